//! Loading the CUDA driver and reading its results, for [`super::CudaDevice`].
//!
//! cudarc loads `libcuda` on first use and panics when the library or a symbol is missing. The
//! first call that needs the driver therefore checks, once per process and cached in a
//! `OnceLock`: the library is present (`cudarc::driver::sys::is_culib_present`), every symbol
//! [`SYMBOLS`] lists resolves (inside `catch_unwind`), and `cuInit(0)` succeeds. If any step
//! fails, that call and every later one return [`DeviceError::Unavailable`] with the reason;
//! none panics.
//!
//! Results: `CUDA_ERROR_OUT_OF_MEMORY` from `cuMemAlloc_v2`, `cuMemCreate` or
//! `cuMemAddressReserve` is [`DeviceError::OutOfMemory`] ([`check_alloc`]); any other failing
//! `CUresult` is [`DeviceError::Driver`] with the entry point's name, the numeric code and
//! `cuGetErrorString`'s message ([`check`]).

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::device::{DeviceError, DeviceResult};

/// Every driver entry point that the `cuda` module or `CudaContext::new`/`drop` calls.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuCtxEnablePeerAccess",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuLaunchHostFunc",
    "cuStreamSynchronize",
    "cuMemFreeAsync",
    "cuMemGetInfo_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD8Async",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamGetCtx",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamIsCapturing",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphDestroy",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuStreamWaitEvent",
];

/// Ok once the driver is loaded and initialised; the reason otherwise. Checked once per process.
pub(super) fn driver() -> DeviceResult<()> {
    static STATE: OnceLock<Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(load_driver)
        .clone()
        .map_err(DeviceError::Unavailable)
}

fn load_driver() -> Result<(), String> {
    // SAFETY: `is_culib_present` only tries to open candidate library names and closes them.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda) was not found".into());
    }
    let resolved = std::panic::catch_unwind(resolve_symbols)
        .unwrap_or_else(|_| Err("loading libcuda panicked".into()));
    resolved?;
    // SAFETY: every symbol resolved above; `cuInit` takes no pointers.
    let code = unsafe { sys::cuInit(0) };
    check("cuInit", code).map_err(|e| format!("cuInit failed: {e}"))
}

fn resolve_symbols() -> Result<(), String> {
    // SAFETY: the library is present (checked by the caller); opening it runs its initialisers,
    // which is what loading the CUDA driver means. A panic here is caught by the caller.
    let lib = unsafe { sys::culib() };
    for name in SYMBOLS {
        // SAFETY: looking a symbol up does not call it; the pointer type is never used.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) };
        found.map_err(|e| format!("libcuda lacks {name}: {e}"))?;
    }
    Ok(())
}

/// The driver's message for a `CUresult`.
fn describe(code: sys::CUresult) -> String {
    match result::DriverError(code).error_string() {
        Ok(message) => message.to_string_lossy().into_owned(),
        Err(_) => format!("{code:?}"),
    }
}

pub(super) fn driver_error(call: &'static str, code: sys::CUresult) -> DeviceError {
    DeviceError::Driver {
        call,
        code: code as i32,
        message: describe(code),
    }
}

/// Maps a `CUresult` to Ok or [`DeviceError::Driver`].
pub(super) fn check(call: &'static str, code: sys::CUresult) -> DeviceResult<()> {
    match code {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        code => Err(driver_error(call, code)),
    }
}

/// Like [`check`], but out-of-memory is [`DeviceError::OutOfMemory`] for `requested` bytes.
pub(super) fn check_alloc(
    call: &'static str,
    requested: u64,
    code: sys::CUresult,
) -> DeviceResult<()> {
    match code {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            Err(DeviceError::OutOfMemory { call, requested })
        }
        code => check(call, code),
    }
}
