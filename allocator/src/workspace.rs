//! cuBLAS workspaces from the pool, sized the way PyTorch sizes them.
//!
//! cuBLAS needs scratch memory for some algorithms. Left alone it allocates its own, outside
//! any caching allocator; PyTorch instead gives each (handle, stream) pair a workspace from its
//! caching allocator, and so does [`CublasHandle`]: one workspace [`Buffer`] per stream the
//! handle runs on, bound with `cublasSetWorkspace_v2`, bound again whenever the handle's stream
//! changes (`cublasSetStream` resets cuBLAS to its own workspace), counted in the allocator's
//! statistics like any allocation, and returned to the pool when the handle is dropped.
//!
//! # Sizes
//!
//! - cuBLAS: `CUBLAS_WORKSPACE_CONFIG`, a list of `:SIZE:COUNT` entries (`SIZE` in KiB), e.g.
//!   `:4096:8` or `:4096:2:16:8`; the workspace is the sum of `SIZE * COUNT` KiB. Unset (or
//!   empty): PyTorch's default, 32 MiB on compute capability 9.x and `:4096:2:16:8` (8.125 MiB)
//!   otherwise. Unlike PyTorch, which skips what it cannot read, a malformed entry is an error
//!   naming the entry.
//! - cuBLASLt: `CUBLASLT_WORKSPACE_SIZE` in KiB, default 1024 KiB (PyTorch's). cuBLASLt takes
//!   its workspace per call, so [`CublasHandle::lt_workspace`] only hands out a buffer (one per
//!   stream) for the caller to pass.
//!
//! The parsers are pure functions of the variable's value ([`workspace_bytes`],
//! [`lt_workspace_bytes`]); [`CachingAllocator::cublas`] reads the environment.
//!
//! # Recording
//!
//! [`RecordingAllocator<CudaDevice, W>`] has the same `cublas` and `cublas_with` (one
//! implementation, over the pool abstraction the buffer constructors share): each workspace's
//! allocation writes `alloc`, and its free when the handle is dropped writes `free_requested`
//! and `free_completed`. The handle holds an `Arc` of the recorder, like a buffer does.

use crate::allocator::CachingAllocator;
use crate::error::AllocError;
use crate::interop::{driver_error, raw_buffer, BufferSource};
use crate::record::RecordingAllocator;
use crate::sync::Arc;
use cudalloc_sys::buffer::cudarc::cublas::CudaBlas;
use cudalloc_sys::buffer::cudarc::driver::CudaStream;
use cudalloc_sys::buffer::{BlasError, Buffer, PooledBlas};
use cudalloc_sys::CudaDevice;
use std::fmt;
use std::io::Write;

/// The cuBLAS workspace variable.
pub const WORKSPACE_ENV: &str = "CUBLAS_WORKSPACE_CONFIG";
/// The cuBLASLt workspace variable (KiB).
pub const LT_WORKSPACE_ENV: &str = "CUBLASLT_WORKSPACE_SIZE";
/// PyTorch's default cuBLASLt workspace, in KiB.
pub const DEFAULT_LT_WORKSPACE_KIB: u64 = 1024;

/// One `:SIZE:COUNT` entry: `count` buffers of `size_kib` KiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceEntry {
    /// Size of one buffer, KiB.
    pub size_kib: u64,
    /// Number of buffers.
    pub count: u64,
}

/// A parsed `CUBLAS_WORKSPACE_CONFIG`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceConfig {
    /// The entries, in order.
    pub entries: Vec<WorkspaceEntry>,
}

/// A malformed workspace variable: which variable, which entry, what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceConfigError {
    /// The variable.
    pub var: &'static str,
    /// The offending entry, as written.
    pub entry: String,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for WorkspaceConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: entry `{}`: {}", self.var, self.entry, self.reason)
    }
}

impl std::error::Error for WorkspaceConfigError {}

fn bad(var: &'static str, entry: &str, reason: impl Into<String>) -> WorkspaceConfigError {
    WorkspaceConfigError {
        var,
        entry: entry.to_string(),
        reason: reason.into(),
    }
}

/// A whole number written in ASCII digits only.
fn number(
    var: &'static str,
    entry: &str,
    field: &str,
    what: &str,
) -> Result<u64, WorkspaceConfigError> {
    if field.is_empty() {
        return Err(bad(var, entry, format!("{what} is missing")));
    }
    if !field.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad(
            var,
            entry,
            format!("{what} `{field}` is not a whole number"),
        ));
    }
    field
        .parse()
        .map_err(|_| bad(var, entry, format!("{what} `{field}` is too large")))
}

impl WorkspaceConfig {
    /// Parses `:SIZE:COUNT` entries, written one after the other (`:4096:2:16:8`) or separated
    /// by commas or spaces. An empty string has no entries.
    pub fn parse(s: &str) -> Result<WorkspaceConfig, WorkspaceConfigError> {
        let var = WORKSPACE_ENV;
        let mut entries = Vec::new();
        for chunk in s.split(|c: char| c == ',' || c.is_whitespace()) {
            if chunk.is_empty() {
                continue;
            }
            let Some(body) = chunk.strip_prefix(':') else {
                return Err(bad(
                    var,
                    chunk,
                    "an entry is `:SIZE:COUNT` and starts with `:`",
                ));
            };
            let fields: Vec<&str> = body.split(':').collect();
            for pair in fields.chunks(2) {
                let entry = format!(":{}", pair.join(":"));
                let size_kib = number(var, &entry, pair[0], "SIZE")?;
                let count = number(var, &entry, pair.get(1).copied().unwrap_or(""), "COUNT")?;
                if size_kib
                    .checked_mul(1024)
                    .and_then(|b| b.checked_mul(count))
                    .is_none()
                {
                    return Err(bad(var, &entry, "SIZE x COUNT overflows"));
                }
                entries.push(WorkspaceEntry { size_kib, count });
            }
        }
        let cfg = WorkspaceConfig { entries };
        if cfg.checked_bytes().is_none() {
            return Err(bad(var, s, "the total size overflows"));
        }
        Ok(cfg)
    }

    /// PyTorch's default: `:4096:8` (32 MiB) on compute capability 9.x, `:4096:2:16:8` before.
    pub fn pytorch_default(cc_major: i32) -> WorkspaceConfig {
        let e = |size_kib, count| WorkspaceEntry { size_kib, count };
        let entries = if cc_major == 9 {
            vec![e(4096, 8)]
        } else {
            vec![e(4096, 2), e(16, 8)]
        };
        WorkspaceConfig { entries }
    }

    fn checked_bytes(&self) -> Option<u64> {
        self.entries.iter().try_fold(0u64, |sum, e| {
            e.size_kib
                .checked_mul(1024)?
                .checked_mul(e.count)?
                .checked_add(sum)
        })
    }

    /// The workspace size: the sum of `SIZE * COUNT` KiB.
    pub fn bytes(&self) -> u64 {
        self.checked_bytes().unwrap_or(u64::MAX)
    }
}

/// Workspace bytes for `CUBLAS_WORKSPACE_CONFIG = value` (`None` or blank: PyTorch's default for
/// compute capability `cc_major`).
pub fn workspace_bytes(value: Option<&str>, cc_major: i32) -> Result<u64, WorkspaceConfigError> {
    match value.map(str::trim) {
        None | Some("") => Ok(WorkspaceConfig::pytorch_default(cc_major).bytes()),
        Some(v) => Ok(WorkspaceConfig::parse(v)?.bytes()),
    }
}

/// cuBLASLt workspace bytes for `CUBLASLT_WORKSPACE_SIZE = value` (KiB; `None` or blank:
/// [`DEFAULT_LT_WORKSPACE_KIB`]).
pub fn lt_workspace_bytes(value: Option<&str>) -> Result<u64, WorkspaceConfigError> {
    let kib = match value.map(str::trim) {
        None | Some("") => DEFAULT_LT_WORKSPACE_KIB,
        Some(v) => number(LT_WORKSPACE_ENV, v, v, "the size in KiB")?,
    };
    kib.checked_mul(1024)
        .ok_or_else(|| bad(LT_WORKSPACE_ENV, &kib.to_string(), "the size overflows"))
}

/// Why a [`CublasHandle`] could not be made or moved.
#[derive(Debug)]
#[non_exhaustive]
pub enum WorkspaceError {
    /// A workspace variable is malformed.
    Config(WorkspaceConfigError),
    /// The workspace could not be allocated.
    Alloc(AllocError),
    /// cuBLAS (or the driver underneath) refused.
    Blas(BlasError),
}

impl fmt::Display for WorkspaceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkspaceError::Config(e) => write!(f, "{e}"),
            WorkspaceError::Alloc(e) => write!(f, "cuBLAS workspace: {e}"),
            WorkspaceError::Blas(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for WorkspaceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WorkspaceError::Config(e) => Some(e),
            WorkspaceError::Alloc(e) => Some(e),
            WorkspaceError::Blas(e) => Some(e),
        }
    }
}

impl From<WorkspaceConfigError> for WorkspaceError {
    fn from(e: WorkspaceConfigError) -> Self {
        WorkspaceError::Config(e)
    }
}

impl From<AllocError> for WorkspaceError {
    fn from(e: AllocError) -> Self {
        WorkspaceError::Alloc(e)
    }
}

impl From<BlasError> for WorkspaceError {
    fn from(e: BlasError) -> Self {
        WorkspaceError::Blas(e)
    }
}

/// A workspace's length as a buffer's; [`AllocError::TooLarge`] where `usize` is too narrow.
fn to_len(bytes: u64) -> Result<usize, WorkspaceError> {
    usize::try_from(bytes).map_err(|_| {
        WorkspaceError::Alloc(AllocError::TooLarge {
            requested: bytes,
            limit: usize::MAX as u64,
        })
    })
}

/// Where a handle's workspaces come from: the pool that made it, recorded or not.
trait WorkspaceSource: Send + Sync {
    /// A `bytes`-byte workspace for `stream`, uninitialized.
    fn workspace(
        self: Arc<Self>,
        bytes: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<Buffer<u8>, WorkspaceError>;
}

impl<P: BufferSource> WorkspaceSource for P {
    fn workspace(
        self: Arc<Self>,
        bytes: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<Buffer<u8>, WorkspaceError> {
        Ok(raw_buffer::<P, u8>(&self, to_len(bytes)?, stream)?)
    }
}

/// A cuBLAS handle whose workspaces come from a [`CachingAllocator`] or a
/// [`RecordingAllocator`]; see the module documentation.
pub struct CublasHandle {
    // Field order is drop order: the handle (and the workspaces it may use) first.
    inner: PooledBlas,
    lt: Vec<Buffer<u8>>,
    alloc: Arc<dyn WorkspaceSource>,
    bytes: u64,
    lt_bytes: u64,
}

impl fmt::Debug for CublasHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CublasHandle")
            .field("blas", &self.inner)
            .field("lt_workspaces", &self.lt)
            .field("workspace_bytes", &self.bytes)
            .field("lt_workspace_bytes", &self.lt_bytes)
            .finish_non_exhaustive()
    }
}

/// Workspace sizes from `CUBLAS_WORKSPACE_CONFIG` and `CUBLASLT_WORKSPACE_SIZE`, or PyTorch's
/// defaults for the compute capability of `stream`'s device.
fn sizes_from_env(stream: &CudaStream) -> Result<(u64, u64), WorkspaceError> {
    let (major, _) = stream
        .context()
        .compute_capability()
        .map_err(|e| WorkspaceError::Alloc(driver_error("cuDeviceGetAttribute", e)))?;
    let bytes = workspace_bytes(std::env::var(WORKSPACE_ENV).ok().as_deref(), major)?;
    let lt_bytes = lt_workspace_bytes(std::env::var(LT_WORKSPACE_ENV).ok().as_deref())?;
    Ok((bytes, lt_bytes))
}

/// A handle on `stream` whose workspaces come from `pool`.
fn new_handle<P: BufferSource>(
    pool: &Arc<P>,
    stream: &Arc<CudaStream>,
    bytes: u64,
    lt_bytes: u64,
) -> Result<CublasHandle, WorkspaceError> {
    let source: Arc<dyn WorkspaceSource> = pool.clone();
    let ws = source.clone().workspace(bytes, stream)?;
    Ok(CublasHandle {
        inner: PooledBlas::new(stream.clone(), ws)?,
        lt: Vec::new(),
        alloc: source,
        bytes,
        lt_bytes,
    })
}

/// The handle constructors, once for [`CachingAllocator<CudaDevice>`] and once for
/// [`RecordingAllocator<CudaDevice, W>`], each a call of the shared functions above.
macro_rules! cublas_constructors {
    () => {
        /// A cuBLAS handle on `stream` with a workspace from this allocator, sized from
        /// `CUBLAS_WORKSPACE_CONFIG` and `CUBLASLT_WORKSPACE_SIZE` (or PyTorch's defaults for
        /// the device's compute capability).
        pub fn cublas(
            self: &Arc<Self>,
            stream: &Arc<CudaStream>,
        ) -> Result<CublasHandle, WorkspaceError> {
            let (bytes, lt_bytes) = sizes_from_env(stream)?;
            new_handle(self, stream, bytes, lt_bytes)
        }

        /// A cuBLAS handle on `stream` with `bytes`-byte cuBLAS workspaces (0: cuBLAS gets
        /// none, though the handle still holds the pool's smallest block, 512 bytes, as an
        /// empty buffer) and `lt_bytes`-byte cuBLASLt workspaces.
        pub fn cublas_with(
            self: &Arc<Self>,
            stream: &Arc<CudaStream>,
            bytes: u64,
            lt_bytes: u64,
        ) -> Result<CublasHandle, WorkspaceError> {
            new_handle(self, stream, bytes, lt_bytes)
        }
    };
}

impl CachingAllocator<CudaDevice> {
    cublas_constructors!();
}

/// The handle constructors of [`CachingAllocator<CudaDevice>`], recorded: each workspace's
/// allocation writes `alloc` and its free (when the handle is dropped) `free_requested` and
/// `free_completed`. The handle holds an `Arc` of the recorder, so drop it before
/// `Arc::try_unwrap` and [`RecordingAllocator::finish`].
impl<W: Write + Send + 'static> RecordingAllocator<CudaDevice, W> {
    cublas_constructors!();
}

impl CublasHandle {
    /// The cudarc handle, for `Gemm`/`Gemv` calls (or `cudalloc_sys::ops`'s checked
    /// wrappers); they run on [`CublasHandle::stream`].
    pub fn blas(&self) -> &CudaBlas {
        self.inner.blas()
    }

    /// The handle and its workspaces, one per stream it ran on.
    pub fn pooled(&self) -> &PooledBlas {
        &self.inner
    }

    /// The stream the handle runs on now.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.inner.stream()
    }

    /// Size of each cuBLAS workspace.
    pub fn workspace_bytes(&self) -> u64 {
        self.bytes
    }

    /// Size of each cuBLASLt workspace.
    pub fn lt_workspace_bytes(&self) -> u64 {
        self.lt_bytes
    }

    /// The cuBLAS workspace bound on the current stream.
    pub fn workspace(&self) -> Option<&Buffer<u8>> {
        self.inner.workspace_for(self.inner.stream())
    }

    /// Moves the handle to `stream` (which first waits for the work queued on the old one),
    /// allocating a workspace there on its first visit, and binds it.
    pub fn set_stream(&mut self, stream: &Arc<CudaStream>) -> Result<(), WorkspaceError> {
        let fresh = match self.inner.workspace_for(stream) {
            Some(_) => None,
            None => Some(self.alloc.clone().workspace(self.bytes, stream)?),
        };
        self.inner.set_stream(stream.clone(), fresh)?;
        Ok(())
    }

    /// A cuBLASLt workspace for the current stream (allocated on first use, kept until the
    /// handle is dropped): pass its address and [`CublasHandle::lt_workspace_bytes`] to
    /// `cublasLtMatmul` calls queued on that stream.
    pub fn lt_workspace(&mut self) -> Result<&Buffer<u8>, WorkspaceError> {
        let stream = self.inner.stream().clone();
        let at = match self.lt.iter().position(|b| **b.owner() == *stream) {
            Some(i) => i,
            None => {
                let b = self.alloc.clone().workspace(self.lt_bytes, &stream)?;
                self.lt.push(b);
                self.lt.len() - 1
            }
        };
        Ok(&self.lt[at])
    }
}
