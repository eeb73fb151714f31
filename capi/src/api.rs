//! The bodies of the exported functions: safe Rust, each inside [`guard`], so that errors and
//! panics become a failure value plus the thread's last error.

use crate::error::{guard, guard_kind, last_error_message, ErrorKind, Failure};
use crate::json;
use crate::memory_snapshot;
use crate::pools::PoolId;
use crate::registry::{self, Dev};
use crate::tags;
use crate::trace::Tracer;
use crate::{
    CUDALLOC_MALLOC_ABORT as ABORT, CUDALLOC_MALLOC_RETURN_NULL as RETURN_NULL,
    CUDALLOC_MALLOC_WARN as WARN,
};
use cudalloc_core::record::Action;
use cudalloc_core::{AllocError, Allocation};
use cudalloc_sys::ffi::{CBuf, CBufLen, CStrArg};
use cudalloc_sys::{CudaDevice, StreamId};
use std::ffi::{c_int, c_void};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};

/// The trace of device 0's calls.
static TRACER: Tracer = Tracer::new();

/// Success of the functions that return `int`.
const OK: c_int = 0;
/// Failure of the functions that return `int`.
const FAILED: c_int = -1;

/// What `cudalloc_malloc` does on failure.
static ON_MALLOC_FAILURE: AtomicI32 = AtomicI32::new(RETURN_NULL);

/// `cudaStreamPerThread` / `CU_STREAM_PER_THREAD`: a different stream on each thread.
const PER_THREAD_STREAM: usize = 0x2;

/// The stream a caller passed. The allocator keys cached memory by the handle, so the
/// per-thread default stream, one handle for a different stream on each thread, is refused:
/// one thread's freed memory would go to another thread's work with nothing ordering them.
pub(crate) fn stream_id(stream: *mut c_void) -> Result<StreamId, String> {
    if stream as usize == PER_THREAD_STREAM {
        return Err(
            "stream 0x2 is cudaStreamPerThread, a different stream on each thread; \
                    pass a stream created for the work (cudaStreamCreate), or NULL"
                .to_string(),
        );
    }
    Ok(StreamId(stream as usize as u64))
}

fn address(ptr: *mut c_void) -> u64 {
    ptr as usize as u64
}

/// Allocates on `dev`, in the calling thread's tag if it has one (`tags`), through the tracer
/// for device 0 (the only one traces record). Out of memory gives the memory of retired private
/// pools back to the driver and tries once more, as part of the same allocation (one
/// out-of-memory event in the statistics and in a trace).
fn allocate(dev: &Dev, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
    let tag = tags::current();
    let release = || dev.pools.release_for_retry();
    if dev.ordinal == 0 {
        TRACER.allocate_releasing(&dev.alloc, size, stream, tag.as_deref(), &release)
    } else {
        tags::allocate(&dev.alloc, size, stream, tag.as_deref(), &release)
    }
}

/// Frees `ptr` on `dev`: its own allocator, else the private pool that holds it.
fn free_ptr(dev: &Dev, ptr: u64) -> Result<(), AllocError> {
    let freed = if dev.ordinal == 0 {
        TRACER.free(&dev.alloc, ptr)
    } else {
        dev.alloc.free_ptr(ptr)
    };
    match freed {
        Err(AllocError::NotAllocated(_)) => dev.pools.with_owner(ptr, |a| a.free_ptr(ptr)),
        other => other,
    }
}

/// Marks `ptr` used on `stream`: on `dev`'s own allocator, else the private pool that holds it.
fn record_on(dev: &Dev, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
    let recorded = if dev.ordinal == 0 {
        TRACER.record_stream(&dev.alloc, ptr, stream)
    } else {
        dev.alloc.record_stream(ptr, stream)
    };
    match recorded {
        Err(AllocError::NotAllocated(_)) => {
            dev.pools.with_owner(ptr, |a| a.record_stream(ptr, stream))
        }
        other => other,
    }
}

/// `None` on failure. Zero bytes give NULL once the device is checked: nothing is handed out,
/// as PyTorch's own allocator hands out nothing for an empty tensor. PyTorch's pluggable
/// allocator may still pass that NULL to `cudalloc_free` (which ignores it) and to
/// `cudalloc_record_stream` (a no-op for NULL).
pub(crate) fn malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let p = guard_kind(None, || {
        let stream = stream_id(stream).map_err(|e| format!("cudalloc_malloc: {e}"))?;
        let dev = registry::device(device).map_err(|e| format!("cudalloc_malloc: {e}"))?;
        if size == 0 {
            return Ok(Some(std::ptr::null_mut()));
        }
        let a = allocate(dev, size as u64, stream).map_err(|e| Failure {
            kind: malloc_error_kind(&e),
            message: format!("cudalloc_malloc({size} bytes, device {device}): {e}"),
        })?;
        Ok(Some(a.ptr() as usize as *mut c_void))
    });
    p.unwrap_or_else(|| {
        report_malloc_failure();
        std::ptr::null_mut()
    })
}

/// Out of memory for the failures PyTorch's own allocator reports as `torch.OutOfMemoryError`:
/// the device or the cap has no room, no address range is left, or the request is larger than
/// any device.
pub(crate) fn malloc_error_kind(e: &AllocError) -> ErrorKind {
    match e {
        AllocError::OutOfMemory { .. }
        | AllocError::AddressSpace { .. }
        | AllocError::TooLarge { .. } => ErrorKind::OutOfMemory,
        _ => ErrorKind::Other,
    }
}

/// Prints the failure and aborts, as `cudalloc_set_malloc_failure_action` asked.
fn report_malloc_failure() {
    let action = ON_MALLOC_FAILURE.load(Ordering::Relaxed);
    if action == RETURN_NULL {
        return;
    }
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "cudalloc: {}", last_error_message());
    if action == ABORT {
        // Close a running trace first, so that it ends complete, with its `oom` event.
        if TRACER.is_recording() {
            if let Err(e) = TRACER.stop(registry::existing(0).map(|d| &d.alloc)) {
                let _ = writeln!(err, "cudalloc: {e}");
            }
        }
        let _ = writeln!(
            err,
            "cudalloc: aborting the process (malloc failure action: abort)"
        );
        drop(err);
        std::process::abort();
    }
}

pub(crate) fn set_malloc_failure_action(action: c_int) -> c_int {
    guard(FAILED, || {
        if ![RETURN_NULL, WARN, ABORT].contains(&action) {
            return Err(format!(
                "cudalloc_set_malloc_failure_action: {action} is not 0 (return NULL), 1 (warn) or 2 (abort)"
            ));
        }
        Ok(ON_MALLOC_FAILURE.swap(action, Ordering::Relaxed))
    })
}

/// `ptr`'s device allocator, found without making one: a device without an allocator holds no
/// allocation, so `ptr` is not one ([`AllocError::NotAllocated`]). The outer error is that of
/// the lookup (a bad config, a bad device).
fn holder(device: c_int, ptr: u64) -> Result<Result<&'static Dev, AllocError>, String> {
    let made = registry::device_if_made(device)?;
    Ok(made.ok_or(AllocError::NotAllocated(ptr)))
}

/// Failures are counted in the stats of the device's allocator, if it has one. Device
/// [`ANY_DEVICE`] frees `ptr` on whichever device's allocator holds it.
pub(crate) fn free(ptr: *mut c_void, device: c_int) {
    guard((), || {
        if ptr.is_null() {
            return Ok(());
        }
        if device == ANY_DEVICE {
            return free_on_any(address(ptr))
                .map_err(|e| format!("cudalloc_free({ptr:p}, any device): {e}"));
        }
        let dev = holder(device, address(ptr)).map_err(|e| format!("cudalloc_free: {e}"))?;
        let freed =
            dev.and_then(|dev| free_ptr(dev, address(ptr)).inspect_err(|_| dev.count_free_error()));
        freed.map_err(|e| format!("cudalloc_free({ptr:p}, device {device}): {e}"))
    })
}

/// `cudalloc_free`'s device for "the device whose allocator holds the pointer".
pub(crate) const ANY_DEVICE: c_int = -1;

/// Frees `ptr` on the first device whose allocator holds it (device addresses are unique across
/// devices, so at most one does). A pointer no allocator holds is not a live allocation: that
/// failure is counted on the lowest-numbered device that has an allocator.
fn free_on_any(ptr: u64) -> Result<(), AllocError> {
    let mut first = None;
    for ordinal in 0..registry::made_count() {
        let Some(dev) = registry::existing(ordinal) else {
            continue;
        };
        first = first.or(Some(dev));
        match free_ptr(dev, ptr) {
            Err(AllocError::NotAllocated(_)) => continue,
            other => return other.inspect_err(|_| dev.count_free_error()),
        }
    }
    if let Some(dev) = first {
        dev.count_free_error();
    }
    Err(AllocError::NotAllocated(ptr))
}

pub(crate) fn record_stream(ptr: *mut c_void, device: c_int, stream: *mut c_void) -> c_int {
    guard(FAILED, || {
        if ptr.is_null() {
            return Ok(OK); // an empty tensor's: nothing was allocated (see `malloc`)
        }
        let stream = stream_id(stream).map_err(|e| format!("cudalloc_record_stream: {e}"))?;
        let dev =
            holder(device, address(ptr)).map_err(|e| format!("cudalloc_record_stream: {e}"))?;
        dev.and_then(|dev| record_on(dev, address(ptr), stream))
            .map_err(|e| format!("cudalloc_record_stream({ptr:p}, device {device}): {e}"))?;
        Ok(OK)
    })
}

pub(crate) fn check() -> c_int {
    guard(FAILED, || {
        let n = registry::check().map_err(|e| format!("cudalloc_check: {e}"))?;
        Ok(c_int::try_from(n).unwrap_or(c_int::MAX))
    })
}

pub(crate) fn empty_cache(device: c_int) -> c_int {
    guard(FAILED, || {
        let used =
            registry::device_if_used(device).map_err(|e| format!("cudalloc_empty_cache: {e}"))?;
        if let Some(dev) = used {
            let emptied = if dev.ordinal == 0 {
                TRACER.empty_cache(&dev.alloc)
            } else {
                dev.alloc.empty_cache()
            };
            // The retired pools are emptied even when the allocator's release failed.
            let retired = dev.pools.empty_retired(None).map(|_| ());
            emptied
                .and(retired)
                .map_err(|e| format!("cudalloc_empty_cache(device {device}): {e}"))?;
        }
        Ok(OK)
    })
}

pub(crate) fn set_memory_fraction(fraction: f64, device: c_int) -> c_int {
    guard(FAILED, || {
        let dev =
            registry::device(device).map_err(|e| format!("cudalloc_set_memory_fraction: {e}"))?;
        dev.alloc.set_memory_fraction(fraction).map_err(|e| {
            format!("cudalloc_set_memory_fraction({fraction}, device {device}): {e}")
        })?;
        // The cap counts the private pools too, as PyTorch's does.
        dev.pools.set_memory_limit(dev.alloc.memory_limit());
        Ok(OK)
    })
}

pub(crate) fn reset_peak_stats(device: c_int) -> c_int {
    guard(FAILED, || {
        let used = registry::device_if_used(device)
            .map_err(|e| format!("cudalloc_reset_peak_stats: {e}"))?;
        if let Some(dev) = used {
            dev.alloc.reset_peak_stats();
            dev.pools.reset_peak_stats();
        }
        Ok(OK)
    })
}

pub(crate) fn stats_json<'id>(device: c_int, buf: CBuf<'id>, len: CBufLen<'id>) -> usize {
    guard(0, || {
        let dev = registry::device(device).map_err(|e| format!("cudalloc_stats_json: {e}"))?;
        let text = json::stats(
            &dev.alloc,
            dev.policy,
            dev.ordinal,
            dev.free_errors(),
            dev.pools.figures(),
        );
        Ok(buf.write_c_string(len, text.as_bytes()))
    })
}

/// `device`'s `torch.cuda.memory_stats()` values as native-endian `int64_t`s, in the order of
/// [`json::TORCH_KEYS`]; the byte count, written or needed.
pub(crate) fn device_stats<'id>(device: c_int, buf: CBuf<'id>, len: CBufLen<'id>) -> usize {
    guard(0, || {
        let used =
            registry::device_if_used(device).map_err(|e| format!("cudalloc_device_stats: {e}"))?;
        // A device not used yet has no allocator: zeros, without opening it.
        let values = used.map_or_else(|| vec![0; json::TORCH_VALUES], |dev| dev.torch_values());
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        Ok(buf.write_bytes(len, &bytes))
    })
}

pub(crate) fn reset_accumulated_stats(device: c_int) -> c_int {
    guard(FAILED, || {
        let used = registry::device_if_used(device)
            .map_err(|e| format!("cudalloc_reset_accumulated_stats: {e}"))?;
        if let Some(dev) = used {
            dev.reset_accumulated_stats();
        }
        Ok(OK)
    })
}

pub(crate) fn enable_peer_access(device: c_int, peer: c_int) -> c_int {
    guard(FAILED, || {
        let what = format!("cudalloc_enable_peer_access(device {device}, peer {peer})");
        let ordinal = usize::try_from(peer).map_err(|_| format!("{what}: no device {peer}"))?;
        if peer == device {
            return Err(format!("{what}: a device is not its own peer"));
        }
        let dev = registry::device(device).map_err(|e| format!("{what}: {e}"))?;
        // A peer that cannot reach the device would fail every later mapping of its pages.
        match CudaDevice::can_access_peer(ordinal, dev.ordinal) {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                    "{what}: device {peer} cannot access device {device}"
                ))
            }
            Err(e) => return Err(format!("{what}: {e}")),
        }
        dev.add_peer(ordinal).map_err(|e| format!("{what}: {e}"))?;
        Ok(OK)
    })
}

/// The fraction of `device`'s memory its allocator is capped at (1.0: no cap), or -1.0; a
/// device not used yet is not opened: the configuration's fraction.
pub(crate) fn memory_fraction(device: c_int) -> f64 {
    guard(-1.0, || {
        let what = format!("cudalloc_memory_fraction(device {device})");
        match registry::device_if_used(device).map_err(|e| format!("{what}: {e}"))? {
            Some(dev) => dev
                .alloc
                .memory_fraction()
                .map_err(|e| format!("{what}: {e}")),
            None => registry::configured_fraction(device).map_err(|e| format!("{what}: {e}")),
        }
    })
}

pub(crate) fn snapshot_json<'id>(device: c_int, buf: CBuf<'id>, len: CBufLen<'id>) -> usize {
    guard(0, || {
        let dev = registry::device(device).map_err(|e| format!("cudalloc_snapshot_json: {e}"))?;
        let text = json::snapshot(&dev.alloc, dev.policy, dev.ordinal);
        Ok(buf.write_c_string(len, text.as_bytes()))
    })
}

/// `device`'s segments and blocks in PyTorch's shape ([`memory_snapshot`]): its own
/// allocator's and every private pool's for pool (0, 0), only that pool's otherwise (none for
/// a pool it does not have). A device not used yet has none and is not opened.
pub(crate) fn memory_snapshot<'id>(
    device: c_int,
    pool: PoolId,
    buf: CBuf<'id>,
    len: CBufLen<'id>,
) -> usize {
    guard(0, || {
        let used = registry::device_if_used(device)
            .map_err(|e| format!("cudalloc_memory_snapshot: {e}"))?;
        let mut doc = memory_snapshot::Document::default();
        if let Some(dev) = used {
            let whole = pool == (0, 0);
            if whole {
                doc.add(&dev.alloc.snapshot(), device, pool);
            }
            for (id, snap) in dev.pools.snapshots((!whole).then_some(pool)) {
                doc.add(&snap, device, id);
            }
        }
        Ok(buf.write_bytes(len, &doc.to_bytes()))
    })
}

#[cfg(unix)]
fn path_from(bytes: &[u8]) -> Result<PathBuf, String> {
    use std::os::unix::ffi::OsStrExt;
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(bytes)))
}

#[cfg(not(unix))]
fn path_from(bytes: &[u8]) -> Result<PathBuf, String> {
    std::str::from_utf8(bytes)
        .map(PathBuf::from)
        .map_err(|_| "the path is not valid UTF-8".to_string())
}

pub(crate) fn trace_start(path: CStrArg<'_>) -> c_int {
    guard(FAILED, || {
        let fail = |e: String| format!("cudalloc_trace_start: {e}");
        let bytes = path
            .to_bytes()
            .ok_or_else(|| fail("the path is NULL".into()))?;
        if bytes.is_empty() {
            return Err(fail("the path is empty".into()));
        }
        let path = path_from(bytes).map_err(fail)?;
        let existing = registry::existing(0).map(|d| &d.alloc);
        TRACER.start(&path, existing).map_err(fail)?;
        Ok(OK)
    })
}

pub(crate) fn trace_stop() -> c_int {
    guard(FAILED, || {
        TRACER
            .stop(registry::existing(0).map(|d| &d.alloc))
            .map_err(|e| format!("cudalloc_trace_stop: {e}"))?;
        Ok(OK)
    })
}

/// Bytes of `cudalloc_memory_history`'s header (the event count) and of one event.
pub(crate) const HISTORY_HEADER_BYTES: usize = 8;
pub(crate) const HISTORY_EVENT_BYTES: usize = 40;

pub(crate) fn history_start(max_entries: u64, clear: c_int) -> c_int {
    guard(FAILED, || {
        let existing = registry::existing(0).map(|d| &d.alloc);
        let max = usize::try_from(max_entries).unwrap_or(usize::MAX);
        TRACER
            .start_history(max, clear != 0, existing)
            .map_err(|e| format!("cudalloc_history_start: {e}"))?;
        Ok(OK)
    })
}

pub(crate) fn history_stop() -> c_int {
    guard(FAILED, || {
        TRACER
            .stop_history(registry::existing(0).map(|d| &d.alloc))
            .map_err(|e| format!("cudalloc_history_stop: {e}"))?;
        Ok(OK)
    })
}

pub(crate) fn history_clear() -> c_int {
    guard(FAILED, || {
        TRACER.clear_history();
        Ok(OK)
    })
}

pub(crate) fn history_enabled() -> c_int {
    guard(FAILED, || Ok(c_int::from(TRACER.is_keeping_history())))
}

/// The history's events as `cudalloc.h` declares them: the count (`uint64_t`), then per event
/// the address, size, stream and time in Unix-epoch microseconds (`uint64_t` each), the action
/// (PyTorch's `TraceEntry::Action` numbering, which [`Action::NAMES`] follows) and the device
/// (`int32_t` each).
pub(crate) fn memory_history<'id>(buf: CBuf<'id>, len: CBufLen<'id>) -> usize {
    guard(0, || {
        let events = TRACER.history();
        let mut out = Vec::with_capacity(HISTORY_HEADER_BYTES + events.len() * HISTORY_EVENT_BYTES);
        out.extend_from_slice(&(events.len() as u64).to_ne_bytes());
        for e in &events {
            for v in [e.addr, e.size, e.stream, e.time_us] {
                out.extend_from_slice(&v.to_ne_bytes());
            }
            let code = Action::NAMES.iter().position(|(a, _)| *a == e.action);
            out.extend_from_slice(&(code.unwrap_or(0) as i32).to_ne_bytes());
            out.extend_from_slice(&0i32.to_ne_bytes());
        }
        Ok(buf.write_bytes(len, &out))
    })
}
