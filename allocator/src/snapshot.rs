//! Snapshots: every segment and its blocks, and the fragmentation figures derived from them;
//! where the reserved bytes are at one moment ([`Excess`]) and which units pin free bytes
//! ([`PinnedUnit`]).
//!
//! A snapshot is the ground truth the statistics are checked against: every `current` value of
//! [`crate::Stats`] can be recomputed from it ([`Snapshot::recompute`]).
//!
//! Each block is in one [`BlockState`]. A [`crate::Pool`]'s snapshot shows what the pool holds:
//! allocated, waiting for events, free or unmapped. A [`crate::CachingAllocator`]'s shows what
//! its callers hold, as its statistics count: a block its caller freed into a thread cache
//! (`tcache.rs`) is still allocated from its pool's point of view, but the allocator's
//! snapshot shows it as [`BlockState::ThreadCached`], neither allocated nor free (it serves only
//! its thread's next request of the same size on the same stream; no other request can have it).
//!
//! Invariants: the blocks of a segment tile it in address order; `recompute() == recorded()`,
//! for a `CachingAllocator`'s snapshot too, which reads its blocks, its statistics and its
//! thread caches' contents with every stream shard locked.

use crate::sizes::PoolKind;
use crate::stats::{StatArray, Stats};
use cudalloc_sys::StreamId;

/// What a block is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlockState {
    /// Handed out to a caller.
    Allocated,
    /// Freed by the caller, waiting for events on other streams.
    PendingEvents,
    /// Cached: free and mapped.
    Free,
    /// Addresses of an expandable segment with no memory behind them.
    Unmapped,
    /// Free pages of an expandable segment on their way back to the device: unmapped once the
    /// work their stream queued before has completed; no request gets them meanwhile.
    Releasing,
    /// Addresses of an expandable segment whose pages moved to another block (`pool::moving`):
    /// still mapped to them until the work their stream queued before has completed, then
    /// unmapped. No memory of their own: the block the pages moved to counts it.
    Moved,
    /// Freed by its caller into a thread cache: not allocated (as the statistics count it), nor
    /// free for any request but its thread's next one of the same size and stream. Only a
    /// `CachingAllocator`'s snapshot shows it.
    ThreadCached,
}

impl BlockState {
    /// Lower-case name used in JSON.
    pub fn name(self) -> &'static str {
        match self {
            BlockState::Allocated => "allocated",
            BlockState::PendingEvents => "pending_events",
            BlockState::Free => "free",
            BlockState::Unmapped => "unmapped",
            BlockState::Releasing => "releasing",
            BlockState::Moved => "moved",
            BlockState::ThreadCached => "thread_cached",
        }
    }
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// First address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes the caller asked for (0 unless allocated, pending or thread-cached: what the last
    /// caller asked for, the size a thread cache serves it for).
    pub requested: u64,
    /// State.
    pub state: BlockState,
}

/// One segment with its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// First address.
    pub addr: u64,
    /// Bytes of address space.
    pub size: u64,
    /// Bytes backed by device memory (equal to `size` unless expandable).
    pub mapped: u64,
    /// Bytes of pages unmapped from an expandable segment whose release failed: the device
    /// still holds them (they count in `reserved_bytes`) until a later call on the segment
    /// releases them; 0 otherwise.
    pub stray: u64,
    /// Pool.
    pub pool: PoolKind,
    /// Stream.
    pub stream: StreamId,
    /// A reserved virtual range with pages mapped on demand.
    pub expandable: bool,
    /// The caller's tag whose pool holds the segment (`CachingAllocator::allocate_tagged`),
    /// `None` for untagged memory.
    pub tag: Option<String>,
    /// Blocks, tiling the segment.
    pub blocks: Vec<BlockInfo>,
}

/// Segments and statistics at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Segments in address order.
    pub segments: Vec<SegmentInfo>,
    /// Statistics at the same moment.
    pub stats: Stats,
}

/// Fragmentation figures PyTorch does not report.
#[derive(Clone, Debug, PartialEq)]
pub struct Fragmentation {
    /// Bytes in free mapped blocks (not in [`BlockState::ThreadCached`] ones, which only their
    /// thread can take; [`crate::Stats::thread_cache`] counts those).
    pub free_bytes: u64,
    /// The largest free mapped block.
    pub largest_free_block: u64,
    /// 1 - largest free block / free bytes (0 when nothing is free).
    pub external_fragmentation: f64,
    /// Allocated bytes / reserved bytes (1 when nothing is reserved).
    pub utilisation: f64,
    /// Free mapped blocks by size: (lower bound of a power-of-two bucket, count, bytes).
    pub free_histogram: Vec<(u64, u64, u64)>,
    /// Bytes backed by device memory.
    pub mapped_bytes: u64,
    /// Bytes of address space held (fixed segments plus reserved virtual ranges).
    pub virtual_bytes: u64,
}

/// Where a pool's reserved bytes are at one moment ([`crate::pool::Core::excess`]): what the live
/// allocations asked for, and every kind of byte above it. The parts add up to `reserved`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Excess {
    /// Bytes held from the device.
    pub reserved: u64,
    /// Bytes the live allocations asked for.
    pub live: u64,
    /// Bytes of live blocks beyond their requests (size rounding, unsplit remainders).
    pub rounding: u64,
    /// Bytes of freed blocks still waiting for other streams' work, and of free pages on their
    /// way back to the device ([`BlockState::Releasing`]).
    pub pending: u64,
    /// Free bytes the pool could give back now: chunks lying wholly inside free blocks of
    /// expandable segments, and `cudaMalloc` segments holding no other block.
    pub releasable: u64,
    /// Free bytes that cannot go back while a live or pending block shares their chunk or
    /// segment.
    pub pinned: u64,
    /// The part of `pinned` in whole device pages (the device's granularity, 2 MiB on the H200)
    /// of expandable segments that no block in use touches: chunks of one page each would give
    /// these back (`max_chunk_mb` trades them against driver calls under `default`;
    /// `torch-expandable` maps 20 MiB units in its large pool). The rest of `pinned` lies in
    /// pages that blocks in use touch, or in `cudaMalloc` segments, where no chunk size gives it
    /// back.
    pub pinned_pages: u64,
    /// Pages unmapped whose release failed, held until a later call releases them (0 unless
    /// a driver call failed).
    pub stray: u64,
}

/// One unit holding pinned bytes ([`crate::pool::Core::pinning`]): a chunk of an expandable segment
/// (what one map and one unmap act on) or a `cudaMalloc` segment, with its free bytes that
/// cannot go back and the blocks in use beside them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedUnit {
    /// A chunk of an expandable segment (false: a `cudaMalloc` segment).
    pub chunk: bool,
    /// First address of the chunk or segment.
    pub addr: u64,
    /// Its bytes.
    pub size: u64,
    /// Its free bytes: pinned while a block in it is in use.
    pub pinned: u64,
    /// Blocks in it that are in use: allocated, or waiting for events.
    pub holders: u32,
    /// The largest of them, as (address, bytes).
    pub largest: (u64, u64),
}

impl std::ops::AddAssign for Excess {
    /// Adds another pool's breakdown (a `CachingAllocator`'s shards).
    fn add_assign(&mut self, o: Excess) {
        self.reserved += o.reserved;
        self.live += o.live;
        self.rounding += o.rounding;
        self.pending += o.pending;
        self.releasable += o.releasable;
        self.pinned += o.pinned;
        self.pinned_pages += o.pinned_pages;
        self.stray += o.stray;
    }
}

impl PinnedUnit {
    /// Orders units the most pinned first, the lowest address among equals.
    pub fn sort_most_pinned(units: &mut [PinnedUnit]) {
        units.sort_by(|a, b| b.pinned.cmp(&a.pinned).then(a.addr.cmp(&b.addr)));
    }
}

impl Snapshot {
    /// Recomputes the `current` value of every per-pool statistic from the blocks; returns
    /// (allocation, segment, active, inactive_split, allocated_bytes, reserved_bytes,
    /// active_bytes, inactive_split_bytes, requested_bytes) as `current` triples.
    pub fn recompute(&self) -> [[i64; 3]; 9] {
        let mut r = [[0i64; 3]; 9];
        for seg in &self.segments {
            let p = if seg.pool == PoolKind::Small { 1 } else { 2 };
            let mut add = |k: usize, v: u64| {
                r[k][0] += v as i64;
                r[k][p] += v as i64;
            };
            if !seg.expandable {
                add(1, 1);
            }
            add(5, seg.mapped + seg.stray);
            let split = seg.blocks.len() > 1;
            for b in &seg.blocks {
                match b.state {
                    BlockState::Allocated => {
                        add(0, 1);
                        add(4, b.size);
                        add(2, 1);
                        add(6, b.size);
                        add(8, b.requested);
                    }
                    BlockState::PendingEvents => {
                        add(2, 1);
                        add(6, b.size);
                        add(8, b.requested);
                    }
                    BlockState::Free if split && !seg.expandable => {
                        add(3, 1);
                        add(7, b.size);
                    }
                    // Neither allocated nor active, as `CachingAllocator::stats` counts it; not an
                    // inactive split either: its pool still holds it as allocated.
                    BlockState::ThreadCached => {}
                    _ => {}
                }
            }
        }
        r
    }

    /// Marks the allocated blocks at `ptrs` as [`BlockState::ThreadCached`]: the blocks a
    /// `CachingAllocator`'s thread caches hold. The segments must be in address order.
    pub(crate) fn mark_thread_cached(&mut self, ptrs: &[u64]) {
        for &ptr in ptrs {
            let i = self.segments.partition_point(|s| s.addr <= ptr);
            let block = i.checked_sub(1).and_then(|i| {
                let blocks = &mut self.segments[i].blocks;
                let j = blocks.binary_search_by_key(&ptr, |b| b.addr).ok()?;
                Some(&mut blocks[j])
            });
            // Without its pool's allocated block, `recompute` differs from `recorded` too.
            let block = block.filter(|b| b.state == BlockState::Allocated);
            debug_assert!(
                block.is_some(),
                "a cached entry at {ptr:#x}, no allocated block"
            );
            if let Some(b) = block {
                b.state = BlockState::ThreadCached;
            }
        }
    }

    /// The `current` values the statistics hold, in [`Snapshot::recompute`]'s order.
    pub fn recorded(&self) -> [[i64; 3]; 9] {
        let arrays = self.stats.arrays();
        let mut r = [[0i64; 3]; 9];
        for (i, (_, a)) in arrays.iter().enumerate() {
            r[i] = current3(a);
        }
        r
    }

    /// Fragmentation figures.
    pub fn fragmentation(&self) -> Fragmentation {
        let mut free_bytes = 0;
        let mut largest = 0;
        let mut hist: Vec<(u64, u64, u64)> = Vec::new();
        let (mut mapped, mut virt) = (0, 0);
        for seg in &self.segments {
            mapped += seg.mapped;
            virt += seg.size;
            for b in seg.blocks.iter().filter(|b| b.state == BlockState::Free) {
                free_bytes += b.size;
                largest = largest.max(b.size);
                let bucket = 1u64 << (63 - b.size.leading_zeros());
                match hist.iter_mut().find(|h| h.0 == bucket) {
                    Some(h) => {
                        h.1 += 1;
                        h.2 += b.size;
                    }
                    None => hist.push((bucket, 1, b.size)),
                }
            }
        }
        hist.sort_unstable();
        let allocated = self.stats.allocated_bytes.0[0].current as f64;
        let reserved = self.stats.reserved_bytes.0[0].current as f64;
        Fragmentation {
            free_bytes,
            largest_free_block: largest,
            external_fragmentation: if free_bytes == 0 {
                0.0
            } else {
                1.0 - largest as f64 / free_bytes as f64
            },
            utilisation: if reserved == 0.0 {
                1.0
            } else {
                allocated / reserved
            },
            free_histogram: hist,
            mapped_bytes: mapped,
            virtual_bytes: virt,
        }
    }
}

fn current3(a: &StatArray) -> [i64; 3] {
    [a.0[0].current, a.0[1].current, a.0[2].current]
}
