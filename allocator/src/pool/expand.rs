//! Expandable segments (PyTorch's `expandable_segments:True`): growing by mapping pages into a
//! reserved virtual range, and shrinking by unmapping the pages free blocks cover entirely.
//!
//! A segment is made of blocks in three states: allocated, free (mapped) and unmapped. Growth
//! looks for the lowest-addressed run of free and unmapped blocks with room for the request,
//! maps the unmapped part and merges it with its free neighbours.

use super::block::{Block, BlockId, NIL};
use super::segment::{ExpSegment, Mapper, Range};
use super::Core;
use super::Observer;
use crate::sizes::PoolKind;
use crate::sync::{IdCounter, Ordering};
use cudalloc_sys::{Device, DeviceError, StreamId};
use std::collections::BTreeMap;

/// The next segment's id ([`ExpSegment::id`]): ids are never reused in a process.
static NEXT_SEGMENT_ID: IdCounter = IdCounter::new(1);

impl<D: Device> Core<D> {
    /// True when the block may take part in growth (free, or unmapped, with nothing pending and
    /// not being released).
    pub(crate) fn allocatable(&self, id: BlockId) -> bool {
        id != NIL && {
            let b = &self.blocks[id];
            !b.allocated && b.event_count == 0 && b.stream_uses.is_empty() && !b.releasing
        }
    }

    /// True when the free and unmapped blocks from `id` on add up to `size` bytes.
    pub(crate) fn has_room(&self, mut id: BlockId, size: u64) -> bool {
        let mut bytes = 0;
        while bytes < size && self.allocatable(id) {
            bytes += self.blocks[id].size;
            id = self.blocks[id].next;
        }
        bytes >= size
    }

    /// The lowest-addressed block, in `stream`'s existing ranges of `pool`, from which a run of
    /// free and unmapped blocks holds `size` bytes (a free block just before an unmapped one
    /// counts as the run's start).
    pub fn room_in_ranges(&self, stream: StreamId, pool: PoolKind, size: u64) -> Option<BlockId> {
        self.runs_in_ranges(stream, pool)
            .find(|&c| self.has_room(c, size))
    }

    /// The first block of each run of free and unmapped blocks of `stream`'s ranges of `pool`
    /// that ends in unmapped space, lowest first.
    pub(crate) fn runs_in_ranges(
        &self,
        stream: StreamId,
        pool: PoolKind,
    ) -> impl Iterator<Item = BlockId> + '_ {
        let idx = match pool {
            PoolKind::Small => &self.small,
            PoolKind::Large => &self.large,
        };
        idx.unmapped_of(stream.0).map(|c| {
            let prev = self.blocks[c].prev;
            if self.allocatable(prev) {
                prev
            } else {
                c
            }
        })
    }

    /// Reserves a virtual range of at least `size` bytes (rounded up to pages) for `stream`'s
    /// blocks of `pool`. `Ok(None)` when the address space is exhausted
    /// (`Core::reserve_failed` is then set).
    pub fn new_segment(
        &mut self,
        stream: StreamId,
        pool: PoolKind,
        page: u64,
        size: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        let size = size.div_ceil(page) * page;
        let va = match self.device.reserve(size) {
            Ok(va) => va,
            Err(e) if e.is_out_of_memory() => {
                self.reserve_failed = true;
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let seg = ExpSegment {
            id: NEXT_SEGMENT_ID.fetch_add(1, Ordering::Relaxed),
            shareable: self.cfg.shareable_segments,
            va,
            size,
            page,
            stream,
            pool,
            chunks: BTreeMap::new(),
            mapped: 0,
            leaked: Vec::new(),
            stuck: Vec::new(),
            slept: Vec::new(),
            moved: BTreeMap::new(),
        };
        // An index a policy released during this call stays unused until the pool told it.
        let free = |(i, s): &(usize, &Option<ExpSegment>)| {
            s.is_none() && !self.released_ranges.contains(&(*i as u32))
        };
        let index = match self.segments.iter().enumerate().find(free).map(|(i, _)| i) {
            Some(i) => {
                self.segments[i] = Some(seg);
                i
            }
            None => {
                self.segments.push(Some(seg));
                self.segments.len() - 1
            }
        };
        let mut b = Block::new(va, size, stream, pool);
        b.mapped = false;
        b.segment = index as u32;
        let id = self.blocks.insert(b);
        self.index_unmapped(id);
        Ok(Some(id))
    }

    /// Growth: makes the run of free and unmapped blocks that starts at block `start` (found by
    /// [`Core::room_in_ranges`]) a free block of at least `size` bytes, and returns it taken out
    /// of the free index. `map` maps the first `want` bytes of the unmapped block it is given
    /// (or more, as the policy likes) and returns the free block they became, merged with the
    /// run so far ([`Core::map_block`] does exactly that); `Ok(None)` from it is out of memory.
    pub fn map_run(
        &mut self,
        start: BlockId,
        size: u64,
        mut map: impl FnMut(&mut Self, BlockId, u64) -> Result<Option<BlockId>, DeviceError>,
    ) -> Result<Option<BlockId>, DeviceError> {
        let mut c = start;
        if !self.blocks[c].mapped {
            let want = self.blocks[c].size.min(size);
            match map(self, c, want)? {
                Some(id) => c = id,
                None => return Ok(None),
            }
        }
        while self.blocks[c].size < size {
            let next = self.blocks[c].next;
            let want = (size - self.blocks[c].size).min(self.blocks[next].size);
            match map(self, next, want)? {
                Some(id) => c = id,
                None => return Ok(None),
            }
        }
        let removed = self.unindex_free(c);
        debug_assert!(removed);
        Ok(Some(c))
    }

    /// Maps the first `size` bytes (rounded up to pages) of unmapped block `id`; the rest stays
    /// unmapped. The mapped block merges with free neighbours and enters the free index; its id
    /// (after merging) is returned. `Ok(None)`: out of memory, nothing changed. On another
    /// error, chunks whose rollback failed stay mapped and are counted as a free block (as
    /// `Core::unmap_block` counts what it unmapped before a failure).
    pub fn map_block(
        &mut self,
        id: BlockId,
        size: u64,
        max_chunk: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        let b = &self.blocks[id];
        debug_assert!(!b.mapped && size <= b.size);
        let (addr, seg_index) = (b.addr, b.segment as usize);
        let seg = self.segments[seg_index]
            .as_ref()
            .expect("block of a released segment");
        let len = seg.page_ceil(addr + size).min(seg.va + seg.size) - addr;
        if !self.claim(len) {
            return Ok(None);
        }
        let seg = self.segments[seg_index]
            .as_mut()
            .expect("block of a released segment");
        let strays = seg.stray_bytes();
        let m = Mapper {
            dev: &self.device,
            peers: &self.peers,
            hooks: &self.hooks,
        };
        let done = seg.map(&m, addr, size, max_chunk);
        self.track_strays(seg_index, strays);
        self.stats.calls.maps += done.undone;
        self.stats.calls.unmaps += done.undone;
        let kept = done.range.size;
        debug_assert!(
            kept == len || done.error.is_some(),
            "a map is all or nothing"
        );
        self.sub_reserved(len - kept);
        let mapped = (kept > 0).then(|| self.account_mapped(id, done.range));
        match done.error {
            None => Ok(mapped),
            Some(e) if e.is_out_of_memory() && kept == 0 => Ok(None),
            Some(e) => Err(e),
        }
    }

    /// Turns the part `range` of unmapped block `id` that was just mapped into a free block,
    /// merged with free neighbours and in the free index (the parts before and after it stay
    /// unmapped); returns its id.
    pub(super) fn account_mapped(&mut self, mut id: BlockId, range: Range) -> BlockId {
        let pool = self.blocks[id].pool;
        let before = range.addr - self.blocks[id].addr;
        if before > 0 {
            self.split_unmapped_tail(id, before);
            id = self.blocks[id].next;
        }
        let removed = self.unindex_unmapped(id);
        debug_assert!(removed);
        self.blocks[id].mapped = true;
        if range.size < self.blocks[id].size {
            self.split_unmapped_tail(id, range.size);
        }
        let prev = self.blocks[id].prev;
        self.try_merge(id, prev);
        let next = self.blocks[id].next;
        self.try_merge(id, next);
        self.insert_free(id);
        self.count_mapped(pool, range);
        id
    }

    /// Cuts block `id` to `keep` bytes; the rest becomes a new unmapped block after it.
    pub(crate) fn split_unmapped_tail(&mut self, id: BlockId, keep: u64) {
        let b = &self.blocks[id];
        let mut tail = Block::new(b.addr + keep, b.size - keep, b.stream, b.pool);
        tail.mapped = false;
        tail.segment = b.segment;
        tail.prev = id;
        tail.next = b.next;
        let tail_id = self.blocks.insert(tail);
        let next = self.blocks[id].next;
        if next != NIL {
            self.blocks[next].prev = tail_id;
        }
        let b = &mut self.blocks[id];
        b.next = tail_id;
        b.size = keep;
        self.index_unmapped(tail_id);
    }

    fn count_mapped(&mut self, pool: PoolKind, range: Range) {
        self.reserved_grew(pool, range.size);
        self.stats.num_device_alloc += 1;
        self.stats.calls.maps += range.ops;
    }

    /// Unmaps the pages free block `id` covers entirely. The unmapped part becomes its own
    /// unmapped block (merged with unmapped neighbours); mapped slivers before and after stay
    /// free. Returns the id of the unmapped block, or `id` when nothing was unmapped. When a
    /// driver call fails part of the way, what was unmapped before it is accounted for as
    /// above (so the blocks keep matching the device's pages) and the error is returned.
    pub(crate) fn unmap_block(&mut self, id: BlockId) -> Result<BlockId, DeviceError> {
        let b = &self.blocks[id];
        let (addr, size) = (b.addr, b.size);
        self.unmap_part(id, addr, size)
    }

    /// [`Core::unmap_block`] for the pages of free block `id` inside `lo..lo + len` only.
    pub(crate) fn unmap_part(
        &mut self,
        id: BlockId,
        lo: u64,
        len: u64,
    ) -> Result<BlockId, DeviceError> {
        let b = &self.blocks[id];
        let (addr, seg_index) = (b.addr, b.segment as usize);
        let seg = self.segments[seg_index]
            .as_mut()
            .expect("block of a released segment");
        let strays = seg.stray_bytes();
        let m = Mapper {
            dev: &self.device,
            peers: &self.peers,
            hooks: &self.hooks,
        };
        let done = seg.unmap(&m, lo, len);
        self.track_strays(seg_index, strays);
        let id = self.account_unmapped(id, addr, done.range);
        match done.error {
            Some(e) => Err(e),
            None => Ok(id),
        }
    }

    /// Turns the part `range` of free block `id` (at `addr`) that was just unmapped into an
    /// unmapped block, as [`Core::unmap_block`] says.
    fn account_unmapped(&mut self, id: BlockId, addr: u64, range: Range) -> BlockId {
        if range.size == 0 {
            return id;
        }
        debug_assert_eq!(addr, self.blocks[id].addr);
        let pool = self.blocks[id].pool;
        let id = self.turn_unmapped(id, range.addr, range.size);
        self.sub_reserved(range.size);
        self.reserved_shrank(pool, range.size);
        self.stats.num_device_free += 1;
        self.stats.calls.unmaps += range.ops;
        id
    }

    /// Makes the part `lo..lo + len` of free block `id` (in its free index), whose pages are no
    /// longer mapped, an unmapped block (merged with unmapped neighbours, in the unmapped index);
    /// the mapped parts before and after stay free. Blocks only: the caller counts the bytes.
    /// Returns the unmapped block's id.
    pub(crate) fn turn_unmapped(&mut self, id: BlockId, lo: u64, len: u64) -> BlockId {
        let removed = self.unindex_free(id);
        debug_assert!(removed);
        let before = lo - self.blocks[id].addr;
        if before > 0 {
            self.split_mapped_front(id, before);
        }
        let after = self.blocks[id].size - len;
        if after > 0 {
            self.split_mapped_back(id, after);
        }
        self.blocks[id].mapped = false;
        let prev = self.blocks[id].prev;
        self.try_merge(id, prev);
        let next = self.blocks[id].next;
        self.try_merge(id, next);
        self.index_unmapped(id);
        id
    }

    /// Splits `len` bytes off the front of block `id` into a new free mapped block.
    pub(crate) fn split_mapped_front(&mut self, id: BlockId, len: u64) {
        let b = &self.blocks[id];
        let mut front = Block::new(b.addr, len, b.stream, b.pool);
        front.segment = b.segment;
        front.prev = b.prev;
        front.next = id;
        let fid = self.blocks.insert(front);
        let prev = self.blocks[id].prev;
        if prev != NIL {
            self.blocks[prev].next = fid;
        }
        let b = &mut self.blocks[id];
        b.prev = fid;
        b.addr += len;
        b.size -= len;
        self.insert_free(fid);
    }

    /// Splits `len` bytes off the back of block `id` into a new free mapped block.
    pub(crate) fn split_mapped_back(&mut self, id: BlockId, len: u64) {
        let b = &self.blocks[id];
        let mut back = Block::new(b.end() - len, len, b.stream, b.pool);
        back.segment = b.segment;
        back.prev = id;
        back.next = b.next;
        let bid = self.blocks.insert(back);
        let next = self.blocks[id].next;
        if next != NIL {
            self.blocks[next].prev = bid;
        }
        let b = &mut self.blocks[id];
        b.next = bid;
        b.size -= len;
        self.insert_free(bid);
    }

    /// Releases the range whose single block, unmapped, is `id`, for a policy's `grow` (as
    /// `release_expandable_segment` does, pages whose release failed keeping it): its index is
    /// queued, and the pool tells its policy (adaptors included) once the policy's next `grow`
    /// returns (`Core::take_released_ranges`); until then no new range gets the index.
    pub fn release_empty_range(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let mut queue = ReleasedRanges(Vec::new());
        let released = self.release_expandable_segment(&mut queue, id);
        self.released_ranges.extend(queue.0);
        released
    }

    /// The ranges released by [`Core::release_empty_range`] since the last call.
    pub(crate) fn take_released_ranges(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.released_ranges)
    }

    /// Frees a segment whose single block is unmapped. A segment holding pages whose release
    /// failed after their unmap keeps its range until they are released (a later call tries
    /// them again).
    pub(crate) fn release_expandable_segment<P: Observer>(
        &mut self,
        policy: &mut P,
        id: BlockId,
    ) -> Result<(), DeviceError> {
        let b = &self.blocks[id];
        let seg_index = b.segment as usize;
        let seg = self.segments[seg_index]
            .as_mut()
            .expect("segment released twice");
        debug_assert!(b.size == seg.size && !b.mapped && seg.chunks.is_empty());
        let strays = seg.stray_bytes();
        seg.retry_leaked(&self.device);
        self.track_strays(seg_index, strays);
        let seg = self.segments[seg_index]
            .as_ref()
            .expect("segment released twice");
        if seg.holds_strays() {
            return Ok(());
        }
        self.device.unreserve(seg.va, seg.size)?;
        self.segments[seg_index] = None;
        // A later segment may get this index and these addresses.
        policy.segment_released(seg_index as u32);
        let b = self.blocks.remove(id);
        let removed = self.index(b.pool).remove_unmapped(&b);
        debug_assert!(removed);
        Ok(())
    }
}

/// Collects the indices of the ranges released for [`Core::release_empty_range`].
struct ReleasedRanges(Vec<u32>);

impl Observer for ReleasedRanges {
    fn marked_free<D: Device>(&mut self, _core: &Core<D>, _id: BlockId, _mark: u64) {
        // Releasing a range frees no block.
    }

    fn segment_released(&mut self, segment: u32) {
        self.0.push(segment);
    }
}
