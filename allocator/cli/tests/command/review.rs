//! The `cudalloc` command line, run as a built binary, on its finer points: `key=value` in
//! a config string named as such (it says to write `key:value`); plot legend names distinct and
//! readable however long the labels; a swept `policy` labelled by the policy replayed;
//! `garbage_collection_threshold` refused wherever the replay would ignore it (any policy but
//! `torch`, or no cap) and acting where it is accepted; `--help` saying that a cap, any cap, puts
//! `default` in its capped mode; the table's trace lines told apart from replayed operations;
//! `stats` reporting a trace's anomalies as `replay` does; `--device` picking a snapshot's device
//! (refused for a CSV trace).

use cudalloc::Config;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What one run of the binary did.
struct Ran {
    code: Option<i32>,
    out: String,
    err: String,
}

impl Ran {
    /// The JSON values of stdout, one a line (`replay --json`) or one document (`stats`).
    fn json(&self) -> Vec<Value> {
        serde_json::Deserializer::from_str(&self.out)
            .into_iter()
            .map(|v| v.expect("stdout is JSON"))
            .collect()
    }

    /// The `policy` of each JSON line.
    fn labels(&self) -> Vec<String> {
        let label = |v: Value| v["policy"].as_str().map(str::to_string);
        self.json().into_iter().filter_map(label).collect()
    }
}

fn run(args: &[&str]) -> Ran {
    let o = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("the cudalloc binary runs");
    Ran {
        code: o.status.code(),
        out: String::from_utf8_lossy(&o.stdout).into_owned(),
        err: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

fn bert() -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    dir.join("bert_dynamic.trace.csv.gz")
        .to_string_lossy()
        .into_owned()
}

/// A trace written for one test, in a fresh folder of its own.
fn trace_file(test: &str, text: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-review-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the scratch folder");
    let path = dir.join("small.csv");
    std::fs::write(&path, text).expect("write the trace");
    path
}

/// A few allocations and frees: enough to replay and plot, quick under any configuration.
const SMALL: &str = "action,addr,size,stream,time_us\nalloc,4096,3000000,0,1\n\
                     alloc,8192,40000000,0,2\nfree_completed,4096,3000000,0,3\n\
                     alloc,16384,512,0,4\nfree_completed,8192,40000000,0,5\n";

/// The visible text of each legend row of a plot (what follows a row's tooltip).
fn legend_names(html: &str) -> Vec<String> {
    html.split("</title>")
        .skip(1)
        .filter_map(|rest| {
            let end = rest.find('<')?;
            rest[end..]
                .starts_with("</text>")
                .then(|| rest[..end].to_string())
        })
        .collect()
}

/// `--config key=value` (the `--sweep` spelling) is an error naming the key and the
/// `key:value` to write, in the library's parser and on the command line.
#[test]
fn a_config_entry_written_with_equals_says_to_use_a_colon() {
    for (s, key, write) in [
        ("max_chunk_mb=16", "max_chunk_mb", "`max_chunk_mb:16`"),
        (
            "policy:torch,max_split_size_mb=128",
            "max_split_size_mb",
            "`max_split_size_mb:128`",
        ),
        ("max_chunk_mb = 16", "max_chunk_mb", "`max_chunk_mb:value`"),
    ] {
        let e = Config::parse(s).unwrap_err();
        assert_eq!(e.key, key, "{s}");
        assert!(e.message.contains(write), "{s}: {e}");
    }
    let r = run(&["replay", "--config", "max_chunk_mb=16", &bert()]);
    assert_eq!(r.code, Some(2), "{}", r.out);
    assert!(
        r.err.contains("max_chunk_mb:16") && r.err.contains("colon"),
        "{}",
        r.err
    );
}

/// Labels that share a long beginning (a sweep's base) and differ at their end get legend names
/// that differ and show the end; none is cut to the same 30 characters.
#[test]
fn plot_legend_names_are_distinct_and_keep_the_swept_value() {
    let trace = trace_file("plot", SMALL);
    let plot = trace.with_file_name("p.html");
    let r = run(&[
        "replay",
        "--plot",
        plot.to_str().unwrap(),
        "--sweep",
        "fragmentation_budget=0.01,0.03,0.05",
        "--sweep",
        "max_chunk_mb=16,256",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.err);
    let names = legend_names(&std::fs::read_to_string(&plot).expect("the plot"));
    let mut distinct = names.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), names.len(), "{names:?}");
    for end in [
        "fragmentation_budget:0.01",
        "fragmentation_budget:0.03",
        "fragmentation_budget:0.05",
        "max_chunk_mb:16",
        "max_chunk_mb:256",
    ] {
        let shown = names.iter().filter(|n| n.ends_with(end)).count();
        assert_eq!(shown, 1, "{end} in {names:?}");
    }
    assert!(names.iter().any(|n| n == "default"), "{names:?}");
}

/// A swept `policy` is labelled by the configuration replayed: `policy:torch`, not
/// `policy:default,policy:torch`; the base's other keys are kept.
#[test]
fn a_swept_policy_labels_the_policy_replayed() {
    let trace = trace_file("sweep-policy", SMALL);
    let trace = trace.to_str().unwrap();
    let r = run(&[
        "replay",
        "--json",
        "--sweep",
        "policy=torch,torch-expandable",
        trace,
    ]);
    assert_eq!(r.code, Some(0), "{}", r.err);
    assert_eq!(
        r.labels(),
        ["default", "policy:torch", "policy:torch-expandable"]
    );
    let r = run(&[
        "replay",
        "--json",
        "--config",
        "policy:torch,max_split_size_mb:128",
        "--sweep",
        "policy=torch-expandable",
        trace,
    ]);
    assert_eq!(r.code, Some(0), "{}", r.err);
    let labels = r.labels();
    assert_eq!(labels[1], "policy:torch-expandable,max_split_size_mb:128");
    let cfg = Config::parse(&labels[1]).unwrap();
    assert_eq!(cfg.policy(), cudalloc::Policy::TorchExpandable);
    assert_eq!(cfg.pool().max_split_size, 128 << 20);
}

/// `garbage_collection_threshold` acts only under `torch` and a cap (pool/release.rs frees
/// only whole cached segments, pool/mod.rs collects only under a limit): anywhere else a replay
/// refuses it, naming the key and when it applies.
#[test]
fn garbage_collection_is_refused_where_a_replay_ignores_it() {
    let gc = "garbage_collection_threshold";
    let cases: [(&[&str], &str); 5] = [
        (
            &["--config", "policy:torch,garbage_collection_threshold:0.5"],
            "--capacity",
        ),
        (
            &[
                "--config",
                "policy:torch-expandable,garbage_collection_threshold:0.5",
            ],
            "`torch`",
        ),
        (
            &[
                "--capacity",
                "2GiB",
                "--config",
                "garbage_collection_threshold:0.5",
            ],
            "`default`",
        ),
        (
            &[
                "--capacity",
                "2GiB",
                "--sweep",
                "garbage_collection_threshold=0.5",
            ],
            "`torch` policy only",
        ),
        (
            &[
                "--min-capacity",
                "--config",
                "policy:default,garbage_collection_threshold:0.5",
            ],
            "`default`",
        ),
    ];
    for (args, says) in cases {
        let bert = bert();
        let r = run(&[&["replay"], args, &[&bert]].concat());
        assert_eq!(r.code, Some(2), "{args:?}: {}", r.out);
        assert!(
            r.err.contains(gc) && r.err.contains(says),
            "{args:?}: {}",
            r.err
        );
        assert!(r.out.is_empty(), "{args:?}: replayed anyway");
    }
    let r = run(&[
        "stats",
        "--config",
        "policy:torch,garbage_collection_threshold:0.5",
        &bert(),
    ]);
    assert_eq!(r.code, Some(2), "{}", r.out);
    assert!(r.err.contains(gc) && r.err.contains("without"), "{}", r.err);
}

/// Where it is accepted, it changes the replay: under `torch` with a cap (fewer reserved bytes
/// than without the key), and with `--min-capacity` alone, which warns that only the min
/// capacity changes; a sweep of it goes after `torch` configurations only.
#[test]
fn garbage_collection_under_torch_and_a_cap_changes_the_replay() {
    let peak = |args: &[&str]| {
        let r = run(&[
            &["replay", "--json", "--capacity", "2GiB"],
            args,
            &[&bert()],
        ]
        .concat());
        assert_eq!(r.code, Some(0), "{args:?}: {}", r.err);
        r.json()[0]["peak_reserved_bytes"].as_u64().unwrap()
    };
    let plain = peak(&["--policy", "torch"]);
    let collected = peak(&["--config", "policy:torch,garbage_collection_threshold:0.5"]);
    assert!(collected < plain, "{collected} < {plain}");
    let r = run(&[
        "replay",
        "--json",
        "--min-capacity",
        "--config",
        "policy:torch,garbage_collection_threshold:0.5",
        &bert(),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.err);
    assert!(r.err.contains("changes only the min capacity"), "{}", r.err);
    let r = run(&[
        "replay",
        "--json",
        "--capacity",
        "2GiB",
        "--policy",
        "torch",
        "--policy",
        "default",
        "--sweep",
        "garbage_collection_threshold=0.5",
        &bert(),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.err);
    assert_eq!(
        r.labels(),
        [
            "torch",
            "policy:torch,garbage_collection_threshold:0.5",
            "default"
        ]
    );
}

/// `--help` says that a cap, any cap, puts `default` in its capped mode (more driver calls);
/// the table's header line counts trace lines, not "events" (`--json`'s `events` are the
/// operations replayed).
#[test]
fn help_says_what_a_cap_does_and_the_table_counts_trace_lines() {
    let r = run(&["replay", "--help"]);
    assert_eq!(r.code, Some(0));
    let help = r.out.split_whitespace().collect::<Vec<_>>().join(" ");
    for says in [
        "Under a cap the `default` policy runs in its capped mode (under any cap, even the whole device,",
        "The probes are capped, so the `default` policy runs them in its capped mode",
    ] {
        assert!(help.contains(says), "{says}: {help}");
    }
    let r = run(&["replay", "--policy", "torch", &bert()]);
    assert_eq!(r.code, Some(0), "{}", r.err);
    let header = r.out.lines().next().unwrap_or_default();
    assert!(
        header.contains("44,615 trace lines read, 29,722 ops replayed"),
        "{header}"
    );
    assert!(!r.out.contains("events"), "{}", r.out);
}

/// `stats` on a trace with anomalies gives `replay --json`'s `anomalies` object and says so on
/// stderr in the words of `replay`'s header line.
#[test]
fn stats_reports_anomalies_as_replay_does() {
    let odd = "action,addr,size,stream,time_us\nalloc,4096,512,0,1\nfree_completed,8192,512,0,2\n\
               alloc,16384,512,0,3\nfree_completed,16384,1024,0,4\n";
    let trace = trace_file("stats-anomalies", odd);
    let trace = trace.to_str().unwrap();
    let stats = run(&["stats", "--policy", "torch", trace]);
    assert_eq!(stats.code, Some(0), "{}", stats.err);
    let replay = run(&["replay", "--json", "--policy", "torch", trace]);
    assert_eq!(replay.code, Some(0), "{}", replay.err);
    let anomalies = &stats.json()[0]["anomalies"];
    assert_eq!(anomalies["unmatched_frees"], 1, "{}", stats.out);
    assert_eq!(anomalies, &replay.json()[0]["anomalies"]);
    let table = run(&["replay", "--policy", "torch", trace]);
    let said = table
        .out
        .lines()
        .next()
        .unwrap()
        .split("; anomalies: ")
        .nth(1);
    let said = said.expect("the header line gives the anomalies");
    assert!(
        stats.err.contains(&format!("anomalies: {said}")),
        "{}",
        stats.err
    );
    let clean = run(&["stats", "--policy", "torch", &bert()]);
    assert!(clean.json()[0]["anomalies"]["first_line"].is_null());
    assert!(!clean.err.contains("anomalies"), "{}", clean.err);
}

/// `--device N` picks a snapshot's device in `replay` and `stats` (the fixture's device 1 holds
/// 4,096 + 8,192 bytes); a device the snapshot lacks, or one given for a CSV trace, is an error
/// naming the file (exit 2), not silently ignored.
#[test]
fn device_picks_a_snapshots_device_and_is_refused_for_a_csv() {
    let snap = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/snapshot.pickle");
    let snap = snap.to_str().unwrap();
    let one = run(&[
        "replay", "--json", "--policy", "torch", "--device", "1", snap,
    ]);
    assert_eq!(one.code, Some(0), "{}", one.err);
    assert_eq!(one.json()[0]["peak_live_bytes"], 4096 + 8192);
    let zero = run(&["replay", "--json", "--policy", "torch", snap]);
    assert_ne!(
        zero.json()[0]["peak_live_bytes"],
        4096 + 8192,
        "device 0 by default"
    );
    let stats = run(&["stats", "--device", "1", snap]);
    assert_eq!(stats.code, Some(0), "{}", stats.err);
    assert_eq!(
        stats.json()[0]["memory_stats"]["requested_bytes.all.peak"],
        4096 + 8192
    );

    let absent = run(&["replay", "--policy", "torch", "--device", "5", snap]);
    assert_eq!(absent.code, Some(2), "{}", absent.err);
    assert!(
        absent.err.contains("snapshot.pickle")
            && absent
                .err
                .contains("device 5 asked for; the snapshot has traces of 2 device(s)"),
        "{}",
        absent.err
    );
    let csv = trace_file("device-csv", SMALL);
    let csv = run(&["stats", "--device", "0", csv.to_str().unwrap()]);
    assert_eq!(csv.code, Some(2), "{}", csv.err);
    assert!(
        csv.err.contains("small.csv") && csv.err.contains("not a PyTorch snapshot"),
        "{}",
        csv.err
    );
}

/// A replay that fails names the trace line of the failing allocation (its op counts only
/// allocs and frees), in the text and in `--json`'s `failure.line`; a snapshot whose history
/// began late says how many allocations were put before it, apart from the lines read, and an
/// anomaly in a snapshot is placed by trace entry, not by line.
#[test]
fn failures_name_their_line_and_snapshots_count_what_was_put_first() {
    // Line 5 (a `segment_alloc` and a `free_requested` are lines, not ops): the 40 MB alloc.
    let text = "action,addr,size,stream,time_us\nsegment_alloc,4096,4194304,0,0\n\
                alloc,4096,3000000,0,1\nfree_requested,4096,3000000,0,2\n\
                alloc,8192,40000000,0,3\n";
    let trace = trace_file("failure-line", text);
    let trace = trace.to_str().unwrap();
    let args = ["replay", "--policy", "torch", "--capacity", "32MiB"];
    let json = run(&[&args[..], &["--json", trace]].concat());
    assert_eq!(json.code, Some(1), "{}", json.err);
    let failure = &json.json()[0]["failure"];
    assert_eq!((&failure["op"], &failure["line"]), (&1.into(), &5.into()));
    let text = run(&[&args[..], &[trace]].concat());
    assert!(
        text.out.contains("failed at op 1 of 2 (line 5): "),
        "{}",
        text.out
    );

    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data");
    let late = data.join("snapshot_late.pickle");
    let late = late.to_str().unwrap();
    let table = run(&["replay", "--policy", "torch", late]);
    let header = table.out.lines().next().unwrap_or_default();
    assert!(
        header.contains("7 trace lines read, 10 ops replayed"),
        "{header}"
    );
    assert!(
        header.contains(", 5 allocations live before the history began put first"),
        "{header}"
    );
    let json = run(&["replay", "--json", "--policy", "torch", late]);
    assert_eq!(json.json()[0]["allocations_before_history"], 5);
    let csv = run(&["replay", "--json", "--policy", "torch", &bert()]);
    assert_eq!(csv.json()[0]["allocations_before_history"], 0);
    let t = cudalloc_trace::read(Path::new(late)).expect("the fixture reads");
    assert_eq!(t.position.noun(), "trace entry");
    assert_eq!(
        (t.before_history, t.line_of(0), t.op_lines.len()),
        (5, None, t.ops.len())
    );
}

/// `cudalloc stats` prints the keys docs/cli.md lists, its fragmentation with the free-block
/// histogram the C library's has, and a failure with its trace line.
#[test]
fn stats_prints_the_documented_keys() {
    let ok = run(&["stats", "--policy", "torch", &bert()]);
    assert_eq!(ok.code, Some(0), "{}", ok.err);
    let doc = &ok.json()[0];
    let keys: Vec<&str> = doc
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let documented = [
        "anomalies",
        "events",
        "failure",
        "fragmentation_at_end",
        "memory_stats",
        "policy",
        "trace",
    ];
    assert_eq!(keys, documented);
    let frag = doc["fragmentation_at_end"].as_object().unwrap();
    assert!(frag["free_histogram"].is_array(), "{frag:?}");
    assert_eq!(frag.len(), 7, "{frag:?}");
    let text = "action,addr,size,stream,time_us\nsegment_alloc,4096,4194304,0,0\n\
                alloc,4096,3000000,0,1\nalloc,8192,400000000000000,0,3\n";
    let trace = trace_file("stats-failure", text);
    let failed = run(&["stats", "--policy", "torch", trace.to_str().unwrap()]);
    assert_eq!(failed.code, Some(1), "{}", failed.err);
    assert_eq!(failed.json()[0]["failure"]["line"], 4, "{}", failed.out);
}

/// A reader that closes the pipe before reading (`| head -0`) does not turn a failed replay's
/// status into success: `replay` and `stats` still exit 1 when a replay ran out of memory
/// (before, the broken pipe made the status 0 whenever the write came after the close), and 0
/// when none did.
#[test]
fn a_closed_output_keeps_a_failed_replays_status() {
    let trace =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/resnet_train.trace.csv.gz");
    let trace = trace.to_str().unwrap();
    let capped = ["replay", "--policy", "torch", "--capacity", "1.5GB", trace];
    let stats = ["stats", "--config", "policy:torch", trace];
    let plain = ["replay", "--policy", "torch", trace];
    for (args, want) in [(&capped[..], 1), (&stats[..], 0), (&plain[..], 0)] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cudalloc"))
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let code = child.wait().unwrap().code();
        assert_eq!(code, Some(want), "{args:?}");
    }
}
