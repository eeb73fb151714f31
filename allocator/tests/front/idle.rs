//! Idle streams give back their cached memory (`CachingAllocator`, the front rule "Idle
//! streams" of `policy::front`), on the simulated device.
//!
//! The pattern of a training fed from a side stream that a later repetition replaces with a new
//! one: the side stream's batches are freed while the main stream may still read them
//! (`record_stream`), and once the side stream stops allocating, its cached memory serves no
//! one. Checked: after two growths of another stream, an idle stream's blocks whose events have
//! completed go back to the device under `default`; a stream that allocated in between keeps
//! its cache; PyTorch's rules (`torch`) keep it too; nothing goes back during a capture.

use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::{CaptureMode, SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const PAGE: u64 = 2 * MIB;
/// Two streams in different shards (a shard is chosen by a hash of the stream).
const MAIN: StreamId = StreamId(1);
const SIDE: StreamId = StreamId(2);

type Alloc = CachingAllocator<Arc<SimDevice>>;

fn alloc_with(policy: Policy) -> (Arc<SimDevice>, Alloc) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(8 * GIB)));
    sim.set_auto_complete(false);
    let cfg = Config::for_policy(policy);
    (sim.clone(), CachingAllocator::new(sim, cfg))
}

/// A 64 MiB batch made on the side stream, used by the main stream, freed: its block waits for
/// the main stream's work; then all work completes.
fn side_batch(sim: &SimDevice, alloc: &Alloc) {
    let x = alloc.allocate(64 * MIB, SIDE).unwrap();
    alloc.record_stream(x.ptr(), MAIN).unwrap();
    alloc.free(x).unwrap();
    sim.complete_all();
}

/// Three growths of the main stream (the first look at the side stream, the look that finds
/// it idle, and the one whose poll unmaps what that look started giving back), all work
/// completed after each.
fn main_grows(sim: &SimDevice, alloc: &Alloc) -> Vec<cudalloc::Allocation> {
    (0..3)
        .map(|_| {
            let a = alloc.allocate(100 * MIB, MAIN).unwrap();
            sim.complete_all();
            a
        })
        .collect()
}

#[test]
fn an_idle_stream_gives_back_its_cache_once_its_events_completed() {
    let (sim, alloc) = alloc_with(Policy::Default);
    side_batch(&sim, &alloc);
    let held = main_grows(&sim, &alloc);
    let live = 300 * MIB;
    let reserved = alloc.reserved_bytes();
    assert!(
        reserved < live + 64 * MIB,
        "{reserved} bytes reserved for {live} live: the side stream kept its batch"
    );
    assert!(sim.mapped_bytes() <= reserved + PAGE);
    // The side stream can still allocate: its pages are mapped again.
    let again = alloc.allocate(64 * MIB, SIDE).unwrap();
    alloc.free(again).unwrap();
    for a in held {
        alloc.free(a).unwrap();
    }
    alloc.check_invariants().unwrap();
}

#[test]
fn a_stream_that_allocated_since_the_last_look_keeps_its_cache() {
    let (sim, alloc) = alloc_with(Policy::Default);
    let mut held = Vec::new();
    for _ in 0..3 {
        side_batch(&sim, &alloc);
        held.push(alloc.allocate(100 * MIB, MAIN).unwrap());
        sim.complete_all();
    }
    assert!(
        alloc.reserved_bytes() >= 300 * MIB + 64 * MIB,
        "the side stream, busy between the main stream's growths, lost its cache"
    );
    drop(held);
    alloc.check_invariants().unwrap();
}

#[test]
fn under_pytorch_rules_an_idle_stream_keeps_its_cache() {
    let (sim, alloc) = alloc_with(Policy::Torch);
    side_batch(&sim, &alloc);
    let _held = main_grows(&sim, &alloc);
    assert!(alloc.reserved_bytes() >= 300 * MIB + 64 * MIB);
}

#[test]
fn nothing_goes_back_during_a_capture() {
    let (sim, alloc) = alloc_with(Policy::Default);
    side_batch(&sim, &alloc);
    alloc.begin_capture(CaptureMode::Global);
    let _held = main_grows(&sim, &alloc);
    alloc.end_capture(CaptureMode::Global).unwrap();
    assert!(
        alloc.reserved_bytes() >= 300 * MIB + 64 * MIB,
        "an idle stream gave back memory during a capture"
    );
}
