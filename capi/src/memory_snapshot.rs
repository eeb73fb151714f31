//! The document of `cudalloc_memory_snapshot`: a device's segments and blocks in the shape of
//! PyTorch's memory snapshot (`torch.cuda.memory_snapshot()`), as plain structs a C or C++
//! caller reads without parsing, for the device's allocator and its private pools together.
//!
//! PyTorch's shape differs from [`Snapshot`]'s in one way: a block there has no address of its
//! own (PyTorch's Python binding numbers the blocks of a segment from its address, one after
//! the other), so a segment holds only mapped memory. An expandable segment is therefore
//! reported as one segment per run of mapped blocks, as PyTorch reports its own, and unmapped
//! addresses are in no segment; every other segment is reported whole.
//!
//! The bytes, native-endian, every field 8-byte aligned (`cudalloc.h` declares the structs):
//! - a header: the segment count and the block count (`uint64_t` each);
//! - the segments ([`SEGMENT_BYTES`] each): address, total size, stream, the private pool's two
//!   ids ((0, 0): the device's own memory), the index of its first block, its block count (all
//!   `uint64_t`), then the device and the flags ([`LARGE`], [`EXPANDABLE`]) as `int32_t`;
//! - the blocks ([`BLOCK_BYTES`] each), a segment's in address order: address, size, requested
//!   size (`uint64_t`), the state ([`state_code`]) and a zero (`int32_t`).
//!
//! The segments are in address order, so the blocks are too.

use crate::pools::PoolId;
use cudalloc_core::sizes::PoolKind;
use cudalloc_core::snapshot::{BlockInfo, BlockState, SegmentInfo};
use cudalloc_core::Snapshot;

/// Bytes of the header: the segment count and the block count.
pub const HEADER_BYTES: usize = 16;
/// Bytes of one segment (`cudalloc_segment`).
pub const SEGMENT_BYTES: usize = 64;
/// Bytes of one block (`cudalloc_block`).
pub const BLOCK_BYTES: usize = 32;

/// Segment flag: the segment is in the large pool (PyTorch's `segment_type` "large").
pub const LARGE: i32 = 1;
/// Segment flag: part of an expandable segment (PyTorch's `is_expandable`).
pub const EXPANDABLE: i32 = 2;

/// A block's state as the C ABI numbers it (`CUDALLOC_BLOCK_*`). Unmapped and moved addresses are
/// never blocks of this document (0 is no state, also given to a state this ABI does not number
/// yet).
pub fn state_code(state: BlockState) -> i32 {
    match state {
        BlockState::Allocated => 1,
        BlockState::PendingEvents => 2,
        BlockState::Free => 3,
        BlockState::Releasing => 4,
        BlockState::ThreadCached => 5,
        _ => 0,
    }
}

/// One segment of the document with its blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First address (that of its first block).
    pub address: u64,
    /// The stream it belongs to.
    pub stream: u64,
    /// The private pool that owns it; (0, 0): the device's own allocator.
    pub pool: PoolId,
    /// The device ordinal.
    pub device: i32,
    /// [`LARGE`] and [`EXPANDABLE`].
    pub flags: i32,
    /// Its blocks, tiling it in address order (none unmapped).
    pub blocks: Vec<BlockInfo>,
}

impl Segment {
    /// Bytes of its blocks.
    pub fn total_size(&self) -> u64 {
        self.blocks.iter().map(|b| b.size).sum()
    }
}

/// A device's segments in PyTorch's shape, gathered from one or more allocators.
#[derive(Clone, Debug, Default)]
pub struct Document {
    /// Segments, in address order once [`Document::to_bytes`] has sorted them.
    pub segments: Vec<Segment>,
}

impl Document {
    /// Adds the segments of `snap`, an allocator of device `device` owned by `pool`: each
    /// segment whole, but for an expandable one a segment per run of mapped blocks.
    pub fn add(&mut self, snap: &Snapshot, device: i32, pool: PoolId) {
        for seg in &snap.segments {
            self.add_runs(seg, device, pool);
        }
    }

    fn add_runs(&mut self, seg: &SegmentInfo, device: i32, pool: PoolId) {
        let mut flags = if seg.pool == PoolKind::Large {
            LARGE
        } else {
            0
        };
        if seg.expandable {
            flags |= EXPANDABLE;
        }
        // Moved addresses hold no memory of their own (the block their pages moved to does).
        let bare = |b: &BlockInfo| matches!(b.state, BlockState::Unmapped | BlockState::Moved);
        for run in seg.blocks.split(bare) {
            if let Some(first) = run.first() {
                self.segments.push(Segment {
                    address: first.addr,
                    stream: seg.stream.0,
                    pool,
                    device,
                    flags,
                    blocks: run.to_vec(),
                });
            }
        }
    }

    /// The document's bytes (see the module doc), segments sorted by address.
    pub fn to_bytes(mut self) -> Vec<u8> {
        self.segments.sort_by_key(|s| s.address);
        let blocks: usize = self.segments.iter().map(|s| s.blocks.len()).sum();
        let mut out = Vec::with_capacity(
            HEADER_BYTES + self.segments.len() * SEGMENT_BYTES + blocks * BLOCK_BYTES,
        );
        put(&mut out, self.segments.len() as u64);
        put(&mut out, blocks as u64);
        let mut first = 0u64;
        for s in &self.segments {
            for v in [
                s.address,
                s.total_size(),
                s.stream,
                s.pool.0,
                s.pool.1,
                first,
            ] {
                put(&mut out, v);
            }
            put(&mut out, s.blocks.len() as u64);
            out.extend_from_slice(&s.device.to_ne_bytes());
            out.extend_from_slice(&s.flags.to_ne_bytes());
            first += s.blocks.len() as u64;
        }
        for b in self.segments.iter().flat_map(|s| &s.blocks) {
            for v in [b.addr, b.size, b.requested] {
                put(&mut out, v);
            }
            out.extend_from_slice(&state_code(b.state).to_ne_bytes());
            out.extend_from_slice(&0i32.to_ne_bytes());
        }
        out
    }
}

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_ne_bytes());
}

/// One segment as `cudalloc_segment` holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentRecord {
    /// First address.
    pub address: u64,
    /// Bytes of its blocks.
    pub total_size: u64,
    /// The stream.
    pub stream: u64,
    /// The owning private pool; (0, 0): the device's own memory.
    pub pool: PoolId,
    /// Index of its first block.
    pub first_block: u64,
    /// Number of its blocks.
    pub block_count: u64,
    /// Device ordinal.
    pub device: i32,
    /// [`LARGE`], [`EXPANDABLE`].
    pub flags: i32,
}

/// One block as `cudalloc_block` holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRecord {
    /// First address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes its last caller asked for (0 for a free block).
    pub requested: u64,
    /// [`state_code`].
    pub state: i32,
}

/// A document read back: its segments and blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Records {
    /// Segments, in address order.
    pub segments: Vec<SegmentRecord>,
    /// Blocks, each segment's from its `first_block`.
    pub blocks: Vec<BlockRecord>,
}

/// Reads bytes written by `cudalloc_memory_snapshot` (for Rust callers and tests); None if
/// they are not a whole document.
pub fn parse(bytes: &[u8]) -> Option<Records> {
    let u64_at = |at: usize| -> Option<u64> {
        Some(u64::from_ne_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
    };
    let i32_at = |at: usize| -> Option<i32> {
        Some(i32::from_ne_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
    };
    let segments = usize::try_from(u64_at(0)?).ok()?;
    let blocks = usize::try_from(u64_at(8)?).ok()?;
    let blocks_at = HEADER_BYTES.checked_add(segments.checked_mul(SEGMENT_BYTES)?)?;
    if bytes.len() != blocks_at.checked_add(blocks.checked_mul(BLOCK_BYTES)?)? {
        return None;
    }
    let mut out = Records::default();
    for i in 0..segments {
        let at = HEADER_BYTES + i * SEGMENT_BYTES;
        out.segments.push(SegmentRecord {
            address: u64_at(at)?,
            total_size: u64_at(at + 8)?,
            stream: u64_at(at + 16)?,
            pool: (u64_at(at + 24)?, u64_at(at + 32)?),
            first_block: u64_at(at + 40)?,
            block_count: u64_at(at + 48)?,
            device: i32_at(at + 56)?,
            flags: i32_at(at + 60)?,
        });
    }
    for i in 0..blocks {
        let at = blocks_at + i * BLOCK_BYTES;
        out.blocks.push(BlockRecord {
            address: u64_at(at)?,
            size: u64_at(at + 8)?,
            requested: u64_at(at + 16)?,
            state: i32_at(at + 24)?,
        });
    }
    Some(out)
}

impl Records {
    /// The blocks of `segment`.
    pub fn blocks_of(&self, segment: &SegmentRecord) -> &[BlockRecord] {
        &self.blocks[segment.first_block as usize..][..segment.block_count as usize]
    }
}

#[cfg(test)]
#[path = "memory_snapshot_tests.rs"]
mod tests;
