//! Handing out a block at a given address ([`CachingAllocator::allocate_at`]): the step that
//! puts a private pool back to an earlier state, as PyTorch's CUDA graph trees do when they
//! restore a graph pool to a checkpoint (each block live then is handed out again where it was).
//!
//! Invariants: only a free range is handed out (never a live, cached, waiting or releasing
//! block, never unmapped pages: an error says so and nothing changes); the block handed out
//! covers exactly the range asked for, and it is a live allocation of the allocator like any
//! other (freed by address, counted in the statistics); no call waits for the device, none
//! runs during a capture.

use crate::allocator::CachingAllocator;
use crate::error::AllocError;
use crate::ladder::Pool;
use crate::live::Entry;
use crate::policy::Policy;
use crate::pool::{Allocation, Request};
use crate::sizes::{self, PoolKind};
use cudalloc_sys::{Device, StreamId};

impl<D: Device, P: Policy> Pool<D, P> {
    /// Hands out `size` bytes at `ptr` on `stream` for a caller that asked for `requested`
    /// bytes (see the module docs); `size` is a block's size, a multiple of 512.
    pub fn allocate_at(
        &mut self,
        ptr: u64,
        size: u64,
        requested: u64,
        stream: StreamId,
    ) -> Result<Allocation, AllocError> {
        let refuse = |why| Err(AllocError::NotFree { ptr, size, why });
        if size == 0 || !size.is_multiple_of(512) || !ptr.is_multiple_of(512) {
            return refuse("a block's address and size are multiples of 512 bytes");
        }
        if requested > size {
            return refuse("more bytes requested than the block holds");
        }
        self.refuse_asleep("allocate_at")?;
        if self.core.capturing() {
            return Err(AllocError::DuringCapture {
                what: "allocate_at",
                requested,
            });
        }
        // Blocks whose streams' work completed become free first (a poll, no wait).
        if self.core.deferred_blocks() > 0 {
            self.core.record_owed(&mut self.policy);
        }
        self.core.process_events(&mut self.policy)?;
        let (id, pool) = match self.core.take_free_at(ptr, size, stream, PoolKind::Large) {
            Ok(id) => (id, PoolKind::Large),
            Err(_) => (
                self.core.take_free_at(ptr, size, stream, PoolKind::Small)?,
                PoolKind::Small,
            ),
        };
        let req = Request {
            stream,
            pool,
            size,
            alloc_size: sizes::segment_size(size),
        };
        let split = self.core.blocks[id].size > size;
        // The policy placed nothing, so it is not told (`on_alloc` would file the block under
        // whatever its last placement was about to record).
        let id = self.core.alloc_found_block(id, &req, requested, split);
        Ok(Allocation(self.core.hand_out(id, requested, stream)))
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Hands out `size` bytes at `ptr` for use on `stream`, for a caller that asked for
    /// `requested` bytes: the range must lie in one free block of the stream's pool (what a
    /// block freed since was, unless the pool gave its pages back or handed them out again).
    /// `size` is the block's size as a snapshot lists it ([`crate::snapshot::BlockInfo`]).
    /// Errors: [`AllocError::NotFree`] naming why, [`AllocError::DuringCapture`],
    /// [`AllocError::Asleep`]. Blocks in thread caches go back to their pools first.
    pub fn allocate_at(
        &self,
        ptr: u64,
        size: u64,
        requested: u64,
        stream: StreamId,
    ) -> Result<Allocation, AllocError> {
        self.flush_thread_caches()?;
        let mut pool = self.shard(stream);
        let a = pool.allocate_at(ptr, size, requested, stream)?;
        let b = pool.block(a.0.block).expect("allocated block");
        self.live.insert(Entry::live(a.0, b.size, b.pool));
        Ok(a)
    }
}
