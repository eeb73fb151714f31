//! Statistics with PyTorch's meaning (`torch.cuda.memory_stats()`), plus what PyTorch lacks.
//!
//! A [`Stat`] counts a quantity: `current`, `peak` (highest `current` since the last
//! [`Stats::reset_peak`]), `allocated` (sum of increases) and `freed` (sum of decreases); so
//! `current == allocated - freed` always holds. A [`StatArray`] holds one [`Stat`] for all pools,
//! the small pool and the large pool; every change to a pool's stat also changes `all`.
//!
//! Invariant (checked by `check_invariants`): every `current` equals what the snapshot recomputes.

use crate::sizes::PoolKind;
use crate::sync::{AtomicU64, Ordering};

/// One counted quantity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Present value.
    pub current: i64,
    /// Highest `current` since the last reset of peaks.
    pub peak: i64,
    /// Sum of all increases.
    pub allocated: i64,
    /// Sum of all decreases.
    pub freed: i64,
}

impl Stat {
    /// Adds `n`.
    pub fn increase(&mut self, n: u64) {
        self.current += n as i64;
        self.allocated += n as i64;
        self.peak = self.peak.max(self.current);
    }

    /// Subtracts `n`.
    pub fn decrease(&mut self, n: u64) {
        self.current -= n as i64;
        self.freed += n as i64;
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// Adds another count of the same quantity (its peak too: the sum of two peaks bounds the
    /// peak of the sum).
    pub fn add(&mut self, other: &Stat) {
        self.current += other.current;
        self.peak += other.peak;
        self.allocated += other.allocated;
        self.freed += other.freed;
    }
}

/// The bytes that several pools (the stream shards of one `CachingAllocator`) hold from the
/// device together, and the most they held at once since the last [`SharedPeak::reset`]: the
/// exact peak of the sum, where the sum of the pools' own peaks is only an upper bound.
/// A pool counts bytes here once the device call that got them succeeded, and uncounts them
/// as it gives them back, so `peak >= held` always, and a refused request never counts.
#[derive(Debug, Default)]
pub struct SharedPeak {
    held: AtomicU64,
    peak: AtomicU64,
}

impl SharedPeak {
    /// `n` more bytes are held.
    pub fn grew(&self, n: u64) {
        let now = self.held.fetch_add(n, Ordering::AcqRel) + n;
        self.peak.fetch_max(now, Ordering::AcqRel);
    }

    /// `n` bytes are given back.
    pub fn shrank(&self, n: u64) {
        self.held.fetch_sub(n, Ordering::AcqRel);
    }

    /// The most held at once since the last reset.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Makes the peak what is held now. A pool that grows meanwhile (one not locked by the
    /// caller, such as a graph pool of the group) leaves the peak at least at what is held
    /// after the reset.
    pub fn reset(&self) {
        let now = self.held.load(Ordering::Acquire);
        self.peak.store(now, Ordering::Release);
        let after = self.held.load(Ordering::Acquire);
        self.peak.fetch_max(after, Ordering::AcqRel);
    }
}

/// Index into a [`StatArray`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StatType {
    /// All pools together.
    All = 0,
    /// The small pool.
    SmallPool = 1,
    /// The large pool.
    LargePool = 2,
}

impl StatType {
    /// PyTorch's spelling of the three types.
    pub const NAMES: [&'static str; 3] = ["all", "small_pool", "large_pool"];
}

/// A stat for all pools, the small pool and the large pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray(pub [Stat; 3]);

impl StatArray {
    /// Adds `n` to the pool's stat and to `all`.
    pub fn increase(&mut self, pool: PoolKind, n: u64) {
        self.0[0].increase(n);
        self.0[pool_index(pool)].increase(n);
    }

    /// Subtracts `n` from the pool's stat and from `all`.
    pub fn decrease(&mut self, pool: PoolKind, n: u64) {
        self.0[0].decrease(n);
        self.0[pool_index(pool)].decrease(n);
    }

    /// The stat of one type.
    pub fn get(&self, t: StatType) -> &Stat {
        &self.0[t as usize]
    }

    /// The `current` value for one pool.
    pub fn current(&self, pool: PoolKind) -> i64 {
        self.0[pool_index(pool)].current
    }

    fn reset_peak(&mut self) {
        self.0.iter_mut().for_each(Stat::reset_peak);
    }

    /// Adds another array, stat by stat ([`Stat::add`]).
    pub fn add(&mut self, other: &StatArray) {
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            a.add(b);
        }
    }
}

fn pool_index(pool: PoolKind) -> usize {
    match pool {
        PoolKind::Small => 1,
        PoolKind::Large => 2,
    }
}

/// The allocator's statistics: PyTorch's `DeviceStats` plus driver-call counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Live allocations (blocks handed out).
    pub allocation: StatArray,
    /// Segments from `malloc` (`torch` policy). Always 0 under the expandable policies
    /// (`torch-expandable`, `default`), as in PyTorch with `expandable_segments:True`: their
    /// reserved ranges and mapped pages are counted in `reserved_bytes`, not here.
    pub segment: StatArray,
    /// Blocks that are allocated or waiting for stream events.
    pub active: StatArray,
    /// Free blocks inside segments that also hold other blocks (they cannot be released).
    /// Always 0 under the expandable policies, as in PyTorch: there a free block's whole
    /// pages can be unmapped whatever its neighbours.
    pub inactive_split: StatArray,
    /// Bytes of live allocations (rounded block sizes).
    pub allocated_bytes: StatArray,
    /// Bytes held from the device (mapped bytes for expandable policies).
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes the callers asked for (before rounding).
    pub requested_bytes: StatArray,
    /// Allocations that needed the last step of the out-of-memory ladder.
    pub num_alloc_retries: u64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: u64,
    /// Times all pending stream events were waited for.
    pub num_sync_all_streams: u64,
    /// Times the pool blocked until the device finished work (a device synchronization, or a
    /// wait for one event): on its synchronizing paths (`empty_cache`, the out-of-memory ladder
    /// when a growth does not fit, dropping the pool); never in an allocation or free that
    /// fits. Not one of PyTorch's keys.
    pub device_waits: u64,
    /// Pages moved from a releasing block to a growth of its stream (`pool::moving`), each one
    /// map operation in `calls.maps` and, once its old addresses are unmapped, one unmap in
    /// `calls.unmaps`: pages the growth did not have to create while the device was behind.
    /// Not one of PyTorch's keys.
    pub pages_moved: u64,
    /// Bytes whose pages started going back to the device in stream order
    /// (`Core::release_pages_in`: unmapped once their stream's work before them completes; the
    /// `default` policy's budget, and the C library's idle streams), those later taken back or
    /// moved to a growth included (and pages unmapped whose release failed: the device gets
    /// them back once a retry releases them); not the pages `empty_cache`, the out-of-memory
    /// ladder or sleep unmap after waiting. Not one of PyTorch's keys.
    pub given_back_bytes: u64,
    /// Bytes of blocks on their way back taken back into the cache before their pages were
    /// unmapped (`Core::reclaim_releasing`, `Core::reclaim_releasing_block`: the device had not
    /// caught up with them, and a request of their stream could use them; the rest of a
    /// partly moved block whose event could not be recorded; and pages whose unmap failed,
    /// free in the cache again). Not one of PyTorch's keys.
    pub taken_back_bytes: u64,
    /// Free blocks of this pool's streams lent to another stream's request that would have
    /// made its own pool grow (`lend_blocks`, `default` only): allocations of this pool,
    /// counted here, and returned to it after the borrowing stream's work. Not one of
    /// PyTorch's keys.
    pub lent_blocks: u64,
    /// Streams of this pool found not idle when asked to lend (one per candidate stream per
    /// request: its work not completed when the event recorded to check was queried at once,
    /// the stream captured, or the event not recorded; nothing waits for it), whether or not
    /// its blocks would have served the request. Not one of PyTorch's keys.
    pub lends_refused_busy: u64,
    /// Device allocations as PyTorch counts them: `malloc` calls, or for expandable policies
    /// mapping steps (one per growth, whatever number of chunks it maps: `calls.maps` counts
    /// those; a growth that takes moved pages and maps new ones too counts two).
    pub num_device_alloc: u64,
    /// Device frees as PyTorch counts them: `free` calls, or for expandable policies unmapping
    /// steps (one per block given back, whatever number of chunks: `calls.unmaps`).
    pub num_device_free: u64,
    /// Live allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// The configured `max_split_size` (PyTorch reports `u64::MAX` as -1... here as is).
    pub max_split_size: u64,
    /// Driver calls by kind, as the allocator issued them.
    pub calls: DriverCalls,
    /// What the thread caches served and hold (`CachingAllocator` only; zero for a bare pool).
    pub thread_cache: ThreadCacheStats,
}

/// Thread caches' part of [`Stats`] (PyTorch has none). The PyTorch statistics already count
/// a cache hit as an allocation and a free into a cache as a free; these say how many there
/// were and what the caches hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThreadCacheStats {
    /// Allocations served from a thread cache so far, without their pool.
    pub hits: u64,
    /// Blocks freed by their callers and held in thread caches now.
    pub blocks: u64,
    /// Those blocks' bytes.
    pub bytes: u64,
}

/// Driver calls the allocator issued, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCalls {
    /// `malloc` calls (successful).
    pub mallocs: u64,
    /// `free` calls.
    pub frees: u64,
    /// Map operations (one physical chunk created, mapped and made accessible).
    pub maps: u64,
    /// Unmap operations (one chunk unmapped and released).
    pub unmaps: u64,
}

impl DriverCalls {
    /// Sum of all calls.
    pub fn total(&self) -> u64 {
        self.mallocs + self.frees + self.maps + self.unmaps
    }
}

impl Stats {
    /// Adds the statistics of another pool (of the same allocator): counts and bytes add up;
    /// a peak becomes the sum of the peaks, an upper bound of the peak of the sum.
    pub fn add(&mut self, s: &Stats) {
        let pairs = [
            (&mut self.allocation, &s.allocation),
            (&mut self.segment, &s.segment),
            (&mut self.active, &s.active),
            (&mut self.inactive_split, &s.inactive_split),
            (&mut self.allocated_bytes, &s.allocated_bytes),
            (&mut self.reserved_bytes, &s.reserved_bytes),
            (&mut self.active_bytes, &s.active_bytes),
            (&mut self.inactive_split_bytes, &s.inactive_split_bytes),
            (&mut self.requested_bytes, &s.requested_bytes),
        ];
        for (a, b) in pairs {
            a.add(b);
        }
        self.oversize_allocations.add(&s.oversize_allocations);
        self.oversize_segments.add(&s.oversize_segments);
        self.num_alloc_retries += s.num_alloc_retries;
        self.num_ooms += s.num_ooms;
        self.num_sync_all_streams += s.num_sync_all_streams;
        self.device_waits += s.device_waits;
        self.pages_moved += s.pages_moved;
        self.given_back_bytes += s.given_back_bytes;
        self.taken_back_bytes += s.taken_back_bytes;
        self.lent_blocks += s.lent_blocks;
        self.lends_refused_busy += s.lends_refused_busy;
        self.num_device_alloc += s.num_device_alloc;
        self.num_device_free += s.num_device_free;
        self.calls.mallocs += s.calls.mallocs;
        self.calls.frees += s.calls.frees;
        self.calls.maps += s.calls.maps;
        self.calls.unmaps += s.calls.unmaps;
    }

    /// Allocations that reached a pool: all of them less the thread-cache hits.
    pub fn pool_allocations(&self) -> i64 {
        self.allocation.get(StatType::All).allocated - self.thread_cache.hits as i64
    }

    /// Frees that reached a pool: all of them less those into thread caches (each was claimed
    /// back by a hit since, is still cached, or reached its pool later, as an eviction that
    /// counts here).
    pub fn pool_frees(&self) -> i64 {
        let cache = self.thread_cache.hits + self.thread_cache.blocks;
        self.allocation.get(StatType::All).freed - cache as i64
    }

    /// Resets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            a.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// The nine stat arrays with PyTorch's names.
    pub fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// Every key of `torch.cuda.memory_stats()`, with its value, in PyTorch's spelling
    /// (`allocated_bytes.all.current`, ..., `num_ooms`, `max_split_size`).
    pub fn to_torch_dict(&self) -> Vec<(String, i64)> {
        let mut out = Vec::with_capacity(128);
        for (name, array) in self.arrays() {
            for (t, stat) in StatType::NAMES.iter().zip(array.0.iter()) {
                push_stat(&mut out, &format!("{name}.{t}"), stat);
            }
        }
        push_stat(&mut out, "oversize_allocations", &self.oversize_allocations);
        push_stat(&mut out, "oversize_segments", &self.oversize_segments);
        let scalars = [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
        ];
        for (k, v) in scalars {
            out.push((k.to_string(), v as i64));
        }
        let mss = if self.max_split_size == u64::MAX {
            -1
        } else {
            self.max_split_size as i64
        };
        out.push(("max_split_size".to_string(), mss));
        out
    }
}

fn push_stat(out: &mut Vec<(String, i64)>, prefix: &str, s: &Stat) {
    out.push((format!("{prefix}.current"), s.current));
    out.push((format!("{prefix}.peak"), s.peak));
    out.push((format!("{prefix}.allocated"), s.allocated));
    out.push((format!("{prefix}.freed"), s.freed));
}
