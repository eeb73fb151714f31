//! A second try of an allocation that ran out of memory, after the caller gave back memory held
//! outside this allocator (another allocator's or a private pool's cache on the same device,
//! under the same limit: the C library's graph pools and `MemPool`s).
//!
//! The second try is part of the same allocation (`Pool::allocate_again`): it counts no
//! out-of-memory event, retry or device wait of its own, and when it succeeds it takes back the
//! first try's out-of-memory event (PyTorch counts an allocation that failed, not each try). It
//! goes straight to the stream's pool, past the thread caches.

use crate::allocator::{CachingAllocator, Try};
use crate::error::AllocError;
use crate::Allocation;
use cudalloc_sys::{Device, StreamId};

impl<D: Device> CachingAllocator<D> {
    /// Tries again an allocation that [`CachingAllocator::allocate`] refused for lack of
    /// memory (see the module docs).
    pub fn allocate_again(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        self.try_allocate(size, stream, Try::Again)
    }

    /// Tries again an allocation that [`CachingAllocator::allocate_tagged`] refused for lack
    /// of memory (see the module docs).
    pub fn allocate_tagged_again(
        &self,
        size: u64,
        stream: StreamId,
        tag: &str,
    ) -> Result<Allocation, AllocError> {
        self.try_allocate_tagged(size, stream, tag, true)
    }
}
