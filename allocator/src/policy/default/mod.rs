//! `default`: cudalloc's own policy, least memory within a driver-call budget.
//!
//! - grow (`budget`): expandable ranges per stream and pool, pages of the device's
//!   granularity mapped in chunks of up to `max_chunk_mb`, after giving back cached chunks
//!   beyond a fragmentation budget over the peak requested bytes; a page ahead while nothing
//!   was freed yet (loading), and under a memory cap slack of up to one budget of the cap
//!   then; a giant request on a range of its own, mapped as one chunk
//!   (`giant`; the threshold is lower under a memory cap); the free blocks of giant ranges
//!   given back first;
//! - place (`plan`, `placement`, `footprint`, `packing`, `search`): a repeated sequence of large
//!   allocations goes where a packing of its last repetition put it; everything else by
//!   PyTorch's best fit with expandable segments ([`torch::get_free_block`]), over the blocks
//!   of giant ranges only for a giant request that nearly fills one;
//! - split: PyTorch's rule for expandable segments ([`torch::should_split`]), never in a giant
//!   range;
//! - on alloc and free: the peak requested bytes (the budget's base) and the episode being
//!   recorded for the next plan (a block of the episode carries its number as its mark).
//!
//! State ([`DefaultPolicy`]): its settings ([`DefaultConfig`]), the episodes and plan
//! (`plan::Plans`), the most bytes ever requested at once, and the giant ranges. Invariants:
//! those of `plan`, `footprint` and `giant`; a block carries a mark iff it is a live
//! allocation of the open episode or of one closed since (then the mark is below the open
//! episode's first number).
//!
//! In these files "under a cap" (or "under a memory limit") means the capped mode
//! ([`DefaultPolicy`]'s `capped`, `note_limit`): a limit that is not far. A far limit runs the
//! uncapped rules; the limit itself, the ladder's last resort (`release_pinned`) and
//! `repage_under_cap:False`'s single pages still follow the limit.
//!
//! The figures the constants of these files quote from `rule_table` ("tuning / held out") are
//! over the tuning set and the 22 held-out traces `traces/split.json` listed when they were
//! measured; it lists 49 now, so a new run of `rule_table` gives other held-out means.

mod behind;
mod budget;
mod footprint;
mod giant;
mod lifetime;
mod packing;
mod placement;
mod plan;
mod rules;
mod search;
mod small;

/// The packing a layout plan is made from, for the tests that check it against its bounds.
#[cfg(feature = "testing")]
pub use lifetime::{Lifetime, Plan};
#[cfg(feature = "testing")]
pub use packing::{best_fit_extent, live_peak, pack};

pub(crate) use footprint::Kept;

use super::{torch, Policy};
use crate::error::ConfigError;
use crate::pool::block::{Block, BlockId};
use crate::pool::{Core, Request};
use cudalloc_sys::{Device, DeviceError};
pub use giant::{
    GIANT_MIN_BYTES, GIANT_MIN_CHUNKS, GIANT_UNCAPPED_MIN_BYTES, GIANT_UNCAPPED_MIN_CHUNKS,
};
use plan::{Placement, Plans};
pub use rules::Rules;

/// The `default` policy's largest chunk when none is given.
pub const DEFAULT_MAX_CHUNK: u64 = 40 << 20;

/// The `default` policy's fragmentation budget when none is given.
pub const DEFAULT_FRAGMENTATION_BUDGET: f64 = 0.02;

/// The most bytes `max_chunk` may be (1 TiB).
const MAX_CHUNK_LIMIT: u64 = 1 << 40;

/// The `default` policy's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DefaultConfig {
    /// Cached bytes allowed above the peak requested bytes, as a fraction of it in [0, 1]. Key
    /// `fragmentation_budget`.
    pub fragmentation_budget: f64,
    /// Largest chunk mapped in one driver call, in bytes: whole 2 MiB pages, from 2 MiB to
    /// 1 TiB. Key `max_chunk_mb`.
    pub max_chunk: u64,
    /// Place a repeated sequence of large allocations by a packing of its last repetition. Key
    /// `layout_plans`.
    pub layout_plans: bool,
    /// Under a memory cap, make pinned chunks again from their live pages at the end of the
    /// out-of-memory ladder (`pool::repage`). Key `repage_under_cap`.
    pub repage_under_cap: bool,
    /// Lend a free block of one stream to another stream's request that would otherwise grow
    /// its pool, once the lender's stream has completed its work (`crate::lend`). Off by
    /// default: on a GPU it reserved more on both programs of several streams it was run on
    /// (`docs/threads.md`). Key `lend_blocks`.
    pub lend_blocks: bool,
    /// Switches for the policy's other rules, all on unless a measurement turns one off
    /// ([`Rules`]).
    pub rules: Rules,
}

impl Default for DefaultConfig {
    fn default() -> Self {
        DefaultConfig {
            fragmentation_budget: DEFAULT_FRAGMENTATION_BUDGET,
            max_chunk: DEFAULT_MAX_CHUNK,
            layout_plans: true,
            repage_under_cap: true,
            lend_blocks: false,
            rules: Rules::ALL,
        }
    }
}

impl DefaultConfig {
    /// Checks every value against what its key accepts; the error names the key and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let b = self.fragmentation_budget;
        if !(0.0..=1.0).contains(&b) {
            return Err(ConfigError::new(
                "fragmentation_budget",
                format!("{b} is not in [0, 1]"),
            ));
        }
        let chunk = self.max_chunk;
        if !(2 << 20..=MAX_CHUNK_LIMIT).contains(&chunk) || !chunk.is_multiple_of(2 << 20) {
            return Err(ConfigError::new(
                "max_chunk_mb",
                format!("{chunk} bytes is not a whole number of 2 MiB pages from 2 MiB to 1 TiB"),
            ));
        }
        Ok(())
    }
}

/// The `default` policy and its state.
pub struct DefaultPolicy {
    pub(crate) cfg: DefaultConfig,
    /// Episodes and the layout plan.
    pub(crate) plans: Plans,
    /// Highest sum of requested bytes seen (the budget's base; not reset with the peak
    /// statistics).
    pub(crate) peak_requested: u64,
    /// The episode index of the request being placed and whether the plan placed it, until
    /// the allocation is handed out ([`Policy::on_alloc`]).
    pending: Option<(usize, bool)>,
    /// The segment index of each giant range (`giant`).
    giant: Vec<u32>,
    /// The last give-back without a cap left pages the device had not caught up with
    /// (`keep_while_behind`, `behind`): no giant range is made meanwhile, and giant blocks
    /// serve any request of the capped giant size (`giant`).
    pub(crate) behind: bool,
    /// The pool runs in its capped mode (`note_limit`): under a memory limit that is not far.
    pub(crate) capped: bool,
}

impl DefaultPolicy {
    /// The policy with no history.
    pub fn new(cfg: DefaultConfig) -> DefaultPolicy {
        DefaultPolicy {
            cfg,
            plans: Plans::default(),
            peak_requested: 0,
            pending: None,
            giant: Vec::new(),
            behind: false,
            capped: false,
        }
    }

    /// Sets the capped mode: on under a memory limit, unless the limit is far (rule
    /// `wide_budget_near_limit`): `repage_under_cap` is on, an episode of the layout plans has
    /// been evaluated, and the limit is at least [`budget::FAR_LIMIT_WIDE_CEILINGS`] times the
    /// wide ceiling ([`budget::CAPPED_BUDGETS`] budgets above the budget's base for `req`, or
    /// above every pool's reserved bytes under the limit when more). Under a far limit the
    /// capped mode's rules are off (see the module docs for what still follows the limit); as
    /// the base grows, the limit becomes near and the capped mode starts.
    fn note_limit<D: Device>(&mut self, core: &Core<D>, req: &Request) {
        let Some(limit) = core.limit() else {
            self.capped = false;
            return;
        };
        // The budget's base for `req` (`budget_room`'s), and never less than what every pool
        // under the limit holds: a pool with a small peak of its own beside others that fill
        // the limit is near it too.
        let base = self
            .peak_requested
            .max(core.requested_bytes() + req.size)
            .max(self.plans.expected_peak())
            .max(core.total_reserved());
        let wide = (1.0 + budget::CAPPED_BUDGETS * self.cfg.fragmentation_budget) * base as f64;
        let far_at = wide * budget::FAR_LIMIT_WIDE_CEILINGS as f64;
        // With `repage_under_cap` off a limited pool keeps its single-page promise: capped.
        let far = self.cfg.rules.wide_budget_near_limit
            && self.cfg.repage_under_cap
            && self.plans.evaluated > 0
            && far_at <= limit as f64;
        self.capped = !far;
    }

    /// True when the last placement ran the capped mode: a memory limit that was not far
    /// (`budget::FAR_LIMIT_WIDE_CEILINGS`, rule `wide_budget_near_limit`).
    pub fn capped(&self) -> bool {
        self.capped
    }

    /// True while a layout plan places this pool's large blocks (see `plan`).
    pub fn has_plan(&self) -> bool {
        self.plans.has_plan()
    }

    /// Allocations placed by a layout plan so far (see `plan`).
    pub fn planned_allocations(&self) -> u64 {
        self.plans.placed
    }

    /// Episodes evaluated for a layout plan so far (best fit over each, then packing it; see
    /// `plan`), those abandoned as too long included; an episode recognised as one that made
    /// no plan before is not evaluated again.
    pub fn evaluated_episodes(&self) -> u64 {
        self.plans.evaluated
    }
}

impl std::fmt::Debug for DefaultPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DefaultPolicy")
            .field("cfg", &self.cfg)
            .field("peak_requested", &self.peak_requested)
            .field("has_plan", &self.has_plan())
            .finish_non_exhaustive()
    }
}

impl Policy for DefaultPolicy {
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        self.note_limit(core, req);
        // Behind is a state of the uncapped mode only (`keep_while_behind`).
        self.behind &= !self.capped;
        let seq = if self.plans_on(req) {
            self.episode_index(core, req.stream)
        } else {
            None
        };
        let planned = match seq {
            Some(k) => match self.planned_block(core, k, req, may_grow)? {
                Placement::At(id) => Some(id),
                Placement::BestFit => None,
                Placement::NeedsGrowth => return Ok(None),
            },
            None => None,
        };
        self.pending = seq.map(|k| (k, planned.is_some()));
        Ok(planned.or_else(|| self.best_fit(core, req)))
    }

    fn should_split<D: Device>(&self, core: &Core<D>, id: BlockId, size: u64) -> bool {
        // A block of a giant range is handed out whole (`giant`), but while behind.
        torch::should_split(core, id, size, true)
            && (self.behind || !self.is_giant(core.blocks[id].segment))
    }

    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        // Pages of this stream still on their way back (the device runs behind) serve the
        // request before new pages are mapped: stream order makes them safe without a wait.
        let (mss, rounding) = (core.cfg.max_split_size, core.cfg.max_non_split_rounding);
        let giant_serve = self.giant_blocks_serve(core);
        let fits = |b: &Block| {
            torch::serves(req, b.size, mss, rounding) && self.may_serve(b, req, giant_serve)
        };
        if self.cfg.rules.take_back_releasing
            && core.releasing_bytes() > 0
            && core.reclaim_releasing(req.stream, req.pool, fits).is_some()
        {
            if let Some(id) = self.best_fit(core, req) {
                return Ok(Some(id));
            }
        }
        if let Some(grown) = self.giant_grow(core, req)? {
            return Ok(grown);
        }
        self.budget_allocate(core, req)
    }

    fn release_pinned<D: Device>(
        &mut self,
        core: &mut Core<D>,
        _req: &Request,
    ) -> Result<bool, DeviceError> {
        // Under a memory limit only: growth there maps the same chunks as without one, and
        // a chunk a live block keeps mapped is what stands between a growth and the limit.
        if core.limit().is_none() || !self.cfg.repage_under_cap {
            return Ok(false);
        }
        Ok(core.repage_pinned()? > 0)
    }

    fn has_last_resort(&self) -> bool {
        self.cfg.repage_under_cap
    }

    fn gives_back_idle(&self) -> bool {
        self.cfg.rules.give_back // with it off, reserved memory only grows
    }

    fn lends_blocks(&self) -> bool {
        self.cfg.lend_blocks
    }

    fn on_alloc<D: Device>(&mut self, core: &mut Core<D>, id: BlockId) {
        self.peak_requested = self.peak_requested.max(core.requested_bytes());
        if let Some((k, placed)) = self.pending.take() {
            self.note_alloc(core, id, k, placed);
        }
    }

    fn on_marked_free<D: Device>(&mut self, _core: &Core<D>, id: BlockId, mark: u64) {
        self.note_free(id, mark);
    }

    fn on_segment_released(&mut self, segment: u32) {
        // A later segment may get this index and these addresses: the plan's kept ranges in
        // this one must not spare its pages.
        self.plans.forget_segment(segment);
        self.giant.retain(|&s| s != segment);
    }

    /// A layout plan places large blocks, or the episode being recorded has two or more
    /// allocations live (a block kept out of the pool would be missing from the sequence the
    /// plan is made from).
    fn watches_large_blocks(&self) -> bool {
        self.plans.has_plan() || self.plans.episode_busy()
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.cfg.validate()
    }
}
