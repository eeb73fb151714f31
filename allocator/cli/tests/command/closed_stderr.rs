//! A stderr that cannot be written (a pipe whose reader has gone: `cudalloc replay ... 2>&1 |
//! grep -q warning`) loses the notes, warnings and errors, and changes neither the work nor the
//! exit status; it used to panic (`eprintln!`), exit status 101, at the first line said.

use super::run::{csv_trace, scratch, stdout};
use std::process::{Command, Output};

/// `cudalloc ARGS` with stderr a pipe whose read end is closed before the command starts.
fn with_stderr_closed(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(args)
        .stderr(writer)
        .output()
        .expect("the cudalloc binary runs")
}

#[test]
fn notes_and_warnings_to_a_closed_stderr_change_nothing() {
    // A free of an address never allocated: an anomaly, warned about by `stats`.
    let odd = csv_trace(
        "closed-stderr",
        "odd.trace.csv",
        "free_completed,8192,512,0,0\nalloc,4096,512,0,1\n",
    );
    let odd = odd.to_str().unwrap();
    let empty = scratch("closed-stderr-empty").join("empty.trace.csv");
    std::fs::write(&empty, "action,addr,size,stream,time_us\n").unwrap();
    let empty = empty.to_str().unwrap();
    // A note (a config string without a policy key), a warning (a trace with nothing to
    // replay), and the plot and calls files said written.
    let dir = scratch("closed-stderr-out");
    let plot = dir.join("p.html");
    let calls = dir.join("c.csv");
    let o = with_stderr_closed(&[
        "replay",
        "--config",
        "max_chunk_mb:16",
        "--plot",
        plot.to_str().unwrap(),
        "--calls",
        calls.to_str().unwrap(),
        odd,
        empty,
    ]);
    assert_eq!(o.status.code(), Some(0), "{:?}", o.status);
    assert!(
        stdout(&o).contains("summary over 2 trace(s)"),
        "{}",
        stdout(&o)
    );
    assert!(plot.is_file() && calls.is_file());
    let o = with_stderr_closed(&["stats", "--config", "max_chunk_mb:16", odd]);
    assert_eq!(o.status.code(), Some(0), "{:?}", o.status);
    assert!(
        stdout(&o).contains("\"unmatched_frees\": 1"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn failures_and_errors_to_a_closed_stderr_keep_their_exit_status() {
    let huge = csv_trace(
        "closed-stderr-huge",
        "huge.trace.csv",
        &format!("alloc,4096,{},0,0\n", u64::MAX),
    );
    let huge = huge.to_str().unwrap();
    // With --json a failure is said on stderr, beside the JSON line.
    let o = with_stderr_closed(&["replay", "--json", "--policy", "default", huge]);
    assert_eq!(o.status.code(), Some(1), "{:?}", o.status);
    assert!(stdout(&o).contains("\"completed\":false"), "{}", stdout(&o));
    let o = with_stderr_closed(&["replay", "--policy", "default", "/no/such/trace.csv"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", o.status);
}
