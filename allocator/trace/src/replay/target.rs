//! What a replay drives: one [`Pool`], the replayer's model of an allocator on a device (every
//! replay but `--answers` and `--shards`), or a [`CachingAllocator`] on one thread ([`Front`]:
//! its stream shards, each a pool, as a program ran it; `--answers`, so that the allocator asks
//! the device about its events when the recorded one asked, and `--shards`).
//!
//! Invariants: both report the exact peak of the live (requested) and the reserved bytes
//! ([`Target::peaks`]); the allocated peak of a [`Front`] is the sum of its shards' peaks,
//! exact with one stream and at least the true peak with several. Everything else is the
//! target's own [`Stats`].

use cudalloc::policy::Policy;
use cudalloc::snapshot::{Excess, PinnedUnit};
use cudalloc::stats::Stats;
use cudalloc::{AllocError, Allocation, CachingAllocator, Pool};
use cudalloc_sys::{Device, StreamId};

/// An allocator a replay drives.
pub(crate) trait Target {
    fn allocate(&mut self, size: u64, stream: StreamId) -> Result<Allocation, AllocError>;
    fn free(&mut self, a: Allocation) -> Result<(), AllocError>;
    fn stats(&self) -> Stats;
    /// The peaks of the live, allocated and reserved bytes (see the invariants).
    fn peaks(&self) -> [u64; 3];
    fn reserved(&self) -> u64;
    fn excess(&self) -> Excess;
    fn pinning(&self) -> Vec<PinnedUnit>;
    /// Caps the target at `cap` bytes, or at the limit it has (the config's memory fraction)
    /// if that is lower.
    fn cap(&mut self, cap: u64);
}

impl<D: Device, P: Policy> Target for Pool<D, P> {
    fn allocate(&mut self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        Pool::allocate(self, size, stream)
    }

    fn free(&mut self, a: Allocation) -> Result<(), AllocError> {
        Pool::free(self, a)
    }

    // The figures are the pool's core's (`Pool` dereferences to it).
    fn stats(&self) -> Stats {
        (**self).stats().clone()
    }

    fn peaks(&self) -> [u64; 3] {
        let s = (**self).stats();
        [&s.requested_bytes, &s.allocated_bytes, &s.reserved_bytes].map(|b| b.0[0].peak as u64)
    }

    fn reserved(&self) -> u64 {
        (**self).reserved()
    }

    fn excess(&self) -> Excess {
        (**self).excess()
    }

    fn pinning(&self) -> Vec<PinnedUnit> {
        (**self).pinning()
    }

    fn cap(&mut self, cap: u64) {
        // The fraction is tried again first if the device could not say its memory when the
        // pool was made.
        let _ = self.apply_fraction();
        let limit = self.limit().map_or(cap, |l| l.min(cap));
        self.set_limit(Some(limit));
    }
}

/// A [`CachingAllocator`] driven from one thread, with the live bytes it was asked for counted.
pub(crate) struct Front<D: Device> {
    alloc: CachingAllocator<D>,
    live: u64,
    live_peak: u64,
}

impl<D: Device> Front<D> {
    pub fn new(alloc: CachingAllocator<D>) -> Self {
        Front {
            alloc,
            live: 0,
            live_peak: 0,
        }
    }
}

impl<D: Device> Target for Front<D> {
    fn allocate(&mut self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        let a = self.alloc.allocate(size, stream)?;
        self.live += a.size();
        self.live_peak = self.live_peak.max(self.live);
        Ok(a)
    }

    fn free(&mut self, a: Allocation) -> Result<(), AllocError> {
        let size = a.size();
        self.alloc.free(a)?;
        self.live -= size;
        Ok(())
    }

    fn stats(&self) -> Stats {
        self.alloc.stats()
    }

    fn peaks(&self) -> [u64; 3] {
        let allocated = self.alloc.stats().allocated_bytes.0[0].peak as u64;
        [self.live_peak, allocated, self.alloc.group_reserved_peak()]
    }

    fn reserved(&self) -> u64 {
        self.alloc.reserved_bytes()
    }

    fn excess(&self) -> Excess {
        self.alloc.excess()
    }

    fn pinning(&self) -> Vec<PinnedUnit> {
        self.alloc.pinning()
    }

    fn cap(&mut self, cap: u64) {
        let limit = self.alloc.memory_limit().map_or(cap, |l| l.min(cap));
        self.alloc.set_memory_limit(Some(limit));
    }
}
