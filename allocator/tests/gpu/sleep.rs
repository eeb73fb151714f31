//! Tags, sleep and wake on a real GPU (ignored elsewhere): for each expandable policy, tagged
//! allocations filled on a stream of the test's own (no synchronize before the sleep: the sleep
//! must wait for that stream's work through events) go to sleep; `cuMemGetInfo` then shows at
//! least 99% of the tags' reserved bytes back on the device; untagged memory keeps working; a
//! wake under a memory limit too low fails with out-of-memory and leaves the tags asleep; once
//! the limit is lifted the wake succeeds and every offloaded allocation reads back its bytes at
//! its old address. The sleep and wake times are printed (GB/s of the offloaded bytes; the
//! `sleep_bandwidth` example sets them beside the pinned copy bandwidth).

use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::{CudaDevice, Device};
use std::time::Instant;

use super::device::GPU;

const MIB: u64 = 1 << 20;

/// The bytes of window `w` of allocation `i`.
fn window(i: usize, w: u64) -> Vec<u8> {
    (0..MIB)
        .map(|k| (k * 131 + w * 7 + i as u64 * 29) as u8)
        .collect()
}

/// Where allocation `i` of `size` bytes has its pattern windows: its first and last MiB.
fn windows(size: u64) -> Vec<u64> {
    if size >= 2 * MIB {
        vec![0, size - MIB]
    } else {
        vec![]
    }
}

fn free_bytes(dev: &CudaDevice) -> u64 {
    dev.mem_info().expect("mem_info").0
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sleep_gives_back_the_tags_memory_and_wake_restores_it_at_the_same_addresses() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    for policy in [Policy::TorchExpandable, Policy::Default] {
        let alloc = CachingAllocator::new(CudaDevice::new(0).unwrap(), Config::for_policy(policy));
        let s = alloc.with_device(|d| d.create_stream()).unwrap();
        let sizes = [1 << 30, 300 * MIB + 12_345, 4096, 2 << 30];
        let weights: Vec<_> = sizes
            .iter()
            .map(|&n| alloc.allocate_tagged(n, s, "weights").unwrap())
            .collect();
        let kv = alloc.allocate_tagged(1 << 30, s, "kv").unwrap();
        alloc.with_device(|d| {
            for (i, a) in weights.iter().enumerate() {
                d.memset_async(a.ptr(), i as u8 + 1, a.size(), s).unwrap();
                for w in windows(a.size()) {
                    d.wait_stream(s).unwrap();
                    d.copy_to_device(a.ptr() + w, &window(i, w)).unwrap();
                }
            }
            d.memset_async(kv.ptr(), 0xee, kv.size(), s).unwrap();
        });
        let tagged: u64 = alloc.tag_stats().iter().map(|t| t.reserved_bytes).sum();
        let offloaded: u64 = sizes.iter().sum();
        let before = alloc.with_device(free_bytes);

        let t = Instant::now();
        alloc.sleep(&["weights", "kv"], &["weights"]).unwrap();
        let slept = t.elapsed();
        let after = alloc.with_device(free_bytes);
        assert!(
            after.saturating_sub(before) as f64 >= 0.99 * tagged as f64,
            "{policy:?}: {} of {tagged} tagged bytes came back",
            after.saturating_sub(before)
        );
        alloc.check_invariants().unwrap();

        // Untagged memory keeps working while the tags sleep.
        let other = alloc.allocate(512 * MIB, s).unwrap();
        alloc.with_device(|d| {
            d.copy_to_device(other.ptr(), &window(99, 0)).unwrap();
            let mut back = vec![0u8; MIB as usize];
            d.copy_from_device(other.ptr(), &mut back).unwrap();
            assert!(back == window(99, 0));
        });
        alloc.free(other).unwrap();

        // A wake that cannot get its memory leaves the tags asleep, and a later one succeeds.
        alloc.set_memory_limit(Some(alloc.reserved_bytes() + tagged / 2));
        let err = alloc.wake(&["weights", "kv"], s).unwrap_err();
        assert!(err.is_out_of_memory(), "{policy:?}: {err}");
        assert!(alloc.is_asleep("weights") || alloc.is_asleep("kv"));
        alloc.check_invariants().unwrap();
        alloc.set_memory_limit(None);

        let t = Instant::now();
        alloc.wake(&["weights", "kv"], s).unwrap();
        // The wake does not wait for its copies: `s` does.
        alloc.with_device(|d| d.wait_stream(s)).unwrap();
        let woke = t.elapsed();
        for (i, a) in weights.iter().enumerate() {
            alloc.with_device(|d| {
                let mut back = vec![0u8; MIB as usize];
                for w in windows(a.size()) {
                    d.copy_from_device(a.ptr() + w, &mut back).unwrap();
                    assert!(back == window(i, w), "{policy:?}: window {w} of {i}");
                }
                let n = a.size().min(4096) as usize;
                let mid = if a.size() >= 4 * MIB { a.size() / 2 } else { 0 };
                let mut back = vec![0u8; n];
                d.copy_from_device(a.ptr() + mid, &mut back).unwrap();
                assert!(
                    back.iter().all(|&b| b == i as u8 + 1),
                    "{policy:?}: middle of {i}"
                );
            });
        }
        let gbs = |d: std::time::Duration| offloaded as f64 / d.as_secs_f64() / 1e9;
        eprintln!(
            "{policy:?}: sleep {slept:?} ({:.1} GB/s offloaded), wake {woke:?} ({:.1} GB/s)",
            gbs(slept),
            gbs(woke)
        );
        for a in weights.into_iter().chain([kv]) {
            alloc.free(a).unwrap();
        }
        alloc.empty_cache().unwrap();
        alloc.check_invariants().unwrap();
        alloc.with_device(|d| d.destroy_stream(s)).unwrap();
    }
}
