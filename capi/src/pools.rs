//! Private pools: the memory of a CUDA graph (`torch.cuda.graph`, `graph_pool_handle`, CUDA
//! graph trees) or of a `torch.cuda.MemPool`, kept apart from the device's other memory.
//!
//! Each pool is a [`CachingAllocator`] of its own on the device (a graph pool of the device's
//! allocator: `CachingAllocator::graph_pool`), so a block it holds is never handed to an
//! allocation outside it: memory a graph's capture freed stays the graph's, and an eager tensor
//! allocated after the capture cannot land on addresses the graph's replays write. The device's
//! memory limit (`cudalloc_set_memory_fraction`) caps the allocator and its pools together.
//!
//! Invariants:
//! - a pool is named by its device and PyTorch's `MempoolId_t` (two integers); `acquire` makes it
//!   or counts one more use, `release` counts one use less;
//! - a pool in use keeps every byte it holds, freed blocks included, whatever `empty_cache` is
//!   asked (a graph's replays write its freed intermediates), unless it was set to *lend*
//!   (`MemPool(use_on_oom=True)`, [`Pools::set_use_on_oom`]) and never handed out an
//!   allocation during a capture the pools were told of: then an allocation on the device
//!   (outside the pool, or in it) that runs out of memory gives the pool's whole free chunks
//!   back to the driver before its second try ([`Pools::release_for_retry`]), so that it can
//!   map them; the pool's live blocks stay, and so does a chunk that holds one (under
//!   `default` a pool's growth is one chunk);
//! - a pool with no use left is *retired*: it serves no new allocation, its live allocations can
//!   still be freed (and `record_stream`ed), and its memory goes back to the driver only in
//!   [`Pools::empty_retired`] (the device's `empty_cache`, a pool's own `empty_cache`, or the
//!   out-of-memory path of an allocation, from the device's allocator or a pool), never inside
//!   `release`, a free or an allocation that fits, which must not wait for the device;
//! - a pool is dropped only after its memory went back, under its write guard, with nothing
//!   live and no allocation in flight (allocations hold the read guard);
//! - the counters of a dropped pool are kept (`folded`), so that cumulative statistics and
//!   peaks never go backwards; a device's peaks are the sum of its allocators' peaks, an upper
//!   bound of the peak of the sum, but for `reserved_bytes.all.peak`, the exact peak of the
//!   device's allocator and its pools together (`CachingAllocator::group_reserved_peak`);
//! - under the `default` policy a pool follows `torch-expandable`'s rules, each growth mapped as
//!   one chunk (`Config::for_graph_pool`), and gives nothing back while in use (but what it
//!   lends), so that a graph's pages stay mapped while it may be replayed (the `default`
//!   policy's budget gives back free pages, which a capture frees).

use crate::error::Failure;
use crate::json::TORCH_VALUES;
use cudalloc_core::snapshot::BlockState;
use cudalloc_core::{AllocError, Allocation, CachingAllocator, Snapshot};
use cudalloc_sys::{CaptureMode, Device, StreamId};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The mode the allocators are told a capture runs in: relaxed, since the caller makes the
/// thread that allocates for the captured stream relax its own mode around the call (as
/// PyTorch's allocator does around `cudaMalloc`), so that growth inside a capture is allowed;
/// what no capture allows (polling events, waiting, giving memory back) is never done in any
/// mode.
pub(crate) const CAPTURE: CaptureMode = CaptureMode::Relaxed;

/// PyTorch's `MempoolId_t`: `(0, n)` for graph pools, `(n, 0)` for `MemPool`s.
pub(crate) type PoolId = (u64, u64);

/// One private pool: its allocator, and the guard that keeps it from being dropped while an
/// allocation is in flight.
struct Private<D: Device> {
    alloc: CachingAllocator<D>,
    busy: RwLock<()>,
    /// Whether an allocation elsewhere that runs out of memory may take this pool's cached
    /// memory while it is in use (`MemPool(use_on_oom=True)`).
    use_on_oom: AtomicBool,
    /// Whether it handed out an allocation during a capture the pools were told of: a graph's
    /// replays may then write its freed blocks, and it lends nothing while in use.
    captured: AtomicBool,
}

impl<D: Device> Private<D> {
    /// Whether an allocation that runs out of memory may take its cached memory now.
    fn lends(&self) -> bool {
        self.use_on_oom.load(Ordering::Relaxed) && !self.captured.load(Ordering::Relaxed)
    }
}

type Shared<D> = Arc<Private<D>>;

/// Live allocations of `alloc` (the stats' `allocation.all.current`).
fn live<D: Device>(alloc: &CachingAllocator<D>) -> i64 {
    alloc.stats().allocation.0[0].current
}

/// The private pools of one device.
pub(crate) struct Pools<D: Device> {
    /// Pools in use, by id, with their use counts.
    active: Mutex<HashMap<PoolId, (Shared<D>, u32)>>,
    /// Pools without uses, by id, until their memory went back.
    retired: Mutex<Vec<(PoolId, Shared<D>)>>,
    /// The statistics of dropped pools, added up (as `torch_values` orders them). Locked
    /// after `active` and `retired` (a pool's `busy` may be held: lock order `active`, `busy`,
    /// `retired`, `folded`, `folded_calls`), before `folded_calls`.
    folded: Mutex<Vec<i64>>,
    /// The driver calls and device waits of dropped pools, added up. Locked last.
    folded_calls: Mutex<(u64, u64)>,
    /// Captures underway on the device that the caller told of (`cudalloc_capture_begin`),
    /// each told to every pool, those made during it included. Locked before `active`.
    captures: Mutex<u32>,
}

impl<D: Device> Default for Pools<D> {
    fn default() -> Self {
        Pools {
            active: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            folded: Mutex::new(vec![0; TORCH_VALUES]),
            folded_calls: Mutex::new((0, 0)),
            captures: Mutex::new(0),
        }
    }
}

/// The private pools of a device as `cudalloc_stats_json` reports them ([`Pools::figures`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolFigures {
    /// Pools in use.
    pub active: usize,
    /// Pools out of use not dropped yet (memory not given back yet, or some still live).
    pub retired: usize,
    /// Driver calls (mallocs, frees, maps, unmaps) of every pool so far, dropped ones included.
    pub driver_calls: u64,
    /// Device waits of every pool so far, dropped ones included.
    pub device_waits: u64,
}

/// The driver calls and device waits of `alloc` so far.
fn calls_of<D: Device>(alloc: &CachingAllocator<D>) -> (u64, u64) {
    let s = alloc.stats();
    (s.calls.total(), s.device_waits)
}

/// Adds `values` (in `torch_values` order) to `into`, but for the last, `max_split_size`, a
/// setting rather than a count.
fn add_values(into: &mut [i64], values: &[i64]) {
    let counts = into.len().saturating_sub(1);
    for (sum, v) in into[..counts].iter_mut().zip(values) {
        *sum += v;
    }
}

impl<D: Device> Pools<D> {
    /// Makes pool `id` (its allocator made by `open`) or counts one more use of it. A retired
    /// pool of the same id comes back into use (PyTorch reuses the ids of a pool it released).
    pub fn acquire(
        &self,
        id: PoolId,
        open: impl FnOnce() -> Result<CachingAllocator<D>, String>,
    ) -> Result<(), String> {
        let captures = self.captures.lock();
        let mut active = self.active.lock();
        if let Some((_, uses)) = active.get_mut(&id) {
            *uses += 1;
            return Ok(());
        }
        let mut retired = self.retired.lock();
        let pool = match retired.iter().position(|(r, _)| *r == id) {
            Some(i) => {
                // Used again, it starts as a new pool would: lending nothing, and held by no
                // graph (a retired pool has no use left).
                let pool = retired.swap_remove(i).1;
                pool.use_on_oom.store(false, Ordering::Relaxed);
                pool.captured.store(false, Ordering::Relaxed);
                pool
            }
            None => {
                let alloc = open()?;
                for _ in 0..*captures {
                    alloc.begin_capture(CAPTURE);
                }
                Arc::new(Private {
                    alloc,
                    busy: RwLock::new(()),
                    use_on_oom: AtomicBool::new(false),
                    captured: AtomicBool::new(false),
                })
            }
        };
        active.insert(id, (pool, 1));
        Ok(())
    }

    /// Counts one use of pool `id` less; at none it retires (its memory goes back later, see
    /// the module doc).
    pub fn release(&self, id: PoolId) -> Result<(), String> {
        let mut active = self.active.lock();
        let (_, uses) = active
            .get_mut(&id)
            .ok_or_else(|| format!("no private pool {id:?} in use on this device"))?;
        *uses -= 1;
        if *uses == 0 {
            let (pool, _) = active.remove(&id).expect("looked up above");
            self.retired.lock().push((id, pool));
        }
        Ok(())
    }

    /// A capture began on the device: `device` (the device's own allocator), every pool, and
    /// every pool made before it ends, make no device call the capture forbids
    /// (`CachingAllocator::begin_capture`). One lock covers them all, so that a begin and an
    /// end on two threads never interleave.
    pub fn begin_capture(&self, device: &CachingAllocator<D>) {
        let mut captures = self.captures.lock();
        *captures += 1;
        device.begin_capture(CAPTURE);
        for pool in self.all() {
            pool.alloc.begin_capture(CAPTURE);
        }
    }

    /// A capture begun with [`Pools::begin_capture`] ended: `device` and every pool end it,
    /// even after one fails (the capture has ended for each all the same: see
    /// `CachingAllocator::end_capture`); the first error is returned. Without a capture
    /// begun, an error and nothing changes.
    pub fn end_capture(&self, device: &CachingAllocator<D>) -> Result<(), AllocError> {
        let mut captures = self.captures.lock();
        if *captures == 0 {
            return Err(AllocError::DuringCapture {
                what: "end_capture",
                requested: 0,
            });
        }
        *captures -= 1;
        let mut first = device.end_capture(CAPTURE);
        for pool in self.all() {
            let r = pool.alloc.end_capture(CAPTURE);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Allocates from pool `id`, which must be in use.
    pub fn allocate(&self, id: PoolId, size: u64, stream: StreamId) -> Result<Allocation, Failure> {
        self.allocate_in(id, |a| a.allocate(size, stream))
    }

    /// [`Pools::allocate`] tried again after memory elsewhere was given back, as part of the
    /// same allocation ([`CachingAllocator::allocate_again`]).
    pub fn allocate_again(
        &self,
        id: PoolId,
        size: u64,
        stream: StreamId,
    ) -> Result<Allocation, Failure> {
        self.allocate_in(id, |a| a.allocate_again(size, stream))
    }

    /// Marks `pool`, about to hand out an allocation, as allocated from during a capture when
    /// `capturing` (read before the `active` lock, [`Pools::capturing`]).
    fn mark_captured(pool: &Private<D>, capturing: bool) {
        if capturing {
            pool.captured.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a capture the pools were told of is underway (`captures` is locked before
    /// `active`: read it first).
    fn capturing(&self) -> bool {
        *self.captures.lock() > 0
    }

    /// Runs `f` on pool `id`'s allocator while the pool is in use.
    fn allocate_in(
        &self,
        id: PoolId,
        f: impl FnOnce(&CachingAllocator<D>) -> Result<Allocation, AllocError>,
    ) -> Result<Allocation, Failure> {
        let capturing = self.capturing();
        let active = self.active.lock();
        let pool = active.get(&id).map(|(p, _)| p.clone()).ok_or_else(|| {
            Failure::from(format!("no private pool {id:?} in use on this device"))
        })?;
        Self::mark_captured(&pool, capturing);
        // Taken while the pool is still in use (the `active` lock held), so that no
        // `empty_retired` can drop it between the lookup and the allocation.
        let _in_flight = pool.busy.read();
        drop(active);
        f(&pool.alloc).map_err(|e| Failure {
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
        for pool in self.all() {
            match f(&pool.alloc) {
                Err(AllocError::NotAllocated(_)) => continue,
                other => return other,
            }
        }
        Err(AllocError::NotAllocated(ptr))
    }

    /// The live blocks of pool `id`: address, block bytes, bytes requested and stream of
    /// each, for a checkpoint of the pool (CUDA graph trees' `getCheckpointState`).
    pub fn live_blocks(&self, id: PoolId) -> Result<Vec<[u64; 4]>, String> {
        let snap = self.in_use(id)?.alloc.snapshot();
        Ok(snap
            .segments
            .iter()
            .flat_map(|s| s.blocks.iter().map(move |b| (s.stream, b)))
            .filter(|(_, b)| b.state == BlockState::Allocated)
            .map(|(stream, b)| [b.addr, b.size, b.requested, stream.0])
            .collect())
    }

    /// Pool `id`, in use (an error names it otherwise).
    fn in_use(&self, id: PoolId) -> Result<Shared<D>, String> {
        let pool = self.active.lock().get(&id).map(|(p, _)| p.clone());
        pool.ok_or_else(|| format!("no private pool {id:?} in use on this device"))
    }

    /// Hands out `size` bytes at `ptr` from pool `id` (which must be in use) for a caller that
    /// asked for `requested` on `stream` (`CachingAllocator::allocate_at`): a block of a
    /// checkpoint handed out again.
    pub fn allocate_at(
        &self,
        id: PoolId,
        [ptr, size, requested]: [u64; 3],
        stream: StreamId,
    ) -> Result<Allocation, String> {
        let capturing = self.capturing();
        let active = self.active.lock();
        let pool = active
            .get(&id)
            .map(|(p, _)| p.clone())
            .ok_or_else(|| format!("no private pool {id:?} in use on this device"))?;
        Self::mark_captured(&pool, capturing);
        let _in_flight = pool.busy.read();
        drop(active);
        pool.alloc
            .allocate_at(ptr, size, requested, stream)
            .map_err(|e| e.to_string())
    }

    /// The live allocations of pool `id` (addresses), for PyTorch's
    /// `checkPoolLiveAllocations`.
    pub fn live_allocations(&self, id: PoolId) -> Result<Vec<u64>, String> {
        Ok(self.live_blocks(id)?.iter().map(|b| b[0]).collect())
    }

    /// Gives the cached memory of retired pools back to the driver (only pool `only`'s, when
    /// given) and drops those with nothing live. Pools in use are not touched. A pool whose
    /// release fails is kept (its memory goes back at a later call) and stops none of the
    /// others; the first such error is returned. Waits for the device (it releases memory):
    /// never call it during a capture. Whether anything was retired.
    pub fn empty_retired(&self, only: Option<PoolId>) -> Result<bool, AllocError> {
        let (retired, _, first_error) = self.empty_each(only);
        first_error.map_or(Ok(retired > 0), Err)
    }

    /// Gives the cached memory of every retired pool, and of every pool in use that lends it
    /// ([`Pools::set_use_on_oom`]; not one a capture allocated from), back, for a second try of
    /// an allocation that ran out of memory: true when a retired pool's cache went back, or a
    /// lending pool gave back any bytes, whether or not another's release failed (a pool told
    /// of a capture refuses: nothing is given back during one).
    pub fn release_for_retry(&self) -> bool {
        let (_, emptied, _) = self.empty_each(None);
        let lending: Vec<Shared<D>> = self
            .active
            .lock()
            .values()
            .filter(|(p, _)| p.lends())
            .map(|(p, _)| p.clone())
            .collect();
        let lent = lending.iter().filter(|p| {
            let before = p.alloc.reserved_bytes();
            p.alloc.empty_cache().is_ok() && p.alloc.reserved_bytes() < before
        });
        emptied > 0 || lent.count() > 0
    }

    /// Sets whether pool `id`, which must be in use, lends its cached memory to allocations on
    /// the device that run out of memory (PyTorch's `MemPool(use_on_oom=True)`): they give it
    /// back to the driver and map it ([`Pools::release_for_retry`]); not once a capture
    /// allocated from it. A retired pool used again lends nothing until set again.
    pub fn set_use_on_oom(&self, id: PoolId, on: bool) -> Result<(), String> {
        let active = self.active.lock();
        let (pool, _) = active
            .get(&id)
            .ok_or_else(|| format!("no private pool {id:?} in use on this device"))?;
        pool.use_on_oom.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// The work of [`Pools::empty_retired`]: how many pools were retired, how many of them
    /// were emptied, and the first error.
    fn empty_each(&self, only: Option<PoolId>) -> (usize, usize, Option<AllocError>) {
        let retired: Vec<(PoolId, Shared<D>)> = self
            .retired
            .lock()
            .iter()
            .filter(|(id, _)| only.is_none_or(|o| o == *id))
            .cloned()
            .collect();
        let (mut emptied, mut first_error) = (0, None);
        for (id, pool) in &retired {
            let _no_allocation = pool.busy.write();
            // Read before emptying: a free between the two could leave a block cached in a
            // pool dropped with its counters kept (reserved bytes that never come back down).
            // With nothing live and no allocation let in, nothing changes meanwhile.
            let idle = live(&pool.alloc) == 0;
            match pool.alloc.empty_cache() {
                Ok(()) if idle => self.drop_retired(*id, pool),
                Ok(()) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            }
            emptied += 1;
        }
        (retired.len(), emptied, first_error)
    }

    /// Forgets retired pool `id` (its memory already went back), keeping its counters: a
    /// reader of the statistics counts it once, as a pool or among the folded.
    fn drop_retired(&self, id: PoolId, pool: &Shared<D>) {
        // Moved from `retired` into the folded counters under the `retired` lock, which the
        // readers hold while they read the counters ([`Pools::all_and`]).
        let mut retired = self.retired.lock();
        if let Some(i) = retired
            .iter()
            .position(|(r, p)| *r == id && Arc::ptr_eq(p, pool))
        {
            retired.swap_remove(i);
            add_values(
                &mut self.folded.lock(),
                &crate::json::torch_values(&pool.alloc),
            );
            let (calls, waits) = calls_of(&pool.alloc);
            let mut folded_calls = self.folded_calls.lock();
            folded_calls.0 += calls;
            folded_calls.1 += waits;
        }
    }

    /// How many pools are in use and retired, and the driver calls and device waits of every
    /// pool so far, the dropped ones included.
    pub fn figures(&self) -> PoolFigures {
        let (active, retired) = self.counts();
        let (pools, (mut driver_calls, mut device_waits)) =
            self.all_and(|| *self.folded_calls.lock());
        for pool in pools {
            let (calls, waits) = calls_of(&pool.alloc);
            driver_calls += calls;
            device_waits += waits;
        }
        PoolFigures {
            active,
            retired,
            driver_calls,
            device_waits,
        }
    }

    /// Adds the statistics of every pool, the dropped ones included, to `into` (in the order
    /// of `torch_values`), but for `max_split_size`, a setting rather than a count.
    pub fn add_torch_values(&self, into: &mut [i64]) {
        let (pools, ()) = self.all_and(|| add_values(into, &self.folded.lock()));
        for pool in pools {
            add_values(into, &crate::json::torch_values(&pool.alloc));
        }
    }

    /// Resets the peaks of every pool, and those kept of dropped pools, to their current values.
    pub fn reset_peak_stats(&self) {
        for pool in self.all() {
            pool.alloc.reset_peak_stats();
        }
        let mut folded = self.folded.lock();
        let stats = TORCH_VALUES - 6; // the [current, peak, allocated, freed] groups
        for group in folded[..stats].chunks_exact_mut(4) {
            group[1] = group[0];
        }
    }

    /// Sets the map hooks of every pool (`CachingAllocator::set_map_hooks`).
    pub fn set_map_hooks(&self, hooks: &Option<Arc<dyn cudalloc_core::MapHooks>>) {
        for pool in self.all() {
            pool.alloc.set_map_hooks(hooks.clone());
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

    /// Snapshots of the pools (only pool `only`'s, when given), in use and retired, each with
    /// its id.
    pub fn snapshots(&self, only: Option<PoolId>) -> Vec<(PoolId, Snapshot)> {
        let mut pools: Vec<(PoolId, Shared<D>)> = self
            .active
            .lock()
            .iter()
            .map(|(id, (p, _))| (*id, p.clone()))
            .collect();
        pools.extend(self.retired.lock().iter().cloned());
        pools
            .into_iter()
            .filter(|(id, _)| only.is_none_or(|o| o == *id))
            .map(|(id, p)| (id, p.alloc.snapshot()))
            .collect()
    }

    /// Sets every pool's memory limit (the device's: `CachingAllocator::set_memory_limit`).
    pub fn set_memory_limit(&self, limit: Option<u64>) {
        for p in self.all() {
            p.alloc.set_memory_limit(limit);
        }
    }

    /// Sets every pool's peer devices (the device's: `CachingAllocator::set_peer_access`): each
    /// pool is tried even after one fails to grant its pages' access (that one keeps its
    /// peers); the first error is returned.
    pub fn set_peer_access(&self, peers: &[usize]) -> Result<(), AllocError> {
        let mut first = Ok(());
        for p in self.all() {
            let r = p.alloc.set_peer_access(peers);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Every pool, active and retired. Both locks are held together (in `acquire`'s order),
    /// so that a pool moving from retired to active meanwhile is not missed.
    fn all(&self) -> Vec<Shared<D>> {
        self.all_and(|| ()).0
    }

    /// [`Pools::all`], and `read` of the dropped pools' counters run under the same locks: a
    /// pool dropped meanwhile is counted once, listed or folded (`drop_retired` moves it
    /// under the `retired` lock).
    fn all_and<T>(&self, read: impl FnOnce() -> T) -> (Vec<Shared<D>>, T) {
        let active = self.active.lock();
        let retired = self.retired.lock();
        let mut out: Vec<Shared<D>> = active.values().map(|(p, _)| p.clone()).collect();
        out.extend(retired.iter().map(|(_, p)| p.clone()));
        (out, read())
    }
}

#[cfg(test)]
#[path = "pools_tests.rs"]
mod tests;
