//! # cudalloc-trace: allocation traces and their replay
//!
//! Reading recorded allocation traces, replaying them against any policy of `cudalloc` on the
//! simulated device, and the figures a replay yields. The runtime crate `cudalloc` writes traces
//! (`cudalloc::record`) and depends on nothing here; this crate adds the readers (and with them
//! gzip and a pickle reader) and the replayer.
//!
//! Readers stream their input into a [`TraceBuilder`], which turns events into [`Op`]s: each
//! `alloc` gets a slot number, each `free_completed` names the slot of the allocation live under
//! its address at that moment (addresses are reused later in a trace). Nothing of the input is
//! kept as text. A free of an address that is not live, an alloc of an address already live, or
//! a free whose size or stream is not its allocation's is counted in [`Trace::anomalies`] with
//! the first line where it happened, never a panic.
//!
//! Formats: our CSV ([`csv`]), PyTorch memory snapshots ([`pytorch`]) and RMM's logging adaptor
//! CSV ([`rmm`]), each plain or gzip'd (one or more gzip members, nothing after them: `gzip.rs`).
//! [`read`] picks the reader from the file's content (see there).
//!
//! - [`replay`]: a trace against a policy on the simulated device, and the smallest capacity
//!   it runs in;
//! - [`bound`]: the map floor, the fewest map operations any allocator within a memory slack can
//!   make on a trace.

pub mod bound;
pub mod call_log;
pub mod csv;
mod gzip;
mod pickle_scan;
pub mod prehistory;
pub mod pytorch;
pub mod replay;
pub mod rmm;

pub use cudalloc::record::event::{Action, Event};
pub use cudalloc_sys::wrap::Answer;

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

/// A replayable operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes on stream number `stream` into `slot`.
    Alloc {
        /// Slot the allocation is remembered under.
        slot: u32,
        /// Index into [`Trace::streams`].
        stream: u32,
        /// Requested bytes.
        size: u64,
    },
    /// Free the allocation in `slot`.
    Free {
        /// Slot of the allocation.
        slot: u32,
    },
}

/// Odd events a trace contained (they are skipped in replay).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Anomalies {
    /// `free_completed` of an address that was not live.
    pub unmatched_frees: u64,
    /// `alloc` of an address that was already live (the older allocation is treated as freed).
    pub double_allocs: u64,
    /// `free_completed` of a live address whose size or stream is not the ones its `alloc` had
    /// (it still frees that allocation).
    pub mismatched_frees: u64,
    /// First line (1-based) with an anomaly.
    pub first_line: Option<u64>,
}

/// A trace in compact form.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// File name without directory and `.gz`.
    pub name: String,
    /// The operations to replay.
    pub ops: Vec<Op>,
    /// Stream handles, indexed by [`Op::Alloc::stream`].
    pub streams: Vec<u64>,
    /// Number of slots used.
    pub slots: u32,
    /// Events read (every action).
    pub events: u64,
    /// `segment_alloc` events (PyTorch's `cudaMalloc` calls).
    pub segment_allocs: u64,
    /// Sizes of the `segment_alloc` events in order.
    pub segment_sizes: Vec<u64>,
    /// Addresses of the `segment_alloc` events, in the same order (the recording process's).
    pub segment_addrs: Vec<u64>,
    /// Peak of the summed requested bytes of live allocations (`u64::MAX` when the sum passes
    /// it: sizes no device holds, which a replay refuses).
    pub peak_live: u64,
    /// Odd events.
    pub anomalies: Anomalies,
    /// The line (1-based; for a snapshot, the trace entry) each operation of `ops` comes from;
    /// 0 for an allocation put before the history ([`Trace::before_history`]).
    pub op_lines: Vec<u64>,
    /// Allocations put first because they were live before the history began (PyTorch
    /// snapshots, [`prehistory`]); not counted in `events`.
    pub before_history: u64,
    /// What the trace's line numbers count.
    pub position: Position,
    /// `oom` events: allocations that failed while the trace was recorded. Not replayed (the
    /// request failed on the recording's device, with its limit and its other processes), nor
    /// is what the recording allocator did before failing (its out-of-memory ladder released
    /// its cached blocks), so a replay's figures after one may differ from the recording's.
    pub recorded_ooms: u64,
    /// What the recording's device answered the allocator's event queries (`event_done`,
    /// `event_pending`: traces of the C library), each with the operation whose call made the
    /// query (the index in `ops` of the next operation after it) and the stream of the event
    /// asked about, in the order given.
    pub answers: Vec<Answer>,
}

/// What the line numbers of a trace (its anomalies, its errors, [`Trace::op_lines`]) count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Position {
    /// Lines of a text file (our CSV, RMM logs).
    #[default]
    Line,
    /// Entries of a snapshot's `device_traces` list.
    Entry,
}

impl Position {
    /// The word for one position: `line` or `trace entry`.
    pub fn noun(self) -> &'static str {
        match self {
            Position::Line => "line",
            Position::Entry => "trace entry",
        }
    }
}

impl Trace {
    /// The line (or trace entry) operation `op` comes from; `None` for an allocation put
    /// before the history or an operation the trace does not have.
    pub fn line_of(&self, op: usize) -> Option<u64> {
        self.op_lines.get(op).copied().filter(|&l| l > 0)
    }
}

/// A trace that could not be read.
#[derive(Debug)]
pub struct TraceError {
    /// The file.
    pub file: PathBuf,
    /// 1-based line (or record) number, when the error belongs to one.
    pub line: Option<u64>,
    /// What was wrong.
    pub message: String,
}

impl TraceError {
    /// An error at a line of a file.
    pub fn at(file: &Path, line: u64, message: impl Into<String>) -> Self {
        TraceError {
            file: file.to_path_buf(),
            line: Some(line),
            message: message.into(),
        }
    }

    /// An error of a whole file.
    pub fn file(file: &Path, message: impl Into<String>) -> Self {
        TraceError {
            file: file.to_path_buf(),
            line: None,
            message: message.into(),
        }
    }

    /// A failed read at a line; a gzip error (truncated, corrupt, trailing data) says what is
    /// wrong by itself.
    pub(crate) fn read_failed(file: &Path, line: u64, e: &io::Error) -> Self {
        match gzip::cause(e) {
            Some(g) => TraceError::at(file, line, g.to_string()),
            None => TraceError::at(file, line, format!("read failed: {e}")),
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "{}:{}: {}", self.file.display(), l, self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

impl std::error::Error for TraceError {}

/// Turns a stream of events into a [`Trace`].
#[derive(Default)]
pub struct TraceBuilder {
    trace: Trace,
    /// Address -> (slot, size, stream) of each live allocation.
    live: HashMap<u64, (u32, u64, u64)>,
    free_slots: Vec<u32>,
    stream_index: HashMap<u64, u32>,
    /// Summed sizes of the live allocations, exact (sizes are `u64`, their sum may not be).
    live_bytes: u128,
}

impl TraceBuilder {
    /// A builder for a trace with this name.
    pub fn new(name: impl Into<String>) -> Self {
        let mut b = TraceBuilder::default();
        b.trace.name = name.into();
        b
    }

    /// Adds one event; `line` is where it came from (for anomaly reports).
    pub fn push(&mut self, e: Event, line: u64) {
        self.trace.events += 1;
        self.add(e, line);
    }

    /// Adds the allocation of a block live before the history began (not a line of the input:
    /// not counted in [`Trace::events`], counted in [`Trace::before_history`]).
    pub fn push_before_history(&mut self, e: Event) {
        self.trace.before_history += 1;
        self.add(e, 0);
    }

    /// Counts a line read that holds no event to replay (in [`Trace::events`] only).
    pub fn count_line(&mut self) {
        self.trace.events += 1;
    }

    /// Says what the line numbers given to `push` count.
    pub fn set_position(&mut self, p: Position) {
        self.trace.position = p;
    }

    fn add(&mut self, e: Event, line: u64) {
        match e.action {
            Action::Alloc => self.alloc(e, line),
            Action::FreeCompleted => self.free_completed(e, line),
            Action::SegmentAlloc => {
                self.trace.segment_allocs += 1;
                self.trace.segment_sizes.push(e.size);
                self.trace.segment_addrs.push(e.addr);
            }
            Action::Oom => self.trace.recorded_ooms += 1,
            Action::EventDone | Action::EventPending => self.trace.answers.push(Answer {
                op: self.trace.ops.len() as u64,
                stream: cudalloc_sys::StreamId(e.stream),
                done: e.action == Action::EventDone,
            }),
            _ => {}
        }
    }

    fn alloc(&mut self, e: Event, line: u64) {
        if self.live.contains_key(&e.addr) {
            self.anomaly(line);
            self.trace.anomalies.double_allocs += 1;
            self.free(e.addr, line);
        }
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.trace.slots += 1;
            self.trace.slots - 1
        });
        let next = self.stream_index.len() as u32;
        let stream = *self.stream_index.entry(e.stream).or_insert_with(|| {
            self.trace.streams.push(e.stream);
            next
        });
        self.live.insert(e.addr, (slot, e.size, e.stream));
        self.live_bytes += u128::from(e.size);
        let live = u64::try_from(self.live_bytes).unwrap_or(u64::MAX);
        self.trace.peak_live = self.trace.peak_live.max(live);
        self.trace.ops.push(Op::Alloc {
            slot,
            stream,
            size: e.size,
        });
        self.trace.op_lines.push(line);
    }

    fn free_completed(&mut self, e: Event, line: u64) {
        match self.free(e.addr, line) {
            Some((size, stream)) if (size, stream) != (e.size, e.stream) => {
                self.anomaly(line);
                self.trace.anomalies.mismatched_frees += 1;
            }
            Some(_) => {}
            None => {
                self.anomaly(line);
                self.trace.anomalies.unmatched_frees += 1;
            }
        }
    }

    /// Frees the allocation live at `addr` (at `line`); returns its size and stream, `None` if
    /// none is.
    fn free(&mut self, addr: u64, line: u64) -> Option<(u64, u64)> {
        let (slot, size, stream) = self.live.remove(&addr)?;
        self.live_bytes -= u128::from(size);
        self.free_slots.push(slot);
        self.trace.ops.push(Op::Free { slot });
        self.trace.op_lines.push(line);
        Some((size, stream))
    }

    fn anomaly(&mut self, line: u64) {
        self.trace.anomalies.first_line.get_or_insert(line);
    }

    /// The finished trace.
    pub fn finish(self) -> Trace {
        self.trace
    }
}

/// The trace's display name: the file name without directory and `.gz`.
pub fn trace_name(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.strip_suffix(".gz").map(str::to_string).unwrap_or(name)
}

/// Opens a file, decompressing gzip when its first bytes say so; a truncated or corrupt gzip
/// stream, or data after it, is a read error that says so, and a gzip stream whose contents
/// are gzip again (a file compressed twice) is an error at once.
pub fn open(path: &Path) -> Result<Box<dyn BufRead>, TraceError> {
    let f = std::fs::File::open(path).map_err(|e| TraceError::file(path, e.to_string()))?;
    let mut r = BufReader::with_capacity(1 << 16, f);
    let head = r
        .fill_buf()
        .map_err(|e| TraceError::file(path, e.to_string()))?;
    if !head.starts_with(&GZIP_MAGIC) {
        return Ok(Box::new(r));
    }
    let mut gz = BufReader::with_capacity(1 << 16, gzip::Members::new(r));
    let inner = gz
        .fill_buf()
        .map_err(|e| TraceError::file(path, e.to_string()))?;
    if inner.starts_with(&GZIP_MAGIC) {
        return Err(TraceError::file(
            path,
            "compressed twice (a gzip stream inside a gzip stream): `gunzip` it once",
        ));
    }
    Ok(Box::new(gz))
}

/// The first two bytes of a gzip member.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// UTF-8's byte order mark, which some editors write at the start of a text file.
pub(crate) const BOM: &[u8] = b"\xef\xbb\xbf";

/// Longest line the text readers take (ours and RMM's are under 200 bytes).
pub const MAX_LINE: usize = 4096;

/// Reads line `n` (counting from 1) into `buf` as `BufRead::read_until` does, but no more than
/// [`MAX_LINE`] bytes: a longer one (a file of another kind, one enormous line) is an error
/// naming the line, before it is all in memory.
pub(crate) fn read_line(
    path: &Path,
    r: &mut impl BufRead,
    n: u64,
    buf: &mut Vec<u8>,
) -> Result<usize, TraceError> {
    let got = r
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', buf)
        .map_err(|e| TraceError::read_failed(path, n, &e))?;
    if buf.len() > MAX_LINE {
        return Err(TraceError::at(
            path,
            n,
            format!("longer than {MAX_LINE} bytes: not a line of a trace"),
        ));
    }
    Ok(got)
}

/// Most characters of a field that an error of the text readers shows.
const SHOWN_CHARS: usize = 64;

/// A field of a text trace as an error shows it: UTF-8 (a byte that is not UTF-8 shown as
/// U+FFFD), escaped as Rust's `escape_debug` does but for quotes (a backslash as `\\`, a control
/// or invisible character as `\0` or `\u{200b}`) so that no invisible byte hides what is wrong
/// (`12\034` is not a number, where `12` and `34` around a NUL printed as they are look like
/// one; a file padded with NULs, as a crash leaves one, would print nothing), cut after
/// [`SHOWN_CHARS`] characters with the field's length.
pub(crate) fn shown(field: &[u8]) -> String {
    let text = String::from_utf8_lossy(field);
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == SHOWN_CHARS {
            out += &format!("... ({} bytes)", field.len());
            break;
        }
        if c == '\'' || c == '"' {
            out.push(c);
        } else {
            out.extend(c.escape_debug());
        }
    }
    out
}

/// The bytes without a leading [`BOM`].
pub(crate) fn strip_bom(text: &[u8]) -> &[u8] {
    text.strip_prefix(BOM).unwrap_or(text)
}

/// The formats [`read`] tells apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Pickle,
    Rmm,
    Csv,
    /// Bytes that are none of the three: a first line that is not text.
    Unknown,
}

/// What [`read`] says of a file in no format it reads.
pub const UNKNOWN_FORMAT: &str = "not a PyTorch snapshot pickle, our CSV trace (header \
     `action,addr,size,stream,time_us`) or an RMM log (header \
     `Thread,Time,Action,Pointer,Size,Stream`): its first line is not text";

/// True when `line` (the start of a file's first line, cut at 256 bytes) is text: UTF-8 (a
/// character cut at the end included) without control characters but tabs and carriage
/// returns.
fn is_text(line: &[u8]) -> bool {
    let utf8 = match std::str::from_utf8(line) {
        Ok(_) => true,
        Err(e) => e.error_len().is_none(),
    };
    utf8 && line
        .iter()
        .all(|&c| (c >= 0x20 && c != 0x7f) || c == b'\t' || c == b'\r')
}

/// The format of a file that starts with `head` (decompressed), by the rules [`read`] states.
fn detect(head: &[u8]) -> Format {
    if matches!(head.first(), Some(0x80 | b'(' | b'}')) {
        return Format::Pickle;
    }
    let text = strip_bom(head);
    let first = &text[..text.len().min(256)];
    let first = first.split(|&c| c == b'\n').next().unwrap_or(first);
    let field = first.split(|&c| c == b',').next().unwrap_or(first);
    if !is_text(first) {
        Format::Unknown
    } else if field.trim_ascii() == b"Thread" {
        Format::Rmm
    } else {
        Format::Csv
    }
}

/// Reads a trace in any supported format, chosen by content (after gzip is undone):
/// - a PyTorch snapshot pickle, any protocol (0 to 5): the file starts with protocol 2+'s `PROTO`
///   opcode (`0x80`), or with how protocols 0 and 1 start a dict (`(` MARK, `}` EMPTY_DICT),
///   which no CSV header does;
/// - RMM's CSV (`Thread,Time,Action,Pointer,Size,Stream`): the first field of the first line is
///   `Thread`;
/// - our CSV (`action,addr,size,stream,time_us`) when the first line is text;
/// - otherwise (random bytes, an image, an archive) an error that
///   says the file is in none of these formats ([`UNKNOWN_FORMAT`]).
///
/// A UTF-8 byte order mark before a CSV header is skipped.
pub fn read(path: &Path) -> Result<Trace, TraceError> {
    read_device(path, None)
}

/// [`read`], with the device of a PyTorch snapshot to read given (`None`: chosen as
/// [`pytorch::read_snapshot`] chooses). Our CSV and RMM's logs hold one device's events: a
/// device given for one of them is an error, so that it is never silently ignored.
pub fn read_device(path: &Path, device: Option<usize>) -> Result<Trace, TraceError> {
    let mut r = open(path)?;
    let head = r
        .fill_buf()
        .map_err(|e| TraceError::file(path, e.to_string()))?;
    let format = detect(head);
    if format == Format::Unknown {
        return Err(TraceError::file(path, UNKNOWN_FORMAT));
    }
    if let (Some(d), Format::Rmm | Format::Csv) = (device, format) {
        return Err(TraceError::file(
            path,
            format!("device {d} asked for, but this is not a PyTorch snapshot (its events have no device)"),
        ));
    }
    match format {
        Format::Pickle => {
            // Read no further than the size `pickle_scan` refuses, rather than all of a larger
            // (or endless) input first.
            let mut bytes = Vec::new();
            r.take(u64::from(u32::MAX) + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| TraceError::file(path, e.to_string()))?;
            match device {
                Some(d) => pytorch::read_snapshot_device(path, &bytes, d),
                None => pytorch::read_snapshot(path, &bytes),
            }
        }
        Format::Rmm => rmm::read(path, r),
        Format::Csv => csv::read(path, r),
        Format::Unknown => Err(TraceError::file(path, UNKNOWN_FORMAT)),
    }
}
