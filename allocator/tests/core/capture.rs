//! Capture awareness (`pool::capture`): told that a CUDA graph capture is underway, the pool
//! makes no device call the capture forbids. The simulated device refuses those calls while it
//! captures a stream, as the driver does (error 900, and the capture is invalidated), so a
//! forbidden call shows as a failed `end_capture` here.

use crate::common::pool;

use cudalloc::snapshot::BlockState;
use cudalloc::{AllocError, CachingAllocator, Config, Policy, Pool};
use cudalloc_sys::{Call, CaptureMode, SimConfig, SimDevice, StreamId};
use pool::{alloc, check, free, pool_with, Sim, GIB, KIB, MIB};
use std::sync::Arc;

/// A stream that can be captured (the sim refuses the legacy and per-thread default streams).
const CAP: StreamId = StreamId(5);
/// Another stream.
const SIDE: StreamId = StreamId(6);

fn pool_for(policy: Policy) -> (Sim, Pool<Sim>) {
    pool_with(Config::for_policy(policy), 4 * GIB)
}

/// Mixed requests on the capture stream: small and large, some freed at once (their memory is
/// reused within the capture), the rest kept.
fn capture_work(pool: &mut Pool<Sim>) -> Vec<cudalloc::Allocation> {
    let mut kept = Vec::new();
    for (i, size) in [1000, 3 * MIB, 40 * KIB, 25 * MIB, 512, 90 * MIB]
        .into_iter()
        .enumerate()
    {
        let a = alloc(pool, size, CAP);
        if i % 2 == 0 {
            free(pool, a);
        } else {
            kept.push(a);
        }
    }
    kept
}

#[test]
fn expandable_policies_grow_and_reuse_during_a_global_capture_without_a_forbidden_call() {
    for policy in [Policy::Default, Policy::TorchExpandable] {
        let (sim, mut pool) = pool_for(policy);
        sim.set_auto_complete(false);
        pool.begin_capture(CaptureMode::Global);
        sim.begin_capture(CAP, CaptureMode::Global).unwrap();
        let kept = capture_work(&mut pool);
        check(&sim, &pool);
        sim.end_capture(CAP)
            .unwrap_or_else(|e| panic!("{policy:?} made a forbidden call: {e}"));
        pool.end_capture(CaptureMode::Global).unwrap();
        assert_eq!(sim.calls(Call::Malloc), 0);
        for a in kept {
            free(&mut pool, a);
        }
        sim.complete_all();
        pool.empty_cache().unwrap();
        check(&sim, &pool);
        assert_eq!(sim.outstanding_bytes(), 0);
    }
}

#[test]
fn torch_growth_during_a_capture_is_an_error_that_says_how_to_reserve_ahead() {
    let (sim, mut pool) = pool_for(Policy::Torch);
    pool.begin_capture(CaptureMode::Global);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    let err = pool.allocate(10 * MIB, CAP).unwrap_err();
    assert_eq!(
        err,
        AllocError::DuringCapture {
            what: "grow",
            requested: 10 * MIB
        }
    );
    let text = err.to_string();
    assert!(
        text.contains("warm-up") && text.contains("torch-expandable"),
        "{text}"
    );
    sim.end_capture(CAP).expect("the capture stayed valid");
    pool.end_capture(CaptureMode::Global).unwrap();
    check(&sim, &pool);
    // Outside the capture the same request is served.
    let a = alloc(&mut pool, 10 * MIB, CAP);
    free(&mut pool, a);
}

#[test]
fn a_pool_not_told_of_the_capture_invalidates_it() {
    let (sim, mut pool) = pool_for(Policy::Torch);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    let err = pool.allocate(10 * MIB, CAP).unwrap_err();
    assert!(
        matches!(&err, AllocError::Device(e) if e.is_capture_unsupported()),
        "{err}"
    );
    assert!(
        sim.end_capture(CAP).is_err(),
        "the driver invalidates the capture"
    );
    check(&sim, &pool);
}

#[test]
fn in_relaxed_mode_torch_grows_with_malloc() {
    let (sim, mut pool) = pool_for(Policy::Torch);
    pool.begin_capture(CaptureMode::Relaxed);
    sim.begin_capture(CAP, CaptureMode::Relaxed).unwrap();
    let kept = capture_work(&mut pool);
    sim.end_capture(CAP).unwrap();
    pool.end_capture(CaptureMode::Relaxed).unwrap();
    assert!(sim.calls(Call::Malloc) > 0);
    for a in kept {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

#[test]
fn a_warmed_up_torch_pool_serves_a_capture_from_its_cache() {
    let (sim, mut pool) = pool_for(Policy::Torch);
    let warm = capture_work(&mut pool);
    for a in warm {
        free(&mut pool, a);
    }
    let mallocs = sim.calls(Call::Malloc);
    pool.begin_capture(CaptureMode::Global);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    let kept = capture_work(&mut pool);
    sim.end_capture(CAP).unwrap();
    pool.end_capture(CaptureMode::Global).unwrap();
    assert_eq!(sim.calls(Call::Malloc), mallocs);
    for a in kept {
        free(&mut pool, a);
    }
    check(&sim, &pool);
}

#[test]
fn a_block_another_stream_used_waits_until_the_capture_ends_for_its_events() {
    let (sim, mut pool) = pool_for(Policy::Default);
    sim.set_auto_complete(false);
    let a = alloc(&mut pool, 4 * MIB, CAP);
    pool.record_stream(&a, SIDE).unwrap();
    pool.begin_capture(CaptureMode::Global);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    free(&mut pool, a.duplicate());
    check(&sim, &pool);
    assert_eq!(pool.deferred_blocks(), 1);
    assert_eq!(
        sim.calls(Call::RecordEvent),
        0,
        "an event recorded during the capture"
    );
    let state = |pool: &Pool<Sim>| {
        let snap = pool.snapshot();
        let mut blocks = snap.segments.iter().flat_map(|s| s.blocks.iter());
        blocks.find(|b| b.addr == a.ptr()).map(|b| b.state)
    };
    assert_eq!(state(&pool), Some(BlockState::PendingEvents));
    // Its memory is not reused during the capture.
    let b = alloc(&mut pool, 4 * MIB, CAP);
    assert_ne!(b.ptr(), a.ptr());
    assert_eq!(
        pool.free(a.duplicate()),
        Err(AllocError::NotAllocated(a.ptr())),
        "freed twice"
    );
    sim.end_capture(CAP).unwrap();
    pool.end_capture(CaptureMode::Global).unwrap();
    assert_eq!(pool.deferred_blocks(), 0);
    assert_eq!(pool.pending_events(), 1);
    sim.complete_all();
    free(&mut pool, b);
    let c = alloc(&mut pool, 4 * MIB, CAP);
    assert_eq!(
        c.ptr(),
        a.ptr(),
        "back in its pool once the side stream's work completed"
    );
    free(&mut pool, c);
    check(&sim, &pool);
}

#[test]
fn the_default_budget_gives_nothing_back_during_a_capture() {
    let cfg = Config::parse("policy:default,layout_plans:false,fragmentation_budget:0.1").unwrap();
    let (sim, mut pool) = pool_with(cfg, 4 * GIB);
    sim.set_auto_complete(false);
    // A free block of another stream: outside a capture the budget would give it back.
    let other = alloc(&mut pool, 64 * MIB, SIDE);
    free(&mut pool, other);
    pool.begin_capture(CaptureMode::Global);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    let a = alloc(&mut pool, 64 * MIB, CAP);
    sim.end_capture(CAP).unwrap();
    assert_eq!(sim.calls(Call::Unmap), 0);
    assert_eq!(sim.calls(Call::RecordEvent), 0);
    assert_eq!(pool.releasing_bytes(), 0);
    pool.end_capture(CaptureMode::Global).unwrap();
    free(&mut pool, a);
    // The control: outside the capture, the same growth on a third stream gives pages back.
    let b = alloc(&mut pool, 64 * MIB, StreamId(7));
    assert!(
        sim.calls(Call::RecordEvent) > 0,
        "the budget gave nothing back"
    );
    free(&mut pool, b);
    check(&sim, &pool);
}

#[test]
fn empty_cache_and_an_unmatched_end_are_refused_and_change_nothing() {
    let (sim, mut pool) = pool_for(Policy::TorchExpandable);
    let a = alloc(&mut pool, 8 * MIB, CAP);
    free(&mut pool, a);
    let reserved = pool.reserved();
    pool.begin_capture(CaptureMode::ThreadLocal);
    sim.begin_capture(CAP, CaptureMode::ThreadLocal).unwrap();
    let err = pool.empty_cache().unwrap_err();
    assert!(
        err.to_string().contains("before or after the capture"),
        "{err}"
    );
    assert_eq!(pool.reserved(), reserved);
    sim.end_capture(CAP).unwrap();
    // A relaxed end does not end a thread-local capture.
    let err = pool.end_capture(CaptureMode::Relaxed).unwrap_err();
    assert!(
        matches!(err, AllocError::DuringCapture { requested: 0, .. }),
        "{err}"
    );
    pool.end_capture(CaptureMode::ThreadLocal).unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
    check(&sim, &pool);
}

#[test]
fn the_caching_allocator_tells_every_shard() {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)));
    let cfg = Config::for_policy(Policy::Torch);
    let alloc = CachingAllocator::new(sim.clone(), cfg);
    alloc.begin_capture(CaptureMode::Global);
    sim.begin_capture(CAP, CaptureMode::Global).unwrap();
    for s in [CAP, SIDE, StreamId(77)] {
        let err = alloc.allocate(MIB, s).unwrap_err();
        assert!(matches!(err, AllocError::DuringCapture { .. }), "{err}");
    }
    assert!(alloc.empty_cache().is_err());
    sim.end_capture(CAP).unwrap();
    alloc.end_capture(CaptureMode::Global).unwrap();
    assert!(
        alloc.end_capture(CaptureMode::Global).is_err(),
        "unmatched end"
    );
    let a = alloc.allocate(MIB, SIDE).unwrap();
    alloc.free(a).unwrap();
    alloc.check_invariants().unwrap();
}

/// A pool not told of a capture does not record an event on the captured stream to give pages
/// back (the event would join the graph and never answer a query); it asks the device whether
/// the stream is being captured, and keeps working after the capture.
#[test]
fn the_budget_records_no_event_on_a_stream_under_a_capture_it_was_not_told_of() {
    let cfg = Config::parse("policy:default,layout_plans:false,fragmentation_budget:0.1").unwrap();
    let (sim, mut pool) = pool_with(cfg, 4 * GIB);
    let a = alloc(&mut pool, 64 * MIB, CAP);
    free(&mut pool, a);
    sim.begin_capture(CAP, CaptureMode::Relaxed).unwrap();
    let b = alloc(&mut pool, 64 * MIB, SIDE);
    assert_eq!(sim.calls(Call::RecordEvent), 0);
    assert_eq!(pool.releasing_bytes(), 0);
    sim.end_capture(CAP).unwrap();
    free(&mut pool, b);
    let c = alloc(&mut pool, 64 * MIB, StreamId(7));
    assert!(
        sim.calls(Call::RecordEvent) > 0,
        "after the capture the budget gives back"
    );
    free(&mut pool, c);
    check(&sim, &pool);
}

/// A block freed while a stream that used it is being captured, before the pool is told of
/// the capture (PyTorch's extension tells at the capture's first allocation): no event is
/// recorded into the capture (none could be queried, and every later allocation polling it
/// would fail), not even by an allocation made before the pool is told; the events are
/// recorded once the capture has ended, and the block comes back when they complete.
#[test]
fn a_free_before_the_pool_is_told_of_a_capture_records_no_event_into_it() {
    for policy in [Policy::Default, Policy::TorchExpandable, Policy::Torch] {
        let (sim, mut pool) = pool_for(policy);
        sim.set_auto_complete(false);
        let warm = alloc(&mut pool, 2 * MIB, CAP);
        free(&mut pool, warm);
        let a = alloc(&mut pool, 4 * MIB, SIDE);
        pool.record_stream(&a, CAP).unwrap();
        sim.begin_capture(CAP, CaptureMode::Relaxed).unwrap();
        free(&mut pool, a.duplicate());
        assert_eq!(pool.deferred_blocks(), 1, "{policy:?}");
        let other = alloc(&mut pool, 4 * MIB, SIDE);
        assert_eq!(pool.deferred_blocks(), 1, "{policy:?}: still captured");
        // Told at the capture's first allocation.
        pool.begin_capture(CaptureMode::Relaxed);
        let in_graph = alloc(&mut pool, 2 * MIB, CAP);
        sim.end_capture(CAP)
            .unwrap_or_else(|e| panic!("{policy:?} made a forbidden call: {e}"));
        pool.end_capture(CaptureMode::Relaxed).unwrap();
        assert_eq!(pool.deferred_blocks(), 0, "{policy:?}");
        assert_eq!(pool.pending_events(), 1, "{policy:?}");
        sim.complete_all();
        let b = alloc(&mut pool, 4 * MIB, SIDE);
        assert_eq!(
            b.ptr(),
            a.ptr(),
            "{policy:?}: back once the capture's work completed"
        );
        for x in [b, other, in_graph] {
            free(&mut pool, x);
        }
        pool.empty_cache().unwrap();
        check(&sim, &pool);
        assert_eq!(sim.outstanding_bytes(), 0, "{policy:?}");
    }
}

/// A pool under `policy` on a device that completes nothing by itself, holding one free 4 MiB
/// block of `SIDE` that waits for an event of `CAP` (used there with `record_stream`); and the
/// block's address.
fn waiting_for_cap(policy: Policy) -> (Sim, Pool<Sim>, u64) {
    let (sim, mut pool) = pool_for(policy);
    sim.set_auto_complete(false);
    let a = alloc(&mut pool, 4 * MIB, SIDE);
    let at = a.ptr();
    pool.record_stream(&a, CAP).unwrap();
    free(&mut pool, a);
    (sim, pool, at)
}

/// An event of a stream under a capture the pool was not told of, whose query fails, holds
/// its block back until the capture has ended; it fails no allocation meanwhile.
#[test]
fn an_unanswered_event_of_a_captured_stream_fails_no_allocation() {
    for policy in [Policy::Default, Policy::TorchExpandable, Policy::Torch] {
        let (sim, mut pool, at) = waiting_for_cap(policy);
        sim.begin_capture(CAP, CaptureMode::Relaxed).unwrap();
        sim.fail_next(); // the event's query
        let b = alloc(&mut pool, 512, SIDE);
        assert_eq!(pool.pending_events(), 1, "{policy:?}: still waiting");
        sim.end_capture(CAP).unwrap();
        sim.complete_all();
        let c = alloc(&mut pool, 4 * MIB, SIDE);
        assert_eq!(c.ptr(), at, "{policy:?}: back once the capture ended");
        for x in [b, c] {
            free(&mut pool, x);
        }
        check(&sim, &pool);
    }
}

/// An end whose deferred events cannot be recorded ends the capture all the same (so that a
/// caller's retry cannot strand it); the blocks stay deferred and the next allocation records
/// their events.
#[test]
fn a_failed_end_capture_still_ends_and_the_next_allocation_records_the_events() {
    let (sim, mut pool) = pool_for(Policy::Default);
    sim.set_auto_complete(false);
    let a = alloc(&mut pool, 8 * MIB, CAP);
    pool.record_stream(&a, SIDE).unwrap();
    pool.begin_capture(CaptureMode::Global);
    free(&mut pool, a);
    // The capture status of the stream that used it is asked first; then the event is made.
    sim.fail_call(2);
    assert!(matches!(
        pool.end_capture(CaptureMode::Global),
        Err(AllocError::Device(_))
    ));
    assert!(!pool.capturing());
    assert_eq!(pool.deferred_blocks(), 1);
    check(&sim, &pool);
    assert!(
        pool.end_capture(CaptureMode::Global).is_err(),
        "ended already"
    );
    let b = alloc(&mut pool, 512, CAP);
    assert_eq!(pool.deferred_blocks(), 0);
    check(&sim, &pool);
    free(&mut pool, b);
    sim.complete_all();
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(sim.outstanding_bytes(), 0);
}

/// A pool dropped during a capture it was told of, while a stream that used one of its freed
/// blocks is being captured, gives all its memory back, that block's too (its event cannot be
/// recorded into the graph, and live memory dies with the pool too), and leaves the capture
/// valid: it waits for nothing then.
#[test]
fn a_pool_dropped_during_a_capture_it_was_told_of_gives_everything_back() {
    let cases = [
        (Policy::Default, CaptureMode::Global),
        (Policy::TorchExpandable, CaptureMode::Global),
        (Policy::Default, CaptureMode::Relaxed),
        (Policy::TorchExpandable, CaptureMode::Relaxed),
        // `free` (fixed segments) is refused in the other modes.
        (Policy::Torch, CaptureMode::Relaxed),
    ];
    for (policy, mode) in cases {
        let (sim, mut pool) = pool_for(policy);
        sim.set_auto_complete(false);
        let a = alloc(&mut pool, 4 * MIB, SIDE);
        let _live = alloc(&mut pool, 30 * MIB, SIDE);
        let waits = alloc(&mut pool, 2 * MIB, CAP);
        pool.record_stream(&a, CAP).unwrap();
        pool.record_stream(&waits, SIDE).unwrap();
        free(&mut pool, waits);
        sim.begin_capture(CAP, mode).unwrap();
        pool.begin_capture(mode);
        free(&mut pool, a);
        assert_eq!(pool.deferred_blocks(), 1, "{policy:?}");
        assert_eq!(pool.pending_events(), 1, "{policy:?}");
        drop(pool);
        sim.end_capture(CAP)
            .unwrap_or_else(|e| panic!("{policy:?} {mode:?}: a forbidden call: {e}"));
        assert_eq!(
            sim.outstanding_bytes(),
            0,
            "{policy:?} {mode:?}: nothing leaked"
        );
    }
}

/// The same drop waits for nothing when the captured stream is known to the pool only through
/// the event of a freed block (its `record_stream`), nor for the pinned host buffer an
/// offloading sleep left (its wait and its free would invalidate the capture: the buffer stays
/// allocated). Found by a review: both made the drop wait.
#[test]
fn a_pool_dropped_during_a_capture_it_was_told_of_waits_for_nothing() {
    for policy in [Policy::Default, Policy::TorchExpandable] {
        let (sim, mut pool) = pool_for(policy);
        sim.set_auto_complete(false);
        let a = alloc(&mut pool, 4 * MIB, SIDE);
        pool.record_stream(&a, CAP).unwrap();
        free(&mut pool, a);
        assert_eq!(pool.pending_events(), 1, "{policy:?}");
        sim.begin_capture(CAP, CaptureMode::Global).unwrap();
        pool.begin_capture(CaptureMode::Global);
        drop_keeps_capture(&sim, pool, &format!("{policy:?}, an event's stream"));

        let (sim, mut pool) = pool_for(policy);
        let _live = alloc(&mut pool, 8 * MIB, CAP);
        pool.sleep(true).unwrap();
        pool.wake(CAP).unwrap();
        sim.set_auto_complete(false);
        sim.begin_capture(CAP, CaptureMode::Global).unwrap();
        pool.begin_capture(CaptureMode::Global);
        drop_keeps_capture(&sim, pool, &format!("{policy:?}, a host buffer"));
    }
}

/// A drop asks the driver nothing of the streams the pool has seen (a block's, one that used
/// one, one an event waits on): a program may have destroyed them before the allocator, and
/// the driver may crash on a destroyed stream's handle (it did on the H200: the `swap`
/// example and the `gpu` tests, whose streams die first, ended with a segmentation fault when
/// the drop asked `cuStreamIsCapturing` of each). Neither for a live block another stream used,
/// nor for a block deferred for a capture: it waits on its own events, or for the device.
#[test]
fn a_pool_dropped_asks_nothing_of_its_streams() {
    for policy in [Policy::Default, Policy::TorchExpandable, Policy::Torch] {
        let (sim, mut pool) = pool_for(policy);
        sim.set_auto_complete(false);
        let a = alloc(&mut pool, 4 * MIB, SIDE);
        let live = alloc(&mut pool, 30 * MIB, SIDE);
        let cached = alloc(&mut pool, 6 * MIB, CAP);
        let owed = alloc(&mut pool, 2 * MIB, SIDE);
        pool.record_stream(&a, CAP).unwrap();
        pool.record_stream(&live, CAP).unwrap();
        pool.record_stream(&owed, StreamId(9)).unwrap();
        free(&mut pool, a);
        free(&mut pool, cached);
        sim.begin_capture(StreamId(9), CaptureMode::Global).unwrap();
        free(&mut pool, owed); // deferred: its stream is captured
        let _ = sim.end_capture(StreamId(9));
        assert_eq!(pool.pending_events(), 1, "{policy:?}");
        assert_eq!(pool.deferred_blocks(), 1, "{policy:?}");
        drop_asks_nothing_of_streams(&sim, pool, &format!("{policy:?}"));
    }
}

/// Drops `pool` and checks that the drop asked no stream for its capture status, recorded no
/// event and made no stream wait for one (a pool with a host buffer records on its own copy
/// stream: not for such a pool), and that (once the device completes its work) it leaked
/// nothing.
fn drop_asks_nothing_of_streams(sim: &Sim, pool: Pool<Sim>, what: &str) {
    let calls = [Call::CaptureStatus, Call::RecordEvent, Call::WaitEvent];
    let before = calls.map(|c| sim.calls(c));
    drop(pool);
    let after = calls.map(|c| sim.calls(c));
    assert_eq!(
        after, before,
        "{what}: capture-status queries, event records and waits"
    );
    sim.clear_faults();
    sim.complete_all();
    assert_eq!(sim.outstanding_bytes(), 0, "{what}: nothing leaked");
}

/// Nor when the device refuses to wait for the pool's events: the drop does not record them
/// again on their streams (the program may have destroyed those), it gives the blocks back
/// without their waits.
#[test]
fn a_pool_whose_event_waits_fail_asks_nothing_of_its_streams_when_dropped() {
    for policy in [Policy::Default, Policy::TorchExpandable, Policy::Torch] {
        let (sim, pool, _) = waiting_for_cap(policy);
        assert_eq!(pool.pending_events(), 1, "{policy:?}");
        sim.fail_always(Call::SynchronizeEvent);
        drop_asks_nothing_of_streams(&sim, pool, &format!("{policy:?}, waits refused"));
    }
}

/// Nor for a sleeping pool's host buffer, which holds the offloaded bytes; nor while the
/// capture is underway on a stream the pool holds nothing of (a global capture
/// refuses a wait on any stream). Found by a second review.
#[test]
fn a_sleeping_pool_or_one_told_of_the_capture_waits_for_nothing_when_dropped() {
    for policy in [Policy::Default, Policy::TorchExpandable] {
        let (sim, mut pool) = pool_for(policy);
        let _live = alloc(&mut pool, 8 * MIB, CAP);
        pool.sleep(true).unwrap();
        sim.set_auto_complete(false);
        sim.begin_capture(CAP, CaptureMode::Global).unwrap();
        pool.begin_capture(CaptureMode::Global);
        drop_keeps_capture(&sim, pool, &format!("{policy:?}, a sleeping pool"));

        let (sim, mut pool) = pool_for(policy);
        sim.set_auto_complete(false);
        let a = alloc(&mut pool, 4 * MIB, SIDE);
        pool.record_stream(&a, StreamId(7)).unwrap();
        free(&mut pool, a);
        assert_eq!(pool.pending_events(), 1);
        pool.begin_capture(CaptureMode::Global);
        sim.begin_capture(CAP, CaptureMode::Global).unwrap();
        drop_keeps_capture(&sim, pool, &format!("{policy:?}, told of the capture"));
    }
}

/// Drops `pool` during the device's capture of `CAP`: the capture must end without error (the
/// drop made no call it forbids), and the device must hold nothing of the pool (`what` names
/// the case).
fn drop_keeps_capture(sim: &Sim, pool: Pool<Sim>, what: &str) {
    drop(pool);
    sim.end_capture(CAP)
        .unwrap_or_else(|e| panic!("{what}: a forbidden call: {e}"));
    assert_eq!(sim.outstanding_bytes(), 0, "{what}: nothing leaked");
}

/// One step of a random sequence for [`captures_never_make_a_forbidden_call`].
#[derive(Clone, Copy, Debug)]
enum Step {
    Alloc { size: u64, side: bool },
    Free { pick: usize },
    RecordFree { pick: usize },
    Complete,
    Capture { mode: usize },
    EndCapture,
    Limit(Option<u64>),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        6 => (1u64..96 * MIB, any::<bool>()).prop_map(|(size, side)| Step::Alloc { size, side }),
        4 => any::<usize>().prop_map(|pick| Step::Free { pick }),
        2 => any::<usize>().prop_map(|pick| Step::RecordFree { pick }),
        1 => Just(Step::Complete),
        1 => (0usize..3).prop_map(|mode| Step::Capture { mode }),
        1 => Just(Step::EndCapture),
        1 => prop_oneof![Just(None), (256u64..1024).prop_map(|m| Some(m * MIB))].prop_map(Step::Limit),
    ]
}

/// Runs `steps` under `policy`: a capture of `CAP` is begun on the device and the pool alike
/// (one at a time); every call the pool makes during it must leave the capture valid, every
/// error must be one the rules allow, and the invariants hold after every step.
fn run_captures(policy: Policy, steps: &[Step]) {
    let (sim, mut pool) = pool_with(Config::for_policy(policy), 2 * GIB);
    sim.set_auto_complete(false);
    let mut live: Vec<cudalloc::Allocation> = Vec::new();
    let mut mode: Option<CaptureMode> = None;
    for s in steps {
        match *s {
            Step::Alloc { size, side } => {
                let stream = if side && mode.is_none() { SIDE } else { CAP };
                match pool.allocate(size, stream) {
                    Ok(a) => live.push(a),
                    Err(AllocError::OutOfMemory { .. }) => {}
                    Err(AllocError::DuringCapture { what: "grow", .. }) => {
                        assert!(policy == Policy::Torch && mode != Some(CaptureMode::Relaxed));
                    }
                    Err(e) => panic!("{policy:?} in {mode:?}: {e}"),
                }
            }
            Step::Free { pick } | Step::RecordFree { pick } if !live.is_empty() => {
                let a = live.swap_remove(pick % live.len());
                if matches!(s, Step::RecordFree { .. }) {
                    pool.record_stream(&a, SIDE).unwrap();
                }
                pool.free(a).unwrap();
            }
            Step::Complete => sim.complete_all(),
            Step::Capture { mode: m } if mode.is_none() => {
                let m = CaptureMode::ALL[m];
                pool.begin_capture(m);
                sim.begin_capture(CAP, m).unwrap();
                mode = Some(m);
            }
            Step::EndCapture => {
                if let Some(m) = mode.take() {
                    sim.end_capture(CAP)
                        .unwrap_or_else(|e| panic!("{policy:?} broke a {m:?} capture: {e}"));
                    pool.end_capture(m).unwrap();
                }
            }
            Step::Limit(l) if mode.is_none() => pool.set_limit(l),
            _ => {}
        }
        check(&sim, &pool);
    }
    if let Some(m) = mode {
        sim.end_capture(CAP)
            .unwrap_or_else(|e| panic!("{policy:?} broke a {m:?} capture: {e}"));
        pool.end_capture(m).unwrap();
    }
    for a in live {
        pool.free(a).unwrap();
    }
    sim.complete_all();
    pool.empty_cache().unwrap();
    check(&sim, &pool);
    assert_eq!(sim.outstanding_bytes(), 0);
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 300, failure_persistence: None, ..Default::default() })]

    #[test]
    fn captures_never_make_a_forbidden_call(
        which in 0usize..3,
        steps in proptest::collection::vec(step(), 1..120),
    ) {
        run_captures(Policy::ALL[which], &steps);
    }
}
