//! The live-allocation table of [`crate::CachingAllocator`]: every pointer it handed out, by
//! address, sharded by address so threads freeing different blocks rarely meet.
//!
//! An entry is either *live* (owned by a caller) or *cached* (freed by its caller and held in a
//! thread cache, still allocated from the pool's point of view). Only a live entry may be freed
//! or recorded on a stream; that is what turns a double free into an error even when the first
//! free went to a thread cache.

use crate::error::AllocError;
use crate::pool::Allocation;
use crate::sizes::PoolKind;
use crate::sync::{CachePadded, Mutex, MutexGuard};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const SHARDS: usize = 64;

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
    pub alloc: Allocation,
    /// Size of the block behind it (rounded).
    pub block_size: u64,
    pub pool: PoolKind,
    /// Held in a thread cache rather than by a caller.
    pub cached: bool,
    /// Used on another stream (`record_stream`): it must go back through its pool's events.
    pub recorded: bool,
}

type Map = HashMap<u64, Entry, BuildHasherDefault<AddrHasher>>;

/// Pointer -> entry, sharded by address.
pub(crate) struct LiveMap {
    shards: Box<[CachePadded<Mutex<Map>>]>,
}

impl LiveMap {
    pub fn new() -> Self {
        LiveMap {
            shards: (0..SHARDS)
                .map(|_| CachePadded::new(Mutex::new(Map::default())))
                .collect(),
        }
    }

    fn shard(&self, ptr: u64) -> MutexGuard<'_, Map> {
        let h = (ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58;
        self.shards[h as usize % SHARDS].lock()
    }

    pub fn insert(&self, e: Entry) {
        self.shard(e.alloc.ptr).insert(e.alloc.ptr, e);
    }

    /// The live entry for `ptr`.
    pub fn live(&self, ptr: u64) -> Result<Entry, AllocError> {
        match self.shard(ptr).get(&ptr) {
            Some(e) if !e.cached => Ok(*e),
            _ => Err(AllocError::NotAllocated(ptr)),
        }
    }

    /// Checks that `a` is live exactly as handed out.
    pub fn check_live(&self, a: &Allocation) -> Result<Entry, AllocError> {
        let e = self.live(a.ptr)?;
        if e.alloc != *a {
            return Err(AllocError::NotAllocated(a.ptr));
        }
        Ok(e)
    }

    /// Turns the live entry of `a` into a cached one, unless it was used on another stream
    /// (then it stays live and is returned with `cached == false`).
    pub fn mark_cached(&self, a: &Allocation) -> Result<Entry, AllocError> {
        let mut g = self.shard(a.ptr);
        match g.get_mut(&a.ptr) {
            Some(e) if !e.cached && e.alloc == *a => {
                e.cached = !e.recorded;
                Ok(*e)
            }
            _ => Err(AllocError::NotAllocated(a.ptr)),
        }
    }

    /// Notes that the live allocation at `ptr` was used on another stream.
    pub fn mark_recorded(&self, ptr: u64) {
        if let Some(e) = self.shard(ptr).get_mut(&ptr) {
            e.recorded = true;
        }
    }

    /// Turns a cached entry live again.
    pub fn mark_live(&self, ptr: u64) {
        if let Some(e) = self.shard(ptr).get_mut(&ptr) {
            debug_assert!(e.cached);
            e.cached = false;
        }
    }

    pub fn remove(&self, ptr: u64) {
        self.shard(ptr).remove(&ptr);
    }

    /// Number of entries, live and cached.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}
