//! Placing an allocation of an episode where the plan puts it (see [`plan`](super::plan)): the
//! first allocation chooses the footprint ([`footprint`](super::footprint)), each one after it
//! goes to the footprint's base plus its scaled offset when those bytes are free or unmapped;
//! the pages missing there are mapped under the budget and the memory cap.
//!
//! Invariants: a planned place is taken only when every block over it is free or unmapped with
//! nothing pending (never a live block's bytes), and what is mapped for it is what the budget
//! was asked about; anything else falls back to best fit.

use super::footprint::{block_containing, block_of_segment, unmapped_bytes, Footprint};
use super::plan::{matches, Placement};
use super::DefaultPolicy;
use crate::pool::block::{BlockId, NIL};
use crate::pool::{Core, Request};
use cudalloc_sys::{Device, DeviceError};

impl DefaultPolicy {
    /// Where the plan puts allocation `k` of the open episode: a block taken out of the free
    /// index that starts at the planned address, best fit, or (without `may_grow`, when the
    /// planned bytes need new pages) nothing from cached memory.
    pub(crate) fn planned_block<D: Device>(
        &mut self,
        core: &mut Core<D>,
        k: usize,
        req: &Request,
        may_grow: bool,
    ) -> Result<Placement, DeviceError> {
        let Some((from, at)) = self.plan_target(core, k, req) else {
            return Ok(Placement::BestFit);
        };
        if self.is_giant(core.blocks[from].segment) {
            // A footprint is never chosen in a giant range (`footprint`), but the open
            // episode's may lie in a range released since whose index a giant range took.
            return Ok(Placement::BestFit);
        }
        let mut asked = 0;
        let (from, at) = match unmapped_bytes(core, from, at, req.size) {
            None => return Ok(Placement::BestFit),
            Some((holder, 0)) => (holder, at),
            Some(_) if !may_grow => return Ok(Placement::NeedsGrowth),
            Some((_, n)) => {
                // Giving memory back (never these bytes) may change the blocks around the
                // target: find it again.
                self.budget_room(core, req, n, Some((at, at + req.size)))?;
                asked = n;
                match self.plan_target(core, k, req) {
                    Some(t) => t,
                    None => return Ok(Placement::BestFit),
                }
            }
        };
        let before = core.reserved;
        let taken = self.take_at(core, from, at, req.size)?;
        // The pages mapped are those the budget was asked about, at the same address.
        debug_assert!(
            core.reserved.saturating_sub(before) <= asked,
            "mapped {} bytes for a planned allocation, the budget was asked about {asked}",
            core.reserved.saturating_sub(before)
        );
        Ok(match taken {
            Some(id) => Placement::At(id),
            None => Placement::BestFit,
        })
    }

    /// A block to walk from and the address the plan gives allocation `k`; sets the episode's
    /// footprint on its first allocation (once: asked again for that allocation, after the
    /// budget made room for it, it keeps the footprint the budget was asked about) and ends
    /// the plan on a size that does not match.
    fn plan_target<D: Device>(
        &mut self,
        core: &mut Core<D>,
        k: usize,
        req: &Request,
    ) -> Option<(BlockId, u64)> {
        let plan = self.plans.plan.as_ref()?;
        let planned = *plan.lifetimes.get(k)?;
        let offset = plan.offsets[k];
        let (extent, plan_peak) = (plan.extent, plan.live_peak);
        let smaller = self.cfg.rules.smaller_matches;
        let chosen = self.plans.episode.as_ref()?.footprint.is_some();
        if k == 0 && !chosen {
            let scale = req.size as f64 / planned.size as f64;
            let placed = self.choose_footprint(core, req.stream, scale, plan)?;
            let live = core.stats.requested_bytes.0[0].current as u64;
            let f = Footprint {
                scale,
                base: placed.base,
                segment: placed.segment,
                split: placed.split,
                expected: live.saturating_add((plan_peak as f64 * scale) as u64),
            };
            let at = f.address(offset);
            self.remember_footprint(&f, extent);
            self.plans.episode.as_mut()?.footprint = Some(f);
            return Some((placed.from, at));
        }
        let e = self.plans.episode.as_mut()?;
        let f = e.footprint.as_ref()?;
        if k > 0 {
            if !matches(req.size, planned.size, f.scale, smaller) {
                e.footprint = None;
                e.follows = false;
                return None;
            }
            e.confirmed = true;
        }
        let (at, segment) = (f.address(offset), f.segment);
        let from = match e.anchors.last() {
            Some(&a) => a,
            None => block_of_segment(core, req.stream, segment)?,
        };
        Some((from, at))
    }

    /// Maps what `at..at + size` lacks and takes the free block that then starts at `at` out
    /// of the free index. `Ok(None)`: the bytes could not be had (device full, or taken).
    fn take_at<D: Device>(
        &mut self,
        core: &mut Core<D>,
        from: BlockId,
        at: u64,
        size: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        let window = self.cfg.max_chunk;
        let mut from = from;
        loop {
            let Some(id) = block_containing(core, from, at) else {
                return Ok(None);
            };
            let Some(u) = first_unmapped(core, id, at, size) else {
                return Ok(carve(core, id, at, size));
            };
            let seg = core.segments[core.blocks[u].segment as usize]
                .as_ref()
                .expect("live segment");
            let b = &core.blocks[u];
            let lo = seg.page_floor(at.max(b.addr));
            let hi = seg.page_ceil((at + size).min(b.end()));
            let (head, u) = if lo > b.addr {
                core.split_unmapped_tail(u, lo - b.addr);
                (Some(u), core.blocks[u].next)
            } else {
                (None, u)
            };
            // A bare pool's mapping does not refuse a memory limit (`Core::claim`): check it.
            let moving = self.cfg.rules.move_pages;
            let mapped = if super::behind::over_limit(core, moving, u, hi - lo) {
                Ok(None)
            } else {
                super::behind::map_pages(core, moving, u, hi - lo, window)
            };
            if let (Some(head), false) = (head, matches!(mapped, Ok(Some(_)))) {
                // Nothing (or, after a failed rollback, only a part that stays mapped) was
                // mapped: join the split back, so no two unmapped blocks lie side by side and
                // the range can be released whole.
                let next = core.blocks[head].next;
                core.try_merge(head, next);
            }
            match mapped? {
                Some(mapped) => from = mapped,
                None => return Ok(None),
            }
        }
    }
}

/// The first unmapped block among those covering `at..at + size`, from block `id` (which
/// holds `at`) on.
fn first_unmapped<D: Device>(
    core: &Core<D>,
    mut id: BlockId,
    at: u64,
    size: u64,
) -> Option<BlockId> {
    loop {
        let b = &core.blocks[id];
        if !b.mapped {
            return Some(id);
        }
        if b.end() >= at + size || b.next == NIL {
            return None;
        }
        id = b.next;
    }
}

/// Takes free mapped block `id` out of the free index when it holds `at..at + size`,
/// leaving the bytes before `at` free; `None` (nothing changed) when it does not.
fn carve<D: Device>(core: &mut Core<D>, id: BlockId, at: u64, size: u64) -> Option<BlockId> {
    let b = &core.blocks[id];
    if !core.allocatable(id) || !b.mapped || b.addr > at || b.end() < at + size {
        return None;
    }
    if !core.unindex_free(id) {
        return None;
    }
    let front = at - core.blocks[id].addr;
    if front > 0 {
        core.split_mapped_front(id, front);
    }
    Some(id)
}
