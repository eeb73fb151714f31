//! Where a layout plan places an episode: its *footprint*, in one piece or split in two.
//!
//! An episode placed by a plan (`plan`) takes the plan's extent at the episode's scale. The
//! footprint goes, in this order of preference:
//!
//! 1. at the last footprint's base, when the scaled extent is free and mapped there;
//! 2. at the start of the best-fitting free block that holds it (no page to map);
//! 3. at the last footprint's base, when it is free or unmapped there;
//! 4. at the start of the lowest run of free and unmapped blocks that holds it.
//!
//! When that placement needs new pages, the footprint may instead be *split* at a clean cut of
//! the plan (an offset no planned allocation straddles, so that the two sides share no
//! allocation): one side in the largest free block, the other in the lowest run of free and
//! unmapped blocks that holds it. A model converted after loading (`bert_dynamic`: fp32 weights
//! freed once their fp16 copies exist) leaves such a free block, 222 MiB between the weights and
//! a long-lived embedding, that no batch's whole footprint fits in; without a split, every
//! large batch maps its footprint above and the budget unmaps the block, one driver call per
//! chunk it was loaded in. A split is taken only when the side in the free block holds at least
//! half of the footprint ([`SPLIT_MIN_CACHED_SHARE`]) and the split maps at least a quarter of the
//! footprint less than the single placement ([`SPLIT_MIN_SAVED_SHARE`]): a split costs rounding at
//! the cut and leaves the rest of the free block idle (the two constants' docs say what other
//! thresholds measure).
//!
//! The footprints' cached pages are spared by the budget up to twice its bytes (or its ceiling
//! plus a page for a small-pool growth, when that is more: `budget::budget_room`): the last footprint's range, and the other piece of the last split
//! (or, after a split, the previous footprint, while episodes move between its two pieces).
//! The second range stays kept while footprints are placed at the last base or inside it, even in
//! one piece: later splits find the free block still mapped (forgetting it there cost
//! `bert_dynamic` 55 calls), at the price of idle kept pages up to twice the budget. Both are
//! forgotten when their segment is released.
//!
//! A footprint never lies in a giant range (`giant`: a range that holds one tensor): the places above leave them out, and when the smallest free block that holds the
//! footprint is a giant range's, the episode has no footprint and goes by best fit (rather than
//! grow the shared range beside a cached giant block: through `CachingAllocator`, on
//! `side_stream_prefetch3` capped at 1.10x its peak live bytes, that growth left the other
//! stream's shard no room, 929 driver calls and 14 device waits against 357 and none).
//!
//! Invariants: a footprint lies in no giant range; the two pieces of a split footprint lie in
//! one segment, do not overlap, and
//! together hold every planned allocation at its scaled offset (the lower piece the offsets
//! below the cut, the upper piece the rest, each from its own base); [`Kept::ranges`] are
//! address ranges of one segment.

use super::lifetime::Plan;
use super::DefaultPolicy;
use crate::pool::block::{BlockId, NIL};
use crate::pool::Core;
use crate::sizes::{PoolKind, MIN_BLOCK};
use cudalloc_sys::{Device, StreamId};

/// A split's side in a free block holds at least this fraction of the footprint. Lower lets
/// more footprints split (each split costs rounding at the cut and leaves the rest of the free
/// block idle); higher keeps them whole and maps their pages anew. Measured (`rule_table`'s
/// all-on row, reserved/live and calls, geometric means): 0.25 costs the held-out traces
/// (1.0436 / 261.8 against 1.0414 / 260.6), 0.75 costs the tuning set calls (295.4 against
/// 272.9: `bert_dynamic` no longer splits).
pub const SPLIT_MIN_CACHED_SHARE: f64 = 0.5;

/// A split maps at least this fraction of the footprint less than the single placement: the
/// saving a split must bring to pay for its rounding and idle rest. Measured as above: 0.1
/// costs held-out calls (261.1), 0.5 costs the tuning set calls (299.2).
pub const SPLIT_MIN_SAVED_SHARE: f64 = 0.25;

/// Offsets are stretched by this fraction over the scale, so that sizes rounded up after scaling
/// still fit where the plan put them: more stretch leaves more slack between planned blocks
/// (memory), less lets more of them miss their place and fall back to best fit. Measured as
/// above: 1/1024 costs held-out memory (1.0436), 1/128 costs calls on both sets (313.1 tuning,
/// 261.8 held out).
const OFFSET_STRETCH: f64 = 1.0 / 256.0;

/// Where the plan places the open episode: its scale against the plan, and its base address in
/// the stream's range `segment`.
pub(super) struct Footprint {
    pub scale: f64,
    pub base: u64,
    pub segment: u32,
    /// Set when the footprint is split: where the offsets from the cut on go.
    pub split: Option<Split>,
    /// The live bytes the pool will hold at the episode's peak if it follows the plan: those
    /// live when it started, and its own peak at its scale.
    pub expected: u64,
}

/// The second piece of a split footprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Split {
    /// The plan offset the upper piece starts at (a clean cut).
    pub cut: u64,
    /// The address that offset goes to.
    pub upper: u64,
}

impl Footprint {
    /// The address of plan offset `offset`.
    pub fn address(&self, offset: u64) -> u64 {
        match self.split {
            Some(s) if offset >= s.cut => {
                s.upper + stretched(offset, self.scale) - stretched(s.cut, self.scale)
            }
            _ => self.base + stretched(offset, self.scale),
        }
    }
}

/// A placement chosen for a footprint.
pub(super) struct Placed {
    /// A block holding `base`.
    pub from: BlockId,
    pub base: u64,
    pub segment: u32,
    pub split: Option<Split>,
}

/// The cached pages the budget spares for the plan: one range, or two after a split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kept {
    /// The segment both ranges lie in.
    pub segment: u32,
    /// Address ranges; the second is empty (`lo == hi`) unless the footprint was split.
    pub ranges: [(u64, u64); 2],
}

impl Kept {
    /// True when `lo..hi` in `segment` overlaps a kept range.
    pub fn overlaps(&self, segment: u32, lo: u64, hi: u64) -> bool {
        segment == self.segment && self.ranges.iter().any(|&(a, z)| a < z && lo < z && a < hi)
    }

    /// True when two ranges are kept.
    pub fn is_split(&self) -> bool {
        let (a, z) = self.ranges[1];
        a < z
    }

    /// The largest part of `lo..hi` that overlaps no kept range, if any.
    pub fn largest_outside(&self, lo: u64, hi: u64) -> Option<(u64, u64)> {
        let mut edges = vec![lo, hi];
        for &(a, z) in &self.ranges {
            if a < z {
                edges.push(a.clamp(lo, hi));
                edges.push(z.clamp(lo, hi));
            }
        }
        edges.sort_unstable();
        edges
            .windows(2)
            .map(|w| (w[0], w[1]))
            .filter(|&(a, z)| a < z && !self.overlaps(self.segment, a, z))
            .max_by_key(|&(a, z)| z - a)
    }
}

impl DefaultPolicy {
    /// Where the footprint of `plan` goes at `scale` (see the module docs).
    pub(super) fn choose_footprint<D: Device>(
        &self,
        core: &Core<D>,
        stream: StreamId,
        scale: f64,
        plan: &Plan,
    ) -> Option<Placed> {
        let bytes = spanned(plan.extent, scale);
        if self.giant_fits_best(core, stream, bytes) {
            // A cached giant block holds it best: the episode goes by best fit
            // rather than grow the shared range for it (`giant`), even where the last footprint
            // is cached (measured: through `CachingAllocator`, `side_stream_prefetch3` at 1.10x
            // then waits for the device again).
            return None;
        }
        let single = self.single_footprint(core, stream, bytes);
        let single_need = single
            .as_ref()
            .and_then(|p| unmapped_bytes(core, p.from, p.base, bytes))
            .map_or(u64::MAX, |(_, n)| n);
        if single_need > 0 && self.cfg.rules.split_footprints {
            let saves = (SPLIT_MIN_SAVED_SHARE * bytes as f64) as u64;
            if let Some((need, split)) = split_footprint(core, stream, scale, plan, &self.giant) {
                if need.saturating_add(saves) <= single_need {
                    return Some(split);
                }
            }
        }
        single
    }

    /// The footprint in one piece: the first of places 1 to 4 of the module docs that holds
    /// `bytes`.
    fn single_footprint<D: Device>(
        &self,
        core: &Core<D>,
        stream: StreamId,
        bytes: u64,
    ) -> Option<Placed> {
        // Never in a giant range (`giant`): it holds one tensor.
        let fit = core
            .large
            .at_least(stream.0, bytes)
            .map(|(_, id)| id)
            .find(|&id| !self.is_giant(core.blocks[id].segment))
            .filter(|_| self.cfg.rules.footprint_in_free_block);
        let last = self
            .last_footprint(core, stream, bytes)
            .filter(|&(_, _, segment)| !self.is_giant(segment))
            .filter(|_| self.cfg.rules.reuse_last_footprint);
        if let Some((from, base, segment)) = last {
            let cached = unmapped_bytes(core, from, base, bytes).is_some_and(|(_, n)| n == 0);
            if cached || fit.is_none() {
                return Some(Placed {
                    from,
                    base,
                    segment,
                    split: None,
                });
            }
        }
        let id = fit.or_else(|| {
            core.runs_in_ranges(stream, PoolKind::Large)
                .find(|&c| !self.is_giant(core.blocks[c].segment) && core.has_room(c, bytes))
        })?;
        let b = &core.blocks[id];
        b.is_expandable().then_some(Placed {
            from: id,
            base: b.addr,
            segment: b.segment,
            split: None,
        })
    }

    /// True when the smallest free block of `stream` that holds `bytes` lies in a giant range
    /// whose blocks may serve (`giant`: not under a cap with `repage_under_cap` off).
    fn giant_fits_best<D: Device>(&self, core: &Core<D>, stream: StreamId, bytes: u64) -> bool {
        let best = core.large.at_least(stream.0, bytes).next();
        let giant = best.is_some_and(|(_, id)| self.is_giant(core.blocks[id].segment));
        giant && self.giant_blocks_serve(core)
    }

    /// The last footprint, when its first `bytes` are all free or unmapped again.
    fn last_footprint<D: Device>(
        &self,
        core: &Core<D>,
        stream: StreamId,
        bytes: u64,
    ) -> Option<(BlockId, u64, u32)> {
        let (segment, base, _) = self.plans.last?;
        let seg = core.segments.get(segment as usize)?.as_ref()?;
        if seg.stream != stream || base.saturating_add(bytes) > seg.va + seg.size {
            return None;
        }
        let start = block_of_segment(core, stream, segment)?;
        let id = block_containing(core, start, base)?;
        unmapped_bytes(core, id, base, bytes).map(|_| (id, base, segment))
    }

    /// Records the footprint just chosen for a plan spanning `extent`, so that its cached pages
    /// are kept (see the module docs). On the same base as the last one a range keeps the
    /// larger end (its pages stay cached up to the largest episode placed there).
    pub(super) fn remember_footprint(&mut self, f: &Footprint, extent: u64) {
        let Some(s) = f.split else {
            self.remember_base(f.segment, f.base, spanned(extent, f.scale));
            return;
        };
        let (lower, upper) = pieces(extent, s.cut, f.scale);
        self.remember_base(f.segment, f.base, lower);
        let mut end = s.upper + upper;
        if let Some((at, e)) = self.plans.other {
            if at == s.upper {
                end = end.max(e);
            }
        }
        self.plans.other = Some((s.upper, end));
    }

    /// Makes `base` the last footprint's base, `bytes` long. Moving into the other piece of a
    /// split keeps the range left as the other one; moving anywhere else forgets it.
    fn remember_base(&mut self, segment: u32, base: u64, bytes: u64) {
        let mut end = base.saturating_add(bytes);
        match self.plans.last {
            Some((seg, b, e)) if (seg, b) == (segment, base) => end = end.max(e),
            Some((seg, b, e)) => {
                let inside_other = self
                    .plans
                    .other
                    .is_some_and(|(lo, hi)| lo <= base && base < hi);
                self.plans.other = (seg == segment && inside_other).then_some((b, e));
            }
            None => self.plans.other = None,
        }
        self.plans.last = Some((segment, base, end));
    }
}

/// The best split of the footprint, with the bytes of pages it needs mapped: for each
/// clean cut and each side, that side at the start of the largest free block outside the giant
/// ranges `giant` (when it holds at least [`SPLIT_MIN_CACHED_SHARE`] of the footprint) and the
/// other in the lowest run of free and unmapped blocks of the same segment clear of it; the one
/// needing the fewest new pages.
fn split_footprint<D: Device>(
    core: &Core<D>,
    stream: StreamId,
    scale: f64,
    plan: &Plan,
    giant: &[u32],
) -> Option<(u64, Placed)> {
    let (largest, hole) = core
        .large
        .below(stream.0, u64::MAX)
        .find(|&(_, id)| !giant.contains(&core.blocks[id].segment))?;
    let h = &core.blocks[hole];
    if !h.is_expandable() {
        return None;
    }
    let (hole_at, segment) = (h.addr, h.segment);
    let total = spanned(plan.extent, scale);
    let mut best: Option<(u64, Placed)> = None;
    for cut in clean_cuts(plan) {
        let (lower, upper) = pieces(plan.extent, cut, scale);
        for lower_cached in [true, false] {
            let (cached, other) = if lower_cached {
                (lower, upper)
            } else {
                (upper, lower)
            };
            if cached > largest || (cached as f64) < SPLIT_MIN_CACHED_SHARE * total as f64 {
                continue;
            }
            let Some(run) = core.runs_in_ranges(stream, PoolKind::Large).find(|&c| {
                let r = &core.blocks[c];
                let clear = r.addr >= hole_at + cached || r.addr + other <= hole_at;
                r.segment == segment && clear && core.has_room(c, other)
            }) else {
                continue;
            };
            let run_at = core.blocks[run].addr;
            let Some((_, need)) = unmapped_bytes(core, run, run_at, other) else {
                continue;
            };
            if best.as_ref().is_some_and(|b| b.0 <= need) {
                continue;
            }
            let (from, base, upper_at) = if lower_cached {
                (hole, hole_at, run_at)
            } else {
                (run, run_at, hole_at)
            };
            let split = Some(Split {
                cut,
                upper: upper_at,
            });
            let placed = Placed {
                from,
                base,
                segment,
                split,
            };
            best = Some((need, placed));
        }
    }
    best
}

/// The plan's clean cuts: offsets strictly inside its extent that no allocation straddles, in
/// increasing order.
pub fn clean_cuts(plan: &Plan) -> Vec<u64> {
    let mut spans: Vec<(u64, u64)> = plan
        .offsets
        .iter()
        .zip(&plan.lifetimes)
        .map(|(&o, t)| (o, o + t.size))
        .collect();
    spans.sort_unstable();
    let mut cuts = Vec::new();
    let mut reach = 0;
    for (start, end) in spans {
        if start > 0 && start >= reach && start < plan.extent && cuts.last() != Some(&start) {
            cuts.push(start);
        }
        reach = reach.max(end);
    }
    cuts
}

/// Bytes the two pieces of a footprint of a plan spanning `extent` take at `scale` when it is
/// split at plan offset `cut`: the lower from its base, the upper from the cut's address.
fn pieces(extent: u64, cut: u64, scale: f64) -> (u64, u64) {
    let at = stretched(cut, scale);
    (at + MIN_BLOCK, spanned(extent, scale) - at)
}

/// Bytes a footprint of a plan spanning `extent` takes at `scale`.
pub(super) fn spanned(extent: u64, scale: f64) -> u64 {
    stretched(extent, scale).saturating_add(MIN_BLOCK)
}

/// `offset` scaled, stretched and rounded down to 512 bytes.
pub(super) fn stretched(offset: u64, scale: f64) -> u64 {
    ((offset as f64 * scale * (1.0 + OFFSET_STRETCH)) as u64) / MIN_BLOCK * MIN_BLOCK
}

/// Some block of `stream`'s range `segment`: one of its unmapped blocks (a `default` range
/// keeps unmapped space at its end until it is full).
pub(super) fn block_of_segment<D: Device>(
    core: &Core<D>,
    stream: StreamId,
    segment: u32,
) -> Option<BlockId> {
    core.large
        .unmapped_of(stream.0)
        .find(|&id| core.blocks[id].segment == segment)
}

/// The block holding address `at`, walking the segment's blocks from `from`.
pub(super) fn block_containing<D: Device>(
    core: &Core<D>,
    mut id: BlockId,
    at: u64,
) -> Option<BlockId> {
    while id != NIL {
        let b = &core.blocks[id];
        if at < b.addr {
            id = b.prev;
        } else if at >= b.end() {
            id = b.next;
        } else {
            return Some(id);
        }
    }
    None
}

/// The block holding `at` (found from `from`) and the bytes of pages to map so that
/// `at..at + size` is free and mapped, or `None` when part of it is taken (or outside the
/// segment).
pub(super) fn unmapped_bytes<D: Device>(
    core: &Core<D>,
    from: BlockId,
    at: u64,
    size: u64,
) -> Option<(BlockId, u64)> {
    let holder = block_containing(core, from, at)?;
    let mut id = holder;
    let seg = core.segments[core.blocks[id].segment as usize].as_ref()?;
    let mut need = 0;
    loop {
        if !core.allocatable(id) {
            return None;
        }
        let b = &core.blocks[id];
        if !b.mapped {
            let lo = seg.page_floor(at.max(b.addr));
            let hi = seg.page_ceil((at + size).min(b.end()));
            need += hi - lo;
        }
        if b.end() >= at + size {
            return Some((holder, need));
        }
        id = b.next;
        if id == NIL {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::default::plan::Lifetime;

    fn plan(spans: &[(u64, u64)], extent: u64) -> Plan {
        let t = |size| Lifetime {
            size,
            start: 0,
            end: 1,
        };
        Plan {
            lifetimes: spans.iter().map(|&(_, size)| t(size)).collect(),
            offsets: spans.iter().map(|&(o, _)| o).collect(),
            extent,
            live_peak: extent,
        }
    }

    #[test]
    fn a_clean_cut_is_an_offset_no_allocation_straddles() {
        // [0, 4) [4, 6) [5, 9) [9, 10): 4 and 9 are clean, 5 is inside [4, 6).
        let p = plan(&[(0, 4), (4, 2), (5, 4), (9, 1)], 10);
        assert_eq!(clean_cuts(&p), vec![4, 9]);
        // Two allocations at one offset give one cut; nothing at 0 or at the extent.
        let p = plan(&[(0, 2), (2, 3), (2, 1), (5, 5)], 10);
        assert_eq!(clean_cuts(&p), vec![2, 5]);
    }

    #[test]
    fn a_split_footprint_sends_offsets_from_the_cut_to_the_upper_piece() {
        let mut f = Footprint {
            scale: 1.0,
            base: 1 << 30,
            segment: 0,
            split: None,
            expected: 0,
        };
        let mib = 1 << 20;
        assert_eq!(f.address(8 * mib), (1 << 30) + stretched(8 * mib, 1.0));
        f.split = Some(Split {
            cut: 8 * mib,
            upper: 4 << 30,
        });
        assert_eq!(f.address(mib), (1 << 30) + stretched(mib, 1.0));
        assert_eq!(f.address(8 * mib), 4 << 30);
        let far = stretched(12 * mib, 1.0) - stretched(8 * mib, 1.0);
        assert_eq!(f.address(12 * mib), (4 << 30) + far);
    }

    #[test]
    fn the_part_given_back_lies_outside_both_kept_ranges() {
        let k = Kept {
            segment: 3,
            ranges: [(100, 200), (300, 350)],
        };
        assert!(k.is_split());
        assert!(k.overlaps(3, 150, 160) && !k.overlaps(2, 150, 160) && !k.overlaps(3, 200, 300));
        // A free block from 150 to 400: 200..300 is the largest part outside both.
        assert_eq!(k.largest_outside(150, 400), Some((200, 300)));
        assert_eq!(k.largest_outside(320, 340), None);
        assert_eq!(k.largest_outside(0, 120), Some((0, 100)));
        let one = Kept {
            segment: 3,
            ranges: [(100, 200), (200, 200)],
        };
        assert!(!one.is_split());
        assert_eq!(one.largest_outside(150, 260), Some((200, 260)));
    }
}
