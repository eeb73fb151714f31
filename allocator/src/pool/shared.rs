//! What the pool tells the world of its memory: the ranges it has mapped, announced to its map
//! hooks ([`crate::hooks`]), and the pages behind an allocation, exported for another process
//! ([`crate::share`]).
//!
//! Invariant: the ranges [`Core::mapped_ranges`] lists are exactly those announced to the
//! pool's hooks and not withdrawn: every chunk of every expandable segment, and every fixed
//! segment.

use super::block::{BlockId, NIL};
use super::Core;
use crate::error::AllocError;
use crate::hooks::{Hooks, MapHooks};
use crate::share::{SharedAllocation, SharedPage};
use crate::sync::Arc;
use cudalloc_sys::Device;

/// Why an allocation of a fixed segment cannot be shared.
const FIXED_SEGMENT: &str = "its segment was allocated with cuMemAlloc (policy `torch`), \
    whose memory cannot be exported; use `policy:default` or `policy:torch-expandable` with \
    `shareable_segments:True`";
/// Why an allocation of a segment made without `shareable_segments` cannot be shared.
const KEY_OFF: &str = "its segment's pages were not created exportable; set the config key \
    `shareable_segments:True` (before the memory is allocated)";

impl<D: Device> Core<D> {
    /// Every range announced to the hooks, by address: the chunks of the expandable segments,
    /// the addresses of pages moved out of them that are still mapped (`moving`) and the fixed
    /// segments.
    pub fn mapped_ranges(&self) -> Vec<(u64, u64)> {
        let segments = self.segments.iter().flatten();
        let chunks = segments.clone().flat_map(|s| s.chunks.iter());
        let moved = segments.flat_map(|s| s.moved.iter().map(|(&a, &size)| (a, size)));
        let mut ranges: Vec<(u64, u64)> = chunks.map(|(&a, c)| (a, c.size)).chain(moved).collect();
        for (id, b) in self.blocks.iter() {
            if !b.is_expandable() && b.prev == NIL {
                ranges.push((b.addr, self.fixed_segment_bytes(id)));
            }
        }
        ranges.sort_unstable();
        ranges
    }

    /// Bytes of the fixed segment whose first block is `head`.
    fn fixed_segment_bytes(&self, head: BlockId) -> u64 {
        let (mut id, mut bytes) = (head, 0);
        while id != NIL {
            bytes += self.blocks[id].size;
            id = self.blocks[id].next;
        }
        bytes
    }

    /// Replaces the pool's hooks: every mapped range is withdrawn from the old ones and
    /// announced to the new ones.
    pub(crate) fn set_hooks(&mut self, hooks: Option<Arc<dyn MapHooks>>) {
        let new = Hooks::new(hooks, self.device.ordinal());
        let ranges = self.mapped_ranges();
        for &(addr, size) in &ranges {
            self.hooks.unmapping(addr, size);
        }
        for &(addr, size) in &ranges {
            new.mapped(addr, size);
        }
        self.hooks = new;
    }

    /// Exports the pages behind the live allocation of `size` bytes at `ptr` (block `id`).
    pub(crate) fn share_block(
        &self,
        id: BlockId,
        ptr: u64,
        size: u64,
    ) -> Result<SharedAllocation, AllocError> {
        let b = self.blocks.get(id).filter(|b| b.allocated && b.addr == ptr);
        let b = b.ok_or(AllocError::NotAllocated(ptr))?;
        if self.slumber.is_some() {
            let (what, tag) = ("share", None);
            return Err(AllocError::Asleep { what, tag });
        }
        let refuse = |why: &str| AllocError::NotShareable {
            ptr,
            why: why.to_string(),
        };
        if !b.is_expandable() {
            return Err(refuse(FIXED_SEGMENT));
        }
        let seg = self.segments[b.segment as usize]
            .as_ref()
            .expect("block of a released segment");
        if !seg.shareable {
            return Err(refuse(KEY_OFF));
        }
        let end = ptr + size.max(1);
        let first = seg
            .chunks
            .range(..=ptr)
            .next_back()
            .map_or(ptr, |(&a, _)| a);
        let mut pages = Vec::new();
        for (_, c) in seg.chunks.range(first..end) {
            let fd = self.device.export_page(c.handle)?;
            pages.push(SharedPage { size: c.size, fd });
        }
        Ok(SharedAllocation {
            device: self.device.ordinal(),
            segment: seg.id,
            offset: ptr - first,
            size,
            pages,
        })
    }
}
