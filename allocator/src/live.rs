//! The live-allocation table of [`crate::CachingAllocator`]: every pointer it handed out, by
//! address, sharded by address so threads freeing different blocks rarely meet.
//!
//! An entry is either *live* (owned by a caller) or *cached* (freed by its caller and held in a
//! thread cache, still allocated from the pool's point of view). The table, not the thread
//! caches, is the authority on who owns a cached block:
//!
//! - a cached entry carries the nonzero *token* the caching thread gave it; taking the block
//!   back ([`LiveMap::claim`]) or sending it to its pool ([`LiveMap::take_cached`]) must present
//!   that token, and succeeds once: a thread cache's copy of an entry that a flush already took
//!   is *stale*, and fails;
//! - only a live entry may be freed or recorded on a stream: a double free is an error even when
//!   the first free went to a thread cache;
//! - each shard keeps the [`Totals`] of its cached entries, changed under the shard's lock
//!   together with the entries: the statistics subtract what is cached (exactly, once no
//!   thread is between a cache hit or a free and its return; see `CachingAllocator::stats`);
//!   and the totals of its cache hits so far, which the statistics count as allocations and
//!   frees the pools never saw;
//! - `large` counts the cached entries whose block is larger than the thread caches' small part
//!   takes (those in a large part), changed under the same locks as the entries: zero in every
//!   stripe means no thread holds a large block, so a pool about to grow has nothing to take
//!   back first. The count is striped by shard (a stripe on its own cache line), so threads
//!   caching and claiming blocks of different shards do not pass one counter between cores.

use crate::error::{AllocError, Invariant, InvariantError};
use crate::pool::Handle;
use crate::sizes::PoolKind;
use crate::sync::{AtomicUsize, CachePadded, Mutex, MutexGuard, Ordering};
use cudalloc_sys::StreamId;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Shards of the table, as a power of two. Many, because a thread's cache hit and free each
/// lock the shard of their block: with 16 threads on their own streams, blocks lie in unrelated
/// ranges and fall on shards at random, and two threads sharing one shard slowed both (and so
/// the whole run) several-fold with 64 shards (H200 bench, `docs/threads.md`); with 1,024 the
/// chance that a given thread shares its shard with one of 15 others is 1.5% instead of 21%.
#[cfg(not(loom))]
const SHARD_BITS: u32 = 10;
/// Under loom every lock is a point where threads may switch: few shards keep the models small.
#[cfg(loom)]
const SHARD_BITS: u32 = 2;
const SHARDS: usize = 1 << SHARD_BITS;
/// Stripes of the large-block count (shard `i` counts in stripe `i % STRIPES`).
const STRIPES: usize = if SHARDS < 64 { SHARDS } else { 64 };

/// The shard of the entry at `ptr`.
fn shard_index(ptr: u64) -> usize {
    ((ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SHARD_BITS)) as usize
}

/// A hasher for device addresses (multiplicative; addresses are 512-byte aligned).
#[derive(Default)]
pub(crate) struct AddrHasher(u64);

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

/// One pointer handed out.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    /// The pool's handle of the block (what goes back to the pool).
    pub alloc: Handle,
    /// The serial of the handle its caller holds: the pool's, or the token of the thread
    /// cache whose hit handed it out again ([`Entry::handle`]).
    pub handle_serial: u64,
    /// Size of the block behind it (rounded).
    pub block_size: u64,
    pub pool: PoolKind,
    /// 0 while a caller owns it; the caching thread's token while a thread cache holds it.
    pub token: u64,
    /// Used on another stream (`record_stream`): it must go back through its pool's events.
    pub recorded: bool,
    /// Owned by a `Buffer`: freed only when the buffer gives it back, never by address
    /// (`CachingAllocator::free_ptr`), which would let a second buffer share the block.
    pub buffer: bool,
    /// The stream its caller asked for, when that is not the block's own (`alloc.stream`): a
    /// block of another stream lent to it (`crate::lend`), which may be freed on either.
    pub lent_to: Option<StreamId>,
}

impl Entry {
    /// An entry for a block just handed out by its pool.
    pub fn live(alloc: Handle, block_size: u64, pool: PoolKind) -> Entry {
        Entry {
            alloc,
            handle_serial: alloc.serial,
            block_size,
            pool,
            token: 0,
            recorded: false,
            buffer: false,
            lent_to: None,
        }
    }

    /// An entry for a block of another stream lent to `borrower`, whose use the block's pool
    /// has recorded: it goes back through its pool's events, never a thread cache.
    pub fn lent(alloc: Handle, block_size: u64, pool: PoolKind, borrower: StreamId) -> Entry {
        Entry {
            recorded: true,
            lent_to: Some(borrower),
            ..Entry::live(alloc, block_size, pool)
        }
    }

    /// Whether a free on `stream` is a free on the stream the allocation was made for: its
    /// block's own, or the one it was lent to.
    pub fn made_for(&self, stream: StreamId) -> bool {
        self.alloc.stream == stream || self.lent_to == Some(stream)
    }

    /// Held in a thread cache rather than by a caller.
    pub fn cached(&self) -> bool {
        self.token != 0
    }

    /// The handle its caller holds: the pool's handle with the serial of the last handout.
    pub fn handle(&self) -> Handle {
        Handle {
            serial: self.handle_serial,
            ..self.alloc
        }
    }
}

/// What the caches hold, per pool: blocks, block bytes, requested bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Blocks in the small pool / large pool.
    pub blocks: [u64; 2],
    /// Their block bytes.
    pub bytes: [u64; 2],
    /// Their requested bytes.
    pub requested: [u64; 2],
}

impl Totals {
    pub(crate) fn add(&mut self, e: &Entry) {
        let p = usize::from(e.pool == PoolKind::Large);
        self.blocks[p] += 1;
        self.bytes[p] += e.block_size;
        self.requested[p] += e.alloc.size;
    }

    pub(crate) fn sub(&mut self, e: &Entry) {
        let p = usize::from(e.pool == PoolKind::Large);
        self.blocks[p] -= 1;
        self.bytes[p] -= e.block_size;
        self.requested[p] -= e.alloc.size;
    }

    pub(crate) fn merge(&mut self, o: &Totals) {
        for p in 0..2 {
            self.blocks[p] += o.blocks[p];
            self.bytes[p] += o.bytes[p];
            self.requested[p] += o.requested[p];
        }
    }

    /// No block counted.
    pub fn is_empty(&self) -> bool {
        self.blocks == [0, 0]
    }
}

/// What [`LiveMap::mark_cached`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Marked {
    /// The entry is cached now.
    Cached,
    /// The entry stays live (recorded on another stream, or too large): free it to its pool.
    Live,
    /// No live entry for that allocation (a double free, a foreign pointer).
    Missing,
}

type Map = HashMap<u64, Entry, BuildHasherDefault<AddrHasher>>;

/// One shard: its entries, what its cached ones add up to, and what its thread-cache hits
/// added up to.
#[derive(Default)]
struct Shard {
    map: Map,
    cached: Totals,
    hits: Totals,
}

/// What the thread caches hold and have served, summed over the shards.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CacheTotals {
    /// The entries cached now.
    pub cached: Totals,
    /// Every entry claimed back from a cache so far (cumulative: the allocations served
    /// without their pool).
    pub hits: Totals,
}

/// Pointer -> entry, sharded by address.
pub(crate) struct LiveMap {
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    /// Largest block a thread cache's small part takes: cached entries above it are counted
    /// in `large`.
    small_block: u64,
    large: Box<[CachePadded<AtomicUsize>]>,
}

impl LiveMap {
    /// A table whose thread caches' small parts take blocks of up to `small_block` bytes.
    pub fn new(small_block: u64) -> Self {
        LiveMap {
            shards: (0..SHARDS)
                .map(|_| CachePadded::new(Mutex::new(Shard::default())))
                .collect(),
            small_block,
            large: (0..STRIPES)
                .map(|_| CachePadded::new(AtomicUsize::new(0)))
                .collect(),
        }
    }

    /// Counts a cached entry at `ptr` in or out of `large` (under its shard's lock).
    fn count_large(&self, ptr: u64, e: &Entry, cached: bool) {
        if e.block_size > self.small_block {
            let stripe = &self.large[shard_index(ptr) % STRIPES];
            if cached {
                stripe.fetch_add(1, Ordering::Relaxed);
            } else {
                stripe.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// True when some thread cache may hold a block above its small part's size (a hint: a
    /// block may be cached or claimed right after).
    pub fn holds_large(&self) -> bool {
        self.large.iter().any(|s| s.load(Ordering::Relaxed) > 0)
    }

    fn shard(&self, ptr: u64) -> MutexGuard<'_, Shard> {
        self.shards[shard_index(ptr)].lock()
    }

    pub fn insert(&self, e: Entry) {
        debug_assert!(!e.cached());
        self.shard(e.alloc.ptr).map.insert(e.alloc.ptr, e);
    }

    /// The live entry for `ptr`.
    pub fn live(&self, ptr: u64) -> Result<Entry, AllocError> {
        match self.shard(ptr).map.get(&ptr) {
            Some(e) if !e.cached() => Ok(*e),
            _ => Err(AllocError::NotAllocated(ptr)),
        }
    }

    /// Turns the live entry of `a` into one cached under `token` and hands it (still live) and
    /// the token to `keep`, unless
    /// it was used on another stream or its block is larger than `max_block` (then it stays
    /// live).
    #[inline]
    pub fn mark_cached(
        &self,
        a: &Handle,
        token: u64,
        max_block: u64,
        keep: impl FnOnce(&Entry, u64),
    ) -> Marked {
        debug_assert_ne!(token, 0);
        let mut g = self.shard(a.ptr);
        let s = &mut *g;
        match s.map.get_mut(&a.ptr) {
            Some(e) if !e.cached() && e.handle() == *a => {
                if e.recorded || e.block_size > max_block {
                    return Marked::Live;
                }
                // `keep` copies the entry before the token is stored in it: a copy that reads a
                // field just written stalls on store forwarding.
                keep(e, token);
                e.token = token;
                s.cached.add(e);
                self.count_large(a.ptr, e, true);
                Marked::Cached
            }
            _ => Marked::Missing,
        }
    }

    /// Turns the entry at `ptr` cached under `token` live again; false when it is not (a flush
    /// took it: the caller's copy is stale).
    #[inline]
    pub fn claim(&self, ptr: u64, token: u64) -> bool {
        let mut g = self.shard(ptr);
        let s = &mut *g;
        match s.map.get_mut(&ptr) {
            Some(e) if e.token == token => {
                e.token = 0;
                // The hit is a new handout: its handle carries the token (tokens are unique).
                e.handle_serial = token;
                e.buffer = false;
                s.cached.sub(e);
                s.hits.add(e);
                self.count_large(ptr, e, false);
                true
            }
            _ => false,
        }
    }

    /// Removes the entry at `ptr` cached under `token` (its block goes back to its pool); `None`
    /// when it is not cached under that token.
    pub fn take_cached(&self, ptr: u64, token: u64) -> Option<Entry> {
        let mut g = self.shard(ptr);
        let s = &mut *g;
        match s.map.get(&ptr) {
            Some(e) if e.token == token && token != 0 => {
                let e = s.map.remove(&ptr).expect("present");
                s.cached.sub(&e);
                self.count_large(ptr, &e, false);
                Some(e)
            }
            _ => None,
        }
    }

    /// Every cached entry, shard by shard (each shard's list is consistent; the whole is not a
    /// snapshot: blocks may be cached or claimed meanwhile).
    pub fn cached_entries(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            let s = s.lock();
            if s.cached.is_empty() {
                continue;
            }
            out.extend(s.map.values().filter(|e| e.cached()).copied());
        }
        out
    }

    /// What the cached entries add up to, and the cache hits so far.
    pub fn cache_totals(&self) -> CacheTotals {
        self.read_caches(None)
    }

    /// The addresses of the cached entries, with [`LiveMap::cache_totals`]: each shard's entries
    /// and totals are read under its one lock, so the cached totals are exactly those of the
    /// listed entries, even while other threads cache and claim blocks.
    pub fn cached_with_totals(&self) -> (Vec<u64>, CacheTotals) {
        let mut ptrs = Vec::new();
        let t = self.read_caches(Some(&mut ptrs));
        (ptrs, t)
    }

    fn read_caches(&self, mut ptrs: Option<&mut Vec<u64>>) -> CacheTotals {
        let mut t = CacheTotals::default();
        for s in self.shards.iter() {
            let s = s.lock();
            t.cached.merge(&s.cached);
            t.hits.merge(&s.hits);
            if let Some(p) = ptrs.as_deref_mut().filter(|_| !s.cached.is_empty()) {
                p.extend(s.map.values().filter(|e| e.cached()).map(|e| e.alloc.ptr));
            }
        }
        t
    }

    /// Notes that the live allocation at `ptr` belongs to a `Buffer` now.
    pub fn mark_buffer(&self, ptr: u64) {
        if let Some(e) = self.shard(ptr).map.get_mut(&ptr) {
            e.buffer = true;
        }
    }

    /// Notes that the live allocation at `ptr` was used on another stream.
    pub fn mark_recorded(&self, ptr: u64) {
        if let Some(e) = self.shard(ptr).map.get_mut(&ptr) {
            e.recorded = true;
        }
    }

    /// Takes out the entry of `a`, which must be live exactly as handed out (not cached): its
    /// block is going back to its pool. Checking and removing in one step under the shard's lock
    /// makes a racing free of the same pointer find nothing (an error), where checking first
    /// and removing later would let that free cache the block in between.
    pub fn take_live(&self, a: &Handle) -> Result<Entry, AllocError> {
        let mut g = self.shard(a.ptr);
        match g.map.get(&a.ptr) {
            Some(e) if !e.cached() && e.handle() == *a => {}
            _ => return Err(AllocError::NotAllocated(a.ptr)),
        }
        Ok(g.map.remove(&a.ptr).expect("present"))
    }

    /// Number of entries, live and cached.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// Checks each shard's cached totals against its entries, and the count of cached blocks
    /// above the small part's size; holds every shard's lock (in order: a thread holds at most
    /// one), so that the count and the entries agree while other threads cache and claim.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        let broke = |detail: String| Err(InvariantError::new(Invariant::LiveTable, detail));
        let guards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let mut large = 0;
        for (i, s) in guards.iter().enumerate() {
            let mut t = Totals::default();
            s.map.values().filter(|e| e.cached()).for_each(|e| t.add(e));
            large += s
                .map
                .values()
                .filter(|e| e.cached() && e.block_size > self.small_block)
                .count();
            if t != s.cached {
                return broke(format!(
                    "live shard {i}: cached totals {:?}, entries add up to {t:?}",
                    s.cached
                ));
            }
        }
        let counted: usize = self.large.iter().map(|s| s.load(Ordering::Relaxed)).sum();
        if counted != large {
            return broke(format!(
                "{counted} large cached blocks counted, {large} in the table"
            ));
        }
        Ok(())
    }
}
