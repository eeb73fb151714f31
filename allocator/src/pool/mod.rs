//! The caching pool: blocks carved out of segments, found by best fit, split and merged.
//!
//! This is the single-threaded heart of the allocator (the thread-safe front is
//! [`crate::CachingAllocator`]). It follows PyTorch's `DeviceCachingAllocator` rule for rule under
//! the `torch` and `torch-expandable` policies; the `default` policy changes only how segments
//! grow and shrink (see `budget`).
//!
//! Invariants (all checked by [`Pool::check_invariants`]):
//! - the blocks of a segment tile it exactly, in address order through `prev`/`next`;
//! - no two neighbouring blocks are both free and mapped (they would have been merged), except
//!   while one of them waits for stream events;
//! - a block is in its pool's free index iff it is free and mapped, in the unmapped index iff it
//!   is unmapped;
//! - every statistic's `current` equals what a scan of the blocks recomputes;
//! - bytes the device holds for this pool (pages whose release failed included) equal
//!   `reserved_bytes.all.current` (`reserved`).

pub mod block;
mod budget;
mod check;
mod events;
mod expand;
mod footprint;
pub(crate) use footprint::Kept;
pub mod index;
mod packing;
mod pinning;
pub mod plan;
mod release;
mod reserved;
pub(crate) use reserved::fraction_limit;
mod search;
pub mod segment;

use crate::config::{Config, Policy};
use crate::error::AllocError;
use crate::sizes::{self, PoolKind, MIN_BLOCK, SMALL_SIZE};
use crate::stats::{SharedPeak, Stats};
use crate::sync::{Arc, AtomicBool, AtomicU64, Ordering};
use block::{Arena, Block, BlockId, NIL};
use cudalloc_sys::{Device, DeviceError, EventHandle, StreamId};
use index::FreeIndex;
use segment::ExpSegment;
use std::collections::{BTreeMap, VecDeque};

/// What a successful allocation hands out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Device address.
    pub ptr: u64,
    /// Bytes asked for.
    pub size: u64,
    /// Stream the allocation belongs to.
    pub stream: StreamId,
    /// The block behind it (stable while the allocation lives).
    pub block: BlockId,
    /// Which handout of the block this is: two handouts of one address never share it, so a
    /// stale handle (freed, its address handed out again with the same size and stream) is
    /// refused instead of freeing the new owner's block. A pool numbers its handouts with the
    /// top bit set; a thread cache's hit (`CachingAllocator`) takes its cache token, which never
    /// has it.
    pub serial: u64,
}

/// The bit that marks a pool's handout numbers ([`Allocation::serial`]).
pub const POOL_SERIAL: u64 = 1 << 63;

/// A request on its way through the allocation ladder.
pub(crate) struct Request {
    pub stream: StreamId,
    pub pool: PoolKind,
    /// Rounded size.
    pub size: u64,
    /// Size of a new segment for this request.
    pub alloc_size: u64,
}

/// The single-threaded caching pool over a device.
pub struct Pool<D: Device> {
    pub(crate) device: D,
    pub(crate) cfg: Config,
    pub(crate) blocks: Arena,
    pub(crate) small: FreeIndex,
    pub(crate) large: FreeIndex,
    pub(crate) segments: Vec<Option<ExpSegment>>,
    pub(crate) stats: Stats,
    /// Bytes held from the device (PyTorch's `total_allocated_memory`).
    pub(crate) reserved: u64,
    /// Memory cap (PyTorch's `allowed_memory_maximum` once a fraction is set).
    pub(crate) limit: Option<u64>,
    pub(crate) pending: BTreeMap<StreamId, VecDeque<(EventHandle, BlockId)>>,
    pub(crate) spare_events: Vec<EventHandle>,
    pub(crate) peers: Vec<usize>,
    /// Highest sum of requested bytes seen (the `default` policy's budget base; not reset
    /// with the peak statistics).
    pub(crate) peak_requested: u64,
    /// Reserved bytes of every pool sharing this pool's device and limit.
    pub(crate) shared: Option<Arc<AtomicU64>>,
    /// The reserved bytes of the pools of one `CachingAllocator` together, and their peak.
    pub(crate) shared_peak: Option<Arc<SharedPeak>>,
    /// A virtual range could not be reserved in the last growth attempt (address space, not
    /// memory, ran out): the error then says so ([`AllocError::AddressSpace`]).
    pub(crate) reserve_failed: bool,
    /// Episodes and the layout plan (`default` policy).
    pub(crate) plans: plan::Plans,
    /// Allocations handed out so far ([`Allocation::serial`]).
    pub(crate) handouts: u64,
    /// Address and stream of blocks whose free waited for events and has completed since the
    /// last [`Pool::take_completions`], while tracked (`None`: not tracked).
    pub(crate) completions: Option<Vec<(u64, StreamId)>>,
    /// Bytes of pages the device still holds outside every chunk (a release that failed:
    /// [`segment::ExpSegment::stray_bytes`]): not reserved bytes, but counted against the limit
    /// (and in the shared counter) until released.
    pub(crate) strays: u64,
    /// True while the job is loading: no block was freed yet, by this pool or by any pool or
    /// thread cache of the `CachingAllocator` that shares the flag. Every live block is then
    /// one the job allocated and kept (its weights, as a rule), and the `default` policy maps
    /// a page ahead in the large pool (`budget`). Once false, it stays false.
    pub(crate) loading: Arc<AtomicBool>,
    /// The config's memory fraction while it is not yet a limit: the device could not say how
    /// much memory it has when the pool was made; the first allocation tries again.
    pub(crate) fraction: Option<f64>,
}

impl<D: Device> Pool<D> {
    /// A pool with no memory yet.
    pub fn new(device: D, cfg: Config) -> Pool<D> {
        let stats = Stats {
            max_split_size: cfg.max_split_size,
            ..Stats::default()
        };
        let fraction = cfg.memory_fraction;
        let mut pool = Pool {
            device,
            cfg,
            blocks: Arena::default(),
            small: FreeIndex::default(),
            large: FreeIndex::default(),
            segments: Vec::new(),
            stats,
            reserved: 0,
            limit: None,
            pending: BTreeMap::new(),
            spare_events: Vec::new(),
            peers: Vec::new(),
            peak_requested: 0,
            shared: None,
            shared_peak: None,
            reserve_failed: false,
            plans: plan::Plans::default(),
            handouts: 0,
            completions: None,
            strays: 0,
            loading: Arc::new(AtomicBool::new(true)),
            fraction,
        };
        // A failure is kept for the first allocation to report.
        let _ = pool.apply_fraction();
        pool
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The statistics.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Bytes held from the device.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// True while a layout plan places this pool's large blocks (see [`plan`]).
    pub fn has_plan(&self) -> bool {
        self.plans.has_plan()
    }

    /// True while large blocks of this pool must reach it rather than a thread cache: a layout
    /// plan places them, or the episode being recorded has two or more allocations live (a
    /// block kept out of the pool would be missing from the sequence the plan is made from).
    pub fn watches_large_blocks(&self) -> bool {
        self.plans.has_plan() || self.plans.episode_busy()
    }

    /// Allocations placed by a layout plan so far (see [`plan`]).
    pub fn planned_allocations(&self) -> u64 {
        self.plans.placed
    }

    /// Episodes evaluated for a layout plan so far (best fit over each, then packing it; see
    /// [`plan`]), those abandoned as too long included; an episode recognised as one that made
    /// no plan before is not evaluated again.
    pub fn evaluated_episodes(&self) -> u64 {
        self.plans.evaluated
    }

    /// The block behind an id.
    pub fn block(&self, id: BlockId) -> Option<&Block> {
        self.blocks.get(id)
    }

    /// Resets peak statistics. Only the statistics: the `default` policy's budget keeps its
    /// base, the most bytes ever requested at once (a job that resets its peaks every epoch
    /// must not make the pool give back and map again the memory of its next step).
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    /// Caps the bytes the pool may hold from the device (`None`: no cap).
    pub fn set_limit(&mut self, limit: Option<u64>) {
        self.limit = limit;
        self.fraction = None;
    }

    /// The cap, if any.
    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// Peer devices whose access is set on every page mapped from now on.
    pub fn set_peers(&mut self, peers: Vec<usize>) {
        self.peers = peers;
    }

    pub(crate) fn index(&mut self, pool: PoolKind) -> &mut FreeIndex {
        match pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
    }

    /// Allocates `size` bytes on `stream`.
    pub fn allocate(&mut self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        self.allocate_or_grow(size, stream, true)
            .map(|a| a.expect("an allocation that may grow"))
    }

    /// Allocates `size` bytes on `stream` from cached blocks only; `Ok(None)` when that would
    /// need new device memory.
    pub fn allocate_cached(
        &mut self,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<Allocation>, AllocError> {
        self.allocate_or_grow(size, stream, false)
    }

    /// The error for a request above [`sizes::MAX_REQUEST`], counted as an out-of-memory error
    /// below 1 EiB (PyTorch's ladder fails such a request and counts it in `num_ooms`; from
    /// 1 EiB up its front refuses the request before the ladder, uncounted).
    pub(crate) fn refuse_too_large(&mut self, size: u64) -> AllocError {
        if size < sizes::ONE_EIB {
            self.stats.num_ooms += 1;
        }
        AllocError::TooLarge {
            requested: size,
            limit: sizes::MAX_REQUEST,
        }
    }

    fn allocate_or_grow(
        &mut self,
        size: u64,
        stream: StreamId,
        may_grow: bool,
    ) -> Result<Option<Allocation>, AllocError> {
        if size > sizes::MAX_REQUEST {
            return Err(self.refuse_too_large(size));
        }
        self.apply_fraction()?;
        self.process_events()?;
        let rounded = sizes::round_size(size, &self.cfg);
        let pool = PoolKind::for_size(rounded);
        let req = Request {
            stream,
            pool,
            size: rounded,
            alloc_size: sizes::segment_size(rounded),
        };
        let seq = if self.plans_on(&req) {
            self.episode_index(stream)
        } else {
            None
        };
        let planned = match seq {
            Some(k) => match self.planned_block(k, &req, may_grow)? {
                plan::Placement::At(id) => Some(id),
                plan::Placement::BestFit => None,
                plan::Placement::NeedsGrowth => return Ok(None),
            },
            None => None,
        };
        let found = planned.or_else(|| self.get_free_block(&req));
        let id = match found {
            Some(id) => id,
            None if may_grow => self.grow(&req, size)?,
            None => return Ok(None),
        };
        let split = self.should_split(id, rounded);
        let id = self.alloc_found_block(id, &req, size, split);
        if let Some(k) = seq {
            self.note_alloc(id, k, planned.is_some());
        }
        self.handouts += 1;
        let serial = POOL_SERIAL | self.handouts;
        let b = &mut self.blocks[id];
        b.serial = serial;
        Ok(Some(Allocation {
            ptr: b.addr,
            size,
            stream,
            block: id,
            serial,
        }))
    }

    /// The out-of-memory ladder: new memory, then release oversize cached blocks, then release
    /// every cached block, then give up with [`AllocError::OutOfMemory`].
    fn grow(&mut self, req: &Request, orig: u64) -> Result<BlockId, AllocError> {
        if self.limit.is_some() && self.cfg.garbage_collection_threshold > 0.0 {
            self.garbage_collect()?;
        }
        if let Some(id) = self.alloc_block(req, false)? {
            return Ok(id);
        }
        if self.release_available_cached_blocks(req)? {
            if let Some(id) = self.alloc_block(req, false)? {
                return Ok(id);
            }
        }
        self.release_cached_blocks()?;
        if let Some(id) = self.alloc_block(req, true)? {
            return Ok(id);
        }
        self.stats.num_ooms += 1;
        Err(self.oom_error(orig, req))
    }

    fn oom_error(&self, orig: u64, req: &Request) -> AllocError {
        let device_free = self.device.mem_info().map(|m| m.0).unwrap_or(0);
        if self.reserve_failed {
            let ranges = self.segments.iter().flatten();
            return AllocError::AddressSpace {
                requested: orig,
                ranges: ranges.clone().count() as u64,
                range_bytes: ranges.map(|s| s.size).sum(),
                device_free,
            };
        }
        AllocError::OutOfMemory {
            requested: orig,
            rounded: req.size,
            reserved: self.reserved,
            allocated: self.stats.allocated_bytes.0[0].current as u64,
            device_free,
            limit: self.limit,
        }
    }

    /// Best fit from the pool's free index, with PyTorch's oversize rules.
    fn get_free_block(&mut self, req: &Request) -> Option<BlockId> {
        let gc = self.limit.is_some() && self.cfg.garbage_collection_threshold > 0.0;
        let (mss, rounding) = (self.cfg.max_split_size, self.cfg.max_non_split_rounding);
        let expandable = self.cfg.policy.is_expandable();
        let idx = match req.pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        };
        if gc {
            idx.searches += 1;
        }
        let (size, id) = {
            let mut it = idx.at_least(req.stream.0, req.size);
            let (mut size, mut id) = it.next()?;
            if expandable && self.blocks[id].is_expandable() {
                // Count a block's unmapped tail as part of its size, so a block at the end of a
                // segment is chosen only when nothing else fits.
                let grow = |b: BlockId| expandable_size(&self.blocks, b);
                for (next_size, next) in it {
                    if grow(next) >= grow(id) {
                        break;
                    }
                    (size, id) = (next_size, next);
                }
            }
            (size, id)
        };
        if req.size < mss && size >= mss {
            return None;
        }
        if req.size >= mss && size >= req.size.saturating_add(rounding) {
            return None;
        }
        let removed = idx.remove(&self.blocks[id]);
        debug_assert!(removed);
        Some(id)
    }

    fn should_split(&self, id: BlockId, size: u64) -> bool {
        let b = &self.blocks[id];
        let remaining = b.size - size;
        if b.pool == PoolKind::Small || self.cfg.policy.is_expandable() {
            remaining >= MIN_BLOCK
        } else {
            size < self.cfg.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// Hands out block `id` (already taken out of the free index), splitting off the rest.
    fn alloc_found_block(&mut self, id: BlockId, req: &Request, orig: u64, split: bool) -> BlockId {
        let pool = req.pool;
        let already_split = self.blocks[id].is_split();
        let expandable = self.blocks[id].is_expandable();
        let id = if split {
            let front = self.split_front(id, req.size);
            let rest_size = self.blocks[id].size;
            if !expandable {
                if already_split {
                    self.stats.inactive_split_bytes.decrease(pool, req.size);
                } else {
                    self.stats.inactive_split_bytes.increase(pool, rest_size);
                    self.stats.inactive_split.increase(pool, 1);
                }
            }
            front
        } else {
            if already_split && !expandable {
                let size = self.blocks[id].size;
                self.stats.inactive_split_bytes.decrease(pool, size);
                self.stats.inactive_split.decrease(pool, 1);
            }
            id
        };
        let b = &mut self.blocks[id];
        b.allocated = true;
        b.requested = orig;
        let size = b.size;
        let s = &mut self.stats;
        s.allocation.increase(pool, 1);
        s.allocated_bytes.increase(pool, size);
        s.active.increase(pool, 1);
        s.active_bytes.increase(pool, size);
        s.requested_bytes.increase(pool, orig);
        if size >= self.cfg.max_split_size {
            s.oversize_allocations.increase(1);
        }
        self.peak_requested = self
            .peak_requested
            .max(s.requested_bytes.0[0].current as u64);
        id
    }

    /// Splits `size` bytes off the front of free block `id` into a new block, which it returns;
    /// `id` keeps the rest and goes back to the free index.
    fn split_front(&mut self, id: BlockId, size: u64) -> BlockId {
        let rest = &self.blocks[id];
        let mut front = Block::new(rest.addr, size, rest.stream, rest.pool);
        front.segment = rest.segment;
        front.prev = rest.prev;
        front.next = id;
        let front_id = self.blocks.insert(front);
        if let Some(p) = self.link(front_id, true) {
            self.blocks[p].next = front_id;
        }
        let rest = &mut self.blocks[id];
        rest.prev = front_id;
        rest.addr += size;
        rest.size -= size;
        self.insert_free(id);
        front_id
    }

    /// The block's neighbour (`prev` when `before`), if any.
    fn link(&self, id: BlockId, before: bool) -> Option<BlockId> {
        let b = &self.blocks[id];
        let n = if before { b.prev } else { b.next };
        (n != NIL).then_some(n)
    }

    /// Takes a free mapped block out of its pool's index; false when it was not there.
    pub(crate) fn unindex_free(&mut self, id: BlockId) -> bool {
        let b = &self.blocks[id];
        match b.pool {
            PoolKind::Small => self.small.remove(b),
            PoolKind::Large => self.large.remove(b),
        }
    }

    /// Takes an unmapped block out of its pool's unmapped index.
    pub(crate) fn unindex_unmapped(&mut self, id: BlockId) -> bool {
        let b = &self.blocks[id];
        match b.pool {
            PoolKind::Small => self.small.remove_unmapped(b),
            PoolKind::Large => self.large.remove_unmapped(b),
        }
    }

    /// Puts an unmapped block into its pool's unmapped index.
    pub(crate) fn index_unmapped(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        match b.pool {
            PoolKind::Small => self.small.insert_unmapped(id, b),
            PoolKind::Large => self.large.insert_unmapped(id, b),
        }
    }

    /// Puts a free mapped block into its pool's index.
    pub(crate) fn insert_free(&mut self, id: BlockId) {
        let pool = self.blocks[id].pool;
        let idx = match pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        };
        let b = &mut self.blocks[id];
        b.gc_base = idx.searches;
        idx.insert(id, b);
    }

    /// Frees an allocation.
    pub fn free(&mut self, a: &Allocation) -> Result<(), AllocError> {
        let b = self
            .blocks
            .get(a.block)
            .filter(|b| b.allocated && b.addr == a.ptr && b.event_count == 0)
            .filter(|b| b.serial == a.serial)
            .ok_or(AllocError::NotAllocated(a.ptr))?;
        let (pool, size) = (b.pool, b.size);
        if !b.stream_uses.is_empty() {
            self.insert_events(a.block)?;
        }
        // A free, even one that waits for other streams' work first.
        end_loading(&self.loading);
        self.stats.allocation.decrease(pool, 1);
        self.stats.allocated_bytes.decrease(pool, size);
        if size >= self.cfg.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
        if self.blocks[a.block].event_count == 0 {
            self.free_block(a.block);
        }
        Ok(())
    }

    /// Returns a block to its pool, merging it with free neighbours.
    pub(crate) fn free_block(&mut self, id: BlockId) {
        if self.blocks[id].episode_seq != plan::NO_SEQ {
            self.note_free(id);
        }
        let b = &self.blocks[id];
        let (pool, orig_size, requested) = (b.pool, b.size, b.requested);
        let (prev, next) = (b.prev, b.next);
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        for cand in [prev, next] {
            let subsumed = self.try_merge(id, cand);
            if subsumed > 0 {
                net_blocks -= 1;
                net_bytes -= subsumed as i64;
            }
        }
        let b = &mut self.blocks[id];
        b.allocated = false;
        b.requested = 0;
        self.insert_free(id);
        let b = &self.blocks[id];
        if b.is_split() {
            net_blocks += 1;
            net_bytes += b.size as i64;
        }
        let s = &mut self.stats;
        if !b.is_expandable() {
            apply_net(&mut s.inactive_split, pool, net_blocks);
            apply_net(&mut s.inactive_split_bytes, pool, net_bytes);
        }
        s.active.decrease(pool, 1);
        s.active_bytes.decrease(pool, orig_size);
        s.requested_bytes.decrease(pool, requested);
    }

    /// Merges `src` into `dst` when `src` is a free neighbour in the same mapping state; returns
    /// the bytes absorbed (0: no merge). `dst` must not be in an index.
    pub(crate) fn try_merge(&mut self, dst: BlockId, src: BlockId) -> u64 {
        if src == NIL {
            return 0;
        }
        let s = &self.blocks[src];
        if s.allocated
            || s.event_count > 0
            || !s.stream_uses.is_empty()
            || s.mapped != self.blocks[dst].mapped
        {
            return 0;
        }
        let idx = match s.pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        };
        let removed = if s.mapped {
            idx.remove(s)
        } else {
            idx.remove_unmapped(s)
        };
        debug_assert!(removed, "merged block was not indexed");
        let (addr, size, prev, next) = (s.addr, s.size, s.prev, s.next);
        self.blocks.discard(src);
        let d = &mut self.blocks[dst];
        if d.prev == src {
            d.addr = addr;
            d.prev = prev;
            if prev != NIL {
                self.blocks[prev].next = dst;
            }
        } else {
            d.next = next;
            if next != NIL {
                self.blocks[next].prev = dst;
            }
        }
        self.blocks[dst].size += size;
        size
    }

    /// Gets new memory for a request: a new segment (`torch`) or mapped pages (expandable).
    /// `Ok(None)` is out of memory (the ladder may free cached memory and retry).
    fn alloc_block(
        &mut self,
        req: &Request,
        is_retry: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        self.reserve_failed = false;
        match self.cfg.policy {
            Policy::Torch => self.alloc_segment(req),
            Policy::TorchExpandable => {
                if self.over_limit(req.alloc_size) {
                    return Ok(None);
                }
                self.try_allocate_expandable_block(req)
            }
            Policy::Default => self.budget_allocate(req),
        }
    }

    /// One `malloc` of `req.alloc_size` bytes: a new segment holding one free block.
    fn alloc_segment(&mut self, req: &Request) -> Result<Option<BlockId>, DeviceError> {
        let size = req.alloc_size;
        if self.over_limit(size) || !self.claim(size) {
            return Ok(None);
        }
        let ptr = match self.device.malloc(size) {
            Ok(p) => p,
            Err(e) => {
                self.sub_reserved(size);
                return if e.is_out_of_memory() {
                    Ok(None)
                } else {
                    Err(e)
                };
            }
        };
        self.stats.segment.increase(req.pool, 1);
        self.reserved_grew(req.pool, size);
        if size >= self.cfg.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        self.stats.calls.mallocs += 1;
        Ok(Some(
            self.blocks
                .insert(Block::new(ptr, size, req.stream, req.pool)),
        ))
    }
}

fn apply_net(s: &mut crate::stats::StatArray, pool: PoolKind, net: i64) {
    if net > 0 {
        s.increase(pool, net as u64);
    } else if net < 0 {
        s.decrease(pool, (-net) as u64);
    }
}

/// A block's size plus the unmapped block right after it (what it could grow to).
fn expandable_size(blocks: &Arena, id: BlockId) -> u64 {
    let b = &blocks[id];
    let tail = if b.next != NIL && !blocks[b.next].mapped {
        blocks[b.next].size
    } else {
        0
    };
    b.size + tail
}

/// Marks the end of a job's loading ([`Pool::share_loading`]): read first, so that once it has
/// ended, frees on many threads only read the flag's cache line.
pub(crate) fn end_loading(loading: &AtomicBool) {
    if loading.load(Ordering::Relaxed) {
        loading.store(false, Ordering::Relaxed);
    }
}
