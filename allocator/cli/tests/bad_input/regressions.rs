//! Inputs at the limits of the trace readers and the command line, found by the fuzz targets
//! (`fuzz/`, see `docs/guarantees.md`) and the reliability tests: sizes whose rounding or sum
//! passes `u64::MAX` (rounding and live bytes saturate) and deeply nested pickles (a nesting
//! bound before decoding). Each test gives the input and the answer expected.
//!
//! Invariant checked throughout: bad input (a config string, a trace, a request size) is an
//! error or a sane result, never a panic (integer overflow panics in debug builds and silently
//! wraps in release builds, which is worse: a wrong result).

use cudalloc_trace::{csv, rmm};
use std::path::Path;
use std::process::Command;

const HUGE: u64 = u64::MAX - 1000;

fn csv_text() -> String {
    format!("action,addr,size,stream,time_us\nalloc,4096,{HUGE},0,1\nalloc,8192,2000,0,2\n")
}

/// Found by fuzz target `trace_csv` (and `trace_rmm`, `trace_pytorch`: the same builder): two
/// live allocations whose sizes add up past `u64::MAX` overflow `TraceBuilder::live_bytes`
/// (`trace/mod.rs`, `TraceBuilder::alloc`, `self.live_bytes += e.size`): a panic in debug
/// builds; in release the sum wraps, so `Trace::peak_live` (the lower bound of
/// `--min-capacity` and the "peak live" column) is garbage. Expected: an error naming the line,
/// or a trace whose `peak_live` saturates (is at least the largest request).
#[test]
fn trace_whose_live_bytes_pass_u64_max() {
    let text = csv_text();
    match csv::read(Path::new("huge.csv"), text.as_bytes()) {
        Err(e) => assert_eq!(e.line, Some(3), "{e}"),
        Ok(t) => assert!(t.peak_live >= HUGE, "peak_live wrapped to {}", t.peak_live),
    }
    let rmm_text = format!(
        "Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.1,allocate,0x1000,{HUGE},0x0\n\
         1,00:00:00.2,allocate,0x2000,2000,0x0\n"
    );
    match rmm::read(Path::new("huge.rmm.csv"), rmm_text.as_bytes()) {
        Err(e) => assert_eq!(e.line, Some(3), "{e}"),
        Ok(t) => assert!(t.peak_live >= HUGE, "peak_live wrapped to {}", t.peak_live),
    }
}

/// The same trace through the command line, in a debug build (where an overflow would panic,
/// exit status 101): exit status 1 (the replay fails: the request is larger than any device)
/// or 2 (the trace is refused), with a message.
#[test]
fn cli_replay_of_a_trace_whose_live_bytes_pass_u64_max() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("regressions-live-bytes");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("huge.csv");
    std::fs::write(&p, csv_text()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(["replay", "--policy", "torch"])
        .arg(&p)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        matches!(o.status.code(), Some(1) | Some(2)),
        "{:?}: {err}",
        o.status
    );
}

/// Found by probing `trace_pytorch` with nesting bombs: serde-pickle turns the decoded pickle
/// into a `Value` recursively (`serde_pickle::de::Deserializer::convert_value`), one stack frame
/// per level, so a pickle nested about 5,000 deep (10 KB: `\x80\x02`, then `(` MARK 5,000 times,
/// `l` LIST 5,000 times, `.` STOP) overflows the main thread's 8 MiB stack: `trace::read`,
/// `pytorch::read_snapshot` and `cudalloc replay`/`stats` abort with "thread 'main' has
/// overflowed its stack" (exit status 134) instead of returning an error. A stack overflow
/// cannot be caught, so this runs the command line. Expected: exit status 2 with a message
/// (a depth limit checked before decoding, or the decode on a thread whose stack is sized to
/// the input).
#[test]
fn cli_replay_of_a_deeply_nested_pickle_is_an_error() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("regressions-deep-pickle");
    std::fs::create_dir_all(&dir).unwrap();
    for depth in [10_000, 100_000] {
        let mut bytes = b"\x80\x02".to_vec();
        bytes.extend(std::iter::repeat_n(b'(', depth));
        bytes.extend(std::iter::repeat_n(b'l', depth));
        bytes.push(b'.');
        let p = dir.join(format!("nested{depth}.pickle"));
        std::fs::write(&p, bytes).unwrap();
        for cmd in ["replay", "stats"] {
            let o = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
                .arg(cmd)
                .arg(&p)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(
                o.status.code(),
                Some(2),
                "{cmd}, depth {depth}: {:?}: {err}",
                o.status
            );
            assert!(err.contains("nested"), "{cmd}, depth {depth}: {err}");
        }
    }
}

/// A pickle (found by the `trace_pytorch` fuzz target) whose set of floats serde-pickle cannot
/// sort (a NaN among them: its sort panics on a comparison that is not a total order). Expected:
/// exit status 2 and an error that says the decoder failed and why, for `replay` and `stats`.
#[test]
fn cli_replay_of_a_pickle_set_that_cannot_be_ordered_is_an_error() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bad_input/unorderable_set.pickle");
    for cmd in ["replay", "stats"] {
        let o = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
            .arg(cmd)
            .arg(&p)
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{cmd}: {:?}: {err}", o.status);
        assert!(
            err.contains("the pickle decoder failed: user-provided comparison"),
            "{cmd}: {err}"
        );
    }
}
