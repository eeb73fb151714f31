//! The device contract: everything cudalloc asks of a GPU driver.
//!
//! The caching allocator never calls the driver directly; it calls a [`Device`]. Two
//! implementations exist: [`crate::CudaDevice`] (the CUDA driver through cudarc) and
//! [`crate::SimDevice`] (host only, deterministic). Wrappers in [`crate::wrap`] add behaviour for
//! tests and debugging (a byte limit, failing calls, call counting, call timing, a call log)
//! around any device.
//!
//! # Addresses and sizes
//!
//! - Addresses are device virtual addresses as `u64` ([`DevicePtr`]); `0` is never a valid result.
//! - [`Device::malloc`] returns memory aligned to at least [`MALLOC_ALIGNMENT`] (256 B, CUDA's
//!   guarantee). A zero-size request is an [`DeviceError::InvalidArgument`]: the allocator never
//!   asks the device for zero bytes (it rounds every request up to at least 512 B first).
//! - Virtual memory works in multiples of [`Device::granularity`] (2 MiB on the H200). `reserve`,
//!   `create_page`, `map`, `unmap` and `set_access` take sizes and addresses that are multiples of
//!   it; anything else is [`DeviceError::InvalidArgument`].
//! - A reserved range holds no memory until a physical page is created and mapped into it, and is
//!   not readable or writable until `set_access` was called on the mapped range. A page may be
//!   mapped at several addresses at once: each is the same memory.
//!
//! # Calls and their pairs
//!
//! | acquire | release | precondition of the release |
//! | --- | --- | --- |
//! | `malloc(size) -> ptr` | `free(ptr, size)` | `ptr` came from `malloc` with that `size` |
//! | `reserve(size) -> va` | `unreserve(va, size)` | nothing is mapped inside it any more |
//! | `create_page(size) -> page` | `release_page(page)` | none (a page still mapped keeps its memory until its last unmap) |
//! | `map(va, size, page)` | `unmap(va, size)` | `va..va+size` is exactly one mapped page's range |
//! | `create_event() -> ev` | `destroy_event(ev)` | none |
//! | `create_shareable_page(size) -> page` | `release_page(page)` | as for `create_page` |
//! | `import_page(fd, size) -> page` | `release_page(page)` | as for `create_page` |
//! | `export_page(page) -> fd` | dropping the fd (it closes) | none |
//!
//! Releasing something that was not acquired, or releasing it twice, is
//! [`DeviceError::InvalidArgument`], never undefined behaviour.
//!
//! # Sharing pages with another process
//!
//! A page made by `create_shareable_page` (physical memory that may be exported as a POSIX file
//! descriptor; `can_share` says whether the device can make one) can be exported with
//! `export_page`: the file descriptor, moved to another process (over a Unix socket,
//! [`crate::fds`]), is imported there with `import_page` as a page of its own, which that
//! process maps into its own reservation like any page. The physical memory lives while any
//! page handle to it, in any process, is not released: an importer that keeps its handle
//! keeps the memory after the exporter released its own. Exporting a page made by
//! `create_page` fails with the driver's error, [`DeviceError::Driver`] code
//! [`NOT_EXPORTABLE`]. `import_page` takes the page's size from the exporter (the description
//! that travels with the descriptor); the descriptor stays the caller's (importing does not
//! close it). A descriptor must be imported while the exporter still holds the page.
//!
//! # Errors
//!
//! - [`DeviceError::OutOfMemory`] means *only* that the device could not supply the memory asked
//!   for (`malloc`, `create_page`, and `reserve` when the address space is exhausted). The caller
//!   may free cached memory and retry. Nothing was acquired.
//! - [`DeviceError::Driver`] is any other failure reported by the driver (the call name and the
//!   driver's code and message are kept). Nothing was acquired.
//! - [`DeviceError::Unavailable`] means there is no driver at all (no `libcuda`, no GPU). Every
//!   call of a [`crate::CudaDevice`] on such a machine returns it; none panics.
//! - [`DeviceError::InvalidArgument`] is a caller bug caught at the boundary (misaligned size,
//!   unknown handle, double release).
//!
//! A failed call leaves the device exactly as it was before the call.
//!
//! # Streams and events
//!
//! A [`StreamId`] is the raw `CUstream` handle as a number (`0` is the legacy default stream). The
//! device does not own streams; it records events on them. `query_event` returns `true` once all
//! work submitted to the stream before `record_event` has completed. An event may be recorded
//! again after it completed; the allocator pools events rather than creating one per free.
//!
//! # Host memory, copies and the allocator's streams
//!
//! `alloc_host` returns pinned (page-locked) host memory ([`HostPtr`], an address in the host's
//! address space, never `0`), which the device may copy to and from asynchronously;
//! `free_host` gives it back and waits for copies still using it. `copy_to_host_async` and
//! `copy_to_device_async` enqueue a copy of `size` bytes on a stream: the copy runs after the
//! stream's earlier work and before its later work, and the caller may read or overwrite the
//! host side only once an event recorded after it completed. The device side must be memory
//! this device made accessible (a `malloc` result, or pages mapped and made accessible); the
//! host side must lie inside one `alloc_host` result. `copy_device_async` enqueues a copy
//! between two device ranges, both accessible as above and not overlapping, in the same order
//! on its stream. `open_stream` makes a stream of the device's own (the allocator's copy
//! stream), `close_stream` ends one it made, and `wait_event` makes later work on a stream wait
//! for an event (no host wait). Pinned host memory is not device memory: a byte limit on the
//! device does not count it.
//!
//! | acquire | release | precondition of the release |
//! | --- | --- | --- |
//! | `alloc_host(size) -> ptr` | `free_host(ptr, size)` | `ptr` came from `alloc_host` with that `size` |
//! | `open_stream() -> stream` | `close_stream(stream)` | the stream came from `open_stream` |
//!
//! # Graph capture
//!
//! While a stream is captured into a CUDA graph ([`CaptureMode`]), work submitted to it is
//! recorded, not run, and some calls are refused with [`DeviceError::Driver`] code
//! [`CAPTURE_UNSUPPORTED`] (900, `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`); a refused call also
//! invalidates the capture, whose end then fails. [`CaptureMode::forbids`] says which calls a
//! mode refuses, as measured on an H200; [`DeviceError::is_capture_unsupported`] recognises the
//! error. [`Device::is_capturing`] says whether a stream is being captured. An event recorded on
//! a capturing stream becomes a node of the graph: querying or waiting for it afterwards is
//! refused with code [`CAPTURED_EVENT`] (1) until it is recorded again outside a capture.
//!
//! # Threads
//!
//! Every method takes `&self`; implementations are `Send + Sync` and may be called from any thread.

use std::fmt;
use std::os::fd::{BorrowedFd, OwnedFd};

/// A device virtual address.
pub type DevicePtr = u64;

/// Alignment of every [`Device::malloc`] result, in bytes.
pub const MALLOC_ALIGNMENT: u64 = 256;

/// An address of pinned host memory from [`Device::alloc_host`].
pub type HostPtr = u64;

/// A CUDA stream, as the raw handle value (`0` is the legacy default stream).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The legacy default stream.
    pub const DEFAULT: StreamId = StreamId(0);
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {:#x}", self.0)
    }
}

/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: the call is not permitted while a stream is captured.
pub const CAPTURE_UNSUPPORTED: i32 = 900;
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`: the capture was invalidated by a refused call.
pub const CAPTURE_INVALIDATED: i32 = 901;
/// What the driver answers a query of, or a wait for, an event last recorded on a capturing
/// stream: `CUDA_ERROR_INVALID_VALUE` (measured on an H200, driver 580, in global mode; not
/// `CUDA_ERROR_CAPTURED_EVENT`, 907, as its documentation suggests).
pub const CAPTURED_EVENT: i32 = 1;

/// What the driver answers an export of a page that was not created exportable
/// (`CUDA_ERROR_INVALID_VALUE`; the GPU test `export_of_a_plain_page_is_refused` checks it).
pub const NOT_EXPORTABLE: i32 = 1;

/// How a stream capture restricts calls (`CUstreamCaptureMode`); see [`CaptureMode::forbids`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL`: unsafe calls are refused on every thread.
    Global,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: unsafe calls are refused on the capturing thread.
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`: only a device-wide synchronize is refused.
    Relaxed,
}

impl CaptureMode {
    /// Every mode.
    pub const ALL: [CaptureMode; 3] = [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ];

    /// True if a capture in this mode refuses `call` when it is made from the thread that began
    /// the capture (`same_thread`) or from another thread. Measured on an H200 (driver 580):
    /// in global and thread-local mode `malloc` (`cuMemAlloc`), `query_event` (`cuEventQuery`
    /// of an event recorded on another stream) and `synchronize_device` (`cuCtxSynchronize`)
    /// are refused, and `free` (which synchronizes implicitly) and `synchronize_event` are
    /// taken to be refused like them (and so are `alloc_host` and `free_host`, not measured);
    /// in relaxed mode only `synchronize_device` is. Thread-local
    /// mode refuses only on the capturing thread, global mode on every thread.
    /// `synchronize_device` waits for the capturing stream itself, which no mode allows, so it
    /// is refused on every thread in every mode. The virtual-memory calls, `record_event` and
    /// the rest are never refused.
    pub fn forbids(self, call: Call, same_thread: bool) -> bool {
        let unsafe_call = matches!(
            call,
            Call::Malloc
                | Call::Free
                | Call::QueryEvent
                | Call::SynchronizeEvent
                | Call::AllocHost
                | Call::FreeHost
        );
        match self {
            _ if call == Call::SynchronizeDevice => true,
            CaptureMode::Global => unsafe_call,
            CaptureMode::ThreadLocal => unsafe_call && same_thread,
            CaptureMode::Relaxed => false,
        }
    }

    /// The mode's name: `global`, `thread_local` or `relaxed`.
    pub fn name(self) -> &'static str {
        match self {
            CaptureMode::Global => "global",
            CaptureMode::ThreadLocal => "thread_local",
            CaptureMode::Relaxed => "relaxed",
        }
    }
}

/// A physical memory page created by [`Device::create_page`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageHandle(pub u64);

/// An event created by [`Device::create_event`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventHandle(pub u64);

/// Why a device call failed. See the module documentation for what each kind promises.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceError {
    /// The device could not supply `requested` bytes.
    OutOfMemory {
        /// The call that ran out of memory.
        call: &'static str,
        /// Bytes asked for.
        requested: u64,
    },
    /// The driver reported an error other than out-of-memory.
    Driver {
        /// The driver entry point.
        call: &'static str,
        /// The driver's error code (a `CUresult` value on CUDA, 999 for an injected fault).
        code: i32,
        /// The driver's message.
        message: String,
    },
    /// No driver is present (no `libcuda`, no GPU): the message says what was missing.
    Unavailable(String),
    /// The caller broke the contract (misaligned size, unknown handle, double release).
    InvalidArgument {
        /// The call that rejected its arguments.
        call: &'static str,
        /// What was wrong.
        message: String,
    },
}

impl DeviceError {
    /// True for [`DeviceError::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, DeviceError::OutOfMemory { .. })
    }

    /// True for a [`DeviceError::Driver`] error with code [`CAPTURE_UNSUPPORTED`]: `call` is not
    /// permitted while a stream is captured (and the capture is now invalidated).
    pub fn is_capture_unsupported(&self) -> bool {
        matches!(self, DeviceError::Driver { code, .. } if *code == CAPTURE_UNSUPPORTED)
    }

    /// The error a call refused by a capture returns ([`CAPTURE_UNSUPPORTED`]).
    pub fn capture_unsupported(call: &'static str) -> Self {
        DeviceError::Driver {
            call,
            code: CAPTURE_UNSUPPORTED,
            message: "operation not permitted when stream is capturing".into(),
        }
    }

    /// Shorthand for an [`DeviceError::InvalidArgument`].
    pub fn invalid(call: &'static str, message: impl Into<String>) -> Self {
        DeviceError::InvalidArgument {
            call,
            message: message.into(),
        }
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::OutOfMemory { call, requested } => {
                write!(
                    f,
                    "{call}: out of device memory ({requested} bytes requested)"
                )
            }
            DeviceError::Driver {
                call,
                code,
                message,
            } => write!(f, "{call}: driver error {code}: {message}"),
            DeviceError::Unavailable(why) => write!(f, "no CUDA device available: {why}"),
            DeviceError::InvalidArgument { call, message } => {
                write!(f, "{call}: invalid argument: {message}")
            }
        }
    }
}

impl std::error::Error for DeviceError {}

/// Result of a device call.
pub type DeviceResult<T> = Result<T, DeviceError>;

/// The kinds of device call, for counters and fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Call {
    /// [`Device::malloc`]
    Malloc,
    /// [`Device::free`]
    Free,
    /// [`Device::reserve`]
    Reserve,
    /// [`Device::unreserve`]
    Unreserve,
    /// [`Device::create_page`]
    CreatePage,
    /// [`Device::release_page`]
    ReleasePage,
    /// [`Device::map`]
    Map,
    /// [`Device::unmap`]
    Unmap,
    /// [`Device::set_access`]
    SetAccess,
    /// [`Device::create_event`]
    CreateEvent,
    /// [`Device::destroy_event`]
    DestroyEvent,
    /// [`Device::record_event`]
    RecordEvent,
    /// [`Device::query_event`]
    QueryEvent,
    /// [`Device::synchronize_event`]
    SynchronizeEvent,
    /// [`Device::synchronize_device`]
    SynchronizeDevice,
    /// [`Device::mem_info`]
    MemInfo,
    /// [`Device::is_capturing`]
    CaptureStatus,
    /// [`Device::alloc_host`]
    AllocHost,
    /// [`Device::free_host`]
    FreeHost,
    /// [`Device::copy_to_host_async`]
    CopyToHostAsync,
    /// [`Device::copy_to_device_async`]
    CopyToDeviceAsync,
    /// [`Device::copy_device_async`]
    CopyDeviceAsync,
    /// [`Device::open_stream`]
    OpenStream,
    /// [`Device::close_stream`]
    CloseStream,
    /// [`Device::wait_event`]
    WaitEvent,
    /// [`Device::export_page`]
    ExportPage,
    /// [`Device::import_page`]
    ImportPage,
}

impl Call {
    /// Every kind of call, in declaration order.
    pub const ALL: [Call; 27] = [
        Call::Malloc,
        Call::Free,
        Call::Reserve,
        Call::Unreserve,
        Call::CreatePage,
        Call::ReleasePage,
        Call::Map,
        Call::Unmap,
        Call::SetAccess,
        Call::CreateEvent,
        Call::DestroyEvent,
        Call::RecordEvent,
        Call::QueryEvent,
        Call::SynchronizeEvent,
        Call::SynchronizeDevice,
        Call::MemInfo,
        Call::CaptureStatus,
        Call::AllocHost,
        Call::FreeHost,
        Call::CopyToHostAsync,
        Call::CopyToDeviceAsync,
        Call::CopyDeviceAsync,
        Call::OpenStream,
        Call::CloseStream,
        Call::WaitEvent,
        Call::ExportPage,
        Call::ImportPage,
    ];

    /// Index into [`Call::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The call's name as the contract spells it.
    pub fn name(self) -> &'static str {
        match self {
            Call::Malloc => "malloc",
            Call::Free => "free",
            Call::Reserve => "reserve",
            Call::Unreserve => "unreserve",
            Call::CreatePage => "create_page",
            Call::ReleasePage => "release_page",
            Call::Map => "map",
            Call::Unmap => "unmap",
            Call::SetAccess => "set_access",
            Call::CreateEvent => "create_event",
            Call::DestroyEvent => "destroy_event",
            Call::RecordEvent => "record_event",
            Call::QueryEvent => "query_event",
            Call::SynchronizeEvent => "synchronize_event",
            Call::SynchronizeDevice => "synchronize_device",
            Call::MemInfo => "mem_info",
            Call::CaptureStatus => "is_capturing",
            Call::AllocHost => "alloc_host",
            Call::FreeHost => "free_host",
            Call::CopyToHostAsync => "copy_to_host_async",
            Call::CopyToDeviceAsync => "copy_to_device_async",
            Call::CopyDeviceAsync => "copy_device_async",
            Call::OpenStream => "open_stream",
            Call::CloseStream => "close_stream",
            Call::WaitEvent => "wait_event",
            Call::ExportPage => "export_page",
            Call::ImportPage => "import_page",
        }
    }

    /// True for calls that release something; wrappers never inject faults into these, so that
    /// cleanup paths stay testable (a real driver does not fail a free of valid memory).
    pub fn is_release(self) -> bool {
        matches!(
            self,
            Call::Free
                | Call::Unreserve
                | Call::ReleasePage
                | Call::Unmap
                | Call::DestroyEvent
                | Call::FreeHost
                | Call::CloseStream
        )
    }
}

/// A GPU as the allocator sees it. The module documentation is the contract.
pub trait Device: Send + Sync {
    /// The device ordinal (0 for the first GPU).
    fn ordinal(&self) -> usize;

    /// Allocates `size` bytes of device memory, aligned to [`MALLOC_ALIGNMENT`].
    fn malloc(&self, size: u64) -> DeviceResult<DevicePtr>;
    /// Frees memory from [`Device::malloc`]; `size` is the size it was allocated with.
    fn free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()>;
    /// Free and total device memory in bytes.
    fn mem_info(&self) -> DeviceResult<(u64, u64)>;

    /// The virtual-memory page granularity in bytes (a power of two).
    fn granularity(&self) -> DeviceResult<u64>;
    /// Reserves `size` bytes of virtual address space (a multiple of the granularity).
    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr>;
    /// Frees a reservation; nothing may be mapped inside it.
    fn unreserve(&self, va: DevicePtr, size: u64) -> DeviceResult<()>;
    /// Creates one physical page of `size` bytes (a multiple of the granularity).
    fn create_page(&self, size: u64) -> DeviceResult<PageHandle>;
    /// Releases a physical page: the handle takes no more calls, and the memory goes once the
    /// page is mapped nowhere (at once, or at its last unmap, as `cuMemRelease`).
    fn release_page(&self, page: PageHandle) -> DeviceResult<()>;
    /// Maps `page` (of exactly `size` bytes) at `va` inside a reservation; a page may be mapped
    /// at several addresses, each the same memory.
    fn map(&self, va: DevicePtr, size: u64, page: PageHandle) -> DeviceResult<()>;
    /// Unmaps the page mapped at exactly `va..va + size`.
    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()>;
    /// Makes a mapped range readable and writable from this device (and from `peers`).
    fn set_access(&self, va: DevicePtr, size: u64, peers: &[usize]) -> DeviceResult<()>;

    /// Creates an event.
    fn create_event(&self) -> DeviceResult<EventHandle>;
    /// Destroys an event.
    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()>;
    /// Records `event` on `stream`: it completes once the stream's earlier work has.
    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()>;
    /// Checks that this device's events can be recorded on `stream` (on CUDA: a stream of this
    /// device's context, or the legacy default stream; the per-thread default stream is refused,
    /// its one handle naming a different stream on each thread). The allocator asks before it
    /// takes a `record_stream`, whose event is recorded only at the free, when a refusal could
    /// no longer be undone. `stream` must be a live stream (or a default one): as for every
    /// call taking a stream, the driver does not check a made-up handle.
    fn check_stream(&self, stream: StreamId) -> DeviceResult<()>;
    /// True once the work before the last `record_event` has completed.
    fn query_event(&self, event: EventHandle) -> DeviceResult<bool>;
    /// Blocks until the event has completed.
    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()>;
    /// Blocks until all work submitted to the device so far has completed. The allocator calls
    /// it only on its synchronizing paths: `empty_cache`, an explicit synchronize, and the last
    /// rung of the out-of-memory ladder. Every capture mode refuses it.
    fn synchronize_device(&self) -> DeviceResult<()>;
    /// True while a capture of `stream` is underway: active, or invalidated by a refused call
    /// and not yet ended. Never refused by a capture.
    fn is_capturing(&self, stream: StreamId) -> DeviceResult<bool>;

    /// Allocates `size` bytes (not zero) of pinned host memory.
    fn alloc_host(&self, size: u64) -> DeviceResult<HostPtr>;
    /// Frees pinned host memory from [`Device::alloc_host`]; `size` is the size it was
    /// allocated with.
    fn free_host(&self, ptr: HostPtr, size: u64) -> DeviceResult<()>;
    /// Enqueues on `stream` a copy of `size` bytes from device address `src` to pinned host
    /// memory at `dst`.
    fn copy_to_host_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        size: u64,
        stream: StreamId,
    ) -> DeviceResult<()>;
    /// Enqueues on `stream` a copy of `size` bytes from pinned host memory at `src` to device
    /// address `dst`.
    fn copy_to_device_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        size: u64,
        stream: StreamId,
    ) -> DeviceResult<()>;
    /// Enqueues on `stream` a copy of `size` bytes from device address `src` to device address
    /// `dst` (ranges that do not overlap).
    fn copy_device_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        size: u64,
        stream: StreamId,
    ) -> DeviceResult<()>;
    /// Creates a stream of the device's own that does not synchronise with the legacy default
    /// stream.
    fn open_stream(&self) -> DeviceResult<StreamId>;
    /// Destroys a stream from [`Device::open_stream`] (its pending work still completes).
    fn close_stream(&self, stream: StreamId) -> DeviceResult<()>;
    /// Makes work submitted to `stream` after this call wait for `event` (no host wait).
    fn wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()>;

    /// True if the device can make pages exportable as POSIX file descriptors
    /// ([`Device::create_shareable_page`]). A plain query, like `granularity`.
    fn can_share(&self) -> DeviceResult<bool>;
    /// Creates one physical page of `size` bytes, as [`Device::create_page`] (and counted as
    /// one), that [`Device::export_page`] can export.
    fn create_shareable_page(&self, size: u64) -> DeviceResult<PageHandle>;
    /// Exports `page` as a POSIX file descriptor another process can import. A page made by
    /// `create_page` is refused with driver code [`NOT_EXPORTABLE`].
    fn export_page(&self, page: PageHandle) -> DeviceResult<OwnedFd>;
    /// Imports the page behind `fd` (from [`Device::export_page`], here or in another process)
    /// as a page handle of its own, of `size` bytes; release it with `release_page`.
    fn import_page(&self, fd: BorrowedFd<'_>, size: u64) -> DeviceResult<PageHandle>;
}

impl<D: Device + ?Sized> Device for std::sync::Arc<D> {
    fn ordinal(&self) -> usize {
        (**self).ordinal()
    }
    fn malloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        (**self).malloc(size)
    }
    fn free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        (**self).free(ptr, size)
    }
    fn mem_info(&self) -> DeviceResult<(u64, u64)> {
        (**self).mem_info()
    }
    fn granularity(&self) -> DeviceResult<u64> {
        (**self).granularity()
    }
    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        (**self).reserve(size)
    }
    fn unreserve(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        (**self).unreserve(va, size)
    }
    fn create_page(&self, size: u64) -> DeviceResult<PageHandle> {
        (**self).create_page(size)
    }
    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        (**self).release_page(page)
    }
    fn map(&self, va: DevicePtr, size: u64, page: PageHandle) -> DeviceResult<()> {
        (**self).map(va, size, page)
    }
    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        (**self).unmap(va, size)
    }
    fn set_access(&self, va: DevicePtr, size: u64, peers: &[usize]) -> DeviceResult<()> {
        (**self).set_access(va, size, peers)
    }
    fn create_event(&self) -> DeviceResult<EventHandle> {
        (**self).create_event()
    }
    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        (**self).destroy_event(event)
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        (**self).record_event(event, stream)
    }
    fn check_stream(&self, stream: StreamId) -> DeviceResult<()> {
        (**self).check_stream(stream)
    }
    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        (**self).query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()> {
        (**self).synchronize_event(event)
    }
    fn synchronize_device(&self) -> DeviceResult<()> {
        (**self).synchronize_device()
    }
    fn is_capturing(&self, stream: StreamId) -> DeviceResult<bool> {
        (**self).is_capturing(stream)
    }
    fn alloc_host(&self, size: u64) -> DeviceResult<HostPtr> {
        (**self).alloc_host(size)
    }
    fn free_host(&self, ptr: HostPtr, size: u64) -> DeviceResult<()> {
        (**self).free_host(ptr, size)
    }
    fn copy_to_host_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        (**self).copy_to_host_async(dst, src, n, s)
    }
    fn copy_to_device_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        (**self).copy_to_device_async(dst, src, n, s)
    }
    fn copy_device_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        (**self).copy_device_async(dst, src, n, s)
    }
    fn open_stream(&self) -> DeviceResult<StreamId> {
        (**self).open_stream()
    }
    fn close_stream(&self, stream: StreamId) -> DeviceResult<()> {
        (**self).close_stream(stream)
    }
    fn wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        (**self).wait_event(stream, event)
    }
    fn can_share(&self) -> DeviceResult<bool> {
        (**self).can_share()
    }
    fn create_shareable_page(&self, size: u64) -> DeviceResult<PageHandle> {
        (**self).create_shareable_page(size)
    }
    fn export_page(&self, page: PageHandle) -> DeviceResult<OwnedFd> {
        (**self).export_page(page)
    }
    fn import_page(&self, fd: BorrowedFd<'_>, size: u64) -> DeviceResult<PageHandle> {
        (**self).import_page(fd, size)
    }
}
