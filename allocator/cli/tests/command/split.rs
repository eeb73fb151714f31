//! `cudalloc replay --split`: one summary per part of a split trace set, each line of `--json`
//! naming its trace's part, and a bad split file refused before any replay.

use super::run::{bert, bundled, csv_trace, cudalloc, json_lines, scratch, stderr, stdout};

fn split_file() -> String {
    bundled("split.json")
}

/// `cudalloc replay --policy default --split traces/split.json` with `more` (flags, traces).
fn replay_split(more: &[&str]) -> std::process::Output {
    let split = split_file();
    let mut args = vec!["replay", "--policy", "default", "--split", &split];
    args.extend_from_slice(more);
    cudalloc(&args)
}

#[test]
fn each_part_of_the_bundled_split_gets_a_summary_of_its_own() {
    let held = bundled("h200/lstm_train_varlen.trace.csv.gz");
    let own = csv_trace("split-parts", "mine.trace.csv", "alloc,4096,2097152,0,0\n");
    let o = replay_split(&[&bert(), &held, own.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let whole = out
        .find("summary over 3 trace(s) (")
        .expect("the whole summary");
    let held_out = out
        .find("summary over 1 trace(s) of split part `held_out`")
        .expect("the held-out part's summary");
    let tuning = out
        .find("summary over 1 trace(s) of split part `tuning`")
        .expect("the tuning part's summary");
    let rest = out
        .find("summary over 1 trace(s) of the traces no part names")
        .expect("the summary of the trace in no part");
    assert!(
        whole < held_out && held_out < tuning && tuning < rest,
        "{out}"
    );
    // Each part's summary names its own worst trace.
    assert!(
        out[held_out..tuning].contains("(lstm_train_varlen.trace.csv)"),
        "{out}"
    );
    assert!(
        out[tuning..rest].contains("(bert_dynamic.trace.csv)"),
        "{out}"
    );
}

#[test]
fn one_trace_under_one_policy_gets_no_summary_of_a_part() {
    let o = replay_split(&[&bert()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stdout(&o).contains("summary over"), "{}", stdout(&o));
}

#[test]
fn json_lines_name_the_part_of_their_trace() {
    let own = csv_trace("split-json", "mine.trace.csv", "alloc,4096,2097152,0,0\n");
    let o = replay_split(&["--json", &bert(), own.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let parts: Vec<_> = json_lines(&o)
        .iter()
        .map(|v| (v["trace"].clone(), v["split_part"].clone()))
        .collect();
    assert_eq!(parts[0].1, "tuning", "{parts:?}");
    assert!(parts[1].1.is_null(), "{parts:?}");
    // Without --split the key is not there.
    let o = cudalloc(&["replay", "--json", "--policy", "default", &bert()]);
    assert!(json_lines(&o)[0].get("split_part").is_none());
}

#[test]
fn a_bad_split_file_is_refused_naming_the_file_and_the_fault() {
    let dir = scratch("split-bad");
    let cases = [
        ("missing.json", None, "cannot read the split file"),
        ("text.json", Some("tuning: a"), "not JSON"),
        ("empty.json", Some(r#"{"about": "no parts"}"#), "no part"),
        (
            "twice.json",
            Some(r#"{"a": ["x.csv"], "b": ["x.trace.csv.gz"]}"#),
            "`x` is in both",
        ),
        (
            "number.json",
            Some(r#"{"a": ["x.csv", 7]}"#),
            "part `a`, entry 2",
        ),
        // A JSON reader keeps the last of a key given twice: `x` would be in no part.
        (
            "key_twice.json",
            Some(r#"{"a": ["x.csv"], "a": ["y.csv"]}"#),
            "key `a` is given twice",
        ),
        (
            "listed_twice.json",
            Some(r#"{"a": ["x.csv", "y.csv", "x.trace.csv.gz"]}"#),
            "part `a`, entry 3: trace `x` is listed twice",
        ),
    ];
    for (name, text, says) in cases {
        let path = dir.join(name);
        if let Some(text) = text {
            std::fs::write(&path, text).unwrap();
        }
        let o = cudalloc(&["replay", "--split", path.to_str().unwrap(), &bert()]);
        assert_eq!(o.status.code(), Some(2), "{name}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains(says) && err.contains(name), "{name}: {err}");
        assert!(stdout(&o).is_empty(), "{name}: replayed before refusing");
    }
}
