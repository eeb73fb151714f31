//! Sleep and wake: a pool gives every physical page back while its virtual ranges stay
//! reserved, and later maps new pages at the same addresses, with the bytes of its live
//! allocations restored from a pinned host copy when it was asked to keep them (*offload*).
//! This file is the sleep; `wake` is the way back.
//!
//! A pool sleeps as a whole; [`crate::CachingAllocator`] keeps each tag's allocations in a pool
//! of their own, so a tag's blocks never share a page (or a range) with another tag's.
//!
//! # Order of work
//!
//! `sleep`: waits for the events of blocks freed on other streams and of releasing blocks
//! (`events`, `releasing`), records one event on every stream that used the pool's memory
//! (its ranges' streams and the streams recorded on live blocks), and then either makes the
//! pool's copy stream wait for those events (offload) or waits for them on the host. With
//! offload it plans one copy per live allocation (its requested bytes, in address order, into
//! the pool's pinned host buffer) and enqueues, chunk by chunk in address order, the parts of
//! the copies lying in each chunk, recording an event after every [`COPY_GROUP`] bytes of
//! chunks; the host then waits for each group's event and unmaps and releases that group's
//! chunks while the later groups' copies run. Without offload every chunk is unmapped at once.
//! No chunk is unmapped before the copies of its bytes completed. A sleep that fails before it
//! unmapped anything changes nothing (but for a host buffer made for it, which stays for the
//! next sleep); once some chunks are unmapped, a failed wait for a later group's event, or an
//! unmap the driver refuses, leaves the pool asleep with the other chunks mapped
//! ([`AllocError::SleepIncomplete`]); a later `sleep` copies their bytes again and unmaps them.
//!
//! The host buffer is made by the first offloading sleep and kept, while awake too, for the
//! next one (it is made again, larger, when the live allocations outgrow it): pinning host
//! memory costs more than copying it. [`Core::release_host_buffer`] frees it.
//!
//! # Invariants
//!
//! - Asleep ([`Core::asleep`]): the blocks are as they were at `sleep`; every chunk that was
//!   mapped is in its segment's `slept` list or still in `chunks` (counted in `reserved`; the
//!   sleep said so with [`AllocError::SleepIncomplete`]); the pool hands out, frees and
//!   releases nothing.
//! - Awake: every segment's `slept` list is empty.
//! - While asleep with offload, the host buffer holds the bytes of every planned copy
//!   ([`Slumber::copies`]: the requested bytes of each block allocated at `sleep`) that lie in
//!   a slept chunk; a chunk still mapped holds its own bytes. Copies into or out of the buffer
//!   are only ever enqueued on the copy stream, so each is ordered after the one before.

use super::block::BlockId;
use super::segment::Mapper;
use super::{Core, Observer};
use crate::error::AllocError;
use cudalloc_sys::{Device, DeviceError, EventHandle, HostPtr, StreamId};
use std::collections::BTreeSet;

/// One live allocation's bytes in the host buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Copy {
    /// Device address.
    pub addr: u64,
    /// Offset in the host buffer.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// What a sleeping pool keeps to wake up.
#[derive(Debug, Default)]
pub(crate) struct Slumber {
    /// The live allocations copied into the host buffer, in address order (empty without
    /// offload).
    pub copies: Vec<Copy>,
    /// Bytes of the chunks unmapped by the sleep.
    pub bytes: u64,
}

/// Bytes of chunks a sleep unmaps after one event on the copy stream: large enough that the
/// host waits rarely, small enough that unmapping starts while most copies still run.
const COPY_GROUP: u64 = 64 << 20;

/// Why [`Core::unmap_everything`] stopped.
enum Stopped {
    /// The copies could not be enqueued: nothing was unmapped.
    Copies(DeviceError),
    /// Some chunks stay mapped: the first failed call (a wait or an unmap).
    Incomplete(DeviceError),
}

/// The parts of `copies` (in address order, disjoint) lying in `lo..hi`: (device address,
/// offset in the host buffer, bytes).
pub(super) fn pieces(
    copies: &[Copy],
    lo: u64,
    hi: u64,
) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    let first = copies.partition_point(|c| c.addr + c.len <= lo);
    copies[first..]
        .iter()
        .take_while(move |c| c.addr < hi)
        .map(move |c| {
            let (from, to) = (c.addr.max(lo), (c.addr + c.len).min(hi));
            (from, c.offset + (from - c.addr), to - from)
        })
}

impl Slumber {
    /// Bytes of the copies.
    fn copied(&self) -> u64 {
        self.copies.iter().map(|c| c.len).sum()
    }
}

impl<D: Device> Core<D> {
    /// True while the pool sleeps (between a successful `Core::sleep` and `Core::wake`).
    pub fn asleep(&self) -> bool {
        self.slumber.is_some()
    }

    /// Bytes of the pages the sleep gave back (0 when awake).
    pub fn slept_bytes(&self) -> u64 {
        self.slumber.as_ref().map_or(0, |s| s.bytes)
    }

    /// Bytes of the sleeping pool's allocations kept in pinned host memory (0 when awake or not
    /// offloaded).
    pub fn offloaded_bytes(&self) -> u64 {
        self.slumber.as_ref().map_or(0, Slumber::copied)
    }

    /// Bytes of the pinned host buffer the pool holds, asleep or awake (0: none).
    pub fn host_buffer_bytes(&self) -> u64 {
        self.host_buffer.map_or(0, |h| h.1)
    }

    /// Puts the pool to sleep (see the module docs). When it already sleeps, only retries the
    /// unmap of the pages a first sleep left mapped. Refused during a capture
    /// ([`AllocError::DuringCapture`]) and when the pool holds fixed segments
    /// ([`AllocError::SleepUnsupported`]). Pages left mapped (an unmap the driver refused, or a
    /// failed wait for the copies once some pages were unmapped) leave the pool asleep with
    /// them: [`AllocError::SleepIncomplete`].
    pub(crate) fn sleep<P: Observer>(
        &mut self,
        policy: &mut P,
        offload: bool,
    ) -> Result<(), AllocError> {
        self.refuse_during_capture("sleep")?;
        if self.asleep() {
            return match self.unmap_everything() {
                Err(Stopped::Copies(e)) => Err(e.into()),
                Err(Stopped::Incomplete(e)) => Err(self.incomplete(e)),
                Ok(()) => Ok(()),
            };
        }
        if self.blocks.iter().any(|(_, b)| !b.is_expandable()) {
            return Err(AllocError::SleepUnsupported);
        }
        self.synchronize_and_free_events(policy)?;
        self.finish_releasing()?;
        let events = self.record_on_users()?;
        let planned = if offload {
            self.plan_offload(&events)
        } else {
            self.wait_all(&events)
                .map(|()| Vec::new())
                .map_err(AllocError::from)
        };
        self.spare_events.extend(events.iter().map(|e| e.1));
        self.slumber = Some(Slumber {
            copies: planned?,
            bytes: 0,
        });
        match self.unmap_everything() {
            Ok(()) => Ok(()),
            Err(Stopped::Incomplete(e)) if self.slept_bytes() > 0 => Err(self.incomplete(e)),
            Err(Stopped::Copies(e) | Stopped::Incomplete(e)) => {
                self.slumber = None; // nothing was unmapped: the pool stays awake
                Err(e.into())
            }
        }
    }

    /// [`AllocError::SleepIncomplete`] after `source` left chunks mapped.
    fn incomplete(&self, source: DeviceError) -> AllocError {
        AllocError::SleepIncomplete {
            tag: None,
            mapped: self.mapped_while_asleep(),
            source,
        }
    }

    /// The error for `what` during a capture, if one is underway.
    pub(crate) fn refuse_during_capture(&self, what: &'static str) -> Result<(), AllocError> {
        if self.capturing() {
            return Err(AllocError::DuringCapture { what, requested: 0 });
        }
        Ok(())
    }

    /// Every stream that used the pool's memory: its ranges' streams and those recorded on its
    /// blocks.
    pub(super) fn user_streams(&self) -> BTreeSet<StreamId> {
        let mut streams: BTreeSet<StreamId> =
            self.segments.iter().flatten().map(|s| s.stream).collect();
        for (_, b) in self.blocks.iter() {
            streams.insert(b.stream);
            streams.extend(b.stream_uses.iter().copied());
        }
        streams
    }

    /// Records an event on every stream that used the pool's memory.
    fn record_on_users(&mut self) -> Result<Vec<(StreamId, EventHandle)>, DeviceError> {
        let streams = self.user_streams();
        let mut events = Vec::with_capacity(streams.len());
        for s in streams {
            let recorded = self.take_event().and_then(|ev| {
                let r = self.device.record_event(ev, s);
                if r.is_err() {
                    self.spare_events.push(ev);
                }
                r.map(|()| ev)
            });
            match recorded {
                Ok(ev) => events.push((s, ev)),
                Err(e) => {
                    self.spare_events.extend(events.iter().map(|e| e.1));
                    return Err(e);
                }
            }
        }
        Ok(events)
    }

    /// Waits on the host for every event of `events`.
    fn wait_all(&mut self, events: &[(StreamId, EventHandle)]) -> Result<(), DeviceError> {
        for &(_, ev) in events {
            self.stats.device_waits += 1;
            self.device.synchronize_event(ev)?;
        }
        Ok(())
    }

    /// The pool's copy stream, made on first use.
    pub(super) fn copy_stream(&mut self) -> Result<StreamId, DeviceError> {
        if let Some(s) = self.copy_stream {
            return Ok(s);
        }
        let s = self.device.open_stream()?;
        self.copy_stream = Some(s);
        Ok(s)
    }

    /// Destroys the copy stream, if one was made (on drop).
    pub(crate) fn destroy_copy_stream(&mut self) {
        if let Some(s) = self.copy_stream.take() {
            let _ = self.device.close_stream(s);
        }
    }

    /// A pinned host buffer of at least `bytes`: the one kept when it is large enough, else a
    /// new one (the one kept freed first).
    pub(super) fn host_buffer(&mut self, bytes: u64) -> Result<HostPtr, DeviceError> {
        match self.host_buffer {
            Some((host, n)) if n >= bytes => Ok(host),
            _ => {
                self.release_host_buffer()?;
                let host = self.device.alloc_host(bytes)?;
                self.host_buffer = Some((host, bytes));
                Ok(host)
            }
        }
    }

    /// Frees the pinned host buffer, once the copies enqueued into or out of it completed;
    /// nothing when there is none, or while the pool sleeps (it holds the sleep's copies).
    pub(crate) fn release_host_buffer(&mut self) -> Result<(), DeviceError> {
        if self.asleep() {
            return Ok(());
        }
        let Some((host, n)) = self.host_buffer else {
            return Ok(());
        };
        if let Some(s) = self.copy_stream {
            self.wait_stream(s)?;
        }
        self.host_buffer = None;
        self.device.free_host(host, n)
    }

    /// Plans the copies of every live allocation into the host buffer (made or grown here), in
    /// address order, and makes the copy stream wait for the users' `events`; without live
    /// allocations, waits for the events on the host instead and plans nothing.
    fn plan_offload(
        &mut self,
        events: &[(StreamId, EventHandle)],
    ) -> Result<Vec<Copy>, AllocError> {
        let mut copies: Vec<Copy> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.allocated && b.requested > 0)
            .map(|(_, b)| Copy {
                addr: b.addr,
                offset: 0,
                len: b.requested,
            })
            .collect();
        if copies.is_empty() {
            self.wait_all(events)?;
            return Ok(copies);
        }
        copies.sort_unstable_by_key(|c| c.addr);
        let mut total = 0;
        for c in &mut copies {
            c.offset = total;
            total += c.len;
        }
        let stream = self.copy_stream()?;
        self.host_buffer(total)?;
        for &(_, ev) in events {
            self.device.wait_event(stream, ev)?;
        }
        Ok(copies)
    }

    /// Records an event on `stream` and waits for it on the host.
    pub(super) fn wait_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        let ev = self.take_event()?;
        let r = self.device.record_event(ev, stream);
        let r = r.and_then(|()| {
            self.stats.device_waits += 1;
            self.device.synchronize_event(ev)
        });
        self.spare_events.push(ev);
        r
    }

    /// Every chunk still mapped: (range, address, bytes), in address order within each range.
    fn mapped_chunks(&self) -> Vec<(usize, u64, u64)> {
        let mut chunks = Vec::new();
        for (i, seg) in self.segments.iter().enumerate() {
            if let Some(seg) = seg {
                chunks.extend(seg.chunks.iter().map(|(&at, c)| (i, at, c.size)));
            }
        }
        chunks
    }

    /// Unmaps and releases every chunk still mapped of the sleeping pool, listing each in its
    /// range's `slept` and counting its bytes in the slumber. With copies planned, first
    /// enqueues on the copy stream the parts of the copies lying in those chunks, with an event
    /// after every [`COPY_GROUP`] bytes of chunks, and unmaps each group once its event
    /// completed (the next groups' copies run meanwhile). A failure to enqueue is
    /// [`Stopped::Copies`] (nothing unmapped); a failed wait stops the unmapping, and a chunk
    /// whose unmap fails stays mapped and counted in `reserved`: both are
    /// [`Stopped::Incomplete`]. A page whose release fails is unmapped and becomes a stray.
    fn unmap_everything(&mut self) -> Result<(), Stopped> {
        let chunks = self.mapped_chunks();
        let copies = self.slumber.as_ref().expect("asleep").copies.clone();
        let groups = if copies.is_empty() {
            vec![(None, chunks)]
        } else {
            self.copy_out(&copies, chunks).map_err(Stopped::Copies)?
        };
        let (mut first, mut waits_failed) = (None, false);
        for (ev, chunks) in groups {
            let waited = ev.map_or(Ok(()), |ev| {
                self.stats.device_waits += 1;
                let r = self.device.synchronize_event(ev);
                self.spare_events.push(ev);
                r
            });
            if let Err(e) = waited {
                first.get_or_insert(e);
                waits_failed = true;
            }
            if waits_failed {
                continue; // copies not known to be done: their chunks stay mapped
            }
            for (i, at, size) in chunks {
                if let Err(e) = self.unmap_slept(i, at, size) {
                    first.get_or_insert(e);
                }
            }
        }
        for seg in self.segments.iter_mut().flatten() {
            seg.slept.sort_unstable();
        }
        first.map_or(Ok(()), |e| Err(Stopped::Incomplete(e)))
    }

    /// Enqueues on the copy stream the parts of `copies` lying in `chunks`, in groups of about
    /// [`COPY_GROUP`] bytes of chunks, each followed by an event; returns the groups. On failure
    /// waits for what was enqueued (best effort) and returns the error.
    #[allow(clippy::type_complexity)]
    fn copy_out(
        &mut self,
        copies: &[Copy],
        chunks: Vec<(usize, u64, u64)>,
    ) -> Result<Vec<(Option<EventHandle>, Vec<(usize, u64, u64)>)>, DeviceError> {
        let stream = self.copy_stream()?;
        let (host, _) = self
            .host_buffer
            .expect("an offloading sleep has a host buffer");
        let mut groups = Vec::new();
        let mut group = Vec::new();
        let mut bytes = 0;
        let n = chunks.len();
        let mut enqueue = |core: &mut Self, k: usize, chunk: (usize, u64, u64)| {
            let (_, at, size) = chunk;
            for (addr, offset, len) in pieces(copies, at, at + size) {
                core.device
                    .copy_to_host_async(host + offset, addr, len, stream)?;
            }
            group.push(chunk);
            bytes += size;
            if bytes >= COPY_GROUP || k + 1 == n {
                let ev = core.take_event()?;
                if let Err(e) = core.device.record_event(ev, stream) {
                    core.spare_events.push(ev);
                    return Err(e);
                }
                groups.push((Some(ev), std::mem::take(&mut group)));
                bytes = 0;
            }
            Ok(())
        };
        let mut done = Ok(());
        for (k, chunk) in chunks.into_iter().enumerate() {
            done = enqueue(self, k, chunk);
            if done.is_err() {
                break;
            }
        }
        if let Err(e) = done {
            let _ = self.wait_stream(stream);
            self.spare_events
                .extend(groups.iter().filter_map(|g: &(Option<EventHandle>, _)| g.0));
            return Err(e);
        }
        Ok(groups)
    }

    /// Unmaps and releases chunk `at` (`size` bytes) of range `i` for the sleep: listed in
    /// `slept`, its bytes out of `reserved` and into the slumber's. An unmap the driver refuses
    /// leaves it mapped (the error); a refused release leaves a stray (not an error).
    fn unmap_slept(&mut self, i: usize, at: u64, size: u64) -> Result<(), DeviceError> {
        let seg = self.segments[i].as_mut().expect("a range with chunks");
        let before = seg.stray_bytes();
        let m = Mapper {
            dev: &self.device,
            peers: &self.peers,
            hooks: &self.hooks,
        };
        let done = seg.unmap(&m, at, size);
        let unmapped = done.range.size == size;
        if unmapped {
            seg.slept.push((at, size));
        }
        let pool = seg.pool;
        self.track_strays(i, before);
        if !unmapped {
            let why = "the chunk stayed mapped";
            return Err(done
                .error
                .unwrap_or_else(|| DeviceError::invalid("unmap", why)));
        }
        self.stats.calls.unmaps += 1;
        self.sub_reserved(size);
        self.reserved_shrank(pool, size);
        self.slumber.as_mut().expect("asleep").bytes += size;
        Ok(())
    }

    /// Bytes of the chunks still mapped while the pool sleeps (an unmap the driver refused).
    pub fn mapped_while_asleep(&self) -> u64 {
        if !self.asleep() {
            return 0;
        }
        self.segments.iter().flatten().map(|s| s.mapped).sum()
    }

    /// When the pool sleeps, as it is dropped: frees its host buffer (not when `unwaited`: during
    /// a capture its wait and its free would invalidate it), unmaps what is still mapped (the
    /// chunks a sleep could not unmap), counting what went back out of the reserved bytes (the
    /// group's counter outlives the pool when it is a graph pool's), and gives its ranges back
    /// (its blocks need no freeing: they hold no pages). False (nothing done) when it is awake.
    pub(crate) fn drop_asleep(&mut self, unwaited: bool) -> bool {
        if self.slumber.take().is_none() {
            return false;
        }
        if !unwaited {
            let _ = self.release_host_buffer();
        }
        for i in 0..self.segments.len() {
            self.drop_slept_range(i);
        }
        true
    }

    /// Unmaps what range `i` of a sleeping pool being dropped still maps, counts it out of the
    /// reserved bytes (and its strays, as they change), and gives the range back.
    fn drop_slept_range(&mut self, i: usize) {
        let Some(seg) = self.segments[i].as_mut() else {
            return;
        };
        let before = seg.stray_bytes();
        let m = Mapper {
            dev: &self.device,
            peers: &self.peers,
            hooks: &self.hooks,
        };
        let done = seg.unmap(&m, seg.va, seg.size);
        seg.retry_leaked(&self.device);
        let _ = self.device.unreserve(seg.va, seg.size);
        let (unmapped, pool) = (done.range.size, seg.pool);
        self.sub_reserved(unmapped);
        self.reserved_shrank(pool, unmapped);
        self.track_strays(i, before);
    }

    /// True when block `id`'s range was mapped when the pool fell asleep (for the invariant
    /// scan: mapped blocks of a sleeping pool lie in slept chunks).
    pub(crate) fn slept_covers(&self, id: BlockId) -> bool {
        let b = &self.blocks[id];
        let Some(seg) = self.segments[b.segment as usize].as_ref() else {
            return false;
        };
        let mut ranges: Vec<(u64, u64)> = seg.slept.clone();
        ranges.extend(seg.chunks.iter().map(|(&a, c)| (a, c.size)));
        ranges.sort_unstable();
        let mut at = b.addr;
        for (a, n) in ranges {
            if a <= at && at < a + n {
                at = a + n;
            }
        }
        at >= b.end()
    }
}
