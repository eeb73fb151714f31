//! The trace readers and the recorder, end to end through files.
//!
//! Checks that:
//! - our CSV reads plain and gzip'd into the same trace; a malformed line, a wrong header and an
//!   unknown action are errors naming the line; a free of an address that is not live is counted
//!   as an anomaly (not a panic); an address reused after its free maps to a fresh allocation;
//! - RMM's logging-adaptor CSV reads (spaces after commas, `(nil)`, `allocate failure`, hex
//!   streams) through the same `trace::read` dispatch, and a malformed line names its line;
//! - the PyTorch snapshot fixture (`allocator/tests/data/snapshot*.pickle`, made by
//!   `allocator/tests/data/make_fixtures.py`) reads for either device and either pickle protocol, and
//!   gives the same trace as the CSV the Python converter made from it, and so does a real
//!   PyTorch 2.11 snapshot (`torch211_snapshot.pickle`); truncated or garbage
//!   bytes, a missing key and a wrong type are errors (naming the entry and key), not panics;
//! - a [`RecordingAllocator`] run of 1,000 random operations on a simulated device reads back
//!   with the same operation count and peak of live bytes, and one shared by threads writes
//!   its events in an order that never shows an address handed out twice.

use cudalloc::record::RecordingAllocator;
use cudalloc::{CachingAllocator, Config, Policy};
use cudalloc_sys::{SimDevice, StreamId};
use cudalloc_trace::{self as trace, pytorch, Anomalies, Op, Trace};
use serde_pickle::{HashableValue, SerOptions, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::common;
use common::assert_same_trace;

const MIB: u64 = 1 << 20;

/// A unique path under the temp dir, removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str) -> TempFile {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir();
        TempFile(dir.join(format!("cudalloc-{}-{n}-{name}", std::process::id())))
    }

    fn with_bytes(name: &str, bytes: &[u8]) -> TempFile {
        let f = TempFile::new(name);
        std::fs::write(&f.0, bytes).unwrap();
        f
    }

    fn with_gzip(name: &str, text: &str) -> TempFile {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(text.as_bytes()).unwrap();
        TempFile::with_bytes(name, &gz.finish().unwrap())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn read_text(name: &str, text: &str) -> Result<Trace, trace::TraceError> {
    trace::read(&TempFile::with_bytes(name, text.as_bytes()).0)
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data")
        .join(name)
}

fn alloc(slot: u32, stream: u32, size: u64) -> Op {
    Op::Alloc { slot, stream, size }
}

fn free(slot: u32) -> Op {
    Op::Free { slot }
}

// ---- our CSV ----

const GOOD_CSV: &str = "action,addr,size,stream,time_us
segment_alloc,1000000,2097152,0,1
alloc,1000000,100,0,2
alloc,1000512,300,7,3
free_requested,1000000,100,0,4
free_completed,1000000,100,0,5
free_completed,1000512,300,7,6
";

#[test]
fn csv_good() {
    let t = read_text("good.csv", GOOD_CSV).unwrap();
    assert_eq!(t.events, 6);
    assert_eq!(
        t.ops,
        [alloc(0, 0, 100), alloc(1, 1, 300), free(0), free(1)]
    );
    assert_eq!(t.streams, [0, 7]);
    assert_eq!(t.slots, 2);
    assert_eq!(t.segment_sizes, [2 * MIB]);
    assert_eq!(t.peak_live, 400);
    assert_eq!(t.anomalies, Anomalies::default());
}

/// Sizes whose sum passes `u64::MAX` (a fuzzed trace; no device holds them): the peak says
/// `u64::MAX` rather than wrapping or failing the read, as the fuzz harness expects. (Its
/// running count is exact past `u64::MAX`, which no figure shows: once the peak is `u64::MAX`
/// it stays there.)
#[test]
fn live_bytes_past_u64_max_saturate_the_peak() {
    let text = "action,addr,size,stream,time_us\n\
                alloc,4096,18446744073709551615,0,1\n\
                alloc,8192,1000,0,2\n\
                free_completed,4096,18446744073709551615,0,3\n\
                alloc,16384,24,0,4\n";
    let t = read_text("huge.csv", text).unwrap();
    assert_eq!(t.peak_live, u64::MAX);
    assert_eq!(t.ops.len(), 4);
}

#[test]
fn csv_gzip_reads_like_plain() {
    let plain = read_text("same.csv", GOOD_CSV).unwrap();
    let gz = TempFile::with_gzip("same.csv.gz", GOOD_CSV);
    let t = trace::read(&gz.0).unwrap();
    assert_same_trace(&t, &plain);
    assert!(t.name.ends_with("same.csv"), "name {}", t.name);
}

#[test]
fn csv_malformed_line_names_the_line() {
    let text = format!("{GOOD_CSV}alloc,5,notanumber,0,7\n");
    let e = read_text("bad.csv", &text).unwrap_err();
    assert_eq!(e.line, Some(8));
    assert!(e.message.contains("size"), "{e}");
    assert!(e.to_string().contains(":8:"), "{e}");
}

#[test]
fn csv_wrong_header() {
    let e = read_text("header.csv", "action,addr,size\nalloc,1,2\n").unwrap_err();
    assert_eq!(e.line, Some(1));
    assert!(e.message.contains("header"), "{e}");
}

#[test]
fn csv_unknown_action() {
    let text = "action,addr,size,stream,time_us\nalloc,1,2,0,0\nrealloc,1,4,0,1\n";
    let e = read_text("action.csv", text).unwrap_err();
    assert_eq!(e.line, Some(3));
    assert!(e.message.contains("realloc"), "{e}");
}

#[test]
fn csv_unmatched_free_is_an_anomaly() {
    let text = "action,addr,size,stream,time_us
alloc,1024,10,0,0
free_completed,4096,10,0,1
free_completed,1024,10,0,2
free_completed,1024,10,0,3
";
    let t = read_text("unmatched.csv", text).unwrap();
    assert_eq!(t.ops, [alloc(0, 0, 10), free(0)]);
    assert_eq!(t.anomalies.unmatched_frees, 2);
    assert_eq!(t.anomalies.first_line, Some(3));
}

#[test]
fn csv_address_reuse() {
    let text = "action,addr,size,stream,time_us
alloc,1024,10,0,0
free_completed,1024,10,0,1
alloc,1024,20,0,2
alloc,2048,5,0,3
alloc,2048,6,0,4
free_completed,1024,20,0,5
";
    let t = read_text("reuse.csv", text).unwrap();
    assert_eq!(
        t.ops,
        [
            alloc(0, 0, 10),
            free(0),
            alloc(0, 0, 20),
            alloc(1, 0, 5),
            free(1),
            alloc(1, 0, 6),
            free(0)
        ]
    );
    assert_eq!(t.slots, 2);
    assert_eq!(t.peak_live, 26);
    assert_eq!(t.anomalies.double_allocs, 1);
    assert_eq!(t.anomalies.unmatched_frees, 0);
    assert_eq!(t.anomalies.first_line, Some(6));
}

// ---- RMM ----

const GOOD_RMM: &str = "Thread,Time,Action,Pointer,Size,Stream
140573312345856, 08:23:45.123456, allocate, 0x7f8a40000000, 1024, 0x0
140573312345856, 08:23:45.123460, allocate, 0x7f8a40000400, 2048, 0x55d1c2a0
140573312345857,08:23:45.123470,allocate failure,(nil),68719476736,0x0

140573312345856,08:23:45.123480,free,0x7f8a40000000,1024,0x0
140573312345856,08:23:45.123490,allocate,0x7f8a40000000,512,0
140573312345856,08:23:45.123500,free,0x7f8a40000400,2048,0x55d1c2a0
";

#[test]
fn rmm_good() {
    let t = read_text("good.rmm.csv", GOOD_RMM).unwrap();
    assert_eq!(t.events, 6);
    assert_eq!(
        t.ops,
        [
            alloc(0, 0, 1024),
            alloc(1, 1, 2048),
            free(0),
            alloc(0, 0, 512),
            free(1)
        ]
    );
    assert_eq!(t.streams, [0, 0x55d1_c2a0]);
    assert_eq!(t.peak_live, 3072);
    assert_eq!(t.anomalies, Anomalies::default());
}

/// RMM logs a 0-byte request as an `allocate` of a null pointer, and its free as a `free` of
/// one: lines read, no memory (they were 512-byte allocations at address 0, each after the
/// first a double allocation).
#[test]
fn rmm_null_pointers_are_no_allocations() {
    let text = format!(
        "{GOOD_RMM}1,08:23:46.000000,allocate,(nil),0,0x0\n1,08:23:46.000001,allocate,0x0,0,0x0\n\
         1,08:23:46.000002,free,(nil),0,0x0\n"
    );
    let t = read_text("null.rmm.csv", &text).unwrap();
    let good = read_text("good.rmm.csv", GOOD_RMM).unwrap();
    assert_eq!((t.events, &t.ops), (good.events + 3, &good.ops));
    assert_eq!(t.anomalies, Anomalies::default());
    assert_eq!(t.op_lines.len(), t.ops.len());
}

#[test]
fn rmm_gzip() {
    let plain = read_text("gz.rmm.csv", GOOD_RMM).unwrap();
    let gz = TempFile::with_gzip("gz.rmm.csv.gz", GOOD_RMM);
    assert_same_trace(&trace::read(&gz.0).unwrap(), &plain);
}

#[test]
fn rmm_malformed_line_names_the_line() {
    let text = format!("{GOOD_RMM}1,08:23:46.000000,allocate,0xnothex,16,0x0\n");
    let e = read_text("bad.rmm.csv", &text).unwrap_err();
    assert_eq!(e.line, Some(9));
    assert!(e.message.contains("Pointer"), "{e}");
    let text = format!("{GOOD_RMM}1,08:23:46.000000,allocate,0x10\n");
    let e = read_text("short.rmm.csv", &text).unwrap_err();
    assert_eq!(e.line, Some(9));
    assert!(e.message.contains("Size"), "{e}");
}

// ---- PyTorch snapshots ----

/// Device 0 of `snapshot.pickle` (see `make_fixtures.py`).
fn assert_fixture_device0(t: &Trace) {
    assert_eq!(t.events, 14);
    assert_eq!(
        t.ops,
        [
            alloc(0, 0, 1000),
            alloc(1, 0, 3000),
            free(0),
            alloc(0, 0, 512),
            alloc(2, 1, 5 * MIB),
            free(2),
            free(1)
        ]
    );
    assert_eq!(t.streams, [0, 0x5581_2D3A_9F10]);
    assert_eq!(t.segment_sizes, [2 * MIB, 20 * MIB]);
    assert_eq!(t.peak_live, 5 * MIB + 3512);
    assert_eq!(t.anomalies, Anomalies::default());
}

#[test]
fn pytorch_fixture() {
    let path = data("snapshot.pickle");
    let t = trace::read(&path).unwrap();
    assert_eq!(t.name, "snapshot.pickle");
    assert_fixture_device0(&t);
    let p2 = data("snapshot_p2.pickle");
    assert_fixture_device0(&pytorch::read_snapshot(&p2, &std::fs::read(&p2).unwrap()).unwrap());
}

#[test]
fn pytorch_fixture_matches_python_converter() {
    let pickle = trace::read(&data("snapshot.pickle")).unwrap();
    let csv = trace::read(&data("snapshot.csv")).unwrap();
    assert_same_trace(&pickle, &csv);
}

#[test]
fn pytorch_real_torch_snapshot() {
    let t = trace::read(&data("torch211_snapshot.pickle")).unwrap();
    assert_eq!(t.events, 167);
    assert_eq!(t.ops.len(), 105);
    assert_eq!(t.streams.len(), 2);
    assert_eq!(t.segment_sizes.len(), 5);
    assert_eq!(t.anomalies, Anomalies::default());
    assert_same_trace(&t, &trace::read(&data("torch211_snapshot.csv")).unwrap());
}

#[test]
fn pytorch_other_device() {
    let path = data("snapshot.pickle");
    let bytes = std::fs::read(&path).unwrap();
    let t = pytorch::read_snapshot_device(&path, &bytes, 1).unwrap();
    assert_eq!(t.ops, [alloc(0, 0, 4096), alloc(1, 0, 8192)]);
    assert_eq!(t.peak_live, 12288);
    let e = pytorch::read_snapshot_device(&path, &bytes, 2).unwrap_err();
    assert!(e.message.contains("device 2"), "{e}");
}

#[test]
fn pytorch_truncated_or_garbage_is_an_error() {
    let path = data("snapshot.pickle");
    let bytes = std::fs::read(&path).unwrap();
    for len in 0..bytes.len() {
        assert!(
            pytorch::read_snapshot(&path, &bytes[..len]).is_err(),
            "prefix {len}"
        );
    }
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..200 {
        let mut garbage = vec![0x80, 4];
        for _ in 0..64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            garbage.push(x as u8);
        }
        assert!(pytorch::read_snapshot(&path, &garbage).is_err());
    }
    let file = TempFile::with_bytes("garbage.pickle", &[0x80, 0x04, 0xff, 0x00, 0x13]);
    assert!(trace::read(&file.0).is_err());
}

fn s(text: &str) -> Value {
    Value::String(text.to_string())
}

/// A pickled snapshot whose device 0 holds `entries`.
fn snapshot_with(entries: Vec<Value>) -> Vec<u8> {
    let top = [(
        HashableValue::String("device_traces".to_string()),
        Value::List(vec![Value::List(entries)]),
    )];
    serde_pickle::value_to_vec(&Value::Dict(top.into_iter().collect()), SerOptions::new()).unwrap()
}

fn entry(fields: &[(&str, Value)]) -> Value {
    let d = fields
        .iter()
        .map(|(k, v)| (HashableValue::String(k.to_string()), v.clone()));
    Value::Dict(d.collect())
}

#[test]
fn pytorch_missing_key_or_wrong_type_names_entry_and_key() {
    let path = Path::new("made.pickle");
    let good = entry(&[
        ("action", s("alloc")),
        ("addr", Value::I64(4096)),
        ("size", Value::I64(10)),
        ("stream", Value::I64(0)),
    ]);
    let missing = entry(&[
        ("action", s("alloc")),
        ("addr", Value::I64(8192)),
        ("stream", Value::I64(0)),
    ]);
    let bytes = snapshot_with(vec![good.clone(), missing]);
    let e = pytorch::read_snapshot(path, &bytes).unwrap_err();
    assert_eq!(e.line, Some(2));
    assert!(
        e.message.contains("entry 2") && e.message.contains("`size`"),
        "{e}"
    );

    let wrong = entry(&[
        ("action", s("alloc")),
        ("addr", Value::I64(8192)),
        ("size", s("ten")),
        ("stream", Value::I64(0)),
    ]);
    let bytes = snapshot_with(vec![good.clone(), good.clone(), wrong]);
    let e = pytorch::read_snapshot(path, &bytes).unwrap_err();
    assert_eq!(e.line, Some(3));
    assert!(
        e.message.contains("entry 3") && e.message.contains("`size`"),
        "{e}"
    );

    let t = pytorch::read_snapshot(path, &snapshot_with(vec![good])).unwrap();
    assert_eq!(t.ops, [alloc(0, 0, 10)]);
}

#[test]
fn pytorch_not_a_snapshot() {
    let path = Path::new("list.pickle");
    let bytes = serde_pickle::value_to_vec(&Value::List(vec![]), SerOptions::new()).unwrap();
    let e = pytorch::read_snapshot(path, &bytes).unwrap_err();
    assert!(e.message.contains("dict"), "{e}");
}

// ---- recording ----

/// xorshift64: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn recording_round_trip() {
    let file = TempFile::new("recorded.csv.gz");
    let out = flate2::write::GzEncoder::new(
        std::fs::File::create(&file.0).unwrap(),
        flate2::Compression::fast(),
    );
    let inner = CachingAllocator::new(SimDevice::with_capacity(64 << 30), Config::default());
    let rec = RecordingAllocator::new(inner, out).unwrap();
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let (mut live, mut allocs, mut frees) = (Vec::new(), 0u64, 0u64);
    let (mut live_bytes, mut peak) = (0u64, 0u64);
    for _ in 0..1000 {
        // Two allocations for each free, on average.
        if live.is_empty() || rng.next() % 3 < 2 {
            let size = 1 + rng.next() % (8 * MIB);
            let stream = StreamId(rng.next() % 2);
            let a = rec.allocate(size, stream).unwrap();
            live_bytes += size;
            peak = peak.max(live_bytes);
            live.push(a);
            allocs += 1;
        } else {
            let a = live.swap_remove((rng.next() % live.len() as u64) as usize);
            live_bytes -= a.size();
            rec.free(a).unwrap();
            frees += 1;
        }
    }
    let oom = rec.allocate(1 << 40, StreamId(0)).unwrap_err();
    assert!(oom.is_out_of_memory());
    rec.finish().unwrap().finish().unwrap();

    let t = trace::read(&file.0).unwrap();
    assert_eq!(t.ops.len() as u64, allocs + frees);
    assert_eq!(t.events, allocs + 2 * frees + 1);
    assert_eq!(t.peak_live, peak);
    assert_eq!(t.anomalies, Anomalies::default());
}

/// A stale handle (its address handed out again since) is refused by the recording front as by
/// `CachingAllocator::free`, and the trace shows no free of the live allocation.
#[test]
fn recording_refuses_a_stale_handle() {
    let inner = CachingAllocator::new(
        SimDevice::with_capacity(64 << 30),
        Config::for_policy(Policy::Torch),
    );
    let rec = RecordingAllocator::new(inner, Vec::new()).unwrap();
    let x = rec.allocate(4096, StreamId(0)).unwrap();
    rec.free(x.duplicate()).unwrap();
    let y = rec.allocate(8192, StreamId(0)).unwrap();
    assert_eq!(x.ptr(), y.ptr(), "the address is handed out again");
    assert!(rec.free(x).is_err(), "a stale handle frees nothing");
    rec.free(y).unwrap();
    let out = rec.finish().unwrap();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(text.matches("free_completed").count(), 2, "{text}");
}

#[test]
fn recording_from_threads_keeps_the_order() {
    let inner = CachingAllocator::new(SimDevice::with_capacity(64 << 30), Config::default());
    let rec = RecordingAllocator::new(inner, Vec::new()).unwrap();
    std::thread::scope(|scope| {
        for seed in 1..=4u64 {
            let rec = &rec;
            scope.spawn(move || {
                let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                for _ in 0..500 {
                    let a = rec.allocate(1 + rng.next() % 4096, StreamId(0)).unwrap();
                    rec.free(a).unwrap();
                }
            });
        }
    });
    let bytes = rec.finish().unwrap();
    let file = TempFile::with_bytes("threads.csv", &bytes);
    let t = trace::read(&file.0).unwrap();
    assert_eq!(t.ops.len(), 4 * 500 * 2);
    assert_eq!(t.anomalies, Anomalies::default());
}

/// A trace recorded from a job whose allocations are also used on a second stream, whose work
/// completes only now and then, replays to the allocator's own figures: each such free is
/// written as completed when its block went back to the pool, not at the free (before, the
/// replay reused those blocks early: fewer segments and a lower reserved peak than the job's).
#[test]
fn a_recorded_trace_with_record_stream_replays_to_the_live_figures() {
    let cfg = Config::parse("policy:torch,thread_cache:False").unwrap();
    let file = TempFile::new("record-stream.csv");
    let path = &file.0;
    let sim = std::sync::Arc::new(SimDevice::new(cudalloc_sys::SimConfig::with_capacity(
        cudalloc_trace::replay::DEVICE_CAPACITY,
    )));
    sim.set_auto_complete(false);
    let out = std::fs::File::create(path).unwrap();
    let rec =
        RecordingAllocator::new(CachingAllocator::new(sim.clone(), cfg.clone()), out).unwrap();
    let (mine, other) = (StreamId(1), StreamId(2));
    let mut rng = common::Rng(11);
    let mut live = Vec::new();
    for _ in 0..3000 {
        match rng.below(8) {
            0..=3 => live.push(rec.allocate(rng.range(1, 48 * MIB), mine).unwrap()),
            4 if !live.is_empty() => {
                let a: &cudalloc::Allocation = &live[rng.below(live.len() as u64) as usize];
                rec.record_stream(a.ptr(), other).unwrap();
            }
            5 => sim.complete_stream(other),
            _ if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                rec.free(live.swap_remove(i)).unwrap();
            }
            _ => {}
        }
    }
    let s = rec.stats();
    let (inner, written) = rec.into_inner();
    written.unwrap();
    drop(inner);
    let t = trace::read(path).unwrap();
    assert_eq!(t.anomalies, Anomalies::default());
    let r = cudalloc_trace::replay::replay(&t, &cfg, &Default::default());
    assert!(s.calls.mallocs > 10, "{:?}", s.calls);
    assert_eq!(
        (r.peak_reserved_bytes, r.device_mallocs, r.device_frees),
        (
            s.reserved_bytes.0[0].peak as u64,
            s.calls.mallocs,
            s.calls.frees
        )
    );
}

/// A free the recorder did not wait for (an allocation used on another stream before the
/// recorder wrapped the allocator) completes while recording; a later allocation at the same
/// address, used on another stream and freed, must not take that old completion for its own:
/// its `free_completed` comes only when its own block goes back (were the old one written at
/// once, the replay would reuse the block early).
#[test]
fn an_old_completion_at_the_same_address_is_not_taken_for_a_later_free() {
    let cfg = Config::parse("policy:torch,thread_cache:False").unwrap();
    let sim = std::sync::Arc::new(SimDevice::new(cudalloc_sys::SimConfig::with_capacity(
        cudalloc_trace::replay::DEVICE_CAPACITY,
    )));
    sim.set_auto_complete(false);
    let (mine, other) = (StreamId(1), StreamId(2));
    let inner = CachingAllocator::new(sim.clone(), cfg.clone());
    let before = inner.allocate(64 * MIB, mine).unwrap();
    inner.record_stream(before.ptr(), other).unwrap();
    let file = TempFile::new("old-completion.csv");
    let out = std::fs::File::create(&file.0).unwrap();
    let rec = RecordingAllocator::new(inner, out).unwrap();
    let before_ptr = before.ptr();
    rec.free(before).unwrap();
    sim.complete_stream(other);
    let b = rec.allocate(64 * MIB, mine).unwrap();
    assert_eq!(b.ptr(), before_ptr, "the block came back");
    rec.record_stream(b.ptr(), other).unwrap();
    let b_ptr = b.ptr();
    rec.free(b).unwrap();
    let c = rec.allocate(64 * MIB, mine).unwrap();
    assert_ne!(c.ptr(), b_ptr, "b still waits for stream 2");
    rec.free(c).unwrap();
    let s = rec.stats();
    let (inner, written) = rec.into_inner();
    written.unwrap();
    drop(inner);
    let text = std::fs::read_to_string(&file.0).unwrap();
    let actions: Vec<&str> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(
        actions,
        [
            "alloc",
            "free_requested",
            "alloc",
            "free_requested",
            "free_completed"
        ],
        "{text}"
    );
    let t = trace::read(&file.0).unwrap();
    let r = cudalloc_trace::replay::replay(&t, &cfg, &Default::default());
    assert_eq!(
        (r.peak_reserved_bytes, r.device_mallocs),
        (s.reserved_bytes.0[0].peak as u64, s.calls.mallocs),
        "the replay reserves what the live run did: c could not reuse b's waiting block"
    );
    assert_eq!(r.device_mallocs, 2);
}
