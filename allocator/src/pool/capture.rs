//! Capture awareness: while the caller says a CUDA graph capture is underway
//! ([`Core::begin_capture`]), the pool makes no device call that a capture forbids (see
//! `cudalloc_sys::CaptureMode::forbids`): no `malloc` or `free`, no event query and no wait.
//!
//! During a capture:
//! - an allocation neither polls stream events nor releasing blocks (`events`, `releasing`);
//! - growth maps pages (expandable policies: legal during a capture); a growth that needs
//!   `malloc` (fixed segments, the `torch` policy) fails with [`AllocError::DuringCapture`],
//!   which says how to reserve ahead, unless every capture underway is in relaxed mode
//!   (`CaptureMode::Relaxed`, as PyTorch's allocator uses for its own `cudaMalloc`);
//! - the out-of-memory ladder stops after growth: its other rungs free segments or wait;
//! - no pages are given back ([`Core::release_pages_in`] gives back nothing) and `empty_cache`
//!   is refused;
//! - a freed block that other streams used (`record_stream`) is *deferred*: its events are
//!   recorded when the last capture ends ([`Core::end_capture`]), as PyTorch does; until then
//!   it waits like a block with events pending. When they cannot be recorded then, the capture
//!   ends all the same and the blocks stay deferred, *owed*: the next allocation outside a
//!   capture records them (`Core::record_owed`).
//!
//! The driver is asked too ([`Core::used_in_capture`]): a block freed while one of the streams
//! that used it is being captured is deferred even when the caller has not told of that
//! capture (yet: PyTorch's extension tells at the capture's first allocation, and a free may
//! come before it), and an owed block's events wait while one of its streams is captured. No
//! query answers an event recorded into a capture (polling one, the pool records it again
//! once the stream is no longer captured: `events`). A stream whose status the driver does
//! not give counts as not captured: the event's record then says what is wrong with it (a
//! block kept deferred on that ground could stay so for good, asking again at every
//! allocation).
//!
//! A pool dropped during a capture it was told of waits for nothing (one it was not told of
//! it does not see: the drop asks nothing of streams, which may be destroyed by then, and
//! outside a told capture waits for the whole device before deferred blocks go back):
//! its deferred blocks, those waiting for events and its releasing pages go back without their
//! events (`Core::release_all_unwaited`), as its live allocations do, and a pinned host buffer
//! stays allocated. The `free` of fixed segments (`torch`) is refused outside relaxed mode
//! all the same, and invalidates the capture.
//!
//! The caller's word is the rule, for all streams of the pool: in the global capture mode a
//! forbidden call from any thread invalidates the capture, and an event recorded on a stream
//! being captured (in any mode) cannot be queried afterwards, so no event is recorded or
//! queried in any mode. Invariants: `captures` counts the captures begun and not ended and
//! `strict_captures` those of them not in relaxed mode; a deferred block is neither allocated
//! nor indexed, has no events pending and keeps its `stream_uses`; outside a capture the
//! deferred blocks are owed ones.

use super::block::BlockId;
use super::Core;
use super::Observer;
use crate::error::{AllocError, Invariant, InvariantError};
use cudalloc_sys::{CaptureMode, Device, DeviceError};

impl<D: Device> Core<D> {
    /// The caller begins a CUDA graph capture in `mode` that this pool's memory may take part
    /// in.
    pub fn begin_capture(&mut self, mode: CaptureMode) {
        self.captures += 1;
        if mode != CaptureMode::Relaxed {
            self.strict_captures += 1;
        }
    }

    /// The caller ended a capture in `mode` begun with [`Core::begin_capture`]. When it was
    /// the last, the events of blocks freed during the captures are recorded now. An end
    /// without a begin in that mode is refused. A failure to record is returned, but the
    /// capture has ended: the blocks stay deferred until the next allocation records them.
    pub(crate) fn end_capture<P: Observer>(
        &mut self,
        policy: &mut P,
        mode: CaptureMode,
    ) -> Result<(), AllocError> {
        let strict = mode != CaptureMode::Relaxed;
        let underway = if strict {
            self.strict_captures
        } else {
            self.captures - self.strict_captures
        };
        if underway == 0 {
            return Err(AllocError::DuringCapture {
                what: "end_capture",
                requested: 0,
            });
        }
        self.captures -= 1;
        if strict {
            self.strict_captures -= 1;
        }
        if self.captures == 0 {
            self.record_deferred(policy)?;
        }
        Ok(())
    }

    /// The invariants of the module docs about captures.
    pub(crate) fn check_captures(&self) -> Result<(), InvariantError> {
        let broke = |detail: String| Err(InvariantError::new(Invariant::Capture, detail));
        if self.strict_captures > self.captures {
            return broke("more strict captures than captures".into());
        }
        match self.deferred.iter().find(|&&id| {
            let b = &self.blocks[id];
            b.allocated || b.event_count > 0 || b.stream_uses.is_empty()
        }) {
            Some(&id) => broke(format!("deferred block {id} is not waiting")),
            None => Ok(()),
        }
    }

    /// Records the events of blocks whose capture ended without them (see the module docs); a
    /// failure leaves them owed until the next allocation.
    pub(crate) fn record_owed<P: Observer>(&mut self, policy: &mut P) {
        let _ = self.record_deferred(policy);
    }

    /// Records the events of the blocks freed during captures, now that none the caller told
    /// of is underway; a block one of whose streams the driver says is captured stays deferred.
    fn record_deferred<P: Observer>(&mut self, policy: &mut P) -> Result<(), AllocError> {
        let mut captured = Vec::new();
        let mut recorded = Ok(());
        while let Some(id) = self.deferred.pop() {
            if self.used_in_capture(id) {
                captured.push(id);
                continue;
            }
            if let Err(e) = self.insert_events(id) {
                self.deferred.push(id); // still owed
                recorded = Err(e.into());
                break;
            }
            if self.blocks[id].event_count == 0 {
                // No stream left to wait for (cannot happen: a deferred block has uses).
                self.free_block(policy, id);
            }
        }
        self.deferred.extend(captured.into_iter().rev());
        recorded
    }

    /// Whether the driver says a stream that used block `id` (`record_stream`) is being
    /// captured now (see the module docs).
    pub(crate) fn used_in_capture(&self, id: BlockId) -> bool {
        let captured = |s| matches!(self.device.is_capturing(s), Ok(true));
        self.blocks[id].stream_uses.iter().any(|&s| captured(s))
    }

    /// True while a capture the caller told of is underway.
    pub fn capturing(&self) -> bool {
        self.captures > 0
    }

    /// True while a capture not in relaxed mode is underway: `malloc` and `free` are refused.
    pub(crate) fn mallocs_refused(&self) -> bool {
        self.strict_captures > 0
    }

    /// Keeps freed block `id`, which other streams used, out of its pool until the captures
    /// end (see the module docs).
    pub(crate) fn defer_events(&mut self, id: BlockId) {
        self.blocks[id].allocated = false;
        self.deferred.push(id);
    }

    /// Returns every deferred block to its pool without recording its events: for a pool being
    /// dropped without waits ([`Core::release_all_unwaited`]), when a stream that used one may
    /// be being captured (an event there would join the graph).
    pub(crate) fn forget_deferred<P: Observer>(&mut self, policy: &mut P) {
        while let Some(id) = self.deferred.pop() {
            self.blocks[id].stream_uses.clear();
            self.free_block(policy, id);
        }
    }

    /// Ends every capture without recording the deferred blocks' events (a pool being dropped:
    /// their streams may be destroyed); those blocks go back with `forget_deferred`.
    pub(crate) fn forget_captures(&mut self) {
        self.captures = 0;
        self.strict_captures = 0;
    }

    /// Blocks freed during a capture whose events wait for its end.
    pub fn deferred_blocks(&self) -> usize {
        self.deferred.len()
    }

    /// The error for a device call a capture forbids, when one is underway.
    pub(crate) fn refuse_in_capture(&self, call: &'static str) -> Result<(), DeviceError> {
        if self.capturing() {
            return Err(DeviceError::capture_unsupported(call));
        }
        Ok(())
    }
}
