//! The bodies of the C functions that share allocations with other processes
//! (`cudalloc_share`, `cudalloc_open_shared`, `cudalloc_close_shared`) and set map hooks
//! (`cudalloc_set_map_hooks`).
//!
//! An opened allocation is kept in a table of this process by (device, pointer) until
//! `cudalloc_close_shared`; the descriptors `cudalloc_share` returns are the caller's.

use crate::error::guard;
use crate::registry::Gpu;
use crate::registry::{self, Dev};
use cudalloc_core::{AllocError, MapHooks, SharedAllocation, SharedMapping, SharedPage};
use cudalloc_sys::fds::duplicate;
use cudalloc_sys::ffi::{CArray, CArrayMut, CCount, CIn, COut};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd};
use std::sync::Arc;

/// `cudalloc_shared_t`: an allocation's description without its pages.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CShared {
    /// The exporter's device.
    pub device: c_int,
    /// The id of the allocation's segment.
    pub segment: u64,
    /// Bytes from the first page to the allocation.
    pub offset: u64,
    /// The allocation's bytes.
    pub size: u64,
    /// Pages behind it.
    pub num_pages: usize,
}

/// A map hook of the C ABI: user data, device, address, bytes.
pub type CMapHook = extern "C" fn(*mut c_void, c_int, u64, u64);

/// Allocations opened in this process, by (device, pointer).
type Opened = HashMap<(usize, u64), SharedMapping<Arc<Gpu>>>;
static OPENED: Mutex<Option<Opened>> = Mutex::new(None);

const FAILED: c_int = -1;

/// The description of the live allocation `ptr` of `dev` (its own allocator, else the
/// private pool holding it).
fn share_on(dev: &Dev, ptr: u64) -> Result<SharedAllocation, AllocError> {
    match dev.alloc.share(ptr) {
        Err(AllocError::NotAllocated(_)) => {
            let found = Mutex::new(None);
            dev.pools.with_owner(ptr, |a| {
                *found.lock() = Some(a.share(ptr)?);
                Ok(())
            })?;
            Ok(found.into_inner().expect("set by the owner"))
        }
        other => other,
    }
}

/// `cudalloc_share`: the number of pages, or -1.
pub(crate) fn share(
    ptr: *mut c_void,
    device: c_int,
    out: COut<'_, CShared>,
    fds: CArrayMut<'_, c_int>,
    sizes: CArrayMut<'_, u64>,
    capacity: CCount<'_>,
) -> i64 {
    guard(FAILED as i64, || {
        let fail = |e: String| format!("cudalloc_share({ptr:?}, device {device}): {e}");
        let dev = registry::device(device).map_err(fail)?;
        let shared = share_on(dev, ptr as usize as u64).map_err(|e| fail(e.to_string()))?;
        let n = shared.pages.len();
        let head = CShared {
            device,
            segment: shared.segment,
            offset: shared.offset,
            size: shared.size,
            num_pages: n,
        };
        if !out.write(head) {
            return Err(fail("the description pointer is NULL".into()));
        }
        if n <= capacity.get() {
            let sizes_of: Vec<u64> = shared.pages.iter().map(|p| p.size).collect();
            let raw: Vec<c_int> = shared.pages.iter().map(|p| p.fd.as_raw_fd()).collect();
            if !sizes.write(capacity, &sizes_of) || !fds.write(capacity, &raw) {
                return Err(fail("fds or page_sizes is NULL".into()));
            }
            // The descriptors now belong to the caller: they stay open.
            shared.pages.into_iter().for_each(|p| {
                let _ = p.fd.into_raw_fd();
            });
        }
        Ok(n as i64)
    })
}

/// `cudalloc_open_shared`: the pointer in this process, or NULL.
pub(crate) fn open(
    device: c_int,
    shared: CIn<'_, CShared>,
    fds: CArray<'_, c_int>,
    sizes: CArray<'_, u64>,
    count: CCount<'_>,
) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        let fail = |e: String| format!("cudalloc_open_shared(device {device}): {e}");
        let head = shared
            .read()
            .ok_or_else(|| fail("the description is NULL".into()))?;
        let (fds, sizes) = match (fds.read(count), sizes.read(count)) {
            (Some(f), Some(s)) if f.len() == head.num_pages => (f, s),
            _ => {
                let n = head.num_pages;
                return Err(fail(format!(
                    "{n} pages described, fds/page_sizes hold {}",
                    count.get()
                )));
            }
        };
        let dev = registry::device(device).map_err(fail)?;
        let pages = borrowed_pages(&fds, &sizes).map_err(fail)?;
        let described = SharedAllocation {
            device: head.device.max(0) as usize,
            segment: head.segment,
            offset: head.offset,
            size: head.size,
            pages,
        };
        let opened = dev.alloc.open_shared(&described);
        // The descriptors are the caller's: ours are duplicates, closed here.
        drop(described);
        let m = opened.map_err(|e| fail(e.to_string()))?;
        let ptr = m.ptr();
        OPENED
            .lock()
            .get_or_insert_with(HashMap::new)
            .insert((dev.ordinal, ptr), m);
        Ok(ptr as usize as *mut c_void)
    })
}

/// Pages over duplicates of the caller's descriptors (which stay the caller's).
fn borrowed_pages(fds: &[c_int], sizes: &[u64]) -> Result<Vec<SharedPage>, String> {
    let dup = |fd: c_int| -> Result<OwnedFd, String> {
        if fd < 0 {
            return Err(format!("descriptor {fd}"));
        }
        duplicate(fd).map_err(|e| format!("descriptor {fd}: {e}"))
    };
    let pages = fds
        .iter()
        .zip(sizes)
        .map(|(&fd, &size)| Ok(SharedPage { size, fd: dup(fd)? }));
    pages.collect()
}

/// `cudalloc_close_shared`: 0 or -1.
pub(crate) fn close(ptr: *mut c_void, device: c_int) -> c_int {
    guard(FAILED, || {
        let fail = |e: String| format!("cudalloc_close_shared({ptr:?}, device {device}): {e}");
        let ordinal = usize::try_from(device).map_err(|_| fail("a negative device".into()))?;
        let key = (ordinal, ptr as usize as u64);
        let m = OPENED.lock().as_mut().and_then(|t| t.remove(&key));
        let m = m.ok_or_else(|| fail("not an allocation cudalloc_open_shared opened".into()))?;
        m.close().map_err(|e| fail(e.to_string()))?;
        Ok(0)
    })
}

/// Map hooks that call C function pointers with the caller's user data.
struct CHooks {
    mapped: CMapHook,
    unmapping: CMapHook,
    /// The user data, as an address (a raw pointer is not `Send`; it is only handed back).
    user: usize,
}

impl MapHooks for CHooks {
    fn mapped(&self, device: usize, addr: u64, size: u64) {
        (self.mapped)(self.user as *mut c_void, device as c_int, addr, size);
    }
    fn unmapping(&self, device: usize, addr: u64, size: u64) {
        (self.unmapping)(self.user as *mut c_void, device as c_int, addr, size);
    }
}

/// `cudalloc_set_map_hooks`: 0 or -1.
pub(crate) fn set_map_hooks(
    device: c_int,
    mapped: Option<CMapHook>,
    unmapping: Option<CMapHook>,
    user: *mut c_void,
) -> c_int {
    guard(FAILED, || {
        let fail = |e: String| format!("cudalloc_set_map_hooks(device {device}): {e}");
        let dev = registry::device(device).map_err(fail)?;
        let hooks: Option<Arc<dyn MapHooks>> = match (mapped, unmapping) {
            (Some(mapped), Some(unmapping)) => Some(Arc::new(CHooks {
                mapped,
                unmapping,
                user: user as usize,
            })),
            (None, None) => None,
            _ => return Err(fail("give both hooks, or neither (to remove them)".into())),
        };
        dev.alloc.set_map_hooks(hooks.clone());
        dev.pools.set_map_hooks(&hooks);
        Ok(0)
    })
}
