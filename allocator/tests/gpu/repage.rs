//! Re-paging on a real GPU (`pool::repage`): under a memory limit the `default` policy's last
//! resort makes the chunks that live blocks pin again from their kept pages, copying the live
//! bytes device to device through a scratch range. Every test needs a CUDA GPU and is ignored
//! elsewhere.
//!
//! Checks: the live blocks' bytes survive at their addresses, the chunks counted (one unmap, one
//! map per kept run), the device waits (one for the device, one per chunk's copies), no host
//! buffer, the bytes given back; and the time of one re-paging of many chunks, printed.

use crate::device::GPU;
use cudalloc::{Allocation, Config, Pool};
use cudalloc_sys::{CudaDevice, Device, StreamId};
use std::sync::Arc;
use std::time::Instant;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId::DEFAULT;

type Gpu = Arc<CudaDevice>;

fn pattern(len: u64, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i.wrapping_mul(0x9E37_79B1) >> 11) ^ seed.wrapping_mul(97)) as u8)
        .collect()
}

fn fill(dev: &CudaDevice, a: &Allocation, seed: u64) {
    dev.copy_to_device(a.ptr(), &pattern(a.size(), seed))
        .expect("copy to device");
}

fn holds(dev: &CudaDevice, a: &Allocation, seed: u64) -> bool {
    let mut back = vec![0u8; a.size() as usize];
    dev.copy_from_device(a.ptr(), &mut back)
        .expect("copy from device");
    back == pattern(a.size(), seed)
}

fn free_bytes() -> u64 {
    CudaDevice::new(0).unwrap().mem_info().unwrap().0
}

/// A `default` pool (no layout plans) on the GPU, past its loading, and a stream of its own.
fn gpu_pool() -> (Gpu, Pool<Gpu>, StreamId) {
    let dev = Arc::new(CudaDevice::new(0).expect("device"));
    let s1 = dev.create_stream().expect("stream");
    let cfg = Config::parse("policy:default,layout_plans:false").unwrap();
    let mut pool = Pool::new(dev.clone(), cfg);
    let a = pool.allocate(512, S0).unwrap();
    pool.free(a).unwrap();
    pool.empty_cache().unwrap();
    (dev, pool, s1)
}

/// Live blocks on both sides of whole free pages in a 40 MiB chunk, one across two chunks and
/// small blocks; a growth past the limit makes the chunk again from its two runs of kept pages.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_capped_pool_re_pages_a_pinned_chunk_and_keeps_the_live_bytes() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let baseline = free_bytes();
    {
        let (dev, mut pool, s1) = gpu_pool();
        let page = dev.granularity().unwrap();
        assert_eq!(page, 2 * MIB, "the layout below assumes 2 MiB pages");
        pool.set_limit(Some(46 * MIB));
        let whole = pool.allocate(44 * MIB, S0).unwrap();
        let base = whole.ptr();
        pool.free(whole).unwrap();
        let first = pool.allocate(3 * MIB, S0).unwrap();
        let gap = pool.allocate(35 * MIB, S0).unwrap();
        let across = pool.allocate(6 * MIB, S0).unwrap();
        assert_eq!((first.ptr(), across.ptr()), (base, base + 38 * MIB));
        pool.free(gap).unwrap();
        let small: Vec<Allocation> = (0..4)
            .map(|_| pool.allocate(300 * KIB, S0).unwrap())
            .collect();
        let live: Vec<&Allocation> = [&first, &across].into_iter().chain(&small).collect();
        for (k, a) in live.iter().enumerate() {
            fill(&dev, a, k as u64 + 10);
        }
        let before = pool.stats().clone();

        let grown = pool
            .allocate(10 * MIB, s1)
            .expect("the last resort makes room");
        pool.check_invariants().unwrap();
        for (k, a) in live.iter().enumerate() {
            assert!(holds(&dev, a, k as u64 + 10), "live block {k}");
        }
        let s = pool.stats();
        assert_eq!(s.num_ooms, before.num_ooms);
        assert_eq!(s.calls.unmaps - before.calls.unmaps, 1, "the pinned chunk");
        assert_eq!(
            s.calls.maps - before.calls.maps,
            3,
            "two kept runs, the growth"
        );
        assert!(
            s.device_waits - before.device_waits >= 2,
            "the device, then the chunk's copies"
        );
        assert_eq!(pool.host_buffer_bytes(), 0, "no host memory");
        // Kept: 2 pages of `first`, `across`'s first page and the 4 MiB chunk after it, the
        // small page; and the growth.
        assert_eq!(pool.reserved(), 3 * page + 4 * MIB + page + 10 * MIB);
        fill(&dev, &grown, 3);
        assert!(holds(&dev, &grown, 3));
        for a in [first, across, grown].into_iter().chain(small) {
            pool.free(a).unwrap();
        }
        pool.empty_cache().unwrap();
        pool.check_invariants().unwrap();
        assert_eq!(pool.reserved(), 0);
        drop(pool);
        dev.destroy_stream(s1).unwrap();
    }
    let now = free_bytes();
    assert!(
        now + 64 * MIB >= baseline,
        "free memory {now} below baseline {baseline}"
    );
}

/// Twenty 40 MiB chunks (ten in each of two streams' segments, fewer than the budget's tail
/// rule gives back), each pinned by a 20 MiB live block with 20 MiB of free pages beside it:
/// one re-paging makes them all again (400 MiB of live bytes copied on the device) and gives
/// 400 MiB back, less the growth's window slack. Prints how long the allocation that forced it
/// took.
#[test]
#[ignore = "needs a CUDA GPU"]
fn re_paging_twenty_chunks_keeps_400_mib_of_live_bytes() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let baseline = free_bytes();
    {
        let (dev, mut pool, s1) = gpu_pool();
        let s2 = dev.create_stream().expect("stream");
        let mut live = Vec::new();
        for s in [S0, s2] {
            let whole = pool.allocate(400 * MIB, s).unwrap();
            pool.free(whole).unwrap();
            let blocks: Vec<Allocation> = (0..20)
                .map(|_| pool.allocate(20 * MIB, s).unwrap())
                .collect();
            for (i, a) in blocks.into_iter().enumerate() {
                if i % 2 == 0 {
                    live.push(a);
                } else {
                    pool.free(a).unwrap();
                }
            }
        }
        for (k, a) in live.iter().enumerate() {
            fill(&dev, a, k as u64);
        }
        assert_eq!(pool.reserved(), 800 * MIB, "twenty chunks mapped");
        pool.set_limit(Some(800 * MIB + 4 * MIB));
        let before = pool.stats().clone();
        let t = Instant::now();
        let grown = pool
            .allocate(100 * MIB, s1)
            .expect("the last resort makes room");
        let took = t.elapsed();
        pool.check_invariants().unwrap();
        let s = pool.stats();
        println!(
            "re-paging 20 chunks: {:.1} ms for the allocation, {} device waits, reserved {} MiB",
            took.as_secs_f64() * 1e3,
            s.device_waits - before.device_waits,
            pool.reserved() / MIB
        );
        assert_eq!(
            s.calls.unmaps - before.calls.unmaps,
            20,
            "every pinned chunk"
        );
        for (k, a) in live.iter().enumerate() {
            assert!(holds(&dev, a, k as u64), "live block {k}");
        }
        // The live half of each chunk, and the growth, up to the end of its last 40 MiB
        // window when the budget and the cap leave room (window slack).
        let reserved = pool.reserved();
        assert!(
            (500 * MIB..=540 * MIB).contains(&reserved),
            "reserved {} MiB",
            reserved / MIB
        );
        pool.free(grown).unwrap();
        for a in live {
            pool.free(a).unwrap();
        }
        pool.check_invariants().unwrap();
        drop(pool);
        dev.destroy_stream(s1).unwrap();
        dev.destroy_stream(s2).unwrap();
    }
    let now = free_bytes();
    assert!(
        now + 64 * MIB >= baseline,
        "free memory {now} below baseline {baseline}"
    );
}
