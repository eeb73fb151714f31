//! [`CudaDevice`]: the [`Device`] contract over the CUDA driver API, through cudarc 0.19.
//!
//! # Driver calls
//!
//! | method | driver call |
//! | --- | --- |
//! | [`CudaDevice::new`] | `cuInit`, `cuDevicePrimaryCtxRetain` (through `CudaContext::new`) |
//! | `malloc` / `free` | `cuMemAlloc_v2` / `cuMemFree_v2` |
//! | `mem_info` | `cuMemGetInfo_v2` |
//! | `granularity` | `cuMemGetAllocationGranularity` (minimum, pinned memory on this device), cached |
//! | `reserve` / `unreserve` | `cuMemAddressReserve` (default alignment) / `cuMemAddressFree` |
//! | `create_page` / `release_page` | `cuMemCreate` (pinned, on this device) / `cuMemRelease` |
//! | `create_shareable_page` | `cuMemCreate` with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` |
//! | `can_share` | `cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)` |
//! | `export_page` / `import_page` | `cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle` (POSIX file descriptor) |
//! | `map` / `unmap` | `cuMemMap` (offset 0) / `cuMemUnmap` |
//! | `set_access` | `cuMemSetAccess`, read/write for this device and every peer |
//! | `create_event` / `destroy_event` | `cuEventCreate` (`CU_EVENT_DISABLE_TIMING`) / `cuEventDestroy_v2` |
//! | `record_event` / `query_event` / `synchronize_event` | `cuEventRecord` / `cuEventQuery` / `cuEventSynchronize` |
//! | `copy_to_device` / `copy_from_device` | `cuMemcpyHtoD_v2` / `cuMemcpyDtoH_v2` (synchronous) |
//! | `memset_async` | `cuMemsetD8Async` |
//! | `create_stream` / `destroy_stream` | `cuStreamCreate` (`CU_STREAM_DEFAULT`) / `cuStreamDestroy_v2` |
//! | `synchronize` / `synchronize_device` | `cuCtxSynchronize` |
//! | `is_capturing` | `cuStreamIsCapturing` (active or invalidated: true; error 906 on the legacy stream: true) |
//! | `begin_capture` / `end_capture` | `cuStreamBeginCapture_v2` / `cuStreamEndCapture`, `cuGraphDestroy` |
//! | `alloc_host` / `free_host` | `cuMemHostAlloc` / `cuMemFreeHost` |
//! | `copy_to_host_async` / `copy_to_device_async` | `cuMemcpyDtoHAsync_v2` / `cuMemcpyHtoDAsync_v2` |
//! | `copy_device_async` | `cuMemcpyDtoDAsync_v2` |
//! | `open_stream` / `close_stream` / `wait_event` | `cuStreamCreate` (`CU_STREAM_NON_BLOCKING`) / `cuStreamDestroy_v2` / `cuStreamWaitEvent` |
//! | `device_count` / `can_access_peer` | `cuDeviceGetCount` / `cuDeviceCanAccessPeer` |
//! | `enable_peer_access` | `cuCtxEnablePeerAccess` |
//!
//! Page handles are the raw `CUmemGenericAllocationHandle`, events the raw `CUevent` pointer and
//! streams the raw `CUstream` pointer, each as a `u64`.
//!
//! # Loading the driver and errors
//!
//! Loading and initialising the driver once per process, without a panic when it is missing,
//! and turning a `CUresult` into a [`DeviceError`], are in the `driver` submodule.
//!
//! # Contexts and threads
//!
//! A `CudaDevice` holds the device's primary context (`CudaContext::new`). CUDA contexts are
//! current per thread, so every method first makes the context current on the calling thread
//! (`cuCtxGetCurrent`, then `cuCtxSetCurrent` only when another context, or none, is current)
//! and, when it had to, makes the caller's context current again (none, when none was) before it
//! returns (a `Bound` guard): a call never changes which device the caller's own CUDA work goes
//! to, as PyTorch's allocator restores the device it found. [`CudaDevice::new`] does the same
//! around cudarc's `CudaContext::new`, which binds the context, and so does dropping the device
//! around cudarc's drop of its last context handle, which binds it to release it. Methods take
//! `&self` and may be called from any thread.
//!
//! # Bookkeeping
//!
//! The driver does not reliably reject stale handles (destroying an event twice is undefined
//! behaviour), so the device records what it handed out: allocations with their sizes,
//! reservations, pages with their mapping counts, mappings, events and streams (a page released
//! while mapped stays in its table, taking no more calls, until its last unmap, when the driver
//! frees its memory). Releasing anything else, a size that does not match, a release whose
//! precondition does not hold, or a map outside a reservation or over an existing mapping is
//! [`DeviceError::InvalidArgument`] before the driver is called. The memory tables' lock is held
//! across each release's driver call, and a new handle enters its table only after the driver gave
//! it, so table and driver agree; events sit behind a read-write lock whose readers
//! (`record_event`, `query_event`, `synchronize_event`) do not queue behind a waiting writer, so a
//! `synchronize_event` blocks only `create_event` and `destroy_event` for its wait, not other
//! queries.
//!
//! Dropping a `CudaDevice` releases nothing it handed out; the driver reclaims it when the
//! primary context's last user goes away.
//!
//! Zero sizes, sizes or addresses that are not multiples of the granularity and the bookkeeping
//! checks above are [`DeviceError::InvalidArgument`]; `cuEventQuery`'s `CUDA_ERROR_NOT_READY` is
//! `Ok(false)`, and `cuCtxEnablePeerAccess`'s `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` is `Ok`.

use std::collections::HashSet;
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext};
use parking_lot::{Mutex, RwLock};

use crate::device::{
    Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostPtr, PageHandle, StreamId,
};

mod driver;
use driver::{check, check_alloc, driver, driver_error};
mod share;
use share::pinned_memory;
mod stream;
mod transfer;

// Sizes and addresses cross between `u64` and `usize` with `as`; that is lossless only here.
const _: () = assert!(usize::BITS == 64, "cudalloc needs a 64-bit target");

/// A device memory location for `ordinal`. `CUmemLocation` changed shape in cudarc's CUDA 13.2+
/// bindings (the id moved into an anonymous union); this is the only place that builds one.
fn device_location(ordinal: usize) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as i32,
    }
}

/// `va + size`, or InvalidArgument when it overflows.
fn end_of(call: &'static str, va: u64, size: u64) -> DeviceResult<u64> {
    va.checked_add(size)
        .ok_or_else(|| DeviceError::invalid(call, format!("{va:#x} + {size} overflows")))
}

mod memory;
use memory::{Mapping, Memory};

/// A CUDA GPU as a [`Device`]. See the module documentation.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: usize,
    /// Dropped in `drop`, where the caller's context is restored after it.
    ctx: ManuallyDrop<Arc<CudaContext>>,
    granularity: OnceLock<u64>,
    memory: Mutex<Memory>,
    events: RwLock<HashSet<u64>>,
    streams: Mutex<HashSet<u64>>,
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let restore = current_context().ok().map(|previous| Bound {
            previous: Some(previous),
        });
        // SAFETY: `ctx` is dropped once, here, and not used after: `self` is being dropped.
        unsafe { ManuallyDrop::drop(&mut self.ctx) };
        drop(restore);
    }
}

/// The context current on the calling thread (null: none).
fn current_context() -> DeviceResult<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer; the driver was initialised by the caller's path.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    Ok(ctx)
}

/// A device's context made current for one call: dropped, it makes `previous` current again
/// (`None`: nothing was changed). A failure to restore cannot be returned from `drop`; the
/// driver then keeps our (valid) context current.
#[must_use = "the caller's context is restored when this is dropped"]
struct Bound {
    previous: Option<sys::CUcontext>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: `previous` was current on this thread when the call began (or is null,
            // which unbinds); the caller keeps a context it made current alive while it is.
            unsafe {
                sys::cuCtxSetCurrent(previous);
            }
        }
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` (retaining its primary context). [`DeviceError::Unavailable`] without
    /// a driver or GPU; [`DeviceError::InvalidArgument`] for an ordinal past the device count.
    pub fn new(ordinal: usize) -> DeviceResult<CudaDevice> {
        let count = Self::device_count()?;
        if ordinal >= count {
            let message = format!("ordinal {ordinal} but only {count} device(s)");
            return Err(DeviceError::invalid("new", message));
        }
        let restore = Bound {
            previous: Some(current_context()?),
        };
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("CudaContext::new", e.0))?;
        drop(restore);
        Ok(CudaDevice {
            ordinal,
            ctx: ManuallyDrop::new(ctx),
            granularity: OnceLock::new(),
            memory: Mutex::new(Memory::default()),
            events: RwLock::new(HashSet::new()),
            streams: Mutex::new(HashSet::new()),
        })
    }

    /// The number of CUDA devices; [`DeviceError::Unavailable`] without a driver.
    pub fn device_count() -> DeviceResult<usize> {
        driver()?;
        let mut count = 0;
        // SAFETY: the driver is initialised and `count` is a valid out-pointer.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        Ok(count.max(0) as usize)
    }

    /// Whether device `a` can access memory on device `b` directly.
    pub fn can_access_peer(a: usize, b: usize) -> DeviceResult<bool> {
        driver()?;
        let (dev_a, dev_b) = (Self::handle_of(a)?, Self::handle_of(b)?);
        let mut can = 0;
        // SAFETY: both handles came from `cuDeviceGet`; `can` is a valid out-pointer.
        let code = unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev_a, dev_b) };
        check("cuDeviceCanAccessPeer", code)?;
        Ok(can != 0)
    }

    fn handle_of(ordinal: usize) -> DeviceResult<sys::CUdevice> {
        let mut dev = 0;
        // SAFETY: the driver is initialised and `dev` is a valid out-pointer.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal as i32)
        })?;
        Ok(dev)
    }

    /// Lets this device's context access `peer`'s `malloc` memory (`cuCtxEnablePeerAccess`).
    /// Already enabled is Ok. Virtual-memory ranges use `set_access` with `peers` instead.
    pub fn enable_peer_access(&self, peer: &CudaDevice) -> DeviceResult<()> {
        let _bound = self.bind()?;
        // SAFETY: `peer.ctx` is a live primary context; our context is current on this thread.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) } {
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            code => check("cuCtxEnablePeerAccess", code),
        }
    }

    /// The cudarc context (the device's primary context), for work outside this crate.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes this device's context current on the calling thread until the returned guard is
    /// dropped.
    fn bind(&self) -> DeviceResult<Bound> {
        let ours = self.ctx.cu_ctx();
        let previous = current_context()?;
        if previous == ours {
            return Ok(Bound { previous: None });
        }
        // SAFETY: `ours` is the primary context retained by `self.ctx`, alive while `self` is.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ours) })?;
        Ok(Bound {
            previous: Some(previous),
        })
    }

    /// Copies `data` to device memory at `ptr` and waits for the copy. A test and example
    /// helper: `ptr` must be device memory of this device (the driver refuses addresses it does
    /// not know, but with unified addressing a pinned or managed host buffer has a device
    /// address too, which this would write).
    pub fn copy_to_device(&self, ptr: DevicePtr, data: &[u8]) -> DeviceResult<()> {
        let _bound = self.bind()?;
        let src = data.as_ptr().cast::<c_void>();
        // SAFETY: `src` is valid for `data.len()` bytes for the whole (synchronous) call. `ptr`
        // is the caller's device memory (see above); the driver refuses addresses it does not
        // know.
        let code = unsafe { sys::cuMemcpyHtoD_v2(ptr, src, data.len()) };
        check("cuMemcpyHtoD_v2", code)
    }

    /// Copies device memory at `ptr` into `out` and waits for the copy.
    pub fn copy_from_device(&self, ptr: DevicePtr, out: &mut [u8]) -> DeviceResult<()> {
        let _bound = self.bind()?;
        let dst = out.as_mut_ptr().cast::<c_void>();
        // SAFETY: `dst` is valid for writes of `out.len()` bytes for the whole (synchronous) call,
        // and `out` is exclusively borrowed; the driver validates `ptr`.
        let code = unsafe { sys::cuMemcpyDtoH_v2(dst, ptr, out.len()) };
        check("cuMemcpyDtoH_v2", code)
    }

    /// Enqueues a fill of `len` bytes at `ptr` with `value` on `stream`; returns at once. As
    /// [`CudaDevice::copy_to_device`], `ptr` must be this device's memory, and `stream` a live
    /// stream (the driver does not check a made-up handle).
    pub fn memset_async(
        &self,
        ptr: DevicePtr,
        value: u8,
        len: u64,
        stream: StreamId,
    ) -> DeviceResult<()> {
        let _bound = self.bind()?;
        let raw = stream.0 as sys::CUstream;
        // SAFETY: no host memory is involved; the driver validates `ptr` and the stream handle.
        let code = unsafe { sys::cuMemsetD8Async(ptr, value, len as usize, raw) };
        check("cuMemsetD8Async", code)
    }

    /// Stream-ordered allocation from the device's default memory pool (`cuMemAllocAsync`); the
    /// baseline the benchmarks compare against.
    pub fn malloc_async(&self, size: u64, stream: StreamId) -> DeviceResult<DevicePtr> {
        if size == 0 {
            return Err(DeviceError::invalid("malloc_async", "zero bytes"));
        }
        let _bound = self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the driver validates the stream handle.
        let code =
            unsafe { sys::cuMemAllocAsync(&mut ptr, size as usize, stream.0 as sys::CUstream) };
        check_alloc("cuMemAllocAsync", size, code)?;
        Ok(ptr)
    }

    /// Stream-ordered free of memory from [`CudaDevice::malloc_async`] (`cuMemFreeAsync`).
    pub fn free_async(&self, ptr: DevicePtr, stream: StreamId) -> DeviceResult<()> {
        let _bound = self.bind()?;
        // SAFETY: no host memory is involved; the driver validates `ptr` and the stream handle
        // and returns an error for memory it did not allocate.
        let code = unsafe { sys::cuMemFreeAsync(ptr, stream.0 as sys::CUstream) };
        check("cuMemFreeAsync", code)
    }

    /// InvalidArgument unless `size` is a positive multiple of the granularity (and `va` one).
    fn check_granular(&self, call: &'static str, va: u64, size: u64) -> DeviceResult<()> {
        let g = self.granularity()?; // a power of two
        if size == 0 || size & (g - 1) != 0 {
            let message = format!("size {size} is not a positive multiple of {g}");
            return Err(DeviceError::invalid(call, message));
        }
        if va & (g - 1) != 0 {
            let message = format!("address {va:#x} is not a multiple of {g}");
            return Err(DeviceError::invalid(call, message));
        }
        Ok(())
    }

    /// InvalidArgument unless `event` came from `create_event` and was not destroyed.
    fn check_event(
        events: &HashSet<u64>,
        call: &'static str,
        event: EventHandle,
    ) -> DeviceResult<()> {
        if events.contains(&event.0) {
            Ok(())
        } else {
            Err(DeviceError::invalid(
                call,
                format!("unknown event {:#x}", event.0),
            ))
        }
    }

    /// InvalidArgument unless `va..va + size` may receive `page` as a new mapping.
    fn check_map(mem: &Memory, va: u64, size: u64, page: PageHandle) -> DeviceResult<()> {
        let end = end_of("map", va, size)?;
        let problem = match mem.pages.get(&page.0).filter(|p| !p.released) {
            None => Some(format!("unknown page {:#x}", page.0)),
            Some(p) if p.size != size => Some(format!("page has {} bytes, not {size}", p.size)),
            _ if !mem.reserved(va, end) => Some(format!("{va:#x}+{size} is not reserved")),
            _ if mem.overlaps_mapping(va, end) => Some(format!("{va:#x}+{size} is mapped")),
            _ => None,
        };
        problem.map_or(Ok(()), |message| Err(DeviceError::invalid("map", message)))
    }

    /// One read/write access descriptor for this device and each distinct peer.
    fn access_descriptors(&self, peers: &[usize]) -> Vec<sys::CUmemAccessDesc> {
        let mut ordinals = vec![self.ordinal];
        ordinals.extend(peers.iter().copied().filter(|p| *p != self.ordinal));
        ordinals.sort_unstable();
        ordinals.dedup();
        let read_write = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        let desc = |ordinal| sys::CUmemAccessDesc {
            location: device_location(ordinal),
            flags: read_write,
        };
        ordinals.into_iter().map(desc).collect()
    }
}

impl Device for CudaDevice {
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn malloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        if size == 0 {
            return Err(DeviceError::invalid("malloc", "zero-size request"));
        }
        let _bound = self.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; our context is current on this thread.
        let code = unsafe { sys::cuMemAlloc_v2(&mut ptr, size as usize) };
        check_alloc("cuMemAlloc_v2", size, code)?;
        self.memory.lock().mallocs.insert(ptr, size);
        Ok(ptr)
    }

    fn free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let mut mem = self.memory.lock();
        match mem.mallocs.get(&ptr) {
            Some(&known) if known == size => {}
            Some(&known) => {
                let message = format!("{ptr:#x} has {known} bytes, not {size}");
                return Err(DeviceError::invalid("free", message));
            }
            None => {
                return Err(DeviceError::invalid(
                    "free",
                    format!("unknown pointer {ptr:#x}"),
                ))
            }
        }
        let _bound = self.bind()?;
        // SAFETY: `ptr` came from `cuMemAlloc_v2` and was not freed (it is in the table).
        check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) })?;
        mem.mallocs.remove(&ptr);
        Ok(())
    }

    fn mem_info(&self) -> DeviceResult<(u64, u64)> {
        let _bound = self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers; our context is current on this thread.
        let code = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
        check("cuMemGetInfo_v2", code)?;
        Ok((free as u64, total as u64))
    }

    fn granularity(&self) -> DeviceResult<u64> {
        if let Some(&g) = self.granularity.get() {
            return Ok(g);
        }
        let _bound = self.bind()?;
        let prop = pinned_memory(self.ordinal, false);
        let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        let mut g = 0usize;
        // SAFETY: `g` is a valid out-pointer and `prop` a fully initialised property struct.
        let code = unsafe { sys::cuMemGetAllocationGranularity(&mut g, &prop, minimum) };
        check("cuMemGetAllocationGranularity", code)?;
        if !g.is_power_of_two() {
            return Err(DeviceError::Driver {
                call: "cuMemGetAllocationGranularity",
                code: 0,
                message: format!("granularity {g} is not a power of two"),
            });
        }
        Ok(*self.granularity.get_or_init(|| g as u64))
    }

    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.check_granular("reserve", 0, size)?;
        let _bound = self.bind()?;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: `va` is a valid out-pointer; alignment 0 and address 0 let the driver choose.
        let code = unsafe { sys::cuMemAddressReserve(&mut va, size as usize, 0, 0, 0) };
        check_alloc("cuMemAddressReserve", size, code)?;
        self.memory.lock().reservations.insert(va, size);
        Ok(va)
    }

    fn unreserve(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        let mut mem = self.memory.lock();
        if mem.reservations.get(&va) != Some(&size) {
            let message = format!("no reservation of {size} bytes at {va:#x}");
            return Err(DeviceError::invalid("unreserve", message));
        }
        if mem.overlaps_mapping(va, va + size) {
            let message = format!("{va:#x}+{size} still has mappings");
            return Err(DeviceError::invalid("unreserve", message));
        }
        let _bound = self.bind()?;
        // SAFETY: the range is a live reservation from `cuMemAddressReserve` with nothing mapped.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(va, size as usize)
        })?;
        mem.reservations.remove(&va);
        Ok(())
    }

    fn create_page(&self, size: u64) -> DeviceResult<PageHandle> {
        self.cuda_create_page(size, false)
    }

    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        let mut mem = self.memory.lock();
        if mem.pages.get(&page.0).is_none_or(|p| p.released) {
            let message = format!("unknown page {:#x}", page.0);
            return Err(DeviceError::invalid("release_page", message));
        }
        let _bound = self.bind()?;
        // SAFETY: the handle came from `cuMemCreate` and was not released (it is in the table,
        // not marked released). A mapped handle may be released: its memory stays until its
        // last mapping is unmapped.
        check("cuMemRelease", unsafe { sys::cuMemRelease(page.0) })?;
        mem.page_released(page.0);
        Ok(())
    }

    fn map(&self, va: DevicePtr, size: u64, page: PageHandle) -> DeviceResult<()> {
        self.check_granular("map", va, size)?;
        let mut mem = self.memory.lock();
        Self::check_map(&mem, va, size, page)?;
        let _bound = self.bind()?;
        // SAFETY: `va..va+size` is unmapped inside a live reservation and `page` is a live handle
        // of exactly `size` bytes (checked against the tables above).
        let code = unsafe { sys::cuMemMap(va, size as usize, 0, page.0, 0) };
        check("cuMemMap", code)?;
        mem.mappings.insert(va, Mapping { size, page: page.0 });
        if let Some(p) = mem.pages.get_mut(&page.0) {
            p.mappings += 1;
        }
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        self.check_granular("unmap", va, size)?;
        let mut mem = self.memory.lock();
        let Some(mapping) = mem.mappings.get(&va).copied().filter(|m| m.size == size) else {
            let message = format!("no mapping of {size} bytes at {va:#x}");
            return Err(DeviceError::invalid("unmap", message));
        };
        let _bound = self.bind()?;
        // SAFETY: `va..va+size` is exactly one live mapping made by `cuMemMap`.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(va, size as usize) })?;
        mem.mappings.remove(&va);
        if let Some(p) = mem.pages.get_mut(&mapping.page) {
            p.mappings -= 1;
            if p.released && p.mappings == 0 {
                mem.pages.remove(&mapping.page);
            }
        }
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, size: u64, peers: &[usize]) -> DeviceResult<()> {
        self.check_granular("set_access", va, size)?;
        let end = end_of("set_access", va, size)?;
        let mem = self.memory.lock();
        if !mem.fully_mapped(va, end) {
            let message = format!("{va:#x}+{size} is not a range of whole mappings");
            return Err(DeviceError::invalid("set_access", message));
        }
        let descs = self.access_descriptors(peers);
        let _bound = self.bind()?;
        // SAFETY: the range is mapped (checked above); `descs` holds `descs.len()` initialised
        // descriptors and outlives the call.
        let code = unsafe { sys::cuMemSetAccess(va, size as usize, descs.as_ptr(), descs.len()) };
        check("cuMemSetAccess", code)
    }

    fn create_event(&self) -> DeviceResult<EventHandle> {
        let _bound = self.bind()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `raw` is a valid out-pointer; our context is current on this thread.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        self.events.write().insert(raw as u64);
        Ok(EventHandle(raw as u64))
    }

    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        let mut events = self.events.write();
        Self::check_event(&events, "destroy_event", event)?;
        let _bound = self.bind()?;
        // SAFETY: the event is live (in the set), and the write lock keeps every other use of it
        // out until it is removed.
        let code = unsafe { sys::cuEventDestroy_v2(event.0 as sys::CUevent) };
        check("cuEventDestroy_v2", code)?;
        events.remove(&event.0);
        Ok(())
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        let events = self.events.read_recursive();
        Self::check_event(&events, "record_event", event)?;
        let _bound = self.bind()?;
        let raw_stream = stream.0 as sys::CUstream;
        // SAFETY: the event is live and cannot be destroyed while the read lock is held; the
        // driver validates the stream handle (0 is the legacy default stream).
        let code = unsafe { sys::cuEventRecord(event.0 as sys::CUevent, raw_stream) };
        check("cuEventRecord", code)
    }

    /// The legacy default stream (0, and 1: `cudaStreamLegacy`) is that of whatever context is
    /// current when an event is recorded, ours then. The per-thread default stream (2) is
    /// refused: its one handle names a different stream on each thread. Any other stream must
    /// belong to our context (`cuStreamGetCtx`).
    fn check_stream(&self, stream: StreamId) -> DeviceResult<()> {
        if stream.0 == 2 {
            let msg = "the per-thread default stream (0x2) is a different stream on each thread";
            return Err(DeviceError::invalid("check_stream", msg));
        }
        if stream.0 <= 1 {
            return Ok(());
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; the driver validates the stream handle as
        // cuEventRecord would (the caller's stream must be a live stream, as for every call
        // taking one).
        let code = unsafe { sys::cuStreamGetCtx(stream.0 as sys::CUstream, &mut ctx) };
        check("cuStreamGetCtx", code)?;
        if ctx != self.ctx.cu_ctx() {
            let msg = format!(
                "stream {:#x} belongs to another context (another device's), not device {}'s",
                stream.0, self.ordinal
            );
            return Err(DeviceError::invalid("cuStreamGetCtx", msg));
        }
        Ok(())
    }

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let events = self.events.read_recursive();
        Self::check_event(&events, "query_event", event)?;
        let _bound = self.bind()?;
        // SAFETY: the event is live and cannot be destroyed while the read lock is held.
        match unsafe { sys::cuEventQuery(event.0 as sys::CUevent) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => check("cuEventQuery", code).map(|()| true),
        }
    }

    fn synchronize_device(&self) -> DeviceResult<()> {
        self.synchronize()
    }

    fn is_capturing(&self, stream: StreamId) -> DeviceResult<bool> {
        self.capture_status(stream)
    }

    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()> {
        let events = self.events.read_recursive();
        Self::check_event(&events, "synchronize_event", event)?;
        let _bound = self.bind()?;
        // SAFETY: the event is live and cannot be destroyed while the read lock is held.
        let code = unsafe { sys::cuEventSynchronize(event.0 as sys::CUevent) };
        check("cuEventSynchronize", code)
    }

    fn alloc_host(&self, size: u64) -> DeviceResult<HostPtr> {
        self.cuda_alloc_host(size)
    }
    fn free_host(&self, ptr: HostPtr, size: u64) -> DeviceResult<()> {
        self.cuda_free_host(ptr, size)
    }
    fn copy_to_host_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        self.cuda_copy_to_host_async(dst, src, n, s)
    }
    fn copy_to_device_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        self.cuda_copy_to_device_async(dst, src, n, s)
    }
    fn copy_device_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        self.cuda_copy_device_async(dst, src, n, s)
    }
    fn open_stream(&self) -> DeviceResult<StreamId> {
        self.cuda_open_stream()
    }
    fn close_stream(&self, stream: StreamId) -> DeviceResult<()> {
        CudaDevice::destroy_stream(self, stream)
    }
    fn wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        self.cuda_wait_event(stream, event)
    }
    fn can_share(&self) -> DeviceResult<bool> {
        self.cuda_can_share()
    }
    fn create_shareable_page(&self, size: u64) -> DeviceResult<PageHandle> {
        self.cuda_create_page(size, true)
    }
    fn export_page(&self, page: PageHandle) -> DeviceResult<OwnedFd> {
        self.cuda_export_page(page)
    }
    fn import_page(&self, fd: BorrowedFd<'_>, size: u64) -> DeviceResult<PageHandle> {
        self.cuda_import_page(fd, size)
    }
}
