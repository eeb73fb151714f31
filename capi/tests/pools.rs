//! The private-pool functions (`cudalloc_pool_*`) through the C ABI: a pool's memory is never
//! handed outside it, is freed by pointer alone, counts in the device's statistics, and goes
//! back when the pool is released. The allocators are process-wide: every test takes `serial`.

use cudalloc_capi::json::TORCH_VALUES;
use cudalloc_capi::{
    cudalloc_capture_begin, cudalloc_capture_end, cudalloc_device_stats, cudalloc_empty_cache,
    cudalloc_free, cudalloc_last_error_kind, cudalloc_malloc, cudalloc_pool_acquire,
    cudalloc_pool_allocate_at, cudalloc_pool_blocks, cudalloc_pool_empty_cache, cudalloc_pool_live,
    cudalloc_pool_malloc, cudalloc_pool_release, cudalloc_pool_set_use_on_oom,
    cudalloc_pool_use_count, cudalloc_set_memory_fraction, last_error_message, with_c_buffer,
    CUDALLOC_ERROR_OTHER,
};
use cudalloc_sys::{CudaDevice, Device};
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
    let blocks = with_c_buffer(&mut [], |b, l| cudalloc_pool_blocks(0, 0, 1, b, l));
    assert_eq!(blocks, -1);
    assert_eq!(
        cudalloc_pool_allocate_at(0, 0, 1, null(), 512, 1, null()),
        -1
    );
    assert!(last_error_message().starts_with("cudalloc_pool_allocate_at: no CUDA device"));
    assert_eq!(cudalloc_pool_set_use_on_oom(0, 0, 1, 1), -1);
    assert!(last_error_message().starts_with("cudalloc_pool_set_use_on_oom: no CUDA device"));
}

/// The live blocks of a pool (address, block bytes, requested, stream), as a checkpoint lists
/// them.
fn pool_blocks(p0: u64, p1: u64) -> Vec<[u64; 4]> {
    let mut buf = vec![0u8; 64 * 32];
    let n = with_c_buffer(&mut buf, |b, l| cudalloc_pool_blocks(0, p0, p1, b, l));
    assert!(n >= 0, "{}", last_error_message());
    let words: Vec<u64> = buf[..n as usize * 32]
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    words
        .chunks_exact(4)
        .map(|w| [w[0], w[1], w[2], w[3]])
        .collect()
}

/// A checkpoint of a pool restored through the C ABI, as CUDA graph trees restore one: the
/// blocks freed since are handed out again at their addresses; a live block is refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_pool_checkpoint_is_restored_at_its_addresses_on_a_gpu() {
    let _g = serial();
    let (p0, p1) = (0u64, 78u64);
    assert_eq!(
        cudalloc_pool_acquire(0, p0, p1),
        0,
        "{}",
        last_error_message()
    );
    let ptrs: Vec<*mut c_void> = [3 << 20, 600 << 10, 9 << 20, 1000]
        .iter()
        .map(|&n| cudalloc_pool_malloc(n, 0, null(), p0, p1))
        .collect();
    assert!(
        ptrs.iter().all(|p| !p.is_null()),
        "{}",
        last_error_message()
    );
    let checkpoint = pool_blocks(p0, p1);
    assert_eq!(checkpoint.len(), 4);
    for &p in &ptrs[1..3] {
        cudalloc_free(p, 0, -1, null());
    }
    assert_eq!(pool_blocks(p0, p1).len(), 2);
    for [ptr, size, requested, stream] in &checkpoint {
        if ptrs[1..3].contains(&(*ptr as usize as *mut c_void)) {
            let r = cudalloc_pool_allocate_at(
                0,
                p0,
                p1,
                *ptr as usize as *mut c_void,
                *size as usize,
                *requested as usize,
                *stream as usize as *mut c_void,
            );
            assert_eq!(r, 0, "{}", last_error_message());
        }
    }
    assert_eq!(pool_blocks(p0, p1), checkpoint);
    let [ptr, size, requested, _] = checkpoint[0];
    let again = cudalloc_pool_allocate_at(
        0,
        p0,
        p1,
        ptr as usize as *mut c_void,
        size as usize,
        requested as usize,
        null(),
    );
    assert_eq!(again, -1, "a live block");
    assert!(
        last_error_message().contains("cannot hand out"),
        "{}",
        last_error_message()
    );
    for p in ptrs {
        cudalloc_free(p, 0, -1, null());
    }
    assert_eq!(cudalloc_pool_release(0, p0, p1), 0);
    assert_eq!(
        cudalloc_pool_empty_cache(0, p0, p1),
        0,
        "{}",
        last_error_message()
    );
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

/// A pool set to lend (PyTorch's `MemPool(use_on_oom=True)`) gives its cached memory to an
/// allocation outside it that runs out of memory under the device's cap; by default a pool in
/// use keeps it. A pool not in use cannot be set.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_lending_pool_gives_its_cache_to_an_allocation_out_of_memory_on_a_gpu() {
    let _g = serial();
    let (p0, p1) = (79u64, 0u64);
    assert_eq!(cudalloc_pool_set_use_on_oom(0, p0, p1, 1), -1, "not in use");
    assert!(
        last_error_message().contains("no private pool (79, 0) in use"),
        "{}",
        last_error_message()
    );
    assert_eq!(
        cudalloc_pool_acquire(0, p0, p1),
        0,
        "{}",
        last_error_message()
    );
    const BIG: usize = 512 << 20;
    let cached = cudalloc_pool_malloc(BIG, 0, null(), p0, p1);
    assert!(!cached.is_null(), "{}", last_error_message());
    cudalloc_free(cached, 0, -1, null());
    assert_eq!(cudalloc_empty_cache(0), 0, "{}", last_error_message());
    // A cap 128 MiB above what the device's allocator and its pools hold, the pool's 512 MiB
    // cache included: BIG more fits only once that cache went back.
    let total = CudaDevice::new(0).and_then(|d| d.mem_info()).unwrap().1;
    let cap = stats()[60] as u64 + (128 << 20); // reserved_bytes.all.current
    assert_eq!(
        cudalloc_set_memory_fraction(cap as f64 / total as f64, 0),
        0
    );
    let refused = cudalloc_malloc(BIG, 0, null());
    let set = cudalloc_pool_set_use_on_oom(0, p0, p1, 1);
    let lent = cudalloc_malloc(BIG, 0, null());
    let why = last_error_message();
    // Put back before asserting: the other tests of this binary share the device.
    for p in [refused, lent] {
        cudalloc_free(p, 0, -1, null());
    }
    assert_eq!(cudalloc_set_memory_fraction(1.0, 0), 0);
    assert_eq!(cudalloc_pool_release(0, p0, p1), 0);
    assert!(refused.is_null(), "the pool in use keeps its cache");
    assert_eq!(set, 0);
    assert!(!lent.is_null(), "{why}");
    assert_eq!(cudalloc_empty_cache(0), 0, "{}", last_error_message());
}
