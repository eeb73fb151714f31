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
//! `Policy::release_pinned`): it waits for the device and copies the live bytes on the device.
//!
//! # Order of work
//!
//! It waits for the device (no work queued earlier may still use the pages; counted in
//! `num_sync_all_streams` and `device_waits`), unmaps the releasing blocks, whose events have
//! completed with it (`releasing`: the old addresses of moved pages among them, `moving`, so
//! that no page a chunk here holds is still mapped elsewhere when the chunk is released; the
//! bytes those unmaps give back count in the return value), and, when allocated blocks lie in
//! the chunks, reserves a *scratch* range of virtual addresses as large as the largest chunk
//! to make again.
//! Then, chunk by chunk: it creates a physical allocation for each run of kept pages; maps
//! those whose runs hold allocated blocks into the scratch range (at their offsets in the
//! chunk) and makes them accessible to this device; enqueues on the pool's copy stream one
//! device-to-device copy per stretch of allocated blocks, from the chunk to the scratch range;
//! waits for them (one `device_waits` for each chunk whose bytes are copied, and one more for
//! the device after a failed wait); unmaps them from the scratch range; unmaps
//! and releases the old chunk, and maps the new allocations at their runs' addresses (the
//! pool's map hooks see the old chunk go and the new ones come, never the scratch range). The
//! bytes copied are whole blocks (a caller may use its block's rounding); those of blocks
//! waiting for events are not copied. Then the scratch range is freed and the free pages
//! become unmapped blocks. No host memory is used.
//!
//! The driver calls on the scratch range are not map or unmap operations of the pool's
//! statistics (`calls.maps`, `calls.unmaps` count chunks): a chunk made again counts one unmap
//! and one map per kept run, as if the pages had moved in place.
//!
//! # Failures
//!
//! Each chunk is made again or left as it was; what fails in one does not stop the others.
//!
//! - A failed device wait, copy-stream creation or scratch reservation leaves every chunk as
//!   it was and is returned.
//! - A moved block still releasing after the wait (its unmap, or the query of its event,
//!   failed; tried again at the next poll) leaves every chunk as it was (which chunks hold its
//!   pages is not known), and nothing is returned but the bytes the other unmaps gave back.
//! - A chunk whose kept runs cannot be created (the device has no room; this is how out of
//!   memory shows) stays as it was, bytes included. The runs are created before the old chunk
//!   is released, so for a moment the device holds up to one chunk's kept pages more than the
//!   pool counts against its limit (never more than the device has).
//! - A failed map into the scratch range, grant of access there, copy enqueue or wait for the
//!   copies leaves the chunk as it was, bytes included: the new allocations are unmapped from
//!   the scratch range and released (after a failed wait, only once a device-wide wait
//!   returned, whatever it returns, so that no copy still writes them). So does an unmap of
//!   the old chunk the driver refuses.
//! - A new allocation whose unmap from the scratch range fails stays mapped there, kept in its
//!   segment's stray pages (`stuck`, counted against the limit, unmapped and released at the
//!   segment's next map or unmap); its chunk stays as it was, and the scratch range, which
//!   cannot be freed while it is mapped, is freed again at the next re-paging or when the
//!   pool is dropped.
//! - A release the driver refuses (of the old chunk once unmapped, or of new allocations given
//!   up) leaves a stray of the segment (`leaked`, counted against the limit, released again at
//!   its next map or unmap); the chunk is made again all the same. A scratch range the driver
//!   refuses to free is kept (`Core::scratch_left`) and freed at the next re-paging or when the
//!   pool is dropped.
//! - Once the old chunk is released, the live bytes are only in the new allocations. One whose
//!   map at its run's address (or grant of access) fails is mapped again, the same allocation;
//!   when that fails too it is released, its live blocks' bytes are lost, the error is
//!   returned, and a fresh allocation is mapped at the run's addresses, so that the blocks over
//!   them stay mapped as the core's invariants say (when that fails as well, the addresses
//!   stay unmapped and so do the invariants not hold there; when the unmap that follows a
//!   refused grant of access fails, it stays mapped there without access, a stray like the
//!   above). This is neither out of memory nor possible but through two driver failures in a
//!   row.
//!
//! A chunk left as it was is not reported (the return value is the bytes given back) and is
//! tried again at the next re-paging.
//!
//! # Conditions
//!
//! Nothing is done during a capture (it waits and frees device memory) or while the pool
//! sleeps, and the chunks of shareable segments are left alone (a process that imported one
//! would keep the old physical allocation). The live bytes move while the calling thread waits
//! in the allocator: a kernel that another thread launches meanwhile on memory of this pool may
//! run while its pages are unmapped (a fault) or write bytes after they were copied (lost), so
//! a policy uses it only where its owner says one thread launches work at a time (the
//! `default` policy's `repage_under_cap` key).
//!
//! Invariants: those of the core (but after the three failures in a row above). Afterwards no
//! chunk holds a whole free page of a free block, but for the chunks left as they were after a
//! failure.

use super::block::BlockId;
use super::segment::{Chunk, Mapper};
use super::Core;
use cudalloc_sys::{Device, DeviceError, PageHandle, StreamId};

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

/// Where live bytes are copied while their chunk is made again: the scratch range (address,
/// bytes) and the copy stream.
#[derive(Clone, Copy, Debug)]
struct Scratch {
    va: u64,
    size: u64,
    stream: StreamId,
}

impl<D: Device> Core<D> {
    /// Gives back every whole page of every free block, making the chunks they share with
    /// kept pages again from those pages (see the module docs). Returns the bytes given back,
    /// releasing blocks unmapped after the wait included (0: nothing to give back, during a
    /// capture, or asleep).
    pub fn repage_pinned(&mut self) -> Result<u64, DeviceError> {
        if self.capturing() || self.asleep() {
            return Ok(0);
        }
        self.release_scratch();
        let plan = self.repage_plan();
        if plan.chunks.is_empty() {
            return Ok(0);
        }
        self.count_sync_all_streams();
        self.stats.device_waits += 1;
        self.device.synchronize_device()?;
        let (plan, polled) = match self.finish_behind() {
            None => (plan, 0),
            // Which chunks hold a moved block's pages is not known: none is made again.
            Some(polled) if self.holds_moved() => return Ok(polled),
            Some(polled) => (self.repage_plan(), polled),
        };
        let live = self.live_stretches(&plan.chunks);
        let scratch = if live.is_empty() {
            None
        } else {
            Some(self.open_scratch(&plan.chunks)?)
        };
        let (mut given, mut error) = (0, None);
        for t in &plan.chunks {
            let Ok((freed, failed)) = self.repage_chunk(t, scratch, &live) else {
                continue; // left as it was, bytes included
            };
            given += freed;
            if let Some(e) = failed {
                error.get_or_insert(e);
            }
        }
        if let Some(s) = scratch {
            self.scratch_left.push((s.va, s.size));
            self.release_scratch();
        }
        self.unmap_free_runs(&plan.blocks);
        error.map_or(Ok(polled + given), Err)
    }

    /// After the device wait: unmaps the releasing blocks, whose events have completed
    /// ([`Core::poll_releasing`]). Why: a moved block's old addresses map pages that chunks
    /// here hold now (`moving`), and a page released while it is mapped there too keeps its
    /// memory on the device, which the pool would no longer count, until that unmap. Returns
    /// the bytes given back, `None` when no block was releasing (nothing changed).
    fn finish_behind(&mut self) -> Option<u64> {
        if self.releasing.is_empty() {
            return None;
        }
        let before = self.reserved();
        self.poll_releasing();
        Some(before.saturating_sub(self.reserved()))
    }

    /// True while a moved block is releasing still (`moving`).
    fn holds_moved(&self) -> bool {
        self.releasing.iter().any(|&(_, id)| self.blocks[id].moved)
    }

    /// Frees the scratch ranges left reserved (a page was stuck in them); those still refused
    /// stay for the next time.
    pub(crate) fn release_scratch(&mut self) {
        let dev = &self.device;
        self.scratch_left
            .retain(|&(va, n)| dev.unreserve(va, n).is_err());
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

    /// The stretches (address, bytes) of allocated blocks lying in `chunks` (sorted by
    /// address), in address order, each inside one chunk; neighbouring blocks make one stretch.
    /// Whole blocks, not the bytes asked for: a caller may use its block's rounding.
    fn live_stretches(&self, chunks: &[Target]) -> Vec<(u64, u64)> {
        let mut live: Vec<(u64, u64)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.allocated)
            .map(|(_, b)| (b.addr, b.size))
            .collect();
        live.sort_unstable();
        let mut stretches: Vec<(u64, u64)> = Vec::new();
        for t in chunks {
            let (lo, hi) = (t.at, t.at + t.size);
            let first = live.partition_point(|&(a, n)| a + n <= lo);
            let mut last = None; // the stretch of this chunk before, by index
            for &(a, n) in live[first..].iter().take_while(|&&(a, _)| a < hi) {
                let (from, to) = (a.max(lo), (a + n).min(hi));
                match last.map(|i: usize| &mut stretches[i]) {
                    Some((s, len)) if *s + *len == from => *len += to - from,
                    _ => {
                        last = Some(stretches.len());
                        stretches.push((from, to - from));
                    }
                }
            }
        }
        stretches
    }

    /// The copy stream, and a scratch range as large as the largest of `chunks`.
    fn open_scratch(&mut self, chunks: &[Target]) -> Result<Scratch, DeviceError> {
        let stream = self.copy_stream()?;
        let size = chunks.iter().map(|t| t.size).max().unwrap_or(0);
        let va = self.device.reserve(size)?;
        Ok(Scratch { va, size, stream })
    }

    /// Makes chunk `t` again from its kept runs, its stretches of `live` copied into them
    /// through `scratch` (see the module docs), and counts it: the bytes given back and the
    /// error that left a kept run unmapped. `Err`: the chunk is as it was.
    fn repage_chunk(
        &mut self,
        t: &Target,
        scratch: Option<Scratch>,
        live: &[(u64, u64)],
    ) -> Result<(u64, Option<DeviceError>), DeviceError> {
        let seg = self.segments[t.seg].as_mut().expect("a chunk's segment");
        let (before, pool) = (seg.stray_bytes(), seg.pool);
        let first = live.partition_point(|&(a, _)| a < t.at);
        let end = live.partition_point(|&(a, _)| a < t.at + t.size);
        let done = seg.create_runs(&self.device, &t.keep).and_then(|pages| {
            if first < end {
                let s = scratch.expect("a scratch range for live bytes");
                self.move_live(t, &pages, s, &live[first..end])?;
            }
            let seg = self.segments[t.seg].as_mut().expect("a chunk's segment");
            let m = Mapper {
                dev: &self.device,
                peers: &self.peers,
                hooks: &self.hooks,
            };
            seg.swap_in(&m, t.at, &t.keep, &pages)
        });
        self.track_strays(t.seg, before);
        let done = done?;
        let freed = t.size - done.bytes;
        self.sub_reserved(freed);
        self.reserved_shrank(pool, freed);
        self.stats.calls.unmaps += 1;
        self.stats.calls.maps += done.pages;
        Ok((freed, done.error))
    }

    /// Copies `live` (stretches inside chunk `t`) into `pages` (one per kept run of `t`)
    /// through the scratch range, and unmaps them from it again. On failure `pages` are
    /// released (those stuck in the scratch range kept as strays) and the chunk is as it was.
    fn move_live(
        &mut self,
        t: &Target,
        pages: &[PageHandle],
        s: Scratch,
        live: &[(u64, u64)],
    ) -> Result<(), DeviceError> {
        let mut mapped = Vec::new();
        let staged = self.stage_live(t, pages, s, live, &mut mapped);
        let waited = self.wait_stream(s.stream);
        if waited.is_err() {
            // A copy may still write the pages: they are released only after the device.
            self.stats.device_waits += 1;
            let _ = self.device.synchronize_device();
        }
        let seg = self.segments[t.seg].as_mut().expect("a chunk's segment");
        let (mut stuck, mut unmapped) = (Vec::new(), Ok(()));
        for &(va, len, handle) in &mapped {
            if let Err(e) = self.device.unmap(va, len) {
                // Unmapped and released at the segment's next map or unmap.
                seg.stuck.push((va, Chunk { size: len, handle }));
                stuck.push(handle);
                unmapped = unmapped.and(Err(e));
            }
        }
        let Err(failed) = staged.and(waited).and(unmapped) else {
            return Ok(());
        };
        let (runs, unstuck): (Vec<_>, Vec<_>) = t
            .keep
            .iter()
            .zip(pages)
            .filter(|(_, h)| !stuck.contains(h))
            .unzip();
        seg.release_all(&self.device, &runs, &unstuck);
        Err(failed)
    }

    /// Maps into the scratch range the pages of `t`'s runs that hold `live` bytes (listing
    /// each in `mapped` as address, bytes and page), makes them accessible to this device and
    /// enqueues the copies of `live` into them; stops at the first failure.
    fn stage_live(
        &self,
        t: &Target,
        pages: &[PageHandle],
        s: Scratch,
        live: &[(u64, u64)],
        mapped: &mut Vec<(u64, u64, PageHandle)>,
    ) -> Result<(), DeviceError> {
        let dev = &self.device;
        for (&(run, len), &handle) in t.keep.iter().zip(pages) {
            if !live.iter().any(|&(a, _)| run <= a && a < run + len) {
                continue;
            }
            let va = s.va + (run - t.at);
            dev.map(va, len, handle)?;
            mapped.push((va, len, handle));
            dev.set_access(va, len, &[])?;
        }
        for &(addr, len) in live {
            dev.copy_device_async(s.va + (addr - t.at), addr, len, s.stream)?;
        }
        Ok(())
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
