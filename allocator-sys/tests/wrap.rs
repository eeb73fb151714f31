//! Tests of the device wrappers in `cudalloc_sys::wrap`, each around a [`SimDevice`].
//!
//! Invariants checked here:
//! - `Limit`: outstanding physical bytes (segments plus pages) never exceed the limit; a request
//!   over it is `OutOfMemory` and never reaches the inner device; a failed inner call books
//!   nothing; `mem_info` never reports more than the limit allows;
//! - `FailCalls`: the same fault semantics as `SimDevice` (k-th and every k-th acquiring call,
//!   releases never fail), and a failed call never reaches the inner device;
//! - `CountCalls`: one count per call, successful or not, and exact outstanding bytes;
//! - `LogCalls`: one line per call, to memory or to a writer, results passed through unchanged;
//! - wrappers stack, and the inner device's own invariants hold underneath.

use std::io::Write;
use std::sync::Arc;

use cudalloc_sys::wrap::{CallCounters, CountCalls, FailCalls, FaultPlan, Limit, LogCalls};
use cudalloc_sys::{Call, Device, DeviceError, SimDevice, StreamId};
use parking_lot::Mutex;

const MIB: u64 = 1 << 20;
const G: u64 = 2 * MIB;

fn sim() -> Arc<SimDevice> {
    Arc::new(SimDevice::with_capacity(1 << 30))
}

fn is_oom<T: std::fmt::Debug>(r: Result<T, DeviceError>) -> bool {
    matches!(r, Err(DeviceError::OutOfMemory { .. }))
}

#[test]
fn limit_caps_outstanding_bytes() {
    let inner = sim();
    let dev = Limit::new(Arc::clone(&inner), 8 * MIB);
    let a = dev.malloc(5 * MIB).unwrap();
    let calls = inner.calls(Call::Malloc);
    assert!(is_oom(dev.malloc(4 * MIB)));
    assert!(is_oom(dev.create_page(2 * G)));
    assert_eq!(inner.calls(Call::Malloc), calls, "never reached the device");
    assert_eq!(inner.calls(Call::CreatePage), 0);
    let p = dev.create_page(G).unwrap();
    assert_eq!(dev.outstanding_bytes(), 5 * MIB + G);
    assert_eq!(inner.outstanding_bytes(), dev.outstanding_bytes());
    dev.release_page(p).unwrap();
    dev.free(a, 5 * MIB).unwrap();
    assert_eq!(dev.outstanding_bytes(), 0);
    inner.check_invariants();
}

#[test]
fn limit_can_change_at_runtime() {
    let dev = Limit::new(sim(), 4 * MIB);
    assert_eq!(dev.limit(), 4 * MIB);
    let a = dev.malloc(3 * MIB).unwrap();
    dev.set_limit(2 * MIB);
    assert!(is_oom(dev.malloc(256)), "already over the lowered limit");
    assert_eq!(dev.mem_info().unwrap(), (0, 2 * MIB));
    dev.set_limit(16 * MIB);
    assert_eq!(dev.mem_info().unwrap(), (13 * MIB, 16 * MIB));
    dev.malloc(4 * MIB).unwrap();
    dev.free(a, 3 * MIB).unwrap();
    assert_eq!(dev.outstanding_bytes(), 4 * MIB);
}

#[test]
fn limit_mem_info_takes_the_smaller_side() {
    let inner = Arc::new(SimDevice::with_capacity(10 * MIB));
    let dev = Limit::new(Arc::clone(&inner), u64::MAX);
    assert_eq!(dev.mem_info().unwrap(), (10 * MIB, 10 * MIB));
    dev.set_limit(6 * MIB);
    inner.malloc(MIB).unwrap(); // behind the wrapper's back
    assert_eq!(dev.mem_info().unwrap(), (6 * MIB, 6 * MIB));
    dev.malloc(4 * MIB).unwrap();
    assert_eq!(dev.mem_info().unwrap(), (2 * MIB, 6 * MIB));
}

#[test]
fn limit_unbooks_a_failed_inner_call() {
    let inner = sim();
    let dev = Limit::new(Arc::clone(&inner), 4 * MIB);
    inner.fail_next();
    assert!(is_oom(dev.malloc(3 * MIB)));
    inner.fail_next();
    assert!(is_oom(dev.create_page(G)));
    assert_eq!(dev.outstanding_bytes(), 0);
    dev.malloc(3 * MIB).unwrap();
}

#[test]
fn fault_plan_fires_on_schedule() {
    let mut plan = FaultPlan::new();
    assert!(!plan.is_armed());
    plan.fail_call(2);
    plan.fail_every(3);
    let fired: Vec<bool> = (0..7).map(|_| plan.tick(Call::Malloc)).collect();
    assert_eq!(fired, [false, true, true, false, false, true, false]);
    assert!(!plan.tick(Call::Free) && !plan.tick(Call::Unmap));
    plan.clear();
    assert!(!plan.is_armed());
    assert_eq!(FaultPlan::injected(Call::Reserve, 7).to_string(), {
        let e = DeviceError::OutOfMemory {
            call: "reserve",
            requested: 7,
        };
        e.to_string()
    });
}

/// A lasting fault fails every call of its kind, acquiring or release, and no other kind,
/// until the plan is cleared; it leaves a one-shot fault armed.
#[test]
fn a_lasting_fault_fails_its_kind_until_cleared() {
    let mut plan = FaultPlan::new();
    plan.fail_always(Call::Unmap);
    plan.fail_call(3);
    assert!(plan.is_armed());
    assert!((0..5).all(|_| plan.tick(Call::Unmap)));
    let fired: Vec<bool> = (0..4).map(|_| plan.tick(Call::Malloc)).collect();
    assert_eq!(fired, [false, false, true, false]);
    assert!(!plan.tick(Call::Free));
    plan.clear();
    assert!(!plan.tick(Call::Unmap) && !plan.is_armed());
    let dev = FailCalls::new(sim());
    dev.fail_always(Call::Reserve);
    assert!(dev.reserve(G).is_err() && dev.reserve(G).is_err());
    dev.clear_faults();
    assert!(dev.reserve(G).is_ok());
}

#[test]
fn fail_calls_hits_the_kth_call_and_spares_the_inner_device() {
    let inner = sim();
    let dev = FailCalls::new(Arc::clone(&inner));
    dev.fail_call(2);
    let a = dev.malloc(4096).unwrap();
    dev.free(a, 4096).unwrap(); // a release: not counted
    let before = inner.total_calls();
    let err = dev.reserve(G).unwrap_err();
    assert_eq!(
        err,
        DeviceError::OutOfMemory {
            call: "reserve",
            requested: G
        }
    );
    assert_eq!(inner.total_calls(), before, "never reached the device");
    assert!(dev.reserve(G).is_ok());
}

#[test]
fn fail_calls_every_kth_and_never_releases() {
    let inner = sim();
    let dev = FailCalls::new(Arc::clone(&inner));
    let e = dev.create_event().unwrap();
    let va = dev.reserve(G).unwrap();
    let p = dev.create_page(G).unwrap();
    dev.map(va, G, p).unwrap();
    dev.fail_every(2);
    let ok: Vec<bool> = (0..4)
        .map(|_| dev.record_event(e, StreamId(1)).is_ok())
        .collect();
    assert_eq!(ok, [true, false, true, false]);
    assert!(dev.query_event(e).is_ok(), "5th call");
    let err = dev.query_event(e).map(|_| ()).unwrap_err();
    assert!(
        matches!(err, DeviceError::Driver { code: 999, .. }),
        "{err}"
    );
    dev.fail_every(1);
    dev.unmap(va, G).unwrap();
    dev.release_page(p).unwrap();
    dev.unreserve(va, G).unwrap();
    dev.destroy_event(e).unwrap();
    dev.clear_faults();
    dev.fail_next();
    assert!(is_oom(dev.malloc(256)));
    assert!(dev.malloc(256).is_ok());
    inner.check_invariants();
}

#[test]
fn count_calls_counts_and_tracks_bytes() {
    let dev = CountCalls::new(sim());
    let a = dev.malloc(3 * MIB).unwrap();
    let p = dev.create_page(G).unwrap();
    let _ = dev.malloc(0);
    let _ = dev.free(a + 256, 1);
    assert_eq!(dev.calls(Call::Malloc), 2);
    assert_eq!(dev.calls(Call::Free), 1);
    assert_eq!(dev.outstanding_bytes(), 3 * MIB + G);
    dev.release_page(p).unwrap();
    dev.free(a, 3 * MIB).unwrap();
    let e = dev.create_event().unwrap();
    dev.record_event(e, StreamId::DEFAULT).unwrap();
    assert!(dev.query_event(e).unwrap());
    dev.mem_info().unwrap();
    assert_eq!(dev.outstanding_bytes(), 0);
    assert_eq!(dev.total_calls(), 10);
    assert_eq!(dev.counters().get(Call::ReleasePage), 1);
    dev.reset_calls();
    assert_eq!(dev.total_calls(), 0);
}

#[test]
fn call_counters_stand_alone() {
    let c = CallCounters::new();
    for call in Call::ALL {
        c.record(call);
    }
    c.record(Call::Map);
    assert_eq!(c.get(Call::Map), 2);
    assert_eq!(c.total(), Call::ALL.len() as u64 + 1);
    c.reset();
    assert_eq!(c.total(), 0);
}

#[test]
fn log_calls_writes_one_line_per_call() {
    let dev = LogCalls::new(SimDevice::with_capacity(1 << 30));
    let a = dev.malloc(2 * MIB).unwrap();
    let _ = dev.free(a, 1);
    let e = dev.create_event().unwrap();
    dev.record_event(e, StreamId(0x10)).unwrap();
    let lines = dev.lines();
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[0], "malloc(2097152) -> Ok(0x700000000000)");
    assert!(
        lines[1].starts_with("free(0x700000000000, 1) -> Err("),
        "{}",
        lines[1]
    );
    assert!(
        lines[2].starts_with("create_event() -> Ok("),
        "{}",
        lines[2]
    );
    assert!(lines[3].starts_with("record_event("), "{}", lines[3]);
    assert_eq!(dev.take_lines().len(), 4);
    assert!(dev.lines().is_empty());
}

/// A writer whose bytes the test can still read after handing it over.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn log_calls_can_write_to_a_writer() {
    let out = Shared::default();
    let dev = LogCalls::with_writer(SimDevice::with_capacity(MIB), Box::new(out.clone()));
    assert!(is_oom(dev.malloc(2 * MIB)));
    dev.reserve(G).unwrap();
    let text = String::from_utf8(out.0.lock().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    assert!(
        lines[0].starts_with("malloc(2097152) -> Err("),
        "{}",
        lines[0]
    );
    assert_eq!(lines[1], "reserve(2097152) -> Ok(0x7f0000000000)");
    assert!(dev.lines().is_empty());
}

#[test]
fn wrappers_stack() {
    let inner = sim();
    let dev = LogCalls::new(Limit::new(
        FailCalls::new(CountCalls::new(Arc::clone(&inner))),
        4 * MIB,
    ));
    let fail = dev.inner().inner();
    let count = fail.inner();
    let a = dev.malloc(MIB).unwrap();
    fail.fail_next();
    assert!(is_oom(dev.malloc(MIB)));
    assert!(is_oom(dev.malloc(4 * MIB)), "over the limit");
    assert_eq!(count.calls(Call::Malloc), 1, "only one malloc got through");
    assert_eq!(dev.inner().outstanding_bytes(), MIB);
    dev.free(a, MIB).unwrap();
    assert_eq!(count.outstanding_bytes(), 0);
    assert_eq!(dev.lines().len(), 4);
    assert_eq!(dev.ordinal(), 0);
    assert_eq!(dev.granularity().unwrap(), G);
    inner.check_invariants();
}
