//! [`PooledBlas`]: a cuBLAS handle whose workspace is a [`Buffer`] from a pool, one workspace
//! per stream the handle runs on, bound with `cublasSetWorkspace_v2` and bound again whenever the
//! handle's stream changes (`cublasSetStream` resets the workspace to cuBLAS's own).
//!
//! The handle owns its workspaces, so none can be freed while cuBLAS may still use it: they go
//! back to the pool, each on its own stream (after the work queued there), only when the handle
//! is dropped, after `cublasDestroy` (whose failure, after a device fault, is not a panic).
//! Sizing the workspaces and allocating them is the caller's job (`cudalloc::workspace`).

use super::Buffer;
use cudarc::cublas::result::CublasError;
use cudarc::cublas::{sys, CudaBlas};
use cudarc::driver::{CudaStream, DriverError};
use std::fmt;
use std::mem::ManuallyDrop;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

/// Workspace addresses must be multiples of this (cuBLAS documentation of `cublasSetWorkspace`).
const WORKSPACE_ALIGNMENT: u64 = 256;

/// Why a [`PooledBlas`] call failed.
#[derive(Debug)]
pub enum BlasError {
    /// cuBLAS returned an error.
    Cublas(CublasError),
    /// The driver returned an error (ordering the old stream before the new one).
    Driver(DriverError),
    /// The cuBLAS library could not be loaded.
    Unavailable(String),
    /// A workspace that does not fit the request (wrong stream, misaligned, missing, extra).
    Workspace(String),
}

impl fmt::Display for BlasError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlasError::Cublas(e) => write!(f, "cuBLAS error: {e}"),
            BlasError::Driver(e) => write!(f, "driver error: {e}"),
            BlasError::Unavailable(why) => write!(f, "cuBLAS is not available: {why}"),
            BlasError::Workspace(why) => write!(f, "workspace: {why}"),
        }
    }
}

impl std::error::Error for BlasError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            BlasError::Cublas(e) => Some(e),
            BlasError::Driver(e) => Some(e),
            BlasError::Unavailable(_) | BlasError::Workspace(_) => None,
        }
    }
}

impl From<CublasError> for BlasError {
    fn from(e: CublasError) -> Self {
        BlasError::Cublas(e)
    }
}

impl From<DriverError> for BlasError {
    fn from(e: DriverError) -> Self {
        BlasError::Driver(e)
    }
}

/// Ok when libcublas can be loaded; cudarc would panic on first use otherwise.
fn cublas_present() -> Result<(), BlasError> {
    // SAFETY: `is_culib_present` only tries to open candidate library names and closes them.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(BlasError::Unavailable(
            "libcublas was not found on the library path".into(),
        ))
    }
}

/// A cuBLAS handle with pool-backed workspaces; see the module documentation.
#[derive(Debug)]
pub struct PooledBlas {
    // Dropped by hand in `Drop`, first: the handle goes before the memory it may use.
    blas: ManuallyDrop<CudaBlas>,
    stream: Arc<CudaStream>,
    workspaces: Vec<Buffer<u8>>,
}

impl Drop for PooledBlas {
    /// Destroys the handle, then (as fields) the workspaces. cudarc's `CudaBlas` unwraps the
    /// status of `cublasDestroy`: after a device fault that call can fail, and the panic is
    /// caught here, so dropping a handle never panics in the caller (the panic hook still
    /// prints it; the handle is gone either way).
    fn drop(&mut self) {
        // SAFETY: `blas` is taken out once, here, and `self` is never used after `drop`.
        let blas = unsafe { ManuallyDrop::take(&mut self.blas) };
        let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(blas)));
    }
}

impl PooledBlas {
    /// Creates a handle on `stream` and binds `workspace` (which must be allocated on `stream`)
    /// as its workspace there. An empty workspace is bound as none at all (cuBLAS then picks
    /// algorithms that need none).
    pub fn new(stream: Arc<CudaStream>, workspace: Buffer<u8>) -> Result<PooledBlas, BlasError> {
        cublas_present()?;
        check_workspace(&stream, &workspace)?;
        let blas = CudaBlas::new(stream.clone())?;
        bind(&blas, &workspace)?;
        Ok(PooledBlas {
            blas: ManuallyDrop::new(blas),
            stream,
            workspaces: vec![workspace],
        })
    }

    /// The cudarc handle, for `Gemm`/`Gemv` calls (they run on [`PooledBlas::stream`]).
    pub fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// The stream the handle runs on now.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The workspace this handle uses on `stream`, if it ran there.
    pub fn workspace_for(&self, stream: &CudaStream) -> Option<&Buffer<u8>> {
        self.workspaces.iter().find(|w| **w.owner() == *stream)
    }

    /// Every workspace the handle holds, one per stream it ran on.
    pub fn workspaces(&self) -> &[Buffer<u8>] {
        &self.workspaces
    }

    /// Moves the handle to `stream` and binds its workspace there. `workspace` must be `Some`
    /// (allocated on `stream`) exactly when the handle has none for `stream` yet
    /// ([`PooledBlas::workspace_for`]). The new stream first waits for the work queued on the
    /// old one, so work through this handle stays in the order it was issued.
    pub fn set_stream(
        &mut self,
        stream: Arc<CudaStream>,
        workspace: Option<Buffer<u8>>,
    ) -> Result<(), BlasError> {
        if **stream.context() != **self.stream.context() {
            return Err(BlasError::Workspace(
                "the stream belongs to another context than the handle".into(),
            ));
        }
        let known = self.workspace_for(&stream).is_some();
        match (&workspace, known) {
            (None, false) => {
                return Err(BlasError::Workspace(
                    "the handle has no workspace for this stream and none was given".into(),
                ))
            }
            (Some(_), true) => {
                return Err(BlasError::Workspace(
                    "the handle already has a workspace for this stream".into(),
                ))
            }
            (Some(w), false) => check_workspace(&stream, w)?,
            (None, true) => {}
        }
        if *stream == *self.stream {
            return Ok(());
        }
        stream.join(&self.stream)?;
        // SAFETY: cudarc marks this unsafe because work on two streams could then touch the same
        // memory concurrently. The new stream waits for everything queued on the old one (the
        // join above); buffers used later through cudarc's traits order themselves; and each
        // stream has its own workspace, so the handle's scratch memory is never shared.
        unsafe { self.blas.set_stream(stream.clone()) }?;
        self.stream = stream;
        if let Some(w) = workspace {
            self.workspaces.push(w);
        }
        let ws = self
            .workspace_for(&self.stream)
            .ok_or_else(|| BlasError::Workspace("workspace vanished".into()))?;
        bind(&self.blas, ws)
    }
}

fn check_workspace(stream: &CudaStream, ws: &Buffer<u8>) -> Result<(), BlasError> {
    if **ws.owner() != *stream {
        return Err(BlasError::Workspace(
            "the workspace was allocated on another stream".into(),
        ));
    }
    if ws.device_address() & (WORKSPACE_ALIGNMENT - 1) != 0 {
        return Err(BlasError::Workspace(format!(
            "address {:#x} is not a multiple of {WORKSPACE_ALIGNMENT}",
            ws.device_address()
        )));
    }
    Ok(())
}

/// `cublasSetWorkspace_v2(handle, ws, size)` (an empty buffer: no workspace).
fn bind(blas: &CudaBlas, ws: &Buffer<u8>) -> Result<(), BlasError> {
    let (ptr, size) = match ws.num_bytes() {
        0 => (std::ptr::null_mut(), 0),
        n => (ws.device_address() as *mut std::ffi::c_void, n),
    };
    // SAFETY: the handle is live (owned by `blas`). `ptr` is null with size 0, or the start of
    // `size` bytes of device memory, 256-byte aligned (checked when the buffer was accepted),
    // allocated on the handle's current stream. The `PooledBlas` that owns `blas` also owns the
    // buffer and drops it only after the handle, so cuBLAS never uses freed memory.
    unsafe { sys::cublasSetWorkspace_v2(*blas.handle(), ptr, size) }.result()?;
    Ok(())
}
