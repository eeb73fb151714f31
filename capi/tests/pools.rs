//! The private-pool functions (`cudalloc_pool_*`) through the C ABI: a pool's memory is never
//! handed outside it, is freed by pointer alone, counts in the device's statistics, and goes
//! back when the pool is released. The allocators are process-wide: every test takes `serial`.

use cudalloc_capi::json::TORCH_VALUES;
use cudalloc_capi::{
    cudalloc_capture_begin, cudalloc_capture_end, cudalloc_device_stats, cudalloc_empty_cache,
    cudalloc_free, cudalloc_last_error_kind, cudalloc_malloc, cudalloc_pool_acquire,
    cudalloc_pool_empty_cache, cudalloc_pool_live, cudalloc_pool_malloc, cudalloc_pool_release,
    cudalloc_pool_use_count, last_error_message, with_c_buffer, CUDALLOC_ERROR_OTHER,
};
use cudalloc_sys::CudaDevice;
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn null() -> *mut c_void {
    std::ptr::null_mut()
}

#[test]
fn without_a_gpu_pool_calls_fail_with_the_reason() {
    let _g = serial();
    if matches!(CudaDevice::device_count(), Ok(n) if n > 0) {
        eprintln!("a CUDA GPU is present: the no-GPU checks do not apply");
        return;
    }
    assert_eq!(cudalloc_pool_acquire(0, 0, 1), -1);
    assert!(last_error_message().starts_with("cudalloc_pool_acquire: no CUDA device"));
    assert!(cudalloc_pool_malloc(64, 0, null(), 0, 1).is_null());
    assert_eq!(cudalloc_last_error_kind(), CUDALLOC_ERROR_OTHER);
    let live = with_c_buffer(&mut [], |b, l| cudalloc_pool_live(0, 0, 1, b, l));
    assert_eq!(live, -1);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pool_keeps_its_memory_apart_on_a_gpu() {
    let _g = serial();
    let (p0, p1) = (0u64, 77u64);
    assert!(
        cudalloc_pool_malloc(64, 0, null(), p0, p1).is_null(),
        "not in use yet"
    );
    assert_eq!(
        cudalloc_pool_acquire(0, p0, p1),
        0,
        "{}",
        last_error_message()
    );
    assert_eq!(cudalloc_pool_use_count(0, p0, p1), 1);
    let a = cudalloc_pool_malloc(4 << 20, 0, null(), p0, p1);
    assert!(!a.is_null(), "{}", last_error_message());
    cudalloc_free(a, 0, -1, null());
    let outside = cudalloc_malloc(4 << 20, 0, null());
    assert!(!outside.is_null());
    assert_ne!(
        outside, a,
        "memory freed in a pool is not handed outside it"
    );
    let b = cudalloc_pool_malloc(4 << 20, 0, null(), p0, p1);
    assert_eq!(b, a, "the pool reuses its own");
    let mut addrs = [0u8; 16];
    let n = with_c_buffer(&mut addrs, |buf, len| {
        cudalloc_pool_live(0, p0, p1, buf, len)
    });
    assert_eq!(n, 1);
    assert_eq!(u64::from_ne_bytes(addrs[..8].try_into().unwrap()), b as u64);
    assert_eq!(stats()[0], 2, "allocation.all.current counts the pool's");
    let reserved = stats()[60]; // reserved_bytes.all.current
    cudalloc_free(outside, 0, -1, null());
    assert_eq!(cudalloc_empty_cache(0), 0, "{}", last_error_message());
    assert!(stats()[60] <= reserved);
    let again = cudalloc_pool_malloc(4 << 20, 0, null(), p0, p1);
    cudalloc_free(again, 0, -1, null());
    assert_eq!(cudalloc_empty_cache(0), 0);
    let pool_kept = cudalloc_pool_malloc(4 << 20, 0, null(), p0, p1);
    assert_eq!(
        pool_kept, again,
        "empty_cache left the pool in use its freed memory"
    );
    cudalloc_free(pool_kept, 0, -1, null());
    assert_eq!(cudalloc_pool_release(0, p0, p1), 0);
    assert_eq!(cudalloc_pool_use_count(0, p0, p1), 0);
    assert!(
        cudalloc_pool_malloc(64, 0, null(), p0, p1).is_null(),
        "released"
    );
    cudalloc_free(b, 0, 0, null());
    assert_eq!(stats()[0], 0, "{}", last_error_message());
    assert_eq!(
        cudalloc_pool_empty_cache(0, p0, p1),
        0,
        "{}",
        last_error_message()
    );
    assert_eq!(cudalloc_pool_release(0, p0, p1), -1, "not in use");
}

fn stats() -> Vec<i64> {
    let mut buf = vec![0u8; TORCH_VALUES * 8];
    with_c_buffer(&mut buf, |b, l| cudalloc_device_stats(0, b, l));
    buf.chunks_exact(8)
        .map(|c| i64::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// `cudalloc_capture_begin`/`end` reach the device's allocator: `cudalloc_empty_cache` fails
/// while a capture is underway (it would wait for the device), an end without a begin fails,
/// and after the end everything works again.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_capture_told_through_the_c_abi_holds_every_release_back() {
    let _g = serial();
    let a = cudalloc_malloc(4 << 20, 0, null());
    assert!(!a.is_null(), "{}", last_error_message());
    cudalloc_free(a, 0, -1, null());
    assert_eq!(cudalloc_capture_begin(0), 0, "{}", last_error_message());
    assert_eq!(cudalloc_empty_cache(0), -1);
    assert!(
        last_error_message().contains("capture"),
        "{}",
        last_error_message()
    );
    assert_eq!(cudalloc_capture_end(0), 0, "{}", last_error_message());
    assert_eq!(cudalloc_capture_end(0), -1, "no capture left to end");
    assert_eq!(cudalloc_empty_cache(0), 0, "{}", last_error_message());
}
