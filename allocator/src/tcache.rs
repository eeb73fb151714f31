//! Per-thread caches of freed blocks: the fast path of [`crate::CachingAllocator`].
//!
//! When a caller frees a block, the block may stay in the freeing thread's cache instead of
//! going back to its pool; the next request of exactly the same size on the same stream from
//! that thread takes it back without touching the pool's lock. A cache has two parts:
//!
//! - *small*: up to [`MAX_BLOCKS`] blocks of at most `thread_cache_block_mb` (1 MiB by default:
//!   the small pool's blocks, so that large-pool blocks reach a pool that follows a layout plan)
//!   and at most `thread_cache_mb` bytes together (2 MiB);
//! - *large*: up to `thread_cache_large` blocks (1 by default, at most [`MAX_LARGE`]) of any
//!   size that the small part does not take: the last ones this thread freed.
//!
//! Large-pool blocks of a stream whose pool follows a layout plan, or records an episode with two
//! or more allocations live, do not enter the caches (`policy::front::FrontRules`) unless another
//! thread holds that pool's lock.
//!
//! The oldest block of a full part leaves first, and a request of the large pool that misses
//! empties its thread's large part first (so those blocks can serve it from their pool: the
//! large part never makes its own thread reserve more). So one thread holds at most
//! `thread_cache_mb` + `thread_cache_large` x (the largest block it freed) bytes in its cache,
//! and never a block it did not free itself. Cached blocks are still allocated from the pool's
//! point of view: the statistics subtract them ([`Totals`]), a snapshot shows them as
//! [`crate::snapshot::BlockState::ThreadCached`], and every cache is flushed back to
//! the pools on `empty_cache`, on out-of-memory (before the error is returned), and when the
//! allocator is dropped; the cache of a thread that exited is returned by the next allocation
//! (on any thread) that misses its own cache.
//!
//! Invariants:
//! - a thread's cache is touched only by its thread (a thread local, no lock); other threads
//!   find cached blocks through the live table (`crate::live`), where each cached entry
//!   carries the token its thread gave it;
//! - a block leaves the cached state exactly once: a thread taking it back, a flush or an
//!   eviction must win `LiveMap::claim` or `LiveMap::take_cached` with the token first; the
//!   losers' copies are stale and are dropped when met;
//! - tokens are never reused (for the first 2^32 ranges): a thread's tokens come from a range
//!   of 2^32 - 1 starting at a fresh process-wide id shifted by 32 bits, and a thread that uses
//!   up its range takes a fresh one, so a stale copy can never match a later caching.

use crate::error::AllocError;
use crate::live::{Entry, LiveMap, Marked};
use crate::pool::Handle;
use crate::sync::Ordering;
use crate::sync::{thread_local, Arc, AtomicBool, AtomicUsize, IdCounter, Mutex};
use std::cell::RefCell;

/// Small blocks a thread cache holds at most.
pub const MAX_BLOCKS: usize = 16;

/// Largest `thread_cache_large`: large blocks a thread cache may hold.
pub const MAX_LARGE: usize = 4;

/// Low bits of a token: the sequence number within a thread's range.
const SEQ_MASK: u64 = 0xFFFF_FFFF;

static NEXT_ID: IdCounter = IdCounter::new(1);

fn fresh_id() -> u64 {
    NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Where [`Caches::put`] left a freed block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kept {
    /// Not cached: it goes to its pool.
    No,
    /// In the thread's small part.
    Small,
    /// In the thread's large part.
    Large,
}

/// A thread cache's copy of a cached entry: what it needs to find the block, claim it with its
/// token, and send it to its pool.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cached {
    pub alloc: Handle,
    pub block_size: u64,
    pub token: u64,
}

/// What one thread cache may hold.
#[derive(Clone, Copy, Debug)]
struct Limits {
    max_bytes: u64,
    max_block: u64,
    max_large: usize,
    /// Blocks of at least this many bytes are never cached: PyTorch's oversize blocks
    /// (`max_split_size`), which its statistics count apart while allocated.
    oversize: u64,
}

impl Limits {
    /// The small part takes the block.
    fn small(&self, block_size: u64) -> bool {
        block_size <= self.max_block.min(self.max_bytes)
    }
}

/// One thread's cache for one allocator; only its thread touches it.
struct Local {
    small: Vec<Cached>,
    /// Block bytes in `small`.
    bytes: u64,
    large: Vec<Cached>,
    /// The last token handed out.
    token: u64,
}

impl Local {
    fn new() -> Local {
        Local {
            small: Vec::with_capacity(MAX_BLOCKS + 1),
            bytes: 0,
            large: Vec::with_capacity(MAX_LARGE + 1),
            token: fresh_id() << 32,
        }
    }

    fn next_token(&mut self) -> u64 {
        if self.token & SEQ_MASK == SEQ_MASK {
            self.token = fresh_id() << 32;
        }
        self.token += 1;
        self.token
    }

    /// Takes the newest entry for `size` bytes on `stream` (maybe stale).
    fn take(&mut self, size: u64, stream: u64) -> Option<Cached> {
        let hit = |e: &Cached| e.alloc.size == size && e.alloc.stream.0 == stream;
        if let Some(i) = self.small.iter().rposition(hit) {
            let e = remove(&mut self.small, i);
            self.bytes -= e.block_size;
            return Some(e);
        }
        let i = self.large.iter().rposition(hit)?;
        Some(remove(&mut self.large, i))
    }

    /// Adds `e` as cached under `token` (then [`Local::pop_excess`] until `None`); the part
    /// that took it.
    fn push(&mut self, e: &Entry, token: u64, lim: &Limits) -> Kept {
        let e = Cached {
            alloc: e.alloc,
            block_size: e.block_size,
            token,
        };
        if lim.small(e.block_size) {
            self.bytes += e.block_size;
            self.small.push(e);
            Kept::Small
        } else {
            self.large.push(e);
            Kept::Large
        }
    }

    /// An entry that has to leave: the oldest of a part over its limits.
    fn pop_excess(&mut self, lim: &Limits) -> Option<Cached> {
        if self.small.len() > MAX_BLOCKS || self.bytes > lim.max_bytes {
            let old = self.small.remove(0);
            self.bytes -= old.block_size;
            return Some(old);
        }
        if self.large.len() > lim.max_large {
            return Some(self.large.remove(0));
        }
        None
    }

    fn drain(&mut self, out: &mut Vec<Cached>) {
        out.append(&mut self.small);
        out.append(&mut self.large);
        self.bytes = 0;
    }
}

/// Removes entry `i` keeping the order; the newest (the usual hit) without a `memmove` call.
fn remove(v: &mut Vec<Cached>, i: usize) -> Cached {
    if i + 1 == v.len() {
        v.pop().expect("entry i")
    } else {
        v.remove(i)
    }
}

/// Blocks left by threads that exited, waiting to go back to their pools.
#[derive(Default)]
struct Orphans {
    entries: Mutex<Vec<Cached>>,
    /// Set when `entries` may be non-empty.
    pending: AtomicBool,
    /// Threads whose cache for this allocator exists now.
    threads: AtomicUsize,
    /// Set when the allocator is dropped: every thread then forgets its cache for it at its
    /// next new cache (while another thread still held one, a count of holders never fell to
    /// one, and each thread's list kept the dead allocators' caches).
    gone: AtomicBool,
}

/// A thread's cache for one allocator; dropped when the thread exits, which hands the blocks
/// to the allocator's orphans.
struct Mine {
    id: u64,
    local: Local,
    orphans: Arc<Orphans>,
}

impl Drop for Mine {
    fn drop(&mut self) {
        self.orphans.threads.fetch_sub(1, Ordering::Relaxed);
        let mut left = Vec::new();
        self.local.drain(&mut left);
        if !left.is_empty() {
            self.orphans.entries.lock().append(&mut left);
            self.orphans.pending.store(true, Ordering::Release);
        }
    }
}

thread_local! {
    // Not `const { .. }`: loom's `thread_local!` does not take that form.
    #[allow(clippy::missing_const_for_thread_local)]
    static MINE: RefCell<Vec<Mine>> = RefCell::new(Vec::new());
}

/// The thread caches of one allocator.
pub(crate) struct Caches {
    id: u64,
    limits: Limits,
    orphans: Arc<Orphans>,
}

impl Drop for Caches {
    fn drop(&mut self) {
        self.orphans.gone.store(true, Ordering::Release);
    }
}

impl Caches {
    pub fn new(max_bytes: u64, max_block: u64, max_large: usize, oversize: u64) -> Self {
        Caches {
            id: fresh_id(),
            limits: Limits {
                max_bytes,
                max_block,
                max_large: max_large.min(MAX_LARGE),
                oversize,
            },
            orphans: Arc::default(),
        }
    }

    /// Largest block a cache takes.
    fn max_cached_block(&self) -> u64 {
        let most = match self.limits.max_large {
            0 => self.limits.max_block.min(self.limits.max_bytes),
            _ => u64::MAX,
        };
        most.min(self.limits.oversize.saturating_sub(1))
    }

    /// Runs `f` on this thread's cache, creating it on first use; `None` while the thread's
    /// locals are being destroyed.
    fn with_mine<R>(&self, f: impl FnOnce(&mut Local) -> R) -> Option<R> {
        MINE.try_with(|m| {
            let mut m = m.borrow_mut();
            let i = match m.iter().position(|x| x.id == self.id) {
                Some(i) => i,
                None => {
                    // Forget caches of allocators that are gone.
                    m.retain(|x| !x.orphans.gone.load(Ordering::Acquire));
                    self.orphans.threads.fetch_add(1, Ordering::Relaxed);
                    m.push(Mine {
                        id: self.id,
                        local: Local::new(),
                        orphans: self.orphans.clone(),
                    });
                    m.len() - 1
                }
            };
            f(&mut m[i].local)
        })
        .ok()
    }

    /// Whether some other thread has a cache for this allocator now (a hint: a thread may
    /// make or drop one right after).
    pub fn others_exist(&self) -> bool {
        self.orphans.threads.load(Ordering::Relaxed) > 1
    }

    /// The token range of this thread's cache (`token >> 32` of the entries it cached since it
    /// last took a fresh range); `None` while the thread's locals are being destroyed.
    pub fn my_token_range(&self) -> Option<u64> {
        self.with_mine(|c| c.token >> 32)
    }

    /// Whether a block of `block_size` bytes goes to a cache's small part (else its large part).
    pub fn in_small_part(&self, block_size: u64) -> bool {
        self.limits.small(block_size)
    }

    /// The largest block a cache's small part takes.
    pub fn small_part_limit(&self) -> u64 {
        self.limits.max_block.min(self.limits.max_bytes)
    }

    /// Takes back a block this thread cached for exactly `size` bytes on `stream`.
    pub fn take(&self, live: &LiveMap, size: u64, stream: u64) -> Option<Handle> {
        self.with_mine(|c| {
            while let Some(e) = c.take(size, stream) {
                if live.claim(e.alloc.ptr, e.token) {
                    // A new handout: its handle carries the token (`LiveMap::claim`), so the
                    // handle of the free that cached it is stale now.
                    return Some(Handle {
                        serial: e.token,
                        ..e.alloc
                    });
                }
            }
            None
        })
        .flatten()
    }

    /// Frees `a` into this thread's cache if it may be cached, handing the entries that leave
    /// the cache to `evict` (they may be stale); which part kept it, or [`Kept::No`] when `a`
    /// stays live, for its pool.
    pub fn put(
        &self,
        live: &LiveMap,
        a: &Handle,
        mut evict: impl FnMut(&Cached) -> Result<(), AllocError>,
    ) -> Result<Kept, AllocError> {
        let (max, lim) = (self.max_cached_block(), self.limits);
        let put = self.with_mine(|c| {
            let token = c.next_token();
            let mut kept = Kept::No;
            let keep = |e: &Entry, t| kept = c.push(e, t, &lim);
            match live.mark_cached(a, token, max, keep) {
                Marked::Missing => return Err(AllocError::NotAllocated(a.ptr)),
                Marked::Live => return Ok(Kept::No),
                Marked::Cached => {}
            }
            while let Some(old) = c.pop_excess(&lim) {
                evict(&old)?;
            }
            Ok(kept)
        });
        // This thread's locals are being destroyed: the caller frees it to its pool, which
        // checks that it is live (`LiveMap::take_live`).
        put.unwrap_or(Ok(Kept::No))
    }

    /// Sends this thread's large part to `evict` (a large request missed: in their pools the
    /// blocks can serve it, so the large part never makes its own thread reserve more).
    pub fn release_large(
        &self,
        mut evict: impl FnMut(&Cached) -> Result<(), AllocError>,
    ) -> Result<(), AllocError> {
        self.with_mine(|c| {
            while let Some(e) = c.large.pop() {
                evict(&e)?;
            }
            Ok(())
        })
        .unwrap_or(Ok(()))
    }

    /// Takes the entries of threads that exited (maybe stale), if any are waiting.
    pub fn adopt_orphans(&self) -> Vec<Cached> {
        // A load first: misses on every thread must not all write the one flag.
        if !self.orphans.pending.load(Ordering::Relaxed)
            || !self.orphans.pending.swap(false, Ordering::Acquire)
        {
            return Vec::new();
        }
        std::mem::take(&mut *self.orphans.entries.lock())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn caches_here() -> usize {
        MINE.with(|m| m.borrow().len())
    }

    /// A thread forgets its cache for a dropped allocator when it makes its next cache, even
    /// while another thread's cache for that allocator still exists (here: a second holder of
    /// its orphans, as another thread's cache is).
    #[test]
    fn a_dropped_allocators_cache_is_forgotten_while_others_hold_one() {
        let a = Caches::new(1 << 20, 1 << 20, 0, u64::MAX);
        a.with_mine(|_| ());
        let other_thread = a.orphans.clone();
        assert_eq!(caches_here(), 1);
        drop(a);
        let b = Caches::new(1 << 20, 1 << 20, 0, u64::MAX);
        b.with_mine(|_| ());
        assert_eq!(caches_here(), 1, "only b's cache is left");
        drop(other_thread);
    }
}
