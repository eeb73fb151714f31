//! Bad trace files, at the readers and at the command line: each must give a clear error (the
//! right `TraceError`, or exit status 1 or 2 with a message naming what was wrong), never a
//! panic. (Bad calls on the allocator: the
//! `cudalloc` crate's `tests/faults/bad_input_*.rs`; bad configurations: its
//! `tests/policies/config.rs`.)
//!
//! What is tried:
//! - Trace readers (`trace::read`, `csv::read`, `rmm::read`, `pytorch::read_snapshot`): an empty
//!   file, a directory, a missing file, garbage bytes, a gzip truncated in the middle, gzip magic
//!   followed by garbage, a gzip of a gzip, a gzip of garbage, a pickle of the wrong shape or
//!   truncated, a device index that does not exist, non-UTF-8 lines, lines with fields missing
//!   or extra.
//! - The `cudalloc` binary: each bad trace file above, bad `--config` strings, bad
//!   `--capacity` values (negative, NaN, infinity, unknown unit, empty, zero, an exponent), an
//!   unknown subcommand and flag, a trace whose single request is `u64::MAX` bytes (exit 1: the
//!   replay fails with an error, not a panic), and `--min-capacity` on a trace no cap can hold
//!   (it must finish).

use cudalloc_trace::{self as trace, csv, pytorch, rmm};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;

// ---- trace readers ------------------------------------------------------------------------------

/// A fresh directory for one test's files.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("bad-input-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap()
}

fn good_csv() -> String {
    let mut s = String::from("action,addr,size,stream,time_us\n");
    for i in 0..2000u64 {
        s += &format!("alloc,{},{},0,{i}\n", 4096 + i * 8192, 1000 + i);
    }
    s
}

/// Bad trace files, by name, with what the error must mention.
fn bad_trace_files(dir: &Path) -> Vec<(PathBuf, &'static str)> {
    let good = gzip(good_csv().as_bytes());
    let mut pickle_of_list = vec![0x80, 2, b']', b'.'];
    pickle_of_list.truncate(4);
    let files: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty.csv", vec![], "empty"),
        (
            "garbage.csv",
            b"\x00\x01garbage\xff\xfe\n1,2,3\n".to_vec(),
            "not a PyTorch snapshot pickle, our CSV trace",
        ),
        ("truncated.csv.gz", good[..good.len() / 2].to_vec(), ""),
        (
            "magic_then_garbage.csv.gz",
            b"\x1f\x8b\x08garbage garbage".to_vec(),
            "",
        ),
        (
            "twice.csv.gz",
            gzip(&good),
            "compressed twice (a gzip stream inside a gzip stream)",
        ),
        (
            "gzip_of_garbage.gz",
            gzip(b"\x13\x37 not a trace at all\n"),
            "not a PyTorch snapshot pickle, our CSV trace",
        ),
        (
            "missing_field.csv",
            b"action,addr,size,stream,time_us\nalloc,1,2,3\n".to_vec(),
            "field",
        ),
        (
            "extra_field.csv",
            b"action,addr,size,stream,time_us\nalloc,1,2,3,4,5\n".to_vec(),
            "fields",
        ),
        (
            "negative.csv",
            b"action,addr,size,stream,time_us\nalloc,1,-2,3,4\n".to_vec(),
            "size",
        ),
        (
            "overflow.csv",
            b"action,addr,size,stream,time_us\nalloc,1,99999999999999999999,0,4\n".to_vec(),
            "size",
        ),
        (
            "not_utf8.rmm.csv",
            b"Thread,Time,Action,Pointer,Size,Stream\n1,\xff\xfe,allocate,0x10,1,0\n".to_vec(),
            "UTF-8",
        ),
        (
            "short.rmm.csv",
            b"Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.0,allocate,0x10\n".to_vec(),
            "field",
        ),
        (
            "pickle_garbage.pickle",
            b"\x80\x04garbage".to_vec(),
            "pickle",
        ),
        ("pickle_list.pickle", pickle_of_list, "dict"),
        (
            "pickle_truncated.pickle",
            std::fs::read(data("snapshot.pickle")).unwrap()[..600].to_vec(),
            "pickle",
        ),
    ];
    let mut out = Vec::new();
    for (name, bytes, needle) in files {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        out.push((p, needle));
    }
    out.push((dir.join("no_such_file.csv"), "No such file"));
    let d = dir.join("a_directory.csv");
    std::fs::create_dir_all(&d).unwrap();
    out.push((d, ""));
    out
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data")
        .join(name)
}

#[test]
fn bad_trace_files_are_errors_naming_the_file() {
    let dir = scratch("readers");
    for (path, needle) in bad_trace_files(&dir) {
        let e = match trace::read(&path) {
            Err(e) => e,
            Ok(t) => panic!(
                "{}: read {} ops from a bad file",
                path.display(),
                t.ops.len()
            ),
        };
        assert_eq!(e.file, path);
        let text = e.to_string();
        assert!(text.contains(&*path.to_string_lossy()), "{text}");
        assert!(text.contains(needle), "{}: {text}", path.display());
        if let Some(l) = e.line {
            assert!(l >= 1, "{text}");
        }
    }
}

#[test]
fn readers_given_bytes_directly_report_errors() {
    let p = Path::new("direct");
    let e = csv::read(
        p,
        &b"action,addr,size,stream,time_us\nalloc,1,2,3,4\nfree,1,2,3,4\n"[..],
    );
    let e = e.unwrap_err();
    assert_eq!(e.line, Some(3));
    assert!(e.message.contains("free"), "{e}");
    let e = csv::read(p, &b""[..]).unwrap_err();
    assert!(e.message.contains("empty"), "{e}");
    let e = rmm::read(p, &b"Thread,Time,Action\n"[..]).unwrap_err();
    assert_eq!(e.line, Some(1));
    let e = rmm::read(
        p,
        &b"Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,0xzz,1,0\n"[..],
    );
    assert_eq!(e.unwrap_err().line, Some(2));
    let fixture = std::fs::read(data("snapshot.pickle")).unwrap();
    for device in [7, usize::MAX] {
        let e = pytorch::read_snapshot_device(p, &fixture, device).unwrap_err();
        assert!(e.message.contains("device"), "{e}");
    }
    for cut in [0, 1, 2, 10, 100, fixture.len() - 1] {
        assert!(
            pytorch::read_snapshot(p, &fixture[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    assert!(pytorch::read_snapshot(p, b"\x80\x05\x95\xff\xff\xff\xff\xff\xff\xff\x7f").is_err());
}

// ---- the command line ---------------------------------------------------------------------------

fn cudalloc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(args)
        .output()
        .expect("the cudalloc binary runs")
}

fn assert_no_panic(o: &Output, what: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert_ne!(
        o.status.code(),
        Some(101),
        "{what}: exit status of a panic; {err}"
    );
}

fn assert_exit(o: &Output, code: i32, needle: &str, what: &str) {
    assert_no_panic(o, what);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "{what}: {err}");
    assert!(
        err.contains(needle),
        "{what}: stderr lacks `{needle}`: {err}"
    );
}

#[test]
fn cli_bad_trace_files_exit_2_naming_the_file() {
    let dir = scratch("cli-traces");
    for (path, _) in bad_trace_files(&dir) {
        let p = path.to_string_lossy().into_owned();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let o = cudalloc(&["replay", "--policy", "torch", &p]);
        assert_exit(&o, 2, &name, &format!("replay {name}"));
        let o = cudalloc(&["stats", &p]);
        assert_exit(&o, 2, &name, &format!("stats {name}"));
    }
}

#[test]
fn cli_bad_options_exit_2() {
    let trace = data("snapshot.csv");
    let trace = trace.to_string_lossy();
    for cfg in [
        "max_split_size_mb:abc",
        "bogus:1",
        "roundup_power2_divisions:[64:3]",
        ":",
        ",",
        "policy:torch,max_chunk_mb:16",
    ] {
        let o = cudalloc(&["replay", "--config", cfg, &trace]);
        assert_exit(&o, 2, "", &format!("--config {cfg}"));
        let o = cudalloc(&["stats", "--config", cfg, &trace]);
        assert_exit(&o, 2, "", &format!("stats --config {cfg}"));
    }
    for cap in [
        "-1",
        "-1GiB",
        "NaNGiB",
        "infGiB",
        "1e400GiB",
        "",
        "12 parsecs",
        "GiB",
        "0.0001B",
    ] {
        let o = cudalloc(&["replay", &format!("--capacity={cap}"), &trace]);
        assert_exit(&o, 2, "capacity", &format!("--capacity {cap:?}"));
    }
    // Digits past u64::MAX: too large, with or without a unit (not "not a byte count").
    for cap in ["99999999999999999999999", "99999999999999999999999GiB"] {
        let o = cudalloc(&["replay", &format!("--capacity={cap}"), &trace]);
        assert_exit(&o, 2, "is too large", &format!("--capacity {cap:?}"));
    }
    // So are those of a config key's integer (not "not a non-negative integer").
    for cfg in [
        "max_chunk_mb:99999999999999999999",
        "max_split_size_mb:99999999999999999999",
    ] {
        let o = cudalloc(&["replay", "--config", cfg, &trace]);
        assert_exit(&o, 2, "is too large", &format!("--config {cfg}"));
        let o = cudalloc(&["stats", "--config", cfg, &trace]);
        assert_exit(&o, 2, "is too large", &format!("stats --config {cfg}"));
    }
    // A cap of nothing, and a number with an exponent, each named for what it is.
    let o = cudalloc(&["replay", "--capacity=0", &trace]);
    assert_exit(&o, 2, "leaves no room", "--capacity 0");
    for cap in ["1e9B", "2E3GiB", "1e+9B", "1E-3GiB"] {
        let o = cudalloc(&["replay", &format!("--capacity={cap}"), &trace]);
        assert_exit(
            &o,
            2,
            "exponents are not read",
            &format!("--capacity {cap:?}"),
        );
    }
    // Malformed words whose digits overflow before the fault are malformed, not too large.
    let o = cudalloc(&["replay", "--capacity=99999999999999999999999.5.5", &trace]);
    assert_exit(&o, 2, "is not a byte count", "--capacity 999...9.5.5");
    let o = cudalloc(&[
        "replay",
        "--config",
        "max_chunk_mb:99999999999999999999x",
        &trace,
    ]);
    assert_exit(&o, 2, "is not a non-negative integer", "--config 999...9x");
    let o = cudalloc(&["replay", "--policy", "pytorch", &trace]);
    assert_exit(&o, 2, "pytorch", "--policy pytorch");
    let o = cudalloc(&["frobnicate"]);
    assert_exit(&o, 2, "frobnicate", "unknown subcommand");
    let o = cudalloc(&["replay", "--no-such-flag", &trace]);
    assert_exit(&o, 2, "no-such-flag", "unknown flag");
}

#[test]
fn cli_request_of_u64_max_bytes_fails_the_replay_cleanly() {
    let dir = scratch("cli-huge");
    let p = dir.join("huge.csv");
    let text = format!(
        "action,addr,size,stream,time_us\nalloc,8192,{},0,1\nfree_completed,8192,{},0,2\n\
         alloc,4096,1000,0,3\n",
        u64::MAX,
        u64::MAX
    );
    std::fs::write(&p, text).unwrap();
    let p = p.to_string_lossy();
    for policy in ["torch", "torch-expandable", "default"] {
        let o = cudalloc(&["replay", "--policy", policy, &p]);
        assert_exit(
            &o,
            1,
            "",
            &format!("replay --policy {policy} of a u64::MAX request"),
        );
        let o = cudalloc(&["stats", "--policy", policy, &p]);
        assert_exit(
            &o,
            1,
            "",
            &format!("stats --policy {policy} of a u64::MAX request"),
        );
    }
}

#[test]
fn cli_min_capacity_of_a_trace_no_cap_holds_finishes() {
    let dir = scratch("cli-min-capacity");
    let p = dir.join("too_big.csv");
    let text = format!(
        "action,addr,size,stream,time_us\nalloc,4096,{},0,1\n",
        200 * GIB
    );
    std::fs::write(&p, text).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(["replay", "--min-capacity", "--json", "--policy", "torch"])
        .arg(&p)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("--min-capacity did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = child.wait_with_output().unwrap();
    assert_exit(&o, 1, "", "--min-capacity of a 200 GiB request");
}
