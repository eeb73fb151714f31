//! Cross-stream use: a block used on other streams returns to its pool only after an event
//! recorded on each of those streams at free time has completed.
//!
//! Events are pooled: a completed event goes back to `spare_events` and is recorded again later.
//! While tracked, the address of each block whose events all completed is kept for a trace
//! recorder ([`Core::take_completions`]).
//! Invariant: a block with `event_count > 0` is neither allocated to a caller nor indexed, and
//! appears `event_count` times in `pending`.

use super::block::BlockId;
use super::Core;
use super::Observer;
use crate::error::AllocError;
use cudalloc_sys::{Device, DeviceError, EventHandle, StreamId};

impl<D: Device> Core<D> {
    /// Marks an allocation as used on `stream` (PyTorch's `record_stream`).
    pub fn record_stream(
        &mut self,
        block: BlockId,
        ptr: u64,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let b = self
            .blocks
            .get(block)
            .filter(|b| b.allocated && b.addr == ptr && b.event_count == 0)
            .ok_or(AllocError::NotAllocated(ptr))?;
        if b.stream == stream || b.stream_uses.contains(&stream) {
            return Ok(());
        }
        // Its event is recorded at the free, when a stream that cannot take it would keep the
        // block allocated for good: refuse it now.
        self.device.check_stream(stream)?;
        self.blocks[block].stream_uses.push(stream);
        Ok(())
    }

    pub(super) fn take_event(&mut self) -> Result<EventHandle, DeviceError> {
        match self.spare_events.pop() {
            Some(e) => Ok(e),
            None => self.device.create_event(),
        }
    }

    /// Records one event per stream that used the block and marks it freed; it stays out of its
    /// pool until they complete. If an event cannot be recorded, nothing changes (the block stays
    /// allocated and the error is returned), so the block is never reused too early.
    pub(crate) fn insert_events(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let streams = self.blocks[id].stream_uses.clone();
        let mut recorded = Vec::with_capacity(streams.len());
        for &s in &streams {
            let ev = match self.take_event() {
                Ok(ev) => ev,
                Err(e) => {
                    self.spare_events
                        .extend(recorded.iter().map(|r: &(StreamId, EventHandle)| r.1));
                    return Err(e);
                }
            };
            if let Err(e) = self.device.record_event(ev, s) {
                self.spare_events.push(ev);
                self.spare_events.extend(recorded.iter().map(|r| r.1));
                return Err(e);
            }
            recorded.push((s, ev));
        }
        let b = &mut self.blocks[id];
        b.stream_uses.clear();
        b.allocated = false;
        b.event_count = recorded.len() as u32;
        for (s, ev) in recorded {
            self.pending.entry(s).or_default().push_back((ev, id));
        }
        Ok(())
    }

    /// Returns blocks whose events have all completed to their pools. An event that cannot be
    /// queried waits while a capture refused the query or its stream is being captured, and is
    /// otherwise recorded again on its stream (a later point of it: the block only waits
    /// longer); the query's error is returned only when that record fails too, so that an
    /// event recorded into a graph (which no query answers) fails no allocation after it.
    pub(crate) fn process_events<P: Observer>(
        &mut self,
        policy: &mut P,
    ) -> Result<(), DeviceError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let streams: Vec<StreamId> = self.pending.keys().copied().collect();
        for s in streams {
            while let Some(&(ev, id)) = self.pending[&s].front() {
                let done = match self.device.query_event(ev) {
                    Ok(done) => done,
                    Err(e) if e.is_capture_unsupported() => false,
                    Err(_) if matches!(self.device.is_capturing(s), Ok(true)) => false,
                    Err(e) if self.record_event_again(ev, s, &e) => false,
                    Err(e) => return Err(e),
                };
                if !done {
                    break;
                }
                self.pending.get_mut(&s).expect("stream queue").pop_front();
                self.event_done(policy, ev, id);
            }
            if self.pending[&s].is_empty() {
                self.pending.remove(&s);
            }
        }
        Ok(())
    }

    /// Records event `ev` again on `stream` after its query or wait failed with `error`: not
    /// when a capture refused the call (the event is fine then), nor while `stream` is being
    /// captured (the record would join the graph), nor while the pool is being dropped (the
    /// program may have destroyed `stream`: the drop gives the block back without its wait).
    /// True when it was recorded again.
    pub(super) fn record_event_again(
        &self,
        ev: EventHandle,
        stream: StreamId,
        error: &DeviceError,
    ) -> bool {
        !self.dropping
            && !error.is_capture_unsupported()
            && matches!(self.device.is_capturing(stream), Ok(false))
            && self.device.record_event(ev, stream).is_ok()
    }

    fn event_done<P: Observer>(&mut self, policy: &mut P, ev: EventHandle, id: BlockId) {
        self.spare_events.push(ev);
        let b = &mut self.blocks[id];
        b.event_count -= 1;
        if b.event_count == 0 {
            if let Some(c) = &mut self.completions {
                c.push((b.addr, b.stream));
            }
            self.free_block(policy, id);
        }
    }

    /// Starts (or stops) keeping the addresses of frees that waited for events, when each
    /// completes (a trace recorder writes its `free_completed` then); stopping drops those not
    /// taken.
    pub fn track_completions(&mut self, on: bool) {
        match (on, &self.completions) {
            (true, None) => self.completions = Some(Vec::new()),
            (false, _) => self.completions = None,
            (true, Some(_)) => {}
        }
    }

    /// The address and stream of each free that waited for events and completed since the last
    /// call, in the order they completed (none when not tracked: [`Core::track_completions`]).
    pub fn take_completions(&mut self) -> Vec<(u64, StreamId)> {
        self.completions
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Waits for every pending event not yet completed and returns their blocks to the pools
    /// (the caller counts the wait: [`Core::count_sync_all_streams`]): an event the device
    /// reports completed is not waited for, and only a wait counts in `device_waits`; any other
    /// answer to the query (not yet, or an error) leads to the wait.
    pub(crate) fn synchronize_and_free_events<P: Observer>(
        &mut self,
        policy: &mut P,
    ) -> Result<(), DeviceError> {
        while let Some((&s, _)) = self.pending.iter().next() {
            while let Some(&(ev, id)) = self.pending[&s].front() {
                self.wait_unless_completed(ev, s)?;
                self.pending.get_mut(&s).expect("stream queue").pop_front();
                self.event_done(policy, ev, id);
            }
            self.pending.remove(&s);
        }
        Ok(())
    }

    /// Waits for event `ev` of `stream` unless the device reports it completed (any other
    /// answer, an error included, leads to the wait), counted in `device_waits`; recorded again
    /// and waited for once more when the wait fails ([`Core::record_event_again`]).
    pub(super) fn wait_unless_completed(
        &mut self,
        ev: EventHandle,
        stream: StreamId,
    ) -> Result<(), DeviceError> {
        if matches!(self.device.query_event(ev), Ok(true)) {
            return Ok(());
        }
        self.stats.device_waits += 1;
        if let Err(e) = self.device.synchronize_event(ev) {
            if !self.record_event_again(ev, stream, &e) {
                return Err(e);
            }
            self.device.synchronize_event(ev)?;
        }
        Ok(())
    }

    /// Whether all work queued on `stream` so far has completed: an event recorded on it now
    /// and reported completed at once. Never waits; a stream being captured, an error or any
    /// other answer is "not idle".
    pub(crate) fn stream_idle(&mut self, stream: StreamId) -> bool {
        if !matches!(self.device.is_capturing(stream), Ok(false)) {
            return false;
        }
        let Ok(ev) = self.take_event() else {
            return false;
        };
        let idle = self.device.record_event(ev, stream).is_ok()
            && matches!(self.device.query_event(ev), Ok(true));
        self.spare_events.push(ev);
        idle
    }

    /// Returns every block waiting for events to its pool without waiting for them: for a pool
    /// being dropped without waits ([`Core::release_all_unwaited`]).
    pub(crate) fn forget_pending<P: Observer>(&mut self, policy: &mut P) {
        for (_, queue) in std::mem::take(&mut self.pending) {
            for (ev, id) in queue {
                self.event_done(policy, ev, id);
            }
        }
    }

    /// Number of blocks waiting for events.
    pub fn pending_events(&self) -> usize {
        self.pending.values().map(|q| q.len()).sum()
    }

    /// Destroys pooled events (on drop).
    pub(crate) fn destroy_spare_events(&mut self) {
        for ev in self.spare_events.drain(..) {
            let _ = self.device.destroy_event(ev);
        }
    }
}
