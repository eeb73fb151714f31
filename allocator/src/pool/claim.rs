//! Taking a given address range out of the free blocks: what restoring a private pool to an
//! earlier state needs (PyTorch's CUDA graph trees put a graph pool back to a checkpoint by
//! handing out again, at the same addresses, the blocks that were live then).
//!
//! Invariants: only a free, mapped block that waits for nothing and holds the whole range is
//! taken; the bytes before the range stay a free block of their own (indexed), and the block
//! returned starts at the range, out of every index, for `Core::alloc_found_block` to split
//! and hand out. The inactive-split statistics count the new free block as a scan would.

use super::block::BlockId;
use super::Core;
use crate::error::AllocError;
use crate::sizes::PoolKind;
use cudalloc_sys::{Device, StreamId};

impl<D: Device> Core<D> {
    /// The free block of `pool` and `stream` that holds `ptr..ptr + size`, cut so that it
    /// starts at `ptr`, out of the free index (see the module docs). An error when no free
    /// block holds the range.
    pub(crate) fn take_free_at(
        &mut self,
        ptr: u64,
        size: u64,
        stream: StreamId,
        pool: PoolKind,
    ) -> Result<BlockId, AllocError> {
        let end = ptr.checked_add(size).ok_or(AllocError::NotFree {
            ptr,
            size,
            why: "the range passes the end of the address space",
        })?;
        let id = self
            .free_index(pool)
            .all_free_at_least(size)
            .find(|&id| {
                let b = &self.blocks[id];
                b.addr <= ptr && end <= b.end() && b.stream == stream
            })
            .ok_or(AllocError::NotFree {
                ptr,
                size,
                why: "no free block of this pool and stream holds it",
            })?;
        let taken = self.unindex_free(id);
        debug_assert!(taken, "a block of the free index was not in it");
        let before = ptr - self.blocks[id].addr;
        if before == 0 {
            return Ok(id);
        }
        let was_split = self.blocks[id].is_split();
        let whole = self.blocks[id].size;
        // `split_front` puts the rest (from `ptr`) back in the index and returns the front.
        let front = self.split_front(id, before);
        self.insert_free(front);
        let taken = self.unindex_free(id);
        debug_assert!(taken, "split_front indexes the rest");
        if !self.blocks[id].is_expandable() {
            let s = &mut self.stats;
            s.inactive_split
                .increase(pool, if was_split { 1 } else { 2 });
            if !was_split {
                s.inactive_split_bytes.increase(pool, whole);
            }
        }
        Ok(id)
    }
}
