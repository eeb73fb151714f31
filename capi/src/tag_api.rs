//! The bodies of the tag functions (`cudalloc_tag_*`, `cudalloc_sleep`, `cudalloc_wake`,
//! `cudalloc_release_host_buffers`): safe Rust inside the same guards as `api`, over
//! [`crate::tags`].

use crate::api::stream_id;
use crate::error::{guard, guard_kind, ErrorKind, Failure};
use crate::registry;
use crate::{json, tags};
use cudalloc_core::AllocError;
use cudalloc_sys::ffi::{CBuf, CBufLen, CStrArg};
use std::ffi::{c_int, c_void};

const OK: c_int = 0;
const FAILED: c_int = -1;

/// The kind of a sleep's or a wake's failure: out of memory (a wake that found no room), an
/// incomplete sleep (the tag sleeps, some pages stay mapped), or anything else.
pub(crate) fn sleep_error_kind(e: &AllocError) -> ErrorKind {
    match e {
        AllocError::SleepIncomplete { .. } => ErrorKind::SleepIncomplete,
        e if e.is_out_of_memory() => ErrorKind::OutOfMemory,
        _ => ErrorKind::Other,
    }
}

pub(crate) fn tag_push(tag: CStrArg<'_>) -> c_int {
    guard(FAILED, || {
        tags::push(tag).map_err(|e| format!("cudalloc_tag_push: {e}"))?;
        Ok(OK)
    })
}

pub(crate) fn tag_pop() -> c_int {
    guard(FAILED, || {
        tags::pop().map_err(|e| format!("cudalloc_tag_pop: {e}"))?;
        Ok(OK)
    })
}

pub(crate) fn tag_depth() -> c_int {
    guard(0, || {
        Ok(c_int::try_from(tags::depth()).unwrap_or(c_int::MAX))
    })
}

pub(crate) fn tag_current<'id>(buf: CBuf<'id>, len: CBufLen<'id>) -> usize {
    guard(0, || {
        let tag = tags::current().unwrap_or_default();
        Ok(buf.write_c_string(len, tag.as_bytes()))
    })
}

pub(crate) fn sleep(device: c_int, tag_list: CStrArg<'_>, offload: CStrArg<'_>) -> c_int {
    guard_kind(FAILED, || {
        let fail = |e: String| Failure::from(format!("cudalloc_sleep: {e}"));
        if tag_list.is_null() {
            return Err(fail("the tags are NULL".into()));
        }
        let names = tags::list(tag_list, "tags").map_err(fail)?;
        let offload = tags::list(offload, "offload").map_err(fail)?;
        let dev = registry::device(device).map_err(fail)?;
        tags::sleep(&dev.alloc, &names, &offload).map_err(|e| Failure {
            kind: sleep_error_kind(&e),
            message: format!("cudalloc_sleep({}, device {device}): {e}", names.join(",")),
        })?;
        Ok(OK)
    })
}

pub(crate) fn wake(device: c_int, tag_list: CStrArg<'_>, stream: *mut c_void) -> c_int {
    guard_kind(FAILED, || {
        let fail = |e: String| Failure::from(format!("cudalloc_wake: {e}"));
        if tag_list.is_null() {
            return Err(fail("the tags are NULL".into()));
        }
        let names = tags::list(tag_list, "tags").map_err(fail)?;
        let stream = stream_id(stream).map_err(fail)?;
        let Some(dev) = registry::device_if_used(device).map_err(fail)? else {
            return Ok(OK); // no allocator: no tag sleeps
        };
        let release = || dev.pools.release_for_retry();
        tags::wake(&dev.alloc, &names, stream, &release).map_err(|e| Failure {
            kind: sleep_error_kind(&e),
            message: format!("cudalloc_wake({}, device {device}): {e}", names.join(",")),
        })?;
        Ok(OK)
    })
}

pub(crate) fn release_host_buffers(device: c_int) -> c_int {
    guard(FAILED, || {
        let fail = |e: String| format!("cudalloc_release_host_buffers: {e}");
        if let Some(dev) = registry::device_if_used(device).map_err(fail)? {
            dev.alloc
                .release_host_buffers()
                .map_err(|e| fail(format!("device {device}: {e}")))?;
        }
        Ok(OK)
    })
}

pub(crate) fn tag_stats_json<'id>(device: c_int, buf: CBuf<'id>, len: CBufLen<'id>) -> usize {
    guard(0, || {
        let used = registry::device_if_used(device)
            .map_err(|e| format!("cudalloc_tag_stats_json: {e}"))?;
        let text = used.map_or_else(|| "[]".to_string(), |d| json::tag_stats(&d.alloc));
        Ok(buf.write_c_string(len, text.as_bytes()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudalloc_core::{CachingAllocator, Config, Policy};
    use cudalloc_sys::{SimConfig, SimDevice, StreamId};
    use std::sync::Arc;

    /// The kinds `cudalloc_last_error_kind` gives: an incomplete sleep (an unmap refused on the
    /// simulated device), an out-of-memory wake (a limit), anything else.
    #[test]
    fn sleep_failures_have_their_own_kinds() {
        let dev = Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
        let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(Policy::Default));
        let names = vec!["t".to_string()];
        let a = alloc.allocate_tagged(64 << 20, StreamId(1), "t").unwrap();
        dev.fail_release(1);
        let e = tags::sleep(&alloc, &names, &[]).unwrap_err();
        dev.clear_faults();
        assert_eq!(sleep_error_kind(&e), ErrorKind::SleepIncomplete, "{e}");
        assert!(e.to_string().contains("tag \"t\" sleeps"), "{e}");
        tags::sleep(&alloc, &names, &[]).unwrap();
        alloc.set_memory_limit(Some(1 << 20));
        let e = tags::wake(&alloc, &names, StreamId(1), &|| false).unwrap_err();
        assert_eq!(sleep_error_kind(&e), ErrorKind::OutOfMemory, "{e}");
        alloc.set_memory_limit(None);
        tags::wake(&alloc, &names, StreamId(1), &|| false).unwrap();
        assert_eq!(
            sleep_error_kind(&AllocError::SleepUnsupported),
            ErrorKind::Other
        );
        alloc.free(a).unwrap();
    }
}
