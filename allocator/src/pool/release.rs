//! Giving memory back: single fixed segments, and everything cached (`empty_cache`, the last
//! rung of the out-of-memory ladder). Which cached blocks go back before that is the policies'
//! (`policy::torch`: oversize blocks, age-based garbage collection).

use super::block::BlockId;
use super::Core;
use super::Observer;
use crate::sizes::PoolKind;
use cudalloc_sys::{Device, DeviceError};

impl<D: Device> Core<D> {
    /// Frees block `id` to the device if it is a whole fixed segment that may go: unsplit,
    /// free, in its pool's free index, waiting for no stream. Returns whether it went; `Ok(false)`
    /// changes nothing, so a policy cannot release a block in use or one other streams may still
    /// read. The block leaves the index before the device call and goes back if the call fails.
    pub fn release_block(&mut self, id: BlockId) -> Result<bool, DeviceError> {
        let Some(b) = self.blocks.get(id) else {
            return Ok(false);
        };
        if b.is_split() || b.allocated || b.is_expandable() || b.event_count > 0 {
            return Ok(false);
        }
        if !b.stream_uses.is_empty() {
            return Ok(false);
        }
        let index = match b.pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        };
        if !index.remove(b) {
            return Ok(false);
        }
        self.hooks.unmapping(b.addr, b.size);
        if let Err(e) = self.device.free(b.addr, b.size) {
            self.hooks.mapped(b.addr, b.size);
            index.insert(id, b);
            return Err(e);
        }
        let b = self.blocks.remove(id);
        self.sub_reserved(b.size);
        self.stats.segment.decrease(b.pool, 1);
        self.reserved_shrank(b.pool, b.size);
        if b.size >= self.cfg.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        self.stats.num_device_free += 1;
        self.stats.calls.frees += 1;
        Ok(true)
    }

    /// Returns the blocks whose stream events have completed to the pool (nothing waits) and
    /// gives back the pages whose release has completed; then the bytes this pool holds cached
    /// (reserved and not allocated). Nothing is queried during a capture (a query could
    /// invalidate it) or while the pool sleeps: then only the count.
    pub(crate) fn settle_idle<P: Observer>(&mut self, policy: &mut P) -> Result<u64, DeviceError> {
        if !self.capturing() && !self.asleep() {
            if self.deferred_blocks() > 0 {
                self.record_owed(policy);
            }
            self.process_events(policy)?;
            self.poll_releasing();
        }
        let allocated = self.stats.allocated_bytes.0[0].current.max(0) as u64;
        Ok(self.reserved.saturating_sub(allocated))
    }

    /// Starts giving back, without waiting, the cached memory of a pool whose stream has gone
    /// idle: the whole chunks of every free block of an expandable segment (`releasing`:
    /// unmapped once their stream's work before them has completed, at a later poll; call
    /// [`Core::settle_idle`] first). Returns the bytes started back. Nothing during a capture
    /// or while the pool sleeps.
    pub(crate) fn give_back_idle(&mut self) -> Result<u64, DeviceError> {
        if self.capturing() || self.asleep() {
            return Ok(0);
        }
        let page = self.device.granularity()?;
        let free: Vec<_> = self
            .small
            .all_free_at_least(page)
            .chain(self.large.all_free_at_least(page))
            .filter(|&id| self.blocks[id].is_expandable())
            .collect();
        let mut going = 0;
        for id in free {
            going += self.release_pages(id)?;
        }
        Ok(going)
    }

    /// Releases every cached block that can go: unsplit fixed segments, and the fully free
    /// pages of expandable segments. Waits for pending stream events and releasing blocks
    /// first, and for the device before it unmaps free pages (work queued on them may still
    /// run; no wait when no free block holds a whole chunk); the caller counts the wait for all
    /// streams ([`Core::count_sync_all_streams`]), each wait counts in `device_waits`. Refused
    /// during a capture (`capture`).
    pub(crate) fn release_all_cached<P: Observer>(
        &mut self,
        policy: &mut P,
    ) -> Result<(), DeviceError> {
        self.refuse_in_capture("synchronize_device")?;
        if self.deferred_blocks() > 0 {
            self.record_owed(policy); // their events, so that the wait below frees them
        }
        self.synchronize_and_free_events(policy)?;
        self.finish_releasing()?;
        if self.holds_whole_free_chunk() {
            self.stats.device_waits += 1;
            self.device.synchronize_device()?;
        }
        let large = self.release_blocks(policy, PoolKind::Large);
        let small = self.release_blocks(policy, PoolKind::Small);
        large.and(small)
    }

    /// Gives back everything cached without waiting for events: for a pool being dropped during
    /// a capture (one it was told of, or one of a stream of it: a wait would invalidate it), or
    /// after [`Core::release_all_cached`] failed and the device was waited for (or refused the
    /// wait). Blocks waiting for events or deferred are free now and releasing ones
    /// unmapped; then every cached block goes back. Work queued on them may still run when no
    /// wait came first, as it may on the live allocations that die with the pool.
    pub(crate) fn release_all_unwaited<P: Observer>(
        &mut self,
        policy: &mut P,
    ) -> Result<(), DeviceError> {
        self.forget_deferred(policy);
        self.forget_pending(policy);
        self.finish_unwaited();
        let large = self.release_blocks(policy, PoolKind::Large);
        let small = self.release_blocks(policy, PoolKind::Small);
        large.and(small)
    }

    /// True when a free block of an expandable segment holds a whole chunk, which
    /// [`Core::release_blocks`] would unmap. A free block inside chunks that live blocks also
    /// use gives nothing back, so the device is not waited for on its account (under a cap the
    /// ladder's rung of every cached block met this on each growth that only re-paging could
    /// serve: a wait for nothing before the re-paging's own).
    fn holds_whole_free_chunk(&self) -> bool {
        [&self.small, &self.large].iter().any(|idx| {
            idx.all_free().any(|id| {
                let b = &self.blocks[id];
                b.is_expandable()
                    && self.segments[b.segment as usize]
                        .as_ref()
                        .is_some_and(|s| s.whole_chunks(b.addr, b.size).is_some())
            })
        })
    }

    /// Counts one wait for all streams (PyTorch's `num_sync_all_streams`).
    pub(crate) fn count_sync_all_streams(&mut self) {
        self.stats.num_sync_all_streams += 1;
    }

    /// Gives back every free block of `pool` that can go (`release_all_cached`'s last step). A
    /// block whose release the device refuses stays cached and the others still go: the first
    /// error is returned, unless a later try of the same call (a segment's release retries its
    /// pages) left nothing behind.
    fn release_blocks<P: Observer>(
        &mut self,
        policy: &mut P,
        pool: PoolKind,
    ) -> Result<(), DeviceError> {
        let mut first = Ok(());
        let ids: Vec<BlockId> = self.index(pool).all_free().collect();
        let mut to_unmap = Vec::new();
        for id in ids {
            let b = &self.blocks[id];
            if b.is_expandable() {
                to_unmap.push(id);
            } else if !b.is_split() {
                keep_first(&mut first, self.release_block(id).map(drop));
            }
        }
        for id in to_unmap {
            match self.unmap_block(id) {
                Ok(id) => {
                    let b = &self.blocks[id];
                    if !b.is_split() && !b.mapped {
                        keep_first(&mut first, self.release_expandable_segment(policy, id));
                    }
                }
                Err(e) => keep_first(&mut first, Err(e)),
            }
        }
        // Segments left entirely unmapped earlier (a growth that failed after reserving).
        let unmapped: Vec<BlockId> = self.index(pool).all_unmapped().collect();
        let empty: Vec<BlockId> = unmapped
            .into_iter()
            .filter(|&id| !self.blocks[id].is_split())
            .collect();
        for id in empty {
            keep_first(&mut first, self.release_expandable_segment(policy, id));
        }
        if first.is_err() && !self.holds_what_a_release_gives_back(pool) {
            return Ok(());
        }
        first
    }

    /// True when `pool` still holds what [`Core::release_blocks`] gives back (a free fixed
    /// segment, free mapped pages, an unmapped segment), or the device holds stray pages.
    fn holds_what_a_release_gives_back(&self, pool: PoolKind) -> bool {
        let idx = match pool {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        };
        self.strays > 0
            || idx.all_free().any(|id| {
                let b = &self.blocks[id];
                b.is_expandable() || !b.is_split()
            })
            || idx.all_unmapped().any(|id| !self.blocks[id].is_split())
    }
}

/// Keeps the first error of a sequence of releases in `first`.
fn keep_first(first: &mut Result<(), DeviceError>, r: Result<(), DeviceError>) {
    if let (Err(e), true) = (r, first.is_ok()) {
        *first = Err(e);
    }
}
