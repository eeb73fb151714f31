//! The `cudalloc replay` progress bars, run in a pseudo-terminal (`script` from util-linux): a
//! bar while more than 4 MiB of traces are read and one while a trace of more than 100,000
//! operations is replayed, both on stderr and only when stderr is a terminal; none for small
//! work or when stderr is a file or a pipe.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `cudalloc ARGS` with its standard streams on a fresh pseudo-terminal; returns what the
/// terminal showed (stdout and stderr together).
fn in_terminal(args: &[&str]) -> String {
    let line = std::iter::once(env!("CARGO_BIN_EXE_cudalloc"))
        .chain(args.iter().copied())
        .map(|a| format!("'{a}'"))
        .collect::<Vec<_>>()
        .join(" ");
    let o = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .output()
        .expect("`script` (util-linux) runs: these tests need it to make a pseudo-terminal");
    assert!(o.status.success(), "{line}: {o:?}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn piped(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(args)
        .output()
        .expect("the cudalloc binary runs");
    assert!(o.status.success(), "{o:?}");
    o
}

/// A CSV trace of `pairs` allocations each freed at once (two lines each, 35 bytes a line).
fn trace(name: &str, pairs: u64) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-progress");
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    let path = dir.join(name);
    let mut text = String::from("action,addr,size,stream,time_us\n");
    for i in 0..pairs {
        let (addr, size) = (1_000_000 + i * 4096, 512 + i % 4096);
        text += &format!("alloc,{addr},{size},0,{}\n", 2 * i);
        text += &format!("free_completed,{addr},{size},0,{}\n", 2 * i + 1);
    }
    std::fs::write(&path, text).expect("write the trace");
    path
}

#[test]
fn long_reads_and_replays_draw_bars_on_a_terminal_only() {
    let big = trace("big.csv", 70_000);
    assert!(std::fs::metadata(&big).unwrap().len() > 4 << 20);
    let args = ["replay", "--policy", "torch", big.to_str().unwrap()];
    let shown = in_terminal(&args);
    assert!(shown.contains("reading 0/1 traces"), "{shown}");
    assert!(shown.contains("replays  big.csv / torch"), "{shown}");
    assert!(
        shown.contains("140,000 ops replayed"),
        "the table follows: {shown}"
    );
    let o = piped(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !err.contains("reading") && !err.contains("replays"),
        "no bar off a terminal: {err}"
    );
}

#[test]
fn short_work_draws_no_bar() {
    let small = trace("small.csv", 1_000);
    let shown = in_terminal(&["replay", "--policy", "torch", small.to_str().unwrap()]);
    assert!(shown.contains("2,000 ops replayed"), "{shown}");
    assert!(
        !shown.contains("reading") && !shown.contains("replays "),
        "{shown}"
    );
}
