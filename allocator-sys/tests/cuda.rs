//! Tests of [`CudaDevice`] against the real driver.
//!
//! `driver_presence_decides_new` runs everywhere. The rest need a CUDA GPU and are ignored by
//! default: `cargo test -p cudalloc-sys --test cuda -- --ignored`. They share device 0 and compare
//! free memory, so they take a lock and run one at a time.
//!
//! The capture tests pin the simulated device's capture rules (`CaptureMode::forbids`, and
//! the error of an event recorded in a capture) to the driver; `capture_rules_match_the_sim` prints a
//! table of call x mode x thread -> ok/900 (run with `-- --ignored --nocapture` to see it).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use cudalloc_sys::{
    Call, CaptureMode, CudaDevice, Device, DeviceError, EventHandle, PageHandle, StreamId,
    CAPTURED_EVENT, CAPTURE_INVALIDATED, MALLOC_ALIGNMENT,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

static GPU: Mutex<()> = Mutex::new(());

/// Device 0, with the lock that keeps GPU tests apart.
fn gpu() -> (MutexGuard<'static, ()>, CudaDevice) {
    let guard = GPU.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let dev = CudaDevice::new(0).expect("CUDA device 0");
    (guard, dev)
}

/// `len` bytes that differ from their neighbours and from another `seed`'s bytes.
fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ seed)
        .collect()
}

/// Reads `len` bytes at `ptr` back from the device.
fn read(dev: &CudaDevice, ptr: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0; len as usize];
    dev.copy_from_device(ptr, &mut out)
        .expect("copy from device");
    out
}

fn assert_invalid<T: std::fmt::Debug>(result: Result<T, DeviceError>) {
    match result {
        Err(DeviceError::InvalidArgument { .. }) => {}
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn driver_presence_decides_new() {
    // SAFETY: this only tries to open the candidate library names and closes them again.
    let present = unsafe { cudarc::driver::sys::is_culib_present() };
    let opened = std::panic::catch_unwind(|| CudaDevice::new(0)).expect("new must not panic");
    if present {
        opened.expect("libcuda is present, so device 0 should open");
        return;
    }
    assert!(
        matches!(opened, Err(DeviceError::Unavailable(_))),
        "{opened:?}"
    );
    // Every later call answers the same, from the cached outcome.
    assert!(matches!(
        CudaDevice::new(0),
        Err(DeviceError::Unavailable(_))
    ));
    assert!(matches!(
        CudaDevice::device_count(),
        Err(DeviceError::Unavailable(_))
    ));
    assert!(matches!(
        CudaDevice::can_access_peer(0, 1),
        Err(DeviceError::Unavailable(_))
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn malloc_write_read_free() {
    let (_lock, dev) = gpu();
    for (seed, size) in [4, KIB, MIB, GIB].into_iter().enumerate() {
        let ptr = dev.malloc(size).expect("malloc");
        assert_eq!(ptr % MALLOC_ALIGNMENT, 0, "{size} bytes at {ptr:#x}");
        let data = pattern(size, seed as u8);
        dev.copy_to_device(ptr, &data).expect("copy to device");
        assert!(
            read(&dev, ptr, size) == data,
            "{size} bytes read back differ"
        );
        assert_invalid(dev.free(ptr, size + 1));
        dev.free(ptr, size).expect("free");
        assert_invalid(dev.free(ptr, size));
    }
    assert_invalid(dev.malloc(0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn malloc_beyond_total_is_out_of_memory() {
    let (_lock, dev) = gpu();
    let (_, total) = dev.mem_info().expect("mem_info");
    let err = dev
        .malloc(total + GIB)
        .expect_err("more than the device has");
    assert!(err.is_out_of_memory(), "{err:?}");
    // The failure is not sticky.
    let ptr = dev.malloc(MIB).expect("malloc after out-of-memory");
    dev.free(ptr, MIB).expect("free");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn granularity_is_a_cached_power_of_two() {
    let (_lock, dev) = gpu();
    let g = dev.granularity().expect("granularity");
    assert!(g.is_power_of_two(), "{g}");
    assert_eq!(dev.granularity().unwrap(), g);
    assert!(CudaDevice::device_count().unwrap() >= 1);
    assert_eq!(dev.ordinal(), 0);
}

/// Creates `count` pages of `g` bytes and maps page `i` at `va + i * g`.
fn map_pages(dev: &CudaDevice, va: u64, g: u64, count: u64) -> Vec<PageHandle> {
    let pages: Vec<_> = (0..count)
        .map(|_| dev.create_page(g).expect("page"))
        .collect();
    for (i, page) in (0..).zip(&pages) {
        dev.map(va + i * g, g, *page).expect("map");
    }
    pages
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_map_write_remap_release() {
    let (_lock, dev) = gpu();
    let g = dev.granularity().unwrap();
    let span = (64 * MIB).max(16 * g);
    let va = dev.reserve(span).expect("reserve");
    let pages = map_pages(&dev, va, g, 8);
    dev.set_access(va, 8 * g, &[]).expect("set_access");

    let data = pattern(8 * g, 7);
    dev.copy_to_device(va, &data).expect("write across pages");
    assert!(read(&dev, va, 8 * g) == data);
    let straddle = va + 3 * g - 100;
    assert!(read(&dev, straddle, 200) == data[(3 * g - 100) as usize..(3 * g + 100) as usize]);

    // Broken preconditions are rejected before the driver sees them.
    assert_invalid(dev.unreserve(va, span));
    assert_invalid(dev.map(va + 3 * g, g, pages[0]));

    // Move page 3 to slot 10: its contents travel with it.
    dev.unmap(va + 3 * g, g).expect("unmap");
    assert_invalid(dev.unmap(va + 3 * g, g));
    let slot = va + 10 * g;
    dev.map(slot, g, pages[3]).expect("remap");
    dev.set_access(slot, g, &[]).expect("set_access again");
    assert!(read(&dev, slot, g) == data[(3 * g) as usize..(4 * g) as usize]);
    assert!(read(&dev, va + 4 * g, g) == data[(4 * g) as usize..(5 * g) as usize]);

    dev.unmap(slot, g).expect("unmap moved page");
    for i in (0..8).filter(|&i| i != 3) {
        dev.unmap(va + i * g, g).expect("unmap");
    }
    for page in &pages {
        dev.release_page(*page).expect("release");
    }
    assert_invalid(dev.release_page(pages[0]));
    dev.unreserve(va, span).expect("unreserve");
    assert_invalid(dev.unreserve(va, span));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vmm_misaligned_arguments_are_invalid() {
    let (_lock, dev) = gpu();
    let g = dev.granularity().unwrap();
    assert_invalid(dev.reserve(g + 1));
    assert_invalid(dev.reserve(0));
    assert_invalid(dev.create_page(g / 2));
    let va = dev.reserve(4 * g).expect("reserve");
    let page = dev.create_page(g).expect("page");
    assert_invalid(dev.map(va + 4 * KIB, g, page));
    assert_invalid(dev.map(va, 2 * g, page));
    assert_invalid(dev.map(va + 4 * g, g, page)); // past the reservation
    dev.map(va, g, page).expect("aligned map");
    assert_invalid(dev.set_access(va + 4 * KIB, g, &[]));
    assert_invalid(dev.set_access(va, 2 * g, &[])); // second granule is not mapped
    assert_invalid(dev.unmap(va, g / 2));
    dev.unmap(va, g).expect("unmap");
    dev.release_page(page).expect("release");
    dev.unreserve(va, 4 * g).expect("unreserve");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn events_follow_stream_work() {
    let (_lock, dev) = gpu();
    let stream = dev.create_stream().expect("stream");
    let event = dev.create_event().expect("event");
    let buf = dev.malloc(GIB).expect("malloc");
    dev.memset_async(buf, 0xAB, GIB, stream).expect("memset");
    dev.record_event(event, stream).expect("record");
    let _maybe_done = dev.query_event(event).expect("query");
    dev.synchronize_event(event).expect("synchronize");
    assert!(dev.query_event(event).unwrap());
    assert_eq!(read(&dev, buf + GIB - 16, 16), vec![0xAB; 16]);

    // Pooled events are recorded again, also on the legacy default stream.
    dev.record_event(event, StreamId::DEFAULT)
        .expect("record again");
    dev.synchronize_event(event).expect("synchronize again");
    assert!(dev.query_event(event).unwrap());
    dev.synchronize().expect("synchronize context");

    dev.destroy_event(event).expect("destroy");
    assert_invalid(dev.destroy_event(event));
    assert_invalid(dev.query_event(event));
    dev.destroy_stream(stream).expect("destroy stream");
    assert_invalid(dev.destroy_stream(stream));
    dev.free(buf, GIB).expect("free");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn calls_work_from_any_thread() {
    let (_lock, dev) = gpu();
    let dev = Arc::new(dev);
    let ptrs: Vec<u64> = (0..4u8)
        .map(|seed| {
            let dev = Arc::clone(&dev);
            std::thread::spawn(move || {
                let ptr = dev.malloc(MIB).unwrap();
                dev.copy_to_device(ptr, &pattern(MIB, seed)).unwrap();
                ptr
            })
        })
        .map(|thread| thread.join().unwrap())
        .collect();
    std::thread::scope(|scope| {
        for (seed, ptr) in (0..).zip(&ptrs) {
            let dev = &dev;
            scope.spawn(move || {
                assert!(read(dev, *ptr, MIB) == pattern(MIB, seed));
                dev.free(*ptr, MIB).unwrap();
            });
        }
    });
}

/// A call leaves the caller's current context as it found it: none on a fresh thread (which
/// then still has none), ours when ours was current (nothing to restore); making and dropping a
/// device on a fresh thread leave none current too.
#[test]
#[ignore = "needs a CUDA GPU"]
fn calls_leave_the_callers_context_as_they_found_it() {
    use cudarc::driver::result::ctx::get_current;
    let (_lock, dev) = gpu();
    let dev = Arc::new(dev);
    let d = Arc::clone(&dev);
    std::thread::spawn(move || {
        let ours = d.context().cu_ctx();
        assert_eq!(
            get_current().unwrap(),
            None,
            "a fresh thread has no context"
        );
        let ptr = d.malloc(MIB).unwrap();
        d.copy_to_device(ptr, &pattern(MIB, 3)).unwrap();
        assert_eq!(
            get_current().unwrap(),
            None,
            "malloc and a copy made theirs current"
        );
        let stream = d.create_stream().unwrap();
        d.wait_stream(stream).unwrap();
        d.destroy_stream(stream).unwrap();
        d.free(ptr, MIB).unwrap();
        assert_eq!(
            get_current().unwrap(),
            None,
            "a stream's calls made theirs current"
        );
        let again = CudaDevice::new(0).unwrap();
        assert_eq!(get_current().unwrap(), None, "new made its context current");
        drop(again);
        assert_eq!(
            get_current().unwrap(),
            None,
            "a drop made its context current"
        );
        d.context().bind_to_thread().unwrap();
        let ptr = d.malloc(MIB).unwrap();
        d.free(ptr, MIB).unwrap();
        assert_eq!(
            get_current().unwrap(),
            Some(ours),
            "our own context stays current"
        );
    })
    .join()
    .unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn free_memory_returns_to_baseline() {
    let (_lock, dev) = gpu();
    dev.synchronize().unwrap();
    let (baseline, _) = dev.mem_info().unwrap();
    let g = dev.granularity().unwrap();

    let ptrs: Vec<u64> = (0..8).map(|_| dev.malloc(256 * MIB).unwrap()).collect();
    let span = (64 * MIB).max(8 * g);
    let va = dev.reserve(span).unwrap();
    let pages = map_pages(&dev, va, g, 8);
    dev.set_access(va, 8 * g, &[]).unwrap();
    let event = dev.create_event().unwrap();
    let (during, _) = dev.mem_info().unwrap();
    assert!(during + 2 * GIB <= baseline, "{during} free of {baseline}");

    dev.destroy_event(event).unwrap();
    for i in 0..8 {
        dev.unmap(va + i * g, g).unwrap();
    }
    pages
        .iter()
        .for_each(|page| dev.release_page(*page).unwrap());
    dev.unreserve(va, span).unwrap();
    ptrs.iter()
        .for_each(|ptr| dev.free(*ptr, 256 * MIB).unwrap());
    dev.synchronize().unwrap();
    let (after, _) = dev.mem_info().unwrap();
    assert!(
        after.abs_diff(baseline) <= 64 * MIB,
        "{after} free, {baseline} before"
    );
}

#[test]
#[ignore = "needs two CUDA GPUs with peer access"]
fn peers_read_vmm_memory() {
    let (_lock, dev) = gpu();
    assert!(
        CudaDevice::device_count().unwrap() >= 2 && CudaDevice::can_access_peer(1, 0).unwrap(),
        "this test needs two GPUs where device 1 can access device 0"
    );
    let peer = CudaDevice::new(1).expect("CUDA device 1");
    dev.enable_peer_access(&peer).expect("enable");
    dev.enable_peer_access(&peer).expect("enable again is Ok");
    let g = dev.granularity().unwrap();
    let va = dev.reserve(g).unwrap();
    let page = dev.create_page(g).unwrap();
    dev.map(va, g, page).unwrap();
    dev.set_access(va, g, &[1, 0, 1])
        .expect("set_access with peers");
    let data = pattern(g, 3);
    dev.copy_to_device(va, &data).unwrap();
    assert!(read(&peer, va, g) == data, "device 1 reads device 0's page");
    dev.unmap(va, g).unwrap();
    dev.release_page(page).unwrap();
    dev.unreserve(va, g).unwrap();
}

// ---- graph capture: the driver against `CaptureMode::forbids`, the simulated device's rules ----

/// What one probed call leaves behind to release once the capture has ended.
enum Leftover {
    Nothing,
    Ptr(u64),
    Va(u64),
    Page(PageHandle),
    Event(EventHandle),
    Host(u64),
    Stream(StreamId),
}

/// One of everything a call can act on, made before a capture begins.
struct Fixture<'a> {
    dev: &'a CudaDevice,
    g: u64,
    captured: StreamId,
    other: StreamId,
    segment: u64,
    spare_va: u64,
    spare_page: PageHandle,
    /// Reserved for two pages; the first is mapped (`mapped_page`), the second free.
    va: u64,
    mapped_page: PageHandle,
    free_page: PageHandle,
    /// Recorded on `other` (not the captured stream).
    recorded: EventHandle,
    spare_event: EventHandle,
    /// Pinned host memory of `g` bytes: copied to and from `segment`.
    host: u64,
    spare_host: u64,
    spare_stream: StreamId,
    /// A shareable page and a descriptor exported from it.
    shareable_page: PageHandle,
    exported: OwnedFd,
}

impl<'a> Fixture<'a> {
    fn new(dev: &'a CudaDevice) -> Self {
        let g = dev.granularity().unwrap();
        let (captured, other) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let va = dev.reserve(2 * g).unwrap();
        let mapped_page = dev.create_page(g).unwrap();
        dev.map(va, g, mapped_page).unwrap();
        let recorded = dev.create_event().unwrap();
        dev.record_event(recorded, other).unwrap();
        let shareable_page = dev.create_shareable_page(g).unwrap();
        let exported = dev.export_page(shareable_page).unwrap();
        Fixture {
            shareable_page,
            exported,
            dev,
            g,
            captured,
            other,
            segment: dev.malloc(g).unwrap(),
            spare_va: dev.reserve(g).unwrap(),
            spare_page: dev.create_page(g).unwrap(),
            va,
            mapped_page,
            free_page: dev.create_page(g).unwrap(),
            recorded,
            spare_event: dev.create_event().unwrap(),
            host: dev.alloc_host(g).unwrap(),
            spare_host: dev.alloc_host(g).unwrap(),
            spare_stream: dev.open_stream().unwrap(),
        }
    }

    /// Makes one call of kind `call`.
    fn probe(&self, call: Call) -> Result<Leftover, DeviceError> {
        use Leftover::*;
        let (dev, g) = (self.dev, self.g);
        Ok(match call {
            Call::Malloc => Ptr(dev.malloc(g)?),
            Call::Free => dev.free(self.segment, g).map(|()| Nothing)?,
            Call::Reserve => Va(dev.reserve(g)?),
            Call::Unreserve => dev.unreserve(self.spare_va, g).map(|()| Nothing)?,
            Call::CreatePage => Page(dev.create_page(g)?),
            Call::ReleasePage => dev.release_page(self.spare_page).map(|()| Nothing)?,
            Call::Map => dev.map(self.va + g, g, self.free_page).map(|()| Nothing)?,
            Call::Unmap => dev.unmap(self.va, g).map(|()| Nothing)?,
            Call::SetAccess => dev.set_access(self.va, g, &[]).map(|()| Nothing)?,
            Call::CreateEvent => Event(dev.create_event()?),
            Call::DestroyEvent => dev.destroy_event(self.spare_event).map(|()| Nothing)?,
            Call::RecordEvent => dev
                .record_event(self.spare_event, self.captured)
                .map(|()| Nothing)?,
            Call::QueryEvent => dev.query_event(self.recorded).map(|_| Nothing)?,
            Call::SynchronizeEvent => dev.synchronize_event(self.recorded).map(|()| Nothing)?,
            Call::SynchronizeDevice => dev.synchronize_device().map(|()| Nothing)?,
            Call::MemInfo => dev.mem_info().map(|_| Nothing)?,
            Call::CaptureStatus => dev.is_capturing(self.captured).map(|_| Nothing)?,
            Call::AllocHost => Host(dev.alloc_host(g)?),
            Call::FreeHost => dev.free_host(self.spare_host, g).map(|()| Nothing)?,
            Call::CopyToHostAsync => dev
                .copy_to_host_async(self.host, self.segment, 4096, self.other)
                .map(|()| Nothing)?,
            Call::CopyToDeviceAsync => dev
                .copy_to_device_async(self.segment, self.host, 4096, self.other)
                .map(|()| Nothing)?,
            Call::CopyDeviceAsync => dev
                .copy_device_async(self.segment + 4096, self.segment, 4096, self.other)
                .map(|()| Nothing)?,
            Call::OpenStream => Stream(dev.open_stream()?),
            Call::CloseStream => dev.close_stream(self.spare_stream).map(|()| Nothing)?,
            Call::WaitEvent => dev
                .wait_event(self.other, self.recorded)
                .map(|()| Nothing)?,
            Call::ExportPage => dev.export_page(self.shareable_page).map(|_| Nothing)?,
            Call::ImportPage => Page(dev.import_page(self.exported.as_fd(), g)?),
        })
    }

    /// Releases what the probe left and everything the fixture still holds (releases of what
    /// a probe already released are refused by the bookkeeping and ignored).
    fn release(self, left: Option<Leftover>) {
        let (dev, g) = (self.dev, self.g);
        let _ = match left {
            Some(Leftover::Ptr(p)) => dev.free(p, g),
            Some(Leftover::Va(va)) => dev.unreserve(va, g),
            Some(Leftover::Page(page)) => dev.release_page(page),
            Some(Leftover::Event(event)) => dev.destroy_event(event),
            Some(Leftover::Host(p)) => dev.free_host(p, g),
            Some(Leftover::Stream(st)) => dev.close_stream(st),
            Some(Leftover::Nothing) | None => Ok(()),
        };
        let _ = dev.free(self.segment, g);
        let _ = dev.unreserve(self.spare_va, g);
        let _ = dev.release_page(self.spare_page);
        let _ = dev.unmap(self.va, g);
        let _ = dev.unmap(self.va + g, g);
        for page in [self.mapped_page, self.free_page, self.shareable_page] {
            dev.release_page(page).unwrap();
        }
        dev.unreserve(self.va, 2 * g).unwrap();
        dev.synchronize().unwrap();
        for event in [self.recorded, self.spare_event] {
            let _ = dev.destroy_event(event);
        }
        dev.destroy_stream(self.captured).unwrap();
        dev.destroy_stream(self.other).unwrap();
        let _ = dev.close_stream(self.spare_stream);
        for p in [self.host, self.spare_host] {
            let _ = dev.free_host(p, g);
        }
    }
}

/// A call's outcome as the table shows it: `ok`, `900`, or another error in full.
fn outcome<T>(result: &Result<T, DeviceError>) -> String {
    match result {
        Ok(_) => "ok".into(),
        Err(e) if e.is_capture_unsupported() => "900".into(),
        Err(e) => format!("error: {e}"),
    }
}

/// Probes `call` during a capture in `mode` from the capturing thread or another, prints one
/// line of the table, and returns a description of each way the driver differed from
/// `CaptureMode::forbids` (the simulated device's rules).
fn probe_capture(
    dev: &CudaDevice,
    mode: CaptureMode,
    call: Call,
    same_thread: bool,
) -> Vec<String> {
    let f = Fixture::new(dev);
    f.dev
        .begin_capture(f.captured, mode)
        .expect("begin capture");
    let run = || {
        let first = f.probe(call);
        // An invalidated capture is still underway: the sim refuses the call again.
        let again = first.as_ref().err().map(|_| f.probe(call));
        let capturing = f.dev.is_capturing(f.captured);
        (first, again, capturing)
    };
    let (first, again, capturing) = match same_thread {
        true => run(),
        false => std::thread::scope(|s| s.spawn(run).join().unwrap()),
    };
    let end = f.dev.end_capture(f.captured);
    let after = f.dev.is_capturing(f.captured);
    let expected = if mode.forbids(call, same_thread) {
        "900"
    } else {
        "ok"
    };
    let got = outcome(&first);
    let again_shown = again.as_ref().map(outcome).unwrap_or_default();
    let thread = if same_thread { "same" } else { "other" };
    let mut wrong = Vec::new();
    let case = format!("{:<18} {:<12} {thread:<5}", call.name(), mode.name());
    if got != expected || again.as_ref().is_some_and(|a| outcome(a) != "900") {
        wrong.push(format!(
            "{case}: {got} then {again_shown:?}, sim says {expected}"
        ));
    }
    let end_code = match &end {
        Err(DeviceError::Driver { code, .. }) => Some(*code),
        _ => None,
    };
    let end_expected = (expected == "900").then_some(CAPTURE_INVALIDATED);
    if end_code != end_expected || (end.is_err() && end_code.is_none()) {
        wrong.push(format!(
            "{case}: end_capture {end:?}, sim expects code {end_expected:?}"
        ));
    }
    if !matches!(capturing, Ok(true)) || !matches!(after, Ok(false)) {
        wrong.push(format!(
            "{case}: is_capturing {capturing:?} during, {after:?} after"
        ));
    }
    let mark = if wrong.is_empty() {
        ""
    } else {
        "  <-- differs from the sim"
    };
    println!("{case} {got:>4} {again_shown:>4} (sim {expected}){mark}");
    let left = first.ok();
    f.release(left);
    wrong
}

/// Pins the simulated device's capture rules to the driver: every call kind, in each mode, from
/// the capturing thread and another one, begins a fresh capture (a refusal invalidates it),
/// makes the call (twice when refused), ends the capture and compares with
/// `CaptureMode::forbids`. Prints `call mode thread first again (sim expected)`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn capture_rules_match_the_sim() {
    let (_lock, dev) = gpu();
    println!(
        "{:<18} {:<12} {:<5} {:>4} {:>4}",
        "call", "mode", "thread", "1st", "2nd"
    );
    let mut wrong = Vec::new();
    for call in Call::ALL {
        for mode in CaptureMode::ALL {
            for same_thread in [true, false] {
                wrong.extend(probe_capture(&dev, mode, call, same_thread));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the driver differs from the sim:\n{}",
        wrong.join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn is_capturing_follows_begin_and_end() {
    let (_lock, dev) = gpu();
    let stream = dev.create_stream().unwrap();
    for mode in CaptureMode::ALL {
        assert!(!dev.is_capturing(stream).unwrap(), "{mode:?} before");
        dev.begin_capture(stream, mode).unwrap();
        assert!(dev.is_capturing(stream).unwrap(), "{mode:?} during");
        let other_thread = std::thread::scope(|s| s.spawn(|| dev.is_capturing(stream)).join());
        assert!(
            other_thread.unwrap().unwrap(),
            "{mode:?} from another thread"
        );
        dev.end_capture(stream).unwrap();
        assert!(!dev.is_capturing(stream).unwrap(), "{mode:?} after");
    }
    dev.destroy_stream(stream).unwrap();
}

/// An event recorded on a capturing stream is refused with `CAPTURED_EVENT` afterwards, as in the sim,
/// until it is recorded again outside a capture.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_event_recorded_in_a_capture_is_refused_until_recorded_again() {
    let (_lock, dev) = gpu();
    let stream = dev.create_stream().unwrap();
    let event = dev.create_event().unwrap();
    let code = |r: Result<(), DeviceError>| match r {
        Err(DeviceError::Driver { code, .. }) => Some(code),
        _ => None,
    };
    for mode in CaptureMode::ALL {
        dev.begin_capture(stream, mode).unwrap();
        dev.record_event(event, stream).unwrap();
        dev.end_capture(stream).unwrap();
        let query = code(dev.query_event(event).map(drop));
        let wait = code(dev.synchronize_event(event));
        println!(
            "{:<12} query_event {query:?} synchronize_event {wait:?}",
            mode.name()
        );
        assert_eq!((query, wait), (Some(CAPTURED_EVENT), Some(CAPTURED_EVENT)));
        dev.record_event(event, stream).unwrap();
        dev.synchronize_event(event).unwrap();
        assert!(dev.query_event(event).unwrap());
    }
    dev.destroy_event(event).unwrap();
    dev.destroy_stream(stream).unwrap();
}
