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
//! pool's copy stream wait for those events and enqueues on it one copy per live allocation
//! (its requested bytes, in address order) into the pool's pinned host buffer (offload), or
//! only waits for those events; with offload the host waits once, for an event recorded after
//! the last copy. Then every chunk is unmapped and released. Nothing is unmapped before the
//! copies completed, and a failure before the unmapping changes nothing (but for a host buffer
//! made for it, which stays for the next sleep).
//!
//! The host buffer is made by the first offloading sleep and kept, while awake too, for the
//! next one (it is made again, larger, when the live allocations outgrow it): pinning host
//! memory costs more than copying it. [`Core::release_host_buffer`] frees it.
//!
//! # Invariants
//!
//! - Asleep ([`Core::asleep`]): the blocks are as they were at `sleep`; every chunk that was
//!   mapped is in its segment's `slept` list or, if its unmap failed, still in `chunks` (and
//!   counted in `reserved`; [`AllocError::SleepIncomplete`] said so, and a second `sleep`
//!   retries the unmap); the pool hands out, frees and releases nothing.
//! - Awake: every segment's `slept` list is empty.
//! - While asleep with offload, the host buffer holds `requested` bytes of each block allocated
//!   at `sleep`, at the offsets listed in the slumber's `copies`; copies into or out of it are
//!   only ever enqueued on the copy stream, so each is ordered after the one before.

use super::block::BlockId;
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

impl Slumber {
    /// Bytes of the copies.
    fn copied(&self) -> u64 {
        self.copies.iter().map(|c| c.len).sum()
    }
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
    /// unmap of the pages a first sleep could not unmap. Refused during a capture
    /// ([`AllocError::DuringCapture`]) and when the pool holds fixed segments
    /// ([`AllocError::SleepUnsupported`]). Pages the driver refuses to unmap leave the pool
    /// asleep with them mapped: [`AllocError::SleepIncomplete`].
    pub(crate) fn sleep<P: Observer>(
        &mut self,
        policy: &mut P,
        offload: bool,
    ) -> Result<(), AllocError> {
        if self.asleep() {
            return self.unmap_everything();
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
                .map(|()| Vec::new())
                .map_err(AllocError::from)
        };
        self.spare_events.extend(events.iter().map(|e| e.1));
        self.slumber = Some(Slumber {
            copies: copied?,
            bytes: 0,
        });
        self.unmap_everything()
    }

    /// The error for `what` during a capture, if one is underway.
    pub(super) fn refuse_during_capture(&self, what: &'static str) -> Result<(), AllocError> {
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
    fn host_buffer(&mut self, bytes: u64) -> Result<HostPtr, DeviceError> {
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

    /// Copies every live allocation into the host buffer on the copy stream, after the users'
    /// `events`, and waits for the copies; returns them.
    fn offload(&mut self, events: &[(StreamId, EventHandle)]) -> Result<Vec<Copy>, AllocError> {
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
        let host = self.host_buffer(total)?;
        for &(_, ev) in events {
            self.device.wait_event(stream, ev)?;
        }
        let enqueued = copies.iter().try_for_each(|c| {
            self.device
                .copy_to_host_async(host + c.offset, c.addr, c.len, stream)
        });
        // Waited for even after a failed enqueue: the copies enqueued before it use the buffer.
        let waited = self.wait_stream(stream);
        enqueued.and(waited)?;
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

    /// Unmaps and releases every chunk still mapped, listing each in its range's `slept` and
    /// counting its bytes in the slumber. A chunk whose unmap fails stays mapped (and counted
    /// in `reserved`): [`AllocError::SleepIncomplete`] with the bytes left and the first
    /// error. A page whose release fails is unmapped and becomes a stray, released later.
    fn unmap_everything(&mut self) -> Result<(), AllocError> {
        let mut first = None;
        let mut total = 0;
        for i in 0..self.segments.len() {
            let Some(seg) = self.segments[i].as_mut() else {
                continue;
            };
            let before = seg.stray_bytes();
            let chunks: Vec<(u64, u64)> = seg.chunks.iter().map(|(&a, c)| (a, c.size)).collect();
            let (mut bytes, mut ops) = (0, 0);
            for (at, size) in chunks {
                let done = seg.unmap(&self.device, at, size);
                if done.range.size == size {
                    seg.slept.push((at, size));
                    bytes += size;
                    ops += 1;
                } else if first.is_none() {
                    first = done.error;
                }
            }
            seg.slept.sort_unstable();
            let pool = seg.pool;
            self.stats.calls.unmaps += ops;
            self.sub_reserved(bytes);
            self.reserved_shrank(pool, bytes);
            self.track_strays(i, before);
            total += bytes;
        }
        let slumber = self.slumber.as_mut().expect("asleep");
        slumber.bytes += total;
        match first {
            None => Ok(()),
            Some(source) => Err(AllocError::SleepIncomplete {
                tag: None,
                mapped: self.mapped_while_asleep(),
                source,
            }),
        }
    }

    /// Bytes of the chunks still mapped while the pool sleeps (an unmap the driver refused).
    pub fn mapped_while_asleep(&self) -> u64 {
        if !self.asleep() {
            return 0;
        }
        self.segments.iter().flatten().map(|s| s.mapped).sum()
    }

    /// When the pool sleeps, as it is dropped: frees its host buffer, unmaps what is still
    /// mapped and gives its ranges back (its blocks need no freeing: they hold no pages). False
    /// (nothing done) when it is awake.
    pub(crate) fn drop_asleep(&mut self) -> bool {
        if self.slumber.take().is_none() {
            return false;
        }
        let _ = self.release_host_buffer();
        for seg in self.segments.iter_mut().flatten() {
            let _ = seg.unmap(&self.device, seg.va, seg.size);
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
