//! The bodies of the private-pool functions (`cudalloc_pool_*`): safe Rust inside the same
//! guards as `api`, over [`crate::pools`].

use crate::error::{guard, guard_kind, ErrorKind, Failure};
use crate::pools::PoolId;
use crate::registry::{self, Dev};
use cudalloc_core::AllocError;
use cudalloc_sys::ffi::{CBuf, CBufLen};
use cudalloc_sys::StreamId;
use std::ffi::{c_int, c_void};

const OK: c_int = 0;
const FAILED: c_int = -1;

fn device(name: &str, device: c_int) -> Result<&'static Dev, String> {
    registry::device(device).map_err(|e| format!("{name}: {e}"))
}

pub(crate) fn acquire(device_: c_int, id: PoolId) -> c_int {
    guard(FAILED, || {
        let dev = device("cudalloc_pool_acquire", device_)?;
        dev.pools
            .acquire(id, || dev.open_pool())
            .map_err(|e| format!("cudalloc_pool_acquire(device {device_}, {id:?}): {e}"))?;
        Ok(OK)
    })
}

pub(crate) fn release(device_: c_int, id: PoolId) -> c_int {
    guard(FAILED, || {
        let dev = device("cudalloc_pool_release", device_)?;
        dev.pools
            .release(id)
            .map_err(|e| format!("cudalloc_pool_release(device {device_}, {id:?}): {e}"))?;
        Ok(OK)
    })
}

pub(crate) fn set_use_on_oom(device_: c_int, id: PoolId, on: c_int) -> c_int {
    guard(FAILED, || {
        let dev = device("cudalloc_pool_set_use_on_oom", device_)?;
        dev.pools.set_use_on_oom(id, on != 0).map_err(|e| {
            format!("cudalloc_pool_set_use_on_oom(device {device_}, {id:?}, {on}): {e}")
        })?;
        Ok(OK)
    })
}

pub(crate) fn use_count(device_: c_int, id: PoolId) -> c_int {
    guard(FAILED, || {
        let dev = device("cudalloc_pool_use_count", device_)?;
        Ok(c_int::try_from(dev.pools.use_count(id)).unwrap_or(c_int::MAX))
    })
}

pub(crate) fn malloc(size: usize, device_: c_int, stream: *mut c_void, id: PoolId) -> *mut c_void {
    guard_kind(std::ptr::null_mut(), || {
        let dev = device("cudalloc_pool_malloc", device_)?;
        if stream as usize == 0x2 {
            return Err(Failure::from(
                "cudalloc_pool_malloc: stream 0x2 is cudaStreamPerThread, a different stream on \
                 each thread; pass a created stream, or NULL"
                    .to_string(),
            ));
        }
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        let stream = StreamId(stream as usize as u64);
        let a = match dev.pools.allocate(id, size as u64, stream) {
            // The device's cap counts its allocator and its pools together: the memory the
            // allocator and the retired pools cache goes back (not during a capture, where
            // `empty_cache` refuses), and the pool tries once more.
            Err(f) if f.kind == ErrorKind::OutOfMemory => {
                // A release the driver refused in one shard stops no other's: the pool tries
                // again unless the allocator refused to release at all (a capture).
                let refused = dev.alloc.empty_cache();
                let cached = !matches!(refused, Err(AllocError::DuringCapture { .. }));
                let retired = dev.pools.release_for_retry();
                if cached || retired {
                    dev.pools.allocate_again(id, size as u64, stream)
                } else {
                    Err(f)
                }
            }
            other => other,
        };
        let a = a.map_err(|f| Failure {
            kind: f.kind,
            message: format!(
                "cudalloc_pool_malloc({size} bytes, device {device_}, pool {id:?}): {}",
                f.message
            ),
        })?;
        Ok(a.ptr() as usize as *mut c_void)
    })
}

pub(crate) fn live<'id>(device_: c_int, id: PoolId, buf: CBuf<'id>, len: CBufLen<'id>) -> i64 {
    guard(-1, || {
        let dev = device("cudalloc_pool_live", device_)?;
        let live = dev
            .pools
            .live_allocations(id)
            .map_err(|e| format!("cudalloc_pool_live(device {device_}, {id:?}): {e}"))?;
        let bytes: Vec<u8> = live.iter().flat_map(|a| a.to_ne_bytes()).collect();
        buf.write_bytes(len, &bytes);
        Ok(live.len() as i64)
    })
}

pub(crate) fn blocks<'id>(device_: c_int, id: PoolId, buf: CBuf<'id>, len: CBufLen<'id>) -> i64 {
    guard(-1, || {
        let dev = device("cudalloc_pool_blocks", device_)?;
        let blocks = dev
            .pools
            .live_blocks(id)
            .map_err(|e| format!("cudalloc_pool_blocks(device {device_}, {id:?}): {e}"))?;
        let bytes: Vec<u8> = blocks
            .iter()
            .flatten()
            .flat_map(|v| v.to_ne_bytes())
            .collect();
        buf.write_bytes(len, &bytes);
        Ok(blocks.len() as i64)
    })
}

pub(crate) fn allocate_at(
    device_: c_int,
    id: PoolId,
    range: [u64; 3],
    stream: *mut c_void,
) -> c_int {
    guard(FAILED, || {
        let dev = device("cudalloc_pool_allocate_at", device_)?;
        let [ptr, size, requested] = range;
        dev.pools
            .allocate_at(id, range, StreamId(stream as usize as u64))
            .map_err(|e| {
                format!(
                    "cudalloc_pool_allocate_at(device {device_}, {id:?}, {ptr:#x}, {size} bytes, \
                     {requested} requested): {e}"
                )
            })?;
        Ok(OK)
    })
}

pub(crate) fn empty_cache(device_: c_int, id: PoolId) -> c_int {
    guard(FAILED, || {
        // A device not opened yet holds no pool, and is not opened for this.
        let name = "cudalloc_pool_empty_cache";
        let Some(dev) = registry::device_if_made(device_).map_err(|e| format!("{name}: {e}"))?
        else {
            return Ok(OK);
        };
        dev.pools
            .empty_retired(Some(id))
            .map_err(|e| format!("cudalloc_pool_empty_cache(device {device_}, {id:?}): {e}"))?;
        Ok(OK)
    })
}

pub(crate) fn capture_begin(device_: c_int) -> c_int {
    guard(FAILED, || {
        device("cudalloc_capture_begin", device_)?.begin_capture();
        Ok(OK)
    })
}

pub(crate) fn capture_end(device_: c_int) -> c_int {
    guard(FAILED, || {
        let dev = device("cudalloc_capture_end", device_)?;
        dev.end_capture()
            .map_err(|e| format!("cudalloc_capture_end(device {device_}): {e}"))?;
        Ok(OK)
    })
}
