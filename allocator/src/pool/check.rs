//! Snapshot, the breakdown of reserved bytes ([`Excess`]) and the full invariant scan of a pool.

use super::block::{Block, BlockId, NIL, NO_SEGMENT};
use super::{Core, Request};
use crate::error::{AllocError, Invariant, InvariantError};
use crate::snapshot::{BlockInfo, BlockState, Excess, SegmentInfo, Snapshot};
use cudalloc_sys::Device;

impl<D: Device> Core<D> {
    /// Every segment with its blocks, and the statistics.
    pub fn snapshot(&self) -> Snapshot {
        let mut segments = Vec::new();
        for (id, b) in self.blocks.iter() {
            if b.prev != NIL {
                continue;
            }
            let (size, mapped, stray, expandable) = if b.segment == NO_SEGMENT {
                (self.chain_bytes(id), self.chain_bytes(id), 0, false)
            } else {
                let s = self.segments[b.segment as usize]
                    .as_ref()
                    .expect("live segment");
                (s.size, s.mapped, s.stray_bytes(), true)
            };
            segments.push(SegmentInfo {
                addr: b.addr,
                size,
                mapped,
                stray,
                pool: b.pool,
                stream: b.stream,
                expandable,
                tag: None,
                blocks: self.chain(id).map(|c| self.block_info(c)).collect(),
            });
        }
        segments.sort_by_key(|s| s.addr);
        Snapshot {
            segments,
            stats: self.stats.clone(),
        }
    }

    /// Where the reserved bytes are now: live, rounding, pending, releasable and pinned
    /// ([`Excess`]), from one scan of the blocks.
    pub fn excess(&self) -> Excess {
        let mut e = Excess {
            reserved: self.reserved + self.strays,
            stray: self.strays,
            ..Excess::default()
        };
        if self.asleep() {
            return e; // its blocks hold no pages
        }
        for (_, b) in self.blocks.iter().filter(|(_, b)| b.mapped && !b.moved) {
            if b.allocated {
                e.live += b.requested;
                e.rounding += b.size - b.requested;
            } else if b.waits() || b.releasing {
                e.pending += b.size;
            } else {
                let whole = self.releasable_bytes(b);
                e.releasable += whole;
                e.pinned += b.size - whole;
                if b.is_expandable() {
                    let pages = self.whole_page_bytes(b);
                    debug_assert!(whole <= pages, "whole chunks lie in whole pages");
                    e.pinned_pages += pages.saturating_sub(whole);
                }
            }
        }
        e
    }

    /// Bytes of the whole device pages (the device's granularity, not the segment's map unit:
    /// 20 MiB in `torch-expandable`'s large pool) free block `b` covers, counted from its
    /// segment's start (`b` lies in an expandable segment). The chunks it covers entirely are
    /// among them (a chunk is whole map units, and a map unit whole device pages).
    fn whole_page_bytes(&self, b: &Block) -> u64 {
        let seg = self.segments[b.segment as usize]
            .as_ref()
            .expect("live segment");
        let page = self.device.granularity().unwrap_or(seg.page).min(seg.page);
        let first = seg.va + (b.addr - seg.va).div_ceil(page) * page;
        let end = seg.va + (b.end() - seg.va) / page * page;
        end.saturating_sub(first)
    }

    /// Bytes of free block `b` that could be given back without touching another block.
    fn releasable_bytes(&self, b: &Block) -> u64 {
        if b.segment == NO_SEGMENT {
            return if b.is_split() { 0 } else { b.size };
        }
        let seg = self.segments[b.segment as usize]
            .as_ref()
            .expect("live segment");
        seg.chunks
            .range(b.addr..b.end())
            .filter(|(a, c)| *a + c.size <= b.end())
            .map(|(_, c)| c.size)
            .sum()
    }

    fn chain(&self, first: BlockId) -> impl Iterator<Item = BlockId> + '_ {
        std::iter::successors(Some(first), move |&id| {
            let n = self.blocks[id].next;
            (n != NIL).then_some(n)
        })
    }

    fn chain_bytes(&self, first: BlockId) -> u64 {
        self.chain(first).map(|id| self.blocks[id].size).sum()
    }

    fn block_info(&self, id: BlockId) -> BlockInfo {
        let b = &self.blocks[id];
        let state = if b.allocated {
            BlockState::Allocated
        } else if b.waits() {
            BlockState::PendingEvents
        } else if b.moved {
            BlockState::Moved
        } else if b.releasing {
            BlockState::Releasing
        } else if b.mapped {
            BlockState::Free
        } else {
            BlockState::Unmapped
        };
        BlockInfo {
            addr: b.addr,
            size: b.size,
            requested: b.requested,
            state,
        }
    }

    /// Checks every invariant of the module documentation; the error says which one broke.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        let snap = self.snapshot();
        for seg in &snap.segments {
            check_segment(seg)?;
        }
        check_no_overlap(&snap.segments)?;
        self.check_indexes()?;
        self.check_expandable_mapping()?;
        self.check_moved()?;
        let (got, want) = (snap.recorded(), snap.recompute());
        if got != want {
            return Err(InvariantError::new(
                Invariant::Statistics,
                format!("statistics {got:?} differ from the snapshot's {want:?}"),
            ));
        }
        let reserved = self.stats.reserved_bytes.0[0].current as u64;
        if reserved != self.reserved + self.strays {
            return Err(InvariantError::new(
                Invariant::Reserved,
                format!(
                    "reserved_bytes {reserved} != held bytes {} + stray pages {}",
                    self.reserved, self.strays
                ),
            ));
        }
        let releasing: u64 = self
            .blocks
            .iter()
            .filter(|(_, b)| b.releasing && !b.moved)
            .map(|(_, b)| b.size)
            .sum();
        if releasing != self.releasing_bytes {
            return Err(InvariantError::new(
                Invariant::Reserved,
                format!(
                    "releasing_bytes {} != the releasing blocks' {releasing} (moved ones aside)",
                    self.releasing_bytes
                ),
            ));
        }
        self.check_pinning()?;
        self.check_captures()?;
        let counted = self.blocks.len();
        let chained: usize = snap.segments.iter().map(|s| s.blocks.len()).sum();
        if counted != chained {
            return Err(InvariantError::new(
                Invariant::Reachable,
                format!("{counted} blocks exist but {chained} are reachable from segments"),
            ));
        }
        Ok(())
    }

    /// The units [`Core::pinning`] lists hold exactly the pinned bytes of [`Core::excess`],
    /// each beside a block in use and none wholly free.
    fn check_pinning(&self) -> Result<(), InvariantError> {
        let units = self.pinning();
        let pinned: u64 = units.iter().map(|u| u.pinned).sum();
        let e = self.excess();
        if pinned != e.pinned {
            return Err(InvariantError::new(
                Invariant::Pinning,
                format!("pinning lists {pinned} bytes, the breakdown {}", e.pinned),
            ));
        }
        match units
            .iter()
            .find(|u| u.holders == 0 || u.pinned == 0 || u.pinned >= u.size)
        {
            Some(u) => Err(InvariantError::new(
                Invariant::Pinning,
                format!("pinned unit {u:?} is empty, wholly free or held by nothing"),
            )),
            None => Ok(()),
        }
    }

    fn check_indexes(&self) -> Result<(), InvariantError> {
        let mut free = 0;
        let mut unmapped = 0;
        for (_, b) in self.blocks.iter() {
            let idle = !b.allocated && !b.waits() && !b.releasing;
            if b.moved && !b.releasing {
                return Err(InvariantError::new(
                    Invariant::Index,
                    format!("moved block {:#x} is not releasing", b.addr),
                ));
            }
            if b.releasing && (b.allocated || !b.mapped || !b.is_expandable()) {
                return Err(InvariantError::new(
                    Invariant::Index,
                    format!(
                        "releasing block {:#x} is allocated, unmapped or fixed",
                        b.addr
                    ),
                ));
            }
            if idle && b.mapped {
                free += 1;
            } else if idle {
                unmapped += 1;
            } else if !b.mapped {
                return Err(InvariantError::new(
                    Invariant::Index,
                    format!("block {:#x} is in use but unmapped", b.addr),
                ));
            }
            if idle && b.mark != super::block::NO_MARK {
                return Err(InvariantError::new(
                    Invariant::Index,
                    format!("free block {:#x} still carries a policy mark", b.addr),
                ));
            }
            if b.size % crate::sizes::MIN_BLOCK != 0 {
                return Err(InvariantError::new(
                    Invariant::Index,
                    format!(
                        "block {:#x} has size {} (not a multiple of 512)",
                        b.addr, b.size
                    ),
                ));
            }
        }
        let indexed = self.small.free_len() + self.large.free_len();
        let indexed_unmapped = self.small.unmapped_len() + self.large.unmapped_len();
        if indexed != free || indexed_unmapped != unmapped {
            return Err(InvariantError::new(Invariant::Index, format!(
                "index holds {indexed} free / {indexed_unmapped} unmapped blocks, blocks say {free} / {unmapped}"
            )));
        }
        Ok(())
    }

    fn check_expandable_mapping(&self) -> Result<(), InvariantError> {
        for (id, b) in self
            .blocks
            .iter()
            .filter(|(_, b)| b.is_expandable() && b.mapped)
        {
            let seg = self.segments[b.segment as usize].as_ref().ok_or_else(|| {
                InvariantError::new(Invariant::Mapping, "block of a released segment")
            })?;
            let slept = self.asleep() && self.slept_covers(id);
            // A moved block's addresses are in `moved`, all of them or (after a failed unmap)
            // those still mapped: `check_moved` checks where every moved range lies.
            if !(seg.is_mapped(b.addr, b.size) || slept || b.moved) {
                return Err(InvariantError::new(
                    Invariant::Mapping,
                    format!("mapped block {:#x}+{} is not fully mapped", b.addr, b.size),
                ));
            }
        }
        Ok(())
    }

    /// Every moved range of a segment lies inside a moved block of that segment (no address
    /// stays mapped to a page another block holds once its block is done).
    fn check_moved(&self) -> Result<(), InvariantError> {
        let moved: Vec<(u32, u64, u64)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.moved)
            .map(|(_, b)| (b.segment, b.addr, b.end()))
            .collect();
        for (i, seg) in self.segments.iter().enumerate() {
            let Some(seg) = seg else { continue };
            for (&a, &n) in &seg.moved {
                let inside =
                    |&(s, lo, hi): &(u32, u64, u64)| s as usize == i && lo <= a && a + n <= hi;
                if !moved.iter().any(inside) {
                    return Err(InvariantError::new(
                        Invariant::Mapping,
                        format!("moved range {a:#x}+{n} lies in no moved block"),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn check_segment(seg: &SegmentInfo) -> Result<(), InvariantError> {
    let mut at = seg.addr;
    let mut prev_free = false;
    let mut prev_unmapped = false;
    for b in &seg.blocks {
        if b.addr != at {
            return Err(InvariantError::new(
                Invariant::Tiling,
                format!(
                    "segment {:#x}: block at {:#x}, expected {:#x}",
                    seg.addr, b.addr, at
                ),
            ));
        }
        let free = b.state == BlockState::Free;
        if free && prev_free {
            return Err(InvariantError::new(
                Invariant::Merged,
                format!(
                    "segment {:#x}: two free neighbours at {:#x}",
                    seg.addr, b.addr
                ),
            ));
        }
        let unmapped = b.state == BlockState::Unmapped;
        if unmapped && prev_unmapped {
            return Err(InvariantError::new(
                Invariant::Merged,
                format!(
                    "segment {:#x}: two unmapped neighbours at {:#x}",
                    seg.addr, b.addr
                ),
            ));
        }
        prev_free = free;
        prev_unmapped = unmapped;
        at += b.size;
    }
    if at != seg.addr + seg.size {
        return Err(InvariantError::new(
            Invariant::Tiling,
            format!(
                "segment {:#x}: blocks end at {:#x}, segment at {:#x}",
                seg.addr,
                at,
                seg.addr + seg.size
            ),
        ));
    }
    Ok(())
}

fn check_no_overlap(segments: &[SegmentInfo]) -> Result<(), InvariantError> {
    for w in segments.windows(2) {
        if w[0].addr + w[0].size > w[1].addr {
            return Err(InvariantError::new(
                Invariant::Overlap,
                format!("segments {:#x} and {:#x} overlap", w[0].addr, w[1].addr),
            ));
        }
    }
    Ok(())
}

impl<D: Device> Core<D> {
    /// Whether block `id`, given by a policy's `place` or `grow` for `req`, may be handed out:
    /// it exists, is neither allocated, unmapped nor waiting for other streams, belongs to the
    /// request's pool and stream, and holds the request; in debug builds also that it is in no
    /// free index (a policy takes the block it places out of the index). A few field reads on
    /// every allocation, so that no policy (one written outside the crate included) hands out a
    /// block another stream may still use, or one too small.
    pub(crate) fn check_placed(&self, id: BlockId, req: &Request) -> Result<(), AllocError> {
        let broke = |why| Err(AllocError::PolicyBroke { block: id, why });
        let Some(b) = self.blocks.get(id) else {
            return broke("no such block");
        };
        if b.allocated {
            return broke("it is allocated");
        }
        if !b.mapped {
            return broke("it is unmapped");
        }
        if b.releasing {
            return broke("its pages are being released");
        }
        if b.event_count > 0 || !b.stream_uses.is_empty() {
            return broke("it waits for other streams' work");
        }
        if b.stream != req.stream {
            return broke("it belongs to another stream");
        }
        if b.pool != req.pool {
            return broke("it belongs to the other pool");
        }
        if b.size < req.size {
            return broke("it is smaller than the request");
        }
        // A block left in the index is caught by `check_invariants` (an allocated block in the
        // index); searching the index on every allocation is left to debug builds.
        if cfg!(debug_assertions) && self.free_index(b.pool).contains(b) {
            return broke("it is still in the free index");
        }
        Ok(())
    }
}
