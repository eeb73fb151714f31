//! Layout plans: the `default` policy places a repeated sequence of large allocations where a
//! packing of its last repetition put them.
//!
//! Inference over batches of changing size runs one sequence of large allocations again and
//! again, every size scaled by the batch. Best fit places each repetition alike, and on such a
//! sequence it can leave a fifth or more of the bytes in holes: on BERT's layers it spans 14
//! hidden-state widths where 11 are live at most. Once a repetition is over, every lifetime is
//! known and a tighter packing is cheap to compute. So, under `default` (with or without a memory
//! cap):
//!
//! - the pool records an *episode*: the large-pool allocations of one stream from one that
//!   starts it until all of them are freed again (a batch, an iteration); other streams'
//!   allocations meanwhile are not recorded. Allocations older than the rest may outlive it
//!   (weights loaded before the first batch): the episode also ends when at least
//!   [`MIN_EPISODE_ALLOCS`] allocations came after its youngest live one and all of those are
//!   freed, and then consists of those. Whether it ended is asked at the next large allocation (of
//!   any stream), which may start the next episode. One that reaches [`MAX_EPISODE_ALLOCS`]
//!   allocations is dropped;
//! - an episode of at least [`MIN_EPISODE_ALLOCS`] allocations is packed offline: in each of a few
//!   orders (largest first, latest first among equals, largest bytes x lifetime first, ...),
//!   each allocation at the lowest offset clear of those whose lifetimes overlap its own; the
//!   tightest packing wins, unless it spans more than
//!   [`SEARCH_ABOVE_LIVE_PEAK`] times the episode's live peak and a
//!   bounded search (`search`) finds a packing within the live peak. It becomes the *plan*
//!   when it spans at most [`PLAN_SPAN_OF_BEST_FIT`] of what
//!   best fit spans on the same sequence, and the plan is dropped otherwise: where best fit
//!   packs well (training steps that repeat the same sizes), placement stays best fit's. An
//!   episode that followed the plan (sizes at the episode's scale within rounding or up to
//!   [`SMALLEST_MATCH`] less, allocation and free order) keeps it without packing, and an episode
//!   like one of the last [`REMEMBERED_REJECTIONS`] that made no plan (a training loop's steps)
//!   drops the plan without being evaluated again, charged the work its evaluation took (so the
//!   work bound below counts what an evaluation would have cost); one like the episode the last
//!   plan
//!   was made from gets that plan again, charged the same way. Evaluating costs
//!   work in proportion to the episode's allocations times those each is compared with. An
//!   evaluation starts only while the work of earlier ones is within [`EVALUATION_WORK_AHEAD`] of
//!   [`EVALUATION_WORK_PER_ALLOC`] per allocation the pool has made since (the plan stands as it is
//!   otherwise), and one spends at most [`MAX_EVALUATION_WORK`], so a job whose every
//!   episode differs spends a bounded share of its time on them, and no allocation waits
//!   for more than about a quarter of a millisecond of it;
//! - allocation `i` of the next episode goes to `base + scale x offset[i]` when its size is
//!   `scale x size[i]` (within rounding, or up to [`SMALLEST_MATCH`] of it smaller) and those bytes
//!   are free or unmapped; the missing pages
//!   are mapped under the fragmentation budget and the memory cap like any growth (and never
//!   past the cap, nor when the caller asked
//!   for cached memory only). The first allocation sets the scale, and the base (the
//!   *footprint*, chosen as `footprint` says: the last one's base when the scaled extent is
//!   free there, a free block that holds it, or a run of free and unmapped blocks; or split in
//!   two pieces at a clean cut of the plan, one in a free block too small for the whole).
//!   With a split, `base + ...` above is the lower piece's base for the offsets below the cut,
//!   and the upper piece's for the rest. An allocation whose size does not match ends the plan
//!   for the episode; one whose bytes are taken falls back to best fit;
//! - the last footprint (up to the largest extent placed at its base) keeps its cached pages
//!   when the budget gives memory back (not under a memory cap), until the pool is past twice
//!   the budget
//!   (`budget::budget_room`), so that the next episode finds them mapped; after a split, so
//!   does its other piece, until a footprint is placed at a base outside both (`footprint`).
//!
//! Invariants: a block's mark ([`Block::mark`](crate::pool::block::Block::mark)) is the number of
//! the recorded allocation it serves ([`NO_MARK`](crate::pool::block::NO_MARK) otherwise, and always while the block is free
//! or unmapped); numbers of a dropped
//! or closed episode are below the open one's `first`; an episode's allocations are all of one
//! stream; `live` counts its allocations not yet back in the pool; `anchors` are live
//! allocations placed by the plan, so in the footprint's segment, from which a walk along the
//! segment's blocks finds any address in it; a plan places no two allocations whose lifetimes
//! overlap on overlapping bytes.

use super::footprint::{Footprint, Kept};
pub(crate) use super::lifetime::{Lifetime, Plan};
use super::packing::{best_fit, pack_within_peak};
use super::DefaultPolicy;
use crate::pool::block::BlockId;
use crate::pool::{Core, Request};
use crate::sizes::{PoolKind, MIN_BLOCK};
use crate::stats::Stats;
use cudalloc_sys::{Device, StreamId};

/// Fewest allocations an episode needs to become a plan, and how many must follow the youngest
/// live allocation (all freed) for an episode nested in older ones to end. Fewer plans short
/// sequences that are often noise; more misses short batches. Measured (`rule_table`'s all-on
/// row, reserved/live and calls, geometric means over the held-out traces): 8 gives 1.0414 /
/// 260.0, 12 1.0430 / 261.7, 16 1.0414 / 260.6, 24 1.0409 / 259.4, 32 1.0440 / 263.6; the
/// tuning set is the same from 8 to 32. Within noise of its neighbours.
pub const MIN_EPISODE_ALLOCS: usize = 16;
/// Most allocations an episode records; longer ones are dropped. Bounds the recording's memory
/// (an evaluation's work has its own bound, [`MAX_EVALUATION_WORK`]). Measured on the 45
/// bundled traces (2026-12-06): at 1024 the batches of `moe_infer_dynamic` (1,186 large
/// allocations each) were dropped, so no plan placed them: 2048 takes it from 1.0295 to 1.0188
/// reserved/live (271 driver calls against 273; found on that held-out trace, so its figure is
/// in-sample), and changes no other trace's figure, capped or not, nor any min capacity; 4096
/// gives the same. Earlier, on 22 held-out traces, 512 cost calls.
pub const MAX_EPISODE_ALLOCS: usize = 2048;

/// What the plan makes of a request.
pub(crate) enum Placement {
    /// The block at the planned address, out of the free index.
    At(BlockId),
    /// No planned place: best fit.
    BestFit,
    /// The planned bytes need new pages and the caller asked for cached memory only.
    NeedsGrowth,
}

/// The episode being recorded.
pub(super) struct Episode {
    pub(super) stream: StreamId,
    /// Number of its first allocation.
    pub(super) first: u64,
    pub(super) lifetimes: Vec<Lifetime>,
    pub(super) clock: u32,
    pub(super) live: u32,
    pub(super) footprint: Option<Footprint>,
    /// Every allocation and free so far matched the plan.
    pub(super) follows: bool,
    /// An allocation after the first (which only sets the scale) matched the plan.
    pub(super) confirmed: bool,
    pub(super) anchors: Vec<BlockId>,
    /// Indexes of allocations in the order made; those freed leave it once they reach the top,
    /// so the top is the youngest live one (while `live > 0`).
    pub(super) stack: Vec<u32>,
}

impl Episode {
    /// Where the episode ended, if it has: 0 when none of its allocations is live any more;
    /// otherwise just after the youngest live one, when at least [`MIN_EPISODE_ALLOCS`] came after
    /// it and all of those are freed (the older ones, such as weights loaded before the first
    /// batch, may outlive many episodes). Asked at the next large allocation, so that an episode
    /// whose last frees come in any order ends at its start.
    fn ended(&self, nested: bool) -> Option<usize> {
        if self.live == 0 {
            return (!self.lifetimes.is_empty()).then_some(0);
        }
        let n = self.lifetimes.len();
        let youngest = *self.stack.last()? as usize;
        (nested && n - youngest > MIN_EPISODE_ALLOCS).then_some(youngest + 1)
    }
}

/// The vectors of a finished episode, emptied and kept for the next one: an episode records a
/// few dozen allocations, and growing its three vectors from nothing each time was a quarter of
/// the policy's own work on a decoding trace (`speculative_decode`, counted by callgrind).
#[derive(Default)]
struct Buffers {
    lifetimes: Vec<Lifetime>,
    anchors: Vec<BlockId>,
    stack: Vec<u32>,
}

impl Buffers {
    /// Keeps `e`'s vectors, emptied.
    fn keep(&mut self, e: Episode) {
        self.keep_lifetimes(e.lifetimes);
        let (mut anchors, mut stack) = (e.anchors, e.stack);
        anchors.clear();
        stack.clear();
        self.anchors = anchors;
        self.stack = stack;
    }

    fn keep_lifetimes(&mut self, mut lifetimes: Vec<Lifetime>) {
        lifetimes.clear();
        self.lifetimes = lifetimes;
    }
}

/// Episode recording and the current plan of one pool.
#[derive(Default)]
pub struct Plans {
    next: u64,
    /// What the next episode records into.
    buffers: Buffers,
    pub(super) episode: Option<Episode>,
    pub(super) plan: Option<Plan>,
    /// Allocations placed by a plan.
    pub placed: u64,
    /// Episodes evaluated.
    pub evaluated: u64,
    /// Signature of the last episode decided on (evaluated, or recognised as rejected).
    packed: Option<u64>,
    /// The last plan made, with the signature of the episode it was packed from and the work
    /// its evaluation took: that episode again gets the same plan without being evaluated.
    made: Option<(u64, u64, Plan)>,
    /// Signatures of the last episodes that made no plan, with the work their evaluation took
    /// ([`REMEMBERED_REJECTIONS`] of them, oldest overwritten first): such an episode again drops
    /// the plan and is charged that work without being evaluated.
    rejected: [Option<(u64, u64)>; REMEMBERED_REJECTIONS],
    /// Where the next rejected signature goes in `rejected`.
    next_rejected: usize,
    /// Segment, base and end of the last footprint: the next episode reuses it when it is free.
    pub(super) last: Option<(u32, u64, u64)>,
    /// A second range of the same segment whose cached pages are kept (`footprint`): the other
    /// piece of the last split footprint, or the footprint before it.
    pub(super) other: Option<(u64, u64)>,
    /// Work of evaluations not yet earned back by allocations ([`EVALUATION_WORK_PER_ALLOC`]).
    debt: u64,
    /// The pool's allocation count when `debt` was last brought up to date.
    allocations: i64,
}

/// Evaluating an episode (best fit over it, then packing it) costs work in proportion to its
/// allocations times the allocations or free ranges each is compared with. Work an evaluation
/// may spend per allocation the pool makes, in those steps: a step takes 4-7 ns while a
/// replay runs (measured on the 2-core machine), so over a run evaluations cost at most about
/// 16-28 ns per allocation (plus [`EVALUATION_WORK_AHEAD`]), whatever the episodes. Until the
/// work is earned the plan stands as it is. A bound on time: from 2 to 16 the figures move by
/// at most 0.1% in memory and 1% in calls (`rule_table`'s all-on row).
pub const EVALUATION_WORK_PER_ALLOC: u64 = 4;

/// Work that evaluations may run ahead of the allocations that pay for it (about a quarter of
/// a millisecond): a pool that evaluates now and then is never held back. A quarter of it
/// costs the held-out traces (1.0439 / 262.4 against 1.0414 / 260.6); four times it changes
/// nothing.
pub const EVALUATION_WORK_AHEAD: u64 = 1 << 16;

/// Most work one evaluation may spend (about a quarter of a millisecond, within one
/// allocation): best fit over an episode that takes more is abandoned and the plan stands; a
/// packing that takes more keeps the best order found by then, if any. A bound on latency and
/// on time. Measured over the 41 traces of `traces/`, `traces/h200/` and the shared
/// `llama_generate`: against four times it, the same memory but on `rl_generate_train` (1.0188
/// -> 1.0200) and fewer driver calls (14,770 -> 14,685; `speculative_decode` 271 -> 199, and
/// under caps of 1.03x and 1.10x its live peak 160 -> 110 and 115 -> 43), and a third of the
/// evaluation work on `speculative_decode`, whose 32-allocation decode steps each spent four
/// times it searching for a packing within their live peak. Half of it is too little for
/// `bert_dynamic`'s search (1.0386 -> 1.0624 reserved/live, 82 -> 490 calls).
pub const MAX_EVALUATION_WORK: u64 = 1 << 16;

/// How many signatures of episodes that made no plan a pool remembers, so that a training loop
/// whose steps alternate between a few episodes (`gpt2_train`: one of 974 allocations, one of
/// 50) does not evaluate each again at every step. Time only: a remembered episode is charged
/// the work its evaluation took, so the figures are those of evaluating it again.
pub const REMEMBERED_REJECTIONS: usize = 8;

/// A packing becomes the plan when it spans at most this fraction of what best fit spans: where
/// best fit already packs well (training steps), placement stays best fit's, whose blocks a
/// later step of another shape can reuse. Measured (`rule_table`'s all-on row, geometric
/// means, tuning / held out): 0.85 gives 1.0492 / 1.0484 in memory (`bert_dynamic` gets no
/// plan), 0.9 1.0224 / 1.0414, 0.95 1.0228 / 1.0430, 1.0 1.0266 / 1.0482; calls are fewest
/// at 0.9 on the held-out traces (260.6, against 266.7 at 0.95).
pub const PLAN_SPAN_OF_BEST_FIT: f64 = 0.9;

/// An allocation down to this fraction of its planned size (at the episode's scale) still
/// takes its planned place: shapes that do not all scale alike (a convolutional net at
/// another resolution rounds each layer's height and width on its own) keep their plan. The
/// first allocation sets the scale with no such tolerance: when it is the one that came out
/// smaller, the others look larger than planned and the plan ends at the first of them.
/// Measured (`rule_table`'s all-on row): 0.8 to 0.95 give the same figures; 0.98 costs the
/// held-out traces (1.0426 / 262.1 against 1.0414 / 260.6), and no tolerance at all more
/// (`smaller_matches` in the rule table).
pub const SMALLEST_MATCH: f64 = 0.95;

/// True when `size` is `scale` times `planned` up to rounding, or (with `smaller`, the
/// `smaller_matches` rule) down to [`SMALLEST_MATCH`] of it.
pub(super) fn matches(size: u64, planned: u64, scale: f64, smaller: bool) -> bool {
    let want = scale * planned as f64;
    let size = size as f64;
    let little_less = smaller && size <= want && size >= SMALLEST_MATCH * want;
    let rounding = want * SCALED_ROUNDING + MIN_BLOCK as f64;
    (size - want).abs() <= rounding || little_less
}

/// A size scaled from a planned one matches it within this fraction of it (and a block's 512
/// bytes): sizes computed from a batch dimension and rounded to 512 bytes do not scale
/// exactly. Measured (`rule_table`'s all-on row): 1/256 gives the same figures, 1/1024 costs
/// held-out memory (1.0422 against 1.0414).
pub const SCALED_ROUNDING: f64 = 1.0 / 512.0;

impl DefaultPolicy {
    /// True when plans apply to this request: the large pool's, with or without a memory cap
    /// (under one, the plan's footprint keeps no pages the budget would give back:
    /// `budget::in_footprint`).
    pub(crate) fn plans_on(&self, req: &Request) -> bool {
        req.pool == PoolKind::Large && self.cfg.layout_plans
    }

    /// The index the next large allocation of `stream` will have in the open episode, after
    /// closing an episode that ended and starting one when none is open or the open one is
    /// full; `None` when another stream's episode is open (that allocation is not recorded).
    pub(crate) fn episode_index<D: Device>(
        &mut self,
        core: &mut Core<D>,
        stream: StreamId,
    ) -> Option<usize> {
        let nested = self.cfg.rules.nested_episodes;
        if let Some(cut) = self.plans.episode.as_ref().and_then(|e| e.ended(nested)) {
            self.close_episode(core, cut);
        }
        let plans = &mut self.plans;
        match &plans.episode {
            Some(e) if e.stream != stream => return None,
            Some(e) if e.lifetimes.len() < MAX_EPISODE_ALLOCS => return Some(e.lifetimes.len()),
            _ => {}
        }
        if let Some(full) = plans.episode.take() {
            plans.buffers.keep(full);
        }
        let first = plans.next;
        plans.next += MAX_EPISODE_ALLOCS as u64;
        let b = std::mem::take(&mut plans.buffers);
        plans.episode = Some(Episode {
            stream,
            first,
            lifetimes: b.lifetimes,
            clock: 0,
            live: 0,
            footprint: None,
            follows: plans.plan.is_some(),
            confirmed: false,
            anchors: b.anchors,
            stack: b.stack,
        });
        Some(0)
    }

    /// Records allocation `k` of the open episode, made in block `id` (`placed`: by the plan).
    pub(crate) fn note_alloc<D: Device>(
        &mut self,
        core: &mut Core<D>,
        id: BlockId,
        k: usize,
        placed: bool,
    ) {
        let size = core.blocks[id].size;
        let smaller = self.cfg.rules.smaller_matches;
        let plan = self.plans.plan.as_ref();
        let Some(e) = self.plans.episode.as_mut() else {
            return;
        };
        if e.lifetimes.len() != k {
            return;
        }
        let start = e.clock;
        let scale = e.footprint.as_ref().map(|f| f.scale);
        e.follows &= plan.and_then(|p| p.lifetimes.get(k)).is_some_and(|t| {
            t.start == start && scale.is_some_and(|c| matches(size, t.size, c, smaller))
        });
        e.lifetimes.push(Lifetime {
            size,
            start,
            end: u32::MAX,
        });
        e.clock += 1;
        e.live += 1;
        e.stack.push(k as u32);
        if placed {
            e.anchors.push(id);
            self.plans.placed += 1;
        }
        core.set_mark(id, e.first + k as u64);
    }

    /// Records the free of block `id`, marked `seq`, if it is an allocation of the open episode.
    pub(crate) fn note_free(&mut self, id: BlockId, seq: u64) {
        let plan = self.plans.plan.as_ref();
        let Some(e) = self.plans.episode.as_mut() else {
            return;
        };
        if seq < e.first || seq >= e.first + e.lifetimes.len() as u64 {
            return;
        }
        let k = (seq - e.first) as usize;
        debug_assert_eq!(e.lifetimes[k].end, u32::MAX, "an allocation freed twice");
        e.lifetimes[k].end = e.clock;
        e.follows &= plan
            .and_then(|p| p.lifetimes.get(k))
            .is_some_and(|t| t.end == e.clock);
        e.clock += 1;
        e.live = e.live.saturating_sub(1);
        while let Some(&top) = e.stack.last() {
            if e.lifetimes[top as usize].end == u32::MAX {
                break;
            }
            e.stack.pop();
        }
        if let Some(i) = e.anchors.iter().rposition(|&a| a == id) {
            e.anchors.swap_remove(i);
        }
    }

    /// Turns the episode that just ended into the plan, or drops the plan.
    fn close_episode<D: Device>(&mut self, core: &mut Core<D>, cut: usize) {
        let Some(mut e) = self.plans.episode.take() else {
            return;
        };
        let mut closed = std::mem::take(&mut e.lifetimes);
        closed.drain(..cut);
        let follows = e.follows;
        self.plans.buffers.keep(e);
        self.decide(core, &mut closed, cut == 0 && follows);
        self.plans.buffers.keep_lifetimes(closed);
    }

    /// [`close_episode`](Self::close_episode)'s decision on the allocations of the episode
    /// that ended (`closed`; `whole_followed`: the whole episode, every allocation and free of
    /// which matched the plan).
    fn decide<D: Device>(
        &mut self,
        core: &mut Core<D>,
        closed: &mut [Lifetime],
        whole_followed: bool,
    ) {
        if closed.len() < MIN_EPISODE_ALLOCS || closed.iter().any(|t| t.end == u32::MAX) {
            return;
        }
        let same = self
            .plans
            .plan
            .as_ref()
            .is_some_and(|p| whole_followed && p.lifetimes.len() == closed.len());
        if same {
            return;
        }
        let t0 = closed[0].start;
        for t in closed.iter_mut() {
            t.start -= t0;
            t.end -= t0;
        }
        let closed = &*closed;
        // A training step repeats the last one exactly: the decision taken then stands.
        let sig = signature(closed);
        if self.plans.packed == Some(sig) || !self.plans.may_work(&core.stats) {
            return;
        }
        self.plans.packed = Some(sig);
        if let Some((work, plan)) = self.plans.made_before(sig, closed) {
            // Packed before into the plan it made then: the same plan again, charged as the
            // evaluation it stands for (as a rejected episode is).
            self.plans.plan = Some(plan);
            self.plans.debt += work;
            return;
        }
        if let Some(work) = self.plans.rejected_work(sig) {
            // Evaluated before, and no plan came of it: the same decision again, charged as the
            // evaluation it stands for, so that which later episodes get evaluated (the work
            // bound) is what it would have been.
            self.plans.plan = None;
            self.plans.debt += work;
            return;
        }
        self.plans.evaluated += 1;
        // No packing spans less than the most bytes live at once: skip it when even that would
        // not gain enough over best fit.
        let Some(fit) = best_fit(closed, MAX_EVALUATION_WORK) else {
            // Too long to evaluate now: the plan stands.
            self.plans.debt += MAX_EVALUATION_WORK;
            return;
        };
        let mut work = fit.work;
        let bound = (PLAN_SPAN_OF_BEST_FIT * fit.extent as f64) as u64;
        self.plans.plan = None;
        if fit.live_peak <= bound {
            let left = MAX_EVALUATION_WORK.saturating_sub(work);
            let (plan, steps) =
                pack_within_peak(closed, fit.live_peak, bound, left, &self.cfg.rules);
            work += steps;
            self.plans.plan = plan;
        }
        match &self.plans.plan {
            Some(plan) => self.plans.made = Some((sig, work, plan.clone())),
            None => self.plans.remember_rejected(sig, work),
        }
        self.plans.debt += work;
    }
}

/// A hash of an episode's sizes and lifetimes, each field mixed in on its own (sizes of a MiB
/// or more and ticks must not share bits, or episodes that differ would collide easily).
fn signature(lifetimes: &[Lifetime]) -> u64 {
    let mix = |h: u64, x: u64| (h.rotate_left(5) ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    lifetimes.iter().fold(lifetimes.len() as u64, |h, t| {
        let h = mix(h, t.size);
        let h = mix(h, u64::from(t.start));
        mix(h, u64::from(t.end))
    })
}

impl Plans {
    /// The live bytes the open episode will reach at its peak if it follows the plan; 0 when no
    /// plan places it, until an allocation after its first (any first allocation sets a scale)
    /// has matched the plan too (from that allocation's own request on), and once none of its
    /// allocations is live. A split footprint (`footprint`) counts from its first allocation's
    /// request on: it was placed to use a cached block, which the budget must not give back to
    /// make room for that allocation.
    pub(crate) fn expected_peak(&self) -> u64 {
        let e = self.episode.as_ref();
        let e = e.filter(|e| {
            let split = e.footprint.as_ref().is_some_and(|f| f.split.is_some());
            let first = e.lifetimes.is_empty();
            e.follows && (e.live > 0 || first) && (e.confirmed || split)
        });
        let f = e.and_then(|e| e.footprint.as_ref());
        f.map_or(0, |f| f.expected)
    }

    /// Remembers that an episode of signature `sig` made no plan, after `work` steps.
    fn remember_rejected(&mut self, sig: u64, work: u64) {
        self.rejected[self.next_rejected] = Some((sig, work));
        self.next_rejected = (self.next_rejected + 1) % REMEMBERED_REJECTIONS;
    }

    /// The work and plan of the last plan made, when it was packed from this episode (of
    /// signature `sig`, and the same lifetimes: two episodes may share a signature).
    fn made_before(&self, sig: u64, lifetimes: &[Lifetime]) -> Option<(u64, Plan)> {
        let (made, work, plan) = self.made.as_ref()?;
        (*made == sig && plan.lifetimes == lifetimes).then(|| (*work, plan.clone()))
    }

    /// The work of the evaluation of an episode of signature `sig` that made no plan, when it is
    /// among the last [`REMEMBERED_REJECTIONS`].
    fn rejected_work(&self, sig: u64) -> Option<u64> {
        self.rejected
            .iter()
            .flatten()
            .find(|r| r.0 == sig)
            .map(|r| r.1)
    }

    /// Brings the work debt up to date with the allocations made since; true when it is at most
    /// [`EVALUATION_WORK_AHEAD`], so that an episode may be evaluated.
    fn may_work(&mut self, stats: &Stats) -> bool {
        let now = stats.allocation.0[0].allocated;
        let earned = now.saturating_sub(self.allocations).max(0) as u64 * EVALUATION_WORK_PER_ALLOC;
        self.allocations = now;
        self.debt = self.debt.saturating_sub(earned);
        self.debt <= EVALUATION_WORK_AHEAD
    }

    /// True while there is a plan to place episodes by.
    pub fn has_plan(&self) -> bool {
        self.plan.is_some()
    }

    /// True while the open episode has two or more of its allocations live: a large block
    /// freed now is one of several the episode's packing will place together.
    pub fn episode_busy(&self) -> bool {
        self.episode.as_ref().is_some_and(|e| e.live >= 2)
    }

    /// Forgets the kept ranges of the last footprints when they lie in segment `segment`, which
    /// was just released.
    pub(crate) fn forget_segment(&mut self, segment: u32) {
        if self.last.is_some_and(|(s, _, _)| s == segment) {
            self.last = None;
            self.other = None;
        }
    }

    /// The cached pages of the last footprints while there is a plan: giving memory back leaves
    /// them alone up to twice the budget.
    pub(crate) fn protected(&self) -> Option<Kept> {
        self.plan.as_ref()?;
        let (segment, lo, hi) = self.last?;
        let other = self.other.unwrap_or((hi, hi));
        Some(Kept {
            segment,
            ranges: [(lo, hi), other],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::footprint::stretched;
    use super::*;

    #[test]
    fn evaluations_wait_while_their_work_is_not_earned_back() {
        let mut plans = Plans::default();
        let mut stats = Stats::default();
        assert!(plans.may_work(&stats));
        plans.debt = EVALUATION_WORK_AHEAD + 10 * EVALUATION_WORK_PER_ALLOC;
        stats.allocation.0[0].allocated = 9;
        assert!(!plans.may_work(&stats), "one allocation short");
        stats.allocation.0[0].allocated = 10;
        assert!(plans.may_work(&stats));
        assert_eq!(plans.debt, EVALUATION_WORK_AHEAD);
    }

    #[test]
    fn a_remembered_plan_is_given_back_only_to_the_episode_it_was_packed_from() {
        let t = |size, start, end| Lifetime { size, start, end };
        let a = vec![t(2 << 20, 0, 2), t(2 << 20, 1, 3)];
        let b = vec![t(3 << 20, 0, 2), t(2 << 20, 1, 3)];
        let plan = super::super::packing::pack(&a);
        let plans = Plans {
            made: Some((signature(&a), 77, plan)),
            ..Plans::default()
        };
        assert_eq!(plans.made_before(signature(&a), &a).map(|m| m.0), Some(77));
        // Another episode under the same signature (a collision) gets nothing.
        assert!(plans.made_before(signature(&a), &b).is_none());
        assert!(plans.made_before(signature(&b), &b).is_none());
        // Fields do not share bits, so they cannot cancel out: 3 MiB freed at tick 2 and 2 MiB
        // freed at tick 3 give the same term under a sum that mixes them (size ^ end << 20).
        let (c, d) = (vec![t(3 << 20, 0, 2)], vec![t(2 << 20, 0, 3)]);
        let old = |l: &[Lifetime]| l[0].size ^ (u64::from(l[0].end) << 20);
        assert_eq!(old(&c), old(&d));
        assert_ne!(signature(&c), signature(&d));
    }

    #[test]
    fn kept_ranges_are_forgotten_with_their_segment() {
        let mut plans = Plans {
            plan: Some(super::super::packing::pack(&[Lifetime {
                size: 1 << 20,
                start: 0,
                end: 1,
            }])),
            last: Some((3, 100, 200)),
            other: Some((300, 400)),
            ..Plans::default()
        };
        plans.forget_segment(2);
        let kept = plans
            .protected()
            .expect("another segment's release keeps them");
        assert_eq!(kept.ranges, [(100, 200), (300, 400)]);
        plans.forget_segment(3);
        assert_eq!(plans.protected(), None);
        assert_eq!(plans.other, None);
    }

    #[test]
    fn sizes_match_up_to_rounding_at_any_scale() {
        assert!(matches(3 << 20, 1 << 20, 3.0, true));
        assert!(matches((3 << 20) + 512, 1 << 20, 3.0, true));
        assert!(!matches(4 << 20, 1 << 20, 3.0, true));
        // A little smaller still matches (a layer whose height rounds down); larger does not.
        assert!(matches(97 << 20, 100 << 20, 1.0, true));
        assert!(!matches(90 << 20, 100 << 20, 1.0, true));
        assert!(!matches(103 << 20, 100 << 20, 1.0, true));
        // Offsets stretch enough that a size rounded up after scaling fits before the next.
        let (size, scale) = (1u64 << 20, 2.999);
        let rounded = ((size as f64 * scale) as u64).div_ceil(512) * 512;
        assert!(stretched(size, scale) >= rounded);
    }
}
