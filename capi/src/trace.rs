//! Recording the calls of one allocator (device 0 in the C ABI), switched on and off while the
//! program runs: as a trace in our CSV format (`cudalloc_trace_start`), or as a history of the
//! latest events kept in memory with Unix-epoch times (`cudalloc_history_start`, behind
//! PyTorch's `_record_memory_history`). One recording at a time; the events are the same:
//!
//! - `cudalloc_malloc` writes `alloc` (address, requested size, stream), or `oom` (address 0)
//!   when the allocator ran out of memory;
//! - `cudalloc_free` writes `free_requested` then `free_completed` with the size and stream of
//!   the allocation; for an allocation used on another stream (`cudalloc_record_stream` while
//!   the trace is on), `free_completed` is written when its block goes back to the pool, after
//!   that stream's work, as PyTorch writes it;
//! - a trace file (not the history) writes, before the events of each `cudalloc_malloc` that
//!   succeeds and each `cudalloc_free` that writes `free_completed` at once, what the device
//!   answered the event queries the allocator made in that call, on its thread (`event_done`,
//!   `event_pending`: the device is a [`RecordAnswers`]), so that a replay can answer them the
//!   same way (`cudalloc replay --answers`); a call that writes no operation of a replay
//!   writes no answer;
//! - starting a trace while allocations are live writes an `alloc` at time 0 for each of them
//!   (from a snapshot), so that their frees match and a replay starts from the same live set;
//! - `time_us` counts microseconds since the start and never decreases.
//!
//! While a trace is on, the tracer's lock is held across each allocator call it records, so
//! events are written in the order the allocator served them, across threads. While it is off,
//! calls go straight to the allocator (one atomic load), so the allocator's own concurrency
//! (stream shards, thread caches) is untouched; the device's [`RecordAnswers`] only notes, in
//! one of 16 locked maps by handle, the stream of each event recorded. A call already running
//! when the trace starts may be missed: its allocation, or its free of an allocation the start
//! wrote as live.
//!
//! The starting live set comes from [`CachingAllocator::snapshot`]: blocks it shows as
//! allocated. A block that its caller freed into a per-thread cache is `ThreadCached` there,
//! not allocated, so it is not written; handing it out again later is an `alloc` like any other.
//!
//! The events are those of [`Recorder`]. The allocating thread only formats each event into a
//! 64 KiB buffer; compressing and writing happen on the recorder's writer thread
//! ([`BackgroundWriter`]), which the allocating threads wait for only when 32 buffers (2 MiB)
//! are queued. A write error is kept, later events are dropped, and stopping reports it;
//! recording never changes what the allocator returns.

use crate::api::malloc_error_kind;
use crate::error::ErrorKind;
use cudalloc_core::record::background::BackgroundWriter;
use cudalloc_core::record::{csv, Event, EventSink, History, Recorder};
use cudalloc_core::snapshot::BlockState;
use cudalloc_core::{AllocError, Allocation, CachingAllocator};
use cudalloc_sys::wrap::{Given, RecordAnswers};
use cudalloc_sys::{Device, StreamId};
use flate2::write::GzEncoder;
use flate2::Compression;
use parking_lot::Mutex;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// The allocator a tracer records: its device keeps the answers to its event queries while a
/// trace file is written ([`RecordAnswers`]).
pub type Traced<D> = CachingAllocator<RecordAnswers<D>>;

/// Where events go: a plain or a gzip'd file.
enum Sink {
    Plain(BufWriter<File>),
    Gzip(GzEncoder<BufWriter<File>>),
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Sink::Plain(w) => w.write(buf),
            Sink::Gzip(w) => w.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Sink::Plain(w) => w.flush(),
            Sink::Gzip(w) => w.flush(),
        }
    }
}

impl Sink {
    /// Opens `path` (truncating it); gzip when the path ends in `.gz` (a file named just `.gz`
    /// included, which [`Path::extension`] would not count).
    fn create(path: &Path) -> io::Result<Sink> {
        let file = BufWriter::new(File::create(path)?);
        let gz = path.as_os_str().as_encoded_bytes().ends_with(b".gz");
        Ok(if gz {
            Sink::Gzip(GzEncoder::new(file, Compression::default()))
        } else {
            Sink::Plain(file)
        })
    }

    /// Writes everything out (the gzip trailer included), syncs a regular file to disk and
    /// closes the file.
    fn close(self) -> io::Result<()> {
        let file = match self {
            Sink::Plain(w) => w,
            Sink::Gzip(w) => w.finish()?,
        };
        let file = file.into_inner().map_err(io::IntoInnerError::into_error)?;
        // Only a regular file has a disk copy to sync: Linux refuses fsync (EINVAL) on pipes,
        // FIFOs and character devices such as /dev/null, which hold nothing back once written.
        if file.metadata()?.is_file() {
            file.sync_all()?;
        }
        Ok(())
    }
}

/// The file a trace is written to: events are formatted on the allocating thread, compressed
/// and written on the recorder's own writer thread.
struct TraceFile {
    path: PathBuf,
    /// `None` once closed.
    writer: Option<csv::Writer<BackgroundWriter<Sink>>>,
}

impl TraceFile {
    /// Writes out the rest, stops the writer thread and closes the file.
    fn finish(&mut self) -> io::Result<()> {
        match self.writer.take() {
            Some(w) => w.finish().and_then(BackgroundWriter::finish)?.close(),
            None => Ok(()),
        }
    }
}

/// Where a recording's events go: a trace file, or the history kept in memory (PyTorch's
/// `_record_memory_history`), whose events carry Unix-epoch microseconds.
enum Output {
    File(TraceFile),
    History { ring: History, epoch_us: u64 },
}

impl EventSink for Output {
    fn put(&mut self, e: &Event) -> io::Result<()> {
        match self {
            Output::File(f) => match f.writer.as_mut() {
                Some(w) => w.write(e),
                None => Ok(()),
            },
            Output::History { ring, epoch_us } => {
                ring.push(Event {
                    time_us: e.time_us + *epoch_us,
                    ..*e
                });
                Ok(())
            }
        }
    }
}

/// A recording underway.
struct Recording {
    recorder: Recorder<Output>,
    /// Whether the allocator keeps completions for this recording yet.
    tracking: bool,
}

impl Recording {
    /// A recording into `out`, beginning with an `alloc` for each allocation `alloc` holds now.
    fn new<D: Device>(out: Output, alloc: Option<&Traced<D>>) -> Recording {
        let mut r = Recording {
            recorder: Recorder::to_sink(out),
            tracking: false,
        };
        // Kept from the start where the allocator exists: its first recorded allocation must
        // lend no block across streams either (`track_completions` pauses lending). One made
        // later holds nothing to lend before its first allocation.
        if let Some(a) = alloc {
            a.track_completions(true);
            r.tracking = true;
        }
        for seg in alloc.map(|a| a.snapshot().segments).unwrap_or_default() {
            let allocated = seg
                .blocks
                .iter()
                .filter(|b| b.state == BlockState::Allocated);
            for b in allocated {
                r.recorder.live_at_start(b.addr, b.requested, seg.stream);
            }
        }
        r
    }

    /// Writes `answers`, what the device answered the event queries of the call just made,
    /// before that call's events when it writes an operation of a replay (`op`: an `alloc`, a
    /// `free_completed`); the answers of a call that writes none (an `oom`, a failed call, a
    /// free that waits for another stream) are dropped, since no replayed operation makes them.
    fn answered(&mut self, answers: &[Given], op: bool) {
        if op {
            self.recorder.answered(answers);
        }
    }

    fn is_history(&self) -> bool {
        matches!(self.recorder.sink(), Output::History { .. })
    }

    /// Writes the frees that completed since the last event (those that waited for another
    /// stream's work), after making the allocator keep them from now on; before the free of
    /// `ptr` when one is given ([`Recorder::catch_up_before_free`]).
    fn catch_up<D: Device>(&mut self, alloc: &Traced<D>, freeing: Option<u64>) {
        if !self.tracking {
            alloc.track_completions(true);
            self.tracking = true;
        }
        let take = |s| alloc.take_completions(s);
        match freeing {
            Some(ptr) => self.recorder.catch_up_before_free(ptr, take),
            None => self.recorder.catch_up(take),
        }
    }
}

/// The tracer's state: the recording underway, and the history of the last one that ended
/// (kept for reading until a new history starts or the history is cleared).
struct State {
    recording: Option<Recording>,
    kept: History,
}

/// Records the calls of one allocator while switched on; see the module documentation.
pub struct Tracer {
    /// True while `state` holds a recording (a hint read without the lock).
    on: AtomicBool,
    state: Mutex<State>,
}

impl Default for Tracer {
    fn default() -> Self {
        Tracer::new()
    }
}

impl Tracer {
    /// A tracer that records nothing yet.
    pub const fn new() -> Self {
        Tracer {
            on: AtomicBool::new(false),
            state: parking_lot::const_mutex(State {
                recording: None,
                kept: History::new(0),
            }),
        }
    }

    /// Starts writing a trace to `path`, with an `alloc` for each allocation `alloc` holds now.
    pub fn start<D: Device>(&self, path: &Path, alloc: Option<&Traced<D>>) -> Result<(), String> {
        let mut state = self.state.lock();
        busy(&state)?;
        let fail = |e: io::Error| format!("cannot write a trace to {}: {e}", path.display());
        let sink = Sink::create(path).and_then(BackgroundWriter::new);
        let writer = csv::Writer::new(sink.map_err(fail)?).map_err(fail)?;
        let out = Output::File(TraceFile {
            path: path.to_path_buf(),
            writer: Some(writer),
        });
        state.recording = Some(Recording::new(out, alloc));
        self.on.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Starts keeping the latest `max` events in memory, beginning with an `alloc` for each
    /// allocation `alloc` holds now (the events kept from an earlier history are dropped).
    /// While the history is being kept, calling this again changes `max` (and clears when
    /// `clear`) without restarting it.
    pub fn start_history<D: Device>(
        &self,
        max: usize,
        clear: bool,
        alloc: Option<&Traced<D>>,
    ) -> Result<(), String> {
        let mut state = self.state.lock();
        if let Some(Output::History { ring, .. }) =
            state.recording.as_mut().map(|r| r.recorder.sink_mut())
        {
            if clear {
                ring.clear();
            }
            ring.set_max(max);
            return Ok(());
        }
        busy(&state)?;
        // A new history: the kept one's allocations would otherwise appear twice (its events
        // and the new start's live set).
        state.kept.clear();
        let out = Output::History {
            ring: History::new(max),
            epoch_us: epoch_us(),
        };
        state.recording = Some(Recording::new(out, alloc));
        self.on.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Stops the trace and closes its file; the first write error if there was one. `alloc`
    /// (the traced allocator, if made) stops keeping completions.
    pub fn stop<D: Device>(&self, alloc: Option<&Traced<D>>) -> Result<(), String> {
        match self.end(alloc, false)? {
            Some(mut f) => {
                let path = f.path.display().to_string();
                f.finish()
                    .map_err(|e| format!("writing the trace to {path} failed: {e}"))
            }
            None => Ok(()),
        }
    }

    /// Stops keeping the history; its events stay readable ([`Tracer::history`]).
    pub fn stop_history<D: Device>(&self, alloc: Option<&Traced<D>>) -> Result<(), String> {
        self.end(alloc, true).map(|_| ())
    }

    /// Ends the recording underway when it is a history (`history`) or a trace (not): a
    /// history's events are kept for reading, a trace's file is returned to be closed.
    fn end<D: Device>(
        &self,
        alloc: Option<&Traced<D>>,
        history: bool,
    ) -> Result<Option<TraceFile>, String> {
        let mut state = self.state.lock();
        let Some(mut r) = state.recording.take_if(|r| r.is_history() == history) else {
            return Err(if history {
                "no memory history is being recorded".into()
            } else {
                "no trace is being recorded".into()
            });
        };
        // Under the lock, so that no recorded call runs between the last catch-up and the
        // end of tracking (a completion dropped then would leave a free unfinished).
        if let Some(a) = alloc {
            r.catch_up(a, None);
            a.track_completions(false);
        }
        self.on.store(false, Ordering::SeqCst);
        let written = match r.recorder.sink() {
            Output::File(f) => format!("writing the trace to {}", f.path.display()),
            Output::History { .. } => "keeping the memory history".into(),
        };
        match r
            .recorder
            .into_sink()
            .map_err(|e| format!("{written} failed: {e}"))?
        {
            Output::File(f) => Ok(Some(f)),
            Output::History { ring, .. } => {
                state.kept = ring;
                Ok(None)
            }
        }
    }

    /// The history's events, oldest first (from the recording underway, or the last one).
    pub fn history(&self) -> Vec<Event> {
        let state = self.state.lock();
        match state.recording.as_ref().map(|r| r.recorder.sink()) {
            Some(Output::History { ring, .. }) => ring.events().copied().collect(),
            _ => state.kept.events().copied().collect(),
        }
    }

    /// Drops the history's events (of the recording underway, or the last one).
    pub fn clear_history(&self) {
        let mut state = self.state.lock();
        match state.recording.as_mut().map(|r| r.recorder.sink_mut()) {
            Some(Output::History { ring, .. }) => ring.clear(),
            _ => state.kept.clear(),
        }
    }

    /// True while a memory history is being kept.
    pub fn is_keeping_history(&self) -> bool {
        let state = self.state.lock();
        state.recording.as_ref().is_some_and(Recording::is_history)
    }

    /// True while a trace is being recorded.
    pub fn is_recording(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// [`CachingAllocator::allocate`] (or [`CachingAllocator::allocate_tagged`] in `tag`),
    /// recorded while a trace is on (a tagged allocation as any other).
    pub fn allocate<D: Device>(
        &self,
        alloc: &Traced<D>,
        size: u64,
        stream: StreamId,
        tag: Option<&str>,
    ) -> Result<Allocation, AllocError> {
        self.allocate_releasing(alloc, size, stream, tag, &|| false)
    }

    /// [`Tracer::allocate`] that, out of memory, runs `release` and tries once more when it
    /// gave memory back ([`crate::tags::allocate`]): the trace records the allocation once,
    /// with the last try's outcome and the answers the device gave in both tries (not those of
    /// the release, whose driver calls are other allocators').
    pub fn allocate_releasing<D: Device>(
        &self,
        alloc: &Traced<D>,
        size: u64,
        stream: StreamId,
        tag: Option<&str>,
        release: &dyn Fn() -> bool,
    ) -> Result<Allocation, AllocError> {
        if !self.on.load(Ordering::Relaxed) {
            return crate::tags::allocate(alloc, size, stream, tag, release);
        }
        let mut state = self.state.lock();
        let file = state.recording.as_ref().is_some_and(|r| !r.is_history());
        let (mut answers, mut first) = (Vec::new(), None);
        let attempt = |again| {
            let call = || crate::tags::allocate_once(alloc, size, stream, tag, again);
            let (result, given) = recorded(alloc, file, call);
            answers.extend(given);
            if !again {
                first = result.as_ref().err().cloned();
            }
            result
        };
        let result = crate::tags::with_retry(attempt, release);
        // A second try that failed for another reason than memory leaves the first try's
        // out-of-memory event counted (`CachingAllocator::allocate_again`): the line says so.
        let shown = match (&result, first) {
            (Err(e), Some(oom)) if malloc_error_kind(e) != ErrorKind::OutOfMemory => Some(Err(oom)),
            _ => None,
        };
        if let Some(r) = state.recording.as_mut() {
            r.catch_up(alloc, None);
            r.answered(&answers, result.is_ok());
            r.recorder
                .allocated(shown.as_ref().unwrap_or(&result), size, stream);
        }
        result
    }

    /// [`CachingAllocator::free_ptr`], recorded while a trace is on. A free of an allocation
    /// the trace never saw made is not written.
    pub fn free<D: Device>(&self, alloc: &Traced<D>, ptr: u64) -> Result<(), AllocError> {
        if !self.on.load(Ordering::Relaxed) {
            return alloc.free_ptr(ptr);
        }
        let mut state = self.state.lock();
        if let Some(r) = state.recording.as_mut() {
            r.catch_up(alloc, Some(ptr));
        }
        let file = state.recording.as_ref().is_some_and(|r| !r.is_history());
        let (freed, answers) = recorded(alloc, file, || alloc.free_ptr(ptr));
        if let Some(r) = state.recording.as_mut() {
            let op = freed.is_ok() && r.recorder.completes_at_free(ptr);
            r.answered(&answers, op);
            if freed.is_ok() {
                r.recorder.freed(ptr);
            }
        }
        freed?;
        Ok(())
    }

    /// [`CachingAllocator::record_stream`], noted while a trace is on: the allocation's
    /// `free_completed` is then written when its block goes back to the pool.
    pub fn record_stream<D: Device>(
        &self,
        alloc: &Traced<D>,
        ptr: u64,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        if !self.on.load(Ordering::Relaxed) {
            return alloc.record_stream(ptr, stream);
        }
        let mut state = self.state.lock();
        if let Some(r) = state.recording.as_mut() {
            r.catch_up(alloc, None);
        }
        alloc.record_stream(ptr, stream)?;
        if let Some(r) = state.recording.as_mut() {
            r.recorder.used_on(ptr, stream);
        }
        Ok(())
    }

    /// [`CachingAllocator::empty_cache`]; frees that waited for other streams complete in it.
    pub fn empty_cache<D: Device>(&self, alloc: &Traced<D>) -> Result<(), AllocError> {
        if !self.on.load(Ordering::Relaxed) {
            return alloc.empty_cache();
        }
        let mut state = self.state.lock();
        let result = alloc.empty_cache();
        if let Some(r) = state.recording.as_mut() {
            r.catch_up(alloc, None);
        }
        result
    }
}

/// Runs `call`, with the device's answers to its event queries when `file` (a trace file is
/// written; the history keeps none).
fn recorded<D: Device, R>(
    alloc: &Traced<D>,
    file: bool,
    call: impl FnOnce() -> R,
) -> (R, Vec<Given>) {
    if file {
        alloc.with_device(|d| d.record(call))
    } else {
        (call(), Vec::new())
    }
}

/// An error when a recording is underway: one at a time.
fn busy(state: &State) -> Result<(), String> {
    match state.recording.as_ref().map(|r| r.recorder.sink()) {
        None => Ok(()),
        Some(Output::File(f)) => Err(format!(
            "a trace is already being recorded to {}",
            f.path.display()
        )),
        Some(Output::History { .. }) => Err(
            "the memory history is being recorded (torch.cuda.memory._record_memory_history); \
             stop it first"
                .into(),
        ),
    }
}

/// Microseconds since the Unix epoch (0 on a clock set before it).
fn epoch_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

#[cfg(test)]
#[path = "trace_tests.rs"]
mod tests;
