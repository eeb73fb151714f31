//! [`LogCalls`]: one line per device call, for debugging.

use std::io::Write;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use parking_lot::Mutex;

use crate::device::{
    Call, Device, DevicePtr, DeviceResult, EventHandle, HostPtr, PageHandle, StreamId,
};

/// Where [`LogCalls`] puts its lines.
enum Sink {
    Lines(Vec<String>),
    Writer(Box<dyn Write + Send>),
}

/// Writes one line per call, such as `malloc(2097152) -> Ok(0x700000000000)`, into an internal
/// list (read it with [`LogCalls::lines`]) or to a writer given at construction. Addresses are
/// printed in hex, sizes in decimal bytes; errors are printed with their `Display` text. Write
/// errors of the writer are ignored: logging never changes what the device returns.
pub struct LogCalls<D> {
    inner: D,
    sink: Mutex<Sink>,
}

impl<D> std::fmt::Debug for LogCalls<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogCalls").finish_non_exhaustive()
    }
}

impl<D: Device> LogCalls<D> {
    /// Wraps `inner`, keeping the lines in memory.
    pub fn new(inner: D) -> Self {
        Self {
            inner,
            sink: Mutex::new(Sink::Lines(Vec::new())),
        }
    }

    /// Wraps `inner`, writing each line (with a trailing newline) to `writer`.
    pub fn with_writer(inner: D, writer: Box<dyn Write + Send>) -> Self {
        Self {
            inner,
            sink: Mutex::new(Sink::Writer(writer)),
        }
    }

    /// The lines logged so far (empty when logging to a writer).
    pub fn lines(&self) -> Vec<String> {
        match &*self.sink.lock() {
            Sink::Lines(lines) => lines.clone(),
            Sink::Writer(_) => Vec::new(),
        }
    }

    /// Removes and returns the lines logged so far (empty when logging to a writer).
    pub fn take_lines(&self) -> Vec<String> {
        match &mut *self.sink.lock() {
            Sink::Lines(lines) => std::mem::take(lines),
            Sink::Writer(_) => Vec::new(),
        }
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Unwraps the device.
    pub fn into_inner(self) -> D {
        self.inner
    }

    /// Logs `call(args) -> result` and passes the result through.
    fn log<T>(&self, call: Call, args: String, result: DeviceResult<T>) -> DeviceResult<T>
    where
        T: LogValue,
    {
        let shown = match &result {
            Ok(v) => format!("Ok({})", v.show()),
            Err(e) => format!("Err({e})"),
        };
        let line = format!("{}({args}) -> {shown}", call.name());
        match &mut *self.sink.lock() {
            Sink::Lines(lines) => lines.push(line),
            Sink::Writer(w) => {
                let _ = writeln!(w, "{line}");
            }
        }
        result
    }
}

/// How a call's successful result is shown in a log line.
trait LogValue {
    fn show(&self) -> String;
}

impl LogValue for u64 {
    /// Only addresses are returned as bare `u64`s.
    fn show(&self) -> String {
        format!("{self:#x}")
    }
}

impl LogValue for () {
    fn show(&self) -> String {
        "()".into()
    }
}

impl LogValue for bool {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl LogValue for (u64, u64) {
    fn show(&self) -> String {
        format!("free {}, total {}", self.0, self.1)
    }
}

impl LogValue for PageHandle {
    fn show(&self) -> String {
        format!("page {}", self.0)
    }
}

impl LogValue for OwnedFd {
    fn show(&self) -> String {
        format!("fd {}", self.as_raw_fd())
    }
}

impl LogValue for StreamId {
    fn show(&self) -> String {
        self.to_string()
    }
}

impl LogValue for EventHandle {
    fn show(&self) -> String {
        format!("event {}", self.0)
    }
}

impl<D: Device> Device for LogCalls<D> {
    forward! {
        ordinal() -> usize;
        granularity() -> DeviceResult<u64>;
        check_stream(stream: StreamId) -> DeviceResult<()>;
        can_share() -> DeviceResult<bool>;
    }

    fn create_shareable_page(&self, size: u64) -> DeviceResult<PageHandle> {
        let result = self.inner.create_shareable_page(size);
        self.log(Call::CreatePage, format!("{size}, shareable"), result)
    }

    fn export_page(&self, page: PageHandle) -> DeviceResult<OwnedFd> {
        let args = format!("page {}", page.0);
        self.log(Call::ExportPage, args, self.inner.export_page(page))
    }

    fn import_page(&self, fd: BorrowedFd<'_>, size: u64) -> DeviceResult<PageHandle> {
        let args = format!("fd {}, {size}", fd.as_raw_fd());
        self.log(Call::ImportPage, args, self.inner.import_page(fd, size))
    }

    fn malloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.log(Call::Malloc, format!("{size}"), self.inner.malloc(size))
    }

    fn free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let args = format!("{ptr:#x}, {size}");
        self.log(Call::Free, args, self.inner.free(ptr, size))
    }

    fn mem_info(&self) -> DeviceResult<(u64, u64)> {
        self.log(Call::MemInfo, String::new(), self.inner.mem_info())
    }

    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.log(Call::Reserve, format!("{size}"), self.inner.reserve(size))
    }

    fn unreserve(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        let args = format!("{va:#x}, {size}");
        self.log(Call::Unreserve, args, self.inner.unreserve(va, size))
    }

    fn create_page(&self, size: u64) -> DeviceResult<PageHandle> {
        let result = self.inner.create_page(size);
        self.log(Call::CreatePage, format!("{size}"), result)
    }

    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        let args = format!("page {}", page.0);
        self.log(Call::ReleasePage, args, self.inner.release_page(page))
    }

    fn map(&self, va: DevicePtr, size: u64, page: PageHandle) -> DeviceResult<()> {
        let args = format!("{va:#x}, {size}, page {}", page.0);
        self.log(Call::Map, args, self.inner.map(va, size, page))
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        let args = format!("{va:#x}, {size}");
        self.log(Call::Unmap, args, self.inner.unmap(va, size))
    }

    fn set_access(&self, va: DevicePtr, size: u64, peers: &[usize]) -> DeviceResult<()> {
        let args = format!("{va:#x}, {size}, peers {peers:?}");
        let result = self.inner.set_access(va, size, peers);
        self.log(Call::SetAccess, args, result)
    }

    fn create_event(&self) -> DeviceResult<EventHandle> {
        self.log(Call::CreateEvent, String::new(), self.inner.create_event())
    }

    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        let args = format!("event {}", event.0);
        self.log(Call::DestroyEvent, args, self.inner.destroy_event(event))
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        let args = format!("event {}, {stream}", event.0);
        let result = self.inner.record_event(event, stream);
        self.log(Call::RecordEvent, args, result)
    }

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let args = format!("event {}", event.0);
        self.log(Call::QueryEvent, args, self.inner.query_event(event))
    }

    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()> {
        let args = format!("event {}", event.0);
        let result = self.inner.synchronize_event(event);
        self.log(Call::SynchronizeEvent, args, result)
    }

    fn synchronize_device(&self) -> DeviceResult<()> {
        let result = self.inner.synchronize_device();
        self.log(Call::SynchronizeDevice, String::new(), result)
    }

    fn is_capturing(&self, stream: StreamId) -> DeviceResult<bool> {
        let result = self.inner.is_capturing(stream);
        self.log(Call::CaptureStatus, format!("{stream}"), result)
    }

    fn alloc_host(&self, size: u64) -> DeviceResult<HostPtr> {
        self.log(
            Call::AllocHost,
            format!("{size}"),
            self.inner.alloc_host(size),
        )
    }

    fn free_host(&self, ptr: HostPtr, size: u64) -> DeviceResult<()> {
        let args = format!("{ptr:#x}, {size}");
        self.log(Call::FreeHost, args, self.inner.free_host(ptr, size))
    }

    fn copy_to_host_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        let args = format!("{dst:#x}, {src:#x}, {n}, {s}");
        let result = self.inner.copy_to_host_async(dst, src, n, s);
        self.log(Call::CopyToHostAsync, args, result)
    }

    fn copy_to_device_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        let args = format!("{dst:#x}, {src:#x}, {n}, {s}");
        let result = self.inner.copy_to_device_async(dst, src, n, s);
        self.log(Call::CopyToDeviceAsync, args, result)
    }

    fn copy_device_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        let args = format!("{dst:#x}, {src:#x}, {n}, {s}");
        let result = self.inner.copy_device_async(dst, src, n, s);
        self.log(Call::CopyDeviceAsync, args, result)
    }

    fn open_stream(&self) -> DeviceResult<StreamId> {
        self.log(Call::OpenStream, String::new(), self.inner.open_stream())
    }

    fn close_stream(&self, stream: StreamId) -> DeviceResult<()> {
        let result = self.inner.close_stream(stream);
        self.log(Call::CloseStream, format!("{stream}"), result)
    }

    fn wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        let args = format!("{stream}, event {}", event.0);
        self.log(Call::WaitEvent, args, self.inner.wait_event(stream, event))
    }
}
