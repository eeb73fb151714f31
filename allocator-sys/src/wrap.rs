//! Adaptors around any [`Device`]: a byte limit, injected faults, call counters, call times, a
//! call log, and event answers recorded and played again.
//!
//! # Why wrappers and not flags in the pool
//!
//! The caching allocator should only know how to carve blocks out of segments and pages and hand
//! them to streams. Testing and debugging concerns ("pretend the device has 4 GiB", "fail the
//! third malloc", "how many times did we call the driver?", "print every driver call") are not
//! part of that job, and each would need a branch on the allocator's hot path if it lived there
//! as a flag. Instead, each concern is a small type that *is* a [`Device`] and holds another
//! device: it does its one thing and forwards the call. The allocator cannot tell a wrapped
//! device from a bare one, so wrappers stack in any order (`LogCalls<Limit<CudaDevice>>`), work
//! over the real driver as well as over [`crate::SimDevice`], and cost nothing when unused. This
//! is the idea behind RMM's resource adaptors, applied at the device boundary.
//!
//! The building blocks [`CallCounters`] and [`FaultPlan`] are public; [`crate::SimDevice`]
//! shares [`FaultPlan`] with [`FailCalls`], so its faults follow the exact same rules, and counts
//! calls as [`CountCalls`] does (every call of a kind, failed or not), under its own lock.
//!
//! Only the [`Call`] kinds are counted, timed, failed or logged; `ordinal`, `granularity`,
//! `check_stream` and `can_share` are plain queries and are forwarded untouched.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use std::os::fd::{BorrowedFd, OwnedFd};

use crate::device::{
    Call, Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostPtr, PageHandle, StreamId,
};

mod counters;
pub use counters::{CallCounters, FaultPlan};

/// Outstanding physical bytes (malloc'd segments plus created pages) seen through a wrapper.
#[derive(Debug, Default)]
struct Bytes {
    outstanding: u64,
    pages: HashMap<PageHandle, u64>,
}

impl Bytes {
    /// Adds `size` unless that would exceed `limit`.
    fn try_add(&mut self, size: u64, limit: u64) -> bool {
        match self.outstanding.checked_add(size) {
            Some(n) if n <= limit => {
                self.outstanding = n;
                true
            }
            _ => false,
        }
    }

    fn sub(&mut self, size: u64) {
        self.outstanding = self.outstanding.saturating_sub(size);
    }

    fn release_page(&mut self, page: PageHandle) {
        let size = self.pages.remove(&page).unwrap_or(0);
        self.sub(size);
    }
}

/// Forwards the [`Device`] methods whose behaviour a wrapper does not change.
macro_rules! forward {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        $(fn $name(&self, $($arg: $ty),*) -> $ret { self.inner.$name($($arg),*) })*
    };
}

/// Caps the physical bytes outstanding on the inner device (malloc sizes plus page sizes, minus
/// frees and releases; a page released while still mapped leaves the count at its release, though
/// the driver frees it only at its last unmap). A request over the limit is
/// [`DeviceError::OutOfMemory`] and never reaches the inner device. The limit may be changed at any
/// time; lowering it below what is outstanding only makes later requests fail.
#[derive(Debug)]
pub struct Limit<D> {
    inner: D,
    limit: AtomicU64,
    bytes: Mutex<Bytes>,
}

impl<D: Device> Limit<D> {
    /// Wraps `inner` with a limit of `limit` bytes.
    pub fn new(inner: D, limit: u64) -> Self {
        Self {
            inner,
            limit: AtomicU64::new(limit),
            bytes: Mutex::new(Bytes::default()),
        }
    }

    /// The current limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Changes the limit.
    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Bytes malloc'd or held in pages through this wrapper and not yet given back.
    pub fn outstanding_bytes(&self) -> u64 {
        self.bytes.lock().outstanding
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Unwraps the device.
    pub fn into_inner(self) -> D {
        self.inner
    }

    /// Books `size` bytes against the limit, or fails without touching the inner device.
    fn book(&self, call: Call, size: u64) -> DeviceResult<()> {
        if self.bytes.lock().try_add(size, self.limit()) {
            Ok(())
        } else {
            Err(DeviceError::OutOfMemory {
                call: call.name(),
                requested: size,
            })
        }
    }

    /// Books a page of `size` bytes, then makes it with `create` on the inner device.
    fn book_page(
        &self,
        size: u64,
        create: impl FnOnce(&D) -> DeviceResult<PageHandle>,
    ) -> DeviceResult<PageHandle> {
        self.book(Call::CreatePage, size)?;
        let page = self.unbook(create(&self.inner), size)?;
        self.bytes.lock().pages.insert(page, size);
        Ok(page)
    }

    /// Gives `size` booked bytes back when the inner call failed.
    fn unbook<T>(&self, result: DeviceResult<T>, size: u64) -> DeviceResult<T> {
        if result.is_err() {
            self.bytes.lock().sub(size);
        }
        result
    }
}

impl<D: Device> Device for Limit<D> {
    forward! {
        ordinal() -> usize;
        granularity() -> DeviceResult<u64>;
        check_stream(stream: StreamId) -> DeviceResult<()>;
        reserve(size: u64) -> DeviceResult<DevicePtr>;
        unreserve(va: DevicePtr, size: u64) -> DeviceResult<()>;
        map(va: DevicePtr, size: u64, page: PageHandle) -> DeviceResult<()>;
        unmap(va: DevicePtr, size: u64) -> DeviceResult<()>;
        set_access(va: DevicePtr, size: u64, peers: &[usize]) -> DeviceResult<()>;
        create_event() -> DeviceResult<EventHandle>;
        destroy_event(event: EventHandle) -> DeviceResult<()>;
        record_event(event: EventHandle, stream: StreamId) -> DeviceResult<()>;
        query_event(event: EventHandle) -> DeviceResult<bool>;
        synchronize_event(event: EventHandle) -> DeviceResult<()>;
        synchronize_device() -> DeviceResult<()>;
        is_capturing(stream: StreamId) -> DeviceResult<bool>;
        alloc_host(size: u64) -> DeviceResult<HostPtr>;
        free_host(ptr: HostPtr, size: u64) -> DeviceResult<()>;
        copy_to_host_async(dst: HostPtr, src: DevicePtr, size: u64, stream: StreamId)
            -> DeviceResult<()>;
        copy_to_device_async(dst: DevicePtr, src: HostPtr, size: u64, stream: StreamId)
            -> DeviceResult<()>;
        copy_device_async(dst: DevicePtr, src: DevicePtr, size: u64, stream: StreamId)
            -> DeviceResult<()>;
        open_stream() -> DeviceResult<StreamId>;
        close_stream(stream: StreamId) -> DeviceResult<()>;
        wait_event(stream: StreamId, event: EventHandle) -> DeviceResult<()>;
        can_share() -> DeviceResult<bool>;
        export_page(page: PageHandle) -> DeviceResult<OwnedFd>;
    }

    /// An imported page is memory another page handle already holds: it is not booked.
    fn import_page(&self, fd: BorrowedFd<'_>, size: u64) -> DeviceResult<PageHandle> {
        self.inner.import_page(fd, size)
    }

    fn malloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.book(Call::Malloc, size)?;
        self.unbook(self.inner.malloc(size), size)
    }

    fn free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.inner.free(ptr, size)?;
        self.bytes.lock().sub(size);
        Ok(())
    }

    fn mem_info(&self) -> DeviceResult<(u64, u64)> {
        let (free, total) = self.inner.mem_info()?;
        let limit = self.limit();
        let limit_free = limit.saturating_sub(self.outstanding_bytes());
        Ok((free.min(limit_free), total.min(limit)))
    }

    fn create_page(&self, size: u64) -> DeviceResult<PageHandle> {
        self.book_page(size, |d| d.create_page(size))
    }

    fn create_shareable_page(&self, size: u64) -> DeviceResult<PageHandle> {
        self.book_page(size, |d| d.create_shareable_page(size))
    }

    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        // Held across the release: the driver may hand the handle out again at once, and a
        // `create_page` that gets it must not book its page before this one is unbooked.
        let mut bytes = self.bytes.lock();
        self.inner.release_page(page)?;
        bytes.release_page(page);
        Ok(())
    }
}

/// Injects faults into the inner device following a [`FaultPlan`]: a failed call returns the
/// injected error and never reaches the inner device, so it changes nothing.
#[derive(Debug)]
pub struct FailCalls<D> {
    inner: D,
    plan: Mutex<FaultPlan>,
}

impl<D: Device> FailCalls<D> {
    /// Wraps `inner` with no fault armed.
    pub fn new(inner: D) -> Self {
        Self {
            inner,
            plan: Mutex::new(FaultPlan::new()),
        }
    }

    /// The `k`-th acquiring call from now fails (1-based).
    pub fn fail_call(&self, k: u64) {
        self.plan.lock().fail_call(k);
    }

    /// Every `k`-th acquiring call fails; `k = 0` disables it.
    pub fn fail_every(&self, k: u64) {
        self.plan.lock().fail_every(k);
    }

    /// The next acquiring call fails.
    pub fn fail_next(&self) {
        self.plan.lock().fail_next();
    }

    /// Disarms every fault.
    pub fn clear_faults(&self) {
        self.plan.lock().clear();
    }

    /// The `k`-th release call from now fails (1-based); see [`FaultPlan::fail_release`].
    pub fn fail_release(&self, k: u64) {
        self.plan.lock().fail_release(k);
    }

    /// Every call of kind `call` fails until cleared; see [`FaultPlan::fail_always`].
    pub fn fail_always(&self, call: Call) {
        self.plan.lock().fail_always(call);
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Unwraps the device.
    pub fn into_inner(self) -> D {
        self.inner
    }

    fn check(&self, call: Call, requested: u64) -> DeviceResult<()> {
        self.plan.lock().check(call, requested)
    }
}

/// Implements every [`Call`] method of a wrapper as `self.$hook(Call, size)?` followed by the
/// forwarded call; `$size` names the argument reported as `requested` (or `0`).
macro_rules! hooked {
    ($hook:ident; $($name:ident => $call:ident ($($arg:ident: $ty:ty),*) [$size:expr] -> $ret:ty;)*) => {
        $(fn $name(&self, $($arg: $ty),*) -> $ret {
            self.$hook(Call::$call, $size)?;
            self.inner.$name($($arg),*)
        })*
    };
}

/// [`hooked!`] for every call but those that acquire or release device memory (`malloc`,
/// `free`, `create_page`, `release_page`), which [`CountCalls`] books itself.
macro_rules! hooked_bookless {
    ($hook:ident) => {
        hooked! { $hook;
            mem_info => MemInfo() [0] -> DeviceResult<(u64, u64)>;
            reserve => Reserve(size: u64) [size] -> DeviceResult<DevicePtr>;
            unreserve => Unreserve(va: DevicePtr, size: u64) [size] -> DeviceResult<()>;
            map => Map(va: DevicePtr, size: u64, page: PageHandle) [size] -> DeviceResult<()>;
            unmap => Unmap(va: DevicePtr, size: u64) [size] -> DeviceResult<()>;
            set_access => SetAccess(va: DevicePtr, size: u64, peers: &[usize]) [size]
                -> DeviceResult<()>;
            create_event => CreateEvent() [0] -> DeviceResult<EventHandle>;
            destroy_event => DestroyEvent(event: EventHandle) [0] -> DeviceResult<()>;
            record_event => RecordEvent(event: EventHandle, stream: StreamId) [0]
                -> DeviceResult<()>;
            query_event => QueryEvent(event: EventHandle) [0] -> DeviceResult<bool>;
            synchronize_event => SynchronizeEvent(event: EventHandle) [0] -> DeviceResult<()>;
            synchronize_device => SynchronizeDevice() [0] -> DeviceResult<()>;
            is_capturing => CaptureStatus(stream: StreamId) [0] -> DeviceResult<bool>;
            alloc_host => AllocHost(size: u64) [size] -> DeviceResult<HostPtr>;
            free_host => FreeHost(ptr: HostPtr, size: u64) [size] -> DeviceResult<()>;
            copy_to_host_async => CopyToHostAsync(dst: HostPtr, src: DevicePtr, size: u64, stream: StreamId)
                [size] -> DeviceResult<()>;
            copy_to_device_async => CopyToDeviceAsync(dst: DevicePtr, src: HostPtr, size: u64, stream: StreamId)
                [size] -> DeviceResult<()>;
            copy_device_async => CopyDeviceAsync(dst: DevicePtr, src: DevicePtr, size: u64, stream: StreamId)
                [size] -> DeviceResult<()>;
            open_stream => OpenStream() [0] -> DeviceResult<StreamId>;
            close_stream => CloseStream(stream: StreamId) [0] -> DeviceResult<()>;
            wait_event => WaitEvent(stream: StreamId, event: EventHandle) [0] -> DeviceResult<()>;
            export_page => ExportPage(page: PageHandle) [0] -> DeviceResult<OwnedFd>;
            import_page => ImportPage(fd: BorrowedFd<'_>, size: u64) [size] -> DeviceResult<PageHandle>;
        }
    };
}

impl<D: Device> Device for FailCalls<D> {
    forward! {
        ordinal() -> usize;
        granularity() -> DeviceResult<u64>;
        check_stream(stream: StreamId) -> DeviceResult<()>;
        can_share() -> DeviceResult<bool>;
    }
    hooked! { check;
        malloc => Malloc(size: u64) [size] -> DeviceResult<DevicePtr>;
        free => Free(ptr: DevicePtr, size: u64) [size] -> DeviceResult<()>;
        create_page => CreatePage(size: u64) [size] -> DeviceResult<PageHandle>;
        create_shareable_page => CreatePage(size: u64) [size] -> DeviceResult<PageHandle>;
        release_page => ReleasePage(page: PageHandle) [0] -> DeviceResult<()>;
    }
    hooked_bookless!(check);
}

/// Counts every call per [`Call`] kind (successful or not) and tracks the physical bytes
/// outstanding on the inner device (malloc'd segments plus created pages).
#[derive(Debug)]
pub struct CountCalls<D> {
    inner: D,
    counters: CallCounters,
    bytes: Mutex<Bytes>,
}

impl<D: Device> CountCalls<D> {
    /// Wraps `inner` with every counter at zero.
    pub fn new(inner: D) -> Self {
        Self {
            inner,
            counters: CallCounters::new(),
            bytes: Mutex::new(Bytes::default()),
        }
    }

    /// How many calls of kind `call` were made.
    pub fn calls(&self, call: Call) -> u64 {
        self.counters.get(call)
    }

    /// How many calls were made in all.
    pub fn total_calls(&self) -> u64 {
        self.counters.total()
    }

    /// Sets every call counter back to zero (outstanding bytes are kept).
    pub fn reset_calls(&self) {
        self.counters.reset();
    }

    /// The counters themselves.
    pub fn counters(&self) -> &CallCounters {
        &self.counters
    }

    /// Bytes malloc'd or held in pages through this wrapper and not yet given back.
    pub fn outstanding_bytes(&self) -> u64 {
        self.bytes.lock().outstanding
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Unwraps the device.
    pub fn into_inner(self) -> D {
        self.inner
    }

    fn count(&self, call: Call, _size: u64) -> DeviceResult<()> {
        self.counters.record(call);
        Ok(())
    }

    fn add(&self, size: u64) {
        self.bytes.lock().try_add(size, u64::MAX);
    }

    /// Counts a page creation of `size` bytes whose inner call returned `made`.
    fn count_page(&self, size: u64, made: DeviceResult<PageHandle>) -> DeviceResult<PageHandle> {
        self.counters.record(Call::CreatePage);
        let page = made?;
        self.add(size);
        self.bytes.lock().pages.insert(page, size);
        Ok(page)
    }
}

impl<D: Device> Device for CountCalls<D> {
    forward! {
        ordinal() -> usize;
        granularity() -> DeviceResult<u64>;
        check_stream(stream: StreamId) -> DeviceResult<()>;
        can_share() -> DeviceResult<bool>;
    }
    hooked_bookless!(count);

    fn malloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.counters.record(Call::Malloc);
        let ptr = self.inner.malloc(size)?;
        self.add(size);
        Ok(ptr)
    }

    fn free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.counters.record(Call::Free);
        self.inner.free(ptr, size)?;
        self.bytes.lock().sub(size);
        Ok(())
    }

    fn create_page(&self, size: u64) -> DeviceResult<PageHandle> {
        self.count_page(size, self.inner.create_page(size))
    }

    fn create_shareable_page(&self, size: u64) -> DeviceResult<PageHandle> {
        self.count_page(size, self.inner.create_shareable_page(size))
    }

    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        self.counters.record(Call::ReleasePage);
        // Held across the release, as in `Limit::release_page`: the handle may be reused.
        let mut bytes = self.bytes.lock();
        self.inner.release_page(page)?;
        bytes.release_page(page);
        Ok(())
    }
}

// After the macros, which they use.
mod answers;
mod log;
mod time;
pub use answers::{Answer, AnswerUse, Given, PlayAnswers, RecordAnswers};
pub use log::LogCalls;
pub use time::{CallTime, TimeCalls};
