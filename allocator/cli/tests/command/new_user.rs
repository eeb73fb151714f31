//! What a new user meets first, run as the built `cudalloc` binary:
//! - a config string without a `policy` key runs the `default` policy, and says so: its label
//!   (table and JSON) is `policy:default,STR`, and a note on stderr names the policy;
//! - `cudalloc stats` has one default, the `default` policy, with or without `--config`;
//! - a file in no known trace format (random bytes, whatever its name) is reported as such,
//!   not as a CSV with a bad header; a text file with a wrong header still names the header.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn cudalloc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the cudalloc binary runs")
}

fn bert() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/bert_dynamic.trace.csv.gz")
        .to_string_lossy()
        .into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("every stdout line is JSON"))
        .collect()
}

fn stats_json(o: &Output) -> serde_json::Value {
    assert_eq!(o.status.code(), Some(0), "{}", stderr(o));
    serde_json::from_slice(&o.stdout).expect("stats prints one JSON document")
}

/// A fresh directory for one test's files.
fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("new-user-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

#[test]
fn a_config_without_a_policy_key_is_labelled_and_noted_as_default() {
    for cfg in ["max_split_size_mb:128", "expandable_segments:True"] {
        let o = cudalloc(&["replay", "--json", "--config", cfg, &bert()]);
        assert_eq!(o.status.code(), Some(0), "{cfg}: {}", stderr(&o));
        let label = format!("policy:default,{cfg}");
        assert_eq!(json_lines(&o)[0]["policy"], label.as_str(), "{cfg}");
        let err = stderr(&o);
        assert!(
            err.contains(&format!("note: config '{cfg}' has no policy key"))
                && err.contains("runs the default policy")
                && err.contains("policy:torch"),
            "{cfg}: {err}"
        );
    }
    // The table's row carries the same label.
    let o = cudalloc(&["replay", "--config", "max_split_size_mb:128", &bert()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("policy:default,max_split_size_mb:128"),
        "{table}"
    );
}

#[test]
fn a_config_with_a_policy_key_keeps_its_label_and_gets_no_note() {
    let cfg = "policy:torch,expandable_segments:True";
    let o = cudalloc(&["replay", "--json", "--config", cfg, &bert()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(json_lines(&o)[0]["policy"], cfg);
    assert!(!stderr(&o).contains("note:"), "{}", stderr(&o));
}

/// The same rules under the two labels give the same figures, and a sweep from a config
/// without a policy key extends the labelled string.
#[test]
fn the_label_of_a_config_without_a_policy_gives_the_same_configuration() {
    let o = cudalloc(&[
        "replay",
        "--json",
        "--config",
        "max_chunk_mb:16",
        "--sweep",
        "fragmentation_budget=0.05",
        &bert(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let rows = json_lines(&o);
    assert_eq!(rows[0]["policy"], "policy:default,max_chunk_mb:16");
    assert_eq!(
        rows[1]["policy"],
        "policy:default,max_chunk_mb:16,fragmentation_budget:0.05"
    );
    let same = cudalloc(&[
        "replay",
        "--json",
        "--config",
        "policy:default,max_chunk_mb:16",
        &bert(),
    ]);
    let same = &json_lines(&same)[0];
    for key in ["peak_reserved_bytes", "device_maps", "device_mallocs"] {
        assert_eq!(rows[0][key], same[key], "{key}");
    }
}

#[test]
fn stats_has_one_default_policy() {
    let plain = stats_json(&cudalloc(&["stats", &bert()]));
    assert_eq!(plain["policy"], "default");
    let named = stats_json(&cudalloc(&["stats", "--policy", "default", &bert()]));
    assert_eq!(plain["memory_stats"], named["memory_stats"]);
    let o = cudalloc(&["stats", "--config", "max_split_size_mb:128", &bert()]);
    assert!(
        stderr(&o).contains("runs the default policy"),
        "{}",
        stderr(&o)
    );
    let config = stats_json(&o);
    assert_eq!(config["policy"], "policy:default,max_split_size_mb:128");
    let torch = stats_json(&cudalloc(&["stats", "--policy", "torch", &bert()]));
    assert_eq!(torch["policy"], "torch");
    assert_ne!(
        torch["memory_stats"]["reserved_bytes.all.peak"],
        plain["memory_stats"]["reserved_bytes.all.peak"],
        "the default is not torch"
    );
}

/// Bytes from a fixed generator, not starting as a pickle or gzip stream does.
fn random_bytes(n: usize) -> Vec<u8> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut out: Vec<u8> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    out[0] = 0x07;
    out
}

#[test]
fn a_file_in_no_known_format_says_so() {
    let dir = scratch("formats");
    let gz = {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(&random_bytes(10_000)).unwrap();
        e.finish().unwrap()
    };
    let files = [
        ("random.pickle", random_bytes(10_000)),
        ("random.csv", random_bytes(100)),
        ("random.csv.gz", gz),
    ];
    for (name, bytes) in files {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let p = path.to_string_lossy().into_owned();
        for args in [vec!["replay", "--policy", "torch", &p], vec!["stats", &p]] {
            let o = cudalloc(&args);
            assert_eq!(o.status.code(), Some(2), "{args:?}");
            let err = stderr(&o);
            assert!(
                err.contains(name)
                    && err.contains("not a PyTorch snapshot pickle, our CSV trace")
                    && err.contains("or an RMM log")
                    && !err.contains("expected the header"),
                "{args:?}: {err}"
            );
        }
    }
    // Text with a header that is not ours is still a CSV with a bad header.
    let path = dir.join("other.csv");
    std::fs::write(&path, "time,bytes\n1,2\n").unwrap();
    let o = cudalloc(&["replay", "--policy", "torch", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("expected the header `action,addr,size,stream,time_us`"),
        "{}",
        stderr(&o)
    );
}
