//! `cudalloc replay` and `cudalloc stats`, run as a built binary: JSON output and its figures on
//! a bundled trace, discovery of the bundled traces, the table and summary, the plot, capped
//! replays (a failure reported, not a panic), sweeps, the breakdown of the peak, recorded
//! out-of-memory events, the `stats` subcommand, `--help`, `--device cuda` without a GPU, and
//! the device running behind (`--device-lag`: pages moved, bytes given back and taken back).

use super::run::{
    bert, bundled, csv_trace, cudalloc, cudalloc_in, json_lines, policy_labels, scratch, stderr,
    stdout,
};
use serde_json::json;

const KEYS: [&str; 32] = [
    "trace",
    "policy",
    "completed",
    "failure",
    "anomalies",
    "events",
    "peak_live_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "min_capacity_bytes",
    "device_lag",
    "device_mallocs",
    "device_frees",
    "device_maps",
    "device_unmaps",
    "device_waits",
    "pages_moved",
    "given_back_bytes",
    "taken_back_bytes",
    "driver_waits",
    "driver_time",
    "shards",
    "answers",
    "ooms",
    "ns_per_event",
    "trace_lines",
    "trace_lines_per_s",
    "segment_alloc_events",
    "map_floor_2pct",
    "map_floor_5pct",
    "allocations_before_history",
    "recorded_ooms",
];

#[test]
fn json_has_exactly_the_keys_and_the_torch_figures() {
    let o = cudalloc(&["replay", "--json", &bert()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines = json_lines(&o);
    let policies = policy_labels(&lines);
    assert_eq!(policies, ["torch", "torch-expandable", "default"]);
    for v in &lines {
        let obj = v.as_object().unwrap();
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut expected = KEYS.to_vec();
        expected.sort_unstable();
        assert_eq!(keys, expected);
        assert_eq!(v["trace"], "bert_dynamic.trace.csv");
        assert_eq!(v["completed"], true);
        assert!(v["failure"].is_null());
        assert!(v["driver_waits"].is_null(), "counted only with --cuda");
        assert!(v["driver_time"].is_null(), "timed only with --cuda");
        assert!(v["answers"].is_null(), "given only with --answers");
        assert_eq!(v["anomalies"]["unmatched_frees"], 0);
        assert_eq!(v["anomalies"]["double_allocs"], 0);
        assert_eq!(v["anomalies"]["mismatched_frees"], 0);
        assert!(v["anomalies"]["first_line"].is_null());
        assert_eq!(v["events"], 29722);
        assert_eq!(v["peak_live_bytes"], 615862208);
        assert!(v["min_capacity_bytes"].is_null());
        assert_eq!(v["ooms"], 0);
        let allocated = v["peak_allocated_bytes"].as_u64().unwrap();
        assert!(615862208 <= allocated && allocated <= v["peak_reserved_bytes"].as_u64().unwrap());
        let ns = v["ns_per_event"].as_f64().unwrap();
        assert!(ns > 0.0);
        // Every action of the trace (44,615 lines after the header), over the replay's time.
        assert_eq!(v["trace_lines"], 44615);
        let per_s = v["trace_lines_per_s"].as_f64().unwrap();
        let want = 44615.0 / (ns * 29722.0) * 1e9;
        assert!(
            (per_s - want).abs() <= want * 0.01,
            "{per_s} against {want}"
        );
        assert_eq!(v["segment_alloc_events"], 33);
        // The trace's map floor (bound::map_floor): policy-independent, fewer with more slack.
        assert_eq!(
            (v["map_floor_2pct"].as_u64(), v["map_floor_5pct"].as_u64()),
            (Some(54), Some(31))
        );
    }
    assert_eq!(lines[0]["peak_reserved_bytes"], 1272971264u64);
    assert_eq!(lines[0]["device_mallocs"], 33);
}

#[test]
fn min_capacity_lies_between_live_and_reserved() {
    let o = cudalloc(&[
        "replay",
        "--json",
        "--min-capacity",
        "--policy",
        "torch",
        &bert(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = &json_lines(&o)[0];
    let min = v["min_capacity_bytes"]
        .as_u64()
        .expect("a number when asked");
    assert!((615862208..=1272971264).contains(&min), "{min}");
}

#[test]
fn no_trace_replays_the_bundled_ones_from_anywhere() {
    let dir = scratch("bundled");
    let o = cudalloc_in(&dir, &["replay", "--json", "--policy", "default"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let names: Vec<String> = json_lines(&o)
        .iter()
        .map(|v| v["trace"].as_str().unwrap().to_string())
        .collect();
    assert!(names.len() >= 4, "{names:?}");
    assert!(names.contains(&"gpt2_train.trace.csv".to_string()));
}

#[test]
fn human_output_has_a_table_and_a_summary() {
    let o = cudalloc(&["replay", &bert()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let header = "bert_dynamic.trace.csv: 44,615 trace lines read, 29,722 ops replayed, \
                  33 segment_alloc, peak live 587.33 MiB, map floor 54 (2%) / 31 (5%)\n";
    assert!(out.starts_with(header), "{out}");
    assert!(
        out.contains("reserved/live") && out.contains("ns/op"),
        "{out}"
    );
    assert!(out.contains("2.067"), "{out}");
    assert!(out.contains("summary over 1 trace(s)"), "{out}");
    assert!(out.contains("reserved/live: geo. mean"), "{out}");
    assert!(
        out.contains("within calls") && out.contains("within 1.05"),
        "{out}"
    );
    assert!(out.contains("2.067 (bert_dynamic.trace.csv)"), "{out}");
}

#[test]
fn config_strings_label_their_rows() {
    let cfg = "policy:torch,max_split_size_mb:128";
    let o = cudalloc(&["replay", "--json", "--config", cfg, &bert()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(json_lines(&o)[0]["policy"], cfg);
}

#[test]
fn plot_writes_self_contained_html() {
    let path = scratch("plot").join("memory.html");
    let o = cudalloc(&["replay", "--plot", path.to_str().unwrap(), &bert()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let html = std::fs::read_to_string(&path).expect("the plot was written");
    assert!(html.contains("<svg") || html.contains("<canvas"));
    assert!(html.contains("torch-expandable") && html.contains("GiB"));
    assert!(!html.contains("<script src") && !html.contains("http://cdn"));
}

#[test]
fn capacity_below_peak_live_reports_the_failure() {
    let o = cudalloc(&[
        "replay",
        "--capacity",
        "256MiB",
        "--policy",
        "torch",
        &bert(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("failed at op"), "{out}");
    assert!(out.contains("out of memory"), "{out}");
}

/// A failed replay says so in its JSON line, and its table row shows no reserved/live ratio
/// (its peak is not the trace's).
#[test]
fn a_failed_replay_is_marked_in_json_and_has_no_ratio() {
    let args = ["replay", "--capacity", "256MiB", "--policy", "torch"];
    let o = cudalloc(&[&args[..], &["--json", &bert()]].concat());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = &json_lines(&o)[0];
    assert_eq!(v["completed"], false);
    let op = v["failure"]["op"].as_u64().expect("the failed operation");
    assert_eq!(v["events"].as_u64(), Some(op + 1));
    let error = v["failure"]["error"].as_str().unwrap();
    assert!(error.contains("out of memory"), "{error}");
    let o = cudalloc(&[&args[..], &[&bert()]].concat());
    let row = stdout(&o)
        .lines()
        .find(|l| l.starts_with("torch "))
        .map(str::to_string)
        .expect("a row for torch");
    let cells: Vec<&str> = row.split_whitespace().collect();
    // policy, ops, then three byte figures of two words each, then reserved/live.
    assert_eq!(cells[8], "-", "{row}");
}

#[test]
fn stats_prints_sorted_torch_keys() {
    let o = cudalloc(&["stats", &bert(), "--policy", "torch"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("one JSON document");
    let stats = v["memory_stats"].as_object().unwrap();
    assert_eq!(stats["reserved_bytes.all.peak"], 1272971264u64);
    let keys: Vec<&String> = stats.keys().collect();
    assert!(keys.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn help_exits_0() {
    for args in [
        &["--help"][..],
        &["replay", "--help"][..],
        &["stats", "--help"][..],
    ] {
        let o = cudalloc(args);
        assert_eq!(o.status.code(), Some(0));
        assert!(stdout(&o).contains("Usage"));
    }
}

/// `--cuda` on a machine without a GPU: one clear error before any replay and exit status 2
/// (an input error: nothing was replayed), no panic.
#[test]
fn cuda_replay_without_a_gpu_says_why() {
    if cudalloc_sys::CudaDevice::new(0).is_ok() {
        // On a GPU machine the replay runs for real; the GPU run checks that path.
        let out = cudalloc(&["replay", "--cuda", "--policy", "torch", "--json", &bert()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let gpt2 = bundled("gpt2_train.trace.csv.gz");
    let out = cudalloc(&["replay", "--cuda", "--policy", "torch", &bert(), &gpt2]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stdout(&out).is_empty(), "no table: {}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("--cuda") && err.contains("no CUDA device available"),
        "{err}"
    );
    assert_eq!(err.matches("no CUDA device").count(), 1, "said once: {err}");
}

#[test]
fn breakdown_says_where_the_peak_reserved_bytes_are() {
    let o = cudalloc(&[
        "replay",
        "--json",
        "--breakdown",
        "--policy",
        "default",
        &bert(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = &json_lines(&o)[0];
    let b = &v["peak_breakdown"];
    let part = |k: &str| b[k].as_u64().unwrap_or_else(|| panic!("{k} in {b}"));
    let parts = [
        "live_bytes",
        "rounding_bytes",
        "pending_bytes",
        "releasable_bytes",
        "pinned_bytes",
    ];
    assert_eq!(
        parts.iter().map(|k| part(k)).sum::<u64>(),
        part("reserved_bytes")
    );
    assert_eq!(b["reserved_bytes"], v["peak_reserved_bytes"]);
    // Of the pinned bytes, those in whole pages that no block in use touches.
    let pages = part("pinned_page_bytes");
    assert!(pages > 0 && pages < part("pinned_bytes"), "{b}");
    assert_eq!(pages % (2 << 20), 0, "whole 2 MiB pages: {b}");
    // bert_dynamic under `default`: the peak comes when a small allocation between batches
    // maps a page while the layout plan's footprints keep their cached pages (releasable):
    // 245 MiB live and 346 MiB releasable.
    assert_eq!(
        (part("live_bytes"), part("releasable_bytes")),
        (257302192, 362807296)
    );
    // What holds the pinned bytes: 6 chunks, the most pinned first, each with the operation
    // that allocated its largest block in use.
    assert_eq!(b["pinned_units"], 6);
    let by = b["pinned_by"].as_array().expect("pinned_by");
    assert_eq!(by.len(), 5);
    let pinned: Vec<u64> = by
        .iter()
        .map(|u| u["pinned_bytes"].as_u64().unwrap())
        .collect();
    assert!(pinned.windows(2).all(|w| w[0] >= w[1]), "{pinned:?}");
    assert!(pinned.iter().sum::<u64>() <= part("pinned_bytes"));
    assert_eq!(
        (&by[0]["kind"], &by[0]["unit_bytes"], &by[0]["pinned_bytes"]),
        (&json!("chunk"), &json!(10485760), &json!(9615360))
    );
    assert_eq!(
        (&by[0]["holding_blocks"], &by[0]["largest_holding_block_op"]),
        (&json!(1), &json!(201))
    );
    // ... and the trace line that operation comes from (line 225: `alloc` of 46,881,792
    // bytes, the fp16 word embedding).
    assert_eq!(
        (&by[0]["largest_holding_block_line"], &b["line"]),
        (&json!(225), &json!(12492))
    );
    let o = cudalloc(&["replay", "--breakdown", "--policy", "default", &bert()]);
    let text = stdout(&o);
    assert!(
        text.contains("  pinned in 6 chunks or segments; the most:\n    9.17 MiB pinned in a 10.00 MiB chunk beside 1 block in use (the largest 44.71 MiB, allocated at op 201, line 225)"),
        "{text}"
    );
    assert!(
        text.contains(
            "default: at peak reserved (op 8,375, line 12492): 610.00 MiB = live 245.38 MiB"
        ) && text.contains(" of it in whole pages)\n"),
        "{text}"
    );
}

/// `--cuda` replays through the driver when there is a GPU, reserving what the simulation
/// does (docs/policies.md); without one it stops before replaying (exit status 2).
#[test]
fn cuda_replay_reserves_what_the_simulation_does() {
    let o = cudalloc(&["replay", "--cuda", "--policy", "default", &bert()]);
    let out = stdout(&o);
    match o.status.code() {
        Some(0) => assert!(out.contains("1.035"), "{out}"),
        Some(2) => assert!(stderr(&o).contains("no CUDA device"), "{}", stderr(&o)),
        c => panic!("exit status {c:?}: {}", stderr(&o)),
    }
}

/// The trace's odd events reach `--json`; a trace with no operations shows no speed.
#[test]
fn json_carries_the_anomalies_and_an_empty_trace_has_no_speed() {
    let odd = csv_trace(
        "anomalies",
        "odd.csv",
        "alloc,4096,512,0,1\nfree_completed,8192,512,0,2\n\
         alloc,16384,512,0,3\nfree_completed,16384,1024,0,4\n",
    );
    let o = cudalloc(&[
        "replay",
        "--json",
        "--policy",
        "torch",
        odd.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = &json_lines(&o)[0];
    assert_eq!(v["anomalies"]["unmatched_frees"], 1);
    assert_eq!(v["anomalies"]["double_allocs"], 0);
    assert_eq!(v["anomalies"]["mismatched_frees"], 1);
    assert_eq!(v["anomalies"]["first_line"], 3);
    let o = cudalloc(&["replay", "--policy", "torch", odd.to_str().unwrap()]);
    assert!(
        stdout(&o).contains("1 frees whose size or stream differs"),
        "{}",
        stdout(&o)
    );
    let empty = csv_trace("anomalies-empty", "empty.csv", "");
    let o = cudalloc(&["replay", "--policy", "torch", empty.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let row = out
        .lines()
        .find(|l| l.starts_with("torch "))
        .expect("a row");
    assert!(
        row.trim_end().ends_with('-'),
        "no ns/op without operations: {row}"
    );
    assert!(stderr(&o).contains("holds no allocation"), "{}", stderr(&o));
    // `stats` warns alike: its statistics are all 0.
    let o = cudalloc(&["stats", empty.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("holds no allocation"), "{}", stderr(&o));
    let o = cudalloc(&[
        "replay",
        "--json",
        "--policy",
        "torch",
        empty.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = &json_lines(&o)[0];
    assert!(
        v["ns_per_event"].is_null() && v["trace_lines_per_s"].is_null(),
        "{}",
        stdout(&o)
    );
}

/// `--sweep` adds one configuration per value after the default policy, labelled by a config
/// string that `--config` accepts.
#[test]
fn a_sweep_replays_the_default_and_each_value() {
    let o = cudalloc(&["replay", "--json", "--sweep", "max_chunk_mb=16", &bert()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines = json_lines(&o);
    let labels = policy_labels(&lines);
    assert_eq!(labels, ["default", "policy:default,max_chunk_mb:16"]);
    let maps = |v: &serde_json::Value| v["device_maps"].as_u64().unwrap();
    assert!(
        maps(&lines[1]) > maps(&lines[0]),
        "smaller chunks, more maps"
    );
    let bad = cudalloc(&["replay", "--sweep", "max_chunk_mbs=16", &bert()]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("max_chunk_mbs"), "{}", stderr(&bad));
}

/// `--cross` replays every combination of the swept keys, and each label, given to `--config`,
/// replays to the same figures as its row.
#[test]
fn a_crossed_sweep_replays_each_combination_as_its_label_says() {
    let args = [
        "replay",
        "--json",
        "--sweep",
        "max_chunk_mb=6,16",
        "--sweep",
        "fragmentation_budget=0.01",
        "--cross",
    ];
    let o = cudalloc(&[&args[..], &[bert().as_str()]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let lines = json_lines(&o);
    let labels = policy_labels(&lines);
    assert_eq!(
        labels,
        [
            "default",
            "policy:default,max_chunk_mb:6,fragmentation_budget:0.01",
            "policy:default,max_chunk_mb:16,fragmentation_budget:0.01",
        ]
    );
    let figures = |v: &serde_json::Value| {
        ["peak_reserved_bytes", "device_maps", "device_unmaps"].map(|k| v[k].as_u64().unwrap())
    };
    for row in &lines[1..] {
        let label = row["policy"].as_str().unwrap();
        let again = cudalloc(&["replay", "--json", "--config", label, &bert()]);
        assert_eq!(figures(&json_lines(&again)[0]), figures(row), "{label}");
    }
}

/// A trace's `oom` events (allocations that failed when it was recorded) are counted and named
/// as not replayed, in the header line and as `--json`'s `recorded_ooms` (0 for a trace with
/// none).
#[test]
fn recorded_ooms_are_counted_not_replayed() {
    let path = csv_trace(
        "recorded-ooms",
        "oom.csv",
        "alloc,4096,1000,0,1\noom,0,1125899906842624,0,5\n\
         oom,0,2000000000000,0,6\nfree_completed,4096,1000,0,7\n",
    );
    let p = path.to_str().unwrap();
    let o = cudalloc(&["replay", "--policy", "torch", p]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("2 oom events recorded (failed allocations, not replayed)"),
        "{}",
        stdout(&o)
    );
    let o = cudalloc(&["replay", "--json", "--policy", "torch", p]);
    let v = &json_lines(&o)[0];
    assert_eq!(
        (v["recorded_ooms"].as_u64(), v["ooms"].as_u64()),
        (Some(2), Some(0))
    );
    let o = cudalloc(&["replay", "--json", "--policy", "torch", &bert()]);
    assert_eq!(json_lines(&o)[0]["recorded_ooms"], 0);
}

/// `--calls FILE.csv` lists every operation that made driver calls: per trace and
/// configuration, its rows add up to the replay's own counts, and each row is one operation
/// with the live and reserved bytes after it. Under a cap the replay fails, and no row comes
/// after the failed allocation (its own calls, the out-of-memory ladder's, count in the sums);
/// a second run overwrites the calls file of the first.
#[test]
fn calls_csv_adds_up_to_each_replays_driver_calls() {
    let path = super::run::scratch("calls").join("calls.csv");
    for capped in [false, true] {
        calls_checked(&path, capped);
    }
}

/// Replays `bert_dynamic` under two configurations (under a 300 MiB cap when `capped`) with
/// `--calls path` and checks the file against the JSON.
fn calls_checked(path: &std::path::Path, capped: bool) {
    let cap: &[&str] = if capped {
        &["--capacity", "300MiB"]
    } else {
        &[]
    };
    let o = cudalloc(
        &[
            &[
                "replay",
                "--json",
                "--policy",
                "default",
                "--config",
                "policy:torch,max_split_size_mb:64",
                "--calls",
                path.to_str().unwrap(),
                &bert(),
            ][..],
            cap,
        ]
        .concat(),
    );
    assert_eq!(
        o.status.code(),
        Some(if capped { 1 } else { 0 }),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("written to"), "{}", stderr(&o));
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("trace,config,op,action,bytes,stream,live_bytes,reserved_bytes,mallocs,frees,maps,unmaps,new_high")
    );
    let rows: Vec<Vec<String>> = lines.map(split_csv).collect();
    let failures: Vec<(String, Option<u64>)> = json_lines(&o)
        .iter()
        .map(|run| {
            let label = run["policy"].as_str().unwrap().to_string();
            (label, run["failure"]["op"].as_u64())
        })
        .collect();
    new_highs_checked(&rows, &stderr(&o), &failures);
    for run in json_lines(&o) {
        let label = run["policy"].as_str().unwrap().to_string();
        let failed = run["failure"]["op"].as_u64();
        assert_eq!(failed.is_some(), capped, "{label}: {}", run["failure"]);
        let mine: Vec<&Vec<String>> = rows.iter().filter(|r| r[1] == label).collect();
        assert!(!mine.is_empty(), "no rows for {label}");
        for (col, key) in [
            (8, "device_mallocs"),
            (9, "device_frees"),
            (10, "device_maps"),
            (11, "device_unmaps"),
        ] {
            let sum: u64 = mine.iter().map(|r| r[col].parse::<u64>().unwrap()).sum();
            assert_eq!(sum, run[key].as_u64().unwrap(), "{label}: {key}");
        }
        let mut last = None;
        for r in mine {
            let op: u64 = r[2].parse().unwrap();
            assert!(
                last.is_none_or(|l| op > l),
                "{label}: operations out of order"
            );
            last = Some(op);
            assert!(
                failed.is_none_or(|f| op <= f),
                "{label}: a row after the failure"
            );
            assert!(r[3] == "alloc" || r[3] == "free", "{r:?}");
            let calls = row_calls(r);
            assert!(calls > 0, "a row without calls: {r:?}");
            let (live, reserved): (u64, u64) = (r[6].parse().unwrap(), r[7].parse().unwrap());
            assert!(live <= reserved, "{r:?}");
        }
    }
}

/// The driver calls of one row of a calls file (mallocs, frees, maps and unmaps).
fn row_calls(r: &[String]) -> u64 {
    r[8..12].iter().map(|c| c.parse::<u64>().unwrap()).sum()
}

/// The `new_high` column of a calls file: 1 only for allocations, each of a configuration's
/// at a higher live figure than the one before it, the first allocation that calls the driver
/// one of them (the pool starts empty), and 0 on the allocation a replay failed at (it added no
/// live bytes); the line on stderr adds up their calls and all. `failures`: each
/// configuration's label and the operation its replay failed at. Without a cap some calls come
/// below the live high (on `bert_dynamic`, `default` maps again what it gave back).
fn new_highs_checked(rows: &[Vec<String>], err: &str, failures: &[(String, Option<u64>)]) {
    let (mut high, mut all) = (0, 0);
    for (label, failed) in failures {
        let mine: Vec<&Vec<String>> = rows.iter().filter(|r| &r[1] == label).collect();
        assert_eq!(mine[0][12], "1", "{label}: the first row {:?}", mine[0]);
        let mut last = None;
        for r in &mine {
            assert!(r[12] == "0" || r[12] == "1", "{r:?}");
            all += row_calls(r);
            if failed.is_some_and(|f| r[2] == f.to_string()) {
                assert_eq!(r[12], "0", "{label}: the failed allocation {r:?}");
            }
            if r[12] == "1" {
                assert_eq!(r[3], "alloc", "{r:?}");
                let live: u64 = r[6].parse().unwrap();
                assert!(
                    last.is_none_or(|l| live > l),
                    "{label}: {r:?} after {last:?}"
                );
                last = Some(live);
                high += row_calls(r);
            }
        }
    }
    assert!(0 < high && high <= all, "{high} of {all}");
    if failures.iter().all(|f| f.1.is_none()) {
        assert!(high < all, "{high} of {all}: every call at a new high");
    }
    let said = format!("({high} of the {all} calls made by allocations that took the live bytes");
    assert!(err.contains(&said), "{err}");
}

/// Splits one CSV row, a quoted field (a configuration label with commas) kept whole.
fn split_csv(line: &str) -> Vec<String> {
    let (mut fields, mut field, mut quoted) = (Vec::new(), String::new(), false);
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(std::mem::take(&mut field)),
            c => field.push(c),
        }
    }
    fields.push(field);
    fields
}

/// The JSON row of `trace` replayed under `default` with `--device-lag lag`.
fn lag_row(trace: &str, lag: &str) -> serde_json::Value {
    let args = [
        "replay",
        "--json",
        "--policy",
        "default",
        "--device-lag",
        lag,
        trace,
    ];
    let o = cudalloc(&args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    json_lines(&o).swap_remove(0)
}

/// `--device-lag` is named in the JSON rows, and behind, `default` moves pages (the bundled
/// BERT trace moves 7 at a lag of 10); without a lag the row says 0 and none moves.
#[test]
fn json_rows_name_the_lag_and_count_the_pages_moved() {
    for (lag, moves) in [("0", false), ("10", true)] {
        let v = lag_row(&bert(), lag);
        assert_eq!(v["device_lag"].as_u64(), Some(lag.parse().unwrap()));
        let moved = v["pages_moved"].as_u64().unwrap();
        assert_eq!(moved > 0, moves, "lag {lag}: {moved} pages moved");
    }
}

/// `given_back_bytes` counts every release started, `taken_back_bytes` those taken back into the
/// cache before the device caught up: none while the device keeps up, some on a long-context
/// training when it runs 10 operations behind, never more than was given back.
#[test]
fn json_rows_count_the_bytes_given_back_and_taken_back() {
    let trace = bundled("h200/long_context_train.trace.csv.gz");
    for (lag, takes_back) in [("0", false), ("10", true)] {
        let v = lag_row(&trace, lag);
        let given = v["given_back_bytes"].as_u64().unwrap();
        let taken = v["taken_back_bytes"].as_u64().unwrap();
        assert!(given > 0, "lag {lag}: nothing given back");
        assert_eq!(taken > 0, takes_back, "lag {lag}: {taken} bytes taken back");
        assert!(taken <= given, "lag {lag}: {taken} taken back of {given}");
    }
}
