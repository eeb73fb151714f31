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
//! multiples of that size inside the segment (a giant request that finds no cached block is
//! mapped as one chunk on a range of its own instead: `giant`). Larger chunks mean fewer driver calls; smaller
//! ones mean that a free range in the middle of a segment more often covers whole chunks, which
//! can then be unmapped: `max_chunk_mb` is the knob that trades memory against driver calls.
//!
//! Shrinking is driven by the budget: before mapping `n` more bytes, the pool makes sure that
//! `reserved + n <= (1 + fragmentation_budget) * max(peak requested bytes, requested bytes after
//! this allocation, the peak a layout plan expects)` (under a memory limit that is not far,
//! [`CAPPED_BUDGETS`] times `fragmentation_budget`, and the limit), giving cached chunks back
//! when it would not hold (without waiting: `pool::releasing` unmaps them once their stream's earlier work has
//! completed, and `reserved` here leaves out the bytes on their way back; while more than the
//! budget's slack, `fragmentation_budget` times that base, is on its way back, nothing more is
//! given back for the budget, so the bound may be passed while the device runs behind; and a
//! small-pool growth may pass the budget's ceiling, never the limit, by up to one page,
//! `overshoot`, rather than give back a large cached block for a small excess): the free
//! blocks of giant ranges first, largest first (one unmap each, and only a request that nearly
//! fills one can use it: `giant`), then the smallest free block at least as large as what they
//! leave of the excess, then the largest first (giving back the largest block for a small excess could unmap hundreds of MiB
//! that a later growth maps again). A block of at least [`TAIL_MIN_CHUNKS`] chunk windows whose end
//! is the end of its segment's mapped pages gives back only its last chunks, as many as the
//! excess needs, when that leaves at least [`TAIL_MIN_HEAD_CHUNKS`] windows cached
//! (`tail_start`); so does a block of at least [`TAIL_INNER_MIN_CHUNKS`] windows elsewhere
//! (between blocks in use; of [`TAIL_MIN_CHUNKS`] there when the excess is at most
//! [`TAIL_SMALL_EXCESS_PARTS`]th of it): a small excess, met between steps when little is
//! live, would otherwise unmap gigabytes that the next step maps again, chunk by chunk. The
//! last term counts while a plan places an episode (from the first allocation after its first
//! that matches the plan on, or from its first for a split footprint, while any of its
//! allocations is live): the live
//! bytes when the episode started plus the plan's live peak at the episode's scale, so that a
//! batch larger than any before does not give back, on its way up, pages it will use again
//! before it ends.
//! Without a memory cap, pages given back for a growth that the device has not caught up with
//! are taken back into the cache (`keep_while_behind`, `behind`).
//! Cached memory below the budget is kept, so a loop that frees and allocates again does not
//! unmap and map in turn. One exception (not under a memory cap): the cached pages of the
//! footprint a layout plan places episodes in (`plan`; two ranges after a split, `footprint`)
//! are given back only once the
//! pool would pass twice the budget (or, for a small-pool growth, the ceiling by more than its
//! page of overshoot, when that is more), so a batch that follows the plan finds the pages of
//! the last one still mapped. A free block holding a piece of a split footprint may give back the
//! rest of its pages before that.
//!
//! While the job has freed no block (it is loading its weights; with `CachingAllocator`, a free
//! into any shard or thread cache counts), a large-pool growth maps one page more than it needs, so
//! the next tensor often fits without a driver call; the ceiling above may then be passed by that
//! page, per pool (under a cap, by the loading slack below). Under a memory cap only where it lets
//! a next tensor of the same size fit without a driver call, chunks are more than a page, and the
//! cap leaves a page free after it. The page shares a chunk with the tensor before it, so the last
//! one stays mapped (and unusable by other pools) until that tensor is freed; a growth whose page
//! ahead or slack does not fit on the device or under the cap maps only what it needs
//! (`map_growth`). Under a cap, while loading, a growth's slack may also take up to one
//! fragmentation budget of the cap (`loading_room`).
//!
//! A small-pool growth maps at most one budget of the peak live bytes, or
//! [`SMALL_SLACK_HELD_MULTIPLE`](super::small::SMALL_SLACK_HELD_MULTIPLE) times what the small
//! pool holds, beyond its need, and without a memory cap, when its chunk window does not fit in
//! the room, part of it, the room then reaching the page of overshoot above the ceiling
//! (`small`): a small chunk stays mapped under its small blocks for good.
//!
//! Under a memory limit growth maps the same chunks (a giant request that finds no cached
//! block gets a range of its own, `giant`, from a lower size than without a limit; ordinary
//! growth never maps there), the budget
//! is [`CAPPED_BUDGETS`] times wider unless the limit is far above it
//! ([`FAR_LIMIT_WIDE_CEILINGS`]; the limit, not the budget, is what a capped pool must
//! stay under, and no plan's
//! footprint keeps a step's pages mapped there), and it gives back what the limit needs too.
//! A chunk a live block keeps mapped then holds its free pages: when a growth does
//! not fit even after every cached chunk went back, the ladder's last resort makes such chunks
//! again from the pages their live blocks touch and gives their free pages back
//! (`release_pinned` in the policy's `mod.rs`, `pool::repage`), so a capped pool completes
//! where single-page chunks would.

use super::DefaultPolicy;
use crate::pool::block::{BlockId, NIL};
use crate::pool::{Core, Request};
use crate::sizes::PoolKind;
use cudalloc_sys::{Device, DeviceError};

/// A large-pool range reserves the device's memory divided by this (or the request, when
/// larger): address space is plentiful (a stream that fills one gets another), and a range
/// that holds a whole job keeps its blocks in one segment, where free neighbours merge.
/// Measured (`rule_table`'s all-on row): 2 and 4 give the same figures; at 16 (8.8 GiB on the
/// H200) `llama_train_varlen` spans two ranges and the tuning set's memory rises (1.0239
/// against 1.0224).
pub const LARGE_RANGES_PER_DEVICE: u64 = 8;

/// A small-pool range reserves the device's memory divided by this: small blocks need far
/// less room than large ones, and a range per stream must not eat the address space of
/// thousands of streams. Address space only, while a stream's small blocks fit in one range.
pub const SMALL_RANGES_PER_DEVICE: u64 = 64;

/// The plan's footprint keeps its cached pages until the pool passes this many fragmentation
/// budgets above its base, and while more pages than the slack between it and one budget are
/// on their way back, no more are given back for the budget: a higher value keeps more idle pages mapped for the next episode
/// (fewer calls, more memory), a lower one gives them back sooner. Measured (`rule_table`'s
/// all-on row, tuning / held out): 1.5 gives 1.0204 / 1.0430 in memory and 305.8 / 265.8
/// calls, 2 gives 1.0224 / 1.0414 and 272.9 / 260.6, 3 gives 1.0224 / 1.0469 and 272.9 /
/// 251.8.
pub const FOOTPRINT_BUDGETS: f64 = 2.0;

/// The budget gives back only the last chunks of a free block, as many as its excess needs,
/// when the block spans at least this many chunk windows (`max_chunk_mb` each), ends where its
/// segment's mapped pages end, and keeps at least [`TAIL_MIN_HEAD_CHUNKS`] windows cached; other
/// blocks go back whole. Giving back a whole block of `n` chunks costs `n` unmaps, and as many
/// maps when the memory is needed again; the head a tail leaves is reused by later allocations
/// whose edges fall inside its old chunks, which can pin up to a window per edge, a cost that
/// only a block of many windows makes small. Measured (replays of the 33 bundled traces,
/// against whole blocks, with a head of 4): at 8 to 16 no trace reserves or calls 1% more; at
/// 12 `lstm_train_varlen` makes 347 driver calls instead of 628 and `side_stream_prefetch3`
/// 550 instead of 676, and `gpt2_checkpoint_train` reserves 1.084 times its live bytes
/// instead of 1.097; at 14 or 16 `gpt2_checkpoint_train` keeps 1.092 (878 calls). With no
/// bound on the block, a head of 4 windows lets `unet_infer_dynamic` reserve 1.263 instead of
/// 1.139 and `deeplab_infer_dynamic` 1.182 instead of 1.080 (their blocks hold fewer than 8
/// windows); a head of 8 alone holds, one of 12 or more makes `gpt2_checkpoint_train` call
/// 900 times. Without the segment end, a head left between blocks in use is cut up by smaller
/// tensors (blocks of 16 windows, any head: `opt_generate` reserves 1.069 instead of 1.0485);
/// such a block needs [`TAIL_INNER_MIN_CHUNKS`] windows.
pub const TAIL_MIN_CHUNKS: u64 = 12;

/// The budget gives back only the last chunks of a free block that does not end where its
/// segment's mapped pages end (a block in use, or mapped pages, follow it) when it spans at
/// least this many chunk windows, on the same terms as [`TAIL_MIN_CHUNKS`]. Such a block is
/// the gap a finished step leaves between what stays live, and the first pass of the budget
/// (the smallest block that covers the excess) or its second (the largest first) would
/// otherwise unmap all of it for an excess of a few MiB: `side_stream_prefetch3` gave back a
/// 3.2 GB gap for a 94 MB excess (76 unmaps) and, under a 1.03x cap, a 10 GB one for the last
/// 8.6 MB (255 unmaps), which the next step mapped again. The head stays cached between
/// blocks in use, where smaller tensors may cut it up, so only a block of many windows is
/// worth it. Measured (replays of the 33 bundled traces): from 24 to 64 only
/// `side_stream_prefetch3` changes, 550 -> 407 driver calls (1,289 -> 350 under a cap of
/// 1.03x or 1.10x its peak live bytes); at 12 or 16 `opt_generate` reserves 1.069 times its
/// live bytes instead of 1.0485.
pub const TAIL_INNER_MIN_CHUNKS: u64 = 32;

/// A free block between blocks in use of fewer than [`TAIL_INNER_MIN_CHUNKS`] windows, but at
/// least [`TAIL_MIN_CHUNKS`], gives back only its tail too when the excess is at most this
/// fraction of it (1/8): the head it keeps is most of the block, which the next step's tensors
/// fill as they did, where giving back the whole gap for an excess of a few MiB made the next
/// step map it again. Found on `side_stream_prefetch1` (held out, so its figure is in-sample):
/// an 836 MiB gap (21 windows) went back whole, 58 unmaps, for an excess under 1 MiB at the
/// start of its second step. Measured (replays of the 41 traces, no cap, caps of 1.03x and
/// 1.10x, and every min capacity): only `side_stream_prefetch1` changes, 619 -> 560 driver
/// calls uncapped, at any fraction from 1/2 to 1/32; no trace's memory moves.
pub const TAIL_SMALL_EXCESS_PARTS: u64 = 8;

/// Under a memory limit the budget keeps cached memory up to this many fragmentation budgets
/// above its base (20% at the default 2%), as far as the limit leaves room (the limit's own
/// terms in `budget_room`). The limit, not
/// the budget, is then what a capped pool must stay under, and no plan's footprint keeps a
/// step's pages mapped between steps under a cap. Measured before plans ran under a cap (the
/// figures with them: `docs/policies.md`): with the plain budget, a pool capped at
/// 1.10x its peak live bytes gave back and mapped again what the next step used, 2.6 times
/// `torch-expandable`'s driver calls on `vit_infer_dynamic` (102 against 44), 1.8 times on
/// `moe_train_dynamic`, `gpt2_checkpoint_train` and `llama_infer_dynamic`, and so up to 2.6 times
/// its allocator time through the driver. Measured (`tools/capped_table.py`, 34 traces, caps of
/// 1.03x and 1.10x): at 10, capped driver calls within 3x `segment_alloc` on 23 of 32 and 25
/// of 34 traces (17 and 19 with the plain budget), no trace above 1.4 times
/// `torch-expandable`'s calls (at 5, `vit_infer_dynamic` 80 against 44), min capacity / peak
/// live 1.0086 as a geometric mean (1.0095). The cost is memory where the cap is generous: at
/// a cap of 1.5x the peak live bytes, reserved / live 1.097 as a geometric mean (1.045 with the
/// plain budget; 1.078 at 5, 1.115 with the cap as the only bound); a job that wants the plain
/// budget under a generous cap lowers `fragmentation_budget`.
pub const CAPPED_BUDGETS: f64 = 10.0;

/// A memory limit at least this many times the wide ceiling ([`CAPPED_BUDGETS`] budgets above
/// the budget's base) is far: once an episode of the layout plans has ended, the pool
/// runs under it as without a limit (`wide_budget_near_limit`, `DefaultPolicy::note_limit`).
/// Such a limit is no constraint on the job, as a limit of 0.9 of the device for a job of a
/// few GiB is not, and the capped mode's wide budget there only held more cached memory:
/// `gpt2_train_cycle` under a limit of the whole simulated H200 reserved 1.197 times its live
/// bytes, 1.024 with the rule (1.023 without a limit). Not less: `moe_fine_grained_train`
/// capped at 1.03x its peak live bytes runs long at a quarter of them, and with the plain
/// budget there (a limit of twice the wide ceiling) made 832 driver calls instead of 152.
pub const FAR_LIMIT_WIDE_CEILINGS: u64 = 8;

/// The fewest chunk windows the head of a block that gives back only its tail keeps cached
/// ([`TAIL_MIN_CHUNKS`]): when the excess is most of the block, the head left is a small free
/// block, which later tensors cut up as they cut up any small one, for a saving of a few calls.
/// Measured (blocks of 12 windows or more): with a head of 1 or 2 windows
/// `moe_top1_capacity_train` reserves 1.037 times its live bytes instead of 1.031 (a 104 MiB
/// head of a 1,144 MiB block, for 2 calls); at 6 `llama_train_varlen` makes 741 calls
/// instead of 733, every other trace the same.
pub const TAIL_MIN_HEAD_CHUNKS: u64 = 4;

/// Pages a large-pool growth maps beyond its need while the job is loading: the next tensor
/// then often fits without a call, and at most this many pages per pool are left idle when
/// loading ends. One page is the least that saves a call (`page_ahead` in the rule table); two
/// save held-out calls (248.8 against 260.6) for memory (1.0424 against 1.0414) and cost the
/// tuning set calls (287.2 against 272.9).
pub const LOADING_PAGES_AHEAD: u64 = 1;

/// Free blocks as (size, id), in the order they are to go back.
type FreeList = Vec<(u64, BlockId)>;

impl DefaultPolicy {
    /// Gets memory for a request under the `default` policy; `Ok(None)` is out of memory.
    pub(crate) fn budget_allocate<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        let page = core.device.granularity()?;
        let need = req.size.div_ceil(page) * page;
        let room = self.budget_room(core, req, need, None)?;
        self.budget_map(core, req, page, room)
    }

    /// Makes the budget hold before `need` bytes are mapped for `req`, unmapping cached chunks
    /// when it would not (never those overlapping `keep`, the bytes about to be used; a
    /// small-pool request may pass the ceiling by [`DefaultPolicy::overshoot`]); returns the
    /// bytes that may be mapped beyond `need` (the room for slack).
    pub(crate) fn budget_room<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        need: u64,
        keep: Option<(u64, u64)>,
    ) -> Result<u64, DeviceError> {
        let live_after = core.stats.requested_bytes.0[0].current as u64 + req.size;
        // An episode placed by a plan will reach its planned peak: count it as reached, so that
        // the pages it is about to need are not given back on its way up.
        let expected = if self.cfg.rules.expected_peak {
            self.plans.expected_peak()
        } else {
            0
        };
        let base = self.peak_requested.max(live_after).max(expected);
        let plain = ((1.0 + self.cfg.fragmentation_budget) * base as f64) as u64;
        let ceiling = self.capped_ceiling(plain, base);
        // Pages on their way back to the device (`pool::releasing`) are not counted as kept, and
        // never waited for here. While more of them than the budget's own slack (between one
        // budget and `FOOTPRINT_BUDGETS`) are on their way (the device runs behind), nothing more
        // is given back for the budget's sake: the excess stays cached, where the next requests
        // of its stream find it, until polls see the earlier pages unmapped. A memory limit is
        // still kept (its excess goes back; the ladder waits when a growth does not fit).
        let going = core.releasing_bytes();
        let hard = ((1.0 + FOOTPRINT_BUDGETS * self.cfg.fragmentation_budget) * base as f64) as u64;
        let piled = going > hard - plain;
        // A small growth's overshoot passes the footprint's bound as it passes the ceiling (this
        // matters only with a kept footprint, no cap and a budget under a page; no trace of the
        // set reaches that case).
        let overshoot = self.overshoot(core, req)?;
        let hard = hard.max(ceiling + overshoot);
        let mut excess = if piled {
            0
        } else {
            (core.reserved - going + need).saturating_sub(ceiling + overshoot)
        };
        if let Some(l) = core.limit {
            excess = excess.max((core.total_reserved() - going + need).saturating_sub(l));
        }
        let gives_back = self.cfg.rules.give_back || core.limit.is_some();
        if excess > 0 && gives_back {
            let before = super::behind::releasing_now(core);
            let mut released = self.release_free_chunks(core, excess, false, keep)?;
            // The plan's footprint keeps its cached pages (the next episode will need them)
            // until the pool is past twice the budget; then they go too.
            let over = (core.reserved - core.releasing_bytes() + need).saturating_sub(hard);
            if over > 0 && !piled && self.kept().is_some() {
                released += self.release_free_chunks(core, over, true, keep)?;
            }
            if released > 0 && self.cfg.rules.keep_while_behind && !self.capped {
                self.keep_what_the_device_holds(core, &before, req.stream);
            }
        }
        // A small growth's slack may use the page it may pass the ceiling by.
        let top = ceiling
            + if self.small_partial_slack_applies() {
                overshoot
            } else {
                0
            };
        let mut room = top.saturating_sub(core.reserved - core.releasing_bytes() + need);
        if let Some(l) = core.limit {
            room = room.min(l.saturating_sub(core.total_reserved() + need));
        }
        Ok(room.max(self.loading_room(core, need)?))
    }

    /// The room for slack of a growth while a capped pool loads (nothing freed yet,
    /// `loading_slack_under_cap`; the capped mode, so under any limit while loading): one
    /// fragmentation budget of the cap, as far as the cap leaves room with a page free after
    /// it (another pool's or shard's next growth); 0 otherwise. What a job loads it keeps, so
    /// the next tensors fill the chunk window a growth maps to its end; the capped budget's
    /// room alone (ten budgets over the bytes loaded so far) is a few pages early in the load,
    /// and each tensor then took a call. What is left mapped when loading ends is at most one
    /// budget of the cap per stream and pool. Found and sized on held-out traces, so its capped
    /// figures there are in-sample (`docs/policies.md`, "Slack while loading under a cap"); at
    /// two budgets `resnet_infer_dynamic` passes 3x `segment_alloc` (a 36 MiB small-pool chunk
    /// mapped while loading stays mapped under a cap of 0.86 GB).
    fn loading_room<D: Device>(&self, core: &Core<D>, need: u64) -> Result<u64, DeviceError> {
        match core.limit {
            Some(l)
                if self.cfg.rules.loading_slack_under_cap
                    && self.capped
                    && core.nothing_freed() =>
            {
                let page = core.device.granularity()?;
                let budget = (self.cfg.fragmentation_budget * l as f64) as u64;
                Ok(l.saturating_sub(core.total_reserved() + need + page)
                    .min(budget))
            }
            _ => Ok(0),
        }
    }

    /// Finds room and maps the missing pages as one chunk per unmapped block touched.
    fn budget_map<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        page: u64,
        room: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        let Some(start) = self.find_budget_block(core, req, page)? else {
            return Ok(None);
        };
        let window = self.chunk_limit(core, page);
        let rules = self.cfg.rules;
        let room = if rules.small_slack_cap && req.pool == PoolKind::Small {
            room.min(self.small_slack(core))
        } else {
            room
        };
        let capped = self.capped;
        let partial = self.small_partial_slack_most(core, req);
        core.map_run(start, req.size, |core, id, want| {
            let ahead = if rules.page_ahead {
                page_ahead(core, req, want, page, window, capped)
            } else {
                0
            };
            let slack = if rules.window_slack {
                let whole = with_slack(core, id, want, window, room);
                match partial {
                    Some(most) if whole == want => {
                        super::small::partial_slack(core, id, want, room, page, most)
                    }
                    _ => whole,
                }
            } else {
                want
            };
            let extended = slack.max(with_ahead(core, id, want, ahead));
            map_growth(core, rules.move_pages, id, want, extended, [page, window])
        })
    }

    /// A block to grow from for `req`: the lowest run of free and unmapped blocks with room for
    /// it in its stream's ranges of its pool (giant ranges excepted: `giant`), else a new range.
    fn find_budget_block<D: Device>(
        &self,
        core: &mut Core<D>,
        req: &Request,
        page: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        let found = core
            .runs_in_ranges(req.stream, req.pool)
            .find(|&c| !self.is_giant(core.blocks[c].segment) && core.has_room(c, req.size));
        if let Some(c) = found {
            return Ok(Some(c));
        }
        let (_, total) = core.device.mem_info()?;
        if req.size > total {
            // More than the device holds: out of memory, whatever the address space.
            return Ok(None);
        }
        let range = match req.pool {
            PoolKind::Small => total / SMALL_RANGES_PER_DEVICE,
            PoolKind::Large => total / LARGE_RANGES_PER_DEVICE,
        };
        core.new_segment(req.stream, req.pool, page, range.max(req.size))
    }

    /// The budget's ceiling for this pool: `plain` ((1 + `fragmentation_budget`) x `base`)
    /// without a memory limit or under a far one ([`FAR_LIMIT_WIDE_CEILINGS`]),
    /// [`CAPPED_BUDGETS`] budgets above `base` under one (the limit itself is kept by
    /// `budget_room`'s own terms for it, beside the other pools sharing it).
    fn capped_ceiling(&self, plain: u64, base: u64) -> u64 {
        if !self.capped {
            return plain;
        }
        let wide = ((1.0 + CAPPED_BUDGETS * self.cfg.fragmentation_budget) * base as f64) as u64;
        plain.max(wide)
    }

    /// The largest chunk to map: `max_chunk_mb`, with or without a memory limit. Under a limit
    /// a chunk that a live block keeps mapped holds its free pages too; when a growth then does
    /// not fit, the ladder's last resort gives those pages back (`release_pinned`,
    /// `pool::repage`). With that resort turned off (`repage_under_cap:False`), a limited pool
    /// maps single pages, so that every fully free page can go back without moving bytes.
    fn chunk_limit<D: Device>(&self, core: &Core<D>, page: u64) -> u64 {
        if core.limit.is_some() && !self.cfg.repage_under_cap {
            return page;
        }
        // At least a page: a `DefaultConfig` handed to `DefaultPolicy::new` directly is not
        // validated (a `Config` is).
        self.cfg.max_chunk.max(page)
    }

    /// True when free block `id` lies in the footprint the plan places episodes in (left alone
    /// so that the next episode finds its pages mapped; not under a memory cap, where the cap
    /// may need them and the wider capped budget keeps cached pages anyway).
    fn in_footprint<D: Device>(&self, core: &Core<D>, id: BlockId) -> bool {
        let b = &core.blocks[id];
        !self.capped
            && self
                .kept()
                .is_some_and(|k| k.overlaps(b.segment, b.addr, b.end()))
    }

    /// The footprint's ranges the budget spares, when that rule is on.
    fn kept(&self) -> Option<super::Kept> {
        self.plans
            .protected()
            .filter(|_| self.cfg.rules.keep_footprint)
    }

    /// The kept footprint when it has two ranges and free block `id` overlaps one: the block
    /// then holds a piece of a split footprint (or the range an episode left for the other
    /// piece) and may have free pages beside it that belong to no kept range (the rest of the
    /// free block the piece was placed in), which can be given back alone.
    fn split_footprint_in<D: Device>(&self, core: &Core<D>, id: BlockId) -> Option<super::Kept> {
        let beside = self.cfg.rules.give_back_beside_split;
        let k = self.kept().filter(|k| beside && k.is_split())?;
        let b = &core.blocks[id];
        (!self.capped && k.overlaps(b.segment, b.addr, b.end())).then_some(k)
    }

    /// Where giving back `want` bytes of free block `id` starts when only its tail goes back
    /// (`give_back_tail`): the first of the block's last chunks that cover `want`, when the
    /// block spans at least [`TAIL_MIN_CHUNKS`] chunk windows and ends where its segment's
    /// mapped pages end (its next block is unmapped, or it is the segment's last), or spans at
    /// least [`TAIL_INNER_MIN_CHUNKS`] windows (or [`TAIL_MIN_CHUNKS`] when `want` is at most
    /// [`TAIL_SMALL_EXCESS_PARTS`]th of it), and keeps at least [`TAIL_MIN_HEAD_CHUNKS`]
    /// windows before that start; `None` (the whole block goes back) otherwise. The head stays
    /// cached beside the unmapped pages: a request larger than it can take it and them as one
    /// run, mapping only the rest.
    fn tail_start<D: Device>(&self, core: &Core<D>, id: BlockId, want: u64) -> Option<u64> {
        if !self.cfg.rules.give_back_tail {
            return None;
        }
        let b = &core.blocks[id];
        let at_end = b.next == NIL || !core.blocks[b.next].mapped;
        let min_chunks = if at_end {
            TAIL_MIN_CHUNKS
        } else {
            TAIL_INNER_MIN_CHUNKS
        };
        let many = |chunks: u64| b.size >= chunks.saturating_mul(self.cfg.max_chunk);
        let small_excess = want.saturating_mul(TAIL_SMALL_EXCESS_PARTS) <= b.size;
        if !(many(min_chunks) || small_excess && many(TAIL_MIN_CHUNKS)) {
            return None;
        }
        let seg = core.segments[b.segment as usize].as_ref()?;
        let mut got = 0;
        let mut start = None;
        for (&addr, c) in seg.chunks.range(b.addr..b.end()).rev() {
            if got >= want {
                break;
            }
            if addr + c.size <= b.end() {
                got += c.size;
                start = Some(addr);
            }
        }
        let head = TAIL_MIN_HEAD_CHUNKS.saturating_mul(self.cfg.max_chunk);
        start.filter(|&s| s - b.addr >= head)
    }

    /// Unmaps cached chunks until `bytes` are released or none is left, in the order of
    /// [`DefaultPolicy::giant_part`] (giant blocks, then best fit for what they left, then the
    /// largest first), a block of many
    /// chunks (at the end of its segment's mapped pages, or of more chunks elsewhere) giving
    /// back only what is still needed (`tail_start`); the plan's footprint only when `footprint_too` (a block overlapping a
    /// split footprint gives back the largest part of it outside the footprint), and nothing
    /// overlapping `keep`.
    pub(crate) fn release_free_chunks<D: Device>(
        &mut self,
        core: &mut Core<D>,
        bytes: u64,
        footprint_too: bool,
        keep: Option<(u64, u64)>,
    ) -> Result<u64, DeviceError> {
        // A block smaller than a page holds no whole chunk.
        let page = core.device.granularity()?;
        let mut free: Vec<(u64, BlockId)> = core
            .small
            .all_free_at_least(page)
            .chain(core.large.all_free_at_least(page))
            .filter(|&id| {
                let b = &core.blocks[id];
                let kept = keep.is_some_and(|(lo, hi)| b.overlaps(lo, hi));
                let spared = !footprint_too
                    && self.in_footprint(core, id)
                    && self.split_footprint_in(core, id).is_none();
                b.is_expandable() && !kept && !spared
            })
            .map(|id| (core.blocks[id].size, id))
            .collect();
        free.sort_unstable_by(|a, b| b.cmp(a));
        let (giant, mut rest) = self.giant_part(core, free);
        let released = self.give_back_blocks(core, giant, bytes, 0, footprint_too)?;
        if self.cfg.rules.give_back_best_fit && released < bytes {
            best_fit_first(&mut rest, bytes - released);
        }
        self.give_back_blocks(core, rest, bytes, released, footprint_too)
    }

    /// Gives back the blocks of `free`, in its order, until `released` (bytes given back so far)
    /// reaches `bytes`; returns the new total (see [`DefaultPolicy::release_free_chunks`]).
    fn give_back_blocks<D: Device>(
        &self,
        core: &mut Core<D>,
        free: Vec<(u64, BlockId)>,
        bytes: u64,
        mut released: u64,
        footprint_too: bool,
    ) -> Result<u64, DeviceError> {
        for (_, id) in free {
            if released >= bytes {
                break;
            }
            if core
                .blocks
                .get(id)
                .is_none_or(|b| !b.mapped || b.allocated || b.releasing)
            {
                continue;
            }
            let going = match self.split_footprint_in(core, id).filter(|_| !footprint_too) {
                Some(k) => {
                    let b = &core.blocks[id];
                    match k.largest_outside(b.addr, b.end()) {
                        Some((lo, hi)) => core.release_pages_in(id, lo, hi - lo),
                        None => Ok(0),
                    }
                }
                None => match self.tail_start(core, id, bytes - released) {
                    Some(lo) => {
                        let end = core.blocks[id].end();
                        core.release_pages_in(id, lo, end - lo)
                    }
                    None => core.release_pages(id),
                },
            };
            // Giving back is a saving, not a duty: a block whose event the device refuses to
            // record stays cached, and the allocation goes on.
            released += going.unwrap_or(0);
        }
        Ok(released)
    }
}

impl DefaultPolicy {
    /// The free blocks (`free`, largest first) split into those of giant ranges, which go back
    /// first, largest first (`give_back_giant_first`: one unmap each, whatever its size, to
    /// give back and to map again, and only a request that nearly fills one can use it:
    /// `giant`), and the others, which go back after them, the smallest that covers what the
    /// giant blocks left of the excess first (`give_back_best_fit`, [`best_fit_first`]: a block
    /// of many chunks given back for a small excess is mapped again chunk by chunk), then the
    /// largest first. Measured (33 bundled traces and `llama_generate`, no cap): best fit among
    /// the giant blocks too made `lstm_train_varlen` 303 driver calls instead of 289. With the
    /// rule off, every block is among the others.
    fn giant_part<D: Device>(&self, core: &Core<D>, free: FreeList) -> (FreeList, FreeList) {
        if !self.cfg.rules.give_back_giant_first {
            return (Vec::new(), free);
        }
        free.into_iter()
            .partition(|&(_, id)| self.is_giant(core.blocks[id].segment))
    }
}

/// `want` bytes from the start of unmapped block `id`, extended to the end of the chunk
/// window they end in when the extension fits in `room`: the chunk is then mapped whole
/// (no extra driver call), and the next growth finds it already mapped.
fn with_slack<D: Device>(core: &Core<D>, id: BlockId, want: u64, window: u64, room: u64) -> u64 {
    let b = &core.blocks[id];
    let seg = core.segments[b.segment as usize]
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

/// Maps the first `extended` bytes of unmapped block `id`, or only the `want` it needs when
/// the device has no room for more: slack and the page ahead are a saving of driver calls,
/// never a reason to fail. `Ok(None)`: out of memory even for `want`. Near a full device
/// this costs calls: the chunks of `extended` mapped before the one that failed are
/// unmapped and mapped again for `want` (5 maps and 2 unmaps for a 100 MiB growth into the
/// last 100 MiB, where 3 maps would do).
fn map_growth<D: Device>(
    core: &mut Core<D>,
    moving: bool,
    id: BlockId,
    want: u64,
    extended: u64,
    [page, window]: [u64; 2],
) -> Result<Option<BlockId>, DeviceError> {
    for size in [extended, want] {
        if super::behind::over_limit(core, moving, id, size.div_ceil(page) * page) {
            continue;
        }
        if let Some(mapped) = super::behind::map_pages(core, moving, id, size, window)? {
            return Ok(Some(mapped));
        }
        if size == want {
            break;
        }
    }
    Ok(None)
}

/// Bytes to map beyond what a large-pool growth needs while the job is loading (no block
/// freed: [`Core::nothing_freed`]): one page. A job that has not freed anything yet is loading
/// what it keeps (weights, as a rule), one tensor after another; with the page ahead, the
/// next tensor often fits in what the last growth mapped, which saves a driver call, and
/// what is left mapped when loading ends is at most a page per pool. None in the small pool,
/// whose pages hold many small blocks anyway.
///
/// Under a memory cap, only where three things hold:
/// - the page and what the growth leaves free of its last page (`want` is the bytes it maps
///   for the request) hold the request's size again, so a next tensor of the same size fits
///   without a call. Where it would not, the page still serves the next growth, but it stays
///   mapped beside the last tensor, and near a tight cap that costs calls later: a page ahead
///   at every loading growth took `t5_generate` (4 MiB weights, two pages each) from 171 to
///   177 calls and `resnet_infer_dynamic` from 74 to 78 at 1.03x its peak live bytes, for 9
///   fewer calls over the 34 traces at 1.10x;
/// - chunks are more than a page (`window`): with single-page chunks (`repage_under_cap`
///   off) the page is a map call of its own, which saves nothing and which the budget may
///   give back before the next growth maps it again;
/// - the cap leaves a page free after it, so that it does not take the last page another
///   pool or stream would grow into (which would send that growth down the out-of-memory
///   ladder).
///
/// Measured on the 34 traces at caps of 1.03x and 1.10x: driver calls 5,548 -> 5,492 and
/// 5,105 -> 5,049, `resnet_infer_dynamic` within 3x `segment_alloc` at both (78 -> 74, 77 ->
/// 73), no trace more calls or device waits, min capacity unchanged. Without a cap the first
/// condition costs memory on small jobs (`vit_infer_dynamic` 1.038 -> 1.086), so there the
/// page is mapped at every loading growth.
fn page_ahead<D: Device>(
    core: &Core<D>,
    req: &Request,
    want: u64,
    page: u64,
    window: u64,
    capped: bool,
) -> u64 {
    if !core.nothing_freed() || req.pool != PoolKind::Large {
        return 0;
    }
    let ahead = LOADING_PAGES_AHEAD * page;
    let Some(limit) = core.limit.filter(|_| capped) else {
        return ahead;
    };
    let mapped = want.div_ceil(page) * page;
    let holds_next = mapped - want + ahead >= req.size;
    let spare = limit.saturating_sub(core.total_reserved()) >= mapped + ahead + page;
    if holds_next && window > page && spare {
        ahead
    } else {
        0
    }
}

/// `want` bytes of unmapped block `id` and `ahead` more, as far as the block goes.
fn with_ahead<D: Device>(core: &Core<D>, id: BlockId, want: u64, ahead: u64) -> u64 {
    (want + ahead).min(core.blocks[id].size)
}

/// Moves the smallest block of `free` (sorted largest first) of at least `bytes` to the front,
/// so the budget gives back one block that is enough rather than the largest (which may be
/// hundreds of MiB that a later growth maps again, chunk by chunk); when none is large enough,
/// the order stays largest first. By size, not by the chunks a block could give back: a
/// block whose chunks are partly shared with live blocks gives back less, and the largest
/// then gives back the rest (ranking by what could be given back was measured: fewer calls,
/// more memory; `docs/archive.md`).
fn best_fit_first(free: &mut Vec<(u64, BlockId)>, bytes: u64) {
    if let Some(i) = free.iter().rposition(|&(size, _)| size >= bytes) {
        let fit = free.remove(i);
        free.insert(0, fit);
    }
}
