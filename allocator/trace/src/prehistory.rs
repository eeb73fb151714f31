//! The allocations a snapshot's history does not show being made.
//!
//! PyTorch records allocator events from `_record_memory_history()` on, and keeps at most
//! `max_entries` of them (its oldest dropped first). A history that starts after the model was
//! loaded, or whose start was dropped, shows tensors only being freed, or not at all; replayed
//! as they are, their bytes are missing from the live bytes, and their frees are frees of
//! addresses never allocated. The snapshot knows more: the blocks its `segments` hold at the
//! end. So a snapshot's trace starts with one `alloc` (time 0) for each allocation that was
//! live before its history began:
//!
//! - an address whose first `free_completed` comes before any `alloc` of it (size and stream
//!   of that free);
//! - a block the segments show allocated (`active_allocated`, or freed and waiting for stream
//!   events: `active_awaiting_free`, older PyTorch `active_pending_free`) whose address no
//!   `alloc` and no `free_completed` of the history mentions (its requested size, or its size
//!   when the request is not given; the segment's stream).
//!
//! They come in address order. A later free of an address already freed is still a free of
//! nothing (an anomaly), and an allocation the history shows is never added again. The Python
//! converter (`python/cudalloc_trace/convert.py`) adds the same allocations.

use super::{Action, Event};
use std::collections::HashSet;

/// A block a snapshot's segments show held at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    /// First address.
    pub addr: u64,
    /// Requested bytes (or the block's size).
    pub size: u64,
    /// The segment's stream.
    pub stream: u64,
}

/// The `alloc` events to put before `history` (see the module documentation).
pub fn allocations<'a>(history: impl IntoIterator<Item = &'a Event>, held: &[Held]) -> Vec<Event> {
    let mut allocated = HashSet::new();
    let mut mentioned = HashSet::new();
    let mut before = Vec::new();
    for e in history {
        match e.action {
            Action::Alloc => {
                allocated.insert(e.addr);
                mentioned.insert(e.addr);
            }
            Action::FreeCompleted => {
                mentioned.insert(e.addr);
                if allocated.insert(e.addr) {
                    before.push(alloc(e.addr, e.size, e.stream));
                }
            }
            _ => {}
        }
    }
    for h in held {
        if mentioned.insert(h.addr) {
            before.push(alloc(h.addr, h.size, h.stream));
        }
    }
    before.sort_by_key(|e| e.addr);
    before
}

fn alloc(addr: u64, size: u64, stream: u64) -> Event {
    Event {
        action: Action::Alloc,
        addr,
        size,
        stream,
        time_us: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(action: Action, addr: u64, size: u64) -> Event {
        Event {
            action,
            addr,
            size,
            stream: 7,
            time_us: 1,
        }
    }

    #[test]
    fn frees_before_allocs_and_unmentioned_held_blocks_come_first_in_address_order() {
        let history = [
            ev(Action::Alloc, 100, 10),
            ev(Action::FreeCompleted, 300, 30), // allocated before the history
            ev(Action::FreeCompleted, 100, 10),
            ev(Action::FreeCompleted, 100, 10), // a double free stays one
            ev(Action::FreeRequested, 500, 50),
            ev(Action::Alloc, 300, 31), // reused after its first free
        ];
        let held = [
            Held {
                addr: 500,
                size: 50,
                stream: 2,
            }, // only free_requested: still held
            Held {
                addr: 300,
                size: 31,
                stream: 2,
            }, // the history allocated it
            Held {
                addr: 200,
                size: 20,
                stream: 2,
            },
        ];
        let before = allocations(&history, &held);
        let got: Vec<(u64, u64, u64)> = before.iter().map(|e| (e.addr, e.size, e.stream)).collect();
        assert_eq!(got, [(200, 20, 2), (300, 30, 7), (500, 50, 2)]);
        assert!(before
            .iter()
            .all(|e| e.action == Action::Alloc && e.time_us == 0));
    }
}
