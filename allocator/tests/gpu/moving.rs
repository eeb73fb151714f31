//! Page moving on a real GPU (`pool::moving`): a page mapped at a second address is the same
//! memory, outlives its handle's release until its last unmap, and under the `default` policy a
//! growth takes the pages its give-back left on their way back while the stream is busy, with
//! stream order keeping the bytes right. Every test needs a CUDA GPU and is ignored elsewhere.

use crate::device::GPU;
use cudalloc::{Allocation, Config, Pool};
use cudalloc_sys::{CudaDevice, Device, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
/// How long the stream's work runs before the frees and the growth.
const SLEEP_MS: u32 = 500;
/// Attempts before the test gives up on keeping the stream busy.
const ATTEMPTS: usize = 3;

fn read(dev: &CudaDevice, ptr: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    dev.copy_from_device(ptr, &mut out)
        .expect("copy from device");
    out
}

fn free_bytes(dev: &CudaDevice) -> u64 {
    dev.mem_info().unwrap().0
}

/// The driver's side of a move: one page mapped at two addresses reads the same bytes at both,
/// its handle may be released while it is mapped, and its memory goes at its last unmap.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_page_mapped_twice_is_one_memory_until_its_last_unmap() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = CudaDevice::new(0).expect("device");
    let g = dev.granularity().unwrap();
    let (a, b) = (dev.reserve(g).unwrap(), dev.reserve(g).unwrap());
    let before = free_bytes(&dev);
    let page = dev.create_page(g).unwrap();
    dev.map(a, g, page).unwrap();
    dev.set_access(a, g, &[]).unwrap();
    let data: Vec<u8> = (0..g).map(|i| (i % 251) as u8).collect();
    dev.copy_to_device(a, &data).unwrap();
    dev.map(b, g, page).unwrap();
    dev.set_access(b, g, &[]).unwrap();
    assert!(
        read(&dev, b, g) == data,
        "the second address shows the bytes"
    );
    dev.release_page(page).unwrap();
    assert!(dev.release_page(page).is_err(), "the handle is gone");
    dev.unmap(a, g).unwrap();
    assert!(read(&dev, b, g) == data, "still mapped at b after a went");
    assert!(free_bytes(&dev) + g <= before, "the page is still held");
    dev.unmap(b, g).unwrap();
    assert!(free_bytes(&dev) + g > before, "gone with its last mapping");
    dev.unreserve(a, g).unwrap();
    dev.unreserve(b, g).unwrap();
}

/// `default` with 2 MiB chunks and a 75% budget (no layout plans) on the GPU, past its
/// loading, and a stream of its own.
fn gpu_pool() -> (Arc<CudaDevice>, Pool<Arc<CudaDevice>>, StreamId) {
    let dev = Arc::new(CudaDevice::new(0).expect("device"));
    let s = dev.create_stream().expect("stream");
    let cfg = "policy:default,layout_plans:false,max_chunk_mb:2,fragmentation_budget:0.75";
    let mut pool = Pool::new(dev.clone(), Config::parse(cfg).unwrap());
    let a = pool.allocate(512, s).unwrap();
    pool.free(a).unwrap();
    pool.empty_cache().unwrap();
    (dev, pool, s)
}

/// While stream `s` sleeps: a 30 MiB and a 6 MiB block, each before a live 2 MiB block, are
/// filled with 0x11 on `s` and freed; a 34 MiB growth on `s` then gives back the 6 MiB block,
/// whose pages are still queued for, and takes them. The growth's bytes are set to 0x22 on `s`.
/// False when the stream's work had ended before the growth (the attempt proves nothing).
fn move_while_busy() -> bool {
    let (dev, mut pool, s) = gpu_pool();
    let done = dev.create_event().unwrap();
    dev.sleep_on_stream(s, SLEEP_MS).unwrap();
    dev.record_event(done, s).unwrap();
    let large = pool.allocate(30 * MIB, s).unwrap();
    let k1 = pool.allocate(2 * MIB, s).unwrap();
    let small = pool.allocate(6 * MIB, s).unwrap();
    let k2 = pool.allocate(2 * MIB, s).unwrap();
    for a in [&large, &small] {
        dev.memset_async(a.ptr(), 0x11, a.size(), s).unwrap();
    }
    pool.free(large).unwrap();
    pool.free(small).unwrap();
    let grown = pool.allocate(34 * MIB, s).unwrap();
    if dev.query_event(done).unwrap() {
        finish(&dev, pool, [k1, k2, grown]);
        return false;
    }
    assert_eq!(pool.stats().pages_moved, 3, "the 6 MiB block's pages moved");
    assert_eq!(pool.releasing_bytes(), 0);
    pool.check_invariants().unwrap();
    dev.memset_async(grown.ptr(), 0x22, grown.size(), s)
        .unwrap();
    dev.synchronize_event(done).unwrap();
    dev.synchronize_device().unwrap();
    let back = read(&dev, grown.ptr(), grown.size());
    assert!(
        back.iter().all(|&x| x == 0x22),
        "stream order kept the bytes"
    );
    finish(&dev, pool, [k1, k2, grown]);
    true
}

/// Frees `live` and drops the pool: the device's memory is all back.
fn finish(dev: &CudaDevice, mut pool: Pool<Arc<CudaDevice>>, live: [Allocation; 3]) {
    dev.synchronize_device().unwrap();
    let poll = pool.allocate(512, StreamId::DEFAULT).unwrap();
    pool.check_invariants().unwrap();
    for a in live.into_iter().chain([poll]) {
        pool.free(a).unwrap();
    }
    pool.empty_cache().unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(pool.reserved(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_growth_takes_the_pages_its_stream_still_queues_for_and_the_bytes_stay_right() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let baseline = free_bytes(&CudaDevice::new(0).unwrap());
    let checked = (0..ATTEMPTS).any(|_| move_while_busy());
    assert!(
        checked,
        "the stream's work ended first in each of {ATTEMPTS} attempts"
    );
    let after = free_bytes(&CudaDevice::new(0).unwrap());
    assert!(
        after + 4 * MIB >= baseline,
        "{after} free against {baseline}"
    );
}
