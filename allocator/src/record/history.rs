//! An in-memory history: the latest events a [`super::Recorder`] made, kept in a ring of at
//! most `max` events (the oldest go first), as PyTorch keeps its allocator's trace for
//! `torch.cuda.memory._record_memory_history` and `_dump_snapshot`.
//!
//! Invariants: `len() <= max()`, events are in the order they were put, and a `max` of 0
//! keeps nothing.

use super::{Event, EventSink};
use std::collections::VecDeque;
use std::io;

/// The latest events, at most `max` of them.
#[derive(Debug, Default)]
pub struct History {
    events: VecDeque<Event>,
    max: usize,
}

impl History {
    /// An empty history that keeps the latest `max` events.
    pub const fn new(max: usize) -> Self {
        History {
            events: VecDeque::new(),
            max,
        }
    }

    /// Keeps the latest `max` events from now on, dropping the oldest beyond it now.
    pub fn set_max(&mut self, max: usize) {
        self.max = max;
        self.trim();
    }

    /// The most events kept.
    pub fn max(&self) -> usize {
        self.max
    }

    /// The number of events kept.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// True when no event is kept.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Drops every event.
    pub fn clear(&mut self) {
        self.events.clear();
    }

    /// The events, oldest first.
    pub fn events(&self) -> impl ExactSizeIterator<Item = &Event> {
        self.events.iter()
    }

    /// Adds `e` as the newest event.
    pub fn push(&mut self, e: Event) {
        self.events.push_back(e);
        self.trim();
    }

    fn trim(&mut self) {
        while self.events.len() > self.max {
            self.events.pop_front();
        }
    }
}

impl EventSink for History {
    fn put(&mut self, e: &Event) -> io::Result<()> {
        self.push(*e);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Action, Recorder};
    use crate::{CachingAllocator, Config};
    use cudalloc_sys::{SimDevice, StreamId};

    fn event(addr: u64) -> Event {
        Event {
            action: Action::Alloc,
            addr,
            size: 1,
            stream: 0,
            time_us: 0,
        }
    }

    #[test]
    fn keeps_the_latest_max_events_in_order() {
        let mut h = History::new(3);
        for a in 0..5 {
            h.push(event(a));
        }
        let addrs: Vec<u64> = h.events().map(|e| e.addr).collect();
        assert_eq!(addrs, [2, 3, 4]);
        h.set_max(1);
        assert_eq!(h.events().map(|e| e.addr).collect::<Vec<_>>(), [4]);
        h.set_max(0);
        h.push(event(9));
        assert!(h.is_empty());
    }

    #[test]
    fn a_recorder_fills_it_with_the_calls() {
        let alloc = CachingAllocator::new(SimDevice::with_capacity(1 << 30), Config::default());
        let mut rec = Recorder::to_sink(History::new(100));
        let s = StreamId(3);
        let r = alloc.allocate(1000, s);
        rec.allocated(&r, 1000, s);
        let a = r.unwrap();
        let ptr = a.ptr();
        alloc.free(a).unwrap();
        rec.freed(ptr);
        let h = rec.into_sink().unwrap();
        let got: Vec<(Action, u64, u64)> =
            h.events().map(|e| (e.action, e.addr, e.stream)).collect();
        assert_eq!(
            got,
            [
                (Action::Alloc, ptr, 3),
                (Action::FreeRequested, ptr, 3),
                (Action::FreeCompleted, ptr, 3)
            ]
        );
    }
}
