//! Helpers of `replay.rs` and `refusals.rs`: the built `cudalloc` binary, the bundled traces,
//! scratch directories.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn cudalloc(args: &[&str]) -> Output {
    cudalloc_in(Path::new(env!("CARGO_MANIFEST_DIR")), args)
}

pub fn cudalloc_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the cudalloc binary runs")
}

pub fn bundled(name: &str) -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    dir.join(name).to_string_lossy().into_owned()
}

pub fn bert() -> String {
    bundled("bert_dynamic.trace.csv.gz")
}

/// A fresh directory for one test's files.
pub fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

/// A CSV trace of `lines` (after the header) named `name` in test `test`'s scratch directory.
pub fn csv_trace(test: &str, name: &str, lines: &str) -> PathBuf {
    let path = scratch(test).join(name);
    std::fs::write(&path, format!("action,addr,size,stream,time_us\n{lines}")).unwrap();
    path
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The `policy` label of each `--json` line, in order.
pub fn policy_labels(lines: &[serde_json::Value]) -> Vec<&str> {
    lines
        .iter()
        .map(|v| v["policy"].as_str().expect("a policy label"))
        .collect()
}

pub fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("every stdout line is JSON"))
        .collect()
}
