//! The error kind (`cudalloc_last_error_kind`), freeing by pointer alone (device -1) and the
//! binary statistics (`cudalloc_device_stats`): what the PyTorch backend builds on to raise
//! `torch.OutOfMemoryError`, to free a tensor's memory from its pointer, and to answer
//! `torch.cuda.memory_stats()`.
//!
//! Invariants checked: a failed call sets a kind with its message, out of memory only for a
//! request the device or the cap cannot hold; the binary statistics hold the same values, in
//! the documented order, as the JSON's torch keys; a pointer freed with device -1 goes back to
//! the allocator that holds it. The allocators are process-wide, so every test takes `serial`.

use cudalloc_capi::json::TORCH_VALUES;
use cudalloc_capi::{
    cudalloc_device_stats, cudalloc_free, cudalloc_last_error_kind, cudalloc_malloc,
    cudalloc_set_malloc_failure_action, cudalloc_set_memory_fraction, cudalloc_stats_json,
    last_error_message, with_c_buffer, CUDALLOC_ERROR_OTHER, CUDALLOC_ERROR_OUT_OF_MEMORY,
};
use cudalloc_core::Stats;
use cudalloc_sys::CudaDevice;
use serde_json::Value;
use std::ffi::c_void;
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

#[test]
fn the_documented_order_is_that_of_the_torch_keys() {
    let keys: Vec<String> = Stats::default()
        .to_torch_dict()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(keys.len(), TORCH_VALUES);
    assert_eq!(TORCH_VALUES, 122, "the header's CUDALLOC_DEVICE_STATS");
    assert_eq!(keys[0], "allocation.all.current");
    assert_eq!(keys[3], "allocation.all.freed");
    assert_eq!(keys[4], "allocation.small_pool.current");
    assert_eq!(keys[12], "segment.all.current");
    assert_eq!(keys[107], "requested_bytes.large_pool.freed");
    assert_eq!(keys[108], "oversize_allocations.current");
    assert_eq!(keys[112], "oversize_segments.current");
    let tail = [
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "max_split_size",
    ];
    assert_eq!(&keys[116..], &tail);
    let header = include_str!("../include/cudalloc.h");
    assert!(header.contains("#define CUDALLOC_DEVICE_STATS 122"));
}

#[test]
fn without_a_gpu_failures_are_of_the_other_kind() {
    let _g = serial();
    if has_gpu() {
        eprintln!("a CUDA GPU is present: the no-GPU checks do not apply");
        return;
    }
    assert!(cudalloc_malloc(1 << 20, 0, null()).is_null());
    assert_eq!(cudalloc_last_error_kind(), CUDALLOC_ERROR_OTHER);
    assert_eq!(
        with_c_buffer(&mut [0u8; 2048], |b, l| cudalloc_device_stats(0, b, l)),
        0
    );
    assert!(last_error_message().starts_with("cudalloc_device_stats: no CUDA device"));
    cudalloc_free(0xdead_0000 as *mut c_void, 0, -1, null());
    let msg = last_error_message();
    assert!(
        msg.starts_with("cudalloc_free(0xdead0000, any device): 0xdead0000 is not a live"),
        "{msg}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn out_of_memory_is_its_own_kind_on_a_gpu() {
    let _g = serial();
    assert_eq!(cudalloc_set_malloc_failure_action(0), 0);
    assert_eq!(
        cudalloc_set_memory_fraction(0.01, 0),
        0,
        "{}",
        last_error_message()
    );
    let too_much = cudalloc_malloc(8 << 30, 0, null());
    assert!(too_much.is_null());
    assert_eq!(cudalloc_last_error_kind(), CUDALLOC_ERROR_OUT_OF_MEMORY);
    assert!(
        last_error_message().contains("out of memory"),
        "{}",
        last_error_message()
    );
    // Larger than any device: PyTorch's allocator raises OutOfMemoryError for it too.
    assert!(cudalloc_malloc(1 << 62, 0, null()).is_null());
    assert_eq!(cudalloc_last_error_kind(), CUDALLOC_ERROR_OUT_OF_MEMORY);
    assert!(cudalloc_malloc(64, 0, 0x2 as *mut c_void).is_null());
    assert_eq!(cudalloc_last_error_kind(), CUDALLOC_ERROR_OTHER);
    assert_eq!(cudalloc_set_memory_fraction(1.0, 0), 0);
    let ok = cudalloc_malloc(1 << 20, 0, null());
    assert!(!ok.is_null(), "{}", last_error_message());
    assert_eq!(
        cudalloc_last_error_kind(),
        CUDALLOC_ERROR_OTHER,
        "a success keeps the last error, kind and message"
    );
    cudalloc_free(ok, 0, -1, null());
    assert_eq!(torch_values()[0], 0, "freed by pointer alone");
    let before = stats_json()["capi"]["free_errors"].as_u64().unwrap();
    cudalloc_free(ok, 0, -1, null());
    assert!(
        last_error_message().contains("not a live"),
        "{}",
        last_error_message()
    );
    assert_eq!(
        stats_json()["capi"]["free_errors"].as_u64(),
        Some(before + 1),
        "a pointer freed twice with device -1 is counted on device 0"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn binary_stats_match_the_json_on_a_gpu() {
    let _g = serial();
    let a = cudalloc_malloc(3 << 20, 0, null());
    let b = cudalloc_malloc(1000, 0, null());
    assert!(!a.is_null() && !b.is_null(), "{}", last_error_message());
    let values = torch_values();
    let json = stats_json();
    let keys: Vec<String> = Stats::default()
        .to_torch_dict()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    for (k, v) in keys.iter().zip(&values) {
        assert_eq!(json[k].as_i64(), Some(*v), "{k}");
    }
    assert_eq!(values[0], 2, "allocation.all.current");
    let mut short = vec![0xAAu8; TORCH_VALUES * 8 - 1];
    let need = with_c_buffer(&mut short, |b, l| cudalloc_device_stats(0, b, l));
    assert_eq!(need, TORCH_VALUES * 8);
    assert!(
        short.iter().all(|&x| x == 0xAA),
        "nothing written to a short buffer"
    );
    cudalloc_free(a, 0, -1, null());
    cudalloc_free(b, 0, 0, null());
    assert_eq!(torch_values()[0], 0);
}

fn torch_values() -> Vec<i64> {
    let mut buf = vec![0u8; TORCH_VALUES * 8];
    let n = with_c_buffer(&mut buf, |b, l| cudalloc_device_stats(0, b, l));
    assert_eq!(n, TORCH_VALUES * 8, "{}", last_error_message());
    buf.chunks_exact(8)
        .map(|c| i64::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

fn stats_json() -> Value {
    let need = with_c_buffer(&mut [], |b, l| cudalloc_stats_json(0, b, l));
    let mut buf = vec![0u8; need + 1];
    with_c_buffer(&mut buf, |b, l| cudalloc_stats_json(0, b, l));
    serde_json::from_slice(&buf[..need]).unwrap()
}
