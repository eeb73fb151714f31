//! Free blocks lent across streams (`lend_blocks:True`, `CachingAllocator` under `default`), on the
//! simulated device: a request that would make its stream's pool grow takes a free block of
//! another stream whose work has completed, and the block returns to its stream's cache once
//! the borrowing stream's work before the free has completed. Checked: the lend itself (no
//! growth, the block's own stream named, the statistics); no lend from a stream with work
//! still queued, nor during a capture, nor under PyTorch's rules or without the key, nor
//! while a trace is recorded; the block's way back waits for the borrower; a free on a third
//! stream is refused, naming the stream asked for.

use cudalloc::record::RecordingAllocator;
use cudalloc::stats::StatType;
use cudalloc::{AllocError, CachingAllocator, Config};
use cudalloc_sys::{CaptureMode, SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Three streams in three different shards (a shard is chosen by a hash of the stream).
const A: StreamId = StreamId(1);
const B: StreamId = StreamId(3);
const C: StreamId = StreamId(2);

type Alloc = CachingAllocator<Arc<SimDevice>>;

/// `default` with lending on (off by default).
const LENDS: &str = "policy:default,lend_blocks:True";

fn alloc_with(config: &str) -> (Arc<SimDevice>, Alloc) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(8 * GIB)));
    let cfg = Config::parse(config).unwrap();
    (sim.clone(), CachingAllocator::new(sim, cfg))
}

/// Stream `A` allocates 64 MiB and frees it: a free block of `A` cached; returns its address.
fn cache_on_a(alloc: &Alloc) -> u64 {
    let a = alloc.allocate(64 * MIB, A).unwrap();
    let ptr = a.ptr();
    alloc.free(a).unwrap();
    ptr
}

#[test]
fn a_free_block_of_an_idle_stream_serves_another_streams_growth() {
    let (sim, alloc) = alloc_with(LENDS);
    let ptr = cache_on_a(&alloc);
    let reserved = alloc.stats().reserved_bytes.get(StatType::All).current;
    let maps = sim.mapped_bytes();

    let b = alloc.allocate(64 * MIB, B).unwrap();
    assert_eq!(b.ptr(), ptr, "the block A cached");
    assert_eq!(b.stream(), A, "the allocation names its block's own stream");
    assert_eq!(sim.mapped_bytes(), maps, "no growth");
    let s = alloc.stats();
    assert_eq!(s.reserved_bytes.get(StatType::All).current, reserved);
    assert_eq!(s.lent_blocks, 1);
    assert_eq!(s.lends_refused_busy, 0);
    alloc.check_invariants().unwrap();

    // Freed on the stream it was asked for: back to A's cache (its event done at once here),
    // never into a thread cache, where A's next request would not find it.
    alloc.free_on(ptr, B).unwrap();
    let again = alloc.allocate(64 * MIB, A).unwrap();
    assert_eq!(again.ptr(), ptr, "back in A's cache");
    assert_eq!(sim.mapped_bytes(), maps);
    alloc.free(again).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn nothing_is_lent_from_a_stream_whose_work_is_not_done() {
    let (sim, alloc) = alloc_with(LENDS);
    let ptr = cache_on_a(&alloc);
    sim.set_auto_complete(false);
    let b = alloc.allocate(64 * MIB, B).unwrap();
    assert_ne!(b.ptr(), ptr, "A's work may still use its block");
    assert_eq!(b.stream(), B);
    let s = alloc.stats();
    assert_eq!(s.lent_blocks, 0);
    assert!(s.lends_refused_busy >= 1, "{}", s.lends_refused_busy);
    assert_eq!(s.device_waits, 0, "the check never waits");
    alloc.free(b).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn a_lent_block_returns_only_after_the_borrowers_work() {
    let (sim, alloc) = alloc_with(LENDS);
    let ptr = cache_on_a(&alloc);
    let b = alloc.allocate(64 * MIB, B).unwrap();
    assert_eq!(b.ptr(), ptr);
    // B's work on the block is still queued when it is freed.
    sim.set_auto_complete(false);
    alloc.free(b).unwrap();
    let a = alloc.allocate(64 * MIB, A).unwrap();
    assert_ne!(a.ptr(), ptr, "B's work may still use the block");
    alloc.free(a).unwrap();
    sim.complete_stream(B);
    let back = alloc.allocate(64 * MIB, A).unwrap();
    assert_eq!(back.ptr(), ptr, "back in A's cache once B's work completed");
    alloc.free(back).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn no_lend_under_pytorchs_rules_with_the_key_off_or_during_a_capture() {
    for config in [
        "policy:torch",
        "policy:torch-expandable",
        "policy:default",
        "policy:default,lend_blocks:False",
    ] {
        let (_, alloc) = alloc_with(config);
        let ptr = cache_on_a(&alloc);
        let b = alloc.allocate(64 * MIB, B).unwrap();
        assert_ne!(b.ptr(), ptr, "{config}");
        assert_eq!(alloc.stats().lent_blocks, 0, "{config}");
    }
    let (_, alloc) = alloc_with(LENDS);
    let ptr = cache_on_a(&alloc);
    alloc.begin_capture(CaptureMode::Global);
    let b = alloc.allocate(64 * MIB, B).unwrap();
    assert_ne!(
        b.ptr(),
        ptr,
        "no event is recorded or queried during a capture"
    );
    assert_eq!(alloc.stats().lent_blocks, 0);
    alloc.end_capture(CaptureMode::Global).unwrap();
}

#[test]
fn a_capture_the_driver_reports_on_the_borrower_stops_the_lend() {
    let (sim, alloc) = alloc_with(LENDS);
    let ptr = cache_on_a(&alloc);
    sim.begin_capture(B, CaptureMode::Relaxed).unwrap();
    let b = alloc.allocate(64 * MIB, B).unwrap();
    assert_ne!(b.ptr(), ptr);
    assert_eq!(alloc.stats().lent_blocks, 0);
    sim.end_capture(B).unwrap();
}

#[test]
fn a_free_on_a_third_stream_is_refused_naming_the_stream_asked_for() {
    let (_, alloc) = alloc_with(LENDS);
    let ptr = cache_on_a(&alloc);
    let b = alloc.allocate(64 * MIB, B).unwrap();
    assert_eq!(b.ptr(), ptr);
    match alloc.free_on(ptr, C) {
        Err(AllocError::WrongStream {
            allocated_on,
            freed_on,
            ..
        }) => assert_eq!((allocated_on, freed_on), (B, C)),
        other => panic!("{other:?}"),
    }
    alloc.free_on(ptr, A).unwrap(); // its block's own stream is its stream too
    alloc.check_invariants().unwrap();
}

#[test]
fn nothing_is_lent_while_a_trace_is_recorded() {
    let (_, inner) = alloc_with(LENDS);
    let alloc = RecordingAllocator::new(inner, Vec::new()).unwrap();
    let a = alloc.allocate(64 * MIB, A).unwrap();
    let ptr = a.ptr();
    alloc.free(a).unwrap();
    let b = alloc.allocate(64 * MIB, B).unwrap();
    assert_ne!(b.ptr(), ptr, "the trace records each stream's own frees");
    alloc.free(b).unwrap();
}
