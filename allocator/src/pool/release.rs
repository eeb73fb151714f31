//! Giving memory back: single segments, oversize blocks, everything cached, and PyTorch's
//! age-based garbage collection.

use super::block::BlockId;
use super::{Core, Request};
use crate::policy::Policy;
use crate::sizes::PoolKind;
use cudalloc_sys::{Device, DeviceError};

impl<D: Device> Core<D> {
    /// Frees an unsplit, free, fixed segment (`free` to the device).
    pub(crate) fn release_block(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let b = &self.blocks[id];
        debug_assert!(!b.is_split() && !b.allocated && !b.is_expandable());
        self.device.free(b.addr, b.size)?;
        let b = self.blocks.remove(id);
        let removed = self.index(b.pool).remove(&b);
        debug_assert!(removed);
        self.sub_reserved(b.size);
        self.stats.segment.decrease(b.pool, 1);
        self.reserved_shrank(b.pool, b.size);
        if b.size >= self.cfg.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        self.stats.num_device_free += 1;
        self.stats.calls.frees += 1;
        Ok(())
    }

    /// Releases every cached block that can go: unsplit fixed segments, and the fully free
    /// pages of expandable segments. Waits for pending stream events first (the caller counts
    /// the wait: [`Core::count_sync_all_streams`]).
    pub(crate) fn release_all_cached<P: Policy>(
        &mut self,
        policy: &mut P,
    ) -> Result<(), DeviceError> {
        self.synchronize_and_free_events(policy)?;
        self.release_blocks(policy, PoolKind::Large)?;
        self.release_blocks(policy, PoolKind::Small)
    }

    /// Counts one wait for all streams (PyTorch's `num_sync_all_streams`).
    pub(crate) fn count_sync_all_streams(&mut self) {
        self.stats.num_sync_all_streams += 1;
    }

    fn release_blocks<P: Policy>(
        &mut self,
        policy: &mut P,
        pool: PoolKind,
    ) -> Result<(), DeviceError> {
        let ids: Vec<BlockId> = self.index(pool).all_free().collect();
        let mut to_unmap = Vec::new();
        for id in ids {
            let b = &self.blocks[id];
            if b.is_expandable() {
                to_unmap.push(id);
            } else if !b.is_split() {
                self.release_block(id)?;
            }
        }
        for id in to_unmap {
            let id = self.unmap_block(id)?;
            let b = &self.blocks[id];
            if !b.is_split() && !b.mapped {
                self.release_expandable_segment(policy, id)?;
            }
        }
        // Segments left entirely unmapped earlier (a growth that failed after reserving).
        let unmapped: Vec<BlockId> = self.index(pool).all_unmapped().collect();
        let empty: Vec<BlockId> = unmapped
            .into_iter()
            .filter(|&id| !self.blocks[id].is_split())
            .collect();
        for id in empty {
            self.release_expandable_segment(policy, id)?;
        }
        Ok(())
    }

    /// Releases oversize cached blocks of the request's stream until one request's worth is
    /// freed (PyTorch's `release_available_cached_blocks`). False when that is impossible.
    pub(crate) fn release_available_cached_blocks(
        &mut self,
        req: &Request,
    ) -> Result<bool, DeviceError> {
        let mss = self.cfg.max_split_size;
        if mss == u64::MAX {
            return Ok(false);
        }
        let key = req.size.max(mss);
        let stream = req.stream.0;
        let first = self.index(req.pool).at_least(stream, key).next();
        if let Some((_, id)) = first {
            // Split blocks only exist below `max_split_size` when a `Config` built in code set
            // it under the 20 MiB a parsed one must have: never release one of those.
            if !self.blocks[id].is_expandable() && !self.blocks[id].is_split() {
                self.release_block(id)?;
                return Ok(true);
            }
        }
        let candidates: Vec<(u64, BlockId)> = self.index(req.pool).below(stream, key).collect();
        let mut released = 0;
        for (size, id) in candidates {
            if released >= key || size < mss {
                break;
            }
            if !self.blocks[id].is_expandable() && !self.blocks[id].is_split() {
                self.release_block(id)?;
                released += size;
            }
        }
        Ok(released >= key)
    }

    /// Frees old unsplit large segments once reserved memory passes
    /// `garbage_collection_threshold` of the limit (PyTorch's `garbage_collect_cached_blocks`).
    pub(crate) fn garbage_collect(&mut self) -> Result<(), DeviceError> {
        let Some(limit) = self.limit else {
            return Ok(());
        };
        let threshold = (self.cfg.garbage_collection_threshold * limit as f64) as u64;
        let reserved = self.total_reserved();
        if reserved <= threshold {
            return Ok(());
        }
        let target = reserved - threshold;
        let clock = self.large.searches;
        let age = |p: &Self, id: BlockId| clock - p.blocks[id].gc_base;
        let freeable: Vec<BlockId> = self
            .large
            .all_free()
            .filter(|&id| !self.blocks[id].is_split())
            .collect();
        let mut total_age: u64 = freeable.iter().map(|&id| age(self, id)).sum();
        let mut count = freeable.len() as u64;
        let mut reclaimed = 0;
        let mut freed_one = true;
        while reclaimed < target && freed_one && count > 0 {
            let threshold_age = total_age as f64 / count as f64;
            freed_one = false;
            let ids: Vec<BlockId> = self.large.all_free().collect();
            for id in ids {
                let b = &self.blocks[id];
                if !b.is_split() && !b.is_expandable() && age(self, id) as f64 >= threshold_age {
                    freed_one = true;
                    reclaimed += b.size;
                    total_age -= age(self, id);
                    count -= 1;
                    self.release_block(id)?;
                }
            }
        }
        Ok(())
    }
}
