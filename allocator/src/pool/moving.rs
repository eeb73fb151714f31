//! Page moving: a growth maps the pages of releasing blocks of its own stream at its own
//! addresses instead of creating pages while theirs are on their way back.
//!
//! A releasing block's pages wait for the work its stream queued before the release
//! (`releasing`); while the device runs behind, a growth beside them creates pages of its own,
//! and the device holds both. [`Core::map_block_moving`] maps the pages of such blocks (the
//! same physical allocations, mapped at a second address) where the growth needs them: every
//! use of the growth comes after the queued work in its stream's order, as a use of a cached
//! block would, so nothing waits. The block they came from is *moved*: still releasing, its
//! addresses still mapped to those pages (work queued before its release may still use them
//! there), but the pages are the growth's chunks now; once its event has completed its
//! addresses are unmapped and the pages stay ([`Core::finish_moved`]). A page's memory is held
//! once whichever address unmaps it first, and until both have: re-paging, which releases
//! chunks, unmaps moved blocks first, and makes no chunk again while one stays (`repage`).
//!
//! Only blocks of the growth's stream move (another stream's queued work is not ordered before
//! the growth's uses), whole chunks at a time, and none while a capture is underway (a graph
//! may be launched on another stream). A block whose pages moved only in part is split: the
//! rest stays releasing with an event of its own, recorded at the split (or, when that record
//! fails, is free again: its stream's order makes it safe to use).
//!
//! Invariants: a moved block is releasing and in an expandable segment; its addresses still
//! mapped are its segment's `moved` ranges inside it (all of them until a failed unmap left
//! some unmapped: the unmap is tried again at the next poll), and every `moved` range lies in a
//! moved block. It is never taken back into the cache, and its bytes count in neither
//! `Core::releasing_bytes` nor its segment's `mapped` bytes (the chunks its pages moved to
//! count them).

use super::block::{Block, BlockId};
use super::segment::{Mapper, Range};
use super::Core;
use cudalloc_sys::{Device, DeviceError};

impl<D: Device> Core<D> {
    /// [`Core::map_block`] that first maps the pages of releasing blocks of the block's stream
    /// (see the module docs) at the front of the bytes to map, and creates pages only for the
    /// rest. `Ok(None)`: the rest is out of memory; nothing changed (after another failure
    /// there, as [`Core::map_block`] says). When a move fails, its
    /// error is returned, and what was mapped (new pages, pages moved before the failure) is
    /// a free block.
    pub fn map_block_moving(
        &mut self,
        id: BlockId,
        size: u64,
        max_chunk: u64,
    ) -> Result<Option<BlockId>, DeviceError> {
        let donors = self.movable(id, size);
        let total: u64 = donors.iter().map(|&(_, n)| n).sum();
        let addr = self.blocks[id].addr;
        let seg = self.segments[self.blocks[id].segment as usize].as_ref();
        let len = seg
            .expect("block of a released segment")
            .page_ceil(addr + size)
            - addr;
        // The policy checked the limit with the moves it expected (`movable_bytes`); a capture
        // that began since may have taken them away.
        if self.over_limit(len.saturating_sub(total)) {
            return Ok(None);
        }
        if total == 0 {
            return self.map_block(id, size, max_chunk);
        }
        if total < size {
            // The new pages first: when they do not fit, nothing changed.
            self.split_unmapped_tail(id, total);
            let tail = self.blocks[id].next;
            let fresh = self.map_block(tail, size - total, max_chunk);
            if !matches!(fresh, Ok(Some(_))) {
                // Nothing mapped there (or, after a failed rollback, a part that is a free
                // block now): join what stays unmapped back.
                let next = self.blocks[id].next;
                if !self.blocks[next].mapped {
                    let removed = self.unindex_unmapped(id);
                    debug_assert!(removed);
                    self.try_merge(id, next);
                    self.index_unmapped(id);
                }
                return fresh;
            }
        }
        let to = self.blocks[id].segment as usize;
        let (moved, error) = self.move_pages(&donors, to, addr);
        let block = if moved.size > 0 {
            self.account_mapped(id, moved)
        } else {
            id
        };
        match error {
            Some(e) => Err(e),
            None => Ok(Some(block)),
        }
    }

    /// Bytes of the first `size` bytes of unmapped block `id` that [`Core::map_block_moving`]
    /// would map with moved pages (they need no new memory: a memory limit's check leaves them
    /// out).
    pub fn movable_bytes(&self, id: BlockId, size: u64) -> u64 {
        self.movable(id, size).iter().map(|&(_, n)| n).sum()
    }

    /// The releasing blocks whose pages a growth at unmapped block `id` may take, as (block,
    /// bytes from its start: whole chunks), newest release first, at most `size` bytes in all
    /// rounded up to the segment's pages; none during a capture (one the pool was told of, or
    /// one the device reports on the block's stream).
    fn movable(&self, id: BlockId, size: u64) -> Vec<(BlockId, u64)> {
        let b = &self.blocks[id];
        let target = self.segments[b.segment as usize]
            .as_ref()
            .expect("block of a released segment");
        let mut left = target.page_ceil(b.addr + size) - b.addr;
        let mut out = Vec::new();
        if self.releasing.is_empty()
            || self.capturing()
            || !matches!(self.device.is_capturing(b.stream), Ok(false))
        {
            return out;
        }
        for &(_, d) in self.releasing.iter().rev() {
            let donor = &self.blocks[d];
            if left == 0 {
                break;
            }
            if donor.moved || donor.stream != b.stream {
                continue;
            }
            let seg = self.segments[donor.segment as usize]
                .as_ref()
                .expect("block of a released segment");
            if seg.shareable != target.shareable {
                continue;
            }
            let mut take = 0;
            for (_, c) in seg.chunks.range(donor.addr..donor.end()) {
                if c.size % target.page != 0 || take + c.size > left {
                    break;
                }
                take += c.size;
            }
            if take > 0 {
                out.push((d, take));
                left -= take;
            }
        }
        out
    }

    /// Maps the first bytes of each donor's chunks (`movable`) end to end from `addr`, in order,
    /// into segment `to` (the one holding `addr`); stops at the first failure. Returns the range
    /// mapped (`ops`: pages moved) and the failure.
    fn move_pages(
        &mut self,
        donors: &[(BlockId, u64)],
        to: usize,
        addr: u64,
    ) -> (Range, Option<DeviceError>) {
        let mut done = Range {
            addr,
            size: 0,
            ops: 0,
        };
        for &(d, bytes) in donors {
            let (moved, ops, error) = self.move_donor(d, bytes, to, addr + done.size);
            done.size += moved;
            done.ops += ops;
            if error.is_some() {
                return (done, error);
            }
        }
        (done, None)
    }

    /// Moves the chunks of the first `bytes` of releasing block `d` to `at` onwards in segment
    /// `to`; the moved part of `d` becomes a moved block of its own. Returns the bytes mapped
    /// at `at`, the pages moved and the failure that stopped it.
    fn move_donor(
        &mut self,
        d: BlockId,
        bytes: u64,
        to: usize,
        at: u64,
    ) -> (u64, u64, Option<DeviceError>) {
        let (from, pool, start) = {
            let b = &self.blocks[d];
            (b.segment as usize, b.pool, b.addr)
        };
        let mut placed = 0; // bytes mapped at `at` onwards
        let mut out = 0; // bytes of `d` whose addresses map pages held elsewhere
        let mut ops = 0;
        let mut error = None;
        while out < bytes {
            let chunk = self.segments[from]
                .as_mut()
                .expect("live")
                .move_out(start + out);
            let m = Mapper {
                dev: &self.device,
                peers: &self.peers,
                hooks: &self.hooks,
            };
            let seg = self.segments[to].as_mut().expect("live");
            let strays = seg.stray_bytes();
            let mapped = seg.map_moved(&m, at + placed, chunk);
            // `map_moved` retries the segment's strays, and a failure may leave one.
            self.track_strays(to, strays);
            match mapped {
                Ok(()) => {
                    placed += chunk.size;
                    out += chunk.size;
                    ops += 1;
                    self.stats.pages_moved += 1;
                }
                Err((e, unmapped)) => {
                    if unmapped {
                        let seg = self.segments[from].as_mut().expect("live");
                        seg.move_back(start + out, chunk);
                    } else {
                        // Held by the stray now (counted by `track_strays`), not by `d`.
                        out += chunk.size;
                        self.sub_reserved(chunk.size);
                        self.reserved_shrank(pool, chunk.size);
                    }
                    error = Some(e);
                    break;
                }
            }
        }
        if out > 0 {
            self.mark_moved(d, out);
            self.reserved_shrank(pool, placed);
        }
        (placed, ops, error)
    }

    /// Makes the first `bytes` of releasing block `d` a moved block (keeping `d`'s id and
    /// event); the rest stays releasing with an event of its own ([`Core::split_releasing`]).
    fn mark_moved(&mut self, d: BlockId, bytes: u64) {
        if bytes < self.blocks[d].size {
            self.split_releasing(d, bytes);
        }
        self.blocks[d].moved = true;
        self.releasing_bytes -= bytes;
    }

    /// Splits releasing block `id` after its first `keep` bytes: the rest becomes a releasing
    /// block of its own, with an event recorded now on its stream (later than its old one, so
    /// it completes once that would have), or free again when that record fails.
    fn split_releasing(&mut self, id: BlockId, keep: u64) {
        let b = &self.blocks[id];
        let mut rest = Block::new(b.addr + keep, b.size - keep, b.stream, b.pool);
        rest.segment = b.segment;
        rest.prev = id;
        rest.next = b.next;
        rest.releasing = true;
        let stream = b.stream;
        let rid = self.blocks.insert(rest);
        let next = self.blocks[id].next;
        if next != super::block::NIL {
            self.blocks[next].prev = rid;
        }
        let b = &mut self.blocks[id];
        b.next = rid;
        b.size = keep;
        let recorded =
            self.take_event()
                .and_then(|ev| match self.device.record_event(ev, stream) {
                    Ok(()) => Ok(ev),
                    Err(e) => {
                        self.spare_events.push(ev);
                        Err(e)
                    }
                });
        match recorded {
            Ok(ev) => self.releasing.push((ev, rid)),
            Err(_) => {
                // Free again: its stream's order makes it safe to use.
                let r = &mut self.blocks[rid];
                r.releasing = false;
                self.releasing_bytes -= r.size;
                self.stats.taken_back_bytes += r.size;
                let next = r.next;
                self.try_merge(rid, next);
                self.insert_free(rid);
            }
        }
    }

    /// Unmaps the addresses of moved block `id`, whose event has completed (its pages stay:
    /// other chunks hold them); the block is unmapped then, merged with unmapped neighbours.
    /// After a failed unmap the block stays moved and releasing, for the caller to try again.
    pub(super) fn finish_moved(&mut self, id: BlockId) -> Result<(), DeviceError> {
        let (addr, size, seg_index) = {
            let b = &self.blocks[id];
            (b.addr, b.size, b.segment as usize)
        };
        let m = Mapper {
            dev: &self.device,
            peers: &self.peers,
            hooks: &self.hooks,
        };
        let seg = self.segments[seg_index].as_mut().expect("live segment");
        let (ops, error) = seg.unmap_moved(&m, addr, size);
        self.stats.calls.unmaps += ops;
        if let Some(e) = error {
            return Err(e);
        }
        let b = &mut self.blocks[id];
        b.releasing = false;
        b.moved = false;
        b.mapped = false;
        for side in [self.blocks[id].prev, self.blocks[id].next] {
            self.try_merge(id, side);
        }
        self.index_unmapped(id);
        Ok(())
    }
}
