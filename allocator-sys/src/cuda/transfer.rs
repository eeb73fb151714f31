//! What sleep and wake, and re-paging, need of a [`CudaDevice`](super::CudaDevice): pinned
//! host memory (`cuMemHostAlloc` / `cuMemFreeHost`), asynchronous copies
//! (`cuMemcpyDtoHAsync_v2`, `cuMemcpyHtoDAsync_v2`, and `cuMemcpyDtoDAsync_v2` between device
//! ranges), a non-blocking stream of the allocator's own (`cuStreamCreate` with
//! `CU_STREAM_NON_BLOCKING`) and a stream waiting for an event (`cuStreamWaitEvent`).
//!
//! Invariant: a host buffer is in the memory table's `host` map from its allocation until its
//! free, and the table's lock is held across every copy's enqueue and every free, so a copy
//! never names host memory that was freed; `cuMemFreeHost` itself waits for the copies enqueued
//! before it.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::driver::{check, check_alloc};
use super::CudaDevice;
use crate::device::{DeviceError, DevicePtr, DeviceResult, EventHandle, HostPtr, StreamId};

impl CudaDevice {
    pub(super) fn cuda_alloc_host(&self, size: u64) -> DeviceResult<HostPtr> {
        if size == 0 {
            return Err(DeviceError::invalid("alloc_host", "zero-size allocation"));
        }
        let _bound = self.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer; our context is current on this thread.
        let code = unsafe { sys::cuMemHostAlloc(&mut ptr, size as usize, 0) };
        check_alloc("cuMemHostAlloc", size, code)?;
        self.memory.lock().host.insert(ptr as u64, size);
        Ok(ptr as u64)
    }

    pub(super) fn cuda_free_host(&self, ptr: HostPtr, size: u64) -> DeviceResult<()> {
        let mut mem = self.memory.lock();
        if mem.host.get(&ptr) != Some(&size) {
            let msg = format!("no host buffer of {size} bytes at {ptr:#x}");
            return Err(DeviceError::invalid("free_host", msg));
        }
        let _bound = self.bind()?;
        // SAFETY: `ptr` came from `cuMemHostAlloc` and was not freed (it is in the table, whose
        // lock is held until it is removed).
        check("cuMemFreeHost", unsafe {
            sys::cuMemFreeHost(ptr as *mut c_void)
        })?;
        mem.host.remove(&ptr);
        Ok(())
    }

    /// The error for a copy whose host range is not inside one live host buffer.
    fn not_host(call: &'static str, ptr: u64, n: u64) -> DeviceError {
        DeviceError::invalid(call, format!("{ptr:#x} + {n} is not in one host buffer"))
    }

    pub(super) fn cuda_copy_to_host_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        n: u64,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let mem = self.memory.lock();
        if !mem.in_host_buffer(dst, n) {
            return Err(Self::not_host("copy_to_host_async", dst, n));
        }
        let _bound = self.bind()?;
        let raw = stream.0 as sys::CUstream;
        // SAFETY: `dst..dst + n` lies inside a live pinned buffer, which cannot be freed while
        // the table's lock is held, and `cuMemFreeHost` waits for this copy; the driver checks
        // the device range and the stream handle.
        let code = unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, n as usize, raw) };
        check("cuMemcpyDtoHAsync_v2", code)
    }

    pub(super) fn cuda_copy_to_device_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        n: u64,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let mem = self.memory.lock();
        if !mem.in_host_buffer(src, n) {
            return Err(Self::not_host("copy_to_device_async", src, n));
        }
        let _bound = self.bind()?;
        let raw = stream.0 as sys::CUstream;
        // SAFETY: as in `cuda_copy_to_host_async`, with the host range read instead of written.
        let code = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, n as usize, raw) };
        check("cuMemcpyHtoDAsync_v2", code)
    }

    pub(super) fn cuda_copy_device_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: u64,
        stream: StreamId,
    ) -> DeviceResult<()> {
        if src < dst.saturating_add(n) && dst < src.saturating_add(n) {
            let msg = format!("{src:#x} + {n} overlaps {dst:#x}");
            return Err(DeviceError::invalid("copy_device_async", msg));
        }
        let _bound = self.bind()?;
        let raw = stream.0 as sys::CUstream;
        // SAFETY: no host memory is touched, so nothing of this process's memory can be
        // corrupted. A device range that is not mapped and accessible (which the `Device`
        // contract forbids) faults on the device: the context is lost, and this or a later
        // call returns the error. The stream handle is one the caller got from this device.
        let code = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, n as usize, raw) };
        check("cuMemcpyDtoDAsync_v2", code)
    }

    /// A stream that does not synchronise with the legacy default stream (`open_stream`; the inherent [`CudaDevice::create_stream`] makes a blocking one).
    pub(super) fn cuda_open_stream(&self) -> DeviceResult<StreamId> {
        let _bound = self.bind()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: `raw` is a valid out-pointer; our context is current on this thread.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, flags)
        })?;
        self.streams.lock().insert(raw as u64);
        Ok(StreamId(raw as u64))
    }

    pub(super) fn cuda_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        let events = self.events.read_recursive();
        Self::check_event(&events, "wait_event", event)?;
        let _bound = self.bind()?;
        let (raw_stream, raw_event) = (stream.0 as sys::CUstream, event.0 as sys::CUevent);
        // SAFETY: the event is live and cannot be destroyed while the read lock is held; the
        // driver validates the stream handle.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(raw_stream, raw_event, 0)
        })
    }
}
