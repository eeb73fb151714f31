//! What the `cudalloc` command refuses, with exit status 2 and a message saying what was wrong:
//! an unknown policy, a bad config key, a bad capacity, a missing or malformed trace, a plot
//! or a calls file that would overwrite a trace or cannot be written (refused before any
//! replay), conflicting or impossible options, inputs given twice, and keys a replay would
//! ignore.

use super::run::{bert, cudalloc, json_lines, scratch, stderr, stdout};

#[test]
fn unknown_policy_exits_2_naming_it() {
    let o = cudalloc(&["replay", "--policy", "tensorflow", &bert()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("tensorflow"), "{}", stderr(&o));
}

#[test]
fn bad_config_key_exits_2_naming_the_key() {
    let o = cudalloc(&[
        "replay",
        "--config",
        "policy:torch,max_splat_mb:128",
        &bert(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("max_splat_mb"), "{}", stderr(&o));
}

#[test]
fn bad_capacity_exits_2() {
    let o = cudalloc(&["replay", "--capacity", "12 parsecs", &bert()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("parsecs"), "{}", stderr(&o));
}

#[test]
fn missing_file_exits_2() {
    let o = cudalloc(&["replay", "no/such/trace.csv.gz"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("no/such/trace.csv.gz"),
        "{}",
        stderr(&o)
    );
    assert!(!stderr(&o).contains("panicked"));
}

#[test]
fn malformed_trace_names_the_line() {
    let dir = scratch("malformed");
    let path = dir.join("malformed.csv");
    let text = "action,addr,size,stream,time_us\nalloc,4096,512,0,1\nalloc,zzz,512,0,2\n";
    std::fs::write(&path, text).unwrap();
    let o = cudalloc(&["replay", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("malformed.csv:3:"), "{}", stderr(&o));
    assert!(stdout(&o).is_empty());
}

#[test]
fn plot_refuses_to_overwrite_a_trace() {
    let dir = scratch("plot-guard");
    let trace = dir.join("copy.trace.csv.gz");
    std::fs::copy(bert(), &trace).unwrap();
    let before = std::fs::read(&trace).unwrap();
    // `--plot` takes the first trace as its value: the mistake this guards against.
    let o = cudalloc(&["replay", "--plot", trace.to_str().unwrap(), &bert()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains(".html"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(&trace).unwrap(),
        before,
        "the trace was overwritten"
    );
}

/// `--calls` writes a CSV: another name, a trace of the replay (it would be overwritten), an
/// existing file that is not a calls file (a CSV trace taken as the value, the bundled traces
/// replayed instead) and a missing folder are refused before any replay, and the trace stays as
/// it was.
#[test]
fn calls_refuses_other_names_a_trace_and_a_missing_folder() {
    let dir = scratch("calls-guard");
    let trace = dir.join("t.csv");
    std::fs::write(
        &trace,
        "action,addr,size,stream,time_us\nalloc,4096,512,0,1\n",
    )
    .unwrap();
    let before = std::fs::read(&trace).unwrap();
    let t = trace.to_str().unwrap();
    let missing = dir.join("missing").join("c.csv");
    let cases: [(&str, &[&str], &str); 4] = [
        ("calls.txt", &[t], "ending in .csv"),
        (t, &[t], "is a trace this replays"),
        (t, &[], "is not a calls file"),
        (missing.to_str().unwrap(), &[t], "no folder"),
    ];
    for (path, traces, says) in cases {
        let o = cudalloc(&[&["replay", "--calls", path][..], traces].concat());
        assert_eq!(o.status.code(), Some(2), "{path}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{path}: {}", stderr(&o));
        assert!(stderr(&o).contains(path), "{path}: {}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{path}: replayed anyway");
    }
    assert_eq!(
        std::fs::read(&trace).unwrap(),
        before,
        "the trace was overwritten"
    );
    assert!(!missing.exists());
}

/// Mistakes in the options are refused before anything is replayed, naming what is wrong.
#[test]
fn conflicting_or_impossible_options_exit_2_naming_them() {
    let plot = scratch("no-folder").join("missing").join("p.html");
    let cases: [(Vec<&str>, &str); 14] = [
        (
            vec!["replay", "--policy", "torch", "--policy", "torch"],
            "`torch` is asked for twice",
        ),
        (
            vec!["replay", "--capacity", "1.5TB"],
            "more than the simulated H200",
        ),
        (
            vec!["replay", "--plot", plot.to_str().unwrap()],
            "no folder",
        ),
        (
            vec!["replay", "--device-lag", "4", "--cuda"],
            "--device-lag 4 cannot be used with --cuda",
        ),
        (
            vec!["replay", "--device-lag", "4", "--min-capacity"],
            "--device-lag 4 cannot be used with --min-capacity",
        ),
        (
            vec!["replay", "--answers", "--cuda"],
            "--answers cannot be used with --cuda",
        ),
        (
            vec!["replay", "--answers", "--device-lag", "3"],
            "--answers cannot be used with --device-lag 3",
        ),
        (
            vec!["replay", "--answers", "--min-capacity"],
            "--answers cannot be used with --min-capacity",
        ),
        (
            vec!["replay", "--answers"],
            "records no answer to an event query",
        ),
        (
            vec!["replay", "--shards", "--answers", "--device-lag", "2"],
            "--answers cannot be used with --device-lag 2",
        ),
        (
            vec!["replay", "--shards", "--min-capacity"],
            "--shards cannot be used with --min-capacity (its probes replay one pool",
        ),
        (vec!["replay", "--config", ""], "empty config string"),
        (vec!["replay", "--config", "max_chunk_mb:5"], "max_chunk_mb"),
        (
            vec!["stats", "--policy", "torch", "--config", "policy:default"],
            "cannot be used with",
        ),
    ];
    for (args, says) in cases {
        let o = cudalloc(&[&args[..], &[&bert()]].concat());
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{args:?}: replayed anyway");
    }
    assert!(!plot.exists());
}

/// A trace given twice (by any path) is refused; two traces of one file name are told apart
/// by their paths; a configuration given twice under two spellings is replayed with a warning.
#[test]
fn inputs_given_twice_are_refused_and_equal_names_told_apart() {
    let dir = scratch("twice");
    let text = "action,addr,size,stream,time_us\nalloc,4096,512,0,1\nfree_completed,4096,512,0,2\n";
    for sub in ["a", "b"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        std::fs::write(dir.join(sub).join("x.csv"), text).unwrap();
    }
    let a = dir.join("a/x.csv");
    let a_again = dir.join("b/../a/x.csv");
    let b = dir.join("b/x.csv");
    let o = cudalloc(&[
        "replay",
        "--policy",
        "torch",
        a.to_str().unwrap(),
        a_again.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stdout(&o));
    assert!(stderr(&o).contains("given twice"), "{}", stderr(&o));
    let o = cudalloc(&[
        "replay",
        "--json",
        "--policy",
        "torch",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let names: Vec<String> = json_lines(&o)
        .iter()
        .map(|v| v["trace"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names.len(), 2);
    assert_ne!(names[0], names[1]);
    assert!(
        names[0].ends_with("a/x.csv") && names[1].ends_with("b/x.csv"),
        "{names:?}"
    );
    let o = cudalloc(&[
        "replay",
        "--policy",
        "torch",
        "--config",
        "policy:torch",
        a.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("same configuration"), "{}", stderr(&o));
}

/// Keys a replay would ignore are refused, naming the key: the thread caches' (a replay has
/// none) and the `default` policy's under another policy.
#[test]
fn keys_a_replay_would_ignore_are_refused() {
    for (cfg, key) in [
        ("thread_cache:False", "thread_cache"),
        ("thread_cache_mb:8", "thread_cache_mb"),
        ("policy:torch,thread_cache_large:0", "thread_cache_large"),
        ("policy:torch,layout_plans:false", "layout_plans"),
    ] {
        let o = cudalloc(&["replay", "--config", cfg, &bert()]);
        assert_eq!(o.status.code(), Some(2), "{cfg}: {}", stdout(&o));
        assert!(stderr(&o).contains(key), "{cfg}: {}", stderr(&o));
    }
    let o = cudalloc(&["stats", "--config", "thread_cache:False", &bert()]);
    assert_eq!(o.status.code(), Some(2), "{}", stdout(&o));
    assert!(stderr(&o).contains("thread_cache"), "{}", stderr(&o));
    let o = cudalloc(&[
        "replay",
        "--policy",
        "torch",
        "--sweep",
        "max_chunk_mb=16",
        &bert(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stdout(&o));
    assert!(stderr(&o).contains("max_chunk_mb"), "{}", stderr(&o));
    // Beside the `default` policy, such a key is swept after it only.
    let o = cudalloc(&[
        "replay",
        "--json",
        "--policy",
        "torch",
        "--policy",
        "default",
        "--sweep",
        "max_chunk_mb=16",
        &bert(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let labels: Vec<String> = json_lines(&o)
        .iter()
        .map(|v| v["policy"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        labels,
        ["torch", "default", "policy:default,max_chunk_mb:16"]
    );
}

/// A plot that cannot be written is refused before any replay, and leaves nothing behind.
#[test]
fn an_unwritable_plot_is_refused_before_the_replays() {
    let dir = scratch("plot-target");
    let folder = dir.join("isdir.html");
    std::fs::create_dir_all(&folder).unwrap();
    for (target, needle) in [
        (
            folder.to_str().unwrap().to_string(),
            "cannot write the plot",
        ),
        (
            dir.join(".html").to_str().unwrap().to_string(),
            "file name before",
        ),
    ] {
        let o = cudalloc(&["replay", "--policy", "torch", "--plot", &target, &bert()]);
        assert_eq!(o.status.code(), Some(2), "{target}");
        assert!(stdout(&o).is_empty(), "no replay ran: {}", stdout(&o));
        assert!(stderr(&o).contains(needle), "{target}: {}", stderr(&o));
    }
    assert!(!dir.join(".html").exists());
}
