//! Tests of the buffer module. The `Send + Sync` bounds and the error sources are pure and run
//! everywhere; the rest needs a CUDA GPU (ignored elsewhere) and checks, with a plain
//! `cuMemAlloc` pool: a kernel launched with `&mut Buffer`/`&Buffer` arguments writes and reads
//! the buffer; a buffer written on a foreign stream and then read on its owner sees the foreign
//! write (the tracker's events), and an owner write forgets the foreign stream; a dropped buffer
//! goes back to its pool; the workspace of a `PooledBlas` follows its stream.

use super::{Buffer, BufferPool, FromBuffer, PoolError, PooledBlas};
use crate::cuda::CudaDevice;
use crate::device::{Device, StreamId};
use cudarc::driver::CudaStream;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

#[test]
fn buffers_and_handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Buffer<f32>>();
    send_sync::<Buffer<bool>>();
    send_sync::<PooledBlas>();
}

/// A `BlasError` that wraps a driver error gives it as its `source`.
#[test]
fn wrapped_errors_are_their_source() {
    use cudarc::driver::sys::CUresult;
    use cudarc::driver::DriverError;
    use std::error::Error;
    let driver = || DriverError(CUresult::CUDA_ERROR_INVALID_VALUE);
    let blas = super::BlasError::Driver(driver());
    // Compared as values: formatting a `DriverError` asks the driver for its text.
    let source = blas.source().and_then(|s| s.downcast_ref::<DriverError>());
    assert_eq!(source.map(|d| d.0), Some(driver().0));
    assert!(super::BlasError::Workspace("x".into()).source().is_none());
}

/// A pool over plain `cuMemAlloc`, counting what is live.
struct MallocPool {
    dev: CudaDevice,
    live: Mutex<HashMap<u64, u64>>,
}

impl MallocPool {
    fn new() -> Arc<MallocPool> {
        Arc::new(MallocPool {
            dev: CudaDevice::new(0).expect("a CUDA device"),
            live: Mutex::new(HashMap::new()),
        })
    }

    fn buffer<T>(self: &Arc<Self>, len: usize, stream: &Arc<CudaStream>) -> Buffer<T> {
        let bytes = (len * std::mem::size_of::<T>()).max(1) as u64;
        let ptr = self.dev.malloc(bytes).expect("malloc");
        self.live.lock().insert(ptr, bytes);
        Buffer::from_pool(self.clone(), ptr, len, stream.clone())
    }

    fn live(&self) -> usize {
        self.live.lock().len()
    }
}

impl BufferPool for MallocPool {
    fn free(&self, ptr: u64, _stream: StreamId, _: FromBuffer) -> Result<(), PoolError> {
        let size = self.live.lock().remove(&ptr).ok_or("unknown pointer")?;
        // cuMemFree waits for the device, so stream order holds trivially.
        self.dev.free(ptr, size)?;
        Ok(())
    }
    fn record_stream(&self, _ptr: u64, _stream: StreamId) -> Result<(), PoolError> {
        Ok(())
    }
}

#[cfg(feature = "ops")]
const IOTA: &str = r#"
extern "C" __global__ void iota(float* x, unsigned long long n, float add) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] = (float)i + add;
}
extern "C" __global__ void twice(const float* x, float* y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
"#;

/// Needs NVRTC, which cudarc builds only with the `ops` feature.
#[cfg(feature = "ops")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn kernel_arguments_write_and_read_buffers() {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let pool = MallocPool::new();
    let stream = pool.dev.context().new_stream().unwrap();
    let module = pool
        .dev
        .context()
        .load_module(cudarc::nvrtc::compile_ptx(IOTA).unwrap())
        .unwrap();
    let (iota, twice) = (
        module.load_function("iota").unwrap(),
        module.load_function("twice").unwrap(),
    );
    let n = 10_000usize;
    let mut x = pool.buffer::<f32>(n, &stream);
    let mut y = pool.buffer::<f32>(n, &stream);
    let n64 = n as u64;
    let add = 0.5f32;
    let cfg = LaunchConfig::for_num_elems(n as u32);
    let mut b = stream.launch_builder(&iota);
    b.arg(&mut x).arg(&n64).arg(&add);
    // SAFETY: `iota(float*, u64, float)` writes x[0..n) and x has n elements.
    unsafe { b.launch(cfg) }.unwrap();
    let mut b = stream.launch_builder(&twice);
    b.arg(&x).arg(&mut y).arg(&n64);
    // SAFETY: `twice(const float*, float*, u64)` reads x[0..n), writes y[0..n); both have n.
    unsafe { b.launch(cfg) }.unwrap();
    let back = stream.clone_dtoh(&y).unwrap();
    for (i, v) in back.iter().enumerate() {
        assert_eq!(*v, 2.0 * (i as f32 + 0.5));
    }
    drop((x, y));
    assert_eq!(pool.live(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn foreign_stream_write_is_seen_by_the_owner() {
    let pool = MallocPool::new();
    let ctx = pool.dev.context().clone();
    let (owner, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    assert!(ctx.is_managing_stream_synchronization());
    let n = 1 << 22;
    let mut buf = pool.buffer::<f32>(n, &owner);
    owner.memset_zeros(&mut buf).unwrap();
    let data: Vec<f32> = (0..n).map(|i| i as f32).collect();
    // A write on the foreign stream, then a read on the owner.
    other.memcpy_htod(&data, &mut buf).unwrap();
    assert_eq!(buf.tracked_streams(), 1);
    let back = owner.clone_dtoh(&buf).unwrap();
    assert!(
        back == data,
        "the owner read did not wait for the foreign write"
    );
    // An owner write orders every foreign use before it and forgets the foreign stream.
    owner.memset_zeros(&mut buf).unwrap();
    assert_eq!(buf.tracked_streams(), 0);
    let zeros = other.clone_dtoh(&buf).unwrap();
    assert!(
        zeros.iter().all(|v| *v == 0.0),
        "the foreign read ran before the owner's write"
    );
    buf.record_stream(&other);
    buf.free().unwrap();
    assert_eq!(pool.live(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pooled_blas_binds_a_workspace_per_stream() {
    let pool = MallocPool::new();
    let ctx = pool.dev.context().clone();
    let (s1, s2) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let mut blas = PooledBlas::new(s1.clone(), pool.buffer::<u8>(4 << 20, &s1)).unwrap();
    assert!(blas.workspace_for(&s1).is_some());
    let wrong = blas.set_stream(s2.clone(), Some(pool.buffer::<u8>(4 << 20, &s1)));
    assert!(
        wrong.is_err(),
        "a workspace from another stream must be refused"
    );
    assert!(blas.set_stream(s2.clone(), None).is_err());
    blas.set_stream(s2.clone(), Some(pool.buffer::<u8>(4 << 20, &s2)))
        .unwrap();
    assert_eq!(blas.workspaces().len(), 2);
    blas.set_stream(s1.clone(), None).unwrap();
    assert_eq!(**blas.stream(), *s1);
    let live_before = pool.live();
    drop(blas);
    assert_eq!(pool.live(), live_before - 2);
}
