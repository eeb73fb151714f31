//! Sleep and wake: a pool gives every physical page back while its virtual ranges stay
//! reserved, and later maps new pages at the same addresses, with the bytes of its live
//! allocations restored from pinned host copies when it was asked to keep them (*offload*).
//!
//! A pool sleeps as a whole; [`crate::CachingAllocator`] keeps each tag's allocations in a pool
//! of their own, so a tag's blocks never share a page (or a range) with another tag's.
//!
//! # Order of work
//!
//! `sleep`: waits for the events of blocks freed on other streams and of releasing blocks
//! (`events`, `releasing`), records one event on every stream that used the pool's memory
//! (its ranges' streams and the streams recorded on live blocks), and then either makes the
//! pool's copy stream wait for those events and copies every live allocation's requested bytes
//! into one pinned host buffer on it (offload), or only waits for them; the host waits for the
//! copies' event, and every chunk is unmapped and released. Nothing is unmapped before the
//! copies completed, and a failure before the unmapping changes nothing. `wake(stream)`:
//! claims the slept bytes against the limit, maps a new page for every chunk that was unmapped,
//! at its old address and with its old size, copies the host copies back on the copy stream,
//! makes `stream` wait for the copies' event, waits for it on the host and frees the host
//! buffer. A failure (out of memory included) unmaps what this attempt mapped and leaves the
//! pool asleep with its host copies.
//!
//! # Invariants
//!
//! - Asleep ([`Core::asleep`]): the blocks are as they were at `sleep`; every chunk that was
//!   mapped is in its segment's `slept` list (or, if its unmap failed, still in `chunks`); the
//!   pool hands out, frees and releases nothing; `reserved` counts only chunks still mapped.
//! - Awake: every segment's `slept` list is empty and there is no host copy.
//! - A host copy holds `requested` bytes of each block allocated at `sleep`, at the offsets
//!   listed in `copies`, inside one buffer of `host_bytes` bytes.

use super::block::BlockId;
use super::segment::{Chunk, Mapper};
use super::{Core, Observer};
use crate::error::AllocError;
use cudalloc_sys::{Device, DeviceError, EventHandle, HostPtr, StreamId};
use std::collections::BTreeSet;

/// What a sleeping pool keeps to wake up.
#[derive(Debug, Default)]
pub(crate) struct Slumber {
    /// The pinned host buffer holding the copies (address, bytes), if anything was copied.
    host: Option<(HostPtr, u64)>,
    /// (device address, offset in the host buffer, bytes) of each live allocation copied.
    copies: Vec<(u64, u64, u64)>,
    /// Bytes of the chunks unmapped by the sleep.
    bytes: u64,
}

impl<D: Device> Core<D> {
    /// True while the pool sleeps (between a successful [`Core::sleep`] and [`Core::wake`]).
    pub fn asleep(&self) -> bool {
        self.slumber.is_some()
    }

    /// Bytes of the pages the sleep gave back (0 when awake).
    pub fn slept_bytes(&self) -> u64 {
        self.slumber.as_ref().map_or(0, |s| s.bytes)
    }

    /// Bytes of pinned host memory holding the sleeping pool's allocations (0 when awake or
    /// not offloaded).
    pub fn offloaded_bytes(&self) -> u64 {
        self.slumber
            .as_ref()
            .and_then(|s| s.host)
            .map_or(0, |h| h.1)
    }

    /// Puts the pool to sleep (see the module docs); nothing when it already sleeps. Refused
    /// during a capture ([`AllocError::DuringCapture`]) and when the pool holds fixed segments
    /// ([`AllocError::SleepUnsupported`]).
    pub(crate) fn sleep<P: Observer>(
        &mut self,
        policy: &mut P,
        offload: bool,
    ) -> Result<(), AllocError> {
        if self.asleep() {
            return Ok(());
        }
        self.refuse_during_capture("sleep")?;
        if self.blocks.iter().any(|(_, b)| !b.is_expandable()) {
            return Err(AllocError::SleepUnsupported);
        }
        self.synchronize_and_free_events(policy)?;
        self.finish_releasing()?;
        let events = self.record_on_users()?;
        let copied = if offload {
            self.offload(&events)
        } else {
            self.wait_all(&events)
                .map(|()| Slumber::default())
                .map_err(AllocError::from)
        };
        self.spare_events.extend(events.iter().map(|e| e.1));
        let mut slumber = copied?;
        slumber.bytes = self.unmap_everything();
        self.slumber = Some(slumber);
        Ok(())
    }

    /// The error for `what` during a capture, if one is underway.
    fn refuse_during_capture(&self, what: &'static str) -> Result<(), AllocError> {
        if self.capturing() {
            return Err(AllocError::DuringCapture { what, requested: 0 });
        }
        Ok(())
    }

    /// Records an event on every stream that used the pool's memory.
    fn record_on_users(&mut self) -> Result<Vec<(StreamId, EventHandle)>, DeviceError> {
        let mut streams: BTreeSet<StreamId> =
            self.segments.iter().flatten().map(|s| s.stream).collect();
        for (_, b) in self.blocks.iter() {
            streams.insert(b.stream);
            streams.extend(b.stream_uses.iter().copied());
        }
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
    fn copy_stream(&mut self) -> Result<StreamId, DeviceError> {
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

    /// Copies every live allocation into one pinned host buffer on the copy stream, after the
    /// users' `events`, and waits for the copies; on failure frees the buffer (nothing kept).
    fn offload(&mut self, events: &[(StreamId, EventHandle)]) -> Result<Slumber, AllocError> {
        let mut copies = Vec::new();
        let mut total = 0;
        for (_, b) in self
            .blocks
            .iter()
            .filter(|(_, b)| b.allocated && b.requested > 0)
        {
            copies.push((b.addr, total, b.requested));
            total += b.requested;
        }
        if total == 0 {
            self.wait_all(events)?;
            return Ok(Slumber::default());
        }
        let stream = self.copy_stream()?;
        let host = self.device.alloc_host(total)?;
        let done = self.copy_out(stream, host, &copies, events);
        if let Err(e) = done {
            let _ = self.device.free_host(host, total);
            return Err(e.into());
        }
        Ok(Slumber {
            host: Some((host, total)),
            copies,
            bytes: 0,
        })
    }

    /// Enqueues the copies out after `events` and waits for them on the host.
    fn copy_out(
        &mut self,
        stream: StreamId,
        host: HostPtr,
        copies: &[(u64, u64, u64)],
        events: &[(StreamId, EventHandle)],
    ) -> Result<(), DeviceError> {
        for &(_, ev) in events {
            self.device.wait_event(stream, ev)?;
        }
        for &(addr, off, n) in copies {
            self.device
                .copy_to_host_async(host + off, addr, n, stream)?;
        }
        self.wait_stream(stream)
    }

    /// Records an event on `stream` and waits for it on the host.
    fn wait_stream(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        let ev = self.take_event()?;
        let r = self.device.record_event(ev, stream);
        let r = r.and_then(|()| {
            self.stats.device_waits += 1;
            self.device.synchronize_event(ev)
        });
        self.spare_events.push(ev);
        r
    }

    /// Unmaps and releases every chunk of every range, listing each in its range's `slept`;
    /// returns the bytes unmapped. A chunk whose unmap fails stays mapped (and counted); a page
    /// whose release fails is a stray, released again later.
    fn unmap_everything(&mut self) -> u64 {
        let mut total = 0;
        for i in 0..self.segments.len() {
            let Some(seg) = self.segments[i].as_mut() else {
                continue;
            };
            let before = seg.stray_bytes();
            let chunks: Vec<(u64, Chunk)> = seg.chunks.iter().map(|(&a, &c)| (a, c)).collect();
            let (mut bytes, mut ops) = (0, 0);
            for (at, c) in chunks {
                let m = Mapper {
                    dev: &self.device,
                    peers: &self.peers,
                    hooks: &self.hooks,
                };
                let done = seg.unmap(&m, at, c.size);
                if done.range.size == c.size {
                    seg.slept.push((at, c.size));
                    bytes += c.size;
                    ops += 1;
                }
            }
            let pool = seg.pool;
            self.stats.calls.unmaps += ops;
            self.sub_reserved(bytes);
            self.reserved_shrank(pool, bytes);
            self.track_strays(i, before);
            total += bytes;
        }
        total
    }

    /// Wakes the pool (see the module docs): later work on `stream` runs after the restored
    /// bytes are in place. Nothing when it is awake. Refused during a capture; out of memory
    /// (the limit or the device) is [`AllocError::OutOfMemory`], and the pool stays asleep,
    /// intact.
    pub(crate) fn wake(&mut self, stream: StreamId) -> Result<(), AllocError> {
        let Some(bytes) = self.slumber.as_ref().map(|s| s.bytes) else {
            return Ok(());
        };
        self.refuse_during_capture("wake")?;
        if self.over_limit(bytes) || !self.claim(bytes) {
            return Err(self.wake_oom(bytes));
        }
        if let Err(e) = self.map_slept() {
            self.sub_reserved(bytes);
            return Err(if e.is_out_of_memory() {
                self.wake_oom(bytes)
            } else {
                e.into()
            });
        }
        if let Err(e) = self.copy_back(stream) {
            self.unmap_woken();
            self.sub_reserved(bytes);
            return Err(e.into());
        }
        let slumber = self.slumber.take().expect("asleep");
        if let Some((host, n)) = slumber.host {
            let _ = self.device.free_host(host, n);
        }
        self.woke();
        Ok(())
    }

    /// The out-of-memory error of a wake that needed `bytes`.
    fn wake_oom(&self, bytes: u64) -> AllocError {
        AllocError::OutOfMemory {
            requested: bytes,
            rounded: bytes,
            reserved: self.reserved,
            allocated: self.stats.allocated_bytes.0[0].current as u64,
            device_free: self.device.mem_info().map(|m| m.0).unwrap_or(0),
            limit: self.limit,
        }
    }

    /// Maps a new page for every slept chunk, at its address; on failure unmaps what it mapped
    /// (the slept lists are untouched until the wake succeeds).
    fn map_slept(&mut self) -> Result<(), DeviceError> {
        for i in 0..self.segments.len() {
            let Some(seg) = self.segments[i].as_mut() else {
                continue;
            };
            let before = seg.stray_bytes();
            // A chunk a failed wake could not unmap still sits at its address: unmapped first.
            seg.retry_leaked(&self.device);
            let mut failed = None;
            for &(at, size) in &seg.slept.clone() {
                let m = Mapper {
                    dev: &self.device,
                    peers: &self.peers,
                    hooks: &self.hooks,
                };
                if let Err(e) = seg.map_exact(&m, at, size) {
                    failed = Some(e);
                    break;
                }
            }
            self.track_strays(i, before);
            if let Some(e) = failed {
                self.unmap_woken();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Unmaps the chunks a failed wake mapped back (those listed in `slept` and mapped now).
    fn unmap_woken(&mut self) {
        for i in 0..self.segments.len() {
            let Some(seg) = self.segments[i].as_mut() else {
                continue;
            };
            let before = seg.stray_bytes();
            for &(at, size) in &seg.slept.clone() {
                if seg.chunks.contains_key(&at) {
                    let m = Mapper {
                        dev: &self.device,
                        peers: &self.peers,
                        hooks: &self.hooks,
                    };
                    let done = seg.unmap(&m, at, size);
                    if done.range.size != size {
                        // Still mapped: counted as a stray until a later call unmaps it, and
                        // withdrawn from the hooks, as no block will use it.
                        if let Some(c) = seg.chunks.remove(&at) {
                            self.hooks.unmapping(at, c.size);
                            seg.mapped -= c.size;
                            seg.stuck.push((at, c));
                        }
                    }
                }
            }
            self.track_strays(i, before);
        }
    }

    /// Copies the host copies back on the copy stream, makes `stream` wait for them, and waits
    /// for them on the host.
    fn copy_back(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        let slumber = self.slumber.as_ref().expect("asleep");
        let Some((host, _)) = slumber.host else {
            return Ok(());
        };
        let copies = slumber.copies.clone();
        let copy_stream = self.copy_stream()?;
        for &(addr, off, n) in &copies {
            self.device
                .copy_to_device_async(addr, host + off, n, copy_stream)?;
        }
        let ev = self.take_event()?;
        let r = self.device.record_event(ev, copy_stream);
        let r = r.and_then(|()| self.device.wait_event(stream, ev));
        let r = r.and_then(|()| {
            self.stats.device_waits += 1;
            self.device.synchronize_event(ev)
        });
        self.spare_events.push(ev);
        r
    }

    /// After a successful wake: the slept chunks count as mapped again.
    fn woke(&mut self) {
        for i in 0..self.segments.len() {
            let Some(seg) = self.segments[i].as_mut() else {
                continue;
            };
            let ops = seg.slept.len() as u64;
            let bytes: u64 = seg.slept.drain(..).map(|(_, n)| n).sum();
            let pool = seg.pool;
            self.reserved_grew(pool, bytes);
            self.stats.calls.maps += ops;
        }
    }

    /// When the pool sleeps, as it is dropped: frees its host copy, unmaps what is still mapped
    /// and gives its ranges back (its blocks need no freeing: they hold no pages). False (nothing
    /// done) when it is awake.
    pub(crate) fn drop_asleep(&mut self) -> bool {
        let Some(slumber) = self.slumber.take() else {
            return false;
        };
        if let Some((host, n)) = slumber.host {
            let _ = self.device.free_host(host, n);
        }
        for seg in self.segments.iter_mut().flatten() {
            let m = Mapper {
                dev: &self.device,
                peers: &self.peers,
                hooks: &self.hooks,
            };
            let _ = seg.unmap(&m, seg.va, seg.size);
            seg.retry_leaked(&self.device);
            let _ = self.device.unreserve(seg.va, seg.size);
        }
        true
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
