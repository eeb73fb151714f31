//! cudarc interop: `Buffer`s from a `CachingAllocator<CudaDevice>` in cudarc's own calls.
//!
//! On any machine: the byte size of `len` elements is checked for overflow. On a CUDA GPU (the
//! other tests, ignored elsewhere), for every policy where it matters: data copied in with
//! `memcpy_htod` reads back with `memcpy_dtoh`/`clone_dtoh` and through `memcpy_dtod`; a fresh
//! buffer is zeroed; a cuBLAS gemm writes a buffer with the product a CPU computes; kernels
//! launched through `cudalloc_sys::ops` write buffers; a buffer written on a foreign
//! stream and read on its owner sees the write; the cuBLAS workspace is one pool allocation
//! per (handle, stream), counted in the statistics and returned when the handle is dropped; a
//! request larger than the card is `OutOfMemory`; a stream of another CUDA context (a second,
//! non-primary one on the same device) is `ForeignContext` naming the stream and both devices,
//! and `record_stream` refuses one; a buffer's block is not freed by address; two threads'
//! per-thread default streams using one buffer are ordered.
//! After each test every buffer is back in the pool (allocated bytes 0) and the allocator's
//! invariants hold.

use cudalloc::interop::{buffer_bytes, stream_id};
use cudalloc::stats::StatType;
use cudalloc::workspace::{workspace_bytes, WORKSPACE_ENV};
use cudalloc::{AllocError, CachingAllocator, Config, Policy};
use cudalloc_sys::buffer::cudarc::cublas::sys::cublasOperation_t as Op;
use cudalloc_sys::buffer::cudarc::cublas::GemmConfig;
use cudalloc_sys::buffer::cudarc::driver::{CudaContext, CudaStream};
use cudalloc_sys::ops::{gemm_f32, Kernels};
use cudalloc_sys::{CudaDevice, Device, StreamId};
use std::sync::Arc;

pub(crate) type Alloc = Arc<CachingAllocator<CudaDevice>>;

const MIB: u64 = 1 << 20;

pub(crate) fn allocator(policy: Policy) -> Alloc {
    let dev = CudaDevice::new(0).expect("a CUDA device");
    Arc::new(CachingAllocator::new(dev, Config::for_policy(policy)))
}

pub(crate) fn new_stream(a: &Alloc) -> Arc<CudaStream> {
    a.with_device(|d| d.context().new_stream())
        .expect("a stream")
}

fn allocated(a: &Alloc) -> i64 {
    a.stats().allocated_bytes.get(StatType::All).current
}

/// Bytes asked for by live allocations (exact, unlike the rounded `allocated`).
fn requested(a: &Alloc) -> i64 {
    a.stats().requested_bytes.get(StatType::All).current
}

/// Every buffer is back and the pool is consistent.
pub(crate) fn settled(a: &Alloc) {
    assert_eq!(allocated(a), 0, "a buffer was not returned");
    a.check_invariants().expect("invariants");
}

pub(crate) fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

#[test]
fn element_sizes_that_overflow_are_rejected() {
    assert_eq!(buffer_bytes::<f32>(1 << 20).unwrap(), 4 << 20);
    assert_eq!(buffer_bytes::<u8>(0).unwrap(), 0);
    assert_eq!(buffer_bytes::<()>(usize::MAX).unwrap(), 0);
    let overflow = |len, elem_size, elem_type| -> Result<u64, AllocError> {
        Err(AllocError::ElementCountOverflow {
            len,
            elem_size,
            elem_type,
        })
    };
    let max = usize::MAX;
    assert_eq!(buffer_bytes::<f32>(max), overflow(max, 4, "f32"));
    assert_eq!(buffer_bytes::<f64>(max / 4), overflow(max / 4, 8, "f64"));
    assert_eq!(
        buffer_bytes::<[u8; 3]>(max / 2),
        overflow(max / 2, 3, "[u8; 3]")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memcpy_round_trips_through_buffers() {
    for policy in Policy::ALL {
        let a = allocator(policy);
        let s = new_stream(&a);
        {
            let host = data(300_000, 7);
            let x = a.buffer_from(&host, &s).unwrap();
            assert_eq!(x.len(), host.len());
            assert!(allocated(&a) >= 4 * host.len() as i64);
            assert_eq!(s.clone_dtoh(&x).unwrap(), host, "{policy:?}: htod/dtoh");

            let mut y = a.buffer::<f32>(host.len(), &s).unwrap();
            assert!(s.clone_dtoh(&y).unwrap().iter().all(|v| *v == 0.0));
            s.memcpy_dtod(&x, &mut y).unwrap();
            let mut back = vec![0f32; host.len()];
            s.memcpy_dtoh(&y, &mut back).unwrap();
            assert_eq!(back, host, "{policy:?}: dtod");

            let mut z = a.buffer_uninit::<u32>(17, &s).unwrap();
            s.memcpy_htod(&[5u32; 17], &mut z).unwrap();
            assert_eq!(s.clone_dtoh(&z).unwrap(), vec![5u32; 17]);
            let empty = a.buffer::<f32>(0, &s).unwrap();
            assert!(s.clone_dtoh(&empty).unwrap().is_empty());
        }
        s.synchronize().unwrap();
        settled(&a);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_writes_a_buffer() {
    let a = allocator(Policy::Default);
    let s = new_stream(&a);
    let (m, n, k) = (37usize, 29usize, 53usize);
    // Row-major X [m, k] times row-major W [n, k] transposed: Y [m, n] = X W^T.
    let (xh, wh) = (data(m * k, 3), data(n * k, 5));
    {
        let blas = a.cublas(&s).unwrap();
        let x = a.buffer_from(&xh, &s).unwrap();
        let w = a.buffer_from(&wh, &s).unwrap();
        let mut y = a.buffer::<f32>(m * n, &s).unwrap();
        // Column-major: Y^T [n, m] = W [k, n]^T X^T [k, m].
        let cfg = GemmConfig {
            transa: Op::CUBLAS_OP_T,
            transb: Op::CUBLAS_OP_N,
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: k as i32,
            ldb: k as i32,
            beta: 0.0f32,
            ldc: n as i32,
        };
        gemm_f32(blas.blas(), cfg, &w, &x, &mut y).unwrap();
        let got = s.clone_dtoh(&y).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|t| xh[i * k + t] as f64 * wh[j * k + t] as f64)
                    .sum();
                let g = got[i * n + j] as f64;
                assert!((g - want).abs() < 1e-3, "y[{i},{j}] = {g}, want {want}");
            }
        }
        // A configuration that reaches past a buffer is refused before cuBLAS sees it.
        let mut short = a.buffer::<f32>(m * n - 1, &s).unwrap();
        assert!(gemm_f32(blas.blas(), cfg, &w, &x, &mut short).is_err());
    }
    s.synchronize().unwrap();
    settled(&a);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kernels_write_buffers() {
    let a = allocator(Policy::Torch);
    let s = new_stream(&a);
    let ctx = a.with_device(|d| d.context().clone());
    let k = Kernels::new(&ctx).unwrap();
    {
        let mut x = a.buffer::<f32>(100_003, &s).unwrap();
        k.fill(&s, &mut x, 3.5).unwrap();
        assert!(s.clone_dtoh(&x).unwrap().iter().all(|v| *v == 3.5));

        let src = a.buffer_from(&data(1000, 9), &s).unwrap();
        let mut dst = a.buffer::<f32>(1500, &s).unwrap();
        k.copy(&s, &src, 100, &mut dst, 700, 800).unwrap();
        let (sh, dh) = (s.clone_dtoh(&src).unwrap(), s.clone_dtoh(&dst).unwrap());
        assert_eq!(&dh[700..1500], &sh[100..900]);
        assert!(dh[..700].iter().all(|v| *v == 0.0));
        assert!(
            k.copy(&s, &src, 300, &mut dst, 0, 800).is_err(),
            "source overrun"
        );

        let logits = a
            .buffer_from(&[0.5f32, 2.0, -1.0, 2.0, 7.0, 1.0], &s)
            .unwrap();
        let mut ids = a.buffer::<u32>(2, &s).unwrap();
        k.argmax(&s, &logits, 2, 3, &mut ids).unwrap();
        assert_eq!(s.clone_dtoh(&ids).unwrap(), vec![1, 1]);
    }
    s.synchronize().unwrap();
    settled(&a);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_foreign_stream_write_is_seen_by_the_owner() {
    let a = allocator(Policy::TorchExpandable);
    let (owner, other) = (new_stream(&a), new_stream(&a));
    let host = data(1 << 22, 11);
    {
        let mut buf = a.buffer::<f32>(host.len(), &owner).unwrap();
        other.memcpy_htod(&host, &mut buf).unwrap();
        assert_eq!(buf.tracked_streams(), 1);
        assert_eq!(owner.clone_dtoh(&buf).unwrap(), host);
        buf.record_stream(&other);
    }
    owner.synchronize().unwrap();
    other.synchronize().unwrap();
    // The freed block waits for an event on `other`; a new allocation processes it.
    drop(a.buffer::<f32>(16, &owner).unwrap());
    settled(&a);
}

/// A buffer that holds the last handle of a stream it was used on: the stream stays alive until
/// the pool has recorded the free's event on it (it used to be destroyed first, the event record
/// then failed and the block never went back).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_buffer_keeps_its_last_foreign_stream_alive_until_freed() {
    for policy in Policy::ALL {
        let a = allocator(policy);
        let owner = new_stream(&a);
        let host = data(1 << 20, 5);
        {
            let mut buf = a.buffer::<f32>(host.len(), &owner).unwrap();
            let other = new_stream(&a);
            other.memcpy_htod(&host, &mut buf).unwrap();
            buf.record_stream(&other);
            drop(other); // the buffer's tracker now holds the stream's only handle
        }
        a.with_device(|d| d.synchronize_device()).unwrap();
        drop(a.buffer::<f32>(16, &owner).unwrap());
        settled(&a);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cublas_workspace_comes_from_the_pool() {
    let a = allocator(Policy::Default);
    let (s1, s2) = (new_stream(&a), new_stream(&a));
    let ws = 4 * MIB;
    {
        let mut h = a.cublas_with(&s1, ws, MIB).unwrap();
        assert_eq!(requested(&a), ws as i64, "one workspace, counted");
        assert_eq!(h.workspace().unwrap().num_bytes() as u64, ws);
        h.set_stream(&s2).unwrap();
        assert_eq!(
            requested(&a),
            2 * ws as i64,
            "one more for the second stream"
        );
        h.set_stream(&s1).unwrap();
        assert_eq!(requested(&a), 2 * ws as i64, "the first stream's is reused");
        assert_eq!(h.lt_workspace().unwrap().num_bytes() as u64, MIB);
        assert_eq!(requested(&a), (2 * ws + MIB) as i64);
        // A product on each stream runs with its workspace bound.
        for s in [&s1, &s2] {
            h.set_stream(s).unwrap();
            let (x, w) = (
                a.buffer_from(&data(64 * 64, 1), s).unwrap(),
                a.buffer_from(&data(64 * 64, 2), s).unwrap(),
            );
            let mut y = a.buffer::<f32>(64 * 64, s).unwrap();
            let cfg = GemmConfig {
                transa: Op::CUBLAS_OP_N,
                transb: Op::CUBLAS_OP_N,
                m: 64,
                n: 64,
                k: 64,
                alpha: 1.0f32,
                lda: 64,
                ldb: 64,
                beta: 0.0f32,
                ldc: 64,
            };
            gemm_f32(h.blas(), cfg, &x, &w, &mut y).unwrap();
            s.synchronize().unwrap();
        }
    }
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();
    settled(&a);

    // Sized from the environment (or PyTorch's default for this GPU).
    let major = s1.context().compute_capability().unwrap().0;
    let want = workspace_bytes(std::env::var(WORKSPACE_ENV).ok().as_deref(), major).unwrap();
    let h = a.cublas(&s1).unwrap();
    assert_eq!(h.workspace_bytes(), want);
    assert_eq!(requested(&a), want as i64);
    drop(h);
    s1.synchronize().unwrap();
    settled(&a);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_stream_of_another_context_is_refused() {
    let a = allocator(Policy::Default);
    let other = CudaContext::new_non_primary(0, 0).expect("a second context on device 0");
    let s = other.new_stream().expect("a stream");
    match a.buffer::<f32>(1024, &s) {
        Err(AllocError::ForeignContext {
            stream,
            stream_device,
            device,
        }) => assert_eq!((stream, stream_device, device), (stream_id(&s), 0, 0)),
        other => panic!("expected ForeignContext, got {other:?}"),
    }
    settled(&a);
}

/// `record_stream` with a stream of another context (its event could never be recorded there)
/// is refused through `cuStreamGetCtx`, a stream of the allocator's own context is taken, and
/// the allocation frees normally.
#[test]
#[ignore = "needs a CUDA GPU"]
fn record_stream_refuses_a_stream_of_another_context() {
    let a = allocator(Policy::Default);
    let other = CudaContext::new_non_primary(0, 0).expect("a second context on device 0");
    let foreign = other.new_stream().expect("a stream");
    let own = a
        .with_device(|d| d.context().new_stream())
        .expect("a stream");
    let x = a.allocate(4 << 20, StreamId::DEFAULT).unwrap();
    let e = a.record_stream(x.ptr(), stream_id(&foreign)).unwrap_err();
    assert!(e.to_string().contains("another context"), "{e}");
    a.record_stream(x.ptr(), stream_id(&own)).unwrap();
    a.free(x).unwrap();
    own.synchronize().unwrap();
    settled(&a);
}

/// The per-thread default stream (one handle, 0x2, for a different stream on each thread) is
/// refused for a buffer and for `record_stream`: the allocator could not tell two threads'
/// streams apart and would hand one thread's freed block to another's unordered work.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_per_thread_default_stream_is_refused() {
    let a = allocator(Policy::Default);
    let per_thread = a.with_device(|d| d.context().per_thread_stream());
    let e = a.buffer::<f32>(16, &per_thread).unwrap_err();
    assert!(e.to_string().contains("per-thread default stream"), "{e}");
    let x = a.allocate(4096, StreamId::DEFAULT).unwrap();
    let e = a
        .record_stream(x.ptr(), stream_id(&per_thread))
        .unwrap_err();
    assert!(e.to_string().contains("per-thread default stream"), "{e}");
    a.free(x).unwrap();
    settled(&a);
}

/// A buffer's block is freed only by the buffer: freed by address while the buffer lives, it
/// could be handed to a second buffer and both would use it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_buffer_s_block_is_not_freed_by_address() {
    let a = allocator(Policy::Default);
    let s = new_stream(&a);
    let b = a.buffer::<u8>(4096, &s).unwrap();
    let p = b.device_address();
    for r in [a.free_ptr(p), a.free_on(p, stream_id(&s))] {
        assert!(
            matches!(r, Err(AllocError::OwnedByBuffer(q)) if q == p),
            "{r:?}"
        );
    }
    let c = a.buffer::<u8>(4096, &s).unwrap();
    assert_ne!(
        c.device_address(),
        p,
        "the live buffer's block was handed out again"
    );
    drop((b, c));
    settled(&a);
}

/// Threads that use one buffer on their per-thread default streams (one handle, 0x2, for a
/// different stream on each) are ordered by waiting on the host: a write on one thread's is
/// complete before another thread reads, and no slot stands for the handle.
#[test]
#[ignore = "needs a CUDA GPU"]
fn per_thread_default_streams_of_two_threads_are_ordered() {
    let a = allocator(Policy::Default);
    let owner = new_stream(&a);
    let host = data(1 << 22, 3);
    let mut buf = a.buffer::<f32>(host.len(), &owner).unwrap();
    std::thread::scope(|t| {
        t.spawn(|| {
            let pt = a.with_device(|d| d.context().per_thread_stream());
            pt.memcpy_htod(&host, &mut buf).unwrap();
        })
        .join()
        .unwrap();
    });
    assert_eq!(
        buf.tracked_streams(),
        0,
        "no slot for the per-thread stream"
    );
    let read = std::thread::scope(|t| {
        t.spawn(|| {
            let pt = a.with_device(|d| d.context().per_thread_stream());
            pt.clone_dtoh(&buf).unwrap()
        })
        .join()
        .unwrap()
    });
    assert_eq!(read, host);
    let pt = a.with_device(|d| d.context().per_thread_stream());
    buf.record_stream(&pt);
    drop(buf);
    settled(&a);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn larger_than_the_card_is_out_of_memory() {
    let a = allocator(Policy::Default);
    let s = new_stream(&a);
    let (_, total) = s.context().mem_get_info().unwrap();
    match a.buffer::<f32>(total, &s) {
        Err(e) => assert!(e.is_out_of_memory(), "{e}"),
        Ok(_) => panic!("{} bytes were granted", 4 * total),
    }
    match a.buffer::<f64>(usize::MAX / 4, &s) {
        Err(AllocError::ElementCountOverflow { len, elem_size, .. }) => {
            assert_eq!((len, elem_size), (usize::MAX / 4, 8))
        }
        other => panic!("expected an overflow error, got {other:?}"),
    }
    let b = a.buffer::<f32>(1024, &s).unwrap();
    drop(b);
    settled(&a);
}
