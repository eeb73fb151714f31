//! Tests of [`SimDevice`]'s graph capture against the rules in `sim/capture.rs`.
//!
//! Invariants checked here (every test ends with `check_invariants()`):
//! - in each mode, a call made during a capture is refused with driver code 900 exactly when
//!   `CaptureMode::forbids` says so, from the capturing thread and from another one;
//! - a refused call invalidates the captures that forbid it, changes nothing else (no memory,
//!   no completed work, no consumed fault), and invalidated captures keep refusing;
//! - `end_capture` fails with code 901 naming the first refused call, and refuses a stream that
//!   is not being captured; `is_capturing` is true from begin to end and is a counted call;
//! - an event recorded on a capturing stream submits no work and is refused by `query_event`
//!   and `synchronize_event` (code 1, `CAPTURED_EVENT`) until it is recorded again outside a capture.

use std::os::fd::AsFd;

use cudalloc_sys::wrap::{CountCalls, LogCalls};
use cudalloc_sys::{
    Call, CaptureMode, Device, DeviceError, DevicePtr, EventHandle, PageHandle, SimDevice,
    StreamId, CAPTURED_EVENT, CAPTURE_INVALIDATED,
};

const G: u64 = 2 << 20;
const CAPTURED: StreamId = StreamId(0x10);
const OTHER: StreamId = StreamId(0x20);

/// A device holding one of everything a call can act on, made before the capture begins.
struct Fixture {
    dev: SimDevice,
    shareable_page: PageHandle,
    exported: std::os::fd::OwnedFd,
    segment: DevicePtr,
    spare_va: DevicePtr,
    spare_page: PageHandle,
    mapped_va: DevicePtr,
    free_page: PageHandle,
    map_at: DevicePtr,
    /// Recorded on `OTHER`, whose work is pending (auto-complete is off).
    pending: EventHandle,
    spare_event: EventHandle,
    /// Pinned host memory of `G` bytes, and a spare buffer and stream to release.
    host: u64,
    spare_host: u64,
    spare_stream: StreamId,
}

fn fixture() -> Fixture {
    let dev = SimDevice::with_capacity(1 << 30);
    dev.set_auto_complete(false);
    let segment = dev.malloc(G).unwrap();
    let spare_va = dev.reserve(G).unwrap();
    let spare_page = dev.create_page(G).unwrap();
    let mapped_va = dev.reserve(2 * G).unwrap();
    let page = dev.create_page(G).unwrap();
    dev.map(mapped_va, G, page).unwrap();
    let free_page = dev.create_page(G).unwrap();
    let pending = dev.create_event().unwrap();
    dev.record_event(pending, OTHER).unwrap();
    let spare_event = dev.create_event().unwrap();
    let (host, spare_host) = (dev.alloc_host(G).unwrap(), dev.alloc_host(G).unwrap());
    let spare_stream = dev.open_stream().unwrap();
    let shareable_page = dev.create_shareable_page(G).unwrap();
    let exported = dev.export_page(shareable_page).unwrap();
    Fixture {
        shareable_page,
        exported,
        host,
        spare_host,
        spare_stream,
        segment,
        spare_va,
        spare_page,
        map_at: mapped_va + G,
        mapped_va,
        free_page,
        pending,
        spare_event,
        dev,
    }
}

/// Makes one call of kind `call` on the fixture.
fn probe(f: &Fixture, call: Call) -> Result<(), DeviceError> {
    let dev = &f.dev;
    match call {
        Call::Malloc => dev.malloc(G).map(drop),
        Call::Free => dev.free(f.segment, G),
        Call::Reserve => dev.reserve(G).map(drop),
        Call::Unreserve => dev.unreserve(f.spare_va, G),
        Call::CreatePage => dev.create_page(G).map(drop),
        Call::ReleasePage => dev.release_page(f.spare_page),
        Call::Map => dev.map(f.map_at, G, f.free_page),
        Call::Unmap => dev.unmap(f.mapped_va, G),
        Call::SetAccess => dev.set_access(f.mapped_va, G, &[]),
        Call::CreateEvent => dev.create_event().map(drop),
        Call::DestroyEvent => dev.destroy_event(f.spare_event),
        Call::RecordEvent => dev.record_event(f.spare_event, CAPTURED),
        Call::QueryEvent => dev.query_event(f.pending).map(drop),
        Call::SynchronizeEvent => dev.synchronize_event(f.pending),
        Call::SynchronizeDevice => dev.synchronize_device(),
        Call::MemInfo => dev.mem_info().map(drop),
        Call::CaptureStatus => dev.is_capturing(CAPTURED).map(drop),
        Call::AllocHost => dev.alloc_host(G).map(drop),
        Call::FreeHost => dev.free_host(f.spare_host, G),
        Call::CopyToHostAsync => dev.copy_to_host_async(f.host, f.segment, 4096, OTHER),
        Call::CopyToDeviceAsync => dev.copy_to_device_async(f.segment, f.host, 4096, OTHER),
        Call::CopyDeviceAsync => dev.copy_device_async(f.segment + 4096, f.segment, 4096, OTHER),
        Call::OpenStream => dev.open_stream().map(drop),
        Call::CloseStream => dev.close_stream(f.spare_stream),
        Call::WaitEvent => dev.wait_event(OTHER, f.pending),
        Call::ExportPage => dev.export_page(f.shareable_page).map(drop),
        Call::ImportPage => dev.import_page(f.exported.as_fd(), G).map(drop),
    }
}

/// Runs `call` during a capture in `mode`, from the capturing thread or another one, and
/// checks the outcome, the invalidation and the end against `CaptureMode::forbids`.
fn check_rule(mode: CaptureMode, call: Call, same_thread: bool) {
    let f = fixture();
    f.dev.begin_capture(CAPTURED, mode).unwrap();
    let result = if same_thread {
        probe(&f, call)
    } else {
        std::thread::scope(|scope| scope.spawn(|| probe(&f, call)).join().unwrap())
    };
    let case = format!("{} {:?} same thread {same_thread}", mode.name(), call);
    let refused = mode.forbids(call, same_thread);
    match &result {
        Err(e) if refused => assert!(e.is_capture_unsupported(), "{case}: {e}"),
        Ok(()) if !refused => {}
        other => panic!("{case}: {other:?}"),
    }
    assert!(f.dev.is_capturing(CAPTURED).unwrap(), "{case}");
    let end = f.dev.end_capture(CAPTURED);
    assert_eq!(end.is_err(), refused, "{case}: {end:?}");
    assert!(!f.dev.is_capturing(CAPTURED).unwrap(), "{case}");
    f.dev.check_invariants();
}

#[test]
fn each_mode_refuses_what_forbids_says_on_the_capturing_thread() {
    for mode in CaptureMode::ALL {
        for call in Call::ALL {
            check_rule(mode, call, true);
        }
    }
}

#[test]
fn each_mode_refuses_what_forbids_says_on_other_threads() {
    for mode in CaptureMode::ALL {
        for call in Call::ALL {
            check_rule(mode, call, false);
        }
    }
}

#[test]
fn the_rules_are_the_measured_ones() {
    let refused = [
        Call::Malloc,
        Call::Free,
        Call::QueryEvent,
        Call::SynchronizeEvent,
        Call::SynchronizeDevice,
        // Taken to be refused like `malloc` and `free`: the GPU probe of `tests/cuda.rs` says.
        Call::AllocHost,
        Call::FreeHost,
    ];
    for call in Call::ALL {
        let unsafe_call = refused.contains(&call);
        assert_eq!(CaptureMode::Global.forbids(call, true), unsafe_call);
        assert_eq!(CaptureMode::Global.forbids(call, false), unsafe_call);
        assert_eq!(CaptureMode::ThreadLocal.forbids(call, true), unsafe_call);
        let sync = call == Call::SynchronizeDevice;
        assert_eq!(CaptureMode::ThreadLocal.forbids(call, false), sync);
        assert_eq!(CaptureMode::Relaxed.forbids(call, true), sync);
        assert_eq!(CaptureMode::Relaxed.forbids(call, false), sync);
    }
}

#[test]
fn a_refused_call_changes_nothing() {
    let f = fixture();
    let dev = &f.dev;
    dev.fail_next();
    dev.begin_capture(CAPTURED, CaptureMode::Global).unwrap();
    let (mallocs, bytes) = (dev.live_mallocs(), dev.malloc_bytes());
    for call in [Call::Malloc, Call::Free, Call::SynchronizeDevice] {
        let err = probe(&f, call).unwrap_err();
        assert!(err.is_capture_unsupported(), "{err}");
    }
    for call in [Call::QueryEvent, Call::SynchronizeEvent] {
        assert!(probe(&f, call).unwrap_err().is_capture_unsupported());
    }
    assert_eq!((dev.live_mallocs(), dev.malloc_bytes()), (mallocs, bytes));
    dev.end_capture(CAPTURED).unwrap_err();
    // The fault armed before the capture was not consumed by the refused calls.
    let err = dev.malloc(G).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    // Nothing completed: the event on OTHER is still pending.
    assert!(!dev.query_event(f.pending).unwrap());
    dev.free(f.segment, G).unwrap();
    dev.check_invariants();
}

#[test]
fn an_invalidated_capture_keeps_refusing_and_its_end_names_the_call() {
    let f = fixture();
    let dev = &f.dev;
    dev.begin_capture(CAPTURED, CaptureMode::ThreadLocal)
        .unwrap();
    assert!(probe(&f, Call::QueryEvent).is_err());
    assert!(
        dev.is_capturing(CAPTURED).unwrap(),
        "invalidated, not ended"
    );
    assert!(probe(&f, Call::Malloc)
        .unwrap_err()
        .is_capture_unsupported());
    // Calls the mode allows still succeed.
    let va = dev.reserve(G).unwrap();
    dev.unreserve(va, G).unwrap();
    match dev.end_capture(CAPTURED) {
        Err(DeviceError::Driver { code, message, .. }) => {
            assert_eq!(code, CAPTURE_INVALIDATED);
            assert!(message.contains("query_event"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!dev.is_capturing(CAPTURED).unwrap());
    dev.malloc(G).unwrap();
    dev.check_invariants();
}

#[test]
fn a_refused_call_invalidates_only_the_captures_that_forbid_it() {
    let f = fixture();
    let dev = &f.dev;
    let local = StreamId(0x30);
    dev.begin_capture(CAPTURED, CaptureMode::Global).unwrap();
    std::thread::scope(|scope| {
        let begin = || dev.begin_capture(local, CaptureMode::ThreadLocal);
        scope.spawn(begin).join().unwrap().unwrap();
    });
    // The global capture refuses a malloc of this thread; the other thread's does not.
    assert!(dev.malloc(G).is_err());
    dev.end_capture(CAPTURED).unwrap_err();
    dev.end_capture(local).unwrap();
    // synchronize_device is refused by every capture, and invalidates them all.
    dev.begin_capture(CAPTURED, CaptureMode::Relaxed).unwrap();
    dev.begin_capture(local, CaptureMode::ThreadLocal).unwrap();
    assert!(dev
        .synchronize_device()
        .unwrap_err()
        .is_capture_unsupported());
    dev.end_capture(CAPTURED).unwrap_err();
    dev.end_capture(local).unwrap_err();
    dev.synchronize_device().unwrap();
    dev.check_invariants();
}

#[test]
fn begin_and_end_refuse_bad_streams() {
    let dev = SimDevice::with_capacity(1 << 30);
    let invalid =
        |r: Result<(), DeviceError>| matches!(r, Err(DeviceError::InvalidArgument { .. }));
    assert!(invalid(dev.end_capture(CAPTURED)));
    assert!(invalid(
        dev.begin_capture(StreamId::DEFAULT, CaptureMode::Relaxed)
    ));
    assert!(invalid(
        dev.begin_capture(StreamId(1), CaptureMode::Relaxed)
    ));
    dev.add_foreign_stream(OTHER);
    assert!(invalid(dev.begin_capture(OTHER, CaptureMode::Global)));
    dev.begin_capture(CAPTURED, CaptureMode::Global).unwrap();
    assert!(invalid(dev.begin_capture(CAPTURED, CaptureMode::Relaxed)));
    dev.end_capture(CAPTURED).unwrap();
    assert!(invalid(dev.end_capture(CAPTURED)));
    assert!(!dev.is_capturing(StreamId(0x99)).unwrap());
    dev.check_invariants();
}

#[test]
fn an_event_recorded_in_a_capture_is_refused_until_recorded_again() {
    let dev = SimDevice::with_capacity(1 << 30);
    dev.set_auto_complete(false);
    let event = dev.create_event().unwrap();
    dev.begin_capture(CAPTURED, CaptureMode::Relaxed).unwrap();
    dev.record_event(event, CAPTURED).unwrap();
    let code = |r: Result<(), DeviceError>| match r {
        Err(DeviceError::Driver { code, .. }) => code,
        other => panic!("{other:?}"),
    };
    assert_eq!(code(dev.query_event(event).map(drop)), CAPTURED_EVENT);
    dev.end_capture(CAPTURED).unwrap();
    assert_eq!(code(dev.query_event(event).map(drop)), CAPTURED_EVENT);
    assert_eq!(code(dev.synchronize_event(event)), CAPTURED_EVENT);
    // The record submitted no work: a record outside the capture is the stream's first.
    dev.record_event(event, CAPTURED).unwrap();
    assert!(!dev.query_event(event).unwrap());
    dev.complete_stream(CAPTURED);
    assert!(dev.query_event(event).unwrap());
    // Destroying a captured event forgets it.
    dev.begin_capture(CAPTURED, CaptureMode::Global).unwrap();
    dev.record_event(event, CAPTURED).unwrap();
    dev.destroy_event(event).unwrap();
    dev.end_capture(CAPTURED).unwrap();
    dev.check_invariants();
}

#[test]
fn is_capturing_is_counted_forwarded_and_logged() {
    let dev = CountCalls::new(LogCalls::new(SimDevice::default()));
    dev.inner()
        .inner()
        .begin_capture(CAPTURED, CaptureMode::Global)
        .unwrap();
    assert!(dev.is_capturing(CAPTURED).unwrap());
    assert!(!dev.is_capturing(OTHER).unwrap());
    assert_eq!(dev.calls(Call::CaptureStatus), 2);
    assert_eq!(dev.inner().inner().calls(Call::CaptureStatus), 2);
    let lines = dev.inner().lines();
    assert_eq!(lines[0], "is_capturing(stream 0x10) -> Ok(true)");
    let arc = std::sync::Arc::new(SimDevice::default());
    assert!(!arc.is_capturing(CAPTURED).unwrap());
}

#[test]
fn the_capture_error_is_recognised() {
    let err = DeviceError::capture_unsupported("malloc");
    assert!(err.is_capture_unsupported());
    assert_eq!(
        err.to_string(),
        "malloc: driver error 900: operation not permitted when stream is capturing"
    );
    let other = DeviceError::Driver {
        call: "malloc",
        code: 999,
        message: "injected fault".into(),
    };
    assert!(!other.is_capture_unsupported());
    assert!(!DeviceError::invalid("malloc", "zero").is_capture_unsupported());
}
