//! Tags, sleep and wake on the simulated device with host backing (contents are checked byte
//! for byte): a sleep gives the tag's pages back (mapped bytes fall by exactly the tag's
//! reserved bytes) and keeps its addresses; a wake maps them again at the same addresses and
//! restores the offloaded tags' bytes; other tags and untagged allocations keep working
//! meanwhile; a sleeping tag refuses allocations and `record_stream`, and takes frees at once
//! (their blocks go back at the wake); a wake that cannot
//! get memory (a limit, or a fault injected at any of its device calls) leaves the tag asleep
//! and intact, and the next wake succeeds; a sleep that fails changes nothing; sleep waits for
//! events, never for the whole device; a capture and the `torch` policy refuse it.

use cudalloc::{AllocError, Allocation, CachingAllocator, Config, Policy, Pool};
use cudalloc_sys::{Call, CaptureMode, SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const EXPANDABLE: [Policy; 2] = [Policy::TorchExpandable, Policy::Default];

fn device(capacity: u64) -> Arc<SimDevice> {
    Arc::new(SimDevice::new(
        SimConfig::with_capacity(capacity).host_backing(true),
    ))
}

fn front(dev: &Arc<SimDevice>, policy: Policy) -> CachingAllocator<Arc<SimDevice>> {
    CachingAllocator::new(dev.clone(), Config::for_policy(policy))
}

/// Bytes derived from `seed`, `len` of them.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mix = |i: u64| (i.wrapping_mul(0x9E37_79B1) >> 11) ^ seed.wrapping_mul(97);
    (0..len as u64).map(|i| mix(i) as u8).collect()
}

/// Writes `seed`'s pattern over all of `a`.
fn fill(dev: &SimDevice, a: &Allocation, seed: u64) {
    dev.write(a.ptr(), &pattern(a.size() as usize, seed))
        .expect("write");
}

/// True when all of `a` holds `seed`'s pattern.
fn holds(dev: &SimDevice, a: &Allocation, seed: u64) -> bool {
    let mut back = vec![0u8; a.size() as usize];
    dev.read(a.ptr(), &mut back).expect("read");
    back == pattern(a.size() as usize, seed)
}

fn check(alloc: &CachingAllocator<Arc<SimDevice>>, dev: &SimDevice) {
    alloc.check_invariants().expect("allocator invariants");
    dev.check_invariants();
    assert_eq!(dev.outstanding_bytes(), alloc.reserved_bytes());
}

fn reserved_of(alloc: &CachingAllocator<Arc<SimDevice>>, tag: &str) -> u64 {
    let stats = alloc.tag_stats();
    stats
        .iter()
        .find(|t| t.tag == tag)
        .expect("tag")
        .reserved_bytes
}

#[test]
fn sleep_gives_the_pages_back_and_wake_restores_offloaded_bytes_at_the_same_addresses() {
    for policy in EXPANDABLE {
        let dev = device(1 << 30);
        let alloc = front(&dev, policy);
        let s = StreamId(7);
        let sizes = [300, MIB, 5 * MIB + 12_345, 40 * MIB];
        let weights: Vec<Allocation> = sizes
            .iter()
            .map(|&n| alloc.allocate_tagged(n, s, "weights").unwrap())
            .collect();
        let kv = alloc.allocate_tagged(3 * MIB, s, "kv").unwrap();
        let kv_gone = alloc.allocate_tagged(MIB, s, "kv").unwrap();
        let plain = alloc.allocate(2 * MIB, s).unwrap();
        for (i, a) in weights.iter().enumerate() {
            fill(&dev, a, i as u64);
        }
        fill(&dev, &kv, 100);
        fill(&dev, &plain, 200);
        let tagged = reserved_of(&alloc, "weights") + reserved_of(&alloc, "kv");
        let (mapped, total) = (dev.mapped_bytes(), alloc.reserved_bytes());
        check(&alloc, &dev);

        alloc.sleep(&["weights", "kv"], &["weights"]).unwrap();
        assert_eq!(dev.mapped_bytes(), mapped - tagged, "{policy:?}");
        assert_eq!(alloc.reserved_bytes(), total - tagged);
        let sizes_sum: u64 = sizes.iter().sum();
        assert_eq!(
            dev.host_bytes(),
            sizes_sum,
            "one host copy of the requested bytes"
        );
        assert!(alloc.is_asleep("weights") && alloc.is_asleep("kv"));
        let stats = alloc.tag_stats();
        assert!(stats.iter().all(|t| t.asleep && t.reserved_bytes == 0));
        assert_eq!(stats[0].offloaded_bytes, sizes_sum);
        check(&alloc, &dev);

        // Other memory keeps working; the sleeping tags refuse.
        assert!(holds(&dev, &plain, 200));
        let other = alloc.allocate_tagged(MIB, s, "other").unwrap();
        let more = alloc.allocate(7 * MIB, s).unwrap();
        let refused = alloc.allocate_tagged(MIB, s, "weights");
        assert!(matches!(
            refused,
            Err(AllocError::Asleep {
                what: "allocate",
                ..
            })
        ));
        // A free while the tag sleeps is taken at once (a deleter cannot wait for the wake);
        // its block goes back when the tag wakes.
        let gone = kv_gone.ptr();
        alloc.free(kv_gone).unwrap();
        assert!(matches!(
            alloc.free_ptr(gone),
            Err(AllocError::NotAllocated(_))
        ));
        let refused = alloc.record_stream(kv.ptr(), StreamId(9));
        assert!(matches!(refused, Err(AllocError::Asleep { .. })));
        alloc.empty_cache().unwrap();
        check(&alloc, &dev);

        alloc.wake(&["weights", "kv"], s).unwrap();
        assert!(!alloc.is_asleep("weights") && !alloc.is_asleep("kv"));
        let kv_stats = alloc
            .tag_stats()
            .into_iter()
            .find(|t| t.tag == "kv")
            .unwrap();
        assert_eq!(
            kv_stats.allocations, 1,
            "the free made asleep ran at the wake"
        );
        assert_eq!(
            dev.host_bytes(),
            sizes_sum,
            "the host buffer is kept for the next sleep"
        );
        assert_eq!(alloc.tag_stats()[0].host_buffer_bytes, sizes_sum);
        for (i, a) in weights.iter().enumerate() {
            assert!(
                holds(&dev, a, i as u64),
                "{policy:?}: weights {i} lost bytes"
            );
        }
        fill(&dev, &kv, 101); // not offloaded: its memory is back, its bytes are not
        check(&alloc, &dev);

        for a in weights.into_iter().chain([kv, plain, other, more]) {
            alloc.free(a).unwrap();
        }
        alloc.empty_cache().unwrap();
        alloc.release_host_buffers().unwrap();
        assert_eq!(dev.host_bytes(), 0, "host buffers freed");
        check(&alloc, &dev);
        drop(alloc);
        assert_eq!((dev.outstanding_bytes(), dev.reserved_va_bytes()), (0, 0));
    }
}

#[test]
fn a_wake_over_the_limit_leaves_the_tag_asleep_and_intact_and_a_later_wake_succeeds() {
    for policy in EXPANDABLE {
        let dev = device(1 << 30);
        let alloc = front(&dev, policy);
        alloc.set_memory_limit(Some(96 * MIB));
        let s = StreamId::DEFAULT;
        let w: Vec<Allocation> = (0..4)
            .map(|_| alloc.allocate_tagged(10 * MIB, s, "weights").unwrap())
            .collect();
        w.iter()
            .enumerate()
            .for_each(|(i, a)| fill(&dev, a, i as u64));
        alloc.sleep(&["weights"], &["weights"]).unwrap();
        let hog = alloc.allocate(70 * MIB, s).unwrap();
        let host = dev.host_bytes();
        let err = alloc.wake(&["weights"], s).unwrap_err();
        assert!(err.is_out_of_memory(), "{policy:?}: {err}");
        assert!(alloc.is_asleep("weights"));
        assert_eq!(dev.host_bytes(), host, "host copies kept");
        check(&alloc, &dev);
        alloc.free(hog).unwrap();
        alloc.wake(&["weights"], s).unwrap();
        for (i, a) in w.iter().enumerate() {
            assert!(
                holds(&dev, a, i as u64),
                "{policy:?}: weights {i} lost bytes"
            );
        }
        check(&alloc, &dev);
    }
}

/// Fails the `k`-th device call of a wake (then of a sleep), for every `k` until the call
/// succeeds without a fault: a failed wake leaves the tag asleep and intact, a failed sleep
/// leaves it awake and intact, and the next try succeeds with every byte in place.
#[test]
fn a_fault_at_any_call_of_sleep_or_wake_loses_nothing() {
    for policy in EXPANDABLE {
        for sleep_fails in [false, true] {
            for k in 1.. {
                let dev = device(1 << 30);
                let alloc = front(&dev, policy);
                let s = StreamId(3);
                let w: Vec<Allocation> = [MIB, 3 * MIB, 25 * MIB, 512]
                    .iter()
                    .map(|&n| alloc.allocate_tagged(n, s, "w").unwrap())
                    .collect();
                w.iter()
                    .enumerate()
                    .for_each(|(i, a)| fill(&dev, a, i as u64));
                if !sleep_fails {
                    alloc.sleep(&["w"], &["w"]).unwrap();
                }
                dev.fail_call(k);
                let result = if sleep_fails {
                    alloc.sleep(&["w"], &["w"])
                } else {
                    alloc.wake(&["w"], s)
                };
                dev.clear_faults();
                check(&alloc, &dev);
                let failed = result.is_err();
                // A wait that fails once pages were unmapped leaves the tag asleep with the
                // rest mapped, and says so.
                let incomplete = matches!(result, Err(AllocError::SleepIncomplete { .. }));
                if failed {
                    let asleep = !sleep_fails || incomplete;
                    assert_eq!(alloc.is_asleep("w"), asleep, "{policy:?} k={k}: {result:?}");
                    if sleep_fails && !incomplete {
                        let t = alloc.tag_stats()[0].clone();
                        assert_eq!(t.offloaded_bytes, 0, "a failed sleep keeps no copy");
                        assert_eq!(dev.host_bytes(), t.host_buffer_bytes);
                    }
                    if sleep_fails {
                        alloc.sleep(&["w"], &["w"]).unwrap();
                    }
                    alloc.wake(&["w"], s).unwrap();
                } else if sleep_fails {
                    alloc.wake(&["w"], s).unwrap();
                }
                for (i, a) in w.iter().enumerate() {
                    assert!(holds(&dev, a, i as u64), "{policy:?} k={k}: {i} lost bytes");
                }
                check(&alloc, &dev);
                if !failed {
                    break;
                }
            }
        }
    }
}

#[test]
fn sleep_waits_for_the_streams_that_used_the_memory_not_for_the_device() {
    let dev = device(1 << 30);
    dev.set_auto_complete(false);
    let alloc = front(&dev, Policy::TorchExpandable);
    let a = alloc.allocate_tagged(4 * MIB, StreamId(5), "t").unwrap();
    alloc.record_stream(a.ptr(), StreamId(6)).unwrap();
    fill(&dev, &a, 9);
    dev.reset_calls();
    alloc.sleep(&["t"], &["t"]).unwrap();
    assert_eq!(dev.calls(Call::SynchronizeDevice), 0);
    assert!(
        dev.calls(Call::WaitEvent) >= 2,
        "the copy stream waits for streams 5 and 6"
    );
    assert!(dev.calls(Call::SynchronizeEvent) >= 1);
    alloc.wake(&["t"], StreamId(5)).unwrap();
    assert_eq!(dev.calls(Call::SynchronizeDevice), 0);
    assert!(holds(&dev, &a, 9));
    dev.complete_all();
    check(&alloc, &dev);
}

#[test]
fn sleep_and_wake_are_refused_during_a_capture() {
    let dev = device(1 << 30);
    let alloc = front(&dev, Policy::Default);
    let a = alloc.allocate_tagged(MIB, StreamId(1), "t").unwrap();
    alloc.begin_capture(CaptureMode::Global);
    let err = alloc.sleep(&["t"], &[]).unwrap_err();
    assert!(
        matches!(err, AllocError::DuringCapture { what: "sleep", .. }),
        "{err}"
    );
    alloc.end_capture(CaptureMode::Global).unwrap();
    alloc.sleep(&["t"], &[]).unwrap();
    alloc.begin_capture(CaptureMode::Relaxed);
    let err = alloc.wake(&["t"], StreamId(1)).unwrap_err();
    assert!(
        matches!(err, AllocError::DuringCapture { what: "wake", .. }),
        "{err}"
    );
    alloc.end_capture(CaptureMode::Relaxed).unwrap();
    alloc.wake(&["t"], StreamId(1)).unwrap();
    alloc.free(a).unwrap();
    check(&alloc, &dev);
}

#[test]
fn the_torch_policy_refuses_sleep_and_names_the_policies_to_use() {
    let dev = device(1 << 30);
    let alloc = front(&dev, Policy::Torch);
    let a = alloc.allocate_tagged(MIB, StreamId(1), "t").unwrap();
    let err = alloc.sleep(&["t"], &["t"]).unwrap_err();
    assert!(matches!(err, AllocError::SleepUnsupported));
    let text = err.to_string();
    assert!(
        text.contains("torch-expandable") && text.contains("default"),
        "{text}"
    );
    let mut pool = Pool::new(dev.clone(), Config::for_policy(Policy::Torch));
    let b = pool.allocate(MIB, StreamId(1)).unwrap();
    assert!(matches!(
        pool.sleep(true),
        Err(AllocError::SleepUnsupported)
    ));
    pool.free(b).unwrap();
    alloc.free(a).unwrap();
}

#[test]
fn a_lone_pool_sleeps_and_wakes_whole() {
    let dev = device(1 << 30);
    let mut pool = Pool::new(dev.clone(), Config::for_policy(Policy::Default));
    let a = pool.allocate(6 * MIB, StreamId(2)).unwrap();
    fill(&dev, &a, 4);
    let reserved = pool.reserved();
    pool.sleep(true).unwrap();
    assert!(pool.asleep());
    assert_eq!((pool.reserved(), pool.slept_bytes()), (0, reserved));
    assert_eq!(dev.outstanding_bytes(), 0);
    pool.check_invariants().unwrap();
    assert!(matches!(
        pool.allocate(MIB, StreamId(2)),
        Err(AllocError::Asleep { tag: None, .. })
    ));
    pool.wake(StreamId(2)).unwrap();
    assert!(holds(&dev, &a, 4));
    pool.check_invariants().unwrap();
    pool.free(a).unwrap();
}

#[test]
fn tagged_memory_never_shares_a_page_with_other_memory() {
    let dev = device(1 << 30);
    let alloc = front(&dev, Policy::Default);
    let s = StreamId(1);
    let small: Vec<Allocation> = (0..6)
        .flat_map(|i| {
            let a = alloc.allocate_tagged(1000 + i, s, "x").unwrap();
            let b = alloc.allocate(1000 + i, s).unwrap();
            let c = alloc.allocate_tagged(1000 + i, s, "y").unwrap();
            [a, b, c]
        })
        .collect();
    let page = |p: u64| p >> 21;
    let snap = alloc.snapshot();
    let mut owner = std::collections::HashMap::new();
    for (i, a) in small.iter().enumerate() {
        let prev = owner.insert(page(a.ptr()), i % 3);
        assert!(
            prev.is_none_or(|o| o == i % 3),
            "page {:#x} shared",
            a.ptr()
        );
    }
    assert!(snap.segments.len() >= 3);
    for a in small {
        alloc.free(a).unwrap();
    }
    check(&alloc, &dev);
}

/// A tag dropped asleep gives everything back.
#[test]
fn dropping_an_allocator_with_a_sleeping_tag_leaves_nothing_behind() {
    let dev = device(1 << 30);
    let alloc = front(&dev, Policy::TorchExpandable);
    let _a = alloc.allocate_tagged(3 * MIB, StreamId(1), "t").unwrap();
    alloc.sleep(&["t"], &["t"]).unwrap();
    drop(alloc);
    assert_eq!(dev.outstanding_bytes(), 0);
    assert_eq!((dev.host_bytes(), dev.reserved_va_bytes()), (0, 0));
}

/// A tag's allocation may use memory the untagged pools cache (the out-of-memory ladder
/// releases it), and the allocator's statistics count tagged allocations.
#[test]
fn a_tag_gets_the_memory_untagged_pools_cached_and_counts_in_the_statistics() {
    for policy in EXPANDABLE {
        let dev = device(64 * MIB);
        let alloc = front(&dev, policy);
        let s = StreamId(1);
        let a = alloc.allocate(40 * MIB, s).unwrap();
        alloc.free(a).unwrap();
        let t = alloc.allocate_tagged(40 * MIB, s, "t").unwrap();
        let stats = alloc.stats();
        assert_eq!(stats.allocation.0[0].current, 1);
        assert!(stats.allocated_bytes.0[0].current as u64 >= 40 * MIB);
        let tag = &alloc.tag_stats()[0];
        assert_eq!((tag.allocations, tag.requested_bytes), (1, 40 * MIB));
        check(&alloc, &dev);
        alloc.free(t).unwrap();
        check(&alloc, &dev);
    }
}

/// Threads allocate and free untagged memory and another tag while one tag sleeps and wakes
/// over and over: nothing is lost, and the invariants hold at the end.
#[test]
fn other_threads_keep_working_while_a_tag_sleeps_and_wakes() {
    for policy in EXPANDABLE {
        let dev = device(1 << 30);
        let alloc = Arc::new(front(&dev, policy));
        let w: Vec<Allocation> = (0..3)
            .map(|i| {
                alloc
                    .allocate_tagged((i + 1) * 3 * MIB + 100, StreamId(1), "w")
                    .unwrap()
            })
            .collect();
        w.iter()
            .enumerate()
            .for_each(|(i, a)| fill(&dev, a, i as u64));
        std::thread::scope(|scope| {
            for t in 0..3u64 {
                let (alloc, dev) = (alloc.clone(), dev.clone());
                scope.spawn(move || {
                    for k in 0..200u64 {
                        let size = 4096 + (k * 7919 + t * 104_729) % (3 * MIB);
                        let a = if t == 0 {
                            alloc.allocate_tagged(size, StreamId(2), "kv").unwrap()
                        } else {
                            alloc.allocate(size, StreamId(2 + t)).unwrap()
                        };
                        fill(&dev, &a, k + 1000 * t);
                        assert!(holds(&dev, &a, k + 1000 * t));
                        alloc.free(a).unwrap();
                    }
                });
            }
            for _ in 0..20 {
                alloc.sleep(&["w"], &["w"]).unwrap();
                alloc.wake(&["w"], StreamId(1)).unwrap();
            }
        });
        for (i, a) in w.iter().enumerate() {
            assert!(holds(&dev, a, i as u64), "{policy:?}: {i} lost bytes");
        }
        check(&alloc, &dev);
    }
}

/// A snapshot names the tag of each tagged segment, and no tag for the rest.
#[test]
fn snapshots_name_the_tag_of_each_segment() {
    let dev = device(1 << 30);
    let alloc = front(&dev, Policy::Default);
    let s = StreamId(3);
    let w = alloc.allocate_tagged(5 * MIB, s, "weights").unwrap();
    let k = alloc.allocate_tagged(3 * MIB, s, "kv").unwrap();
    let p = alloc.allocate(2 * MIB, s).unwrap();
    let snap = alloc.snapshot();
    let tag_of = |ptr: u64| {
        snap.segments
            .iter()
            .find(|g| g.addr <= ptr && ptr < g.addr + g.size)
            .map(|g| g.tag.clone())
            .expect("a segment holds it")
    };
    assert_eq!(tag_of(w.ptr()).as_deref(), Some("weights"));
    assert_eq!(tag_of(k.ptr()).as_deref(), Some("kv"));
    assert_eq!(tag_of(p.ptr()), None);
    for a in [w, k, p] {
        alloc.free(a).unwrap();
    }
}
