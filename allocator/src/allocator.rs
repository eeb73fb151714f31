//! The thread-safe front: [`CachingAllocator`].
//!
//! Blocks belong to a stream and are reused only by it (but for the blocks one shard lends
//! another under `lend_blocks:True`: `lend`), so the allocator is split into shards by
//! stream: each shard is a [`Pool`] behind its own lock, and a stream's shard is chosen by a hash
//! of the stream (64 shards), so threads working on different streams wait for each other only
//! when their streams share a shard. All shards count their reserved bytes into one shared counter, to
//! which the memory limit applies; when a shard runs out of memory, the cached memory of every
//! other shard and tag pool is released (under a limit, every one of those pools' last resort
//! runs too) and the allocation retried once before out-of-memory is returned.
//!
//! Statistics are the sums over shards, with PyTorch's meanings (a block in a thread cache is
//! not allocated; an allocation that failed is one OOM however many shards it tried). With one
//! stream (one shard) and thread caches off they are exactly PyTorch's; a block waiting in a
//! thread cache counts in the peaks until it leaves it, and with several streams a `peak` is the
//! sum of the shards' peaks, an upper bound of the true peak, except
//! `reserved_bytes.all.peak`: the shards count what they hold into one [`SharedPeak`] once the
//! device granted it, so it is exact (and a pool's reserved peak is capped by it).
//!
//! With `thread_cache` on (the `default` policy's default), freed blocks may stay in the freeing
//! thread's cache and serve that thread's next request of the same size and stream without any pool
//! lock ([`crate::tcache`]): a cache hit and the free before it take one live-table lock each.
//! Cached blocks are subtracted from the statistics' current values (and are `ThreadCached` in a
//! snapshot) and cache hits added to their counts of allocations and frees (the live table keeps
//! both totals); peaks may include cached blocks. Which blocks skip the caches, and when cached
//! blocks go back to their pools before a pool grows, the front asks the policy layer
//! ([`FrontRules`]): it reports what it sees (a shard's lock found held or free, whether a pool
//! watches its large blocks after each operation on it) and does what the rules say. A thread
//! that finds a watched pool's lock held frees into, or hits, its cache instead of waiting (a
//! miss or an eviction still takes the lock).
//!
//! Tagged allocations (`allocate_tagged`) live in one pool per tag (`tags`), outside the
//! shards and the thread caches; their pools can sleep and wake.
//!
//! Lock order: a stream shard (or the tags' lock), then a live-table shard; where the tags' lock
//! and shard locks are both held, the shards' come first. A cached block goes back to its pool
//! only under its stream shard's lock, removed from the live table in the same critical
//! section, so the shards and the live table agree whenever all shard locks are held, which
//! `stats()` does while it counts the cached blocks (a cache hit or a free into a cache takes no
//! shard lock, so a figure read while other threads allocate may be off by one block per thread
//! doing so at that instant).

use crate::config::Config;
use crate::error::AllocError;
use crate::ladder::Pool;
use crate::lend::Lending;
use crate::live::{Entry, LiveMap};
use crate::policy::front::FrontRules;
use crate::pool::{Allocation, Handle};
use crate::stats::SharedPeak;
use crate::sync::{Arc, AtomicBool, AtomicU64, CachePadded, Mutex, MutexGuard, Ordering};
use crate::tags::Tags;
use crate::tcache::{Cached, Caches, Kept};
use cudalloc_sys::{Device, StreamId};

/// Number of stream shards.
const SHARDS: usize = 64;

/// A caching allocator over one device; `Send + Sync`.
///
/// Every method takes `&self`. Allocations are returned as [`Allocation`] values; free them with
/// [`CachingAllocator::free`] (or by address with [`CachingAllocator::free_ptr`]).
pub struct CachingAllocator<D: Device> {
    pub(crate) device: Arc<D>,
    pub(crate) shards: Box<[Shard<D>]>,
    pub(crate) reserved: Arc<AtomicU64>,
    /// The bytes this allocator and its graph pools hold together, which its memory limit
    /// caps, and their peak (`graph_pool`).
    pub(crate) group: Group,
    /// The bytes the shards hold together, and the most they held at once since peaks were
    /// last reset.
    pub(crate) reserved_peak: Arc<SharedPeak>,
    pub(crate) live: LiveMap,
    pub(crate) caches: Option<Caches>,
    /// The thread-cache rules the policies set, with the per-shard state they read.
    pub(crate) rules: FrontRules,
    /// Whether free blocks are lent across streams, and which shards may lend (`lend`).
    pub(crate) lending: Lending,
    /// Shared by every shard's pool: true until the first free, wherever it goes (a pool or a
    /// thread cache): a fact the policies may read ([`crate::pool::Core::nothing_freed`]).
    pub(crate) unfreed: Arc<AtomicBool>,
    pub(crate) cfg: Config,
    /// The pools of the caller's tags (`tags`).
    pub(crate) tags: Tags<D>,
    /// A graph pool's (`graph_pool`): out of memory, nothing cached is given back (the ladder
    /// of every shard and tag pool stops after growth, and no other pool is emptied).
    pub(crate) keeps_memory: bool,
}

/// What an allocator and its graph pools count together: the bytes they hold, which the
/// memory limit caps, and the most they held at once.
#[derive(Clone, Default)]
pub(crate) struct Group {
    pub reserved: Arc<AtomicU64>,
    pub peak: Arc<SharedPeak>,
}

/// One stream shard: a pool behind its own lock, on its own cache lines.
pub(crate) type Shard<D> = CachePadded<Mutex<Pool<Arc<D>>>>;

pub(crate) fn shard_of(stream: StreamId) -> usize {
    let h = stream.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (h >> 58) as usize % SHARDS
}

impl<D: Device> CachingAllocator<D> {
    /// An allocator with the given configuration.
    pub fn new(device: D, cfg: Config) -> Self {
        Self::on_shared_device(Arc::new(device), cfg, Group::default(), false)
    }

    /// An allocator over a device another allocator also uses, counting in `group` with it
    /// (`graph_pool`).
    pub(crate) fn on_shared_device(
        device: Arc<D>,
        cfg: Config,
        group: Group,
        keeps_memory: bool,
    ) -> Self {
        let reserved = Arc::new(AtomicU64::new(0));
        let reserved_peak = Arc::new(SharedPeak::default());
        let unfreed = Arc::new(AtomicBool::new(true));
        let shards = (0..SHARDS)
            .map(|_| {
                let mut pool = Pool::new(device.clone(), cfg.clone());
                // The other shards' and thread caches' memory goes back before live bytes move.
                pool.defer_last_resort = true;
                pool.keeps_memory = keeps_memory;
                pool.share_reserved(reserved.clone());
                pool.share_group(&group);
                pool.share_reserved_peak(reserved_peak.clone());
                pool.share_unfreed(unfreed.clone());
                CachePadded::new(Mutex::new(pool))
            })
            .collect::<Box<[Shard<D>]>>();
        let lending = Lending::new(shards[0].lock().lends_blocks());
        let caches = cfg.thread_cache_on().then(|| {
            let front = cfg.front();
            Caches::new(
                front.thread_cache_bytes,
                front.thread_cache_block,
                front.thread_cache_large,
                cfg.pool().max_split_size,
            )
        });
        CachingAllocator {
            device,
            shards,
            reserved,
            group,
            reserved_peak,
            live: LiveMap::new(caches.as_ref().map_or(u64::MAX, Caches::small_part_limit)),
            rules: FrontRules::new(SHARDS),
            lending,
            unfreed,
            caches,
            cfg,
            tags: Tags::default(),
            keeps_memory,
        }
    }

    /// An allocator with the given configuration, after checking it against the device: with
    /// `shareable_segments:True`, a device (or driver) that cannot export pages is refused here,
    /// with an error naming the key, rather than at the first allocation. [`CachingAllocator::new`]
    /// does not ask the device; there, such a device fails the first page it is asked for.
    pub fn try_new(device: D, cfg: Config) -> Result<Self, crate::config::ConfigError> {
        if cfg.pool().shareable_segments {
            let n = device.ordinal();
            let refuse = |why: String| crate::config::ConfigError::new("shareable_segments", why);
            match device.can_share() {
                Ok(true) => {}
                Ok(false) => {
                    return Err(refuse(format!(
                        "device {n} cannot export memory as POSIX file descriptors \
                         (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0); \
                         leave the key off"
                    )))
                }
                Err(e) => {
                    return Err(refuse(format!(
                        "cannot ask device {n} whether it exports memory: {e}"
                    )))
                }
            }
        }
        Ok(Self::new(device, cfg))
    }

    /// An allocator configured from `CUDALLOC_CONF` (absent: the `default` policy).
    pub fn from_env(device: D) -> Result<Self, crate::config::ConfigError> {
        Ok(Self::new(device, Config::from_env()?))
    }

    pub(crate) fn shard(&self, stream: StreamId) -> MutexGuard<'_, Pool<Arc<D>>> {
        self.shards[shard_of(stream)].lock()
    }

    /// Allocates `size` bytes for use on `stream`. Zero bytes yield a valid 512-byte block, as
    /// PyTorch's block pool rounds them (its front, like the C ABI's `cudalloc_malloc`, hands
    /// out nothing for zero bytes instead).
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        if size > crate::sizes::MAX_REQUEST {
            return Err(self.shard(stream).refuse_too_large(size));
        }
        if let Some(c) = &self.caches {
            if let Some(a) = self.allocate_through_caches(c, size, stream)? {
                return Ok(a);
            }
        }
        if let Some(a) = self.lend_before_growth(size, stream)? {
            return Ok(a);
        }
        match self.try_allocate(size, stream, Try::Grow) {
            Err(e) if e.is_out_of_memory() => {
                if !self.release_for_retry(&e, shard_of(stream), size, stream)? {
                    return Err(e);
                }
                self.try_allocate(size, stream, Try::Again)
            }
            other => other,
        }
    }

    /// The thread caches' part of [`CachingAllocator::allocate`]: a hit, or the cached blocks
    /// the pool must see before it places the request (`None`: the pool places it, growing if
    /// it must).
    fn allocate_through_caches(
        &self,
        c: &Caches,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<Allocation>, AllocError> {
        // A pool that watches its large blocks gets the request, unless another thread is in
        // it (see `free`).
        let i = shard_of(stream);
        let watched = self.rules.bypasses_caches(i, size);
        if !watched || self.found_held(i) {
            if let Some(a) = c.take(&self.live, size, stream.0) {
                return Ok(Some(Allocation(a)));
            }
        }
        self.after_miss(c, size)?;
        // A watched pool must see every free of its shard before it places a large block: the
        // large parts of other threads give back what they hold of it first
        // ([`FrontRules::take_large_cached`]). Then, only if some thread's large part still
        // holds a block (the live table counts them) can the pool grow where a cached block
        // would do: it tries without growing first. (The count is read without a lock: a block
        // cached at this moment may be missed and the pool grow instead; out of memory, every
        // cache is flushed anyway.)
        let others_hold = || c.others_exist() && self.live.holds_large();
        if watched && others_hold() && self.rules.take_large_cached(i) {
            self.release_large_parts_of(c, i)?;
        }
        if self.rules.large_parts_before_growth() && self.live.holds_large() {
            if let Some(a) = self.try_allocate_cached(size, stream)? {
                return Ok(Some(a));
            }
            self.release_large_parts(c)?;
        }
        Ok(None)
    }

    /// A thread-cache miss for `size` bytes: the blocks of exited threads' caches and, for a
    /// request of the large pool, this thread's large part go back to their pools first.
    fn after_miss(&self, c: &Caches, size: u64) -> Result<(), AllocError> {
        for orphan in c.adopt_orphans() {
            self.evict(&orphan)?;
        }
        if size > crate::sizes::SMALL_SIZE {
            c.release_large(|e| self.evict(e))?;
        }
        Ok(())
    }

    /// Sends a block leaving a thread cache to its pool (nothing if the copy is stale).
    fn evict(&self, e: &Cached) -> Result<(), AllocError> {
        self.free_cached_to_pool(&e.alloc, e.token).map(drop)
    }

    /// Before a pool grows: every thread's large part goes back to its pool
    /// ([`FrontRules::large_parts_before_growth`]).
    fn release_large_parts(&self, c: &Caches) -> Result<(), AllocError> {
        for e in self.live.cached_entries() {
            if !c.in_small_part(e.block_size) {
                self.free_cached_to_pool(&e.alloc, e.token)?;
            }
        }
        Ok(())
    }

    /// Every thread's large part gives back what it holds of stream shard `i` (whichever of its
    /// streams) to its pool.
    fn release_large_parts_of(&self, c: &Caches, i: usize) -> Result<(), AllocError> {
        for e in self.live.cached_entries() {
            if shard_of(e.alloc.stream) == i && !c.in_small_part(e.block_size) {
                self.free_cached_to_pool(&e.alloc, e.token)?;
            }
        }
        Ok(())
    }

    /// A pool allocation from cached blocks only (`None`: the pool would have to grow).
    pub(crate) fn try_allocate_cached(
        &self,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<Allocation>, AllocError> {
        self.pool_allocate(size, stream, Try::Cached)
    }

    fn try_allocate(
        &self,
        size: u64,
        stream: StreamId,
        how: Try,
    ) -> Result<Allocation, AllocError> {
        self.pool_allocate(size, stream, how)
            .map(|a| a.expect("an allocation that may grow"))
    }

    /// Allocates from the stream's pool as `how` says and records the pointer.
    fn pool_allocate(
        &self,
        size: u64,
        stream: StreamId,
        how: Try,
    ) -> Result<Option<Allocation>, AllocError> {
        if self.caches.is_some() {
            self.found_held(shard_of(stream)); // a miss: lets a crowded shard's score decay
        }
        let mut pool = self.shard(stream);
        let before = pool.reserved();
        let a = match how {
            Try::Cached => match pool.allocate_cached(size, stream)? {
                Some(a) => a,
                None => return Ok(None),
            },
            // Every thread cache was flushed before a second try: nothing for the check to do.
            Try::Again => pool.allocate_again(size, stream)?,
            Try::Grow => match self.small_growth_check(&mut pool, size, stream)? {
                Some(a) => a,
                None => pool.allocate(size, stream)?,
            },
        };
        let b = pool.block(a.0.block).expect("allocated block");
        self.live.insert(Entry::live(a.0, b.size, b.pool));
        self.lending.note_used(shard_of(stream));
        self.note_watched(stream, &pool);
        let grew = pool.reserved().saturating_sub(before);
        self.rules.note_allocation(shard_of(stream), grew);
        drop(pool);
        if grew > 0 {
            self.sweep_idle(shard_of(stream));
        }
        Ok(Some(a))
    }

    /// Before a small-pool request makes its pool grow: the small blocks that other threads
    /// hold cached on this stream go back to the pool, and the request is tried on it again
    /// ([`FrontRules::small_parts_before_growth`]). The calling thread's own are left alone.
    /// `None`: still no room, or nothing to release (the caller grows the pool).
    fn small_growth_check(
        &self,
        pool: &mut MutexGuard<'_, Pool<Arc<D>>>,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<Allocation>, AllocError> {
        let Some(c) = &self.caches else {
            return Ok(None);
        };
        if !self.rules.small_parts_before_growth(size) || !c.others_exist() {
            return Ok(None);
        }
        if let Some(a) = pool.allocate_cached(size, stream)? {
            return Ok(Some(a));
        }
        let mine = c.my_token_range();
        let mut released = 0;
        for e in self.live.cached_entries() {
            let others = Some(e.token >> 32) != mine;
            if e.alloc.stream != stream || !c.in_small_part(e.block_size) || !others {
                continue;
            }
            released += usize::from(self.free_cached_into(pool, &e.alloc, e.token)?);
        }
        if released == 0 {
            return Ok(None);
        }
        pool.allocate_cached(size, stream)
    }

    /// Tells the rules whether the stream's pool watches its large blocks, after an operation
    /// on it.
    pub(crate) fn note_watched(&self, stream: StreamId, pool: &Pool<Arc<D>>) {
        self.rules
            .note_watched(shard_of(stream), pool.watches_large_blocks());
    }

    /// Whether shard `i`'s lock is held now, told to the rules.
    fn found_held(&self, i: usize) -> bool {
        let held = self.shards[i].is_locked();
        self.rules.note_lock(i, held);
        held
    }

    /// Returns every block held in thread caches to its pool; returns how many there were.
    pub(crate) fn flush_thread_caches(&self) -> Result<usize, AllocError> {
        if self.caches.is_none() {
            return Ok(0);
        }
        let mut n = 0;
        for e in self.live.cached_entries() {
            n += usize::from(self.free_cached_to_pool(&e.alloc, e.token)?);
        }
        Ok(n)
    }

    /// Gives the block of `a`, cached under `token`, back to its pool, unless that is a stale
    /// copy (another thread took the block first); true when it went back.
    fn free_cached_to_pool(&self, a: &Handle, token: u64) -> Result<bool, AllocError> {
        self.free_cached_into(&mut self.shard(a.stream), a, token)
    }

    /// [`CachingAllocator::free_cached_to_pool`] with the stream shard's lock already held.
    fn free_cached_into(
        &self,
        pool: &mut MutexGuard<'_, Pool<Arc<D>>>,
        a: &Handle,
        token: u64,
    ) -> Result<bool, AllocError> {
        let Some(mut e) = self.live.take_cached(a.ptr, token) else {
            return Ok(false);
        };
        if let Err(err) = pool.free_handle(a) {
            // The pool still holds the block allocated: keep it in the table as live, so that
            // the table and the pools keep agreeing (the statistics, `check_invariants`).
            e.token = 0;
            self.live.insert(e);
            return Err(err);
        }
        self.note_watched(a.stream, pool);
        Ok(true)
    }

    /// Frees an allocation. A block used on other streams ([`CachingAllocator::record_stream`])
    /// returns to the pool once their work has completed.
    pub fn free(&self, a: Allocation) -> Result<(), AllocError> {
        self.free_handle(&a.0)
    }

    /// Frees the allocation `a` is a copy of.
    fn free_handle(&self, a: &Handle) -> Result<(), AllocError> {
        if a.tag != 0 {
            return self.free_tagged(a);
        }
        let Some(c) = &self.caches else {
            return self.free_to_pool(a);
        };
        let i = shard_of(a.stream);
        if self.rules.bypasses_caches(i, a.size) {
            // The pool watches its large blocks: it gets this one, unless another thread is in
            // it (then the block waits in this thread's cache, as it would without the rule,
            // rather than queue threads that share a stream behind one lock).
            let locked = self.shards[i].try_lock();
            self.rules.note_lock(i, locked.is_none());
            if let Some(pool) = locked {
                return self.free_to_locked_pool(pool, a);
            }
        }
        // A free into a thread cache is a free all the same.
        crate::pool::note_free(&self.unfreed);
        match c.put(&self.live, a, |e| self.evict(e))? {
            Kept::Large => self.rules.note_large_cached(i),
            Kept::Small => {}
            Kept::No => return self.free_to_pool(a),
        }
        Ok(())
    }

    /// Gives a block back to its pool and forgets its pointer.
    fn free_to_pool(&self, a: &Handle) -> Result<(), AllocError> {
        self.free_to_locked_pool(self.shard(a.stream), a)
    }

    /// [`CachingAllocator::free_to_pool`] with the stream shard's lock already held. The live
    /// entry is taken out before the pool frees the block (and put back if that fails), so a
    /// racing free of the same pointer, on any path, finds no live entry.
    fn free_to_locked_pool(
        &self,
        mut pool: MutexGuard<'_, Pool<Arc<D>>>,
        a: &Handle,
    ) -> Result<(), AllocError> {
        let e = self.live.take_live(a)?;
        // The pool's handle: a thread cache's hit handed `a` out with another serial.
        if let Err(err) = pool.free_handle(&e.alloc) {
            self.live.insert(e);
            return Err(err);
        }
        self.note_watched(a.stream, &pool);
        Ok(())
    }

    /// Frees the allocation at `ptr` (not one a `Buffer` owns: [`AllocError::OwnedByBuffer`]).
    pub fn free_ptr(&self, ptr: u64) -> Result<(), AllocError> {
        let e = self.live.live(ptr)?;
        if e.buffer {
            return Err(AllocError::OwnedByBuffer(ptr));
        }
        self.free_handle(&e.handle())
    }

    /// Frees the allocation at `ptr` that was made on `stream` (PyTorch's pluggable allocator
    /// passes the stream); a different stream is an error, and so is a `Buffer`'s allocation
    /// ([`AllocError::OwnedByBuffer`]).
    pub fn free_on(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        let e = self.live.live(ptr)?;
        if e.buffer {
            return Err(AllocError::OwnedByBuffer(ptr));
        }
        self.free_entry(e, stream)
    }

    /// Marks the live allocation at `ptr` as a `Buffer`'s: [`CachingAllocator::free_ptr`] and
    /// [`CachingAllocator::free_on`] refuse it from then on.
    pub(crate) fn mark_buffer(&self, ptr: u64) {
        self.live.mark_buffer(ptr);
    }

    /// Frees a `Buffer`'s allocation at `ptr`, made on `stream` (the buffer's way back).
    pub(crate) fn free_buffer(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        self.free_entry(self.live.live(ptr)?, stream)
    }

    /// Frees live entry `e` if it was made on `stream`.
    fn free_entry(&self, e: Entry, stream: StreamId) -> Result<(), AllocError> {
        let ptr = e.alloc.ptr;
        if !e.made_for(stream) {
            return Err(AllocError::WrongStream {
                ptr,
                allocated_on: e.lent_to.unwrap_or(e.alloc.stream),
                freed_on: stream,
            });
        }
        self.free_handle(&e.handle())
    }

    /// Marks the allocation at `ptr` as used on `stream` too.
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        let a = self.live.live(ptr)?.alloc;
        if a.tag != 0 {
            return self.record_tagged(&a, stream);
        }
        // Marked first: a free racing this call then finds the mark and skips the thread cache
        // (a block with other streams' uses must go back through its pool's events). A stream
        // the pool would refuse is refused before the mark, so that the call changes nothing.
        if stream != a.stream {
            self.with_device(|d| d.check_stream(stream))?;
            self.live.mark_recorded(ptr);
        }
        self.shard(a.stream)
            .record_block_stream(a.block, ptr, stream)
    }

    /// Starts (or stops) keeping, in every shard, the addresses of frees that waited for other
    /// streams' work when each completes ([`crate::pool::Core::track_completions`]; a trace
    /// recorder's). While kept, no block is lent across streams (`lend`).
    pub fn track_completions(&self, on: bool) {
        self.lending.pause(on);
        self.shards
            .iter()
            .for_each(|s| s.lock().track_completions(on));
    }

    /// The frees of allocations made on `stream` (or a stream of its shard) that waited for
    /// other streams' work and completed since the last call ([`crate::pool::Core::take_completions`]).
    pub fn take_completions(&self, stream: StreamId) -> Vec<(u64, StreamId)> {
        self.shard(stream).take_completions()
    }

    /// Returns every cached block that can go back to the device (one wait for all streams in
    /// the statistics, as PyTorch's `empty_cache`, however many shards it empties). A release
    /// the driver refuses stops no other pool's: the first error is returned, and what it could
    /// not release stays cached for the next call.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        if self.shards[0].lock().capturing() {
            return Err(AllocError::DuringCapture {
                what: "empty_cache",
                requested: 0,
            });
        }
        // A release that fails stops no other: every pool gives back what it can, the first
        // error is returned, and what could not go stays cached.
        let mut first = self.flush_thread_caches().map(|_| ());
        self.shards[0].lock().count_sync_all_streams();
        for s in self.shards.iter() {
            let r = s.lock().release_all_cached();
            if first.is_ok() {
                first = r.map_err(AllocError::from);
            }
        }
        first.and(self.release_tags_cached())
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Runs `f` on the device.
    pub fn with_device<R>(&self, f: impl FnOnce(&D) -> R) -> R {
        f(&self.device)
    }

    /// The device, shared (`graph_pool`).
    pub(crate) fn shared_device(&self) -> Arc<D> {
        self.device.clone()
    }

    /// The most bytes this allocator and its graph pools held at once since the peaks were last
    /// reset ([`CachingAllocator::reset_peak_stats`] resets it): the exact peak of their sum.
    pub fn group_reserved_peak(&self) -> u64 {
        self.group.peak.peak()
    }

    /// Bytes held from the device: the shards' reserved bytes, and pages whose release failed
    /// until they are released.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved.load(Ordering::Relaxed)
    }
}

impl<D: Device> std::fmt::Debug for CachingAllocator<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("policy", &self.cfg.policy())
            .field("reserved_bytes", &self.reserved_bytes())
            .field("thread_cache", &self.caches.is_some())
            .finish_non_exhaustive()
    }
}

impl<D: Device> Drop for CachingAllocator<D> {
    fn drop(&mut self) {
        let _ = self.flush_thread_caches();
    }
}

/// How a pool is asked for a block.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Try {
    /// From cached blocks only.
    Cached,
    /// Growing the pool when needed, through its out-of-memory ladder.
    Grow,
    /// As `Grow`, again after memory elsewhere was released ([`Pool::allocate_again`]).
    Again,
}

#[cfg(test)]
#[path = "allocator_tests.rs"]
mod tests;
