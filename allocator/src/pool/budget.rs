//! The `default` policy: expandable segments with device-granularity pages mapped in batches,
//! and a fragmentation budget that bounds cached memory.
//!
//! Growth works like PyTorch's expandable segments (reserved ranges per stream and pool, the
//! lowest-addressed run of free and unmapped blocks that fits) with three differences: a range
//! is an eighth of the device's memory in the large pool and a 64th in the small pool (or the
//! request, when larger) rather than 1.125 times it, and a stream that fills one gets another,
//! so address space lasts for thousands of streams instead of about 400; pages are
//! the device's granularity (2 MiB on the H200) in both pools, and a growth maps its pages in
//! chunks of up to `max_chunk_mb` (40 MiB by default), one map operation each, aligned to
//! multiples of that size inside the segment. Larger chunks mean fewer driver calls; smaller
//! ones mean that a free range in the middle of a segment more often covers whole chunks, which
//! can then be unmapped: `max_chunk_mb` is the knob that trades memory against driver calls.
//!
//! Shrinking is driven by the budget: before mapping `n` more bytes, the pool makes sure that
//! `reserved + n <= (1 + fragmentation_budget) * max(peak requested bytes, requested bytes after
//! this allocation, the peak a layout plan expects)`, unmapping cached chunks when it would not
//! hold: the smallest free block at least as large as the excess first, then the largest
//! first (giving back the largest block for a small excess could unmap hundreds of MiB that a
//! later growth maps again). The last term counts while a plan places an episode (from the
//! first allocation after its first that matches the plan on, or from its first for a split
//! footprint, while any of its allocations is live; not under a memory cap): the live
//! bytes when the episode started plus the plan's live peak at the episode's scale, so that a
//! batch larger than any before does not give back, on its way up, pages it will use again
//! before it ends.
//! Cached memory below the budget is kept, so a loop that frees and allocates again does not
//! unmap and map in turn. One exception: the cached pages of the footprint a layout plan places
//! episodes in (`plan`; two ranges after a split, `footprint`) are given back only once the
//! pool would pass twice the budget, so a batch that follows the plan finds the pages of the
//! last one still mapped. A free block holding a piece of a split footprint may give back the
//! rest of its pages before that.
//!
//! While the job has freed no block (it is loading its weights; with `CachingAllocator`, a
//! free into any shard or thread cache counts), a large-pool growth maps one page more than
//! it needs, so the next tensor often fits without a driver call; the ceiling above may then
//! be passed by that page, per pool. Not under a memory cap. The page shares a chunk with the
//! tensor before it, so the last one stays mapped (and unusable by other pools) until that
//! tensor is freed; a growth whose page ahead or slack does not fit on the device maps only
//! what it needs (`map_growth`).

use super::block::BlockId;
use super::{Pool, Request};
use crate::sizes::PoolKind;
use crate::sync::Ordering;
use cudalloc_sys::{Device, DeviceError};

impl<D: Device> Pool<D> {
    /// Gets memory for a request under the `default` policy; `Ok(None)` is out of memory.
    pub(crate) fn budget_allocate(
        &mut self,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        let page = self.device.granularity()?;
        let need = req.size.div_ceil(page) * page;
        let room = self.budget_room(req.size, need, None)?;
        self.budget_map(req, page, room)
    }

    /// Makes the budget hold before `need` bytes are mapped for a request of `size` bytes,
    /// unmapping cached chunks when it would not (never those overlapping `keep`, the bytes
    /// about to be used); returns the bytes that may be mapped beyond `need` (the room for
    /// slack).
    pub(crate) fn budget_room(
        &mut self,
        size: u64,
        need: u64,
        keep: Option<(u64, u64)>,
    ) -> Result<u64, DeviceError> {
        let live_after = self.stats.requested_bytes.0[0].current as u64 + size;
        // An episode placed by a plan will reach its planned peak: count it as reached, so that
        // the pages it is about to need are not given back on its way up.
        let expected = if self.limit.is_none() {
            self.plans.expected_peak()
        } else {
            0
        };
        let base = self.peak_requested.max(live_after).max(expected);
        let ceiling = ((1.0 + self.cfg.fragmentation_budget) * base as f64) as u64;
        let mut excess = (self.reserved + need).saturating_sub(ceiling);
        if let Some(l) = self.limit {
            excess = excess.max((self.total_reserved() + need).saturating_sub(l));
        }
        if excess > 0 {
            self.release_free_chunks(excess, false, keep)?;
            // The plan's footprint keeps its cached pages (the next episode will need them)
            // until the pool is past twice the budget; then they go too.
            let hard = ((1.0 + 2.0 * self.cfg.fragmentation_budget) * base as f64) as u64;
            let over = (self.reserved + need).saturating_sub(hard);
            if over > 0 && self.plans.protected().is_some() {
                self.release_free_chunks(over, true, keep)?;
            }
        }
        let mut room = ceiling.saturating_sub(self.reserved + need);
        if let Some(l) = self.limit {
            room = room.min(l.saturating_sub(self.total_reserved() + need));
        }
        Ok(room)
    }

    /// `want` bytes from the start of unmapped block `id`, extended to the end of the chunk
    /// window they end in when the extension fits in `room`: the chunk is then mapped whole
    /// (no extra driver call), and the next growth finds it already mapped.
    fn with_slack(&self, id: BlockId, want: u64, window: u64, room: u64) -> u64 {
        let b = &self.blocks[id];
        let seg = self.segments[b.segment as usize]
            .as_ref()
            .expect("live segment");
        let end = b.addr + want;
        let window_end = seg.va + (end - seg.va).div_ceil(window) * window;
        let extended = (window_end - b.addr).min(b.size);
        if extended - want <= room {
            extended
        } else {
            want
        }
    }

    /// Finds room and maps the missing pages as one chunk per unmapped block touched.
    fn budget_map(
        &mut self,
        req: &Request,
        page: u64,
        room: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        let Some(mut c) = self.find_budget_block(req, page)? else {
            return Ok(None);
        };
        let window = self.chunk_limit(page);
        let ahead = self.page_ahead(req, page);
        if !self.blocks[c].mapped {
            let want = self.blocks[c].size.min(req.size);
            let extended = self
                .with_slack(c, want, window, room)
                .max(self.ahead(c, want, ahead));
            match self.map_growth(c, want, extended, page, window)? {
                Some(id) => c = id,
                None => return Ok(None),
            }
        }
        while self.blocks[c].size < req.size {
            let next = self.blocks[c].next;
            let want = (req.size - self.blocks[c].size).min(self.blocks[next].size);
            let extended = self
                .with_slack(next, want, window, room)
                .max(self.ahead(next, want, ahead));
            match self.map_growth(next, want, extended, page, window)? {
                Some(id) => c = id,
                None => return Ok(None),
            }
        }
        let removed = self.unindex_free(c);
        debug_assert!(removed);
        Ok(Some(c))
    }

    /// Maps the first `extended` bytes of unmapped block `id`, or only the `want` it needs when
    /// the device has no room for more: slack and the page ahead are a saving of driver calls,
    /// never a reason to fail. `Ok(None)`: out of memory even for `want`. Near a full device
    /// this costs calls: the chunks of `extended` mapped before the one that failed are
    /// unmapped (after a device synchronization) and mapped again for `want` (a review: 5 maps,
    /// 2 unmaps and a sync for a 100 MiB growth into the last 100 MiB, where 3 maps would do).
    fn map_growth(
        &mut self,
        id: BlockId,
        want: u64,
        extended: u64,
        page: u64,
        window: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        for size in [extended, want] {
            if self.over_limit(size.div_ceil(page) * page) {
                continue;
            }
            if let Some(mapped) = self.map_block(id, size, window)? {
                return Ok(Some(mapped));
            }
            if size == want {
                break;
            }
        }
        Ok(None)
    }

    /// Bytes to map beyond what a large-pool growth needs while the job is loading (no block
    /// freed: `Pool::loading`): one page. A job that has not freed anything yet is loading
    /// what it keeps (weights, as a rule), one tensor after another; with the page ahead, the
    /// next tensor often fits in what the last growth mapped, which saves a driver call, and
    /// what is left mapped when loading ends is at most a page per pool. None under a memory
    /// cap, where every page is the owner's, and none in the small pool, whose pages hold many
    /// small blocks anyway.
    fn page_ahead(&self, req: &Request, page: u64) -> u64 {
        let loading = self.loading.load(Ordering::Relaxed) && self.limit.is_none();
        if loading && req.pool == PoolKind::Large {
            page
        } else {
            0
        }
    }

    /// `want` bytes of unmapped block `id` and `ahead` more, as far as the block goes.
    fn ahead(&self, id: BlockId, want: u64, ahead: u64) -> u64 {
        (want + ahead).min(self.blocks[id].size)
    }

    fn find_budget_block(
        &mut self,
        req: &Request,
        page: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        if let Some(c) = self.room_in_ranges(req.stream, req.pool, req.size) {
            return Ok(Some(c));
        }
        let (_, total) = self.device.mem_info()?;
        if req.size > total {
            // More than the device holds: out of memory, whatever the address space.
            return Ok(None);
        }
        let range = match req.pool {
            PoolKind::Small => total / 64,
            PoolKind::Large => total / 8,
        };
        self.new_segment(req.stream, req.pool, page, range.max(req.size))
    }

    /// The largest chunk to map now: `max_chunk_mb`, or single pages once a memory limit is set
    /// (a capped pool needs every fully free page to be releasable, and its owner asked for
    /// memory first; without a cap, fewer driver calls matter more).
    fn chunk_limit(&self, page: u64) -> u64 {
        if self.limit.is_some() {
            page
        } else {
            // At least a page: a `Config` built in code (not parsed) may hold any value.
            self.cfg.max_chunk.max(page)
        }
    }

    /// True when free block `id` lies in the footprint the plan places episodes in (left alone
    /// so that the next episode finds its pages mapped; not under a memory cap, where plans are
    /// off).
    fn in_footprint(&self, id: BlockId) -> bool {
        let b = &self.blocks[id];
        self.limit.is_none()
            && self
                .plans
                .protected()
                .is_some_and(|k| k.overlaps(b.segment, b.addr, b.end()))
    }

    /// The kept footprint when it has two ranges and free block `id` overlaps one: the block
    /// then holds a piece of a split footprint (or the range an episode left for the other
    /// piece) and may have free pages beside it that belong to no kept range (the rest of the
    /// free block the piece was placed in), which can be given back alone.
    fn split_footprint_in(&self, id: BlockId) -> Option<super::Kept> {
        let k = self.plans.protected().filter(|k| k.is_split())?;
        let b = &self.blocks[id];
        (self.limit.is_none() && k.overlaps(b.segment, b.addr, b.end())).then_some(k)
    }

    /// Unmaps cached chunks until `bytes` are released or none is left: first the smallest free
    /// block of at least `bytes` ([`best_fit_first`]), then the largest first; the plan's
    /// footprint only when `footprint_too` (a block overlapping a split footprint gives back
    /// the largest part of it outside the footprint), and nothing overlapping `keep`.
    pub(crate) fn release_free_chunks(
        &mut self,
        bytes: u64,
        footprint_too: bool,
        keep: Option<(u64, u64)>,
    ) -> Result<u64, DeviceError> {
        // A block smaller than a page holds no whole chunk.
        let page = self.device.granularity()?;
        let mut free: Vec<(u64, BlockId)> = self
            .small
            .all_free_at_least(page)
            .chain(self.large.all_free_at_least(page))
            .filter(|&id| {
                let b = &self.blocks[id];
                let kept = keep.is_some_and(|(lo, hi)| b.overlaps(lo, hi));
                let spared = !footprint_too
                    && self.in_footprint(id)
                    && self.split_footprint_in(id).is_none();
                b.is_expandable() && !kept && !spared
            })
            .map(|id| (self.blocks[id].size, id))
            .collect();
        free.sort_unstable_by(|a, b| b.cmp(a));
        best_fit_first(&mut free, bytes);
        let mut released = 0;
        for (_, id) in free {
            if released >= bytes {
                break;
            }
            if self.blocks.get(id).is_none_or(|b| !b.mapped || b.allocated) {
                continue;
            }
            let before = self.reserved;
            match self.split_footprint_in(id).filter(|_| !footprint_too) {
                Some(k) => {
                    let b = &self.blocks[id];
                    if let Some((lo, hi)) = k.largest_outside(b.addr, b.end()) {
                        self.unmap_part(id, lo, hi - lo)?;
                    }
                }
                None => {
                    self.unmap_block(id)?;
                }
            }
            released += before - self.reserved;
        }
        Ok(released)
    }
}

/// Moves the smallest block of `free` (sorted largest first) of at least `bytes` to the front,
/// so the budget gives back one block that is enough rather than the largest (which may be
/// hundreds of MiB that a later growth maps again, chunk by chunk); when none is large enough,
/// the order stays largest first. By size, not by the chunks a block could give back: a
/// block whose chunks are partly shared with live blocks gives back less, and the largest
/// then gives back the rest (ranking by what could be given back was measured: fewer calls,
/// more memory; `docs/policy-experiments.md`).
fn best_fit_first(free: &mut Vec<(u64, BlockId)>, bytes: u64) {
    if let Some(i) = free.iter().rposition(|&(size, _)| size >= bytes) {
        let fit = free.remove(i);
        free.insert(0, fit);
    }
}
