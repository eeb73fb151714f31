//! The allocator on a real GPU (`CudaDevice`); every test needs a CUDA GPU and is ignored
//! elsewhere (run them with `--include-ignored` on the GPU machine).
//!
//! Checks, for every policy: sizes 0 B, 4 B, 1 KiB, 1 MiB and 1 GiB are served and data written
//! through every block reads back; a request larger than the card is `OutOfMemory`, not a panic;
//! after the allocator drops, free device memory is back to its baseline. For the expandable
//! policies: a segment that grows across many pages keeps data across page boundaries, pages
//! are unmapped by `empty_cache` and mapped again, and a byte limit on the device (the `Limit`
//! wrapper) turns into `OutOfMemory` with the allocator still usable afterwards.

use cudalloc::{AllocError, CachingAllocator, Config, Policy};
use cudalloc_sys::wrap::Limit;
use cudalloc_sys::{CudaDevice, Device, StreamId};
use std::sync::Mutex;

/// GPU tests compare free memory, so they run one at a time.
pub(crate) static GPU: Mutex<()> = Mutex::new(());

const MIB: u64 = 1 << 20;

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn roundtrip(dev: &CudaDevice, ptr: u64, len: usize, seed: u64) {
    let data = pattern(len, seed);
    dev.copy_to_device(ptr, &data).expect("copy to device");
    let mut back = vec![0u8; len];
    dev.copy_from_device(ptr, &mut back)
        .expect("copy from device");
    assert!(data == back, "data at {ptr:#x} (+{len}) did not read back");
}

fn free_bytes() -> u64 {
    CudaDevice::new(0)
        .expect("device")
        .mem_info()
        .expect("mem_info")
        .0
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conformance_every_policy() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let baseline = free_bytes();
    for policy in Policy::ALL {
        {
            let alloc =
                CachingAllocator::new(CudaDevice::new(0).unwrap(), Config::for_policy(policy));
            let mut live = Vec::new();
            for (i, size) in [0u64, 4, 1024, MIB, 1 << 30].into_iter().enumerate() {
                let a = alloc
                    .allocate(size, StreamId::DEFAULT)
                    .unwrap_or_else(|e| panic!("{policy:?} {size}: {e}"));
                assert_eq!(a.ptr() % 512, 0, "alignment");
                let len = size.max(1) as usize;
                alloc.with_device(|d| roundtrip(d, a.ptr(), len, i as u64 + 1));
                live.push(a);
            }
            let total = alloc.with_device(|d| d.mem_info().unwrap().1);
            let err = alloc
                .allocate(total + (1 << 30), StreamId::DEFAULT)
                .unwrap_err();
            assert!(err.is_out_of_memory(), "{policy:?}: {err}");
            alloc.check_invariants().unwrap();
            for a in live {
                alloc.free(a).unwrap();
            }
            alloc.check_invariants().unwrap();
            println!("{policy:?}: {:?}", alloc.stats().calls);
        }
        let now = free_bytes();
        assert!(
            now + 64 * MIB >= baseline,
            "{policy:?}: free memory {now} below baseline {baseline}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn expandable_growth_across_pages_and_remap() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let baseline = free_bytes();
    for policy in [Policy::TorchExpandable, Policy::Default] {
        {
            let alloc =
                CachingAllocator::new(CudaDevice::new(0).unwrap(), Config::for_policy(policy));
            // Many allocations that straddle page boundaries, in a segment that keeps growing.
            let sizes: Vec<u64> = (0..40).map(|i| 3 * MIB + i * 777 * 1024).collect();
            let live: Vec<_> = sizes
                .iter()
                .map(|&s| alloc.allocate(s, StreamId::DEFAULT).unwrap())
                .collect();
            for (i, a) in live.iter().enumerate() {
                alloc.with_device(|d| roundtrip(d, a.ptr(), a.size() as usize, 100 + i as u64));
            }
            let mapped = alloc.reserved_bytes();
            assert!(mapped >= sizes.iter().sum::<u64>());
            for a in live {
                alloc.free(a).unwrap();
            }
            alloc.empty_cache().unwrap();
            assert_eq!(
                alloc.reserved_bytes(),
                0,
                "{policy:?}: empty_cache unmaps every page"
            );
            let again = alloc.allocate(64 * MIB, StreamId::DEFAULT).unwrap();
            alloc.with_device(|d| roundtrip(d, again.ptr(), again.size() as usize, 7));
            let s = alloc.stats();
            assert!(
                s.calls.maps > 0 && s.calls.unmaps > 0,
                "{policy:?}: {:?}",
                s.calls
            );
            alloc.free(again).unwrap();
            alloc.check_invariants().unwrap();
        }
        let now = free_bytes();
        assert!(
            now + 64 * MIB >= baseline,
            "{policy:?}: free memory {now} below baseline {baseline}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn limited_device_gives_out_of_memory_and_recovers() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    for policy in Policy::ALL {
        let dev = Limit::new(CudaDevice::new(0).unwrap(), 256 * MIB);
        let alloc = CachingAllocator::new(dev, Config::for_policy(policy));
        let mut live = Vec::new();
        let err = loop {
            match alloc.allocate(30 * MIB, StreamId::DEFAULT) {
                Ok(a) => live.push(a),
                Err(e) => break e,
            }
            assert!(live.len() < 100, "{policy:?}: the limit was not enforced");
        };
        assert!(
            matches!(err, AllocError::OutOfMemory { .. }),
            "{policy:?}: {err}"
        );
        assert!(!live.is_empty());
        let a = live.pop().unwrap();
        alloc.free(a).unwrap();
        let b = alloc
            .allocate(30 * MIB, StreamId::DEFAULT)
            .expect("usable after out-of-memory");
        alloc.with_device(|d| roundtrip(d.inner(), b.ptr(), b.size() as usize, 9));
        alloc.free(b).unwrap();
        for a in live {
            alloc.free(a).unwrap();
        }
        alloc.check_invariants().unwrap();
    }
}

/// Two GPUs: one allocator per device; pages come from the allocator's own device; with peer
/// access asked for, device 1 reads what device 0 wrote into device 0's pages.
#[test]
#[ignore = "needs two CUDA GPUs with peer access"]
fn one_allocator_per_device_and_peer_access() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    assert!(
        CudaDevice::device_count().unwrap() >= 2,
        "this test needs two GPUs"
    );
    assert!(
        CudaDevice::can_access_peer(1, 0).unwrap(),
        "device 1 cannot access device 0"
    );
    let free = |i: usize| CudaDevice::new(i).unwrap().mem_info().unwrap().0;
    for policy in [Policy::TorchExpandable, Policy::Default] {
        let a0 = CachingAllocator::new(CudaDevice::new(0).unwrap(), Config::for_policy(policy));
        let a1 = CachingAllocator::new(CudaDevice::new(1).unwrap(), Config::for_policy(policy));
        let peer = CudaDevice::new(1).unwrap();
        a0.with_device(|d| d.enable_peer_access(&peer)).unwrap();
        a0.set_peer_access(&[1]).unwrap();
        let (f0, f1) = (free(0), free(1));
        let x = a1.allocate(1 << 30, StreamId::DEFAULT).unwrap();
        assert!(
            free(1) + (1 << 30) <= f1 + 64 * MIB,
            "{policy:?}: device 1's pages are on device 1"
        );
        assert!(
            free(0) + 64 * MIB >= f0,
            "{policy:?}: device 0 untouched by device 1's allocator"
        );
        let y = a0.allocate(64 * MIB, StreamId::DEFAULT).unwrap();
        let data = pattern(y.size() as usize, 77);
        a0.with_device(|d| d.copy_to_device(y.ptr(), &data))
            .unwrap();
        let mut back = vec![0u8; data.len()];
        peer.copy_from_device(y.ptr(), &mut back).unwrap();
        assert!(back == data, "{policy:?}: device 1 reads device 0's pages");
        a1.free(x).unwrap();
        a0.free(y).unwrap();
        a0.check_invariants().unwrap();
        a1.check_invariants().unwrap();
    }
}

/// `per_process_memory_fraction` on the real device: the fraction of the card that makes about
/// 1.5 GiB (1% of an H200, 1.9% of an H100 80 GB) holds 1 GiB but not 1 GiB more, under every
/// policy, and the allocator stays usable.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_memory_fraction_key_caps_the_allocator_on_the_device() {
    let _g = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let total = CudaDevice::new(0).unwrap().mem_info().unwrap().1;
    assert!(total > 4 << 30, "this test wants a device above 4 GiB");
    let fraction = (1.5 * (1u64 << 30) as f64) / total as f64;
    for policy in Policy::ALL {
        let conf = format!(
            "policy:{},per_process_memory_fraction:{fraction}",
            policy.name()
        );
        let alloc =
            CachingAllocator::new(CudaDevice::new(0).unwrap(), Config::parse(&conf).unwrap());
        let a = alloc.allocate(1 << 30, StreamId(0)).unwrap();
        let e = alloc.allocate(1 << 30, StreamId(0)).unwrap_err();
        assert!(
            matches!(e, AllocError::OutOfMemory { .. }),
            "{policy:?}: {e}"
        );
        alloc.free(a).unwrap();
        let b = alloc.allocate(1 << 30, StreamId(0)).unwrap();
        alloc.free(b).unwrap();
        alloc.empty_cache().unwrap();
    }
}
