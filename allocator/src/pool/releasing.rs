//! Asynchronous release: the pages of a free block go back to the device once the work that
//! its stream queued before the release has completed, which the pool learns by polling an
//! event, never by waiting.
//!
//! A block is freed in stream order: kernels queued on its stream before the free may still
//! use its memory, so its pages cannot be unmapped at once. [`Core::release_pages`] cuts the
//! whole chunks out of a free block into a *releasing* block, records an event on the block's
//! stream and polls it once; every allocation polls again ([`Core::poll_releasing`]), and the
//! pages are unmapped when the event has completed. Work of other streams needs no event
//! here: a block used by other streams reached its pool only after their events completed
//! (`events`). The synchronizing paths ([`Core::finish_releasing`]: `empty_cache`, the
//! out-of-memory ladder when a growth does not fit, dropping the pool) wait for the events not
//! yet completed instead; each wait counts in [`crate::stats::Stats::device_waits`] (a pool
//! dropped while the device refuses the waits unmaps without them: `Core::finish_unwaited`).
//! Nothing else waits: a policy that must bound the bytes on their way back gives back no
//! more while too many are (the `default` policy's budget). A policy about to map pages for a
//! request may first take back a releasing block of the request's own stream
//! ([`Core::reclaim_releasing`]): stream order puts the queued work before the new use, so
//! neither a wait nor a map is needed. `Core::releasing` is in the order the blocks' events were
//! recorded.
//!
//! A growth may take the pages of a releasing block of its own stream instead (`moving`): the
//! block is *moved* then, its addresses left to unmap once its event completes.
//!
//! Invariants: a releasing block is free (not allocated, no events pending), mapped, in an
//! expandable segment, in no index, covers whole chunks of its segment (or, moved, whole moved
//! ranges), never merges with a neighbour, and appears once in `Core::releasing` with its event;
//! `Core::releasing_bytes` is the sum of the sizes of releasing blocks that are not moved. Its
//! bytes stay reserved (and count against the memory limit) until they are unmapped.

use super::block::{Block, BlockId, NIL};
use super::segment::Range;
use super::Core;
use crate::sizes::PoolKind;
use cudalloc_sys::{Device, DeviceError, EventHandle, StreamId};
use smallvec::SmallVec;

impl<D: Device> Core<D> {
    /// Starts giving back the whole chunks of free block `id` ([`Core::release_pages_in`] over
    /// the whole block).
    pub fn release_pages(&mut self, id: BlockId) -> Result<u64, DeviceError> {
        let Some(b) = self.blocks.get(id) else {
            return Ok(0);
        };
        let (addr, size) = (b.addr, b.size);
        self.release_pages_in(id, addr, size)
    }

    /// Starts giving back the chunks of free block `id` (of an expandable segment, in its free
    /// index) lying entirely inside `lo..lo + len`: they leave the pool now and are unmapped
    /// once the work their stream queued before has completed, at once when it already has
    /// (see the module docs). Returns the bytes on their way back (0 when no whole chunk lies
    /// there, and during a capture: `capture`); they count as reserved until unmapped
    /// ([`Core::releasing_bytes`]). Nothing changes when the event cannot be recorded (the
    /// error is returned), nor for a block that is not such a free block (0: a policy cannot
    /// release a block in use).
    pub fn release_pages_in(&mut self, id: BlockId, lo: u64, len: u64) -> Result<u64, DeviceError> {
        let Some(b) = self.blocks.get(id) else {
            return Ok(0);
        };
        if !b.is_expandable() || !self.free_index(b.pool).contains(b) {
            return Ok(0);
        }
        let (lo, hi) = (lo.max(b.addr), (lo + len).min(b.end()));
        let seg = self.segments[b.segment as usize]
            .as_ref()
            .expect("block of a released segment");
        let whole = (lo < hi && !self.capturing()).then(|| seg.whole_chunks(lo, hi - lo));
        let Some(chunks) = whole.flatten() else {
            return Ok(0);
        };
        let stream = b.stream;
        // An event recorded on a stream under capture (one the pool was not told of) would
        // join the graph and never answer a query: give nothing back then.
        if !matches!(self.device.is_capturing(stream), Ok(false)) {
            return Ok(0);
        }
        let ev = self.take_event()?;
        if let Err(e) = self.device.record_event(ev, stream) {
            self.spare_events.push(ev);
            return Err(e);
        }
        let id = self.carve(id, chunks);
        self.blocks[id].releasing = true;
        self.releasing.push((ev, id));
        self.releasing_bytes += chunks.size;
        self.stats.given_back_bytes += chunks.size;
        self.poll_releasing();
        Ok(chunks.size)
    }

    /// Takes free block `id` out of its index and splits off what lies outside `r` (those parts
    /// stay free); returns the block covering exactly `r`.
    fn carve(&mut self, id: BlockId, r: Range) -> BlockId {
        let removed = self.unindex_free(id);
        debug_assert!(removed, "released block was not indexed");
        let before = r.addr - self.blocks[id].addr;
        if before > 0 {
            self.split_mapped_front(id, before);
        }
        let after = self.blocks[id].size - r.size;
        if after > 0 {
            self.split_mapped_back(id, after);
        }
        id
    }

    /// Takes back the smallest releasing block of `stream` and size class `pool` that `fits`,
    /// before its pages are unmapped: the work its stream queued before the release
    /// comes before any use of the block on that same stream, so it needs no wait. The block is
    /// free again (merged with its free neighbours, in its index); returns it, or `None` when
    /// no such block is releasing. For a policy about to map pages for a request of that
    /// stream while pages of it are still on their way back (the device runs behind).
    pub fn reclaim_releasing(
        &mut self,
        stream: StreamId,
        pool: PoolKind,
        fits: impl Fn(&Block) -> bool,
    ) -> Option<BlockId> {
        let (i, _) = self
            .releasing
            .iter()
            .enumerate()
            .map(|(i, &(_, id))| (i, &self.blocks[id]))
            .filter(|(_, b)| !b.moved && b.stream == stream && b.pool == pool && fits(b))
            .min_by_key(|(_, b)| b.size)?;
        Some(self.take_back(i))
    }

    /// The releasing blocks that are not moved (`moving`), in the order they started releasing
    /// (a policy tells by them which of its releases the device has not caught up with).
    pub fn releasing_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        let unmoved = |&&(_, id): &&(EventHandle, BlockId)| !self.blocks[id].moved;
        self.releasing.iter().filter(unmoved).map(|&(_, id)| id)
    }

    /// Takes back releasing block `id` before its pages are unmapped, as
    /// [`Core::reclaim_releasing`] takes back the block it picks: the block is free again, in
    /// the free index of its own stream (whose queued work comes before any use there); false
    /// when `id` is not releasing, or moved (`moving`: its addresses map pages other blocks
    /// hold).
    pub fn reclaim_releasing_block(&mut self, id: BlockId) -> bool {
        if self.blocks.get(id).is_none_or(|b| b.moved) {
            return false;
        }
        match self.releasing.iter().position(|&(_, r)| r == id) {
            Some(i) => {
                self.take_back(i);
                true
            }
            None => false,
        }
    }

    /// Takes back the releasing block at `i` of `Core::releasing`: free, merged with its free
    /// neighbours and in its index again.
    fn take_back(&mut self, i: usize) -> BlockId {
        let (ev, id) = self.releasing.remove(i);
        debug_assert!(!self.blocks[id].moved, "a moved block is never taken back");
        // The event may not have completed: it is recorded again before its next use.
        self.spare_events.push(ev);
        let b = &mut self.blocks[id];
        b.releasing = false;
        self.releasing_bytes -= b.size;
        self.stats.taken_back_bytes += b.size;
        for side in [self.blocks[id].prev, self.blocks[id].next] {
            self.try_merge(id, side);
        }
        self.insert_free(id);
        id
    }

    /// Bytes of releasing blocks: reserved still, on their way back to the device.
    pub fn releasing_bytes(&self) -> u64 {
        self.releasing_bytes
    }

    /// Unmaps the releasing blocks whose events have completed; never waits. A failure fails
    /// no allocation: an event that cannot be queried is recorded again on the block's stream
    /// (tried again at the next poll), pages whose unmap failed are free again, and a moved
    /// block whose unmap failed stays releasing (tried again at the next poll).
    ///
    /// A block waits while a moved block of its stream that started releasing before it still
    /// does: its pages may be mapped at that block's addresses too, and giving them back first
    /// would count as returned memory the device still holds there. In stream order the moved
    /// block's event completes first anyway; only one recorded again comes later.
    pub(crate) fn poll_releasing(&mut self) {
        let mut moved_ahead: SmallVec<[StreamId; 4]> = SmallVec::new();
        let mut i = 0;
        while i < self.releasing.len() {
            let (ev, id) = self.releasing[i];
            let (moved, stream) = (self.blocks[id].moved, self.blocks[id].stream);
            if !moved && moved_ahead.contains(&stream) {
                i += 1;
                continue;
            }
            let finished = match self.device.query_event(ev) {
                Ok(true) if moved => {
                    let done = self.finish_moved(id).is_ok();
                    if done {
                        self.releasing.remove(i);
                        self.spare_events.push(ev);
                    }
                    done // else tried again at the next poll
                }
                Ok(true) => {
                    self.releasing.remove(i);
                    let _ = self.finish_one(ev, id);
                    true
                }
                Ok(false) => false,
                Err(e) => {
                    self.record_again(ev, id, &e);
                    false
                }
            };
            if !finished {
                if moved {
                    moved_ahead.push(stream);
                }
                i += 1;
            }
        }
    }

    /// Records the event of releasing block `id` again after a query of it failed with
    /// `error` (it may have been recorded into a capture the pool was not told of), unless the
    /// failure came from a capture refusing the call (the event is fine then) or the block's
    /// stream is being captured now (the new record would join the graph too). True when it
    /// was recorded again.
    fn record_again(&mut self, ev: EventHandle, id: BlockId, error: &DeviceError) -> bool {
        self.record_event_again(ev, self.blocks[id].stream, error)
    }

    /// Waits for the events of every releasing block and unmaps them, in the order they started
    /// releasing: for the synchronizing paths only (each wait counted in `device_waits`; no
    /// wait for an event the device reports completed). An event that cannot be waited for is
    /// recorded again and waited for once more (not while the pool is dropped,
    /// `Core::dropping`: its error is returned at once); the error of a second failure is
    /// returned and the block stays releasing. A moved block whose unmap
    /// fails stays (it holds no memory of its own), and so do the later blocks of its stream
    /// (see [`Core::poll_releasing`]); the rest go on, and its error is returned at the end.
    pub(crate) fn finish_releasing(&mut self) -> Result<(), DeviceError> {
        let mut moved_failed: SmallVec<[StreamId; 4]> = SmallVec::new();
        let (mut i, mut error) = (0, None);
        while i < self.releasing.len() {
            let (ev, id) = self.releasing[i];
            let (moved, stream) = (self.blocks[id].moved, self.blocks[id].stream);
            if moved_failed.contains(&stream) {
                i += 1;
                continue;
            }
            self.wait_unless_completed(ev, stream)?;
            if !moved {
                self.releasing.remove(i);
                self.finish_one(ev, id)?;
            } else if let Err(e) = self.finish_moved(id) {
                moved_failed.push(stream);
                error = Some(e);
                i += 1;
            } else {
                self.releasing.remove(i);
                self.spare_events.push(ev);
            }
        }
        error.map_or(Ok(()), Err)
    }

    /// Unmaps every releasing block without waiting for its event: for a pool being dropped
    /// ([`Core::release_all_unwaited`]). A moved block whose unmap fails stays, and so do the
    /// later blocks of its stream (as [`Core::poll_releasing`] keeps them).
    pub(crate) fn finish_unwaited(&mut self) {
        let mut moved_failed: SmallVec<[StreamId; 4]> = SmallVec::new();
        for (ev, id) in std::mem::take(&mut self.releasing) {
            let (moved, stream) = (self.blocks[id].moved, self.blocks[id].stream);
            if moved_failed.contains(&stream) {
                self.releasing.push((ev, id));
            } else if !moved {
                let _ = self.finish_one(ev, id);
            } else if self.finish_moved(id).is_ok() {
                self.spare_events.push(ev);
            } else {
                moved_failed.push(stream);
                self.releasing.push((ev, id));
            }
        }
    }

    /// Unmaps releasing block `id`, whose event `ev` has completed. After a failed driver call,
    /// what was unmapped is accounted for and the rest of the block is free again: taken back
    /// into the cache (`taken_back_bytes`), as if a request had reclaimed it.
    fn finish_one(&mut self, ev: EventHandle, id: BlockId) -> Result<(), DeviceError> {
        self.spare_events.push(ev);
        let b = &mut self.blocks[id];
        b.releasing = false;
        let (addr, size) = (b.addr, b.size);
        self.releasing_bytes -= size;
        self.insert_free(id);
        let reserved = self.reserved();
        let result = self.unmap_part(id, addr, size);
        if result.is_err() {
            let unmapped = reserved - self.reserved();
            self.stats.taken_back_bytes += size - unmapped;
            self.settle_after_failure(addr, size);
        }
        result.map(|_| ())
    }

    /// Merges the free mapped blocks inside `addr..addr + size` left by a failed unmap with
    /// their free neighbours, so that no two free mapped blocks are neighbours.
    fn settle_after_failure(&mut self, addr: u64, size: u64) {
        let mut free: Vec<BlockId> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.overlaps(addr, addr + size) && b.mapped && !b.allocated)
            .filter(|(_, b)| !b.waits() && !b.releasing && b.is_expandable())
            .map(|(id, _)| id)
            .collect();
        free.retain(|&id| {
            self.free_index(self.blocks[id].pool)
                .contains(&self.blocks[id])
        });
        for id in free {
            if self.blocks.get(id).is_none() || !self.unindex_free(id) {
                continue;
            }
            for side in [self.blocks[id].prev, self.blocks[id].next] {
                if side != NIL && !self.blocks[side].releasing {
                    self.try_merge(id, side);
                }
            }
            self.insert_free(id);
        }
    }
}
