//! Giant growths under a memory cap: a large-pool request of at least [`GIANT_MIN_CHUNKS`]
//! chunk windows that finds no cached block it may take gets a virtual range of its own
//! (`giant_ranges` in [`Rules`](super::Rules)).
//!
//! Its pages are mapped as one chunk: one map operation where the shared range would take a
//! chunk per window (eight or more), and one unmap when the budget or the cap gives the block
//! back, where a block in the shared range gives back window by window. A free block of a
//! giant range serves only a giant request that leaves at most one chunk window of it unused,
//! so that the range keeps holding one tensor, and ordinary growth never maps pages in a giant
//! range. A giant range whose pages all went back serves the next giant growth of its stream
//! that fits in it; the others are released then (outside a capture), so the address space held
//! by empty giant ranges never outgrows what the job had mapped in them at once. Ranges are
//! reserved in whole chunk windows, so a range serves later requests up to a window larger
//! than the one that made it; only the request's pages are mapped.
//!
//! Only under a memory cap: there, every byte mapped in a window that a live tensor pins is a
//! byte the cap lacks, and a giant tensor in the shared range is given back and mapped again
//! window by window. Without a cap, ranges of their own cost memory on the bundled traces
//! (`docs/archive.md`, "Giant tensors on ranges of their own"). The ranges made under a cap
//! keep their rules when the cap is lifted.
//!
//! Invariant: `DefaultPolicy::giant` lists the segment index of every giant range the pool
//! holds, and no other (an index leaves it when its segment is released, before it can be
//! reused).

use super::DefaultPolicy;
use crate::policy::torch;
use crate::pool::block::BlockId;
use crate::pool::{Core, Request};
use crate::sizes::PoolKind;
use cudalloc_sys::{Device, DeviceError};

/// A large-pool request of at least this many chunk windows (`max_chunk_mb`; 320 MiB at the
/// default 40 MiB) grows on a range of its own under a memory cap. Measured (replays,
/// `tools/capped_table.py --min-capacity` over the 34 traces, against the policy without
/// giant ranges): see `docs/policies.md`, "Giant ranges".
pub const GIANT_MIN_CHUNKS: u64 = 8;

impl DefaultPolicy {
    /// The smallest giant request, in bytes.
    fn giant_min(&self) -> u64 {
        GIANT_MIN_CHUNKS.saturating_mul(self.cfg.max_chunk)
    }

    /// True when `segment` is a giant range.
    pub(crate) fn is_giant(&self, segment: u32) -> bool {
        self.giant.contains(&segment)
    }

    /// Whether free block `id` may serve `req`: any block outside giant ranges, and a block of
    /// one only for a giant request that leaves at most one chunk window of it unused.
    fn may_take<D: Device>(&self, core: &Core<D>, id: BlockId, req: &Request) -> bool {
        let b = &core.blocks[id];
        let waste = b.size - req.size.min(b.size);
        !self.is_giant(b.segment) || (req.size >= self.giant_min() && waste <= self.cfg.max_chunk)
    }

    /// PyTorch's best fit ([`torch::get_free_block`]) over the blocks `req` may take: a block
    /// of a giant range it may not take is set aside while the search goes on, then put back.
    pub(crate) fn best_fit<D: Device>(&self, core: &mut Core<D>, req: &Request) -> Option<BlockId> {
        if self.giant.is_empty() || req.pool != PoolKind::Large {
            return torch::get_free_block(core, req, true);
        }
        let mut aside = Vec::new();
        let found = loop {
            match torch::get_free_block(core, req, true) {
                Some(id) if !self.may_take(core, id, req) => aside.push(id),
                other => break other,
            }
        };
        for id in aside {
            core.large.insert(id, &core.blocks[id]);
        }
        found
    }

    /// A giant growth for `req` (see the module docs): `Ok(None)` when `req` does not grow on a
    /// range of its own (not giant, no memory cap, the rule off, or the cap leaves no room for
    /// its pages: ordinary growth then has its try), else what the growth gave (`Some(None)`:
    /// the device is out of memory).
    pub(crate) fn giant_grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<Option<BlockId>>, DeviceError> {
        let giant = self.cfg.rules.giant_ranges && req.pool == PoolKind::Large;
        if !giant || core.limit().is_none() || req.size < self.giant_min() {
            return Ok(None);
        }
        let page = core.device.granularity()?;
        let need = req.size.div_ceil(page) * page;
        self.budget_room(core, req, need, None)?;
        if core.over_limit(need) {
            return Ok(None);
        }
        let start = match self.empty_giant_range(core, req, need)? {
            Some(id) => id,
            None => {
                let window = self.cfg.max_chunk.max(page);
                let range = need.div_ceil(window) * window;
                let Some(id) = core.new_segment(req.stream, req.pool, page, range)? else {
                    return Ok(None);
                };
                self.giant.push(core.blocks[id].segment);
                id
            }
        };
        let mapped = core.map_run(start, req.size, |core, id, want| {
            core.map_block(id, want, need)
        })?;
        Ok(Some(mapped))
    }

    /// The smallest giant range of `req`'s stream with no page mapped and room for `need`
    /// bytes, as its one unmapped block; the other empty giant ranges of the stream are
    /// released (not during a capture).
    fn empty_giant_range<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        need: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        let empty: Vec<BlockId> = core
            .large
            .unmapped_of(req.stream.0)
            .filter(|&id| {
                let b = &core.blocks[id];
                self.is_giant(b.segment) && !b.is_split() && core.allocatable(id)
            })
            .collect();
        let chosen = empty
            .iter()
            .copied()
            .filter(|&id| core.blocks[id].size >= need)
            .min_by_key(|&id| core.blocks[id].size);
        if !core.capturing() {
            for &id in empty.iter().filter(|&&id| Some(id) != chosen) {
                core.release_expandable_segment(self, id)?;
            }
        }
        Ok(chosen)
    }
}
