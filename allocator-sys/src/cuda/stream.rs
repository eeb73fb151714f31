//! Streams of a [`CudaDevice`]: creating, destroying and waiting for them, work enqueued on
//! them for tests, and graph capture (`cuStreamBeginCapture_v2`, `cuStreamEndCapture`,
//! `cuStreamIsCapturing`).
//!
//! Invariant: a stream handle this device destroys is one it created and has not destroyed (the
//! `streams` set); every other call passes the caller's handle to the driver, which validates
//! it.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::driver::check;
use super::CudaDevice;
use crate::device::{CaptureMode, DeviceError, DeviceResult, StreamId};

/// Host function for [`CudaDevice::sleep_on_stream`]: `data` carries the milliseconds.
extern "C" fn sleep_host_fn(data: *mut c_void) {
    std::thread::sleep(std::time::Duration::from_millis(data as usize as u64));
}

/// The driver's name for `mode`.
fn raw_mode(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    use sys::CUstreamCaptureMode as M;
    match mode {
        CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

impl CudaDevice {
    /// Enqueues on `stream` a host function that sleeps `ms` milliseconds: the stream's later
    /// work (and events recorded after it) waits for it, as it would for a long kernel. For
    /// tests of stream-ordered reuse.
    pub fn sleep_on_stream(&self, stream: StreamId, ms: u32) -> DeviceResult<()> {
        let _bound = self.bind()?;
        let data = ms as usize as *mut c_void;
        // SAFETY: `sleep_host_fn` only reads `data` as an integer (no pointer is dereferenced),
        // and it does not call into CUDA, as host functions must not.
        let code =
            unsafe { sys::cuLaunchHostFunc(stream.0 as sys::CUstream, Some(sleep_host_fn), data) };
        check("cuLaunchHostFunc", code)
    }

    /// Waits for all work on `stream`.
    pub fn wait_stream(&self, stream: StreamId) -> DeviceResult<()> {
        let _bound = self.bind()?;
        // SAFETY: no host memory is involved; the driver validates the stream handle.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream.0 as sys::CUstream)
        })
    }

    /// Creates a stream (`CU_STREAM_DEFAULT`: it synchronises with the legacy default stream).
    pub fn create_stream(&self) -> DeviceResult<StreamId> {
        let _bound = self.bind()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; our context is current on this thread.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, 0)
        })?;
        self.streams.lock().insert(raw as u64);
        Ok(StreamId(raw as u64))
    }

    /// Destroys a stream from [`CudaDevice::create_stream`] (its pending work still completes).
    pub fn destroy_stream(&self, stream: StreamId) -> DeviceResult<()> {
        let mut streams = self.streams.lock();
        if !streams.contains(&stream.0) {
            return Err(DeviceError::invalid(
                "destroy_stream",
                format!("unknown {stream}"),
            ));
        }
        let _bound = self.bind()?;
        // SAFETY: the stream was created by `create_stream` and not destroyed (it is in the set).
        let code = unsafe { sys::cuStreamDestroy_v2(stream.0 as sys::CUstream) };
        check("cuStreamDestroy_v2", code)?;
        streams.remove(&stream.0);
        Ok(())
    }

    /// Waits for all work on this device's context.
    pub fn synchronize(&self) -> DeviceResult<()> {
        let _bound = self.bind()?;
        // SAFETY: our context is current on this thread; the call takes no pointers.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Begins capturing `stream` into a graph in `mode` (`cuStreamBeginCapture_v2`); for tests
    /// of the capture rules. `stream` must be a live stream that is not the legacy default one.
    pub fn begin_capture(&self, stream: StreamId, mode: CaptureMode) -> DeviceResult<()> {
        let _bound = self.bind()?;
        // SAFETY: no host memory is involved; the driver validates the stream handle.
        let code =
            unsafe { sys::cuStreamBeginCapture_v2(stream.0 as sys::CUstream, raw_mode(mode)) };
        check("cuStreamBeginCapture_v2", code)
    }

    /// Ends the capture of `stream` (`cuStreamEndCapture`) and destroys the graph it made
    /// (`cuGraphDestroy`). An invalidated capture ends with the driver's error 901
    /// (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`), and no graph.
    pub fn end_capture(&self, stream: StreamId) -> DeviceResult<()> {
        let _bound = self.bind()?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: `graph` is a valid out-pointer; the driver validates the stream handle.
        let code = unsafe { sys::cuStreamEndCapture(stream.0 as sys::CUstream, &mut graph) };
        if !graph.is_null() {
            // SAFETY: `graph` was just made by `cuStreamEndCapture` and is owned by no one else.
            check("cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph) })?;
        }
        check("cuStreamEndCapture", code)
    }

    /// Whether a capture of `stream` is underway (`cuStreamIsCapturing`: active or
    /// invalidated). Querying the legacy default stream while a blocking stream is being
    /// captured is the driver's error 906 (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`): true then,
    /// since work or a wait on the legacy stream would join or break that capture.
    pub(super) fn capture_status(&self, stream: StreamId) -> DeviceResult<bool> {
        use sys::CUstreamCaptureStatus as S;
        let _bound = self.bind()?;
        let mut status = S::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a valid out-pointer; the driver validates the stream handle.
        let code = unsafe { sys::cuStreamIsCapturing(stream.0 as sys::CUstream, &mut status) };
        if code == sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT {
            return Ok(true);
        }
        check("cuStreamIsCapturing", code)?;
        Ok(status != S::CU_STREAM_CAPTURE_STATUS_NONE)
    }
}
