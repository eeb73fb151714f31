//! Wake: new pages at the addresses a sleep unmapped, and the offloaded bytes copied back
//! (`sleep` describes the sleeping state).
//!
//! # Order of work
//!
//! `wake(stream)` claims the slept bytes against the limit, then walks every range's slept
//! chunks in address order: it maps a new page at each chunk's old address and with its old
//! size, and enqueues on the copy stream, from the host buffer, the copies of the bytes lying
//! in that chunk (they run while the next chunks are mapped). Chunks a sleep could not unmap
//! kept their bytes and get no copy. After the last
//! chunk it records one event on the copy stream and makes `stream` and every stream that used
//! the pool's memory wait for it; the host does not wait. The host buffer is kept for the next
//! sleep (a later copy into it is enqueued on the same copy stream, so it runs after these).
//!
//! A failure (out of memory included) waits on the host for the copies already enqueued,
//! unmaps every chunk this attempt mapped and leaves the pool asleep with its host copy; the
//! pages a failed call left behind (strays) are released again at the next attempt before it
//! maps at their addresses.

use super::segment::Mapper;
use super::sleep::pieces;
use super::Core;
use crate::error::AllocError;
use cudalloc_sys::{Device, DeviceError, StreamId};

impl<D: Device> Core<D> {
    /// Wakes the pool (see the module docs): later work on `stream`, and on every stream that
    /// used the pool's memory, runs after the restored bytes are in place. Nothing when it is
    /// awake. Refused during a capture; out of memory (the limit or the device) is
    /// [`AllocError::OutOfMemory`], and the pool stays asleep, intact.
    pub(crate) fn wake(&mut self, stream: StreamId) -> Result<(), AllocError> {
        let Some(bytes) = self.slumber.as_ref().map(|s| s.bytes) else {
            return Ok(());
        };
        self.refuse_during_capture("wake")?;
        if self.over_limit(bytes) || !self.claim(bytes) {
            return Err(self.wake_oom(bytes));
        }
        if let Err(e) = self.map_and_restore(stream) {
            if let Some(s) = self.copy_stream {
                // Best effort: a driver that cannot wait cannot copy either.
                let _ = self.wait_stream(s);
            }
            self.unmap_woken();
            self.sub_reserved(bytes);
            return Err(if e.is_out_of_memory() {
                self.wake_oom(bytes)
            } else {
                e.into()
            });
        }
        self.slumber = None;
        self.woke();
        Ok(())
    }

    /// The out-of-memory error of a wake that needed `bytes`.
    fn wake_oom(&self, bytes: u64) -> AllocError {
        AllocError::OutOfMemory {
            device: self.device.ordinal(),
            requested: bytes,
            rounded: bytes,
            reserved: self.reserved,
            allocated: self.stats.allocated_bytes.0[0].current as u64,
            device_free: self.device.mem_info().map(|m| m.0).unwrap_or(0),
            limit: self.limit,
        }
    }

    /// Maps a new page for every slept chunk, at its address, enqueueing the copies of the
    /// bytes lying in it as soon as it is mapped, and orders `stream` and the pool's users
    /// after the copies. Chunks a sleep left mapped kept their bytes: nothing is copied into
    /// them. The slept lists are untouched (the caller undoes a failure).
    fn map_and_restore(&mut self, stream: StreamId) -> Result<(), DeviceError> {
        let copies = self.slumber.as_ref().expect("asleep").copies.clone();
        let from = match (copies.is_empty(), self.host_buffer) {
            (false, Some((host, _))) => Some((host, self.copy_stream()?)),
            _ => None,
        };
        for i in 0..self.segments.len() {
            let Some(seg) = self.segments[i].as_mut() else {
                continue;
            };
            let before = seg.stray_bytes();
            seg.retry_leaked(&self.device);
            let mut mapped = Ok(());
            for &(at, size) in &seg.slept.clone() {
                let m = Mapper {
                    dev: &self.device,
                    peers: &self.peers,
                    hooks: &self.hooks,
                };
                mapped = seg.map_exact(&m, at, size);
                if let (Ok(()), Some((host, s))) = (&mapped, from) {
                    mapped = pieces(&copies, at, at + size).try_for_each(|(addr, offset, len)| {
                        self.device
                            .copy_to_device_async(addr, host + offset, len, s)
                    });
                }
                if mapped.is_err() {
                    break;
                }
            }
            self.track_strays(i, before);
            mapped?;
        }
        self.order_after_copies(stream, from.map(|f| f.1))
    }

    /// Makes `stream` and every stream that used the pool's memory wait for the work enqueued
    /// so far on `copy_stream` (nothing without one).
    fn order_after_copies(
        &mut self,
        stream: StreamId,
        copy_stream: Option<StreamId>,
    ) -> Result<(), DeviceError> {
        let Some(copy_stream) = copy_stream else {
            return Ok(());
        };
        let mut streams = self.user_streams();
        streams.insert(stream);
        let ev = self.take_event()?;
        let r = self.device.record_event(ev, copy_stream);
        let r = r.and_then(|()| {
            streams
                .iter()
                .try_for_each(|&s| self.device.wait_event(s, ev))
        });
        self.spare_events.push(ev);
        r
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
                        // Still mapped: a stray until a later call unmaps it. The failed unmap
                        // announced it again; a stuck chunk is not announced (`segment`).
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
}
