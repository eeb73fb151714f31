//! Recording the calls of one allocator (device 0 in the C ABI) as a trace in our CSV format,
//! switched on and off while the program runs.
//!
//! - `cudalloc_malloc` writes `alloc` (address, requested size, stream), or `oom` (address 0)
//!   when the allocator ran out of memory;
//! - `cudalloc_free` writes `free_requested` then `free_completed` with the size and stream of
//!   the allocation; for an allocation used on another stream (`cudalloc_record_stream` while
//!   the trace is on), `free_completed` is written when its block goes back to the pool, after
//!   that stream's work, as PyTorch writes it;
//! - starting a trace while allocations are live writes an `alloc` at time 0 for each of them
//!   (from a snapshot), so that their frees match and a replay starts from the same live set;
//! - `time_us` counts microseconds since the start and never decreases.
//!
//! While a trace is on, the tracer's lock is held across each allocator call it records, so
//! events are written in the order the allocator served them, across threads. While it is off,
//! calls go straight to the allocator (one atomic load), so the allocator's own concurrency
//! (stream shards, thread caches) is untouched. A call already running when the trace starts
//! may be missed: its allocation, or its free of an allocation the start wrote as live.
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

use cudalloc_core::record::background::BackgroundWriter;
use cudalloc_core::record::Recorder;
use cudalloc_core::snapshot::BlockState;
use cudalloc_core::{AllocError, Allocation, CachingAllocator};
use cudalloc_sys::{Device, StreamId};
use flate2::write::GzEncoder;
use flate2::Compression;
use parking_lot::Mutex;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

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

/// A trace being written: events are formatted on the allocating thread, compressed and
/// written on the recorder's own writer thread.
struct Recording {
    path: PathBuf,
    recorder: Recorder<BackgroundWriter<Sink>>,
    /// Whether the allocator keeps completions for this recording yet.
    tracking: bool,
}

impl Recording {
    /// Writes the frees that completed since the last event (those that waited for another
    /// stream's work), after making the allocator keep them from now on; before the free of
    /// `ptr` when one is given ([`Recorder::catch_up_before_free`]).
    fn catch_up<D: Device>(&mut self, alloc: &CachingAllocator<D>, freeing: Option<u64>) {
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

/// Records the calls of one allocator while switched on; see the module documentation.
pub struct Tracer {
    /// True while `state` holds a recording (a hint read without the lock).
    on: AtomicBool,
    state: Mutex<Option<Recording>>,
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
            state: parking_lot::const_mutex(None),
        }
    }

    /// Starts writing a trace to `path`, with an `alloc` for each allocation `alloc` holds now.
    pub fn start<D: Device>(
        &self,
        path: &Path,
        alloc: Option<&CachingAllocator<D>>,
    ) -> Result<(), String> {
        let mut state = self.state.lock();
        if let Some(r) = state.as_ref() {
            return Err(format!(
                "a trace is already being recorded to {}",
                r.path.display()
            ));
        }
        let fail = |e: io::Error| format!("cannot write a trace to {}: {e}", path.display());
        let sink = Sink::create(path).and_then(BackgroundWriter::new);
        let mut r = Recording {
            path: path.to_path_buf(),
            recorder: Recorder::new(sink.map_err(fail)?).map_err(fail)?,
            tracking: false,
        };
        for seg in alloc.map(|a| a.snapshot().segments).unwrap_or_default() {
            let allocated = seg
                .blocks
                .iter()
                .filter(|b| b.state == BlockState::Allocated);
            for b in allocated {
                r.recorder.live_at_start(b.addr, b.requested, seg.stream);
            }
        }
        *state = Some(r);
        self.on.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Stops the trace and closes its file; the first write error if there was one. `alloc`
    /// (the traced allocator, if made) stops keeping completions.
    pub fn stop<D: Device>(&self, alloc: Option<&CachingAllocator<D>>) -> Result<(), String> {
        let r = {
            let mut state = self.state.lock();
            // Under the lock, so that no recorded call runs between the last catch-up and the
            // end of tracking (a completion dropped then would leave a free unfinished).
            if let (Some(r), Some(a)) = (state.as_mut(), alloc) {
                r.catch_up(a, None);
                a.track_completions(false);
            }
            self.on.store(false, Ordering::SeqCst);
            state.take()
        }
        .ok_or_else(|| "no trace is being recorded".to_string())?;
        let path = r.path.display().to_string();
        let fail = |e: io::Error| format!("writing the trace to {path} failed: {e}");
        r.recorder
            .finish()
            .and_then(BackgroundWriter::finish)
            .and_then(Sink::close)
            .map_err(fail)
    }

    /// True while a trace is being recorded.
    pub fn is_recording(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// [`CachingAllocator::allocate`] (or [`CachingAllocator::allocate_tagged`] in `tag`),
    /// recorded while a trace is on (a tagged allocation as any other).
    pub fn allocate<D: Device>(
        &self,
        alloc: &CachingAllocator<D>,
        size: u64,
        stream: StreamId,
        tag: Option<&str>,
    ) -> Result<Allocation, AllocError> {
        if !self.on.load(Ordering::Relaxed) {
            return crate::tags::allocate(alloc, size, stream, tag);
        }
        let mut state = self.state.lock();
        let result = crate::tags::allocate(alloc, size, stream, tag);
        if let Some(r) = state.as_mut() {
            r.catch_up(alloc, None);
            r.recorder.allocated(&result, size, stream);
        }
        result
    }

    /// [`CachingAllocator::free_ptr`], recorded while a trace is on. A free of an allocation
    /// the trace never saw made is not written.
    pub fn free<D: Device>(&self, alloc: &CachingAllocator<D>, ptr: u64) -> Result<(), AllocError> {
        if !self.on.load(Ordering::Relaxed) {
            return alloc.free_ptr(ptr);
        }
        let mut state = self.state.lock();
        if let Some(r) = state.as_mut() {
            r.catch_up(alloc, Some(ptr));
        }
        alloc.free_ptr(ptr)?;
        if let Some(r) = state.as_mut() {
            r.recorder.freed(ptr);
        }
        Ok(())
    }

    /// [`CachingAllocator::record_stream`], noted while a trace is on: the allocation's
    /// `free_completed` is then written when its block goes back to the pool.
    pub fn record_stream<D: Device>(
        &self,
        alloc: &CachingAllocator<D>,
        ptr: u64,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        if !self.on.load(Ordering::Relaxed) {
            return alloc.record_stream(ptr, stream);
        }
        let mut state = self.state.lock();
        if let Some(r) = state.as_mut() {
            r.catch_up(alloc, None);
        }
        alloc.record_stream(ptr, stream)?;
        if let Some(r) = state.as_mut() {
            r.recorder.used_on(ptr, stream);
        }
        Ok(())
    }

    /// [`CachingAllocator::empty_cache`]; frees that waited for other streams complete in it.
    pub fn empty_cache<D: Device>(&self, alloc: &CachingAllocator<D>) -> Result<(), AllocError> {
        if !self.on.load(Ordering::Relaxed) {
            return alloc.empty_cache();
        }
        let mut state = self.state.lock();
        let result = alloc.empty_cache();
        if let Some(r) = state.as_mut() {
            r.catch_up(alloc, None);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudalloc_core::Config;
    use cudalloc_sys::{SimConfig, SimDevice};
    use cudalloc_trace::read;

    /// PyTorch's rules: no per-thread caches, so a freed block is free in the snapshot.
    fn sim_allocator() -> CachingAllocator<SimDevice> {
        allocator_for(cudalloc_core::Policy::Torch)
    }

    fn allocator_for(policy: cudalloc_core::Policy) -> CachingAllocator<SimDevice> {
        let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
        CachingAllocator::new(sim, Config::for_policy(policy))
    }

    fn lines(path: &Path) -> Vec<String> {
        let text = std::fs::read_to_string(path).unwrap();
        text.lines().map(str::to_string).collect()
    }

    #[test]
    fn records_only_while_on_and_starts_from_the_live_set() {
        let dir = std::env::temp_dir().join(format!("cudalloc-capi-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.csv");
        let alloc = sim_allocator();
        let t = Tracer::new();
        let s = StreamId(7);
        let before = t.allocate(&alloc, 1000, s, None).unwrap();
        let gone = t.allocate(&alloc, 3000, s, None).unwrap();
        t.free(&alloc, gone.ptr()).unwrap();
        t.start(&path, Some(&alloc)).unwrap();
        assert!(t.is_recording());
        assert!(t
            .start(&path, Some(&alloc))
            .unwrap_err()
            .contains("already"));
        let a = t.allocate(&alloc, 2 << 20, s, None).unwrap();
        assert!(t.allocate(&alloc, 4 << 30, s, None).is_err());
        assert!(
            t.allocate(&alloc, 1 << 50, s, None).is_err(),
            "more than any device holds"
        );
        t.free(&alloc, before.ptr()).unwrap();
        t.free(&alloc, a.ptr()).unwrap();
        t.stop(Some(&alloc)).unwrap();
        assert!(!t.is_recording());
        let after = t.allocate(&alloc, 10, s, None).unwrap();
        t.free(&alloc, after.ptr()).unwrap();
        let l = lines(&path);
        assert_eq!(l[0], cudalloc_core::record::csv::HEADER);
        assert_eq!(l[1], format!("alloc,{},1000,7,0", before.ptr()));
        let actions: Vec<&str> = l[1..]
            .iter()
            .map(|x| x.split(',').next().unwrap())
            .collect();
        assert_eq!(
            actions,
            [
                "alloc",
                "alloc",
                "oom",
                "oom",
                "free_requested",
                "free_completed",
                "free_requested",
                "free_completed"
            ]
        );
        assert!(l[3].starts_with(&format!("oom,0,{},7,", 4u64 << 30)));
        assert!(l[4].starts_with(&format!("oom,0,{},7,", 1u64 << 50)));
        let trace = read(&path).unwrap();
        assert_eq!(trace.anomalies.unmatched_frees, 0);
        assert!(t.stop(Some(&alloc)).unwrap_err().contains("no trace"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Under the `default` rules a freed block may stay in its thread's cache: the trace does
    /// not start with it as live, so its next hand-out (a cache hit) is no second `alloc` of a
    /// live address.
    #[test]
    fn a_block_in_a_thread_cache_is_not_in_the_starting_live_set() {
        let dir = std::env::temp_dir().join(format!("cudalloc-capi-tc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.csv");
        let alloc = allocator_for(cudalloc_core::Policy::Default);
        let t = Tracer::new();
        let s = StreamId(7);
        let keep = t.allocate(&alloc, 1000, s, None).unwrap();
        let cached = t.allocate(&alloc, 3000, s, None).unwrap();
        t.free(&alloc, cached.ptr()).unwrap();
        t.start(&path, Some(&alloc)).unwrap();
        let again = t.allocate(&alloc, 3000, s, None).unwrap();
        assert_eq!(again.ptr(), cached.ptr(), "a thread-cache hit");
        t.free(&alloc, again.ptr()).unwrap();
        t.free(&alloc, keep.ptr()).unwrap();
        t.stop(Some(&alloc)).unwrap();
        let l = lines(&path);
        assert_eq!(l[1], format!("alloc,{},1000,7,0", keep.ptr()));
        assert!(l[2].starts_with(&format!("alloc,{},3000,7,", cached.ptr())));
        assert_eq!(l.len(), 7, "{l:?}");
        assert_eq!(read(&path).unwrap().anomalies, Default::default());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn gzip_when_the_name_ends_in_gz() {
        let dir = std::env::temp_dir().join(format!("cudalloc-capi-gz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.csv.gz");
        let alloc = sim_allocator();
        let t = Tracer::new();
        t.start::<SimDevice>(&path, None).unwrap();
        let a = t.allocate(&alloc, 512, StreamId::DEFAULT, None).unwrap();
        t.free(&alloc, a.ptr()).unwrap();
        t.stop(Some(&alloc)).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..2], &[0x1f, 0x8b]);
        let trace = read(&path).unwrap();
        assert_eq!(trace.anomalies, Default::default());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn gzip_when_the_file_is_named_just_gz() {
        let dir = std::env::temp_dir().join(format!("cudalloc-capi-dotgz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(".gz");
        let t = Tracer::new();
        t.start::<SimDevice>(&path, None).unwrap();
        t.stop::<SimDevice>(None).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..2], &[0x1f, 0x8b], "not gzip'd");
        assert!(read(&path).unwrap().ops.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Records a few calls to `path` and stops: the result of `stop`.
    fn trace_a_few_calls(path: &Path) -> Result<(), String> {
        let alloc = sim_allocator();
        let t = Tracer::new();
        t.start::<SimDevice>(path, None)?;
        for _ in 0..100 {
            let a = t.allocate(&alloc, 512, StreamId::DEFAULT, None).unwrap();
            t.free(&alloc, a.ptr()).unwrap();
        }
        t.stop(Some(&alloc))
    }

    /// /dev/null takes every byte, but is not a file that fsync can sync (EINVAL on Linux).
    #[cfg(unix)]
    #[test]
    fn a_trace_to_a_character_device_stops_cleanly() {
        trace_a_few_calls(Path::new("/dev/null")).unwrap();
    }

    /// A FIFO (as `/dev/stdout | cat` is a pipe) gets the whole trace, and stopping succeeds.
    #[cfg(unix)]
    #[test]
    fn a_trace_to_a_fifo_is_read_whole_and_stops_cleanly() {
        let dir = std::env::temp_dir().join(format!("cudalloc-capi-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("t.csv");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", fifo.display());
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
        };
        // Checked before the join: a trace that never opened the FIFO leaves the reader waiting.
        trace_a_few_calls(&fifo).unwrap();
        let text = reader.join().unwrap();
        assert!(
            text.starts_with(cudalloc_core::record::csv::HEADER),
            "{text}"
        );
        assert_eq!(text.lines().count(), 1 + 100 * 3, "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bad_path_is_an_error() {
        let t = Tracer::new();
        let e = t
            .start::<SimDevice>(Path::new("/nonexistent-dir/x/t.csv"), None)
            .unwrap_err();
        assert!(
            e.contains("cannot write a trace to /nonexistent-dir/x/t.csv"),
            "{e}"
        );
        assert!(!t.is_recording());
    }

    /// An allocation used on another stream is freed while that stream's work is pending: the
    /// trace writes `free_requested` at the free and `free_completed` only when the block went
    /// back to the pool (at the allocation after the work completed), before the allocation
    /// that reuses it, so a replay reuses it no earlier. Before, both were written at the free.
    #[test]
    fn a_free_waiting_for_another_stream_completes_when_its_block_returns() {
        let dir = std::env::temp_dir().join(format!("cudalloc-capi-rs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.csv");
        let sim = std::sync::Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
        sim.set_auto_complete(false);
        let alloc = CachingAllocator::new(
            sim.clone(),
            Config::for_policy(cudalloc_core::Policy::Torch),
        );
        let t = Tracer::new();
        let (s1, s2) = (StreamId(1), StreamId(2));
        t.start::<std::sync::Arc<SimDevice>>(&path, None).unwrap();
        let a = t.allocate(&alloc, 64 << 20, s1, None).unwrap();
        t.record_stream(&alloc, a.ptr(), s2).unwrap();
        t.free(&alloc, a.ptr()).unwrap();
        let b = t.allocate(&alloc, 64 << 20, s1, None).unwrap();
        assert_ne!(b.ptr(), a.ptr(), "the block waits for stream 2");
        t.free(&alloc, b.ptr()).unwrap();
        sim.complete_stream(s2);
        let c = t.allocate(&alloc, 64 << 20, s1, None).unwrap();
        t.free(&alloc, c.ptr()).unwrap();
        t.stop(Some(&alloc)).unwrap();
        let events: Vec<String> = lines(&path)[1..]
            .iter()
            .map(|l| {
                let f: Vec<&str> = l.split(',').collect();
                let who = if f[1] == a.ptr().to_string() {
                    "a"
                } else {
                    "other"
                };
                format!("{} {who}", f[0])
            })
            .collect();
        assert_eq!(
            events,
            [
                "alloc a",
                "free_requested a",
                "alloc other",
                "free_requested other",
                "free_completed other",
                "free_completed a",
                "alloc a",
                "free_requested a",
                "free_completed a",
            ]
        );
        let trace = read(&path).unwrap();
        assert_eq!(trace.anomalies, Default::default());
        let r = cudalloc_trace::replay::replay(
            &trace,
            &Config::for_policy(cudalloc_core::Policy::Torch),
            &Default::default(),
        );
        let live = alloc.stats();
        assert_eq!(
            (r.peak_reserved_bytes, r.device_mallocs),
            (live.reserved_bytes.0[0].peak as u64, live.num_device_alloc),
            "the replay reserves what the allocator did"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Writes fail on the writer thread (`/dev/full`: no space left); the allocator keeps
    /// serving, and stopping reports the error.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_write_error_on_the_writer_thread_is_reported_by_stop() {
        let alloc = sim_allocator();
        let t = Tracer::new();
        t.start::<SimDevice>(Path::new("/dev/full"), None).unwrap();
        for _ in 0..5_000 {
            let a = t.allocate(&alloc, 512, StreamId::DEFAULT, None).unwrap();
            t.free(&alloc, a.ptr()).unwrap();
        }
        let e = t.stop(Some(&alloc)).unwrap_err();
        assert!(e.contains("writing the trace to /dev/full failed"), "{e}");
        assert!(!t.is_recording());
    }
}
