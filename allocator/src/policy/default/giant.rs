//! Giant growths: a large-pool request of at least [`GIANT_MIN_CHUNKS`] chunk windows (and
//! [`GIANT_MIN_BYTES`]) under a memory cap, or of at least [`GIANT_UNCAPPED_MIN_CHUNKS`] (and
//! [`GIANT_UNCAPPED_MIN_BYTES`]) without one, that finds no cached block it may take gets a
//! virtual range of its own (`giant_ranges` and `giant_ranges_uncapped` in
//! [`Rules`](super::Rules)).
//!
//! Its pages are mapped as one chunk (after the pages a growth takes from releasing blocks of its
//! stream, `move_pages`, when the device runs behind): one map operation where the shared range
//! would take a chunk per window (eight or more under a cap, sixteen or more without), and one
//! unmap when the budget or the cap gives the block back, where a block in the shared range gives
//! back window by window. A free block of a giant range serves only a giant request (of the capped
//! size or more) that leaves at most one chunk window of it unused, and is handed out whole (never
//! split: a rest in the chunk would stay mapped while the tensor lives, and only the ladder's last
//! resort, which copies the whole chunk, could give it back), so the range holds one tensor. While
//! the policy is behind (`keep_while_behind`, `behind`: without a cap, a give-back the device had
//! not caught up with) no giant range is made, and a giant block serves any request of at least
//! the capped giant size ([`GIANT_MIN_CHUNKS`] windows and [`GIANT_MIN_BYTES`]) by best fit and
//! is split like any block: a giant tensor whose size changes with every step would otherwise get a
//! new range each step while the old ones are held by the device. A smaller request never takes
//! one, behind or not: placed there, its tensor would keep the range's one chunk mapped for as
//! long as it lives (in a GPT-2 training on the H100, a 3 MiB tensor in a 786 MiB range made the
//! next step's logits map another range: 1.13 times the live bytes reserved; the replay of that
//! run with the device's answers, 1.03 under this rule: `docs/policies.md`, "When the device runs
//! behind"). A request of the capped giant size that splits such a block holds its chunk mapped
//! the same way, but only while a tensor of a giant range's kind lives. A range split then may hold
//! several blocks; once the policy is no longer behind, its free pieces serve only giant requests
//! that nearly fill them, and a piece beside a live block in the range's one chunk goes back only
//! with that block (or by the last resort under a cap). The budget gives back the free blocks of
//! giant ranges before any other (`give_back_giant_first`): one unmap each, and only a request that
//! nearly fills one can reuse it. Ordinary growth and a layout plan's footprint never go to a giant
//! range. Ranges are reserved in whole chunk windows, so a range serves later requests up to a
//! window larger than the one that made it; only the request's pages are mapped. A giant range
//! whose pages all went back serves the next giant growth of its stream that fits in it (the
//! smallest such); after that growth the stream's other empty giant ranges are released (not during
//! a capture), so empty giant ranges pile up only between two giant growths of a stream that go
//! ahead, during a capture, while the policy is behind (no giant growth then), or when the stream
//! makes no more giant growths (a range made under a cap for 320-640 MiB, the cap then lifted;
//! address space only: `empty_cache` releases them).
//!
//! A cap set on a pool with `repage_under_cap` off stops blocks of giant ranges made before it
//! from serving requests of the pool (that pool promises single-page chunks); the budget and
//! the cap give them back like any cached block. A block that `CachingAllocator` holds in a
//! thread cache is not the pool's: it serves the next request of its size on that thread
//! without asking the policy, as it did before the cap.
//!
//! Under a memory cap, only while `repage_under_cap` is on: there, every byte mapped in a
//! window that a live tensor pins is a byte the cap lacks, and a giant tensor in the shared
//! range is given back and mapped again window by window; with `repage_under_cap` off the
//! policy promises single-page chunks, each of which can go back without moving bytes. Without
//! a cap the threshold is twice as high: a tensor of 8-15 windows whose size changes with each
//! batch (`fasterrcnn_infer_dynamic`'s 387-590 MiB activations) finds no range that it nearly
//! fills, and the growth that replaces the shared range's reuse of its windows costs memory
//! (`docs/policies.md`, "Giant ranges").
//!
//! Invariant: `DefaultPolicy::giant` lists the segment index of every giant range the pool
//! holds, and no other: an index leaves it when the pool reports its segment released
//! (`Policy::on_segment_released`; for the ranges this module releases, once the policy's call
//! has returned, `Core::release_empty_range`), before the index can be reused.

use super::DefaultPolicy;
use crate::policy::torch;
use crate::pool::block::{Block, BlockId};
use crate::pool::{Core, Request};
use crate::sizes::PoolKind;
use cudalloc_sys::{Device, DeviceError, StreamId};

/// A large-pool request of at least this many chunk windows (`max_chunk_mb`; 320 MiB at the
/// default 40 MiB), and of at least [`GIANT_MIN_BYTES`], grows on a range of its own under a
/// memory cap. Measured (`tools/capped_table.py --min-capacity`, 34 traces): at 8, within 3x
/// `segment_alloc` on 26 of 32 traces at a cap of 1.03x the peak live bytes and 30 of 34 at
/// 1.10x (25 and 27 without giant ranges), no new device wait. Measured with an earlier version
/// (blocks of giant ranges split, footprints free to go there): at 4, 27 and 29, with new
/// device waits (`deberta_dynamic` 8); at 6 and 12, 27 and 29, and 27 and 30; at 8, 27 and 30.
pub const GIANT_MIN_CHUNKS: u64 = 8;

/// The least a giant request is, whatever `max_chunk_mb`: with small chunks (chosen so that
/// pages go back without moving bytes) eight windows are a few MiB, and tensors of that size
/// on ranges of their own would mean a reservation each.
pub const GIANT_MIN_BYTES: u64 = 320 << 20;

/// Without a memory cap, a large-pool request of at least this many chunk windows (640 MiB at
/// the default 40 MiB), and of at least [`GIANT_UNCAPPED_MIN_BYTES`], grows on a range of its
/// own. Measured (replays of the 29 held-out traces without a cap, giant blocks given back
/// first; against 1.0346 reserved / live as a geometric mean, 11,488 driver calls, 12 traces
/// above 3x `segment_alloc`): at 16, 1.0340, 10,395 calls and 11 traces, none more than 1%
/// worse; at 14, 1.0346, 10,330 and 10; at 8, 10 and 12, `fasterrcnn_infer_dynamic` reserves
/// 1.072 instead of 1.051 (and at 10 `moe_top2_capacity_train` 1.027 instead of 1.017); at 20,
/// `lstm_train_varlen` 1.033 instead of 1.021; at 24, 1.0345 and 10,890 calls, 12 traces.
pub const GIANT_UNCAPPED_MIN_CHUNKS: u64 = 16;

/// The least a giant request is without a memory cap, whatever `max_chunk_mb` (see
/// [`GIANT_MIN_BYTES`]).
pub const GIANT_UNCAPPED_MIN_BYTES: u64 = 640 << 20;

impl DefaultPolicy {
    /// The smallest giant request, in bytes: the capped size, the least a block of a giant
    /// range serves.
    fn giant_min(&self) -> u64 {
        GIANT_MIN_CHUNKS
            .saturating_mul(self.cfg.max_chunk)
            .max(GIANT_MIN_BYTES)
    }

    /// The smallest request that grows on a range of its own in `core` (`None`: none does):
    /// [`DefaultPolicy::giant_min`] under a memory cap while `repage_under_cap` is on, the
    /// uncapped size without a cap.
    fn giant_growth_min(&self) -> Option<u64> {
        let rules = self.cfg.rules;
        if self.behind {
            return None;
        }
        if self.capped {
            (rules.giant_ranges && self.cfg.repage_under_cap).then(|| self.giant_min())
        } else {
            let min = GIANT_UNCAPPED_MIN_CHUNKS
                .saturating_mul(self.cfg.max_chunk)
                .max(GIANT_UNCAPPED_MIN_BYTES);
            rules.giant_ranges_uncapped.then_some(min)
        }
    }

    /// True when `segment` is a giant range.
    pub(super) fn is_giant(&self, segment: u32) -> bool {
        self.giant.contains(&segment)
    }

    /// Whether blocks of giant ranges may serve requests in `core` at all (see
    /// [`DefaultPolicy::may_serve`]).
    pub(super) fn giant_blocks_serve<D: Device>(&self, core: &Core<D>) -> bool {
        core.limit().is_none() || self.cfg.repage_under_cap
    }

    /// Whether free block `b` (also a releasing one, which a growth may take back) may serve
    /// `req`: any block outside giant ranges, and a block of one only for a request of the capped
    /// giant size that leaves at most one chunk window of it unused (while behind, for any such
    /// request), and only when `giant_serve` ([`DefaultPolicy::giant_blocks_serve`]: not under a
    /// memory cap with `repage_under_cap` off, a range made before the cap was set: such a pool
    /// promises single-page chunks, whose free pages can all go back).
    pub(super) fn may_serve(&self, b: &Block, req: &Request, giant_serve: bool) -> bool {
        if !self.is_giant(b.segment) {
            return true;
        }
        let waste = b.size - req.size.min(b.size);
        let giant = req.size >= self.giant_min();
        let giant_fits = giant && waste <= self.cfg.max_chunk;
        giant_serve && (giant_fits || (giant && self.behind))
    }

    /// PyTorch's best fit ([`torch::get_free_block`]) over the blocks `req` may take: the
    /// answer of setting aside each block of a giant range it may not take while the search goes
    /// on ([`torch::get_free_block_where`], which walks the index once instead).
    pub(super) fn best_fit<D: Device>(&self, core: &mut Core<D>, req: &Request) -> Option<BlockId> {
        if self.giant.is_empty() || req.pool != PoolKind::Large {
            return torch::get_free_block(core, req, true);
        }
        let giant_serve = self.giant_blocks_serve(core);
        torch::get_free_block_where(core, req, true, |b| self.may_serve(b, req, giant_serve))
    }

    /// A giant growth for `req` (see the module docs): `Ok(None)` when `req` does not grow on a
    /// range of its own (not giant, the rule off, `repage_under_cap` off under a cap, or the
    /// cap leaves no room for its pages: ordinary growth then has its try), else what the
    /// growth gave (`Some(None)`: the device is out of memory).
    pub(super) fn giant_grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<Option<BlockId>>, DeviceError> {
        let min = self.giant_growth_min();
        if req.pool != PoolKind::Large || min.is_none_or(|min| req.size < min) {
            return Ok(None);
        }
        let page = core.device.granularity()?;
        let need = req.size.div_ceil(page) * page;
        self.budget_room(core, req, need, None)?;
        // A give-back that found the device behind (`keep_while_behind`) leaves ordinary growth
        // to serve the request, as every growth after it while behind.
        if core.over_limit(need) || self.behind {
            return Ok(None);
        }
        let grown = self.grow_in_giant_range(core, req, need, page)?;
        if grown.is_none() {
            // No range could be reserved: ordinary growth has its try, and its own failure
            // says what it ran out of.
            core.reserve_failed = false;
        }
        if !core.capturing() {
            for id in self.empty_giant_ranges(core, req.stream) {
                // A saving, not a duty: a range the driver will not release stays reserved.
                let _ = core.release_empty_range(id);
            }
        }
        Ok(grown)
    }

    /// Maps `need` bytes for `req` as one chunk at the start of the smallest empty giant range
    /// of its stream that holds them, or of a new one: `Ok(None)` when no range could be
    /// reserved (address space), `Some(None)` when the device is out of memory.
    fn grow_in_giant_range<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        need: u64,
        page: u64,
    ) -> Result<Option<Option<BlockId>>, DeviceError> {
        let empty = self
            .empty_giant_ranges(core, req.stream)
            .into_iter()
            .filter(|&id| core.blocks[id].size >= need)
            .min_by_key(|&id| core.blocks[id].size);
        let start = match empty {
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
        let moving = self.cfg.rules.move_pages;
        let mapped = core.map_run(start, req.size, |core, id, want| {
            super::behind::map_pages(core, moving, id, want, need)
        })?;
        Ok(Some(mapped))
    }

    /// The giant ranges of `stream` with no page mapped, each as its one unmapped block.
    fn empty_giant_ranges<D: Device>(&self, core: &Core<D>, stream: StreamId) -> Vec<BlockId> {
        core.large
            .unmapped_of(stream.0)
            .filter(|&id| {
                let b = &core.blocks[id];
                self.is_giant(b.segment) && !b.is_split() && core.allocatable(id)
            })
            .collect()
    }
}
