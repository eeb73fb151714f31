//! The thread-safe front: [`CachingAllocator`].
//!
//! Blocks belong to a stream and are reused only by it, so the allocator is split into shards by
//! stream: each shard is a [`Pool`] behind its own lock, and threads working on different streams
//! do not wait for each other. All shards count their reserved bytes into one shared counter, to
//! which the memory limit applies; when a shard runs out of memory, the cached memory of every
//! other shard is released and the allocation retried once before out-of-memory is returned.
//!
//! Statistics are the sums over shards. With one stream (one shard) they are exactly PyTorch's;
//! with several, a `peak` is the sum of the shards' peaks, an upper bound of the true peak.
//!
//! Lock order: at most one shard lock is held at a time.

use crate::config::Config;
use crate::error::AllocError;
use crate::pool::{Allocation, Pool};
use crate::snapshot::Snapshot;
use crate::stats::{Stat, StatArray, Stats};
use crate::sync::{Arc, AtomicU64, CachePadded, Mutex, MutexGuard, Ordering};
use cudalloc_sys::{Device, StreamId};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Number of stream shards.
const SHARDS: usize = 64;

/// A caching allocator over one device; `Send + Sync`.
///
/// Every method takes `&self`. Allocations are returned as [`Allocation`] values; free them with
/// [`CachingAllocator::free`] (or by address with [`CachingAllocator::free_ptr`]).
pub struct CachingAllocator<D: Device> {
    device: Arc<D>,
    shards: Box<[CachePadded<Mutex<Shard<D>>>]>,
    reserved: Arc<AtomicU64>,
}

struct Shard<D: Device> {
    pool: Pool<Arc<D>>,
    live: HashMap<u64, Allocation, BuildHasherDefault<AddrHasher>>,
}

/// A hasher for device addresses (multiplicative; addresses are 512-byte aligned).
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

fn shard_of(stream: StreamId) -> usize {
    let h = stream.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (h >> 58) as usize % SHARDS
}

impl<D: Device> CachingAllocator<D> {
    /// An allocator with the given configuration.
    pub fn new(device: D, cfg: Config) -> Self {
        let device = Arc::new(device);
        let reserved = Arc::new(AtomicU64::new(0));
        let shards = (0..SHARDS)
            .map(|_| {
                let mut pool = Pool::new(device.clone(), cfg.clone());
                pool.share_reserved(reserved.clone());
                CachePadded::new(Mutex::new(Shard {
                    pool,
                    live: HashMap::default(),
                }))
            })
            .collect();
        CachingAllocator {
            device,
            shards,
            reserved,
        }
    }

    /// An allocator configured from `CUDALLOC_CONF` (absent: the `default` policy).
    pub fn from_env(device: D) -> Result<Self, crate::config::ConfigError> {
        Ok(Self::new(device, Config::from_env()?))
    }

    fn shard(&self, stream: StreamId) -> MutexGuard<'_, Shard<D>> {
        self.shards[shard_of(stream)].lock()
    }

    /// Allocates `size` bytes for use on `stream`. Zero bytes yield a valid 512-byte block, as
    /// in PyTorch's allocator.
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        if size > (1u64 << 62) {
            return Err(AllocError::InvalidArgument(format!(
                "{size} bytes is larger than any device"
            )));
        }
        match self.try_allocate(size, stream) {
            Err(e) if e.is_out_of_memory() => {
                if !self.release_other_shards(shard_of(stream))? {
                    return Err(e);
                }
                self.try_allocate(size, stream)
            }
            other => other,
        }
    }

    fn try_allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        let mut g = self.shard(stream);
        let a = g.pool.allocate(size, stream)?;
        g.live.insert(a.ptr, a);
        Ok(a)
    }

    /// Empties the caches of every shard but `except`; true when anything was released.
    fn release_other_shards(&self, except: usize) -> Result<bool, AllocError> {
        let before = self.reserved.load(Ordering::Relaxed);
        for (i, s) in self.shards.iter().enumerate() {
            if i != except {
                s.lock().pool.empty_cache()?;
            }
        }
        Ok(self.reserved.load(Ordering::Relaxed) < before)
    }

    /// Frees an allocation. A block used on other streams ([`CachingAllocator::record_stream`])
    /// returns to the pool once their work has completed.
    pub fn free(&self, a: Allocation) -> Result<(), AllocError> {
        let mut g = self.shard(a.stream);
        let Shard { pool, live } = &mut *g;
        match live.get(&a.ptr) {
            Some(found) if *found == a => {}
            _ => return Err(AllocError::NotAllocated(a.ptr)),
        }
        pool.free(&a)?;
        live.remove(&a.ptr);
        Ok(())
    }

    /// Frees the allocation at `ptr` (searching every stream's shard).
    pub fn free_ptr(&self, ptr: u64) -> Result<(), AllocError> {
        let a = self.find(ptr)?;
        self.free(a)
    }

    /// Frees the allocation at `ptr` that was made on `stream` (no search; PyTorch's pluggable
    /// allocator passes the stream).
    pub fn free_on(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        let a = *self
            .shard(stream)
            .live
            .get(&ptr)
            .ok_or(AllocError::NotAllocated(ptr))?;
        self.free(a)
    }

    fn find(&self, ptr: u64) -> Result<Allocation, AllocError> {
        self.shards
            .iter()
            .find_map(|s| s.lock().live.get(&ptr).copied())
            .ok_or(AllocError::NotAllocated(ptr))
    }

    /// Marks the allocation at `ptr` as used on `stream` too.
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        let a = self.find(ptr)?;
        self.shard(a.stream)
            .pool
            .record_stream(a.block, ptr, stream)
    }

    /// Returns every cached block that can go back to the device.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        for s in self.shards.iter() {
            s.lock().pool.empty_cache()?;
        }
        Ok(())
    }

    /// Caps the allocator at `fraction` of the device's memory.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), AllocError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidArgument(format!(
                "memory fraction {fraction} is not in [0, 1]"
            )));
        }
        let (_, total) = self.device.mem_info()?;
        self.set_memory_limit(Some((fraction * total as f64) as u64));
        Ok(())
    }

    /// Caps the allocator at `bytes` (`None`: no cap).
    pub fn set_memory_limit(&self, bytes: Option<u64>) {
        for s in self.shards.iter() {
            s.lock().pool.set_limit(bytes);
        }
    }

    /// The statistics, summed over stream shards.
    pub fn stats(&self) -> Stats {
        let mut total: Option<Stats> = None;
        for s in self.shards.iter() {
            let g = s.lock();
            let st = g.pool.stats();
            match &mut total {
                None => total = Some(st.clone()),
                Some(t) => add_stats(t, st),
            }
        }
        total.unwrap_or_default()
    }

    /// Resets peak statistics.
    pub fn reset_peak_stats(&self) {
        for s in self.shards.iter() {
            s.lock().pool.reset_peak_stats();
        }
    }

    /// Segments, blocks and statistics of every shard.
    pub fn snapshot(&self) -> Snapshot {
        let mut segments = Vec::new();
        for s in self.shards.iter() {
            segments.extend(s.lock().pool.snapshot().segments);
        }
        segments.sort_by_key(|s| s.addr);
        Snapshot {
            segments,
            stats: self.stats(),
        }
    }

    /// Runs the full invariant scan of every shard.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut reserved = 0;
        for s in self.shards.iter() {
            let g = s.lock();
            g.pool.check_invariants()?;
            let allocated = g.pool.stats().allocation.0[0].current as usize;
            if allocated != g.live.len() {
                return Err(format!(
                    "{} live pointers but {allocated} allocations",
                    g.live.len()
                ));
            }
            reserved += g.pool.reserved();
        }
        let shared = self.reserved.load(Ordering::Relaxed);
        if shared != reserved {
            return Err(format!(
                "shared reserved counter {shared} != sum of shards {reserved}"
            ));
        }
        Ok(())
    }

    /// Runs `f` on the device.
    pub fn with_device<R>(&self, f: impl FnOnce(&D) -> R) -> R {
        f(&self.device)
    }

    /// Bytes held from the device.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved.load(Ordering::Relaxed)
    }
}

fn add_stats(t: &mut Stats, s: &Stats) {
    let pairs = [
        (&mut t.allocation, &s.allocation),
        (&mut t.segment, &s.segment),
        (&mut t.active, &s.active),
        (&mut t.inactive_split, &s.inactive_split),
        (&mut t.allocated_bytes, &s.allocated_bytes),
        (&mut t.reserved_bytes, &s.reserved_bytes),
        (&mut t.active_bytes, &s.active_bytes),
        (&mut t.inactive_split_bytes, &s.inactive_split_bytes),
        (&mut t.requested_bytes, &s.requested_bytes),
    ];
    for (a, b) in pairs {
        add_array(a, b);
    }
    add_stat(&mut t.oversize_allocations, &s.oversize_allocations);
    add_stat(&mut t.oversize_segments, &s.oversize_segments);
    t.num_alloc_retries += s.num_alloc_retries;
    t.num_ooms += s.num_ooms;
    t.num_sync_all_streams += s.num_sync_all_streams;
    t.num_device_alloc += s.num_device_alloc;
    t.num_device_free += s.num_device_free;
    t.calls.mallocs += s.calls.mallocs;
    t.calls.frees += s.calls.frees;
    t.calls.maps += s.calls.maps;
    t.calls.unmaps += s.calls.unmaps;
}

fn add_array(a: &mut StatArray, b: &StatArray) {
    for (x, y) in a.0.iter_mut().zip(b.0.iter()) {
        add_stat(x, y);
    }
}

fn add_stat(a: &mut Stat, b: &Stat) {
    a.current += b.current;
    a.peak += b.peak;
    a.allocated += b.allocated;
    a.freed += b.freed;
}
