//! Per-thread caches of freed blocks: the lock-free fast path of [`crate::CachingAllocator`].
//!
//! When a caller frees a block, the block may stay in the freeing thread's cache instead of
//! going back to its pool; the next request of exactly the same size on the same stream from
//! that thread takes it back without touching the pool's lock. A cache holds at most
//! [`MAX_BLOCKS`] blocks and `thread_cache_mb` bytes, of blocks up to `thread_cache_block_mb`
//! (32 MiB and 2 MiB by default: larger blocks go straight back to their pool, where other
//! threads and the memory budget can use them); the oldest block leaves first. Cached blocks
//! are still allocated from the pool's point of view: the statistics subtract them
//! ([`Totals`]), and every cache is flushed back to the pools on `empty_cache`, on
//! out-of-memory, and when the allocator is dropped.
//!
//! Each thread's cache is an `Arc<Mutex<_>>` shared by the thread (through a thread local) and
//! the allocator's registry (for flushing); the thread's own lock is uncontended except while a
//! flush runs. When a thread exits, its cache is orphaned; the next allocation that misses its
//! own cache returns orphaned blocks to their pools ([`Caches::adopt_orphans`]).

use crate::live::Entry;
use crate::sizes::PoolKind;
use crate::sync::Ordering;
use crate::sync::{thread_local, Arc, AtomicUsize, IdCounter, Mutex};
use std::cell::RefCell;

/// Blocks a thread cache holds at most.
pub const MAX_BLOCKS: usize = 16;

static NEXT_ID: IdCounter = IdCounter::new(1);

#[derive(Default)]
struct ThreadCache {
    entries: Vec<Entry>,
    bytes: u64,
}

type Shared = Arc<Mutex<ThreadCache>>;

/// A thread's handle on its cache for one allocator; dropped when the thread exits, which tells
/// the allocator that the cache's blocks have no owner any more.
struct Mine {
    id: u64,
    cache: Option<Shared>,
    exited: Arc<AtomicUsize>,
}

impl Drop for Mine {
    /// Lets go of the cache first, then signals: an allocation that sees the signal finds the
    /// cache with no owner left.
    fn drop(&mut self) {
        drop(self.cache.take());
        self.exited.fetch_add(1, Ordering::Release);
    }
}

thread_local! {
    // Not `const { .. }`: loom's `thread_local!` does not take that form.
    #[allow(clippy::missing_const_for_thread_local)]
    static MINE: RefCell<Vec<Mine>> = RefCell::new(Vec::new());
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

/// The thread caches of one allocator.
pub(crate) struct Caches {
    id: u64,
    max_bytes: u64,
    max_block: u64,
    all: Mutex<Vec<Shared>>,
    /// Threads that left a cache behind since the last [`Caches::adopt_orphans`].
    exited: Arc<AtomicUsize>,
}

impl Caches {
    pub fn new(max_bytes: u64, max_block: u64) -> Self {
        Caches {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            max_bytes,
            max_block,
            all: Mutex::new(Vec::new()),
            exited: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Runs `f` on this thread's cache, creating and registering it on first use.
    fn with_mine<R>(&self, f: impl FnOnce(&mut ThreadCache) -> R) -> R {
        MINE.with(|m| {
            let mut m = m.borrow_mut();
            let i = match m.iter().position(|x| x.id == self.id) {
                Some(i) => i,
                None => {
                    // Forget caches of allocators that are gone (only this thread holds them).
                    m.retain(|x| x.cache.as_ref().is_some_and(|c| Arc::strong_count(c) > 1));
                    let c: Shared = Arc::default();
                    self.all.lock().push(c.clone());
                    m.push(Mine {
                        id: self.id,
                        cache: Some(c),
                        exited: self.exited.clone(),
                    });
                    m.len() - 1
                }
            };
            let mut c = m[i].cache.as_ref().expect("a live thread's cache").lock();
            f(&mut c)
        })
    }

    /// Takes a cached block for exactly `size` bytes on `stream`.
    pub fn take(&self, size: u64, stream: u64) -> Option<Entry> {
        self.with_mine(|c| {
            let i = c
                .entries
                .iter()
                .rposition(|e| e.alloc.size == size && e.alloc.stream.0 == stream)?;
            let e = c.entries.swap_remove(i);
            c.bytes -= e.block_size;
            Some(e)
        })
    }

    /// Caches a freed block; returns the blocks that no longer fit (to be freed to the pool).
    pub fn put(&self, e: Entry) -> Vec<Entry> {
        if e.block_size > self.max_block || e.block_size > self.max_bytes {
            return vec![e];
        }
        self.with_mine(|c| {
            c.bytes += e.block_size;
            c.entries.push(e);
            let mut out = Vec::new();
            while c.entries.len() > MAX_BLOCKS || c.bytes > self.max_bytes {
                let old = c.entries.remove(0);
                c.bytes -= old.block_size;
                out.push(old);
            }
            out
        })
    }

    /// Empties every thread's cache and returns what they held.
    pub fn drain_all(&self) -> Vec<Entry> {
        let all = self.all.lock().clone();
        let mut out = Vec::new();
        for c in all {
            let mut c = c.lock();
            c.bytes = 0;
            out.append(&mut c.entries);
        }
        self.all.lock().retain(|c| Arc::strong_count(c) > 1);
        out
    }

    /// Empties the caches of threads that have exited and returns what they held.
    pub fn adopt_orphans(&self) -> Vec<Entry> {
        if self.exited.swap(0, Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut all = self.all.lock();
        let mut out = Vec::new();
        all.retain(|c| {
            if Arc::strong_count(c) > 1 {
                return true;
            }
            out.append(&mut c.lock().entries);
            false
        });
        out
    }

    /// What all caches hold.
    pub fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for c in self.all.lock().iter() {
            for e in &c.lock().entries {
                let p = usize::from(e.pool == PoolKind::Large);
                t.blocks[p] += 1;
                t.bytes[p] += e.block_size;
                t.requested[p] += e.alloc.size;
            }
        }
        t
    }
}
