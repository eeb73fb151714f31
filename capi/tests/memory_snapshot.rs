//! `cudalloc_memory_snapshot` through the C ABI: the failure without a GPU, and on a GPU the
//! document of the device's memory and of a private pool's, read back with
//! `memory_snapshot::parse`. The document itself is tested on the simulated device in
//! `src/memory_snapshot_tests.rs`. The allocators are process-wide: every test takes `serial`.

use cudalloc_capi::json::TORCH_VALUES;
use cudalloc_capi::memory_snapshot::{self, Records, HEADER_BYTES, LARGE};
use cudalloc_capi::{
    cudalloc_device_stats, cudalloc_free, cudalloc_malloc, cudalloc_memory_snapshot,
    cudalloc_pool_acquire, cudalloc_pool_malloc, cudalloc_pool_release, last_error_message,
    with_c_buffer,
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

/// The document of device 0 (pool `pool`), with the two-call size protocol.
fn snapshot(pool: (u64, u64)) -> Records {
    let need = with_c_buffer(&mut [], |b, l| {
        cudalloc_memory_snapshot(0, pool.0, pool.1, b, l)
    });
    assert!(need >= HEADER_BYTES, "{}", last_error_message());
    let mut buf = vec![0u8; need + 4096];
    let got = with_c_buffer(&mut buf, |b, l| {
        cudalloc_memory_snapshot(0, pool.0, pool.1, b, l)
    });
    assert!(
        got <= buf.len(),
        "it grew by more than 4 KiB between the calls"
    );
    memory_snapshot::parse(&buf[..got]).expect("a whole document")
}

/// Device 0's `torch.cuda.memory_stats()` values.
fn stats() -> Vec<i64> {
    let mut buf = vec![0u8; TORCH_VALUES * 8];
    let n = with_c_buffer(&mut buf, |b, l| cudalloc_device_stats(0, b, l));
    assert_eq!(n, buf.len(), "{}", last_error_message());
    buf.chunks_exact(8)
        .map(|c| i64::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn without_a_gpu_the_snapshot_fails_with_the_reason() {
    let _g = serial();
    if matches!(CudaDevice::device_count(), Ok(n) if n > 0) {
        eprintln!("a CUDA GPU is present: the no-GPU checks do not apply");
        return;
    }
    let n = with_c_buffer(&mut [], |b, l| cudalloc_memory_snapshot(0, 0, 0, b, l));
    assert_eq!(n, 0);
    let msg = last_error_message();
    assert!(
        msg.starts_with("cudalloc_memory_snapshot: no CUDA device"),
        "{msg}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_snapshot_holds_every_live_allocation_and_adds_up_to_the_stats() {
    let _g = serial();
    let sizes = [1000usize, 3 << 20, 64 << 20];
    let ptrs: Vec<*mut c_void> = sizes
        .iter()
        .map(|&n| cudalloc_malloc(n, 0, null()))
        .collect();
    assert!(
        ptrs.iter().all(|p| !p.is_null()),
        "{}",
        last_error_message()
    );
    let (p0, p1) = (0u64, 4242u64);
    assert_eq!(
        cudalloc_pool_acquire(0, p0, p1),
        0,
        "{}",
        last_error_message()
    );
    let pooled = cudalloc_pool_malloc(5 << 20, 0, null(), p0, p1);
    assert!(!pooled.is_null(), "{}", last_error_message());

    let r = snapshot((0, 0));
    let stats = stats();
    let reserved: u64 = r.segments.iter().map(|s| s.total_size).sum();
    assert_eq!(reserved as i64, stats[5 * 12], "reserved_bytes.all.current");
    let allocated: u64 = r
        .blocks
        .iter()
        .filter(|b| b.state == 1)
        .map(|b| b.size)
        .sum();
    assert_eq!(
        allocated as i64,
        stats[4 * 12],
        "allocated_bytes.all.current"
    );
    let holder = |ptr: *mut c_void| {
        let addr = ptr as u64;
        let seg = r
            .segments
            .iter()
            .find(|s| (s.address..s.address + s.total_size).contains(&addr));
        let seg = seg.unwrap_or_else(|| panic!("{addr:#x} in no segment"));
        let block = r.blocks_of(seg).iter().find(|b| b.address == addr).copied();
        (
            *seg,
            block.unwrap_or_else(|| panic!("{addr:#x} starts no block")),
        )
    };
    for (&p, &n) in ptrs.iter().zip(&sizes) {
        let (seg, block) = holder(p);
        assert_eq!(block.state, 1, "allocated");
        assert!(block.size >= n as u64 && block.requested == n as u64);
        assert_eq!(seg.pool, (0, 0));
        assert_eq!(seg.device, 0);
    }
    assert_eq!(holder(ptrs[2]).0.flags & LARGE, LARGE);
    assert_eq!(holder(pooled).0.pool, (p0, p1));

    let only = snapshot((p0, p1));
    assert!(only.segments.iter().all(|s| s.pool == (p0, p1)));
    assert!(only
        .blocks
        .iter()
        .any(|b| b.address == pooled as u64 && b.state == 1));
    assert!(
        snapshot((7, 7)).segments.is_empty(),
        "a pool the device does not have"
    );

    for p in ptrs.into_iter().chain([pooled]) {
        cudalloc_free(p, 0, -1, null());
    }
    assert_eq!(cudalloc_pool_release(0, p0, p1), 0);
}
