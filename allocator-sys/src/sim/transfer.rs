//! Pinned host memory, copies between it and the device and within the device, and the
//! streams a [`SimDevice`](super::SimDevice) makes: the calls sleep, wake and re-paging use.
//!
//! Pinned host buffers are handed out from [`HOST_BASE`] upwards, each at a fresh address
//! (never reused, so a stale pointer is always refused), and keep their bytes in sparse host
//! storage. A copy runs at once when it is enqueued (simulated streams order nothing but
//! events): with host backing it moves the bytes, reading never-written device bytes as zero;
//! without it, it checks the host side only and moves nothing, so a device without host
//! backing (every replay) pays nothing for contents. A copy between two device ranges checks,
//! with host backing or without, that both are accessible and do not overlap. A stream made by
//! `open_stream` is a plain simulated stream; `wait_event` checks its arguments and orders nothing, since copies
//! have already run.
//!
//! Invariants: host buffers do not overlap; a copy touches only one live host buffer and, with
//! host backing, only live segments or accessible mapped pages; streams destroyed are streams
//! made and not yet destroyed.

use super::space::Sparse;
use super::{SimDevice, State};
use crate::device::{Call, DeviceError, DevicePtr, DeviceResult, EventHandle, HostPtr, StreamId};
use std::collections::{BTreeMap, HashSet};

/// First address of pinned host memory.
pub const HOST_BASE: u64 = 0x1000_0000_0000;
/// Streams made by `open_stream` have this bit set, apart from those tests name.
const MADE_STREAM: u64 = 0x5eed_0000_0000;

/// One pinned host buffer.
#[derive(Debug)]
struct HostBuf {
    size: u64,
    data: Sparse,
}

/// Host buffers and made streams.
#[derive(Debug, Default)]
pub(super) struct Transfers {
    bufs: BTreeMap<u64, HostBuf>,
    next: u64,
    made: HashSet<StreamId>,
}

impl Transfers {
    /// The buffer holding `ptr..ptr + len` (its start), if one does.
    fn holding(&self, ptr: u64, len: u64) -> Option<u64> {
        let (&base, b) = self.bufs.range(..=ptr).next_back()?;
        (ptr.checked_add(len)? <= base + b.size).then_some(base)
    }

    /// Bytes of live pinned host buffers.
    pub(super) fn bytes(&self) -> u64 {
        self.bufs.values().map(|b| b.size).sum()
    }
}

/// An invalid-argument error of `call`.
fn invalid(call: Call, msg: String) -> DeviceError {
    DeviceError::invalid(call.name(), msg)
}

impl SimDevice {
    pub(super) fn sim_alloc_host(&self, size: u64) -> DeviceResult<HostPtr> {
        let mut s = self.enter(Call::AllocHost, size)?;
        if size == 0 {
            return Err(invalid(Call::AllocHost, "zero-size allocation".into()));
        }
        let t = &mut s.transfers;
        let ptr = t.next.max(HOST_BASE);
        t.next = ptr + size.next_multiple_of(4096) + 4096;
        let data = Sparse::default();
        t.bufs.insert(ptr, HostBuf { size, data });
        Ok(ptr)
    }

    pub(super) fn sim_free_host(&self, ptr: HostPtr, size: u64) -> DeviceResult<()> {
        let mut s = self.enter(Call::FreeHost, size)?;
        match s.transfers.bufs.get(&ptr) {
            Some(b) if b.size == size => {
                s.transfers.bufs.remove(&ptr);
                Ok(())
            }
            _ => Err(invalid(
                Call::FreeHost,
                format!("no host buffer of {size} bytes at {ptr:#x}"),
            )),
        }
    }

    /// Checks the stream and the host range of a copy; returns the host buffer's start.
    fn copy_args(
        &self,
        s: &State,
        call: Call,
        host: u64,
        n: u64,
        st: StreamId,
    ) -> DeviceResult<u64> {
        if s.foreign.contains(&st) {
            return Err(invalid(call, format!("{st} belongs to another device")));
        }
        let base = s.transfers.holding(host, n);
        base.ok_or_else(|| invalid(call, format!("{host:#x} + {n} is not in one host buffer")))
    }

    pub(super) fn sim_copy_to_host_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        n: u64,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let mut s = self.enter(Call::CopyToHostAsync, n)?;
        let base = self.copy_args(&s, Call::CopyToHostAsync, dst, n, stream)?;
        if !self.cfg.host_backing || n == 0 {
            return Ok(());
        }
        let mut bytes = vec![0u8; n as usize];
        self.read_locked(Call::CopyToHostAsync.name(), &s, src, &mut bytes)?;
        let buf = s.transfers.bufs.get_mut(&base).expect("checked");
        buf.data.write(dst - base, &bytes);
        Ok(())
    }

    pub(super) fn sim_copy_to_device_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        n: u64,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let mut s = self.enter(Call::CopyToDeviceAsync, n)?;
        let base = self.copy_args(&s, Call::CopyToDeviceAsync, src, n, stream)?;
        if !self.cfg.host_backing || n == 0 {
            return Ok(());
        }
        let mut bytes = vec![0u8; n as usize];
        s.transfers.bufs[&base].data.read(src - base, &mut bytes);
        self.write_locked(Call::CopyToDeviceAsync.name(), &mut s, dst, &bytes)
    }

    pub(super) fn sim_copy_device_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: u64,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let call = Call::CopyDeviceAsync;
        let mut s = self.enter(call, n)?;
        if s.foreign.contains(&stream) {
            return Err(invalid(call, format!("{stream} belongs to another device")));
        }
        if src < dst.saturating_add(n) && dst < src.saturating_add(n) {
            let msg = format!("{src:#x} + {n} overlaps {dst:#x}");
            return Err(invalid(call, msg));
        }
        Self::accessible(call.name(), &s, src, n)?;
        Self::accessible(call.name(), &s, dst, n)?;
        if !self.cfg.host_backing || n == 0 {
            return Ok(());
        }
        let mut bytes = vec![0u8; n as usize];
        self.read_locked(call.name(), &s, src, &mut bytes)?;
        self.write_locked(call.name(), &mut s, dst, &bytes)
    }

    pub(super) fn sim_open_stream(&self) -> DeviceResult<StreamId> {
        let mut s = self.enter(Call::OpenStream, 0)?;
        let stream = StreamId(MADE_STREAM | s.handle());
        s.transfers.made.insert(stream);
        Ok(stream)
    }

    pub(super) fn sim_close_stream(&self, stream: StreamId) -> DeviceResult<()> {
        let mut s = self.enter(Call::CloseStream, 0)?;
        if !s.transfers.made.remove(&stream) {
            return Err(invalid(Call::CloseStream, format!("unknown {stream}")));
        }
        Ok(())
    }

    pub(super) fn sim_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        let mut s = self.enter(Call::WaitEvent, 0)?;
        s.event(Call::WaitEvent, event)?;
        if s.foreign.contains(&stream) {
            return Err(invalid(
                Call::WaitEvent,
                format!("{stream} belongs to another device"),
            ));
        }
        Ok(())
    }

    /// Bytes of pinned host memory handed out and not freed (a test hook).
    pub fn host_bytes(&self) -> u64 {
        self.state.lock().transfers.bytes()
    }

    /// Copies pinned host memory at `ptr` into `out` (a test hook; never-written bytes read as
    /// zero). The range must lie inside one live host buffer.
    pub fn read_host(&self, ptr: HostPtr, out: &mut [u8]) -> DeviceResult<()> {
        let s = self.state.lock();
        let n = out.len() as u64;
        let base = s.transfers.holding(ptr, n);
        let base = base.ok_or_else(|| invalid(Call::CopyToHostAsync, format!("{ptr:#x} + {n}")))?;
        s.transfers.bufs[&base].data.read(ptr - base, out);
        Ok(())
    }
}
