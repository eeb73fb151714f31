//! Where a pool's pinned bytes are ([`PinnedUnit`]): the free bytes that cannot go back while a
//! block shares their unit with them, per unit. A unit is what one driver call gives back: a
//! chunk of an expandable segment, or a `cudaMalloc` segment.
//!
//! Invariants: a unit is listed when it holds free bytes and is not itself wholly free (a chunk
//! inside one free block, or a segment of one free block, can go back and is not pinned); the
//! pinned bytes of the listed units add up to [`Excess::pinned`](crate::snapshot::Excess) at the
//! same moment (`Pool::check_invariants` checks it).

use super::block::{Block, BlockId, NIL, NO_SEGMENT};
use super::Core;
use crate::snapshot::PinnedUnit;
use cudalloc_sys::Device;

impl<D: Device> Core<D> {
    /// Every unit holding pinned bytes, the most pinned first (the lowest address among equals).
    pub fn pinning(&self) -> Vec<PinnedUnit> {
        let mut units = Vec::new();
        if self.asleep() {
            return units; // its blocks hold no pages
        }
        for (id, b) in self.blocks.iter() {
            if b.prev != NIL {
                continue;
            }
            if b.segment == NO_SEGMENT {
                self.pinned_in_segment(id, &mut units);
            } else {
                self.pinned_in_chunks(id, &mut units);
            }
        }
        PinnedUnit::sort_most_pinned(&mut units);
        units
    }

    /// The `cudaMalloc` segment starting with block `head`, when it is split and holds free bytes.
    fn pinned_in_segment(&self, head: BlockId, units: &mut Vec<PinnedUnit>) {
        let mut unit = PinnedUnit {
            addr: self.blocks[head].addr,
            ..PinnedUnit::default()
        };
        let mut id = head;
        while id != NIL {
            let b = &self.blocks[id];
            unit.size += b.size;
            count(&mut unit, b, b.size);
            id = b.next;
        }
        if unit.pinned > 0 && self.blocks[head].is_split() {
            units.push(unit);
        }
    }

    /// The chunks of the expandable segment whose first block is `head` that hold free bytes but
    /// do not lie inside one free block.
    fn pinned_in_chunks(&self, head: BlockId, units: &mut Vec<PinnedUnit>) {
        let seg = self.segments[self.blocks[head].segment as usize]
            .as_ref()
            .expect("live segment");
        let mut first = head;
        for (&addr, chunk) in &seg.chunks {
            let end = addr + chunk.size;
            while first != NIL && self.blocks[first].end() <= addr {
                first = self.blocks[first].next;
            }
            let mut unit = PinnedUnit {
                chunk: true,
                addr,
                size: chunk.size,
                ..PinnedUnit::default()
            };
            let mut id = first;
            while id != NIL && self.blocks[id].addr < end {
                let b = &self.blocks[id];
                if is_free(b) && b.addr <= addr && b.end() >= end {
                    // The chunk lies inside one free block: it can go back.
                    unit.pinned = 0;
                    break;
                }
                count(&mut unit, b, b.end().min(end) - b.addr.max(addr));
                id = b.next;
            }
            if unit.pinned > 0 {
                units.push(unit);
            }
        }
    }
}

/// A mapped block that is neither allocated, waiting for events nor being released.
fn is_free(b: &Block) -> bool {
    b.mapped && !b.allocated && !b.waits() && !b.releasing
}

/// Adds `bytes` of block `b` (those inside the unit) to `unit`.
fn count(unit: &mut PinnedUnit, b: &Block, bytes: u64) {
    if is_free(b) {
        unit.pinned += bytes;
    } else if b.mapped {
        unit.holders += 1;
        if b.size > unit.largest.1 {
            unit.largest = (b.addr, b.size);
        }
    }
}
