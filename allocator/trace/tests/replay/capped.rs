//! The `default` policy under a memory cap on every bundled trace: capped at 0.98x, 1.00x,
//! 1.01x, 1.03x and 1.10x of its peak live bytes (the last two as `tools/capped_table.py`), a
//! replay never reserves more than the cap, below the peak live bytes it fails, and at 1.10x
//! every trace completes (`docs/policies.md`, "Under a memory cap"). A bare `Pool`'s mapping
//! does not refuse a limit by itself (`Core::claim`): every path of the policy that maps pages
//! (growth, a plan's placement, the last resort) must check it.

use cudalloc::{Config, Policy};
use cudalloc_trace::replay::{replay, ReplayOptions};
use std::path::PathBuf;

fn bundled_traces() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    let mut out = Vec::new();
    for dir in [root.clone(), root.join("h200")] {
        for e in std::fs::read_dir(&dir).expect("the traces folder reads") {
            let p = e.expect("a folder entry").path();
            if p.to_string_lossy().ends_with(".trace.csv.gz") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn capped_replays_never_pass_the_cap_and_complete_at_1_10x() {
    let cfg = Config::for_policy(Policy::Default);
    let traces = bundled_traces();
    assert!(traces.len() >= 33, "{} bundled traces", traces.len());
    let mut wrong = Vec::new();
    for path in traces {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let trace = cudalloc_trace::read(&path).expect("bundled trace reads");
        let live = replay(&trace, &cfg, &ReplayOptions::default()).peak_live_bytes;
        for factor in [0.98, 1.0, 1.01, 1.03, 1.10] {
            let cap = (live as f64 * factor).ceil() as u64;
            let opts = ReplayOptions {
                capacity: Some(cap),
                ..ReplayOptions::default()
            };
            let r = replay(&trace, &cfg, &opts);
            if r.peak_reserved_bytes > cap {
                wrong.push(format!(
                    "{name} at {factor}x: {} reserved > {cap}",
                    r.peak_reserved_bytes
                ));
            }
            if factor < 1.0 && r.failure.is_none() {
                wrong.push(format!(
                    "{name} at {factor}x: completed below its peak live bytes"
                ));
            }
            if factor > 1.05 && r.failure.is_some() {
                wrong.push(format!("{name} at {factor}x: {:?}", r.failure));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
