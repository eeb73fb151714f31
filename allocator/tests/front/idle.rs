//! Idle streams give back their cached memory (`CachingAllocator`, the front rule "Idle
//! streams" of `policy::front`), on the simulated device.
//!
//! The pattern of a training fed from a side stream that a later repetition replaces with a new
//! one: the side stream's batches are freed while the main stream may still read them
//! (`record_stream`), and once the side stream stops allocating, its cached memory serves no
//! one. Checked: once other streams grew by more than an idle stream holds, its blocks whose
//! events have completed go back to the device under `default`, without a device wait; a
//! stream whose pool allocated since keeps its cache; PyTorch's rules (`torch`) keep it; nothing
//! goes back during a capture, nor with the policy's give-back switch off; a failed release
//! during a give-back loses nothing; streams taking turns with changing shapes, on one thread or
//! four, make at most 1.5x the driver calls of the same steps on an allocator each, and over
//! the second half of the steps at most 10% more than those; over the shared ceiling a finished
//! side stream's cache goes back while the next one grows.

use cudalloc::config::{DefaultConfig, PolicyConfig};
use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::{Call, CaptureMode, SimConfig, SimDevice, StreamId};
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

/// A 64 MiB batch made on `side`, used by the main stream, freed: its block waits for the main
/// stream's work; then all work completes.
fn side_batch(sim: &SimDevice, alloc: &Alloc, side: StreamId) {
    let x = alloc.allocate(64 * MIB, side).unwrap();
    alloc.record_stream(x.ptr(), MAIN).unwrap();
    alloc.free(x).unwrap();
    sim.complete_all();
}

/// Three growths of the main stream by 100 MiB (the look that finds the side stream idle and
/// starts its pages back, then looks whose polls unmap them), all work completed after each.
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
    side_batch(&sim, &alloc, SIDE);
    let held = main_grows(&sim, &alloc);
    let live = 300 * MIB;
    let reserved = alloc.reserved_bytes();
    assert!(
        reserved < live + 64 * MIB,
        "{reserved} bytes reserved for {live} live: the side stream kept its batch"
    );
    assert!(sim.mapped_bytes() <= reserved + PAGE);
    assert_eq!(alloc.stats().device_waits, 0, "the give-back waited");
    // The side stream can still allocate: its pages are mapped again.
    let again = alloc.allocate(64 * MIB, SIDE).unwrap();
    alloc.free(again).unwrap();
    for a in held {
        alloc.free(a).unwrap();
    }
    alloc.check_invariants().unwrap();
}

/// Ten repetitions, each with a new side stream feeding the main stream: the finished side
/// streams' batches do not pile up.
#[test]
fn side_streams_of_earlier_repetitions_do_not_pile_up() {
    let (sim, alloc) = alloc_with(Policy::Default);
    let mut peak = 0;
    for rep in 0..10u64 {
        let side = StreamId(100 + rep);
        let mut held = Vec::new();
        for _ in 0..4 {
            side_batch(&sim, &alloc, side);
            held.push(alloc.allocate(32 * MIB, MAIN).unwrap());
        }
        sim.complete_all();
        peak = peak.max(alloc.reserved_bytes());
        for a in held {
            alloc.free(a).unwrap();
        }
    }
    // One repetition holds 64 MiB of batch and 128 MiB on the main stream; keeping every
    // finished side stream's batch would hold 10 x 64 MiB more.
    assert!(
        peak <= 512 * MIB,
        "peak reserved {peak} bytes: the finished side streams kept their batches"
    );
    alloc.check_invariants().unwrap();
}

/// A repetition whose host runs ahead of the main stream: `side` makes 16 batches of 64 MiB that
/// the main stream reads, none freed before the end (the work of other streams, a give-back's
/// included, completes after each); the peak reserved bytes during it.
fn ahead_repetition(sim: &SimDevice, alloc: &Alloc, side: StreamId) -> u64 {
    let mut peak = 0;
    let held: Vec<_> = (0..16)
        .map(|_| {
            let x = alloc.allocate(64 * MIB, side).unwrap();
            peak = peak.max(alloc.reserved_bytes());
            sim.complete_all();
            x
        })
        .collect();
    for x in held {
        alloc.record_stream(x.ptr(), MAIN).unwrap();
        alloc.free(x).unwrap();
    }
    sim.complete_all();
    peak
}

/// Over the shared ceiling a finished side stream's cache goes back while the next one grows:
/// not once the next one has grown by all it holds, when both repetitions' batches would be
/// reserved at the second one's peak.
#[test]
fn a_finished_side_stream_goes_back_while_the_next_one_grows() {
    let (sim, alloc) = alloc_with(Policy::Default);
    let first = ahead_repetition(&sim, &alloc, SIDE);
    let second = ahead_repetition(&sim, &alloc, StreamId(3));
    let one = 16 * 64 * MIB;
    assert!(
        first <= one + 64 * MIB,
        "first repetition: {first} bytes reserved"
    );
    // The first stream's 1 GiB goes back after eight growths of the second (512 MiB).
    assert!(
        second <= one + 640 * MIB,
        "second repetition: {second} bytes reserved for {one} live: the first stream kept its cache"
    );
    assert_eq!(alloc.stats().device_waits, 0, "the give-back waited");
    alloc.check_invariants().unwrap();
}

#[test]
fn a_stream_that_allocated_since_keeps_its_cache() {
    let (sim, alloc) = alloc_with(Policy::Default);
    let mut held = Vec::new();
    for round in 0..3 {
        // The main stream grows by 40 MiB between the side stream's 64 MiB batches: less than
        // the side stream holds each time, so the side stream's batch is never given back and
        // its later batches map nothing.
        held.push(alloc.allocate(40 * MIB, MAIN).unwrap());
        sim.complete_all();
        let maps = sim.calls(Call::Map);
        side_batch(&sim, &alloc, SIDE);
        if round > 0 {
            assert_eq!(
                sim.calls(Call::Map),
                maps,
                "round {round}: the side stream, busy between the main stream's growths, lost its cache"
            );
        }
    }
    drop(held);
    alloc.check_invariants().unwrap();
}

#[test]
fn under_pytorch_rules_an_idle_stream_keeps_its_cache() {
    let (sim, alloc) = alloc_with(Policy::Torch);
    side_batch(&sim, &alloc, SIDE);
    let _held = main_grows(&sim, &alloc);
    assert!(alloc.reserved_bytes() >= 300 * MIB + 64 * MIB);
}

/// During a capture the look queries no event and unmaps nothing (either could invalidate
/// the capture on a real device).
#[test]
fn nothing_goes_back_during_a_capture() {
    let (sim, alloc) = alloc_with(Policy::Default);
    let x = alloc.allocate(64 * MIB, SIDE).unwrap();
    alloc.record_stream(x.ptr(), MAIN).unwrap();
    alloc.free(x).unwrap();
    sim.complete_all();
    let (queries, unmaps) = (sim.calls(Call::QueryEvent), sim.calls(Call::Unmap));
    alloc.begin_capture(CaptureMode::Global);
    let _held = main_grows(&sim, &alloc);
    assert_eq!(
        sim.calls(Call::QueryEvent),
        queries,
        "an event was queried during the capture"
    );
    assert_eq!(
        sim.calls(Call::Unmap),
        unmaps,
        "a page was unmapped during the capture"
    );
    alloc.end_capture(CaptureMode::Global).unwrap();
    assert!(
        alloc.reserved_bytes() >= 300 * MIB + 64 * MIB,
        "an idle stream gave back memory during a capture"
    );
}

/// With the policy's give-back switch off (`rules.give_back`), reserved memory only grows: idle
/// streams keep their caches too.
#[test]
fn with_give_back_off_an_idle_stream_keeps_its_cache() {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(8 * GIB)));
    sim.set_auto_complete(false);
    let mut d = DefaultConfig::default();
    d.rules.give_back = false;
    let cfg = Config::default()
        .with_policy(PolicyConfig::Default(d))
        .unwrap();
    let alloc = CachingAllocator::new(sim.clone(), cfg);
    side_batch(&sim, &alloc, SIDE);
    let _held = main_grows(&sim, &alloc);
    assert!(alloc.reserved_bytes() >= 300 * MIB + 64 * MIB);
}

/// One step of stream `s`: allocate blocks of the step's sizes, free them all.
fn step(alloc: &Alloc, s: StreamId, sizes: &[u64]) {
    let held: Vec<_> = sizes
        .iter()
        .map(|&n| alloc.allocate(n, s).unwrap())
        .collect();
    for a in held {
        alloc.free(a).unwrap();
    }
}

/// The sizes of step `k` of stream `s`: a few blocks of 1 to 200 MiB that change from step to
/// step (a xorshift of the step and the stream).
fn sizes(k: u64, s: u64) -> Vec<u64> {
    let mut x = (k * 0x9E37_79B9 + s * 0x85EB_CA6B) | 1;
    (0..4)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (1 + x % 200) * MIB
        })
        .collect()
}

/// Driver calls of `streams` streams taking `steps` turns with changing shapes, each stream's
/// steps on its own allocator (`alone`) or all on one: over all steps, and over the second half.
fn turns_calls(streams: u64, steps: u64, alone: bool) -> (u64, u64) {
    let new = || {
        let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(16 * GIB)));
        CachingAllocator::new(sim, Config::for_policy(Policy::Default))
    };
    let shared = new();
    let own: Vec<_> = (0..streams).map(|_| new()).collect();
    let calls = || -> u64 {
        if alone {
            own.iter().map(|a| a.stats().calls.total()).sum()
        } else {
            shared.stats().calls.total()
        }
    };
    let mut half = 0;
    for k in 0..steps {
        if k == steps / 2 {
            half = calls();
        }
        for s in 0..streams {
            let a = if alone { &own[s as usize] } else { &shared };
            step(a, StreamId(s + 1), &sizes(k, s));
        }
    }
    (calls(), calls() - half)
}

/// Streams taking turns may each be taken for idle while they all grow (a strike), not after:
/// over the second half, at most 10% more calls than on an allocator each.
#[test]
fn streams_taking_turns_with_changing_shapes_do_not_give_each_other_back() {
    for streams in [2, 4] {
        let (together, late) = turns_calls(streams, 400, false);
        let (alone, late_alone) = turns_calls(streams, 400, true);
        assert!(
            late <= late_alone + late_alone / 10 + 2,
            "{streams} streams taking turns, second half: {late} driver calls, {late_alone} on an allocator each"
        );
        assert!(
            together <= alone + alone / 2,
            "{streams} streams taking turns: {together} driver calls, {alone} on an allocator each"
        );
    }
}

#[test]
fn four_threads_one_stream_each_do_not_give_each_other_back() {
    let run = |shared: bool| -> u64 {
        let new = || {
            let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(16 * GIB)));
            Arc::new(CachingAllocator::new(
                sim,
                Config::for_policy(Policy::Default),
            ))
        };
        let one = new();
        let allocs: Vec<_> = (0..4)
            .map(|_| if shared { one.clone() } else { new() })
            .collect();
        std::thread::scope(|sc| {
            for (t, a) in allocs.iter().enumerate() {
                sc.spawn(move || {
                    for k in 0..400 {
                        step(a, StreamId(t as u64 + 1), &sizes(k, t as u64));
                    }
                });
            }
        });
        if shared {
            one.stats().calls.total()
        } else {
            allocs.iter().map(|a| a.stats().calls.total()).sum()
        }
    };
    let (together, alone) = (run(true), run(false));
    assert!(
        together <= alone + alone / 2,
        "four threads: {together} driver calls, {alone} on an allocator each"
    );
}

/// A release call that fails while an idle stream's pages go back loses nothing: every growth
/// of the other stream succeeds, the invariants hold, and `empty_cache` gives back the rest.
#[test]
fn a_failed_release_during_a_give_back_loses_nothing() {
    for k in 1..=4 {
        let (sim, alloc) = alloc_with(Policy::Default);
        side_batch(&sim, &alloc, SIDE);
        sim.fail_release(k);
        let held = main_grows(&sim, &alloc);
        alloc.check_invariants().unwrap();
        for a in held {
            alloc.free(a).unwrap();
        }
        sim.complete_all();
        alloc.empty_cache().unwrap();
        assert_eq!(
            alloc.reserved_bytes(),
            0,
            "release call {k} failed: bytes kept"
        );
        sim.check_invariants();
    }
}
