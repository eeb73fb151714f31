//! [`TimeCalls`]: how many calls of each kind the inner device took, and how long they took.
//!
//! Invariant: every [`Call`] method is timed around the inner call alone, failed calls included,
//! so the time of a kind is the time spent inside the inner device for it (the driver, when the
//! inner device is [`crate::CudaDevice`]); the queries that are not [`Call`] kinds (`ordinal`,
//! `granularity`, `check_stream`, `can_share`) are forwarded untimed.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::device::{
    Call, Device, DevicePtr, DeviceResult, EventHandle, HostPtr, PageHandle, StreamId,
};

/// The calls of one kind and the nanoseconds they took together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallTime {
    /// Calls made.
    pub calls: u64,
    /// Nanoseconds spent in them.
    pub ns: u64,
}

/// Counts every call per [`Call`] kind and adds up the wall time each took in the inner device.
#[derive(Debug)]
pub struct TimeCalls<D> {
    inner: D,
    calls: [AtomicU64; Call::ALL.len()],
    ns: [AtomicU64; Call::ALL.len()],
}

impl<D: Device> TimeCalls<D> {
    /// Wraps `inner` with every count and time at zero.
    pub fn new(inner: D) -> Self {
        Self {
            inner,
            calls: Default::default(),
            ns: Default::default(),
        }
    }

    /// The calls of kind `call` and their time.
    pub fn time(&self, call: Call) -> CallTime {
        CallTime {
            calls: self.calls[call.index()].load(Ordering::Relaxed),
            ns: self.ns[call.index()].load(Ordering::Relaxed),
        }
    }

    /// The kinds called at least once, in [`Call::ALL`]'s order, with their calls and time.
    pub fn times(&self) -> Vec<(Call, CallTime)> {
        Call::ALL
            .iter()
            .map(|&c| (c, self.time(c)))
            .filter(|(_, t)| t.calls > 0)
            .collect()
    }

    /// Nanoseconds spent in calls of every kind together.
    pub fn total_ns(&self) -> u64 {
        Call::ALL.iter().map(|&c| self.time(c).ns).sum()
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Unwraps the device.
    pub fn into_inner(self) -> D {
        self.inner
    }

    /// Times `f`, a call of kind `call` on the inner device.
    fn timed<T>(&self, call: Call, f: impl FnOnce(&D) -> T) -> T {
        let start = Instant::now();
        let out = f(&self.inner);
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.calls[call.index()].fetch_add(1, Ordering::Relaxed);
        self.ns[call.index()].fetch_add(ns, Ordering::Relaxed);
        out
    }
}

/// Implements each listed [`Device`] method as the inner call, timed as kind `$call`.
macro_rules! timed {
    ($($name:ident => $call:ident ($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        $(fn $name(&self, $($arg: $ty),*) -> $ret {
            self.timed(Call::$call, |d| d.$name($($arg),*))
        })*
    };
}

impl<D: Device> Device for TimeCalls<D> {
    forward! {
        ordinal() -> usize;
        granularity() -> DeviceResult<u64>;
        check_stream(stream: StreamId) -> DeviceResult<()>;
        can_share() -> DeviceResult<bool>;
    }
    timed! {
        malloc => Malloc(size: u64) -> DeviceResult<DevicePtr>;
        free => Free(ptr: DevicePtr, size: u64) -> DeviceResult<()>;
        create_page => CreatePage(size: u64) -> DeviceResult<PageHandle>;
        create_shareable_page => CreatePage(size: u64) -> DeviceResult<PageHandle>;
        release_page => ReleasePage(page: PageHandle) -> DeviceResult<()>;
        mem_info => MemInfo() -> DeviceResult<(u64, u64)>;
        reserve => Reserve(size: u64) -> DeviceResult<DevicePtr>;
        unreserve => Unreserve(va: DevicePtr, size: u64) -> DeviceResult<()>;
        map => Map(va: DevicePtr, size: u64, page: PageHandle) -> DeviceResult<()>;
        unmap => Unmap(va: DevicePtr, size: u64) -> DeviceResult<()>;
        set_access => SetAccess(va: DevicePtr, size: u64, peers: &[usize]) -> DeviceResult<()>;
        create_event => CreateEvent() -> DeviceResult<EventHandle>;
        destroy_event => DestroyEvent(event: EventHandle) -> DeviceResult<()>;
        record_event => RecordEvent(event: EventHandle, stream: StreamId) -> DeviceResult<()>;
        query_event => QueryEvent(event: EventHandle) -> DeviceResult<bool>;
        synchronize_event => SynchronizeEvent(event: EventHandle) -> DeviceResult<()>;
        synchronize_device => SynchronizeDevice() -> DeviceResult<()>;
        is_capturing => CaptureStatus(stream: StreamId) -> DeviceResult<bool>;
        alloc_host => AllocHost(size: u64) -> DeviceResult<HostPtr>;
        free_host => FreeHost(ptr: HostPtr, size: u64) -> DeviceResult<()>;
        copy_to_host_async => CopyToHostAsync(dst: HostPtr, src: DevicePtr, size: u64,
            stream: StreamId) -> DeviceResult<()>;
        copy_to_device_async => CopyToDeviceAsync(dst: DevicePtr, src: HostPtr, size: u64,
            stream: StreamId) -> DeviceResult<()>;
        copy_device_async => CopyDeviceAsync(dst: DevicePtr, src: DevicePtr, size: u64,
            stream: StreamId) -> DeviceResult<()>;
        open_stream => OpenStream() -> DeviceResult<StreamId>;
        close_stream => CloseStream(stream: StreamId) -> DeviceResult<()>;
        wait_event => WaitEvent(stream: StreamId, event: EventHandle) -> DeviceResult<()>;
        export_page => ExportPage(page: PageHandle) -> DeviceResult<OwnedFd>;
        import_page => ImportPage(fd: BorrowedFd<'_>, size: u64) -> DeviceResult<PageHandle>;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimDevice;

    #[test]
    fn counts_each_kind_failed_calls_included_and_adds_their_time() {
        let dev = TimeCalls::new(SimDevice::default());
        let page = dev.create_page(2 << 20).unwrap();
        let va = dev.reserve(4 << 20).unwrap();
        dev.map(va, 2 << 20, page).unwrap();
        // Mapping the same range twice fails in the inner device, and is still a call.
        assert!(dev.map(va, 2 << 20, page).is_err());
        dev.unmap(va, 2 << 20).unwrap();
        assert_eq!(dev.time(Call::Map).calls, 2);
        assert_eq!(dev.time(Call::CreatePage).calls, 1);
        assert_eq!(dev.time(Call::Malloc), CallTime::default());
        let kinds: Vec<Call> = dev.times().iter().map(|(c, _)| *c).collect();
        assert_eq!(
            kinds,
            [Call::Reserve, Call::CreatePage, Call::Map, Call::Unmap]
        );
        let sum: u64 = dev.times().iter().map(|(_, t)| t.ns).sum();
        assert_eq!(dev.total_ns(), sum);
        assert!(dev.total_ns() > 0);
    }
}
