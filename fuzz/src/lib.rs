//! Helpers shared by the fuzz targets: what every parsed [`Trace`] must satisfy, a checked
//! replay of it under every policy, and [`tolerating_known_bugs`], which lets fuzzing go on past
//! the panics of bugs already reported (set `CUDALLOC_FUZZ_STRICT` to make them crashes again).

use cudalloc::{AllocError, Allocation, Config, Policy, Pool};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use cudalloc_trace::replay::{replay, ReplayOptions};
use cudalloc_trace::{Op, Trace, TraceError};
use std::panic::{catch_unwind, AssertUnwindSafe, PanicHookInfo};
use std::sync::{Once, OnceLock};

/// Panics of bugs already reported, by (source file suffix, message), each with a regression
/// test in `allocator/tests/core/sizes.rs`, `allocator/tests/faults/bad_input_pool.rs`,
/// `allocator/tests/core/pool_expandable.rs` or `allocator/cli/tests/bad_input/regressions.rs`;
/// [`tolerating_known_bugs`] lets fuzzing go on past them. Add an entry when a crash is
/// reported, remove it when the bug is fixed. The one open is a dependency's (below); the four
/// bugs the first runs met (overflows in `round_size` and in `TraceBuilder`'s live bytes, stack
/// overflow on deeply nested pickles) were fixed in commit 467c8b1.
const KNOWN_BUGS: &[(&str, &str)] = &[
    // serde-pickle 1.2 sorts a pickled set or frozenset of floats into a BTreeSet, and a NaN
    // makes the sort panic; the reader decodes on a thread of its own and turns the panic into
    // an error ("the pickle decoder failed: ..."), which is what the target checks.
    (
        "smallsort.rs",
        "user-provided comparison function does not correctly implement a total order",
    ),
];

fn is_known(info: &PanicHookInfo<'_>) -> bool {
    let file = info.location().map_or("", |l| l.file());
    let msg = info.payload_as_str().unwrap_or("");
    KNOWN_BUGS
        .iter()
        .any(|(f, m)| file.ends_with(f) && msg.contains(m))
}

/// True when the environment variable `CUDALLOC_FUZZ_STRICT` is set: known bugs are crashes
/// too (to check a fix, or to see how fast fuzzing finds them).
pub fn strict() -> bool {
    static STRICT: OnceLock<bool> = OnceLock::new();
    *STRICT.get_or_init(|| std::env::var_os("CUDALLOC_FUZZ_STRICT").is_some())
}

/// Runs `f`; a panic of a known bug ([`KNOWN_BUGS`]) ends the input quietly, any other panic
/// is a crash as usual (libFuzzer's panic hook aborts). With [`strict`], every panic is a crash.
pub fn tolerating_known_bugs(f: impl FnOnce()) {
    if strict() {
        return f();
    }
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let fuzzer_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !is_known(info) {
                fuzzer_hook(info);
            }
        }));
    });
    let _ = catch_unwind(AssertUnwindSafe(f));
}

/// Device capacity of the checked replays: small, so that traces run out of memory too.
const CAPACITY: u64 = 4 << 30;

/// The structure a reader promises: every op names a slot and a stream that exist, an `alloc`
/// goes into a free slot, a `free` names a live slot, and `peak_live` is the peak of the summed
/// sizes of live allocations.
pub fn check_trace(t: &Trace) {
    // One op per `alloc` or matched `free_completed`, plus the implied free of a double alloc
    // and the allocations put before a snapshot's history; each op with its line.
    let most = t.events + t.anomalies.double_allocs + t.before_history;
    assert!(
        t.ops.len() as u64 <= most,
        "{} ops from {} events and {} allocations before the history",
        t.ops.len(),
        t.events,
        t.before_history
    );
    assert_eq!(t.op_lines.len(), t.ops.len());
    assert_eq!(t.segment_sizes.len() as u64, t.segment_allocs);
    let mut live: Vec<Option<u64>> = vec![None; t.slots as usize];
    let (mut bytes, mut peak) = (0u128, 0u128);
    for (i, op) in t.ops.iter().enumerate() {
        match *op {
            Op::Alloc { slot, stream, size } => {
                assert!(
                    (stream as usize) < t.streams.len(),
                    "op {i}: stream {stream} out of range"
                );
                let s = live
                    .get_mut(slot as usize)
                    .unwrap_or_else(|| panic!("op {i}: slot {slot} out of range"));
                assert!(s.is_none(), "op {i}: alloc into live slot {slot}");
                *s = Some(size);
                bytes += u128::from(size);
                peak = peak.max(bytes);
            }
            Op::Free { slot } => {
                let s = live
                    .get_mut(slot as usize)
                    .unwrap_or_else(|| panic!("op {i}: slot {slot} out of range"));
                let size = s
                    .take()
                    .unwrap_or_else(|| panic!("op {i}: free of empty slot {slot}"));
                bytes -= u128::from(size);
            }
        }
    }
    // The sum of live sizes may pass `u64::MAX`; the trace then says `u64::MAX`.
    assert_eq!(
        u128::from(t.peak_live),
        peak.min(u128::from(u64::MAX)),
        "peak_live"
    );
    let a = &t.anomalies;
    assert_eq!(
        a.first_line.is_some(),
        a.unmatched_frees + a.double_allocs + a.mismatched_frees > 0
    );
}

/// An error must name a line that exists (1-based) in an input of `lines` lines or records.
pub fn check_error(e: &TraceError, lines: u64) {
    if let Some(l) = e.line {
        assert!(
            l >= 1 && l <= lines.max(1),
            "error at line {l} of {lines}: {e}"
        );
    }
    assert!(!e.message.is_empty());
    let _ = e.to_string();
}

/// Replays `t` under every policy on a small simulated device, checking the pool's and the
/// device's invariants after every op and that nothing leaks; then runs the library's own
/// [`replay`] (capped, with a timeline) once.
pub fn replay_all(t: &Trace, which: u8) {
    for policy in Policy::ALL {
        replay_checked(t, policy);
    }
    let cfg = Config::for_policy(Policy::ALL[which as usize % 3]);
    let opts = ReplayOptions {
        capacity: Some(CAPACITY / 2),
        samples: 8,
        calls: true,
        ..ReplayOptions::default()
    };
    let r = replay(t, &cfg, &opts);
    assert!(r.events <= t.ops.len() as u64);
    // The call log adds up to the replay's calls, one step per operation, none past a failure.
    let logged = r.calls.iter().fold([0; 4], |s, c| {
        let k = c.calls;
        [
            s[0] + k.mallocs,
            s[1] + k.frees,
            s[2] + k.maps,
            s[3] + k.unmaps,
        ]
    });
    assert_eq!(
        logged,
        [
            r.device_mallocs,
            r.device_frees,
            r.device_maps,
            r.device_unmaps
        ]
    );
    assert!(r.calls.windows(2).all(|w| w[0].op < w[1].op));
    assert!(r.calls.iter().all(|c| c.op < r.events as usize));
    if let Some(f) = &r.failure {
        assert!(f.op < t.ops.len());
        let huge = matches!(f.error, AllocError::TooLarge { .. });
        assert!(
            f.error.is_out_of_memory() || huge,
            "replay failed with {:?}",
            f.error
        );
    }
}

fn replay_checked(t: &Trace, policy: Policy) {
    let sim = std::sync::Arc::new(SimDevice::new(SimConfig::with_capacity(CAPACITY)));
    // The placements a replay makes (the trace's addresses decide them), checked here too.
    sim.plan_mallocs(cudalloc_trace::replay::malloc_plan(t));
    let mut pool = Pool::new(sim.clone(), Config::for_policy(policy));
    let mut slots: Vec<Option<Allocation>> = (0..t.slots).map(|_| None).collect();
    for (i, op) in t.ops.iter().enumerate() {
        match *op {
            Op::Alloc { slot, stream, size } => {
                match pool.allocate(size, StreamId(t.streams[stream as usize])) {
                    Ok(a) => slots[slot as usize] = Some(a),
                    Err(AllocError::OutOfMemory { .. })
                    | Err(AllocError::AddressSpace { .. })
                    | Err(AllocError::TooLarge { .. }) => {}
                    Err(e) => panic!("{policy:?} op {i}: allocate({size}): {e:?}"),
                }
            }
            Op::Free { slot } => {
                if let Some(a) = slots[slot as usize].take() {
                    pool.free(a)
                        .unwrap_or_else(|e| panic!("{policy:?} op {i}: free: {e:?}"));
                }
            }
        }
        if let Err(e) = pool.check_invariants() {
            panic!("{policy:?} op {i}: {e}");
        }
        assert_eq!(
            sim.outstanding_bytes(),
            pool.reserved(),
            "{policy:?} op {i}"
        );
    }
    for a in slots.into_iter().flatten() {
        pool.free(a).unwrap();
    }
    pool.empty_cache().unwrap();
    assert_eq!(
        pool.reserved(),
        0,
        "{policy:?}: reserved after freeing everything"
    );
    drop(pool);
    sim.check_invariants();
    assert_eq!(sim.outstanding_bytes(), 0);
    assert_eq!(sim.reserved_va_bytes(), 0);
}
