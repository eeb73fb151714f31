//! Tests of [`SimDevice`] against the device contract.
//!
//! Invariants checked here (most tests end with `check_invariants()`):
//! - segments from `malloc` are aligned to the granularity, never overlap, and their address
//!   space is reused (coalesced) after `free`; the same calls give the same addresses;
//! - used bytes (segments plus pages) never exceed the capacity; running out is `OutOfMemory`
//!   and changes nothing;
//! - zero sizes, misaligned sizes, unknown handles and double releases are `InvalidArgument`;
//! - mapped ranges lie inside one reservation, a page is mapped at most once, and a reservation
//!   or page cannot be released while something is mapped;
//! - host-backed data reads back, across consecutive pages and after a page is remapped;
//! - pinned host memory: copies move bytes both ways with host backing (none without), only
//!   inside one live host buffer; a released page's bytes are gone; streams made by
//!   `open_stream` close once;
//! - an event completes only when its stream's work has completed;
//! - injected faults hit exactly the planned acquiring calls, never release calls, and a failed
//!   call changes nothing.

use std::sync::Arc;

use cudalloc_sys::sim::{MALLOC_BASE, REGION_SIZE, RESERVE_BASE};
use cudalloc_sys::{Call, Device, DeviceError, PageHandle, SimConfig, SimDevice, StreamId};

const MIB: u64 = 1 << 20;
const G: u64 = 2 * MIB;

fn backed() -> SimDevice {
    SimDevice::new(SimConfig::with_capacity(1 << 30).host_backing(true))
}

fn is_invalid<T: std::fmt::Debug>(r: Result<T, DeviceError>) -> bool {
    matches!(r, Err(DeviceError::InvalidArgument { .. }))
}

fn is_oom<T: std::fmt::Debug>(r: Result<T, DeviceError>) -> bool {
    matches!(r, Err(DeviceError::OutOfMemory { .. }))
}

/// Reserves `pages` granules, maps a fresh page at each and makes the range accessible.
fn mapped_range(dev: &SimDevice, pages: u64) -> (u64, Vec<PageHandle>) {
    let va = dev.reserve(pages * G).unwrap();
    let handles: Vec<_> = (0..pages).map(|_| dev.create_page(G).unwrap()).collect();
    for (i, &p) in handles.iter().enumerate() {
        dev.map(va + i as u64 * G, G, p).unwrap();
    }
    dev.set_access(va, pages * G, &[]).unwrap();
    (va, handles)
}

#[test]
fn default_config_is_an_h200() {
    let cfg = SimConfig::default();
    assert_eq!(cfg.capacity, 143_771 * MIB);
    assert_eq!(cfg.granularity, G);
    assert!(!cfg.host_backing);
    let dev = SimDevice::new(cfg.ordinal(3));
    assert_eq!(dev.ordinal(), 3);
    assert_eq!(dev.granularity().unwrap(), G);
    assert_eq!(dev.mem_info().unwrap(), (143_771 * MIB, 143_771 * MIB));
}

#[test]
fn malloc_is_aligned_first_fit_from_the_base() {
    let dev = SimDevice::with_capacity(1 << 30);
    let a = dev.malloc(1).unwrap();
    let b = dev.malloc(G + 1).unwrap();
    let c = dev.malloc(512).unwrap();
    assert_eq!(a, MALLOC_BASE);
    assert_eq!(b, MALLOC_BASE + G);
    assert_eq!(c, MALLOC_BASE + 3 * G);
    for p in [a, b, c] {
        assert_eq!(p % G, 0);
    }
    assert_eq!(dev.malloc_bytes(), 1 + G + 1 + 512);
    assert_eq!(dev.live_mallocs(), 3);
    dev.check_invariants();
}

#[test]
fn freed_ranges_are_reused_and_coalesced() {
    let dev = SimDevice::with_capacity(1 << 30);
    let a = dev.malloc(G).unwrap();
    let b = dev.malloc(G).unwrap();
    let c = dev.malloc(G).unwrap();
    dev.free(b, G).unwrap();
    assert_eq!(dev.malloc(100).unwrap(), b, "lowest free range first");
    dev.free(b, 100).unwrap();
    dev.free(a, G).unwrap();
    dev.check_invariants();
    assert_eq!(dev.malloc(2 * G).unwrap(), a, "a and b merged");
    assert_eq!(dev.malloc(G).unwrap(), c + G);
    dev.check_invariants();
}

#[test]
fn planned_mallocs_go_where_the_plan_says_while_their_range_is_free() {
    let dev = SimDevice::with_capacity(1 << 30);
    // (size, offset from the malloc base): a recording's segments, in its order.
    dev.plan_mallocs([(G, 8 * G), (3 * MIB, 0), (G, 4 * G)]);
    assert_eq!(dev.malloc(G).unwrap(), MALLOC_BASE + 8 * G);
    // A size the plan does not name next goes first fit and leaves the plan as it was.
    assert_eq!(dev.malloc(MIB).unwrap(), MALLOC_BASE);
    // Named next, but its range is taken: first fit, and that entry is used up.
    assert_eq!(dev.malloc(3 * MIB).unwrap(), MALLOC_BASE + G);
    assert_eq!(dev.malloc(G).unwrap(), MALLOC_BASE + 4 * G);
    // The plan is used up: first fit again.
    assert_eq!(dev.malloc(G).unwrap(), MALLOC_BASE + 3 * G);
    dev.check_invariants();
}

#[test]
fn a_planned_range_that_overlaps_a_segment_or_is_misaligned_is_not_used() {
    let dev = SimDevice::with_capacity(1 << 30);
    let a = dev.malloc(2 * G).unwrap();
    // Starts inside `a`, then one whose offset is not a multiple of the granularity.
    dev.plan_mallocs([(G, G), (G, 6 * G + 512), (G, 6 * G)]);
    assert_eq!(dev.malloc(G).unwrap(), a + 2 * G, "overlaps a: first fit");
    assert_eq!(dev.malloc(G).unwrap(), a + 3 * G, "misaligned: first fit");
    assert_eq!(dev.malloc(G).unwrap(), MALLOC_BASE + 6 * G);
    dev.free(a, 2 * G).unwrap();
    dev.check_invariants();
}

#[test]
fn a_planned_range_that_runs_into_a_segment_or_past_the_malloc_region_is_not_used() {
    let dev = SimDevice::with_capacity(1 << 30);
    let a = dev.malloc(G).unwrap();
    let b = dev.malloc(G).unwrap();
    dev.free(a, G).unwrap();
    let room = RESERVE_BASE - MALLOC_BASE;
    // Free at its start, `b` at its end; then ranges reaching into the reservations' region,
    // past the malloc region and past `u64::MAX`; then one that fits.
    dev.plan_mallocs([
        (2 * G, 0),
        (G, room),
        (G, room - G / 2),
        (G, REGION_SIZE),
        (G, u64::MAX - G + 1),
        (G, room - G),
    ]);
    assert_eq!(dev.malloc(2 * G).unwrap(), b + G, "runs into b: first fit");
    for _ in 0..4 {
        let p = dev.malloc(G).unwrap();
        assert!(
            p < RESERVE_BASE,
            "{p:#x}: first fit, below the reservations"
        );
    }
    assert_eq!(dev.malloc(G).unwrap(), RESERVE_BASE - G);
    assert_eq!(dev.reserve(G).unwrap(), RESERVE_BASE);
    dev.check_invariants();
}

#[test]
fn same_calls_give_same_addresses() {
    let run = || {
        let dev = SimDevice::with_capacity(1 << 30);
        let a = dev.malloc(3 * MIB).unwrap();
        let b = dev.malloc(MIB).unwrap();
        dev.free(a, 3 * MIB).unwrap();
        (b, dev.malloc(MIB).unwrap(), dev.reserve(4 * G).unwrap())
    };
    assert_eq!(run(), run());
}

#[test]
fn capacity_counts_exact_bytes() {
    let dev = SimDevice::with_capacity(10 * MIB);
    let a = dev.malloc(6 * MIB).unwrap();
    assert!(is_oom(dev.malloc(5 * MIB)));
    let b = dev.malloc(3 * MIB).unwrap();
    let before = (dev.outstanding_bytes(), dev.live_mallocs());
    assert!(is_oom(dev.create_page(G)), "pages count against capacity");
    assert_eq!((dev.outstanding_bytes(), dev.live_mallocs()), before);
    assert_eq!(dev.mem_info().unwrap(), (MIB, 10 * MIB));
    dev.free(a, 6 * MIB).unwrap();
    let page = dev.create_page(G).unwrap();
    assert_eq!(dev.page_bytes(), G);
    assert_eq!(dev.outstanding_bytes(), 3 * MIB + G);
    assert_eq!(dev.mem_info().unwrap().0, 10 * MIB - 3 * MIB - G);
    dev.release_page(page).unwrap();
    dev.free(b, 3 * MIB).unwrap();
    assert_eq!(dev.outstanding_bytes(), 0);
    dev.check_invariants();
}

#[test]
fn oom_reports_the_call_and_size() {
    let dev = SimDevice::with_capacity(MIB);
    let err = dev.malloc(2 * MIB).unwrap_err();
    let want = DeviceError::OutOfMemory {
        call: "malloc",
        requested: 2 * MIB,
    };
    assert_eq!(err, want);
    assert!(err.is_out_of_memory());
}

#[test]
fn zero_and_misaligned_sizes_are_invalid() {
    let dev = SimDevice::with_capacity(1 << 30);
    assert!(is_invalid(dev.malloc(0)));
    assert!(is_invalid(dev.reserve(0)));
    assert!(is_invalid(dev.reserve(G + 4096)));
    assert!(is_invalid(dev.create_page(0)));
    assert!(is_invalid(dev.create_page(MIB)));
    assert_eq!(dev.outstanding_bytes(), 0);
    assert_eq!(dev.reserved_va_bytes(), 0);
    dev.check_invariants();
}

#[test]
fn free_must_match_a_live_segment() {
    let dev = SimDevice::with_capacity(1 << 30);
    let a = dev.malloc(4096).unwrap();
    assert!(is_invalid(dev.free(a, 4097)), "wrong size");
    assert!(is_invalid(dev.free(a + 256, 4096)), "interior pointer");
    assert!(is_invalid(dev.free(0x1234, 4096)), "unknown pointer");
    dev.free(a, 4096).unwrap();
    assert!(is_invalid(dev.free(a, 4096)), "double free");
    assert_eq!(dev.live_mallocs(), 0);
    dev.check_invariants();
}

#[test]
fn reserve_map_unmap_release_in_order() {
    let dev = SimDevice::with_capacity(1 << 30);
    let va = dev.reserve(4 * G).unwrap();
    assert_eq!(va, RESERVE_BASE);
    assert_eq!(dev.reserve(G).unwrap(), RESERVE_BASE + 4 * G);
    let p = dev.create_page(2 * G).unwrap();
    dev.map(va + G, 2 * G, p).unwrap();
    dev.set_access(va + G, 2 * G, &[1]).unwrap();
    assert_eq!(dev.mapped_bytes(), 2 * G);
    dev.check_invariants();
    dev.unmap(va + G, 2 * G).unwrap();
    dev.release_page(p).unwrap();
    dev.unreserve(va, 4 * G).unwrap();
    assert_eq!(dev.reserved_va_bytes(), G);
    assert_eq!((dev.live_pages(), dev.mapped_bytes()), (0, 0));
    assert_eq!(dev.reserve(2 * G).unwrap(), RESERVE_BASE, "va reused");
    dev.check_invariants();
}

#[test]
fn map_rejects_every_broken_precondition() {
    let dev = SimDevice::with_capacity(1 << 30);
    let va = dev.reserve(4 * G).unwrap();
    let other = dev.reserve(4 * G).unwrap();
    let p = dev.create_page(G).unwrap();
    let q = dev.create_page(G).unwrap();
    let big = dev.create_page(2 * G).unwrap();
    assert!(is_invalid(dev.map(va + 4096, G, p)), "misaligned va");
    assert!(is_invalid(dev.map(va, 2 * G, p)), "size is not the page's");
    assert!(is_invalid(dev.map(va, G, PageHandle(999))), "unknown page");
    assert!(
        is_invalid(dev.map(0x1000_0000, G, p)),
        "outside reservations"
    );
    assert!(
        is_invalid(dev.map(va + 3 * G, 2 * G, big)),
        "leaves reservation"
    );
    dev.map(va, G, p).unwrap();
    assert!(is_invalid(dev.map(va, G, q)), "range already mapped");
    dev.map(va + 2 * G, 2 * G, big).unwrap();
    assert!(is_invalid(dev.map(va + G, 2 * G, q)), "overlaps a mapping");
    assert!(
        is_invalid(dev.map(va + 3 * G, G, q)),
        "inside a mapping that starts before it"
    );
    // A page may be mapped at several addresses (as with cuMemMap): the same memory twice.
    dev.map(other, G, p).unwrap();
    dev.check_invariants();
    dev.unmap(other, G).unwrap();
    assert_eq!(dev.mapped_bytes(), 3 * G);
    // cuMemSetAccess takes whole mappings: a range ending or starting inside one is refused.
    assert!(
        is_invalid(dev.set_access(va + 2 * G, G, &[])),
        "ends inside a mapping"
    );
    assert!(
        is_invalid(dev.set_access(va + 3 * G, G, &[])),
        "starts inside a mapping"
    );
    dev.set_access(va + 2 * G, 2 * G, &[]).unwrap();
    dev.check_invariants();
}

#[test]
fn releases_need_their_preconditions() {
    let dev = SimDevice::with_capacity(1 << 30);
    let va = dev.reserve(2 * G).unwrap();
    let p = dev.create_page(G).unwrap();
    dev.map(va, G, p).unwrap();
    assert!(is_invalid(dev.unreserve(va, 2 * G)), "reservation in use");
    assert!(
        is_invalid(dev.unreserve(va, G)),
        "not exactly a reservation"
    );
    assert!(is_invalid(dev.unmap(va, 2 * G)), "not one page's range");
    assert!(is_invalid(dev.unmap(va + G, G)), "nothing mapped there");
    dev.unmap(va, G).unwrap();
    assert!(is_invalid(dev.unmap(va, G)), "double unmap");
    dev.release_page(p).unwrap();
    assert!(is_invalid(dev.release_page(p)), "double release");
    dev.unreserve(va, 2 * G).unwrap();
    assert!(is_invalid(dev.unreserve(va, 2 * G)), "double unreserve");
    dev.check_invariants();
}

/// As `cuMemRelease`: a page released while mapped is gone as a handle at once, and its memory
/// stays until its last mapping is unmapped.
#[test]
fn a_page_released_while_mapped_lives_until_its_last_unmap() {
    let dev = SimDevice::with_capacity(1 << 30);
    let (a, b) = (dev.reserve(G).unwrap(), dev.reserve(G).unwrap());
    let p = dev.create_page(G).unwrap();
    dev.map(a, G, p).unwrap();
    dev.map(b, G, p).unwrap();
    let used = || dev.mem_info().map(|(free, total)| total - free).unwrap();
    dev.release_page(p).unwrap();
    assert!(is_invalid(dev.release_page(p)), "the handle is gone");
    assert!(
        is_invalid(dev.map(a, G, p)),
        "a released handle maps nothing"
    );
    dev.check_invariants();
    dev.unmap(a, G).unwrap();
    assert_eq!(used(), G, "still mapped at b");
    dev.check_invariants();
    dev.unmap(b, G).unwrap();
    assert_eq!(used(), 0, "gone with its last mapping");
    dev.check_invariants();
}

#[test]
fn set_access_needs_the_whole_range_mapped() {
    let dev = SimDevice::with_capacity(1 << 30);
    let va = dev.reserve(3 * G).unwrap();
    let p = dev.create_page(G).unwrap();
    let q = dev.create_page(G).unwrap();
    dev.map(va, G, p).unwrap();
    dev.map(va + 2 * G, G, q).unwrap();
    assert!(
        is_invalid(dev.set_access(va, 3 * G, &[])),
        "hole in the middle"
    );
    assert!(is_invalid(dev.set_access(va + G, G, &[])), "nothing mapped");
    assert!(is_invalid(dev.set_access(va, MIB, &[])), "misaligned size");
    dev.set_access(va, G, &[]).unwrap();
    dev.set_access(va + 2 * G, G, &[]).unwrap();
}

#[test]
fn reserve_address_space_runs_out() {
    let dev = SimDevice::with_capacity(G);
    let all = dev.reserve(REGION_SIZE).unwrap();
    assert!(is_oom(dev.reserve(G)));
    dev.unreserve(all, REGION_SIZE).unwrap();
    assert_eq!(dev.reserve(G).unwrap(), RESERVE_BASE);
    dev.check_invariants();
}

#[test]
fn backed_segment_reads_back_what_was_written() {
    let dev = backed();
    let a = dev.malloc(1 << 30).unwrap();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    dev.write(a + 100_000, &data).unwrap();
    let mut back = vec![0; data.len()];
    dev.read(a + 100_000, &mut back).unwrap();
    assert_eq!(back, data);
    let mut fresh = [7u8; 16];
    dev.read(a + (1 << 30) - 16, &mut fresh).unwrap();
    assert_eq!(fresh, [0; 16], "never-written bytes read as zero");
    let err = dev.write(a + (1 << 30) - 1, &[1, 2]).unwrap_err();
    assert!(matches!(err, DeviceError::InvalidArgument { .. }));
}

#[test]
fn backed_data_spans_consecutive_pages() {
    let dev = backed();
    let (va, _) = mapped_range(&dev, 2);
    let data: Vec<u8> = (0..4096u32).map(|i| i as u8 ^ 0x5a).collect();
    dev.write(va + G - 1000, &data).unwrap();
    let mut back = vec![0; data.len()];
    dev.read(va + G - 1000, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn page_data_follows_the_page_when_remapped() {
    let dev = backed();
    let (va, pages) = mapped_range(&dev, 2);
    dev.write(va + G + 10, b"segment, page, block, stream")
        .unwrap();
    dev.unmap(va + G, G).unwrap();
    let mut buf = [0u8; 28];
    assert!(is_invalid(dev.read(va + G + 10, &mut buf)), "unmapped");
    let other = dev.reserve(G).unwrap();
    dev.map(other, G, pages[1]).unwrap();
    assert!(is_invalid(dev.read(other + 10, &mut buf)), "no access yet");
    dev.set_access(other, G, &[]).unwrap();
    dev.read(other + 10, &mut buf).unwrap();
    assert_eq!(&buf, b"segment, page, block, stream");
}

#[test]
fn bad_host_accesses_name_the_address() {
    let dev = backed();
    let err = dev.write(0xdead_0000, &[1]).unwrap_err();
    assert!(err.to_string().contains("0xdead0000"), "{err}");
    let (va, _) = mapped_range(&dev, 1);
    let err = dev.write(va + G - 1, &[1, 2]).unwrap_err();
    assert!(err.to_string().contains(&format!("{:#x}", va + G)), "{err}");
    let plain = SimDevice::with_capacity(1 << 30);
    let a = plain.malloc(4096).unwrap();
    assert!(is_invalid(plain.write(a, &[1])), "no host backing");
    let mut buf = [0u8; 1];
    assert!(is_invalid(plain.read(a, &mut buf)));
}

#[test]
fn events_wait_for_their_stream() {
    let dev = SimDevice::default();
    dev.set_auto_complete(false);
    let s1 = StreamId(0x10);
    let s2 = StreamId(0x20);
    let e1 = dev.create_event().unwrap();
    let e2 = dev.create_event().unwrap();
    let e3 = dev.create_event().unwrap();
    assert!(dev.query_event(e1).unwrap(), "never recorded: complete");
    dev.record_event(e1, s1).unwrap();
    dev.record_event(e2, s1).unwrap();
    dev.record_event(e3, s2).unwrap();
    assert!(!dev.query_event(e1).unwrap());
    dev.synchronize_event(e1).unwrap();
    assert!(dev.query_event(e1).unwrap());
    assert!(!dev.query_event(e2).unwrap(), "later work still pending");
    dev.complete_stream(s1);
    assert!(dev.query_event(e2).unwrap());
    assert!(!dev.query_event(e3).unwrap(), "other stream untouched");
    dev.record_event(e1, s2).unwrap();
    dev.complete_all();
    assert!(dev.query_event(e1).unwrap() && dev.query_event(e3).unwrap());
    dev.check_invariants();
}

#[test]
fn auto_complete_and_unknown_events() {
    let dev = SimDevice::default();
    let e = dev.create_event().unwrap();
    dev.record_event(e, StreamId::DEFAULT).unwrap();
    assert!(dev.query_event(e).unwrap());
    assert_eq!(dev.live_events(), 1);
    dev.destroy_event(e).unwrap();
    assert_eq!(dev.live_events(), 0);
    assert!(is_invalid(dev.query_event(e)));
    assert!(is_invalid(dev.record_event(e, StreamId::DEFAULT)));
    assert!(is_invalid(dev.synchronize_event(e)));
    assert!(is_invalid(dev.destroy_event(e)));
}

#[test]
fn counters_count_every_call() {
    let dev = SimDevice::with_capacity(1 << 30);
    let a = dev.malloc(4096).unwrap();
    let _ = dev.malloc(0);
    dev.free(a, 4096).unwrap();
    let _ = dev.free(a, 4096);
    dev.mem_info().unwrap();
    let _ = dev.granularity();
    assert_eq!(dev.calls(Call::Malloc), 2);
    assert_eq!(dev.calls(Call::Free), 2);
    assert_eq!(dev.calls(Call::MemInfo), 1);
    assert_eq!(dev.total_calls(), 5);
    dev.reset_calls();
    assert_eq!(dev.total_calls(), 0);
}

#[test]
fn fail_call_hits_the_kth_acquiring_call() {
    let dev = SimDevice::with_capacity(1 << 30);
    let a = dev.malloc(4096).unwrap();
    dev.fail_call(3);
    let b = dev.malloc(4096).unwrap(); // 1
    dev.free(a, 4096).unwrap(); // a release: not counted
    let e = dev.create_event().unwrap(); // 2
    dev.destroy_event(e).unwrap();
    let err = dev.malloc(4096).unwrap_err(); // 3
    assert_eq!(
        err,
        DeviceError::OutOfMemory {
            call: "malloc",
            requested: 4096
        }
    );
    assert!(dev.malloc(4096).is_ok(), "one-shot");
    dev.free(b, 4096).unwrap();
}

#[test]
fn fail_every_and_fail_next() {
    let dev = SimDevice::with_capacity(1 << 30);
    dev.fail_every(2);
    let results: Vec<bool> = (0..6).map(|_| dev.create_event().is_ok()).collect();
    assert_eq!(results, [true, false, true, false, true, false]);
    dev.fail_every(0);
    dev.fail_next();
    let err = dev.create_event().unwrap_err();
    let DeviceError::Driver {
        call,
        code,
        message,
    } = err
    else {
        panic!("{err:?}");
    };
    assert_eq!(
        (call, code, message.as_str()),
        ("create_event", 999, "injected fault")
    );
    dev.fail_every(1);
    dev.clear_faults();
    assert!(dev.create_event().is_ok());
}

#[test]
fn releases_never_fail() {
    let dev = SimDevice::with_capacity(1 << 30);
    let va = dev.reserve(G).unwrap();
    let p = dev.create_page(G).unwrap();
    dev.map(va, G, p).unwrap();
    let a = dev.malloc(4096).unwrap();
    let e = dev.create_event().unwrap();
    dev.fail_every(1);
    dev.unmap(va, G).unwrap();
    dev.release_page(p).unwrap();
    dev.unreserve(va, G).unwrap();
    dev.free(a, 4096).unwrap();
    dev.destroy_event(e).unwrap();
    assert!(dev.mem_info().is_err(), "acquiring calls still fail");
    assert_eq!(dev.outstanding_bytes(), 0);
}

#[test]
fn a_release_fault_fails_the_release_it_names() {
    let dev = SimDevice::with_capacity(1 << 30);
    let va = dev.reserve(G).unwrap();
    let p = dev.create_page(G).unwrap();
    dev.map(va, G, p).unwrap();
    dev.fail_release(2);
    dev.unmap(va, G).unwrap();
    let e = dev.create_page(G).unwrap(); // acquiring calls do not count down
    assert!(
        dev.release_page(p).is_err(),
        "the second release call fails"
    );
    dev.release_page(p).unwrap();
    dev.release_page(e).unwrap();
    dev.unreserve(va, G).unwrap();
    assert_eq!(dev.outstanding_bytes(), 0);
}

#[test]
fn a_failed_call_changes_nothing() {
    let dev = SimDevice::with_capacity(1 << 30);
    let va = dev.reserve(G).unwrap();
    let p = dev.create_page(G).unwrap();
    dev.fail_next();
    assert!(dev.map(va, G, p).is_err());
    assert_eq!(dev.mapped_bytes(), 0);
    dev.fail_next();
    assert!(is_oom(dev.malloc(4096)));
    dev.fail_next();
    assert!(is_oom(dev.reserve(G)));
    dev.fail_next();
    assert!(is_oom(dev.create_page(G)));
    assert_eq!((dev.live_mallocs(), dev.live_pages()), (0, 1));
    assert_eq!(dev.reserved_va_bytes(), G);
    dev.map(va, G, p).unwrap();
    assert_eq!(
        dev.malloc(4096).unwrap(),
        MALLOC_BASE,
        "no address consumed"
    );
    dev.check_invariants();
}

#[test]
fn threads_share_one_device() {
    let dev = Arc::new(SimDevice::with_capacity(1 << 30));
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let dev = Arc::clone(&dev);
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let size = 512 + (t * 1000 + i) % 5000;
                    let p = dev.malloc(size).unwrap();
                    dev.free(p, size).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(dev.calls(Call::Malloc), 800);
    assert_eq!(dev.outstanding_bytes(), 0);
    dev.check_invariants();
}

#[test]
fn copies_move_bytes_between_pages_and_pinned_host_memory() {
    let dev = backed();
    let (va, pages) = mapped_range(&dev, 2);
    let data: Vec<u8> = (0..3 * MIB as usize).map(|i| (i * 7) as u8).collect();
    let at = va + G / 2;
    dev.write(at, &data).unwrap();
    let host = dev.alloc_host(4 * MIB).unwrap();
    let s = dev.open_stream().unwrap();
    dev.copy_to_host_async(host + 100, at, 3 * MIB, s).unwrap();
    let mut back = vec![0u8; data.len()];
    dev.read_host(host + 100, &mut back).unwrap();
    assert!(back == data);
    // Release the pages: their bytes go; new pages read zero until the copy comes back.
    for (i, &p) in pages.iter().enumerate() {
        dev.unmap(va + i as u64 * G, G).unwrap();
        dev.release_page(p).unwrap();
        let q = dev.create_page(G).unwrap();
        dev.map(va + i as u64 * G, G, q).unwrap();
        dev.set_access(va + i as u64 * G, G, &[]).unwrap();
    }
    dev.read(at, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0));
    dev.copy_to_device_async(at, host + 100, 3 * MIB, s)
        .unwrap();
    dev.read(at, &mut back).unwrap();
    assert!(back == data);
    assert_eq!(dev.host_bytes(), 4 * MIB);
    // Host ranges outside one live buffer, double frees and unknown streams are refused.
    assert!(is_invalid(dev.copy_to_host_async(
        host + 4 * MIB - 1,
        at,
        2,
        s
    )));
    assert!(is_invalid(dev.free_host(host, MIB)));
    dev.free_host(host, 4 * MIB).unwrap();
    assert!(is_invalid(dev.free_host(host, 4 * MIB)));
    assert!(is_invalid(dev.copy_to_device_async(at, host, 1, s)));
    assert!(is_invalid(dev.alloc_host(0)));
    let ev = dev.create_event().unwrap();
    dev.record_event(ev, s).unwrap();
    dev.wait_event(StreamId(3), ev).unwrap();
    dev.close_stream(s).unwrap();
    assert!(is_invalid(dev.close_stream(s)));
    assert_eq!(dev.host_bytes(), 0);
    dev.check_invariants();
}

#[test]
fn without_host_backing_copies_check_the_host_side_and_move_nothing() {
    let dev = SimDevice::with_capacity(1 << 30);
    let host = dev.alloc_host(MIB).unwrap();
    let seg = dev.malloc(MIB).unwrap();
    dev.copy_to_host_async(host, seg, MIB, StreamId(1)).unwrap();
    dev.copy_to_device_async(seg, host, MIB, StreamId(1))
        .unwrap();
    assert!(is_invalid(dev.copy_to_host_async(
        host,
        seg,
        MIB + 1,
        StreamId(1)
    )));
    dev.fail_next();
    assert!(
        dev.alloc_host(MIB).is_err(),
        "an acquiring call takes faults"
    );
    dev.free_host(host, MIB).unwrap();
    assert_eq!(dev.calls(Call::AllocHost), 2);
}

#[test]
fn device_copies_move_bytes_between_accessible_ranges() {
    let dev = backed();
    let (va, _) = mapped_range(&dev, 2);
    let seg = dev.malloc(4 * MIB).unwrap();
    let data: Vec<u8> = (0..3 * MIB as usize).map(|i| (i * 13) as u8).collect();
    let at = va + G / 2;
    dev.write(at, &data).unwrap();
    let s = dev.open_stream().unwrap();
    // Across two pages into a segment, and back to a page after a fresh one replaced it.
    dev.copy_device_async(seg + 100, at, 3 * MIB, s).unwrap();
    let mut back = vec![0u8; data.len()];
    dev.read(seg + 100, &mut back).unwrap();
    assert!(back == data);
    let other = dev.reserve(4 * MIB).unwrap();
    let page = dev.create_page(4 * MIB).unwrap();
    dev.map(other, 4 * MIB, page).unwrap();
    // Mapped but not accessible yet: refused.
    assert!(is_invalid(dev.copy_device_async(other, seg, MIB, s)));
    dev.set_access(other, 4 * MIB, &[]).unwrap();
    dev.copy_device_async(other + 7, seg + 100, 3 * MIB, s)
        .unwrap();
    dev.read(other + 7, &mut back).unwrap();
    assert!(back == data);
    // Overlapping ranges, ranges past what is mapped and streams of another device: refused.
    assert!(is_invalid(dev.copy_device_async(seg + 1, seg, 2, s)));
    assert!(is_invalid(dev.copy_device_async(
        seg,
        other + 3 * MIB,
        2 * MIB,
        s
    )));
    let unmapped = dev.reserve(G).unwrap();
    assert!(is_invalid(dev.copy_device_async(unmapped, seg, 1, s)));
    dev.add_foreign_stream(StreamId(77));
    assert!(is_invalid(dev.copy_device_async(seg, at, 1, StreamId(77))));
    dev.fail_next();
    assert!(
        dev.copy_device_async(seg, at, 1, s).is_err(),
        "it takes faults"
    );
    assert_eq!(dev.calls(Call::CopyDeviceAsync), 8);
    dev.check_invariants();
}

#[test]
fn without_host_backing_device_copies_check_both_ranges_and_move_nothing() {
    let dev = SimDevice::with_capacity(1 << 30);
    let (va, _) = mapped_range(&dev, 1);
    let seg = dev.malloc(MIB).unwrap();
    dev.copy_device_async(va, seg, MIB, StreamId(1)).unwrap();
    assert!(is_invalid(dev.copy_device_async(
        va + G,
        seg,
        1,
        StreamId(1)
    )));
    assert!(is_invalid(dev.copy_device_async(
        va,
        seg,
        MIB + 1,
        StreamId(1)
    )));
    assert_eq!(dev.calls(Call::CopyDeviceAsync), 3);
}
