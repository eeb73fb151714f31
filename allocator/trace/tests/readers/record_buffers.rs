//! Recording `Buffer`s: a `RecordingAllocator<CudaDevice, W>` in an `Arc` is a `BufferPool` with
//! the buffer constructors, and its trace shows every buffer.
//!
//! On any machine: the recording allocator is a `BufferPool` (checked by the compiler). On a
//! CUDA GPU (ignored elsewhere): zeroed, copied and uninitialized buffers on one stream each
//! write one `alloc` of `len * size_of::<T>()` bytes on that stream, and dropping them writes
//! the matching frees, so the trace reads back with one free per allocation, no anomalies and a
//! peak of all three; a buffer given back with `free()` is written too. The recorder is
//! finished only after every buffer is dropped and `Arc::try_unwrap` returned it.
//!
//! A cuBLAS handle made through the recorder (on a CUDA GPU): its workspace on each stream it
//! ran on is one `alloc` of the size `workspace_bytes` computes from the environment and the
//! device's compute capability, on that stream, and dropping the handle writes their frees; its
//! cuBLASLt workspaces (one per stream asked on) are recorded the same way.

use cudalloc::interop::stream_id;
use cudalloc::record::RecordingAllocator;
use cudalloc::workspace::{workspace_bytes, WORKSPACE_ENV};
use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::buffer::cudarc::driver::CudaStream;
use cudalloc_sys::buffer::BufferPool;
use cudalloc_sys::CudaDevice;
use cudalloc_trace::{self as trace, Anomalies, Op, Trace};
use std::path::Path;
use std::sync::Arc;

type Recording = Arc<RecordingAllocator<CudaDevice, Vec<u8>>>;

fn recording() -> Recording {
    let dev = CudaDevice::new(0).expect("a CUDA device");
    let inner = CachingAllocator::new(dev, Config::for_policy(Policy::Default));
    Arc::new(RecordingAllocator::new(inner, Vec::new()).expect("the header"))
}

fn new_stream(rec: &Recording) -> Arc<CudaStream> {
    rec.with_device(|d| d.context().new_stream())
        .expect("a stream")
}

/// Finishes the recorder (every buffer must be dropped): its CSV text and the trace read back.
fn finish(rec: Recording) -> (String, Trace) {
    let rec = Arc::try_unwrap(rec).unwrap_or_else(|_| panic!("a buffer still holds the recorder"));
    let out = rec.finish().expect("the trace");
    let t = trace::csv::read(Path::new("recorded.csv"), out.as_slice()).expect("a valid trace");
    (String::from_utf8(out).expect("UTF-8"), t)
}

/// The sizes of the trace's allocations, in order, after checking that each was freed once.
fn matched_sizes(t: &Trace) -> Vec<u64> {
    let mut live = std::collections::HashMap::new();
    let mut sizes = Vec::new();
    for op in &t.ops {
        match *op {
            Op::Alloc { slot, size, .. } => {
                assert!(
                    live.insert(slot, size).is_none(),
                    "slot {slot} reused while live"
                );
                sizes.push(size);
            }
            Op::Free { slot } => assert!(live.remove(&slot).is_some(), "free of slot {slot}"),
        }
    }
    assert!(live.is_empty(), "allocations never freed: {live:?}");
    assert_eq!(t.anomalies, Anomalies::default());
    sizes
}

#[test]
fn a_recording_allocator_is_a_buffer_pool() {
    fn pool<P: BufferPool + 'static>() {}
    pool::<RecordingAllocator<CudaDevice, Vec<u8>>>();
    pool::<RecordingAllocator<CudaDevice, std::fs::File>>();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn buffers_are_recorded_with_their_sizes_and_frees() {
    let rec = recording();
    let stream = new_stream(&rec);
    let host: Vec<f64> = (0..3000).map(|i| i as f64 * 0.5).collect();
    let zeroed = rec.buffer::<f32>(1 << 20, &stream).unwrap();
    let copied = rec.buffer_from(&host, &stream).unwrap();
    let uninit = rec.buffer_uninit::<u16>(777, &stream).unwrap();
    assert_eq!(stream.clone_dtoh(&copied).unwrap(), host);
    assert!(stream
        .clone_dtoh(&zeroed)
        .unwrap()
        .iter()
        .all(|&x| x == 0.0));
    drop((zeroed, copied, uninit));
    stream.synchronize().unwrap();

    let (_, t) = finish(rec);
    let sizes = matched_sizes(&t);
    assert_eq!(sizes, [4 << 20, 3000 * 8, 777 * 2]);
    assert_eq!((t.ops.len(), t.events), (6, 3 + 2 * 3));
    assert_eq!(t.streams, [stream_id(&stream).0]);
    assert_eq!(t.peak_live, (4 << 20) + 3000 * 8 + 777 * 2);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_buffer_given_back_with_free_is_recorded() {
    let rec = recording();
    let stream = new_stream(&rec);
    let b = rec.buffer::<u32>(4096, &stream).unwrap();
    let ptr = b.device_address();
    b.free().expect("the recorder takes it back");
    let kept = rec.buffer::<u8>(100, &stream).unwrap();
    assert_eq!(
        Arc::strong_count(&rec),
        2,
        "the live buffer holds the recorder"
    );
    drop(kept);
    stream.synchronize().unwrap();

    let (text, t) = finish(rec);
    assert_eq!(matched_sizes(&t), [4096 * 4, 100]);
    let Op::Alloc { slot, .. } = t.ops[0] else {
        panic!("the trace starts with {:?}", t.ops[0]);
    };
    assert_eq!(
        t.ops[1],
        Op::Free { slot },
        "freed before the next allocation"
    );
    let s = stream_id(&stream).0;
    for action in ["alloc", "free_requested", "free_completed"] {
        let line = format!("{action},{ptr},{},{s},", 4096 * 4);
        assert!(text.contains(&line), "no line {line} in\n{text}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cublas_handles_workspaces_are_recorded() {
    let rec = recording();
    let (first, second) = (new_stream(&rec), new_stream(&rec));
    let (major, _) = first.context().compute_capability().unwrap();
    let env = std::env::var(WORKSPACE_ENV).ok();
    let want = workspace_bytes(env.as_deref(), major).unwrap();
    let mut blas = rec.cublas(&first).expect("a handle");
    assert_eq!(blas.workspace_bytes(), want);
    blas.set_stream(&second).expect("a second workspace");
    assert_eq!(blas.workspace().map(|w| w.len() as u64), Some(want));
    assert_eq!(
        Arc::strong_count(&rec),
        4,
        "the handle and its two workspaces hold the recorder"
    );
    drop(blas);
    second.synchronize().unwrap();

    let (_, t) = finish(rec);
    assert_eq!(matched_sizes(&t), [want, want]);
    assert_eq!((t.ops.len(), t.events), (4, 2 + 2 * 2));
    let mut streams = [stream_id(&first).0, stream_id(&second).0];
    streams.sort_unstable();
    let mut got = t.streams.clone();
    got.sort_unstable();
    assert_eq!(got, streams);
}

/// cuBLASLt workspaces come from the recorder too: one per stream the handle asked on (asking
/// again on a stream reuses it), each an `alloc` of `lt_bytes` on its stream after the cuBLAS
/// workspace of that stream, all freed when the handle is dropped.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cublas_handles_cublaslt_workspaces_are_recorded() {
    const MIB: u64 = 1 << 20;
    let rec = recording();
    let (first, second) = (new_stream(&rec), new_stream(&rec));
    let mut blas = rec.cublas_with(&first, 2 * MIB, 3 * MIB).expect("a handle");
    let at = blas
        .lt_workspace()
        .expect("a cuBLASLt workspace")
        .num_bytes();
    assert_eq!(at as u64, 3 * MIB);
    blas.lt_workspace().expect("the same workspace again");
    blas.set_stream(&second).expect("a second workspace");
    blas.lt_workspace().expect("a second cuBLASLt workspace");
    assert_eq!(blas.lt_workspace_bytes(), 3 * MIB);
    drop(blas);
    second.synchronize().unwrap();

    let (text, t) = finish(rec);
    assert_eq!(
        matched_sizes(&t),
        [2 * MIB, 3 * MIB, 2 * MIB, 3 * MIB],
        "cuBLAS then cuBLASLt workspace, per stream, in the order asked:\n{text}"
    );
    let on = |i: usize| match t.ops[i] {
        Op::Alloc { stream, .. } => t.streams[stream as usize],
        Op::Free { .. } => panic!("op {i} is a free"),
    };
    assert_eq!(
        [on(0), on(1), on(2), on(3)],
        [
            stream_id(&first).0,
            stream_id(&first).0,
            stream_id(&second).0,
            stream_id(&second).0
        ]
    );
}
