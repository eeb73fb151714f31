//! The core of a caching pool: the mechanism every policy shares.
//!
//! [`Core`] owns the blocks (an arena of sub-ranges of segments), the free indexes of the small
//! and large pools, the segments and the pages mapped into expandable ones, split and merge,
//! every call to the device, the statistics, the snapshot and the invariant scan. It decides
//! nothing: where a request goes, how a pool grows and what it gives back are for a policy to
//! say ([`crate::policy::Policy`]), which [`Pool`](crate::Pool) (the core and one policy, in
//! `ladder`) asks at each step of an allocation. The core sits below the policies and the
//! configuration: it reads only its own settings ([`config::PoolConfig`]) and tells its policy
//! what happens to the blocks the policy marked and the ranges it releases through
//! [`Observer`], which every policy implements.
//!
//! Invariants (all checked by [`Core::check_invariants`]):
//! - the blocks of a segment tile it exactly, in address order through `prev`/`next`;
//! - no two neighbouring blocks are both free and mapped (they would have been merged), except
//!   while one of them waits for stream events or is being released (`releasing`; its pages
//!   may have moved to another block, `moving`);
//! - a block is in its pool's free index iff it is free and mapped, in the unmapped index iff it
//!   is unmapped;
//! - a free or unmapped block carries no policy mark ([`block::NO_MARK`]);
//! - every statistic's `current` equals what a scan of the blocks recomputes;
//! - bytes the device holds for this pool (pages whose release failed included) equal
//!   `reserved_bytes.all.current` (`reserved`);
//! - a sleeping pool's mapped blocks lie in the chunks its sleep unmapped (`sleep`).

pub(crate) mod block;
mod capture;
mod check;
mod claim;
pub(crate) mod config;
mod events;
mod expand;
pub(crate) mod index;
mod moving;
mod peers;
mod pinning;
mod release;
mod releasing;
mod repage;
mod reserved;
mod shared;
mod sleep;
mod wake;
pub(crate) use reserved::fraction_limit;
pub(crate) mod segment;

use crate::error::AllocError;
use crate::hooks::Hooks;
use crate::sizes;
use crate::sizes::PoolKind;
use crate::stats::{SharedPeak, Stats};
use crate::sync::{Arc, AtomicBool, AtomicU64, Ordering};
use block::{Arena, Block, BlockId, NIL, NO_MARK};
use config::PoolConfig;
use cudalloc_sys::{Device, DeviceError, EventHandle, StreamId};
use index::FreeIndex;
use segment::ExpSegment;
use std::collections::{BTreeMap, VecDeque};

/// What a successful allocation hands out: an opaque handle, read through its accessors. It is
/// neither `Copy` nor `Clone` and only the allocator makes one, so a forged or duplicated handle
/// does not compile; freeing one consumes it:
///
/// ```compile_fail,E0382
/// use cudalloc::{CachingAllocator, Config};
/// use cudalloc_sys::{SimDevice, StreamId};
///
/// let alloc = CachingAllocator::new(SimDevice::with_capacity(1 << 30), Config::default());
/// let a = alloc.allocate(1 << 20, StreamId::DEFAULT).unwrap();
/// alloc.free(a).unwrap();
/// alloc.free(a).unwrap(); // a second free of one handle
/// ```
#[derive(Debug, PartialEq, Eq)]
pub struct Allocation(pub(crate) Handle);

impl Allocation {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.0.ptr
    }

    /// Bytes asked for.
    pub fn size(&self) -> u64 {
        self.0.size
    }

    /// Stream the allocation belongs to.
    pub fn stream(&self) -> StreamId {
        self.0.stream
    }

    /// The block behind it in its pool (stable while the allocation lives; a test's view).
    #[cfg(feature = "testing")]
    pub fn block(&self) -> BlockId {
        self.0.block
    }

    /// A second handle to the same allocation, which the public API never makes: for the tests
    /// of the run-time checks behind it (a double free, a stale handle).
    #[cfg(feature = "testing")]
    pub fn duplicate(&self) -> Allocation {
        Allocation(self.0)
    }

    /// A handle made up from its parts, which the public API never makes: for the tests of the
    /// run-time checks behind it (a forged handle).
    #[cfg(feature = "testing")]
    pub fn forge(ptr: u64, size: u64, stream: StreamId, block: BlockId, serial: u64) -> Allocation {
        Allocation(Handle {
            ptr,
            size,
            stream,
            block,
            serial,
            tag: 0,
        })
    }

    /// The handout number ([`Handle::serial`]), for tests that forge handles.
    #[cfg(feature = "testing")]
    pub fn serial(&self) -> u64 {
        self.0.serial
    }
}

/// The allocator's own copy of an [`Allocation`]: the live table, the thread caches and a
/// pool's teardown keep these and hand an `Allocation` back out of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Handle {
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
    /// top bit set, from ranges no other pool uses; a thread cache's hit (`CachingAllocator`)
    /// takes its cache token, which never has it.
    pub serial: u64,
    /// The number of the caller's tag whose pool holds it ([`Core::tag`]; 0: untagged).
    pub tag: u32,
}

/// The bit that marks a pool's handout numbers ([`Handle::serial`]).
pub(crate) const POOL_SERIAL: u64 = 1 << 63;

/// What the core tells the policy of its pool while it works: every
/// [`Policy`](crate::policy::Policy) hears it, through `on_marked_free` and
/// `on_segment_released`.
pub(crate) trait Observer {
    /// Block `id`, which carried policy mark `mark`, returns to its pool (the core has cleared
    /// the mark; the block has not merged yet).
    fn marked_free<D: Device>(&mut self, core: &Core<D>, id: BlockId, mark: u64);

    /// Expandable range `segment` went back to the device (its index may be reused).
    fn segment_released(&mut self, segment: u32);
}

/// A request on its way through the allocation ladder.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// The stream it is for.
    pub stream: StreamId,
    /// The pool its rounded size belongs to.
    pub pool: PoolKind,
    /// Rounded size.
    pub size: u64,
    /// Size of a new fixed segment for this request (PyTorch's `get_allocation_size`).
    pub alloc_size: u64,
}

/// The mechanism of a single-threaded caching pool over a device (see the module docs).
pub struct Core<D: Device> {
    pub(crate) device: D,
    pub(crate) cfg: PoolConfig,
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
    /// Releasing blocks with the event each waits for (`releasing`).
    pub(crate) releasing: Vec<(EventHandle, BlockId)>,
    /// Bytes of the releasing blocks.
    pub(crate) releasing_bytes: u64,
    /// Captures the caller began and has not ended (`capture`).
    pub(crate) captures: u32,
    /// Those of them not in relaxed mode.
    pub(crate) strict_captures: u32,
    /// Blocks freed during a capture whose events are recorded when it ends (`capture`).
    pub(crate) deferred: Vec<BlockId>,
    /// A growth in the last attempt needed `malloc` during a capture: the error then says so
    /// ([`crate::AllocError::DuringCapture`]).
    pub(crate) capture_refused: bool,
    pub(crate) spare_events: Vec<EventHandle>,
    pub(crate) peers: Vec<usize>,
    /// Reserved bytes of every pool of this pool's `CachingAllocator` (its shards and tags).
    pub(crate) shared: Option<Arc<AtomicU64>>,
    /// Reserved bytes of every pool under one memory limit: an allocator's and those of its
    /// graph pools ([`crate::CachingAllocator::graph_pool`]); when set, the limit applies to it.
    pub(crate) group: Option<Arc<AtomicU64>>,
    /// The group's reserved bytes and their peak, counted as `shared_peak` is.
    pub(crate) group_peak: Option<Arc<SharedPeak>>,
    /// The reserved bytes of the pools of one `CachingAllocator` together, and their peak.
    pub(crate) shared_peak: Option<Arc<SharedPeak>>,
    /// A virtual range could not be reserved in the last growth attempt (address space, not
    /// memory, ran out): the error then says so ([`crate::AllocError::AddressSpace`]).
    pub(crate) reserve_failed: bool,
    /// The last handout number ([`Handle::serial`] without its top bit; `block::next_serial`).
    pub(crate) handouts: u64,
    /// Address and stream of blocks whose free waited for events and has completed since the
    /// last [`Core::take_completions`], while tracked (`None`: not tracked).
    pub(crate) completions: Option<Vec<(u64, StreamId)>>,
    /// Bytes of pages the device still holds outside every chunk (a release that failed:
    /// [`segment::ExpSegment::stray_bytes`]): not reserved bytes, but counted against the limit
    /// (and in the shared counter) until released.
    pub(crate) strays: u64,
    /// True until a block is freed, by this pool or by any pool or thread cache of the
    /// `CachingAllocator` that shares the flag. A fact policies may read ([`Core::nothing_freed`]);
    /// once false, it stays false.
    pub(crate) unfreed: Arc<AtomicBool>,
    /// The config's memory fraction while it is not yet a limit: the device could not say how
    /// much memory it has when the pool was made; the first allocation tries again.
    pub(crate) fraction: Option<f64>,
    /// The number of the caller's tag whose allocations this pool holds (0: untagged), which
    /// its handles carry (`CachingAllocator` keeps each tag in a pool of its own).
    pub(crate) tag: u32,
    /// What a sleeping pool keeps to wake up (`sleep`); `None` while awake.
    pub(crate) slumber: Option<sleep::Slumber>,
    /// The stream sleep, wake and re-paging copy on, made on first use.
    pub(crate) copy_stream: Option<StreamId>,
    /// The pinned host buffer (address, bytes) the last offloading sleep copied into, kept
    /// across wakes for the next sleep (`sleep`).
    pub(crate) host_buffer: Option<(cudalloc_sys::HostPtr, u64)>,
    /// Told of every range mapped and before it is unmapped ([`crate::hooks`]).
    pub(crate) hooks: Hooks,
    /// Scratch ranges (address, bytes) of re-paging whose unreserve failed (a page stuck in
    /// them, or the driver refused; `repage`): unreserved again at the next re-paging and when
    /// the pool is dropped.
    pub(crate) scratch_left: Vec<(u64, u64)>,
    /// Ranges a policy released during its current call ([`Core::release_empty_range`]), which
    /// the pool tells the policy of once the call returns.
    pub(crate) released_ranges: Vec<u32>,
    /// The pool is being dropped: an event whose wait fails is not recorded again, nor its
    /// stream asked whether it is captured (`Core::record_event_again`).
    pub(crate) dropping: bool,
}

impl<D: Device> Core<D> {
    /// A core with no memory yet.
    pub fn new(device: D, cfg: PoolConfig) -> Core<D> {
        let stats = Stats {
            max_split_size: cfg.max_split_size,
            ..Stats::default()
        };
        let fraction = cfg.memory_fraction;
        let mut core = Core {
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
            releasing: Vec::new(),
            releasing_bytes: 0,
            captures: 0,
            strict_captures: 0,
            deferred: Vec::new(),
            capture_refused: false,
            dropping: false,
            spare_events: Vec::new(),
            peers: Vec::new(),
            shared: None,
            group: None,
            group_peak: None,
            shared_peak: None,
            reserve_failed: false,
            handouts: block::fresh_serials(),
            completions: None,
            strays: 0,
            unfreed: Arc::new(AtomicBool::new(true)),
            fraction,
            tag: 0,
            slumber: None,
            copy_stream: None,
            host_buffer: None,
            hooks: Hooks::default(),
            scratch_left: Vec::new(),
            released_ranges: Vec::new(),
        };
        // A failure is kept for the first allocation to report.
        let _ = core.apply_fraction();
        core
    }

    /// The settings every policy shares.
    pub fn config(&self) -> &PoolConfig {
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

    /// The block behind an id.
    pub fn block(&self, id: BlockId) -> Option<&Block> {
        self.blocks.get(id)
    }

    /// The cap, if any.
    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// True while no block has been freed yet (by this pool, or by any pool or thread cache
    /// sharing the flag: `Core::share_unfreed`).
    pub fn nothing_freed(&self) -> bool {
        self.unfreed.load(Ordering::Relaxed)
    }

    /// Bytes the caller asked for, summed over live allocations.
    pub fn requested_bytes(&self) -> u64 {
        self.stats.requested_bytes.0[0].current as u64
    }

    /// Caps the bytes the pool may hold from the device (`None`: no cap).
    pub fn set_limit(&mut self, limit: Option<u64>) {
        self.limit = limit;
        self.fraction = None;
    }

    /// Marks allocated block `id` for its policy: [`Policy::on_marked_free`](crate::policy::Policy::on_marked_free)(crate::policy::Policy::on_marked_free)
    /// hears of it when it is freed. False (nothing done) for a block that is not allocated or
    /// a mark of [`block::NO_MARK`].
    pub fn set_mark(&mut self, id: BlockId, mark: u64) -> bool {
        match self.blocks.get_mut(id) {
            Some(b) if b.allocated && mark != block::NO_MARK => {
                b.mark = mark;
                true
            }
            _ => false,
        }
    }

    /// Resets peak statistics (only the statistics: a policy's state keeps its own).
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    /// The free index of `pool`.
    pub fn free_index(&self, pool: PoolKind) -> &FreeIndex {
        match pool {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        }
    }

    pub(crate) fn index(&mut self, pool: PoolKind) -> &mut FreeIndex {
        match pool {
            PoolKind::Small => &mut self.small,
            PoolKind::Large => &mut self.large,
        }
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

    pub(crate) fn oom_error(&self, orig: u64, req: &Request) -> AllocError {
        if self.capture_refused {
            return AllocError::DuringCapture {
                what: "grow",
                requested: orig,
            };
        }
        let device_free = self.device.mem_info().map(|m| m.0).unwrap_or(0);
        if self.reserve_failed {
            let ranges = self.segments.iter().flatten();
            return AllocError::AddressSpace {
                device: self.device.ordinal(),
                requested: orig,
                ranges: ranges.clone().count() as u64,
                range_bytes: ranges.map(|s| s.size).sum(),
                device_free,
            };
        }
        AllocError::OutOfMemory {
            device: self.device.ordinal(),
            requested: orig,
            rounded: req.size,
            reserved: self.reserved,
            allocated: self.stats.allocated_bytes.0[0].current as u64,
            device_free,
            limit: self.limit,
        }
    }

    /// Hands out block `id` (already taken out of the free index) for a request of `orig`
    /// bytes, splitting off the rest when `split` (it goes back to the free index).
    pub(crate) fn alloc_found_block(
        &mut self,
        id: BlockId,
        req: &Request,
        orig: u64,
        split: bool,
    ) -> BlockId {
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
        id
    }

    /// Numbers the handout of allocated block `id` and makes its handle.
    pub(crate) fn hand_out(&mut self, id: BlockId, size: u64, stream: StreamId) -> Handle {
        self.handouts = block::next_serial(self.handouts);
        let serial = POOL_SERIAL | self.handouts;
        let b = &mut self.blocks[id];
        b.serial = serial;
        Handle {
            ptr: b.addr,
            size,
            stream,
            block: id,
            serial,
            tag: self.tag,
        }
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
    pub fn unindex_free(&mut self, id: BlockId) -> bool {
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

    /// Returns a block to its pool, merging it with free neighbours. A block carrying a policy
    /// mark has it cleared, and the policy hears of it ([`Policy::on_marked_free`](crate::policy::Policy::on_marked_free)).
    pub(crate) fn free_block<P: Observer>(&mut self, policy: &mut P, id: BlockId) {
        if self.blocks[id].mark != NO_MARK {
            let mark = std::mem::replace(&mut self.blocks[id].mark, NO_MARK);
            policy.marked_free(self, id, mark);
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
            || s.waits()
            || s.releasing
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

    /// One `malloc` of `req.alloc_size` bytes: a new fixed segment holding one free block, not
    /// in the free index. `Ok(None)`: out of memory, or past the limit.
    pub fn alloc_segment(&mut self, req: &Request) -> Result<Option<BlockId>, DeviceError> {
        let size = req.alloc_size;
        if self.mallocs_refused() {
            self.capture_refused = true;
            return Ok(None);
        }
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
        self.hooks.mapped(ptr, size);
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

/// Marks that a block was freed ([`Core::nothing_freed`]): read first, so that once it is,
/// frees on many threads only read the flag's cache line.
pub(crate) fn note_free(unfreed: &AtomicBool) {
    if unfreed.load(Ordering::Relaxed) {
        unfreed.store(false, Ordering::Relaxed);
    }
}
