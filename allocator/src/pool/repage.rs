//! Re-paging: the free pages of chunks that live blocks keep mapped go back to the device.
//!
//! A chunk (one physical allocation, `segment`) goes back to the device only whole, so a chunk
//! of many pages that one live block keeps mapped keeps its free pages mapped too.
//! [`Core::repage_pinned`] gives back every whole page of every free block of the pool's
//! expandable segments: each chunk such a page lies in is made again at the same addresses
//! from its *kept* pages only (those not lying wholly in a free block: they hold live bytes, or
//! bytes of blocks waiting for events), one chunk per run of consecutive kept pages. Every block
//! keeps its address, and the pages mapped afterwards are those single-page chunks would have
//! kept. It is a last resort (a policy calls it where a device wait is allowed,
//! `Policy::release_pinned`): it waits for the device and copies live bytes through host memory.
//!
//! # Order of work
//!
//! It waits for the device (no work queued earlier may still use the pages; counted in
//! `num_sync_all_streams` and `device_waits`), then enqueues on the pool's copy stream the
//! copies of the allocated blocks' bytes that lie in those chunks into a pinned host buffer (the
//! one an offloading sleep keeps when it is large enough, else one made for this and freed
//! after), and waits for them. Then, chunk by chunk: it creates a chunk for each run of kept
//! pages, unmaps and releases the old chunk, maps the new ones at their addresses and enqueues
//! the copies back into them. It waits for the copies back before it returns (work enqueued
//! afterwards on any stream finds the bytes in place), and the free pages become unmapped
//! blocks.
//!
//! # Failures
//!
//! A chunk whose kept runs cannot be created (the device has no room) or whose unmap the driver
//! refuses stays as it was, bytes included. The kept runs are created before the old chunk is
//! released, so for a moment the device holds up to one chunk's kept pages more than the pool
//! counts against its limit (never more than the device has). A kept run the driver refuses to
//! map (twice, the second time a physical allocation created anew) stays unmapped and the error
//! is returned: the bytes of the live blocks in it are lost, as they are when a copy back fails
//! twice; neither is out of memory, and neither happens but through driver failures.
//!
//! # Conditions
//!
//! Nothing is done during a capture (it waits and frees device memory) or while the pool
//! sleeps, and the chunks of shareable segments are left alone (a process that imported one
//! would keep the old physical allocation). The live bytes move while the calling thread waits
//! in the allocator: a kernel that another thread launches meanwhile on memory of this pool may
//! run while its pages are unmapped (a fault) or write bytes that the copy back overwrites, so
//! a policy uses it only where its owner says one thread launches work at a time (the
//! `default` policy's `repage_under_cap` key).
//!
//! Invariants: those of the core. Afterwards no chunk holds a whole free page of a free block,
//! but for the chunks left as they were after a failure.

use super::block::BlockId;
use super::segment::Mapper;
use super::sleep::{pieces, Copy};
use super::Core;
use cudalloc_sys::{Device, DeviceError, HostPtr, StreamId};

/// One chunk to make again from its kept runs.
#[derive(Debug)]
struct Target {
    /// Index of its segment.
    seg: usize,
    /// Its address.
    at: u64,
    /// Its bytes.
    size: u64,
    /// The runs of consecutive pages to keep (address, bytes), ascending.
    keep: Vec<(u64, u64)>,
}

/// What re-paging does: the chunks to make again and the free blocks whose whole pages (a
/// range from the first to past the last) go back.
#[derive(Debug, Default)]
struct Plan {
    chunks: Vec<Target>,
    blocks: Vec<(BlockId, u64, u64)>,
}

/// Where the live bytes wait while their chunks are made again: the host buffer, the copy
/// stream, and whether the buffer was made for this (and is freed after).
#[derive(Clone, Copy)]
struct Staged {
    host: HostPtr,
    stream: StreamId,
    made: bool,
}

impl<D: Device> Core<D> {
    /// Gives back every whole page of every free block, making the chunks they share with
    /// kept pages again from those pages (see the module docs). Returns the bytes given back (0:
    /// nothing to give back, during a capture, or asleep).
    pub fn repage_pinned(&mut self) -> Result<u64, DeviceError> {
        if self.capturing() || self.asleep() {
            return Ok(0);
        }
        let plan = self.repage_plan();
        if plan.chunks.is_empty() {
            return Ok(0);
        }
        self.count_sync_all_streams();
        self.stats.device_waits += 1;
        self.device.synchronize_device()?;
        let copies = self.live_pieces(&plan.chunks);
        let staged = self.stage_out(&copies)?;
        let (mut given, mut error) = (0, None);
        for t in &plan.chunks {
            let Ok((freed, failed)) = self.repage_chunk(t) else {
                continue; // left as it was, bytes included
            };
            given += freed;
            let back = staged.map_or(Ok(()), |s| self.copy_back(s, &copies, t));
            if let Some(e) = failed.or(back.err()) {
                error.get_or_insert(e);
            }
        }
        let finished = staged.map_or(Ok(()), |s| self.finish_staging(s));
        self.unmap_free_runs(&plan.blocks);
        match error.or(finished.err()) {
            Some(e) => Err(e),
            None => Ok(given),
        }
    }

    /// The free blocks with whole pages, and the chunks those pages lie in with the runs of
    /// pages of each to keep (pages lying wholly in no free block).
    fn repage_plan(&self) -> Plan {
        let mut plan = Plan::default();
        let free = self.small.all_free().chain(self.large.all_free());
        for id in free {
            let b = &self.blocks[id];
            let seg = self
                .segments
                .get(b.segment as usize)
                .and_then(Option::as_ref);
            // An exported chunk's importers would keep the old physical allocation.
            let Some(seg) = seg.filter(|s| !s.shareable) else {
                continue;
            };
            let (lo, hi) = (seg.page_ceil(b.addr), seg.page_floor(b.end()));
            if lo < hi {
                plan.blocks.push((id, lo, hi));
            }
        }
        // Free ranges by (segment, address): disjoint, so sorted by start they are sorted.
        let mut ranges: Vec<(usize, u64, u64)> = plan
            .blocks
            .iter()
            .map(|&(id, lo, hi)| (self.blocks[id].segment as usize, lo, hi))
            .collect();
        ranges.sort_unstable();
        let is_free = |seg: usize, p: u64| {
            let i = ranges.partition_point(|&r| (r.0, r.1) <= (seg, p));
            i > 0 && ranges[i - 1].0 == seg && p < ranges[i - 1].2
        };
        let mut last = None;
        for &(i, lo, hi) in &ranges {
            let seg = self.segments[i].as_ref().expect("a free block's segment");
            let first = seg.chunks.range(..=lo).next_back().map_or(lo, |(&a, _)| a);
            for (&at, c) in seg.chunks.range(first..hi) {
                if at + c.size <= lo || last == Some((i, at)) {
                    continue;
                }
                last = Some((i, at));
                let mut keep: Vec<(u64, u64)> = Vec::new();
                for p in (at..at + c.size).step_by(seg.page as usize) {
                    if is_free(i, p) {
                        continue;
                    }
                    match keep.last_mut() {
                        Some((a, n)) if *a + *n == p => *n += seg.page,
                        _ => keep.push((p, seg.page)),
                    }
                }
                plan.chunks.push(Target {
                    seg: i,
                    at,
                    size: c.size,
                    keep,
                });
            }
        }
        plan.chunks.sort_unstable_by_key(|t| t.at);
        plan
    }

    /// The parts of the allocated blocks lying in `chunks` (sorted by address), in address
    /// order, with their offsets in a host buffer laid end to end. Whole blocks, not the bytes
    /// asked for: a caller may use its block's rounding.
    fn live_pieces(&self, chunks: &[Target]) -> Vec<Copy> {
        let mut live: Vec<(u64, u64)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.allocated)
            .map(|(_, b)| (b.addr, b.size))
            .collect();
        live.sort_unstable();
        let mut copies = Vec::new();
        let mut offset = 0;
        for t in chunks {
            let (lo, hi) = (t.at, t.at + t.size);
            let first = live.partition_point(|&(a, n)| a + n <= lo);
            for &(a, n) in live[first..].iter().take_while(|&&(a, _)| a < hi) {
                let (from, to) = (a.max(lo), (a + n).min(hi));
                copies.push(Copy {
                    addr: from,
                    offset,
                    len: to - from,
                });
                offset += to - from;
            }
        }
        copies
    }

    /// Copies `copies` into the host buffer on the copy stream and waits for them; `None`
    /// when there is nothing to copy. On failure waits for what was enqueued (best effort).
    fn stage_out(&mut self, copies: &[Copy]) -> Result<Option<Staged>, DeviceError> {
        let Some(last) = copies.last() else {
            return Ok(None);
        };
        let made = self
            .host_buffer
            .is_none_or(|(_, n)| n < last.offset + last.len);
        let stream = self.copy_stream()?;
        let host = self.host_buffer(last.offset + last.len)?;
        let staged = Staged { host, stream, made };
        let enqueued = copies.iter().try_for_each(|c| {
            self.device
                .copy_to_host_async(host + c.offset, c.addr, c.len, stream)
        });
        let waited = self.wait_stream(stream);
        enqueued.and(waited).map(|()| Some(staged))
    }

    /// Makes chunk `t` again from its kept runs (`ExpSegment::repage`) and counts it: the bytes
    /// given back and the error that left a kept run unmapped. `Err`: the chunk is as it was.
    fn repage_chunk(&mut self, t: &Target) -> Result<(u64, Option<DeviceError>), DeviceError> {
        let seg = self.segments[t.seg].as_mut().expect("a chunk's segment");
        let (before, pool) = (seg.stray_bytes(), seg.pool);
        let m = Mapper {
            dev: &self.device,
            peers: &self.peers,
            hooks: &self.hooks,
        };
        let done = seg.repage(&m, t.at, &t.keep);
        self.track_strays(t.seg, before);
        let done = done?;
        let freed = t.size - done.bytes;
        self.sub_reserved(freed);
        self.reserved_shrank(pool, freed);
        self.stats.calls.unmaps += 1;
        self.stats.calls.maps += done.pages;
        Ok((freed, done.error))
    }

    /// Enqueues the copies back into those of chunk `t`'s kept runs that are mapped again,
    /// each tried twice, all of them whatever fails (a run left unmapped gets none: its bytes
    /// are lost, and `repage_chunk` returned the error); the first failure is returned.
    fn copy_back(&self, s: Staged, copies: &[Copy], t: &Target) -> Result<(), DeviceError> {
        let dev = &self.device;
        let seg = self.segments[t.seg].as_ref().expect("a chunk's segment");
        let mut first = None;
        for &(run, len) in t
            .keep
            .iter()
            .filter(|(run, _)| seg.chunks.contains_key(run))
        {
            for (addr, offset, n) in pieces(copies, run, run + len) {
                let copy = || dev.copy_to_device_async(addr, s.host + offset, n, s.stream);
                if let Err(e) = copy().or_else(|_| copy()) {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Waits for the copies back, and frees the host buffer when it was made for them.
    fn finish_staging(&mut self, s: Staged) -> Result<(), DeviceError> {
        if s.made {
            self.release_host_buffer()
        } else {
            self.wait_stream(s.stream)
        }
    }

    /// Turns the pages of `blocks` (free block, first and past the last whole page) that no
    /// chunk covers any more into unmapped blocks, one device free each block.
    fn unmap_free_runs(&mut self, blocks: &[(BlockId, u64, u64)]) {
        for &(id, lo, hi) in blocks {
            let seg = self.segments[self.blocks[id].segment as usize]
                .as_ref()
                .expect("a free block's segment");
            let runs = seg.unmapped_runs(lo, hi);
            if runs.is_empty() {
                continue;
            }
            // Each later run lies in the mapped block after the one turned unmapped before it.
            let mut at = id;
            for (k, &(addr, len)) in runs.iter().enumerate() {
                if k > 0 {
                    at = self.blocks[at].next;
                }
                at = self.turn_unmapped(at, addr, len);
            }
            self.stats.num_device_free += 1;
        }
    }
}
