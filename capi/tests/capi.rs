//! The C ABI, called as C would call it (the crate is also an rlib).
//!
//! CPU tests check the failure paths without a GPU (on a machine with one, the no-GPU checks are
//! skipped, since there the calls succeed); the GPU test is `#[ignore = "needs a CUDA GPU"]`.
//! The allocators and the trace are process-wide, so every test takes the `serial` lock.

use cudalloc_capi::{
    cudalloc_check, cudalloc_empty_cache, cudalloc_free, cudalloc_last_error, cudalloc_malloc,
    cudalloc_record_stream, cudalloc_reset_peak_stats, cudalloc_set_malloc_failure_action,
    cudalloc_set_memory_fraction, cudalloc_snapshot_json, cudalloc_stats_json,
    cudalloc_trace_start, cudalloc_trace_stop, last_error_message, with_c_buffer, CBuf, CStrArg,
};
use cudalloc_core::record::csv::HEADER;
use cudalloc_core::{CachingAllocator, Config, Policy};
use cudalloc_sys::{CudaDevice, SimConfig, SimDevice, StreamId};
use serde_json::Value;
use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn has_gpu() -> bool {
    matches!(CudaDevice::device_count(), Ok(n) if n > 0)
}

fn null() -> *mut c_void {
    std::ptr::null_mut()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn c_path(p: &Path) -> CString {
    CString::new(p.to_str().unwrap()).unwrap()
}

#[test]
fn without_a_gpu_malloc_returns_null_and_says_why() {
    let _g = serial();
    if has_gpu() {
        eprintln!("a CUDA GPU is present: the no-GPU checks do not apply");
        return;
    }
    let p = cudalloc_malloc(1 << 20, 0, null());
    assert!(p.is_null());
    let msg = last_error_message();
    assert!(msg.contains("no CUDA device"), "{msg}");
    assert!(msg.starts_with("cudalloc_malloc"), "{msg}");
    assert!(!cudalloc_last_error().is_null());

    assert_eq!(cudalloc_check(), -1);
    assert!(last_error_message().starts_with("cudalloc_check: no CUDA device"));
    assert_eq!(cudalloc_check(), -1);
    assert!(cudalloc_malloc(0, 0, null()).is_null());
    let msg = last_error_message();
    assert!(
        msg.starts_with("cudalloc_malloc: no CUDA device"),
        "zero bytes check the device: {msg}"
    );
    assert!(cudalloc_malloc(64, -1, null()).is_null());
    assert_eq!(cudalloc_empty_cache(0), -1);
    assert!(last_error_message().starts_with("cudalloc_empty_cache: no CUDA device"));
    assert_eq!(cudalloc_record_stream(0x1000 as *mut c_void, 0, null()), -1);
    assert_eq!(cudalloc_set_memory_fraction(0.5, 0), -1);
    assert_eq!(cudalloc_reset_peak_stats(0), -1);
}

#[test]
fn the_malloc_failure_action_can_be_set() {
    let _g = serial();
    assert_eq!(
        cudalloc_set_malloc_failure_action(cudalloc_capi::CUDALLOC_MALLOC_WARN),
        0
    );
    assert_eq!(cudalloc_set_malloc_failure_action(7), -1);
    assert!(last_error_message().contains("7 is not 0"));
    // A failure now also goes to stderr; the result is still NULL.
    assert!(cudalloc_malloc(1 << 50, 0, null()).is_null());
    assert_eq!(
        cudalloc_set_malloc_failure_action(0),
        cudalloc_capi::CUDALLOC_MALLOC_WARN
    );
}

#[test]
fn json_functions_fail_with_zero_without_a_gpu() {
    let _g = serial();
    if has_gpu() {
        return;
    }
    let mut buf = [b'x'; 64];
    assert_eq!(
        with_c_buffer(&mut buf, |b, l| cudalloc_stats_json(0, b, l)),
        0
    );
    assert!(last_error_message().contains("no CUDA device"));
    assert_eq!(
        with_c_buffer(&mut buf, |b, l| cudalloc_snapshot_json(0, b, l)),
        0
    );
    assert!(last_error_message().starts_with("cudalloc_snapshot_json"));
    assert_eq!(buf, [b'x'; 64], "nothing written on failure");
}

#[test]
fn too_small_buffers_get_the_needed_length_and_no_bytes() {
    // The exported JSON functions end in the same writer as this; without a GPU there is no
    // allocator to describe, so the document comes from a simulated one here.
    let alloc = CachingAllocator::new(
        SimDevice::new(SimConfig::with_capacity(1 << 30)),
        Config::for_policy(Policy::Default),
    );
    let a = alloc.allocate(5 << 20, StreamId::DEFAULT).unwrap();
    let text = cudalloc_capi::json::stats(&alloc, Policy::Default, 0, 0, Default::default());
    let n = text.len();
    let mut small = vec![b'x'; 16];
    assert_eq!(
        with_c_buffer(&mut small, |b, l| b.write_c_string(l, text.as_bytes())),
        n
    );
    assert_eq!(small, vec![b'x'; 16]);
    let mut exact = vec![b'x'; n];
    assert_eq!(
        with_c_buffer(&mut exact, |b, l| b.write_c_string(l, text.as_bytes())),
        n
    );
    assert_eq!(exact, vec![b'x'; n], "no room for the NUL: nothing written");
    let mut fits = vec![b'x'; n + 1];
    assert_eq!(
        with_c_buffer(&mut fits, |b, l| b.write_c_string(l, text.as_bytes())),
        n
    );
    assert_eq!(&fits[..n], text.as_bytes());
    assert_eq!(fits[n], 0);
    let v: Value = serde_json::from_slice(&fits[..n]).unwrap();
    assert_eq!(v["allocated_bytes.all.current"], 5 << 20);
    assert_eq!(v["policy"], "default");
    alloc.free(a).unwrap();
}

/// NULL is what a 0-byte `cudalloc_malloc` returns, and PyTorch passes it back to
/// `cudalloc_free` and `cudalloc_record_stream`: neither fails nor sets the last error.
#[test]
fn freeing_null_or_junk_never_panics() {
    let _g = serial();
    assert_eq!(cudalloc_set_malloc_failure_action(99), -1); // a known last error
    let before = last_error_message();
    cudalloc_free(null(), 0, 0, null());
    cudalloc_free(null(), 123, -5, null());
    assert_eq!(cudalloc_record_stream(null(), 0, null()), 0);
    assert_eq!(last_error_message(), before, "NULL set an error");
}

/// A device without an allocator (here: none, there is no GPU) holds no allocation, so freeing
/// a pointer on it fails as not allocated, without opening the device or asking the driver.
#[test]
fn freeing_junk_on_a_device_without_an_allocator_is_not_allocated() {
    let _g = serial();
    if has_gpu() {
        eprintln!("a CUDA GPU is present: device 0 may have an allocator here");
        return;
    }
    let junk = 0xdead_0000 as *mut c_void;
    cudalloc_free(junk, 512, 0, null());
    let msg = last_error_message();
    assert!(
        msg.starts_with("cudalloc_free(0xdead0000, device 0): 0xdead0000 is not a live allocation"),
        "{msg}"
    );
    assert_eq!(cudalloc_record_stream(junk, 0, null()), -1);
    let msg = last_error_message();
    assert!(
        msg.starts_with("cudalloc_record_stream(0xdead0000, device 0): 0xdead0000 is not a live"),
        "{msg}"
    );
    // Also after a call that asked the driver and failed.
    assert!(cudalloc_malloc(64, 0, null()).is_null());
    cudalloc_free(junk, 512, 0, null());
    assert!(last_error_message().contains("is not a live allocation"));
}

/// The per-thread default stream (0x2) is a different stream on each thread: refused by
/// malloc and record_stream before anything else, GPU or not. A negative device (but -1, which
/// `cudalloc_free` reads as "any device") is named as such by free and record_stream, which
/// otherwise look for no allocator.
#[test]
fn the_per_thread_stream_and_negative_devices_are_refused() {
    let _g = serial();
    let per_thread = 0x2 as *mut c_void;
    assert!(cudalloc_malloc(1 << 20, 0, per_thread).is_null());
    let msg = last_error_message();
    assert!(
        msg.starts_with("cudalloc_malloc: stream 0x2 is cudaStreamPerThread"),
        "{msg}"
    );
    let junk = 0xdead_0000 as *mut c_void;
    assert_eq!(cudalloc_record_stream(junk, 0, per_thread), -1);
    let msg = last_error_message();
    assert!(
        msg.starts_with("cudalloc_record_stream: stream 0x2 is cudaStreamPerThread"),
        "{msg}"
    );
    for device in [-2, i32::MIN] {
        cudalloc_free(junk, 512, device, null());
        let msg = last_error_message();
        assert!(
            msg.starts_with(&format!(
                "cudalloc_free: no CUDA device {device}: a device ordinal is never negative"
            )),
            "{msg}"
        );
        assert_eq!(cudalloc_record_stream(junk, device, null()), -1);
        assert!(last_error_message().contains("never negative"));
    }
}

#[test]
fn trace_start_and_stop_report_their_errors() {
    let _g = serial();
    assert_eq!(cudalloc_trace_start(CStrArg::null()), -1);
    assert!(
        last_error_message().contains("NULL"),
        "{}",
        last_error_message()
    );
    assert_eq!(cudalloc_trace_start(CStrArg::new(c"")), -1);
    assert!(last_error_message().contains("empty"));
    let bad = c"/nonexistent-cudalloc-dir/sub/job.trace.csv.gz";
    assert_eq!(cudalloc_trace_start(CStrArg::new(bad)), -1);
    let msg = last_error_message();
    assert!(
        msg.starts_with("cudalloc_trace_start: cannot write a trace to /nonexistent-cudalloc-dir"),
        "{msg}"
    );
    assert_eq!(cudalloc_trace_stop(), -1);
    assert!(last_error_message().contains("no trace is being recorded"));

    let dir = temp_dir("trace");
    let path = dir.join("empty.trace.csv");
    let c = c_path(&path);
    assert_eq!(
        cudalloc_trace_start(CStrArg::new(&c)),
        0,
        "{}",
        last_error_message()
    );
    assert_eq!(cudalloc_trace_start(CStrArg::new(&c)), -1);
    assert!(last_error_message().contains("already being recorded"));
    assert_eq!(cudalloc_trace_stop(), 0, "{}", last_error_message());
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with(HEADER));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn malloc_free_stats_snapshot_and_trace_on_a_gpu() {
    let _g = serial();
    assert!(cudalloc_check() >= 1, "{}", last_error_message());
    let s = null();
    let p = cudalloc_malloc(3 << 20, 0, s);
    assert!(!p.is_null(), "{}", last_error_message());
    let before = fetch_stats(0)["allocation.all.allocated"].as_i64().unwrap();
    let z = cudalloc_malloc(0, 0, s);
    assert!(z.is_null(), "zero bytes give NULL");
    assert_eq!(
        fetch_stats(0)["allocation.all.allocated"].as_i64().unwrap(),
        before,
        "zero bytes allocated nothing"
    );
    assert_eq!(
        cudalloc_record_stream(p, 0, s),
        0,
        "{}",
        last_error_message()
    );

    // Too small a buffer: the needed length, nothing written.
    let mut small = [b'x'; 8];
    let need = with_c_buffer(&mut small, |b, l| cudalloc_stats_json(0, b, l));
    assert!(need > 8);
    assert_eq!(small, [b'x'; 8]);
    let stats = fetch_stats(0);
    assert_eq!(stats["allocation.all.current"], 1);
    assert!(stats["allocated_bytes.all.current"].as_i64().unwrap() >= 3 << 20);
    assert!(stats["reserved_bytes.all.peak"].as_i64().unwrap() >= 3 << 20);
    assert!(stats["policy"].is_string());
    assert!(stats["fragmentation"]["utilisation"].is_number());

    let snap = fetch_snapshot(0);
    let blocks: Vec<&Value> = snap["segments"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["blocks"].as_array().unwrap())
        .collect();
    let mine = blocks.iter().find(|b| b["addr"] == p as u64).unwrap();
    assert_eq!(mine["state"], "allocated");
    assert_eq!(mine["requested"], 3 << 20);

    // A trace of a few calls, gzip'd.
    let dir = temp_dir("gpu-trace");
    let path = dir.join("t.csv.gz");
    let c = c_path(&path);
    assert_eq!(
        cudalloc_trace_start(CStrArg::new(&c)),
        0,
        "{}",
        last_error_message()
    );
    let q = cudalloc_malloc(1000, 0, s);
    assert!(!q.is_null());
    cudalloc_free(q, 1000, 0, s);
    cudalloc_free(z, 0, 0, s); // NULL: ignored, not written
    assert!(cudalloc_malloc(0, 0, s).is_null()); // nothing handed out, not written
    assert_eq!(cudalloc_trace_stop(), 0, "{}", last_error_message());
    let trace = cudalloc_trace::read(&path).unwrap();
    assert_eq!(trace.anomalies, Default::default());
    // p was live at the start, q came and went.
    assert_eq!(trace.ops.len(), 1 + 2);
    std::fs::remove_dir_all(&dir).unwrap();

    cudalloc_free(p, 3 << 20, 0, s);
    cudalloc_free(p, 3 << 20, 0, s);
    assert!(last_error_message().contains("not a live allocation"));
    assert_eq!(fetch_stats(0)["capi"]["free_errors"], 1);
    assert_eq!(fetch_stats(0)["allocation.all.current"], 0);

    // Out of memory is NULL with the reason.
    assert_eq!(cudalloc_set_memory_fraction(0.25, 0), 0);
    let huge = cudalloc_malloc(1 << 40, 0, s);
    assert!(huge.is_null());
    assert!(
        last_error_message().contains("out of memory"),
        "{}",
        last_error_message()
    );
    assert_eq!(cudalloc_set_memory_fraction(1.0, 0), 0);
    assert_eq!(cudalloc_set_memory_fraction(2.0, 0), -1);

    // Many threads at once.
    std::thread::scope(|sc| {
        for t in 0..8usize {
            sc.spawn(move || {
                for i in 0..500usize {
                    let n = 512 + (t * 7919 + i * 104_729) % (4 << 20);
                    let p = cudalloc_malloc(n, 0, null());
                    assert!(!p.is_null(), "{}", last_error_message());
                    cudalloc_free(p, n, 0, null());
                }
            });
        }
    });
    let stats = fetch_stats(0);
    assert_eq!(stats["allocation.all.current"], 0);
    assert_eq!(stats["capi"]["free_errors"], 1);

    assert_eq!(cudalloc_reset_peak_stats(0), 0);
    assert_eq!(cudalloc_empty_cache(0), 0, "{}", last_error_message());
    assert!(cudalloc_malloc(64, 99, s).is_null());
    assert!(last_error_message().contains("no CUDA device 99"));
}

fn fetch_stats(device: i32) -> Value {
    fetch(|b, l| cudalloc_stats_json(device, b, l))
}

fn fetch_snapshot(device: i32) -> Value {
    fetch(|b, l| cudalloc_snapshot_json(device, b, l))
}

/// Asks for the length with an empty buffer, then fetches into one that fits.
fn fetch(f: impl for<'id> Fn(CBuf<'id>, cudalloc_capi::CBufLen<'id>) -> usize) -> Value {
    let need = with_c_buffer(&mut [], &f);
    assert!(need > 0, "{}", last_error_message());
    let mut buf = vec![0u8; need + 1];
    let got = with_c_buffer(&mut buf, &f);
    assert_eq!(got, need);
    assert_eq!(buf[need], 0, "NUL-terminated");
    serde_json::from_slice(&buf[..need]).unwrap()
}
