//! [`Pool`]: a [`Core`] and the [`Policy`] it asks, and the allocation ladder between them.
//!
//! An allocation runs PyTorch's `malloc` step by step: round the request and pick its pool
//! (shared by every policy), ask the policy for a cached block ([`Policy::place`]); when there is
//! none, climb the out-of-memory ladder (PyTorch's garbage collection under a memory limit, then
//! new memory through [`Policy::grow`], then what [`Policy::release`] gives back, then every
//! cached block, then what [`Policy::release_pinned`] gives back, retrying after each), split
//! what was found when the policy says so ([`Policy::should_split`]), hand it out and tell the
//! policy ([`Policy::on_alloc`]). A free
//! goes back through the core, which tells the policy of the blocks it marked
//! ([`Policy::on_marked_free`]) and of the ranges it releases
//! ([`Policy::on_segment_released`]).
//!
//! The pool reads the core through `Deref` (statistics, snapshot, invariants); every operation
//! that changes it goes through the pool, so that the policy hears of it.

use crate::config::Config;
use crate::error::{AllocError, ConfigError};
use crate::policy::{Builtin, Policy};
use crate::pool::block::BlockId;
use crate::pool::config::PoolConfig;
use crate::pool::{note_free, Allocation, Core, Handle, Request};
use crate::sizes;
use crate::stats::SharedPeak;
use crate::sync::{Arc, AtomicBool, AtomicU64};
use cudalloc_sys::{Device, DeviceError, StreamId};

/// A free [`Pool::try_free`] could not make: why, and the allocation, still allocated, when it
/// is one (`None` for a handle the pool does not hold).
#[derive(Debug)]
pub struct FreeError {
    /// Why the free failed.
    pub error: AllocError,
    /// The allocation, to free again later.
    pub allocation: Option<Allocation>,
}

impl std::fmt::Display for FreeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for FreeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// A single-threaded caching pool over a device: the core's mechanism under policy `P` (the
/// built-in policy the config names, unless another is given).
pub struct Pool<D: Device, P: Policy = Builtin> {
    pub(crate) core: Core<D>,
    pub(crate) policy: P,
    /// The ladder ends before its last resort ([`Policy::release_pinned`]), except in
    /// [`Pool::allocate_again`]: set by a front that releases other pools' cached memory
    /// between the two tries, which costs less than moving live bytes.
    pub(crate) defer_last_resort: bool,
    /// A graph pool's (`CachingAllocator::graph_pool`): its out-of-memory ladder stops after
    /// growth, as during a capture, since the replays of its graphs write the blocks it holds
    /// free; only `empty_cache` gives its memory back.
    pub(crate) keeps_memory: bool,
}

impl<D: Device> Pool<D> {
    /// A pool with no memory yet, under the built-in policy `cfg` names.
    pub fn new(device: D, cfg: Config) -> Pool<D> {
        let policy = Builtin::new(cfg.policy_config());
        Pool::checked(device, cfg.pool().clone(), policy)
    }
}

impl<D: Device, P: Policy> std::ops::Deref for Pool<D, P> {
    type Target = Core<D>;

    fn deref(&self) -> &Core<D> {
        &self.core
    }
}

impl<D: Device, P: Policy> Pool<D, P> {
    /// A pool with no memory yet under `policy`, with the settings every policy shares
    /// (rounding, `max_split_size`, garbage collection, the memory fraction); an error names
    /// the first setting [`PoolConfig::validate`] or the policy's own check
    /// ([`Policy::validate`]) refuses.
    pub fn with_policy(device: D, cfg: PoolConfig, policy: P) -> Result<Pool<D, P>, ConfigError> {
        cfg.validate()?;
        policy.validate()?;
        Ok(Pool::checked(device, cfg, policy))
    }

    /// [`Pool::with_policy`] with settings already validated.
    fn checked(device: D, cfg: PoolConfig, policy: P) -> Pool<D, P> {
        Pool {
            core: Core::new(device, cfg),
            policy,
            defer_last_resort: false,
            keeps_memory: false,
        }
    }

    /// The policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// True while the policy wants every large block of this pool to come back to it rather
    /// than wait in a thread cache ([`Policy::watches_large_blocks`]).
    pub fn watches_large_blocks(&self) -> bool {
        self.policy.watches_large_blocks()
    }

    /// The error for a request above [`sizes::MAX_REQUEST`] ([`Core::refuse_too_large`]).
    pub(crate) fn refuse_too_large(&mut self, size: u64) -> AllocError {
        self.core.refuse_too_large(size)
    }

    /// Allocates `size` bytes on `stream`.
    pub fn allocate(&mut self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        self.allocate_or_grow(size, stream, true)
            .map(|a| Allocation(a.expect("an allocation that may grow")))
    }

    /// Allocates `size` bytes on `stream` from cached blocks only; `Ok(None)` when that would
    /// need new device memory.
    pub fn allocate_cached(
        &mut self,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<Allocation>, AllocError> {
        Ok(self.allocate_or_grow(size, stream, false)?.map(Allocation))
    }

    fn allocate_or_grow(
        &mut self,
        size: u64,
        stream: StreamId,
        may_grow: bool,
    ) -> Result<Option<Handle>, AllocError> {
        if size > sizes::MAX_REQUEST {
            return Err(self.core.refuse_too_large(size));
        }
        self.refuse_asleep("allocate")?;
        self.core.apply_fraction()?;
        if !self.core.capturing() {
            if self.core.deferred_blocks() > 0 {
                self.core.record_owed(&mut self.policy);
            }
            self.core.process_events(&mut self.policy)?;
            if !self.core.releasing.is_empty() {
                self.core.poll_releasing();
            }
        }
        let req = self.request(size, stream);
        let rounded = req.size;
        let id = match self.policy.place(&mut self.core, &req, may_grow)? {
            Some(id) => id,
            None if may_grow => self.grow(&req, size)?,
            None => return Ok(None),
        };
        self.core.check_placed(id, &req)?;
        let split = self.policy.should_split(&self.core, id, rounded);
        let id = self.core.alloc_found_block(id, &req, size, split);
        self.policy.on_alloc(&mut self.core, id);
        Ok(Some(self.core.hand_out(id, size, stream)))
    }

    /// The out-of-memory ladder: new memory, then what the policy releases (oversize cached
    /// blocks, as PyTorch), then every cached block, then what the policy gives back of the
    /// chunks live blocks keep mapped ([`Policy::release_pinned`]), then give up with
    /// [`AllocError::OutOfMemory`]. During a capture, and in a pool that keeps its memory, only
    /// the first rung.
    fn grow(&mut self, req: &Request, orig: u64) -> Result<BlockId, AllocError> {
        if self.core.capturing() || self.keeps_memory {
            return self.grow_only(req, orig);
        }
        if self.core.limit.is_some() && self.core.cfg.garbage_collection_threshold > 0.0 {
            crate::policy::torch::garbage_collect_cached_blocks(&mut self.core)?;
        }
        if let Some(id) = self.alloc_block(req, false)? {
            return Ok(id);
        }
        if self.policy.release(&mut self.core, req)? {
            self.core.poll_releasing();
            if let Some(id) = self.alloc_block(req, false)? {
                return Ok(id);
            }
        }
        // Pages on their way back may be what the growth needs (under a cap, or on a full
        // device): wait for them (counted in `device_waits`) before giving back every cached
        // block. A failure leaves its blocks releasing (a moved block whose unmap failed holds
        // no bytes), and the retry uses what the others gave back; the next rung meets it again.
        // (Moved blocks alone free nothing: their pages are other blocks' now.)
        if self.core.releasing_bytes() > 0 {
            let _ = self.core.finish_releasing();
            if let Some(id) = self.alloc_block(req, false)? {
                return Ok(id);
            }
        }
        self.release_cached_blocks()?;
        if let Some(id) = self.alloc_block(req, true)? {
            return Ok(id);
        }
        // The last resort: free pages that chunks kept mapped by live blocks hold.
        if !self.defer_last_resort && self.policy.release_pinned(&mut self.core, req)? {
            if let Some(id) = self.alloc_block(req, false)? {
                return Ok(id);
            }
        }
        self.core.stats.num_ooms += 1;
        Err(self.core.oom_error(orig, req))
    }

    /// The ladder during a capture (`capture`) and in a pool that keeps its memory: growth
    /// only, since its other rungs free segments or wait for the device.
    fn grow_only(&mut self, req: &Request, orig: u64) -> Result<BlockId, AllocError> {
        if let Some(id) = self.alloc_block(req, false)? {
            return Ok(id);
        }
        self.core.stats.num_ooms += 1;
        Err(self.core.oom_error(orig, req))
    }

    /// New memory for a request, as the policy gets it. `Ok(None)` is out of memory (the ladder
    /// may free cached memory and retry).
    fn alloc_block(
        &mut self,
        req: &Request,
        is_retry: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        if is_retry {
            self.core.stats.num_alloc_retries += 1;
        }
        self.core.reserve_failed = false;
        self.core.capture_refused = false;
        let grown = self.policy.grow(&mut self.core, req);
        // Ranges the policy released itself: now that its call returned, before any index is
        // reused.
        for segment in self.core.take_released_ranges() {
            self.policy.on_segment_released(segment);
        }
        grown
    }

    /// Frees an allocation. It is consumed even when the free fails; [`Pool::try_free`] gives
    /// it back then.
    pub fn free(&mut self, a: Allocation) -> Result<(), AllocError> {
        self.free_handle(&a.0)
    }

    /// Frees an allocation, or gives it back with the error when the pool could not free it (a
    /// device error while recording the events of the other streams it was used on, a
    /// sleeping pool), so that the caller can try again. A handle the pool does not hold (of
    /// another pool, or freed already) is refused and not given back: it is no allocation.
    pub fn try_free(&mut self, a: Allocation) -> Result<(), Box<FreeError>> {
        match self.free_handle(&a.0) {
            Ok(()) => Ok(()),
            Err(error @ AllocError::NotAllocated(_)) => Err(Box::new(FreeError {
                error,
                allocation: None,
            })),
            Err(error) => Err(Box::new(FreeError {
                error,
                allocation: Some(a),
            })),
        }
    }

    /// Frees the allocation `a` is a copy of (the thread-safe front keeps such copies).
    pub(crate) fn free_handle(&mut self, a: &Handle) -> Result<(), AllocError> {
        self.refuse_asleep("free")?;
        let core = &mut self.core;
        let found = core
            .blocks
            .get(a.block)
            .filter(|b| b.allocated && b.addr == a.ptr && b.event_count == 0)
            .filter(|b| b.serial == a.serial);
        // Not `ok_or`: an error made and dropped on every free costs its drop glue.
        let Some(b) = found else {
            return Err(AllocError::NotAllocated(a.ptr));
        };
        let (pool, size) = (b.pool, b.size);
        if !b.stream_uses.is_empty() {
            if core.capturing() || core.used_in_capture(a.block) {
                core.defer_events(a.block);
            } else {
                core.insert_events(a.block)?;
            }
        }
        // A free, even one that waits for other streams' work first.
        note_free(&core.unfreed);
        core.stats.allocation.decrease(pool, 1);
        core.stats.allocated_bytes.decrease(pool, size);
        if size >= core.cfg.max_split_size {
            core.stats.oversize_allocations.decrease(1);
        }
        if !core.blocks[a.block].waits() {
            core.free_block(&mut self.policy, a.block);
        }
        Ok(())
    }

    /// The caller begins a CUDA graph capture in `mode` ([`Core::begin_capture`]).
    pub fn begin_capture(&mut self, mode: cudalloc_sys::CaptureMode) {
        self.core.begin_capture(mode);
    }

    /// The caller ended a capture in `mode`: blocks freed during it that other streams used
    /// start waiting for those streams' work.
    pub fn end_capture(&mut self, mode: cudalloc_sys::CaptureMode) -> Result<(), AllocError> {
        self.core.end_capture(&mut self.policy, mode)
    }

    /// Puts the pool to sleep: every page goes back to the device, the virtual ranges stay
    /// reserved, and with `offload` the bytes of every live allocation are kept in pinned host
    /// memory first (`pool::sleep`). Until [`Pool::wake`], allocations, frees and
    /// `record_stream` are refused ([`AllocError::Asleep`]) and `empty_cache` does nothing.
    /// When it already sleeps, only retries the pages an incomplete sleep left mapped
    /// ([`AllocError::SleepIncomplete`]); refused during a capture and under the `torch` policy
    /// ([`AllocError::SleepUnsupported`]).
    pub fn sleep(&mut self, offload: bool) -> Result<(), AllocError> {
        self.core.sleep(&mut self.policy, offload)
    }

    /// Wakes the pool: new pages at the same addresses, the offloaded bytes copied back, and
    /// later work on `stream`, and on the streams that used its memory, ordered after the
    /// copies (the host does not wait for them). Out of memory leaves it asleep and
    /// intact ([`AllocError::OutOfMemory`]); nothing when it is awake.
    pub fn wake(&mut self, stream: StreamId) -> Result<(), AllocError> {
        self.core.wake(stream)
    }

    /// Frees the pinned host buffer that offloading sleeps copy into, kept across wakes for
    /// the next sleep, once the copies into or out of it completed; nothing while the pool
    /// sleeps (the buffer holds its bytes) or when it has none. Refused during a capture
    /// ([`AllocError::DuringCapture`]: it waits for the copy stream and frees pinned memory).
    pub fn release_host_buffer(&mut self) -> Result<(), AllocError> {
        self.core.refuse_during_capture("release_host_buffers")?;
        Ok(self.core.release_host_buffer()?)
    }

    /// [`AllocError::Asleep`] for `what` while the pool sleeps.
    pub(crate) fn refuse_asleep(&self, what: &'static str) -> Result<(), AllocError> {
        if self.core.asleep() {
            return Err(AllocError::Asleep { what, tag: None });
        }
        Ok(())
    }

    /// Returns every cached block that can go back to the device (PyTorch's `empty_cache`).
    pub fn empty_cache(&mut self) -> Result<(), AllocError> {
        if self.core.capturing() {
            return Err(AllocError::DuringCapture {
                what: "empty_cache",
                requested: 0,
            });
        }
        self.release_cached_blocks()?;
        Ok(())
    }

    /// Releases every cached block that can go (see [`Core::release_all_cached`]), counting one
    /// wait for all streams.
    pub(crate) fn release_cached_blocks(&mut self) -> Result<(), DeviceError> {
        self.core.count_sync_all_streams();
        self.release_all_cached()
    }

    /// Releases every cached block that can go without counting its wait: for a sweep over the
    /// stream shards of one allocator, which counts its one wait itself.
    pub(crate) fn release_all_cached(&mut self) -> Result<(), DeviceError> {
        if self.core.asleep() {
            return Ok(()); // it holds no pages, and its ranges must stay
        }
        self.core.release_all_cached(&mut self.policy)
    }

    /// The front's look at a pool whose stream may have gone idle
    /// ([`crate::policy::front::FrontRules::idle_after`]): for a policy that gives back idle
    /// streams' memory ([`Policy::gives_back_idle`]), the bytes it holds cached once its
    /// completed stream events are processed ([`Core::settle_idle`]); `None` for the others.
    pub(crate) fn idle_cached(&mut self) -> Result<Option<u64>, DeviceError> {
        if !self.policy.gives_back_idle() {
            return Ok(None);
        }
        self.core.settle_idle(&mut self.policy).map(Some)
    }

    /// Gives back, without waiting, the cached memory of a pool whose stream has gone idle
    /// ([`Core::give_back_idle`]); the bytes started back.
    pub(crate) fn give_back_idle(&mut self) -> Result<u64, DeviceError> {
        self.core.give_back_idle()
    }

    /// Counts one wait for all streams (PyTorch's `num_sync_all_streams`).
    pub(crate) fn count_sync_all_streams(&mut self) {
        self.core.count_sync_all_streams();
    }

    /// The ladder's last resort ([`Policy::release_pinned`]) alone, for a request of `size`
    /// bytes on `stream` that a pool of the same limit could not fit; true when it gave
    /// something back. Never during a capture or asleep. An error is a driver failure: one
    /// that stopped it before any chunk changed, or a kept run left unmapped, its live bytes
    /// lost (`pool::repage`).
    pub(crate) fn last_resort(&mut self, size: u64, stream: StreamId) -> Result<bool, AllocError> {
        if self.core.capturing() || self.core.asleep() {
            return Ok(false);
        }
        let req = self.request(size, stream);
        Ok(self.policy.release_pinned(&mut self.core, &req)?)
    }

    /// The request `size` bytes on `stream` make: rounded, in the pool of their rounded size.
    pub(crate) fn request(&self, size: u64, stream: StreamId) -> Request {
        let rounded = self.core.cfg.round_size(size);
        Request {
            stream,
            pool: sizes::PoolKind::for_size(rounded),
            size: rounded,
            alloc_size: sizes::segment_size(rounded),
        }
    }

    /// Tries again a request that ran out of memory here, after the caller released memory
    /// held elsewhere (the other stream shards of one allocator): part of the same allocation,
    /// so it counts no retry, wait or out-of-memory event of its own, and takes back the first
    /// try's out-of-memory event when it succeeds (PyTorch counts an allocation that failed
    /// once, not each try).
    pub(crate) fn allocate_again(
        &mut self,
        size: u64,
        stream: StreamId,
    ) -> Result<Allocation, AllocError> {
        let s = &self.core.stats;
        let counts = (s.num_ooms, s.num_alloc_retries, s.num_sync_all_streams);
        let deferred = std::mem::replace(&mut self.defer_last_resort, false);
        let r = self.allocate(size, stream);
        self.defer_last_resort = deferred;
        let s = &mut self.core.stats;
        (s.num_ooms, s.num_alloc_retries, s.num_sync_all_streams) = counts;
        if r.is_ok() {
            s.num_ooms = s.num_ooms.saturating_sub(1);
        }
        r
    }

    /// Marks an allocation as used on `stream` (PyTorch's `record_stream`).
    pub fn record_stream(&mut self, a: &Allocation, stream: StreamId) -> Result<(), AllocError> {
        self.refuse_asleep("record_stream")?;
        self.core.record_stream(a.0.block, a.0.ptr, stream)
    }

    /// Marks block `block` at `ptr` as used on `stream` (the front's copy of a handle).
    pub(crate) fn record_block_stream(
        &mut self,
        block: BlockId,
        ptr: u64,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        self.core.record_stream(block, ptr, stream)
    }

    /// Caps the bytes the pool may hold from the device (`None`: no cap).
    pub fn set_limit(&mut self, limit: Option<u64>) {
        self.core.set_limit(limit);
    }

    /// Caps the pool at `fraction` of the device's total memory ([`Core::set_memory_fraction`]).
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), AllocError> {
        self.core.set_memory_fraction(fraction)
    }

    /// Turns the config's memory fraction into the limit, once (`Core::apply_fraction`).
    pub fn apply_fraction(&mut self) -> Result<(), AllocError> {
        self.core.apply_fraction()
    }

    /// Sets the peer devices whose access every page of the pool has: the pages mapped from now
    /// on, and the ones mapped already when the list adds a device (`Core::set_peers`: on a
    /// failure to grant the list stays as it was).
    pub fn set_peers(&mut self, peers: Vec<usize>) -> Result<(), AllocError> {
        self.core.set_peers(peers)
    }

    /// Resets peak statistics. Only the statistics: a policy keeps its own figures (the
    /// `default` policy's budget base, the most bytes ever requested at once: a job that resets
    /// its peaks every epoch must not make the pool give back and map again the memory of its
    /// next step).
    pub fn reset_peak_stats(&mut self) {
        self.core.reset_peak_stats();
    }

    /// Starts (or stops) keeping the addresses of frees that waited for events
    /// ([`Core::track_completions`]).
    pub fn track_completions(&mut self, on: bool) {
        self.core.track_completions(on);
    }

    /// The frees that waited for events and completed since the last call
    /// ([`Core::take_completions`]).
    pub fn take_completions(&mut self) -> Vec<(u64, StreamId)> {
        self.core.take_completions()
    }

    /// Makes this pool count its reserved bytes into `counter` ([`Core::share_reserved`]).
    pub fn share_reserved(&mut self, counter: Arc<AtomicU64>) {
        self.core.share_reserved(counter);
    }

    /// Makes this pool count the bytes it holds into `peak` too.
    pub(crate) fn share_reserved_peak(&mut self, peak: Arc<SharedPeak>) {
        self.core.share_reserved_peak(peak);
    }

    /// Makes this pool count its reserved bytes into its group's `counter` too, the one its
    /// limit applies to ([`Core::share_group`]).
    pub(crate) fn share_group(&mut self, group: &crate::allocator::Group) {
        self.core
            .share_group(group.reserved.clone(), group.peak.clone());
    }

    /// Makes this pool's "nothing freed yet" end when `flag`'s does ([`Core::share_unfreed`]).
    pub(crate) fn share_unfreed(&mut self, flag: Arc<AtomicBool>) {
        self.core.share_unfreed(flag);
    }
}

impl<D: Device, P: Policy> Drop for Pool<D, P> {
    /// Gives everything back to the device: live allocations die with the pool. While a capture
    /// the pool was told of is underway, the memory goes back without a wait
    /// (`Core::release_all_unwaited`), and a pinned host buffer (`sleep`'s) stays allocated,
    /// since its wait and its free would invalidate the capture; when that release fails, it
    /// is tried once more. When the release fails otherwise, the pool waits for the device and
    /// then gives back what is left the same way (without the wait too when the device refuses
    /// it). The drop asks the driver nothing of the streams the pool has seen and records no
    /// event on them: a program may have destroyed them already (a Rust program drops its
    /// streams before the allocator as often as after), and the driver may crash on a
    /// destroyed stream's handle. Blocks deferred for a capture go back after a wait for the
    /// whole device, live blocks without events, and a block whose event the device will not
    /// wait for (`Core::dropping`) after the fallback's wait for the whole device.
    fn drop(&mut self) {
        self.core.dropping = true;
        // A capture the caller told of may be of a stream the pool holds nothing of. Blocks
        // deferred for a capture go back without their events: after a wait for the whole
        // device (no stream handle) unless a capture is underway.
        let told = self.core.capturing();
        self.core.forget_captures();
        if !told && self.core.deferred_blocks() > 0 {
            self.core.stats.device_waits += 1;
            let _ = self.core.device.synchronize_device();
        }
        self.core.forget_deferred(&mut self.policy);
        let unwaited = told;
        if !unwaited {
            let _ = self.core.synchronize_and_free_events(&mut self.policy);
        }
        if self.core.drop_asleep(unwaited) {
            self.core.release_scratch();
            self.core.destroy_spare_events();
            self.core.destroy_copy_stream();
            return;
        }
        let live: Vec<Handle> = self
            .core
            .blocks
            .iter()
            .filter(|(_, b)| b.allocated)
            .map(|(id, b)| Handle {
                ptr: b.addr,
                size: b.requested,
                stream: b.stream,
                block: id,
                serial: b.serial,
                tag: self.core.tag,
            })
            .collect();
        for a in live {
            // Live memory dies with the pool: no event on the streams that used it.
            self.core.blocks[a.block].stream_uses.clear();
            let _ = self.free_handle(&a);
        }
        if unwaited {
            // A release the device refused stopped the rest: one more try, as below (nothing
            // is left to wait for here).
            if self.core.release_all_unwaited(&mut self.policy).is_err() {
                let _ = self.core.release_all_unwaited(&mut self.policy);
            }
        } else if self.release_cached_blocks().is_err() {
            self.core.stats.device_waits += 1;
            let _ = self.core.device.synchronize_device();
            let _ = self.core.release_all_unwaited(&mut self.policy);
        }
        self.core.release_scratch();
        if !unwaited {
            let _ = self.core.release_host_buffer();
        }
        self.core.destroy_spare_events();
        self.core.destroy_copy_stream();
    }
}
