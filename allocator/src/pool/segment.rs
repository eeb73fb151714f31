//! Expandable segments: one reserved virtual range whose pages are mapped on demand.
//!
//! A segment owns `size` bytes of virtual addresses starting at `va` and a set of *chunks*: one
//! physical allocation each, created, mapped and made accessible in one map operation, and
//! unmapped and released in one unmap operation. Under `torch-expandable` every chunk is exactly
//! one page (2 MiB in the small pool, 20 MiB in the large, as PyTorch does); under `default` a
//! chunk is any multiple of the device's granularity, so that growing by many pages costs one map.
//!
//! A segment made while `shareable_segments` is on creates its pages exportable
//! (`create_shareable_page`), so that [`crate::CachingAllocator::share`] can export the chunks
//! behind an allocation; `id` names the segment for as long as it lives, and no other segment
//! of the process ever has it.
//!
//! A chunk that live blocks keep mapped with free pages beside it can be made again from the
//! pages they touch, at the same addresses (`create_runs` and `swap_in`, for `pool::repage`).
//!
//! Every chunk mapped is announced to the pool's map hooks once it is accessible, and withdrawn
//! before its unmap ([`crate::hooks`]); a `stuck` chunk is not announced.
//!
//! A chunk's page may move to another segment (`pool::moving`): it leaves `chunks` (and
//! `mapped`) for the one it moves to, and its addresses here stay mapped, in `moved`, until they
//! are unmapped; the page is released by the chunk that holds it, never through `moved`.
//!
//! Invariants: chunks and moved ranges do not overlap, lie inside `va..va + size` and start and end
//! on page boundaries; `mapped` is the sum of the chunks' sizes. Pages a failed driver call left
//! behind (`leaked`: created or unmapped, not released; `stuck`: mapped without access, or mapped
//! at a re-paging's scratch range outside `va..va + size`, not unmapped) are outside `chunks` and
//! `mapped`, are retried at every map and unmap, and keep the range reserved until they are gone.

use crate::hooks::Hooks;
use crate::sizes::PoolKind;
use cudalloc_sys::{Device, DeviceError, PageHandle, StreamId};
use std::collections::BTreeMap;

/// One mapped physical allocation.
#[derive(Clone, Copy, Debug)]
pub struct Chunk {
    /// Bytes.
    pub size: u64,
    /// The physical allocation.
    pub handle: PageHandle,
}

/// What mapping and unmapping chunks needs besides the segment: the device, the peers given
/// access to every chunk, and the hooks told of each.
pub(crate) struct Mapper<'a, D> {
    pub dev: &'a D,
    pub peers: &'a [usize],
    pub hooks: &'a Hooks,
}

/// A reserved virtual range with chunks mapped into it.
#[derive(Debug)]
pub struct ExpSegment {
    /// The segment's id, unique in the process for as long as it runs.
    pub id: u64,
    /// Its pages are created exportable (`shareable_segments`).
    pub shareable: bool,
    /// First virtual address.
    pub va: u64,
    /// Reserved bytes.
    pub size: u64,
    /// Page size: mapping and unmapping work in multiples of it.
    pub page: u64,
    /// The stream whose blocks live here.
    pub stream: StreamId,
    /// The pool whose blocks live here.
    pub pool: PoolKind,
    /// Chunks by start address.
    pub chunks: BTreeMap<u64, Chunk>,
    /// Sum of chunk sizes.
    pub mapped: u64,
    /// Pages unmapped (or never mapped) whose release failed, to release again at the next
    /// map or unmap.
    pub leaked: Vec<(PageHandle, u64)>,
    /// Chunks mapped whose access could not be granted and whose unmap failed too, and pages
    /// of this segment mapped at a re-paging's scratch range whose unmap failed
    /// (`pool::repage`): listed neither in `chunks` nor in the pool (no block may use them),
    /// unmapped and released again at the next map or unmap.
    pub stuck: Vec<(u64, Chunk)>,
    /// Chunks (address, bytes) a sleep unmapped, to map again at the same addresses when the
    /// pool wakes (`pool::sleep`); empty while it is awake.
    pub slept: Vec<(u64, u64)>,
    /// Addresses (first address, bytes) still mapped to pages moved out of `chunks` to another
    /// segment's (`pool::moving`): unmapped, never released, once the work queued on them
    /// before has completed.
    pub moved: BTreeMap<u64, u64>,
}

/// What [`ExpSegment::map`] did.
#[derive(Debug)]
pub struct Mapped {
    /// The chunks mapped and still mapped, one range from the first address asked for or
    /// after it: the whole request, or after a failure the chunks its rollback could not unmap
    /// (none when the rollback undid everything).
    pub range: Range,
    /// Chunks mapped and unmapped again after a failure (one map and one unmap each).
    pub undone: u64,
    /// The failed call: the one that stopped the mapping (out of memory included), or the
    /// one that stopped its rollback.
    pub error: Option<DeviceError>,
}

/// What [`ExpSegment::unmap`] did, and the error that stopped it, if one did.
#[derive(Debug)]
pub struct Unmapped {
    /// The chunks unmapped, one range from the first.
    pub range: Range,
    /// The failed call that stopped the unmapping early.
    pub error: Option<DeviceError>,
}

/// What [`ExpSegment::swap_in`] did once the chunk was unmapped.
#[derive(Debug, Default)]
pub struct Repaged {
    /// Chunks mapped in its place.
    pub pages: u64,
    /// Their bytes.
    pub bytes: u64,
    /// The failed call that left a kept page unmapped, if one did.
    pub error: Option<DeviceError>,
}

/// What a map or unmap operation did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Range {
    /// First address.
    pub addr: u64,
    /// Bytes (0: nothing happened).
    pub size: u64,
    /// Map or unmap operations issued (chunks).
    pub ops: u64,
}

impl ExpSegment {
    /// Rounds `addr` down to a page boundary of this segment.
    pub fn page_floor(&self, addr: u64) -> u64 {
        self.va + (addr - self.va) / self.page * self.page
    }

    /// Rounds `addr` up to a page boundary of this segment.
    pub fn page_ceil(&self, addr: u64) -> u64 {
        self.va + (addr - self.va).div_ceil(self.page) * self.page
    }

    /// Maps the pages covering `addr..addr + size`, which must all be unmapped and start on a
    /// page boundary, as chunks of at most `max_chunk` bytes that never cross a multiple of
    /// `max_chunk` from the segment's start (so a chunk lies inside one aligned window, and a
    /// large free range holds whole chunks that can be unmapped). `max_chunk` is a multiple of
    /// the page size; one above the segment's size maps the range in one chunk. A failed call
    /// (out of memory included) undoes the chunks already mapped; when that rollback fails too,
    /// the chunks it could not unmap stay mapped and are in [`Mapped::range`], for the pool to
    /// count.
    pub(crate) fn map<D: Device>(
        &mut self,
        m: &Mapper<'_, D>,
        addr: u64,
        size: u64,
        max_chunk: u64,
    ) -> Mapped {
        self.retry_leaked(m.dev);
        let begin = self.page_floor(addr);
        let end = self.page_ceil(addr + size).min(self.va + self.size);
        debug_assert_eq!(begin, addr, "map must start on a page boundary");
        let window = max_chunk.max(self.page).min(self.size);
        let mut done = Mapped {
            range: Range {
                addr: begin,
                size: 0,
                ops: 0,
            },
            undone: 0,
            error: None,
        };
        let mut at = begin;
        while at < end {
            let boundary = self.va + ((at - self.va) / window + 1) * window;
            let len = (end - at).min(boundary - at);
            match map_chunk(m, at, len, self.shareable) {
                Ok(handle) => {
                    self.chunks.insert(at, Chunk { size: len, handle });
                    self.mapped += len;
                    done.range.size += len;
                    done.range.ops += 1;
                    at += len;
                }
                Err(failed) => {
                    match failed.left {
                        Left::Nothing => {}
                        Left::Page(handle) => self.leaked.push((handle, len)),
                        Left::Mapped(handle) => self.stuck.push((at, Chunk { size: len, handle })),
                    }
                    done.error = Some(failed.error);
                    self.roll_back(m, &mut done);
                    break;
                }
            }
        }
        done
    }

    /// Maps one chunk of exactly `size` bytes at `at` (a wake restores the chunks a sleep
    /// unmapped). On failure the chunk is not mapped; what its cleanup could not undo is kept
    /// for the next map or unmap, as in [`ExpSegment::map`].
    pub(crate) fn map_exact<D: Device>(
        &mut self,
        m: &Mapper<'_, D>,
        at: u64,
        size: u64,
    ) -> Result<(), DeviceError> {
        match map_chunk(m, at, size, self.shareable) {
            Ok(handle) => {
                self.chunks.insert(at, Chunk { size, handle });
                self.mapped += size;
                Ok(())
            }
            Err(failed) => {
                match failed.left {
                    Left::Nothing => {}
                    Left::Page(handle) => self.leaked.push((handle, size)),
                    Left::Mapped(handle) => self.stuck.push((at, Chunk { size, handle })),
                }
                Err(failed.error)
            }
        }
    }

    /// Creates one physical allocation per run of `keep` (address and bytes), for chunk
    /// re-making (`pool::repage`). A device without room for them all (or any failed call)
    /// releases those made and returns the error: nothing changed.
    pub(crate) fn create_runs<D: Device>(
        &mut self,
        dev: &D,
        keep: &[(u64, u64)],
    ) -> Result<Vec<PageHandle>, DeviceError> {
        self.retry_leaked(dev);
        let mut pages = Vec::with_capacity(keep.len());
        for &(_, len) in keep {
            match create(dev, len, self.shareable) {
                Ok(h) => pages.push(h),
                Err(e) => {
                    self.release_all(dev, keep, &pages);
                    return Err(e);
                }
            }
        }
        Ok(pages)
    }

    /// Puts `pages` (from [`ExpSegment::create_runs`], one per run of `keep`, mapped nowhere,
    /// holding the bytes the caller copied into them) in place of chunk `at`. An unmap of the
    /// chunk the driver refuses releases the pages and leaves the chunk as it was (`Err`).
    /// Otherwise the chunk is released (a failed release leaves a stray) and each page mapped
    /// at its run's address, tried twice with the same page (a failed map leaves the page
    /// unmapped, its bytes in it); when both tries fail the page is released (its bytes are
    /// lost), the error is in [`Repaged::error`], and a fresh allocation is mapped at the run's
    /// addresses (left unmapped only when that fails too).
    pub(crate) fn swap_in<D: Device>(
        &mut self,
        m: &Mapper<'_, D>,
        at: u64,
        keep: &[(u64, u64)],
        pages: &[PageHandle],
    ) -> Result<Repaged, DeviceError> {
        let old = *self.chunks.get(&at).expect("a mapped chunk");
        m.hooks.unmapping(at, old.size);
        if let Err(e) = m.dev.unmap(at, old.size) {
            m.hooks.mapped(at, old.size);
            self.release_all(m.dev, keep, pages);
            return Err(e);
        }
        self.chunks.remove(&at);
        self.mapped -= old.size;
        if m.dev.release_page(old.handle).is_err() {
            self.leaked.push((old.handle, old.size));
        }
        let mut done = Repaged::default();
        for (&(page_at, size), &handle) in keep.iter().zip(pages) {
            let attached =
                attach_kept(m, page_at, size, handle).or_else(|failed| match failed.left {
                    Left::Page(h) => attach_kept(m, page_at, size, h),
                    _ => Err(failed),
                });
            match attached {
                Ok(()) => {
                    self.chunks.insert(page_at, Chunk { size, handle });
                    self.mapped += size;
                    done.pages += 1;
                    done.bytes += size;
                }
                Err(failed) => {
                    let left = match failed.left {
                        Left::Page(h) => release(m.dev, h),
                        left => left,
                    };
                    self.keep_left(page_at, size, left);
                    done.error.get_or_insert(failed.error);
                    // The bytes are lost; a fresh allocation keeps the addresses mapped, so the
                    // blocks over them stay as the pool's invariants say.
                    match map_chunk(m, page_at, size, self.shareable) {
                        Ok(handle) => {
                            self.chunks.insert(page_at, Chunk { size, handle });
                            self.mapped += size;
                            done.pages += 1;
                            done.bytes += size;
                        }
                        Err(again) => self.keep_left(page_at, size, again.left),
                    }
                }
            }
        }
        Ok(done)
    }

    /// Releases the chunks created for `keep` and not mapped (never, or mapped at a scratch
    /// range and unmapped again); a failed release leaves a stray.
    pub(crate) fn release_all<D: Device>(
        &mut self,
        dev: &D,
        keep: &[(u64, u64)],
        pages: &[PageHandle],
    ) {
        for (&h, &(_, len)) in pages.iter().zip(keep) {
            if dev.release_page(h).is_err() {
                self.leaked.push((h, len));
            }
        }
    }

    /// Keeps what a failed map of `size` bytes at `at` left behind, for the next map or unmap.
    fn keep_left(&mut self, at: u64, size: u64, left: Left) {
        match left {
            Left::Nothing => {}
            Left::Page(handle) => self.leaked.push((handle, size)),
            Left::Mapped(handle) => self.stuck.push((at, Chunk { size, handle })),
        }
    }

    /// The runs of pages inside `lo..hi` (page boundaries) that no chunk covers, ascending, as
    /// (first address, bytes).
    pub fn unmapped_runs(&self, lo: u64, hi: u64) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut at = lo;
        while at < hi {
            if self.is_mapped(at, self.page) {
                at += self.page;
                continue;
            }
            match runs.last_mut() {
                Some((a, n)) if *a + *n == at => *n += self.page,
                _ => runs.push((at, self.page)),
            }
            at += self.page;
        }
        runs
    }

    /// Unmaps the chunks `done` mapped, after the failure it holds: what could not be unmapped
    /// stays in `done.range`, and a failure of the rollback replaces the error.
    fn roll_back<D: Device>(&mut self, m: &Mapper<'_, D>, done: &mut Mapped) {
        let r = done.range;
        let undone = self.unmap(m, r.addr, r.size);
        done.undone = undone.range.ops;
        done.range = Range {
            addr: r.addr + undone.range.size,
            size: r.size - undone.range.size,
            ops: r.ops - undone.range.ops,
        };
        if let Some(e) = undone.error {
            done.error = Some(e);
        }
    }

    /// Unmaps and releases every chunk lying entirely inside `addr..addr + size`, in address
    /// order. It does not wait for the device: the caller makes sure that no work queued on the
    /// device may still use these pages (an event of their stream completed, the device was
    /// synchronized, or they were mapped just now and never handed out). A failed call stops it: what it
    /// did until then is in [`Unmapped::range`] (chunks of a mapped range lie end to end, so
    /// those released form one range from the first), the error in [`Unmapped::error`]. A chunk
    /// whose `unmap` failed stays mapped and listed; one whose `unmap` succeeded and whose
    /// `release_page` failed is unmapped (counted in the range) and its page is released again
    /// at the segment's next unmap.
    pub(crate) fn unmap<D: Device>(&mut self, m: &Mapper<'_, D>, addr: u64, size: u64) -> Unmapped {
        let dev = m.dev;
        self.retry_leaked(dev);
        let end = addr + size;
        // The next chunk lying entirely inside the range, from `from` on (no list is made: the
        // chunks after the one unmapped stay as they were).
        let next_inside = |chunks: &BTreeMap<u64, Chunk>, from: u64| {
            let mut inside = chunks.range(from..end).filter(|(a, c)| **a + c.size <= end);
            inside.next().map(|(a, c)| (*a, *c))
        };
        let mut next = next_inside(&self.chunks, addr);
        let first = next.map_or(addr, |c| c.0);
        let mut done = Unmapped {
            range: Range {
                addr: first,
                size: 0,
                ops: 0,
            },
            error: None,
        };
        while let Some((a, c)) = next {
            m.hooks.unmapping(a, c.size);
            if let Err(e) = dev.unmap(a, c.size) {
                // Still mapped, and usable: announced again.
                m.hooks.mapped(a, c.size);
                done.error = Some(e);
                break;
            }
            self.chunks.remove(&a);
            self.mapped -= c.size;
            done.range.size += c.size;
            done.range.ops += 1;
            if let Err(e) = dev.release_page(c.handle) {
                self.leaked.push((c.handle, c.size));
                done.error = Some(e);
                break;
            }
            next = next_inside(&self.chunks, a + c.size);
        }
        done
    }

    /// Moves the chunk at `at` out of `chunks` (its page is the caller's to map elsewhere with
    /// [`ExpSegment::map_moved`]); its addresses stay mapped, in `moved`.
    pub(crate) fn move_out(&mut self, at: u64) -> Chunk {
        let c = self.chunks.remove(&at).expect("a chunk starts there");
        self.mapped -= c.size;
        self.moved.insert(at, c.size);
        c
    }

    /// Undoes [`ExpSegment::move_out`] of chunk `c` at `at`, whose page could not be mapped
    /// elsewhere.
    pub(crate) fn move_back(&mut self, at: u64, c: Chunk) {
        self.moved.remove(&at);
        self.chunks.insert(at, c);
        self.mapped += c.size;
    }

    /// Maps chunk `c`, moved out of a segment, at `at` (its page is mapped there too until
    /// that segment unmaps it). On failure the error, and whether the page is unmapped here
    /// again (to move back); when its unmap failed too it is kept as [`ExpSegment::stuck`].
    pub(crate) fn map_moved<D: Device>(
        &mut self,
        m: &Mapper<'_, D>,
        at: u64,
        c: Chunk,
    ) -> Result<(), (DeviceError, bool)> {
        self.retry_leaked(m.dev);
        match attach_kept(m, at, c.size, c.handle) {
            Ok(()) => {
                self.chunks.insert(at, c);
                self.mapped += c.size;
                Ok(())
            }
            Err(ChunkFailed {
                error,
                left: Left::Mapped(handle),
            }) => {
                let size = c.size;
                self.stuck.push((at, Chunk { size, handle }));
                Err((error, false))
            }
            Err(failed) => Err((failed.error, true)),
        }
    }

    /// Unmaps the moved ranges inside `addr..addr + size` (never releasing a page: each is
    /// held by the chunk it moved to), in address order; stops at the first failure, which
    /// leaves the rest in `moved`. Returns the unmaps made and that failure.
    pub(crate) fn unmap_moved<D: Device>(
        &mut self,
        m: &Mapper<'_, D>,
        addr: u64,
        size: u64,
    ) -> (u64, Option<DeviceError>) {
        let inside: Vec<(u64, u64)> = self
            .moved
            .range(addr..addr + size)
            .map(|(&a, &n)| (a, n))
            .collect();
        let mut ops = 0;
        for (a, n) in inside {
            m.hooks.unmapping(a, n);
            if let Err(e) = m.dev.unmap(a, n) {
                m.hooks.mapped(a, n); // still mapped
                return (ops, Some(e));
            }
            self.moved.remove(&a);
            ops += 1;
        }
        (ops, None)
    }

    /// Unmaps and releases again what a failed call left behind ([`ExpSegment::stuck`],
    /// [`ExpSegment::leaked`]); best effort: what fails again stays for the next time.
    pub(crate) fn retry_leaked<D: Device>(&mut self, dev: &D) {
        let leaked = &mut self.leaked;
        self.stuck.retain(|&(at, c)| {
            if dev.unmap(at, c.size).is_err() {
                return true;
            }
            leaked.push((c.handle, c.size));
            false
        });
        self.leaked.retain(|&(h, _)| dev.release_page(h).is_err());
    }

    /// True while pages of this segment are held by the device outside its chunks (their
    /// release failed): its range must stay reserved until they are gone.
    pub fn holds_strays(&self) -> bool {
        !self.leaked.is_empty() || !self.stuck.is_empty()
    }

    /// Bytes of the pages held by the device outside the chunks ([`ExpSegment::holds_strays`]):
    /// the pool counts them against its memory limit until they are released.
    pub fn stray_bytes(&self) -> u64 {
        let leaked: u64 = self.leaked.iter().map(|&(_, n)| n).sum();
        leaked + self.stuck.iter().map(|(_, c)| c.size).sum::<u64>()
    }

    /// The chunks lying entirely inside `addr..addr + size`, as one range (first address and
    /// bytes; `ops`: how many), or `None` when there is none. Inside a mapped range they lie end
    /// to end.
    pub fn whole_chunks(&self, addr: u64, size: u64) -> Option<Range> {
        let mut inside = self
            .chunks
            .range(addr..addr + size)
            .filter(|(a, c)| **a + c.size <= addr + size);
        let (&first, c) = inside.next()?;
        let mut r = Range {
            addr: first,
            size: c.size,
            ops: 1,
        };
        for (_, c) in inside {
            r.size += c.size;
            r.ops += 1;
        }
        Some(r)
    }

    /// True when every byte of `addr..addr + size` is mapped.
    pub fn is_mapped(&self, addr: u64, size: u64) -> bool {
        let mut at = addr;
        let end = addr + size;
        match self.chunks.range(..=at).next_back() {
            Some((a, c)) if *a + c.size > at => at = *a + c.size,
            _ => return size == 0,
        }
        if at >= end {
            return true;
        }
        for (a, c) in self.chunks.range(at..end) {
            if *a != at {
                return false;
            }
            at = *a + c.size;
        }
        at >= end
    }
}

/// What a chunk that failed to map left behind after its cleanup.
enum Left {
    /// Nothing: the page was released or never created.
    Nothing,
    /// A page created and not mapped (or unmapped) whose release failed.
    Page(PageHandle),
    /// A page mapped without access whose unmap failed.
    Mapped(PageHandle),
}

/// A chunk that could not be mapped.
struct ChunkFailed {
    error: DeviceError,
    left: Left,
}

/// Creates one physical allocation of `len` bytes (exportable when `shareable`), maps it at
/// `at`, makes it accessible and announces it to the hooks; on failure undoes what it did, and
/// says what it could not undo.
fn map_chunk<D: Device>(
    m: &Mapper<'_, D>,
    at: u64,
    len: u64,
    shareable: bool,
) -> Result<PageHandle, ChunkFailed> {
    let handle = create(m.dev, len, shareable).map_err(|error| ChunkFailed {
        error,
        left: Left::Nothing,
    })?;
    attach(m, at, len, handle)?;
    Ok(handle)
}

/// Creates one physical allocation of `len` bytes, exportable when `shareable`.
fn create<D: Device>(dev: &D, len: u64, shareable: bool) -> Result<PageHandle, DeviceError> {
    if shareable {
        dev.create_shareable_page(len)
    } else {
        dev.create_page(len)
    }
}

/// Maps physical allocation `handle` of `len` bytes at `at`, makes it accessible and announces
/// it to the hooks; on failure undoes what it did (the handle released included), and says what
/// it could not undo.
fn attach<D: Device>(
    m: &Mapper<'_, D>,
    at: u64,
    len: u64,
    handle: PageHandle,
) -> Result<(), ChunkFailed> {
    attach_kept(m, at, len, handle).map_err(|failed| match failed.left {
        Left::Page(h) => ChunkFailed {
            error: failed.error,
            left: release(m.dev, h),
        },
        _ => failed,
    })
}

/// [`attach`] that keeps the handle on failure: [`Left::Page`] when it is unmapped again (the
/// caller's to map again or release), [`Left::Mapped`] when its unmap failed too.
fn attach_kept<D: Device>(
    m: &Mapper<'_, D>,
    at: u64,
    len: u64,
    handle: PageHandle,
) -> Result<(), ChunkFailed> {
    let (dev, peers) = (m.dev, m.peers);
    if let Err(error) = dev.map(at, len, handle) {
        let left = Left::Page(handle);
        return Err(ChunkFailed { error, left });
    }
    if let Err(error) = dev.set_access(at, len, peers) {
        let left = match dev.unmap(at, len) {
            Ok(()) => Left::Page(handle),
            Err(_) => Left::Mapped(handle),
        };
        return Err(ChunkFailed { error, left });
    }
    m.hooks.mapped(at, len);
    Ok(())
}

/// Releases a page mapped nowhere: [`Left::Nothing`], or [`Left::Page`] when the release fails.
fn release<D: Device>(dev: &D, handle: PageHandle) -> Left {
    match dev.release_page(handle) {
        Ok(()) => Left::Nothing,
        Err(_) => Left::Page(handle),
    }
}
