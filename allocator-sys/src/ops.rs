//! Checked device operations of the example engine (feature `ops`, off by default: the
//! allocator needs none of it): the elementwise kernels and cuBLAS products a decoder-only
//! transformer needs, as safe functions over anything implementing cudarc's
//! `DevicePtr`/`DevicePtrMut` (a [`crate::buffer::Buffer`], a `CudaSlice`, a `CudaView`), and
//! the driver's default memory pool counters ([`mempool`]) the engine compares with.
//!
//! They live in this crate because each launch is `unsafe` and its safety rests on the length
//! checks next to it and on the kernels' source (`ops/kernels.cu`); the model that uses them is
//! the example's (`allocator/examples/engine/`).
//!
//! Launching a kernel and calling cuBLAS are `unsafe` in cudarc because nothing stops them from
//! reaching past a buffer. Each function here checks every length (with overflow checks) before
//! the call, and the kernels (`kernels.cu`, compiled once per process with NVRTC) guard their
//! indices too, so callers outside this crate need no `unsafe`. Every call takes the stream to
//! run on and orders itself through `device_ptr`/`device_ptr_mut` on that stream, following
//! cudarc's synchronization contract.
//!
//! Layout conventions: matrices are row-major `[rows, cols]` arrays of `f32`; attention tensors
//! are `[rows, heads, head_dim]`. The cuBLAS wrappers ([`gemm_f32`],
//! [`gemm_strided_batched_f32`]) take cuBLAS's own column-major configuration. The batched
//! decode step's kernels (`ops/decode.rs`) read each sequence's position from device memory, so
//! that a CUDA graph captured once replays at every position.

use cudarc::cublas::result::CublasError;
use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError,
    LaunchArgs, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx, Ptx};
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

mod decode;
pub mod mempool;

pub use decode::{DecodeShape, LINEAR_ROWS};

#[cfg(test)]
mod tests;

const SOURCE: &str = include_str!("ops/kernels.cu");

/// Threads per block of every kernel (the row kernels depend on it).
const THREADS: u32 = 256;

/// Most blocks of a grid-stride launch.
const MAX_BLOCKS: u64 = 1 << 20;

/// Why an operation was not run.
#[derive(Debug)]
pub enum OpsError {
    /// A buffer is too small, a size overflows, or an argument is out of range.
    Shape(String),
    /// The driver returned an error (loading the module, launching).
    Driver(DriverError),
    /// cuBLAS returned an error.
    Blas(CublasError),
    /// NVRTC could not compile the kernels, or could not be loaded.
    Compile(String),
}

impl fmt::Display for OpsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpsError::Shape(m) => write!(f, "shape: {m}"),
            OpsError::Driver(e) => write!(f, "driver error: {e}"),
            OpsError::Blas(e) => write!(f, "cuBLAS error: {e}"),
            OpsError::Compile(m) => write!(f, "kernel compilation: {m}"),
        }
    }
}

impl std::error::Error for OpsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OpsError::Driver(e) => Some(e),
            OpsError::Blas(e) => Some(e),
            OpsError::Shape(_) | OpsError::Compile(_) => None,
        }
    }
}

impl From<DriverError> for OpsError {
    fn from(e: DriverError) -> Self {
        OpsError::Driver(e)
    }
}

fn shape(m: impl Into<String>) -> OpsError {
    OpsError::Shape(m.into())
}

/// `a * b`, or a shape error naming `what`.
fn mul(what: &str, a: usize, b: usize) -> Result<usize, OpsError> {
    a.checked_mul(b)
        .ok_or_else(|| shape(format!("{what}: {a} x {b} overflows")))
}

/// Ok if `s` holds at least `elems` elements.
fn need<T, S: DeviceSlice<T> + ?Sized>(what: &str, s: &S, elems: usize) -> Result<(), OpsError> {
    if s.len() < elems {
        return Err(shape(format!(
            "{what} has {} elements, needs {elems}",
            s.len()
        )));
    }
    Ok(())
}

fn to_u32(what: &str, v: usize) -> Result<u32, OpsError> {
    u32::try_from(v).map_err(|_| shape(format!("{what} = {v} does not fit in 32 bits")))
}

/// A grid-stride launch over `n` elements.
fn stride_cfg(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(THREADS as u64).clamp(1, MAX_BLOCKS);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
fn rows_cfg(rows: usize) -> Result<LaunchConfig, OpsError> {
    let blocks = to_u32("rows", rows)?;
    if blocks > i32::MAX as u32 {
        return Err(shape(format!("{rows} rows exceed the grid limit")));
    }
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Queues the prepared launch.
///
/// # Safety
///
/// `args` match the kernel's parameters in number, order and type (pointers as `u64` device
/// addresses of live buffers), and every access the kernel makes with those arguments is inside
/// those buffers. The buffers' `SyncOnDrop` guards are dropped only after this returns.
unsafe fn launch(args: &mut LaunchArgs<'_>, cfg: LaunchConfig) -> Result<(), OpsError> {
    // SAFETY: the caller's promise above is exactly `LaunchArgs::launch`'s contract.
    unsafe { args.launch(cfg) }?;
    Ok(())
}

/// The compiled kernels (once per process).
fn ptx() -> Result<Ptx, OpsError> {
    static PTX: OnceLock<Result<Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        // SAFETY: `is_culib_present` only tries to open candidate library names and closes them.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err("libnvrtc was not found on the library path".into());
        }
        compile_ptx(SOURCE).map_err(|e| format!("{e:?}"))
    })
    .clone()
    .map_err(OpsError::Compile)
}

/// The kernels of this module, loaded into one context.
#[derive(Debug, Clone)]
pub struct Kernels {
    fill: CudaFunction,
    copy: CudaFunction,
    embedding: CudaFunction,
    rmsnorm: CudaFunction,
    rope: CudaFunction,
    softmax_causal: CudaFunction,
    silu_mul: CudaFunction,
    argmax: CudaFunction,
    rope_at: CudaFunction,
    store_rows: CudaFunction,
    decode_attention: CudaFunction,
    attention_part: CudaFunction,
    attention_merge: CudaFunction,
    linear_rows: CudaFunction,
    add_u32: CudaFunction,
    spin: CudaFunction,
}

impl Kernels {
    /// Compiles the kernels (the first time in the process) and loads them into `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Kernels, OpsError> {
        let module = ctx.load_module(ptx()?)?;
        let f = |name: &str| module.load_function(name);
        Ok(Kernels {
            fill: f("cudalloc_fill_f32")?,
            copy: f("cudalloc_copy_f32")?,
            embedding: f("cudalloc_embedding_f32")?,
            rmsnorm: f("cudalloc_rmsnorm_f32")?,
            rope: f("cudalloc_rope_f32")?,
            softmax_causal: f("cudalloc_softmax_causal_f32")?,
            silu_mul: f("cudalloc_silu_mul_f32")?,
            argmax: f("cudalloc_argmax_f32")?,
            rope_at: f("cudalloc_rope_at_f32")?,
            store_rows: f("cudalloc_store_rows_f32")?,
            decode_attention: f("cudalloc_decode_attention_f32")?,
            attention_part: f("cudalloc_attention_part_f32")?,
            attention_merge: f("cudalloc_attention_merge_f32")?,
            linear_rows: f("cudalloc_linear_rows_f32")?,
            add_u32: f("cudalloc_add_u32")?,
            spin: f("cudalloc_spin_ns")?,
        })
    }

    /// Queues one thread that returns once `wait` has passed on the device, so that the work
    /// queued after it starts no earlier: the stream is busy for all of `wait` (a `wait` past
    /// `u64::MAX` nanoseconds counts as that many).
    pub fn spin(&self, stream: &Arc<CudaStream>, wait: Duration) -> Result<(), OpsError> {
        let ns = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
        let mut b = stream.launch_builder(&self.spin);
        b.arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: cudalloc_spin_ns(u64) reads the device's timer and touches no memory; the
        // argument above matches its parameter.
        unsafe { launch(&mut b, cfg) }
    }

    /// `x[..] = value` over all of `x`.
    pub fn fill<X: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut X,
        value: f32,
    ) -> Result<(), OpsError> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let (xp, _x) = x.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&self.fill);
        b.arg(&xp).arg(&n64).arg(&value);
        // SAFETY: cudalloc_fill_f32(float*, u64, float) writes x[0..n), n = x.len(); the arguments
        // above match its parameters in order and type.
        unsafe { launch(&mut b, stride_cfg(n)) }
    }

    /// `dst[dst_at..dst_at + count] = src[src_at..src_at + count]`.
    pub fn copy<S: DevicePtr<f32>, D: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        src: &S,
        src_at: usize,
        dst: &mut D,
        dst_at: usize,
        count: usize,
    ) -> Result<(), OpsError> {
        let end = |at: usize| {
            at.checked_add(count)
                .ok_or_else(|| shape("copy range overflows"))
        };
        need("copy source", src, end(src_at)?)?;
        need("copy destination", dst, end(dst_at)?)?;
        if count == 0 {
            return Ok(());
        }
        let n64 = count as u64;
        let (sp, _s) = src.device_ptr(stream);
        let (dp, _d) = dst.device_ptr_mut(stream);
        // In bounds: both ranges were checked above; 4 bytes per f32.
        let (sp, dp) = (sp + 4 * src_at as u64, dp + 4 * dst_at as u64);
        let mut b = stream.launch_builder(&self.copy);
        b.arg(&sp).arg(&dp).arg(&n64);
        // SAFETY: cudalloc_copy_f32(const float*, float*, u64) touches [at, at + count) of each
        // buffer, both checked above; the arguments above match its parameters in order and type.
        unsafe { launch(&mut b, stride_cfg(count)) }
    }

    /// `out[r, :] = table[ids[r], :]` for `r < rows`; `table` is `[vocab, dim]`. An id past the
    /// vocabulary gives a row of NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding<T: DevicePtr<f32>, I: DevicePtr<u32>, O: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        table: &T,
        vocab: usize,
        dim: usize,
        ids: &I,
        rows: usize,
        out: &mut O,
    ) -> Result<(), OpsError> {
        need("embedding table", table, mul("vocab x dim", vocab, dim)?)?;
        need("ids", ids, rows)?;
        let n = mul("rows x dim", rows, dim)?;
        need("embedding output", out, n)?;
        if n == 0 {
            return Ok(());
        }
        let (r64, d64, v64) = (rows as u64, dim as u64, vocab as u64);
        let (tp, _t) = table.device_ptr(stream);
        let (ip, _i) = ids.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&self.embedding);
        b.arg(&tp).arg(&ip).arg(&op).arg(&r64).arg(&d64).arg(&v64);
        // SAFETY: cudalloc_embedding_f32(const float*, const u32*, float*, u64, u64, u64) reads
        // ids[0..rows), table[0..vocab*dim) (ids checked against vocab in the kernel) and writes
        // out[0..rows*dim), all checked above; the arguments above match its parameters in order
        // and type.
        unsafe { launch(&mut b, stride_cfg(n)) }
    }

    /// RMSNorm: `out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w` over `[rows, dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm<X: DevicePtr<f32>, W: DevicePtr<f32>, O: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        x: &X,
        w: &W,
        out: &mut O,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), OpsError> {
        let n = mul("rows x dim", rows, dim)?;
        need("rmsnorm input", x, n)?;
        need("rmsnorm weight", w, dim)?;
        need("rmsnorm output", out, n)?;
        if n == 0 {
            return Ok(());
        }
        let cfg = rows_cfg(rows)?;
        let (r64, d32) = (rows as u64, to_u32("dim", dim)?);
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&self.rmsnorm);
        b.arg(&xp).arg(&wp).arg(&op).arg(&r64).arg(&d32).arg(&eps);
        // SAFETY: cudalloc_rmsnorm_f32(const float*, const float*, float*, u64, u32, float) touches
        // x and out in [0, rows*dim) and w in [0, dim), checked above; the arguments above match
        // its parameters in order and type.
        unsafe { launch(&mut b, cfg) }
    }

    /// Rotary position embedding in place on `x` as `[rows, heads, head_dim]` (`head_dim`
    /// even): row `r` is position `pos0 + r`; the pair `(2p, 2p + 1)` turns by
    /// `position * theta^(-2p / head_dim)` radians.
    #[allow(clippy::too_many_arguments)]
    pub fn rope<X: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut X,
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos0: usize,
        theta: f32,
    ) -> Result<(), OpsError> {
        if head_dim & 1 != 0 {
            return Err(shape(format!(
                "rope needs an even head_dim, not {head_dim}"
            )));
        }
        let n = mul(
            "rows x heads x head_dim",
            mul("rows x heads", rows, heads)?,
            head_dim,
        )?;
        need("rope input", x, n)?;
        if n == 0 {
            return Ok(());
        }
        let (r64, h32, d32, p64) = (
            rows as u64,
            to_u32("heads", heads)?,
            to_u32("head_dim", head_dim)?,
            pos0 as u64,
        );
        let (xp, _x) = x.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&self.rope);
        b.arg(&xp)
            .arg(&r64)
            .arg(&h32)
            .arg(&d32)
            .arg(&p64)
            .arg(&theta);
        // SAFETY: cudalloc_rope_f32(float*, u64, u32, u32, u64, float) touches
        // x[0..rows*heads*head_dim), checked above; the arguments above match its parameters in
        // order and type.
        unsafe { launch(&mut b, stride_cfg(n / 2)) }
    }

    /// Causal softmax in place on `x` as `[batches, rows, cols]`: row `r` of every batch is the
    /// query at position `pos0 + r`, attending to columns `0..=pos0 + r`; later columns become 0.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_causal<X: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut X,
        batches: usize,
        rows: usize,
        cols: usize,
        pos0: usize,
    ) -> Result<(), OpsError> {
        let total = mul("batches x rows", batches, rows)?;
        need("softmax input", x, mul("rows x cols", total, cols)?)?;
        if total == 0 || cols == 0 {
            return Ok(());
        }
        let cfg = rows_cfg(total)?;
        let (t64, r32, c32, p64) = (
            total as u64,
            to_u32("rows", rows)?,
            to_u32("cols", cols)?,
            pos0 as u64,
        );
        let (xp, _x) = x.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&self.softmax_causal);
        b.arg(&xp).arg(&t64).arg(&r32).arg(&c32).arg(&p64);
        // SAFETY: cudalloc_softmax_causal_f32(float*, u64, u32, u32, u64) touches
        // x[0..batches*rows*cols), checked above; the arguments above match its parameters in order
        // and type.
        unsafe { launch(&mut b, cfg) }
    }

    /// `out = silu(a) * b` over the first `n` elements (SwiGLU's gate).
    pub fn silu_mul<A: DevicePtr<f32>, B: DevicePtr<f32>, O: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        a: &A,
        b: &B,
        out: &mut O,
        n: usize,
    ) -> Result<(), OpsError> {
        need("silu_mul a", a, n)?;
        need("silu_mul b", b, n)?;
        need("silu_mul output", out, n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let (ap, _a) = a.device_ptr(stream);
        let (bp, _b) = b.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let mut l = stream.launch_builder(&self.silu_mul);
        l.arg(&ap).arg(&bp).arg(&op).arg(&n64);
        // SAFETY: cudalloc_silu_mul_f32(const float*, const float*, float*, u64) touches [0, n) of
        // each buffer, checked above; the arguments above match its parameters in order and type.
        unsafe { launch(&mut l, stride_cfg(n)) }
    }

    /// `out[r]` = index of the largest element of row `r` of `x` as `[rows, cols]` (the first
    /// on ties; NaN never wins).
    pub fn argmax<X: DevicePtr<f32>, O: DevicePtrMut<u32>>(
        &self,
        stream: &Arc<CudaStream>,
        x: &X,
        rows: usize,
        cols: usize,
        out: &mut O,
    ) -> Result<(), OpsError> {
        need("argmax input", x, mul("rows x cols", rows, cols)?)?;
        need("argmax output", out, rows)?;
        if rows == 0 {
            return Ok(());
        }
        if cols == 0 {
            return Err(shape("argmax over zero columns"));
        }
        let cfg = rows_cfg(rows)?;
        let (r64, c32) = (rows as u64, to_u32("cols", cols)?);
        let (xp, _x) = x.device_ptr(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&self.argmax);
        b.arg(&xp).arg(&op).arg(&r64).arg(&c32);
        // SAFETY: cudalloc_argmax_f32(const float*, u32*, u64, u32) reads x[0..rows*cols) and
        // writes out[0..rows), checked above; the arguments above match its parameters in order and
        // type.
        unsafe { launch(&mut b, cfg) }
    }
}

/// Elements a column-major matrix needs: `op(X)` is `rows x cols`, stored transposed unless
/// `trans` is `N`, with leading dimension `ld`; `batch` of them `stride` apart.
fn matrix_need(
    what: &str,
    trans: Op,
    rows: i32,
    cols: i32,
    ld: i32,
    batch: i32,
    stride: i64,
) -> Result<usize, OpsError> {
    let (r, c) = match trans {
        Op::CUBLAS_OP_N => (rows, cols),
        Op::CUBLAS_OP_T | Op::CUBLAS_OP_C => (cols, rows),
        other => {
            return Err(shape(format!(
                "{what}: operation {other:?} is not supported"
            )))
        }
    };
    if r < 0 || c < 0 || batch < 0 || stride < 0 {
        return Err(shape(format!(
            "{what}: negative dimension, batch or stride"
        )));
    }
    if (ld as i64) < (r.max(1) as i64) {
        return Err(shape(format!(
            "{what}: leading dimension {ld} < {}",
            r.max(1)
        )));
    }
    if r == 0 || c == 0 || batch == 0 {
        return Ok(0);
    }
    let one = (ld as u64) * (c as u64 - 1) + r as u64;
    let all = (stride as u64)
        .checked_mul(batch as u64 - 1)
        .and_then(|s| s.checked_add(one))
        .ok_or_else(|| shape(format!("{what}: size overflows")))?;
    usize::try_from(all).map_err(|_| shape(format!("{what}: size overflows")))
}

/// Checks a (batched) gemm's three operands against their lengths.
fn check_gemm(
    cfg: &GemmConfig<f32>,
    batch: i32,
    strides: [i64; 3],
    lens: [usize; 3],
) -> Result<(), OpsError> {
    if cfg.m < 0 || cfg.n < 0 || cfg.k < 0 {
        return Err(shape("gemm: negative m, n or k"));
    }
    let a = matrix_need(
        "gemm A", cfg.transa, cfg.m, cfg.k, cfg.lda, batch, strides[0],
    )?;
    let b = matrix_need(
        "gemm B", cfg.transb, cfg.k, cfg.n, cfg.ldb, batch, strides[1],
    )?;
    let c = matrix_need(
        "gemm C",
        Op::CUBLAS_OP_N,
        cfg.m,
        cfg.n,
        cfg.ldc,
        batch,
        strides[2],
    )?;
    for (what, needed, len) in [("A", a, lens[0]), ("B", b, lens[1]), ("C", c, lens[2])] {
        if len < needed {
            return Err(shape(format!(
                "gemm {what} has {len} elements, needs {needed}"
            )));
        }
    }
    Ok(())
}

/// `C = alpha * op(A) op(B) + beta * C` (cuBLAS `Sgemm`, column-major), on `blas`'s stream,
/// after checking that every operand is large enough for the configuration.
pub fn gemm_f32<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    blas: &CudaBlas,
    cfg: GemmConfig<f32>,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<(), OpsError> {
    check_gemm(&cfg, 1, [0; 3], [a.len(), b.len(), c.len()])?;
    // SAFETY: `check_gemm` proved that cuBLAS's reads of A and B and writes of C stay inside the
    // three buffers (last element of each stored matrix < its length). cudarc orders the call
    // on the handle's stream through `device_ptr`/`device_ptr_mut`.
    unsafe { blas.gemm(cfg, a, b, c) }.map_err(OpsError::Blas)
}

/// Strided batched `gemm_f32` (cuBLAS `SgemmStridedBatched`), checked the same way for every
/// batch.
pub fn gemm_strided_batched_f32<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    blas: &CudaBlas,
    cfg: StridedBatchedConfig<f32>,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<(), OpsError> {
    let strides = [cfg.stride_a, cfg.stride_b, cfg.stride_c];
    check_gemm(
        &cfg.gemm,
        cfg.batch_size,
        strides,
        [a.len(), b.len(), c.len()],
    )?;
    // SAFETY: as in `gemm_f32`, for each of the `batch_size` matrices `stride` elements apart.
    unsafe { blas.gemm_strided_batched(cfg, a, b, c) }.map_err(OpsError::Blas)
}
