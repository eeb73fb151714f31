//! The thread-safe front: [`CachingAllocator`].

use crate::config::Config;
use crate::error::AllocError;
use crate::pool::{Allocation, Pool};
use crate::snapshot::Snapshot;
use crate::stats::Stats;
use crate::sync::Mutex;
use cudalloc_sys::{Device, StreamId};
use std::collections::HashMap;

/// A caching allocator over one device; `Send + Sync`.
///
/// Every method takes `&self`. Allocations are returned as [`Allocation`] values; free them with
/// [`CachingAllocator::free`] (or by address with [`CachingAllocator::free_ptr`]).
pub struct CachingAllocator<D: Device> {
    inner: Mutex<Inner<D>>,
}

struct Inner<D: Device> {
    pool: Pool<D>,
    live: HashMap<u64, Allocation>,
}

impl<D: Device> CachingAllocator<D> {
    /// An allocator with the given configuration.
    pub fn new(device: D, cfg: Config) -> Self {
        CachingAllocator {
            inner: Mutex::new(Inner {
                pool: Pool::new(device, cfg),
                live: HashMap::new(),
            }),
        }
    }

    /// An allocator configured from `CUDALLOC_CONF` (absent: the `default` policy).
    pub fn from_env(device: D) -> Result<Self, crate::config::ConfigError> {
        Ok(Self::new(device, Config::from_env()?))
    }

    /// Allocates `size` bytes for use on `stream`. Zero bytes yield a valid 512-byte block, as
    /// in PyTorch's allocator.
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        if size > (1u64 << 62) {
            return Err(AllocError::InvalidArgument(format!(
                "{size} bytes is larger than any device"
            )));
        }
        let mut g = self.inner.lock();
        let a = g.pool.allocate(size, stream)?;
        g.live.insert(a.ptr, a);
        Ok(a)
    }

    /// Frees an allocation. A block used on other streams ([`CachingAllocator::record_stream`])
    /// returns to the pool once their work has completed.
    pub fn free(&self, a: Allocation) -> Result<(), AllocError> {
        self.free_ptr(a.ptr)
    }

    /// Frees the allocation at `ptr`.
    pub fn free_ptr(&self, ptr: u64) -> Result<(), AllocError> {
        let mut g = self.inner.lock();
        let a = *g.live.get(&ptr).ok_or(AllocError::NotAllocated(ptr))?;
        g.pool.free(&a)?;
        g.live.remove(&ptr);
        Ok(())
    }

    /// Marks the allocation at `ptr` as used on `stream` too.
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        let mut g = self.inner.lock();
        let a = *g.live.get(&ptr).ok_or(AllocError::NotAllocated(ptr))?;
        g.pool.record_stream(a.block, ptr, stream)
    }

    /// Returns every cached block that can go back to the device.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        self.inner.lock().pool.empty_cache()
    }

    /// Caps the allocator at `fraction` of the device's memory.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), AllocError> {
        self.inner.lock().pool.set_memory_fraction(fraction)
    }

    /// Caps the allocator at `bytes` (`None`: no cap).
    pub fn set_memory_limit(&self, bytes: Option<u64>) {
        self.inner.lock().pool.set_limit(bytes)
    }

    /// A copy of the statistics.
    pub fn stats(&self) -> Stats {
        self.inner.lock().pool.stats().clone()
    }

    /// Resets peak statistics.
    pub fn reset_peak_stats(&self) {
        self.inner.lock().pool.reset_peak_stats()
    }

    /// Segments, blocks and statistics.
    pub fn snapshot(&self) -> Snapshot {
        self.inner.lock().pool.snapshot()
    }

    /// Runs the full invariant scan.
    pub fn check_invariants(&self) -> Result<(), String> {
        let g = self.inner.lock();
        g.pool.check_invariants()?;
        let allocated = g.pool.stats().allocation.0[0].current as usize;
        if allocated != g.live.len() {
            return Err(format!(
                "{} live pointers but {allocated} allocations",
                g.live.len()
            ));
        }
        Ok(())
    }

    /// Runs `f` on the device.
    pub fn with_device<R>(&self, f: impl FnOnce(&D) -> R) -> R {
        f(self.inner.lock().pool.device())
    }

    /// Bytes held from the device.
    pub fn reserved_bytes(&self) -> u64 {
        self.inner.lock().pool.reserved()
    }
}
