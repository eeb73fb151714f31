//! Recording traces from a running allocator.
//!
//! [`RecordingAllocator`] wraps a [`CachingAllocator`] and writes the calls it serves in our CSV
//! format ([`super::csv`]), so that a run can be replayed later against any policy:
//! - a successful `allocate` writes `alloc` (the address, the requested size, the stream);
//! - an `allocate` that runs out of memory writes `oom` (address 0, the requested size);
//! - a `free` writes `free_requested` then `free_completed`, with the size and stream the
//!   allocation was made with. Segments are not recorded.
//!
//! Guarantees:
//! - events are written in the order the allocator served the calls, across threads (the
//!   writer's lock is held across each call), so the file never shows an address handed out
//!   again before its free;
//! - `time_us` counts microseconds since the recorder was made and never decreases;
//! - recording never changes what the allocator returns: the first write error is kept, later
//!   events are dropped, and [`RecordingAllocator::finish`] reports it.

use super::csv;
use super::{Action, Event};
use crate::error::AllocError;
use crate::pool::Allocation;
use crate::snapshot::Snapshot;
use crate::stats::Stats;
use crate::sync::Mutex;
use crate::CachingAllocator;
use cudalloc_sys::{Device, StreamId};
use std::collections::HashMap;
use std::io::{self, Write};
use std::time::Instant;

/// A [`CachingAllocator`] that writes a trace of the calls it serves; `Send + Sync` like the
/// allocator it wraps.
pub struct RecordingAllocator<D: Device, W: Write + Send> {
    inner: CachingAllocator<D>,
    out: Mutex<Out<W>>,
    start: Instant,
}

/// The writer and what it needs to know about live allocations.
struct Out<W: Write> {
    writer: csv::Writer<W>,
    /// Address -> (requested size, stream) of each live allocation.
    live: HashMap<u64, (u64, u64)>,
    /// The first write error.
    error: Option<io::Error>,
}

impl<D: Device, W: Write + Send> RecordingAllocator<D, W> {
    /// Wraps `inner` and writes the header to `out`.
    pub fn new(inner: CachingAllocator<D>, out: W) -> io::Result<Self> {
        Ok(RecordingAllocator {
            inner,
            out: Mutex::new(Out {
                writer: csv::Writer::new(out)?,
                live: HashMap::new(),
                error: None,
            }),
            start: Instant::now(),
        })
    }

    /// [`CachingAllocator::allocate`], recorded.
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        let mut out = self.out.lock();
        let result = self.inner.allocate(size, stream);
        match &result {
            Ok(a) => {
                out.live.insert(a.ptr, (a.size, stream.0));
                self.emit(&mut out, Action::Alloc, a.ptr, a.size, stream.0);
            }
            Err(e) if e.is_out_of_memory() => self.emit(&mut out, Action::Oom, 0, size, stream.0),
            Err(_) => {}
        }
        result
    }

    /// [`CachingAllocator::free`], recorded.
    pub fn free(&self, a: Allocation) -> Result<(), AllocError> {
        self.free_ptr(a.ptr)
    }

    /// [`CachingAllocator::free_ptr`], recorded.
    pub fn free_ptr(&self, ptr: u64) -> Result<(), AllocError> {
        let mut out = self.out.lock();
        self.inner.free_ptr(ptr)?;
        let (size, stream) = out.live.remove(&ptr).unwrap_or_default();
        self.emit(&mut out, Action::FreeRequested, ptr, size, stream);
        self.emit(&mut out, Action::FreeCompleted, ptr, size, stream);
        Ok(())
    }

    /// [`CachingAllocator::record_stream`] (not an event of the trace).
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        self.inner.record_stream(ptr, stream)
    }

    /// [`CachingAllocator::empty_cache`] (not an event of the trace).
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        self.inner.empty_cache()
    }

    /// [`CachingAllocator::stats`].
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// [`CachingAllocator::snapshot`].
    pub fn snapshot(&self) -> Snapshot {
        self.inner.snapshot()
    }

    /// [`CachingAllocator::reserved_bytes`].
    pub fn reserved_bytes(&self) -> u64 {
        self.inner.reserved_bytes()
    }

    /// Flushes the trace and returns its writer, or the first write error.
    pub fn finish(self) -> io::Result<W> {
        self.into_inner().1
    }

    /// The allocator back, with the flushed writer or the first write error.
    pub fn into_inner(self) -> (CachingAllocator<D>, io::Result<W>) {
        let out = self.out.into_inner();
        let writer = match out.error {
            Some(e) => Err(e),
            None => out.writer.finish(),
        };
        (self.inner, writer)
    }

    /// Writes one event unless an earlier write failed.
    fn emit(&self, out: &mut Out<W>, action: Action, addr: u64, size: u64, stream: u64) {
        if out.error.is_some() {
            return;
        }
        let e = Event {
            action,
            addr,
            size,
            stream,
            time_us: self.start.elapsed().as_micros() as u64,
        };
        if let Err(err) = out.writer.write(&e) {
            out.error = Some(err);
        }
    }
}
