//! Recording traces from a running allocator.
//!
//! [`Recorder`] turns the calls an allocator served into events ([`event`]) and hands them to
//! an [`EventSink`]: our CSV format ([`csv`]) or an in-memory ring of the latest ones
//! ([`History`], behind PyTorch's `_record_memory_history` in the C ABI);
//! [`RecordingAllocator`] wraps a [`CachingAllocator`] with a CSV one, and the C ABI's trace
//! (`cudalloc_trace_start`) and history (`cudalloc_history_start`) use one too:
//! - a successful `allocate` writes `alloc` (the address, the requested size, the stream);
//! - an `allocate` that runs out of memory (or asks for more than any device holds: `TooLarge`)
//!   writes `oom` (address 0, the requested size);
//! - a `free` writes `free_requested` then `free_completed`, with the size and stream the
//!   allocation was made with; a free of an allocation the recorder never saw made (or was
//!   told of with [`Recorder::live_at_start`]) is not written, so a trace never holds an
//!   unmatched free. Segments are not recorded;
//! - a free of an allocation used on another stream ([`Recorder::used_on`]) writes
//!   `free_requested` at once and `free_completed` when the block goes back to its pool, after
//!   that stream's work (as PyTorch writes them): the allocator keeps those completions
//!   ([`CachingAllocator::take_completions`]) and [`Recorder::catch_up`] writes them before the
//!   next event, so a replay reuses the block no earlier than the allocator did;
//! - [`Recorder::answered`] writes what the device answered the allocator's event queries in a
//!   call (`event_done`, `event_pending`), before that call's events.
//!
//! Guarantees:
//! - events are written in the order the allocator served the calls, across threads (the
//!   recorder's lock is held across each call), so the file never shows an address handed out
//!   again before its free;
//! - `time_us` counts microseconds since the recorder was made and never decreases;
//! - recording never changes what the allocator returns: the first write error is kept, later
//!   events are dropped, and `finish` reports it;
//! - lines reach the output in chunks ([`csv::Writer`]); to keep a slow output (gzip)
//!   off the allocating thread, give it a [`background::BackgroundWriter`].
//!
//! On the CUDA device a `RecordingAllocator` in an `Arc` is a `BufferPool` with the buffer
//! constructors of `CachingAllocator` ([`crate::interop`]): a buffer's allocation writes
//! `alloc`, its drop or `free` goes through [`RecordingAllocator::free_on`] on its stream. It
//! has `cublas` and `cublas_with` too ([`crate::workspace`]): the handle's workspaces are such
//! buffers, so they are written when allocated and when the handle is dropped.

pub mod background;
pub mod csv;
pub mod event;
pub mod history;

pub use event::{Action, Event};
pub use history::History;

use crate::error::AllocError;
use crate::pool::Allocation;
use crate::snapshot::Snapshot;
use crate::stats::Stats;
use crate::sync::Mutex;
use crate::CachingAllocator;
use cudalloc_sys::{Device, StreamId};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::{self, Write};
use std::time::Instant;

/// Where a [`Recorder`]'s events go: a CSV file ([`csv::Writer`]), an in-memory ring
/// ([`History`]), or anything else that takes events one at a time.
pub trait EventSink {
    /// Takes one event; an error stops the recorder's later events ([`Recorder::into_sink`]
    /// reports it).
    fn put(&mut self, e: &Event) -> io::Result<()>;

    /// Writes out what is held and closes the output (nothing for an in-memory sink).
    fn close(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<W: Write> EventSink for csv::Writer<W> {
    fn put(&mut self, e: &Event) -> io::Result<()> {
        self.write(e)
    }

    fn close(&mut self) -> io::Result<()> {
        self.flush()
    }
}

impl<S: EventSink + ?Sized> EventSink for Box<S> {
    fn put(&mut self, e: &Event) -> io::Result<()> {
        (**self).put(e)
    }

    fn close(&mut self) -> io::Result<()> {
        (**self).close()
    }
}

/// Writes the events of the calls it is told of; see the module documentation.
pub struct Recorder<S: EventSink> {
    sink: S,
    start: Instant,
    /// Address -> (requested size, stream) of each live allocation.
    live: HashMap<u64, (u64, u64)>,
    /// Live allocations used on a stream other than their own.
    used_elsewhere: HashSet<u64>,
    /// Freed allocations whose `free_completed` waits for their block to go back to its pool,
    /// as `live`.
    waiting: HashMap<u64, (u64, u64)>,
    /// The first write error.
    error: Option<io::Error>,
}

impl<W: Write> Recorder<csv::Writer<W>> {
    /// A recorder of our CSV format whose clock starts now; writes the header.
    pub fn new(out: W) -> io::Result<Self> {
        Ok(Recorder::to_sink(csv::Writer::new(out)?))
    }

    /// Writes out the rest and returns the output, or the first write error.
    pub fn finish(self) -> io::Result<W> {
        self.into_sink()?.finish()
    }
}

impl<S: EventSink> Recorder<S> {
    /// A recorder whose events go to `sink`, with its clock starting now.
    pub fn to_sink(sink: S) -> Self {
        Recorder {
            sink,
            start: Instant::now(),
            live: HashMap::new(),
            used_elsewhere: HashSet::new(),
            waiting: HashMap::new(),
            error: None,
        }
    }

    /// Writes `event_done` or `event_pending` for each answer the device gave the allocator's
    /// event queries (oldest first), before the event of the call they were made in: a replay
    /// gives them again in that call (`cudalloc-trace`'s `ReplayOptions::answers`).
    /// Each answer names the stream the event was recorded on (the event's `stream` field).
    pub fn answered(&mut self, answers: &[(StreamId, bool)]) {
        let now = self.now();
        for &(stream, done) in answers {
            let action = if done {
                Action::EventDone
            } else {
                Action::EventPending
            };
            self.emit(action, 0, 0, stream.0, now);
        }
    }

    /// Writes an `alloc` at time 0 for an allocation made before recording began, so that its
    /// free is written and matches.
    pub fn live_at_start(&mut self, ptr: u64, size: u64, stream: StreamId) {
        self.live.insert(ptr, (size, stream.0));
        self.emit(Action::Alloc, ptr, size, stream.0, 0);
    }

    /// Writes what an `allocate(size, stream)` that returned `result` did.
    pub fn allocated(
        &mut self,
        result: &Result<Allocation, AllocError>,
        size: u64,
        stream: StreamId,
    ) {
        let t = self.now();
        match result {
            Ok(a) => {
                self.live.insert(a.ptr(), (a.size(), stream.0));
                self.emit(Action::Alloc, a.ptr(), a.size(), stream.0, t);
            }
            // A request above the most any device holds fails as running out of memory
            // does (PyTorch writes `oom` for it too).
            Err(e) if e.is_out_of_memory() || matches!(e, AllocError::TooLarge { .. }) => {
                self.emit(Action::Oom, 0, size, stream.0, t)
            }
            Err(_) => {}
        }
    }

    /// Notes that the allocation at `ptr` is used on `stream` too (`record_stream`): if that is
    /// not its own stream, its free completes only after that stream's work.
    pub fn used_on(&mut self, ptr: u64, stream: StreamId) {
        if self.live.get(&ptr).is_some_and(|&(_, s)| s != stream.0) {
            self.used_elsewhere.insert(ptr);
        }
    }

    /// Whether [`Recorder::freed`] of `ptr` would write `free_completed` now: an allocation it
    /// knows, not used on another stream.
    pub fn completes_at_free(&self, ptr: u64) -> bool {
        self.live.contains_key(&ptr) && !self.used_elsewhere.contains(&ptr)
    }

    /// Writes a successful free of `ptr`: `free_requested`, and `free_completed` unless the
    /// allocation was used on another stream (then [`Recorder::catch_up`] writes it).
    pub fn freed(&mut self, ptr: u64) {
        if let Some((size, stream)) = self.live.remove(&ptr) {
            let t = self.now();
            self.emit(Action::FreeRequested, ptr, size, stream, t);
            if self.used_elsewhere.remove(&ptr) {
                self.waiting.insert(ptr, (size, stream));
            } else {
                self.emit(Action::FreeCompleted, ptr, size, stream, t);
            }
        }
    }

    /// Writes `free_completed` for the waiting frees that have completed: `take(stream)` gives
    /// the address and stream of the frees that completed among the allocations of that
    /// stream's shard ([`CachingAllocator::take_completions`]); those the recorder was not
    /// waiting for (frees it never saw marked) are dropped. Call it before writing each event;
    /// it asks nothing while no free is waiting.
    pub fn catch_up(&mut self, take: impl FnMut(StreamId) -> Vec<(u64, StreamId)>) {
        self.catch_up_with(None, take);
    }

    /// [`Recorder::catch_up`] before the free of `ptr`: when that free will wait for another
    /// stream, its shard's list is emptied now too, so that a completion kept from an earlier
    /// free at the same address (one the recorder did not wait for) cannot pass for this one's.
    pub fn catch_up_before_free(
        &mut self,
        ptr: u64,
        take: impl FnMut(StreamId) -> Vec<(u64, StreamId)>,
    ) {
        let stream = self.live.get(&ptr).map(|&(_, s)| s);
        let waits = self.used_elsewhere.contains(&ptr);
        self.catch_up_with(stream.filter(|_| waits), take);
    }

    fn catch_up_with(
        &mut self,
        extra: Option<u64>,
        mut take: impl FnMut(StreamId) -> Vec<(u64, StreamId)>,
    ) {
        if self.waiting.is_empty() && extra.is_none() {
            return;
        }
        let mut streams: BTreeSet<u64> = self.waiting.values().map(|&(_, s)| s).collect();
        streams.extend(extra);
        for s in streams {
            for (ptr, stream) in take(StreamId(s)) {
                if self.waiting.get(&ptr).is_some_and(|&(_, w)| w == stream.0) {
                    let (size, stream) = self.waiting.remove(&ptr).expect("waiting");
                    let t = self.now();
                    self.emit(Action::FreeCompleted, ptr, size, stream, t);
                }
            }
        }
    }

    /// Where the events go.
    pub fn sink(&self) -> &S {
        &self.sink
    }

    /// Where the events go, to change it (a history's size, say).
    pub fn sink_mut(&mut self) -> &mut S {
        &mut self.sink
    }

    /// The sink, or the first error it gave.
    pub fn into_sink(self) -> io::Result<S> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.sink),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Writes one event unless an earlier write failed.
    fn emit(&mut self, action: Action, addr: u64, size: u64, stream: u64, time_us: u64) {
        if self.error.is_some() {
            return;
        }
        let e = Event {
            action,
            addr,
            size,
            stream,
            time_us,
        };
        if let Err(err) = self.sink.put(&e) {
            self.error = Some(err);
        }
    }
}

/// A [`CachingAllocator`] that writes a trace of the calls it serves; `Send + Sync` like the
/// allocator it wraps.
///
/// Recording a program's allocations to a gzip'd trace, compressed on a writer thread:
///
/// ```
/// use cudalloc::record::{background::BackgroundWriter, RecordingAllocator};
/// use cudalloc::{CachingAllocator, Config};
/// use cudalloc_sys::{SimDevice, StreamId};
/// use flate2::{read::MultiGzDecoder, write::GzEncoder, Compression};
/// use std::io::Read;
///
/// let path = std::env::temp_dir().join(format!("doc-{}.trace.csv.gz", std::process::id()));
/// let gzip = GzEncoder::new(std::fs::File::create(&path)?, Compression::default());
/// let alloc = CachingAllocator::new(SimDevice::with_capacity(1 << 30), Config::default());
/// let rec = RecordingAllocator::new(alloc, BackgroundWriter::new(gzip)?)?;
/// let a = rec.allocate(3 << 20, StreamId::DEFAULT).unwrap();
/// rec.free(a).unwrap();
/// rec.finish()?.finish()?.finish()?; // the recorder, the writer thread, the gzip stream
/// let mut text = String::new();
/// MultiGzDecoder::new(std::fs::File::open(&path)?).read_to_string(&mut text)?;
/// let lines: Vec<&str> = text.lines().collect();
/// assert_eq!(lines.len(), 4); // the header, alloc, free_requested, free_completed
/// assert!(lines[1].starts_with("alloc,") && lines[1].contains(",3145728,"));
/// # std::fs::remove_file(&path)?;
/// # Ok::<(), std::io::Error>(())
/// ```
pub struct RecordingAllocator<D: Device, W: Write + Send> {
    inner: CachingAllocator<D>,
    recorder: Mutex<Recorder<csv::Writer<W>>>,
}

impl<D: Device, W: Write + Send> RecordingAllocator<D, W> {
    /// Wraps `inner` and writes the header to `out`. Allocations `inner` holds already are
    /// not in the trace, nor are their frees.
    pub fn new(inner: CachingAllocator<D>, out: W) -> io::Result<Self> {
        let recorder = Mutex::new(Recorder::new(out)?);
        inner.track_completions(true);
        Ok(RecordingAllocator { inner, recorder })
    }

    /// Locks the recorder and writes the frees completed since its last event, before the free
    /// of `ptr` ([`Recorder::catch_up_before_free`]).
    fn recorder_to_free(&self, ptr: u64) -> crate::sync::MutexGuard<'_, Recorder<csv::Writer<W>>> {
        let mut rec = self.recorder.lock();
        rec.catch_up_before_free(ptr, |s| self.inner.take_completions(s));
        rec
    }

    /// [`CachingAllocator::allocate`], recorded.
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        let mut rec = self.recorder.lock();
        let result = self.inner.allocate(size, stream);
        rec.catch_up(|s| self.inner.take_completions(s));
        rec.allocated(&result, size, stream);
        result
    }

    /// [`CachingAllocator::free`], recorded.
    pub fn free(&self, a: Allocation) -> Result<(), AllocError> {
        let ptr = a.ptr();
        let mut rec = self.recorder_to_free(ptr);
        self.inner.free(a)?;
        rec.freed(ptr);
        Ok(())
    }

    /// [`CachingAllocator::free_ptr`], recorded.
    pub fn free_ptr(&self, ptr: u64) -> Result<(), AllocError> {
        let mut rec = self.recorder_to_free(ptr);
        self.inner.free_ptr(ptr)?;
        rec.freed(ptr);
        Ok(())
    }

    /// [`CachingAllocator::free_on`], recorded: frees the allocation at `ptr` made on
    /// `stream` (a different stream, or a `Buffer`'s allocation, is an error and writes
    /// nothing).
    pub fn free_on(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        let mut rec = self.recorder_to_free(ptr);
        self.inner.free_on(ptr, stream)?;
        rec.freed(ptr);
        Ok(())
    }

    /// [`CachingAllocator::free_buffer`], recorded: a `Buffer`'s way back.
    pub(crate) fn free_buffer(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        let mut rec = self.recorder_to_free(ptr);
        self.inner.free_buffer(ptr, stream)?;
        rec.freed(ptr);
        Ok(())
    }

    /// [`CachingAllocator::mark_buffer`].
    pub(crate) fn mark_buffer(&self, ptr: u64) {
        self.inner.mark_buffer(ptr);
    }

    /// [`CachingAllocator::record_stream`] (not an event of the trace: the allocation's
    /// `free_completed` is written when its block goes back to its pool).
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), AllocError> {
        let mut rec = self.recorder.lock();
        rec.catch_up(|s| self.inner.take_completions(s));
        self.inner.record_stream(ptr, stream)?;
        rec.used_on(ptr, stream);
        Ok(())
    }

    /// [`CachingAllocator::empty_cache`] (not an event of the trace; frees that waited for
    /// other streams complete in it).
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let mut rec = self.recorder.lock();
        let result = self.inner.empty_cache();
        rec.catch_up(|s| self.inner.take_completions(s));
        result
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

    /// [`CachingAllocator::with_device`].
    pub fn with_device<R>(&self, f: impl FnOnce(&D) -> R) -> R {
        self.inner.with_device(f)
    }

    /// Flushes the trace and returns its writer, or the first write error.
    ///
    /// Takes the recorder by value: one that made `Buffer`s (`buffer`, `buffer_from`,
    /// `buffer_uninit` in [`crate::interop`]) or cuBLAS handles (`cublas` in
    /// [`crate::workspace`]) is in an `Arc` that each of them holds a clone of, so drop them
    /// all first, then `Arc::try_unwrap` it and finish.
    pub fn finish(self) -> io::Result<W> {
        self.into_inner().1
    }

    /// The allocator back (no longer keeping completions), with the flushed writer or the
    /// first write error. Frees still waiting for other streams' work are not written.
    pub fn into_inner(self) -> (CachingAllocator<D>, io::Result<W>) {
        self.inner.track_completions(false);
        (self.inner, self.recorder.into_inner().finish())
    }
}
