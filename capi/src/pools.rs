//! Private pools: the memory of a CUDA graph (`torch.cuda.graph`, `graph_pool_handle`, CUDA
//! graph trees) or of a `torch.cuda.MemPool`, kept apart from the device's other memory.
//!
//! Each pool is a [`CachingAllocator`] of its own on the device, so a block it holds is never
//! handed to an allocation outside it: memory a graph's capture freed stays the graph's, and an
//! eager tensor allocated after the capture cannot land on addresses the graph's replays write.
//!
//! Invariants:
//! - a pool is named by its device and PyTorch's `MempoolId_t` (two integers); `acquire` makes it
//!   or counts one more use, `release` counts one use less;
//! - a pool with no use left is *retired*: it serves no new allocation, its live allocations can
//!   still be freed (and `record_stream`ed), and its memory goes back to the driver once none is
//!   live (at its `release`, else at an `empty_cache` of the device);
//! - under the `default` policy a pool follows `torch-expandable`'s rules: it grows by mapping
//!   pages and gives nothing back while in use, so an allocation during a capture never waits
//!   for the device (the `default` policy's page give-back synchronizes before it unmaps).

use crate::error::Failure;
use cudalloc_core::snapshot::BlockState;
use cudalloc_core::{AllocError, Allocation, CachingAllocator, Config, Policy};
use cudalloc_sys::{Device, StreamId};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// PyTorch's `MempoolId_t`: `(0, n)` for graph pools, `(n, 0)` for `MemPool`s.
pub(crate) type PoolId = (u64, u64);

type Alloc<D> = Arc<CachingAllocator<D>>;

/// Live allocations of `alloc` (the stats' `allocation.all.current`).
fn live<D: Device>(alloc: &CachingAllocator<D>) -> i64 {
    alloc.stats().allocation.0[0].current
}

/// The private pools of one device.
pub(crate) struct Pools<D: Device> {
    /// Pools in use, by id, with their use counts.
    active: Mutex<HashMap<PoolId, (Alloc<D>, u32)>>,
    /// Pools without uses whose memory is not all freed yet.
    retired: Mutex<Vec<Alloc<D>>>,
}

impl<D: Device> Default for Pools<D> {
    fn default() -> Self {
        Pools {
            active: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
        }
    }
}

/// The configuration of a private pool: the device's, with `default` replaced by
/// `torch-expandable` (see the module doc).
pub(crate) fn pool_config(device: &Config) -> Config {
    let mut cfg = device.clone();
    if cfg.policy == Policy::Default {
        cfg.policy = Policy::TorchExpandable;
    }
    cfg
}

impl<D: Device> Pools<D> {
    /// Makes pool `id` (its allocator made by `open`) or counts one more use of it.
    pub fn acquire(
        &self,
        id: PoolId,
        open: impl FnOnce() -> Result<CachingAllocator<D>, String>,
    ) -> Result<(), String> {
        let mut active = self.active.lock();
        if let Some((_, uses)) = active.get_mut(&id) {
            *uses += 1;
            return Ok(());
        }
        active.insert(id, (Arc::new(open()?), 1));
        Ok(())
    }

    /// Counts one use of pool `id` less; at none it retires, and its memory goes back to the
    /// driver now if nothing of it is live.
    pub fn release(&self, id: PoolId) -> Result<(), String> {
        let mut active = self.active.lock();
        let (_, uses) = active
            .get_mut(&id)
            .ok_or_else(|| format!("no private pool {id:?} in use on this device"))?;
        *uses -= 1;
        if *uses > 0 {
            return Ok(());
        }
        let (alloc, _) = active.remove(&id).expect("looked up above");
        drop(active);
        if live(&alloc) > 0 {
            self.retired.lock().push(alloc);
        }
        Ok(())
    }

    /// Allocates from pool `id`, which must be in use.
    pub fn allocate(&self, id: PoolId, size: u64, stream: StreamId) -> Result<Allocation, Failure> {
        let alloc = self.active.lock().get(&id).map(|(a, _)| a.clone());
        let alloc = alloc.ok_or_else(|| {
            Failure::from(format!("no private pool {id:?} in use on this device"))
        })?;
        alloc.allocate(size, stream).map_err(|e| Failure {
            kind: crate::api::malloc_error_kind(&e),
            message: e.to_string(),
        })
    }

    /// Runs `f` on the pool allocators (active, then retired) until one does not answer
    /// [`AllocError::NotAllocated`]; that answer, or `NotAllocated` if none holds `ptr`.
    pub fn with_owner(
        &self,
        ptr: u64,
        f: impl Fn(&CachingAllocator<D>) -> Result<(), AllocError>,
    ) -> Result<(), AllocError> {
        for alloc in self.all() {
            match f(&alloc) {
                Err(AllocError::NotAllocated(_)) => continue,
                other => return other,
            }
        }
        Err(AllocError::NotAllocated(ptr))
    }

    /// The live allocations of pool `id` (addresses), for PyTorch's
    /// `checkPoolLiveAllocations`.
    pub fn live_allocations(&self, id: PoolId) -> Result<Vec<u64>, String> {
        let alloc = self.active.lock().get(&id).map(|(a, _)| a.clone());
        let alloc = alloc.ok_or_else(|| format!("no private pool {id:?} in use on this device"))?;
        let snap = alloc.snapshot();
        Ok(snap
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == BlockState::Allocated)
            .map(|b| b.addr)
            .collect())
    }

    /// Releases the cached memory of every pool and drops retired pools with nothing live.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        self.retired.lock().retain(|a| live(a) > 0);
        for alloc in self.all() {
            alloc.empty_cache()?;
        }
        Ok(())
    }

    /// Adds the statistics of every pool to `into` (in the order of `torch_values`), but for
    /// the last value, `max_split_size`, a setting rather than a count.
    pub fn add_torch_values(&self, into: &mut [i64]) {
        for alloc in self.all() {
            let values = crate::json::torch_values(&alloc);
            let counts = into.len().saturating_sub(1);
            for (sum, v) in into[..counts].iter_mut().zip(values) {
                *sum += v;
            }
        }
    }

    /// The uses of pool `id` (0: not in use).
    pub fn use_count(&self, id: PoolId) -> u32 {
        self.active.lock().get(&id).map_or(0, |(_, uses)| *uses)
    }

    /// How many pools are in use and how many are retired.
    pub fn counts(&self) -> (usize, usize) {
        (self.active.lock().len(), self.retired.lock().len())
    }

    fn all(&self) -> Vec<Alloc<D>> {
        let mut out: Vec<Alloc<D>> = self
            .active
            .lock()
            .values()
            .map(|(a, _)| a.clone())
            .collect();
        out.extend(self.retired.lock().iter().cloned());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudalloc_sys::{SimConfig, SimDevice};

    const GRAPH: PoolId = (0, 1);
    const S: StreamId = StreamId(7);

    fn open() -> Result<CachingAllocator<SimDevice>, String> {
        let cfg = pool_config(&Config::parse("policy:default").unwrap());
        assert_eq!(cfg.policy, Policy::TorchExpandable);
        Ok(CachingAllocator::new(
            SimDevice::new(SimConfig::default()),
            cfg,
        ))
    }

    #[test]
    fn a_pool_keeps_its_memory_until_released_and_freed() {
        let pools = Pools::<SimDevice>::default();
        assert!(pools.allocate(GRAPH, 1 << 20, S).is_err(), "not in use yet");
        pools.acquire(GRAPH, open).unwrap();
        pools.acquire(GRAPH, || panic!("made twice")).unwrap();
        assert_eq!(pools.use_count(GRAPH), 2);
        let a = pools.allocate(GRAPH, 3 << 20, S).unwrap();
        let b = pools.allocate(GRAPH, 1000, S).unwrap();
        assert_eq!(pools.live_allocations(GRAPH).unwrap().len(), 2);
        pools.with_owner(b.ptr, |p| p.free_ptr(b.ptr)).unwrap();
        assert_eq!(pools.live_allocations(GRAPH).unwrap(), vec![a.ptr]);
        assert!(matches!(
            pools.with_owner(0xdead, |p| p.free_ptr(0xdead)),
            Err(AllocError::NotAllocated(0xdead))
        ));
        pools.release(GRAPH).unwrap();
        pools.release(GRAPH).unwrap();
        assert_eq!(pools.counts(), (0, 1), "retired: one allocation is live");
        assert!(
            pools.allocate(GRAPH, 64, S).is_err(),
            "a retired pool serves nothing"
        );
        let mut values = vec![0i64; crate::json::TORCH_VALUES];
        pools.add_torch_values(&mut values);
        assert_eq!(
            values[0], 1,
            "allocation.all.current counts the retired pool's"
        );
        pools.empty_cache().unwrap();
        assert_eq!(pools.counts(), (0, 1), "kept while live");
        pools.with_owner(a.ptr, |p| p.free_ptr(a.ptr)).unwrap();
        pools.empty_cache().unwrap();
        assert_eq!(pools.counts(), (0, 0), "dropped once nothing is live");
        assert!(pools.release(GRAPH).is_err(), "not in use");
    }

    #[test]
    fn two_pools_never_share_addresses() {
        let pools = Pools::<SimDevice>::default();
        pools.acquire((0, 1), open).unwrap();
        pools.acquire((0, 2), open).unwrap();
        let a = pools.allocate((0, 1), 1 << 20, S).unwrap();
        pools.with_owner(a.ptr, |p| p.free_ptr(a.ptr)).unwrap();
        let b = pools.allocate((0, 2), 1 << 20, S).unwrap();
        assert!(pools.live_allocations((0, 1)).unwrap().is_empty());
        assert_eq!(pools.live_allocations((0, 2)).unwrap(), vec![b.ptr]);
        let c = pools.allocate((0, 1), 1 << 20, S).unwrap();
        assert_eq!(c.ptr, a.ptr, "a pool reuses its own freed memory");
    }

    #[test]
    fn the_configs_of_the_other_policies_are_kept() {
        for p in [
            "policy:torch",
            "policy:torch-expandable,max_split_size_mb:64",
        ] {
            let device = Config::parse(p).unwrap();
            assert_eq!(pool_config(&device), device);
        }
    }
}
