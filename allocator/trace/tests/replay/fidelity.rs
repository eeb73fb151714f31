//! Fidelity: replaying the bundled traces (recorded from PyTorch 2.11 on an H200) with the
//! `torch` and `torch-expandable` policies lands on PyTorch's own figures (`traces/anchors.json`,
//! copied from `shared/anchors.json`): peak reserved bytes within 1% (`torch`) and 2%
//! (`torch-expandable`), and `torch` issues as many device mallocs as the trace has
//! `segment_alloc` events, within 2%. On every bundled trace of `traces/` and `traces/h200/`,
//! `torch` makes exactly the recording's `cudaMalloc`s and reserves exactly what they did: the
//! simulated device places its segments in the recording's address order
//! (`replay::simulated_device`), so best fit breaks ties between free blocks of one size as
//! PyTorch's did.

use cudalloc::{Config, Policy};
use cudalloc_trace::replay::{replay, ReplayOptions};
use std::path::PathBuf;

fn traces_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces")
}

fn anchors() -> serde_json::Value {
    let text =
        std::fs::read_to_string(traces_dir().join("anchors.json")).expect("traces/anchors.json");
    serde_json::from_str(&text).expect("anchors.json parses")
}

fn check(name: &str, policy: Policy, key: &str, tolerance: f64) {
    let path = traces_dir().join(format!("{name}.trace.csv.gz"));
    let trace = cudalloc_trace::read(&path).expect("bundled trace reads");
    let r = replay(
        &trace,
        &Config::for_policy(policy),
        &ReplayOptions::default(),
    );
    assert!(r.failure.is_none(), "{name}: {:?}", r.failure);
    let want = anchors()["traces"][name][key]["peak_reserved_bytes"]
        .as_u64()
        .expect("anchor");
    let diff = (r.peak_reserved_bytes as f64 / want as f64 - 1.0).abs();
    assert!(
        diff <= tolerance,
        "{name} {key}: peak reserved {} vs PyTorch {want} ({:.3}%)",
        r.peak_reserved_bytes,
        diff * 100.0
    );
    assert_eq!(r.peak_live_bytes, trace.peak_live, "{name}: peak live");
    if policy == Policy::Torch {
        let segs = trace.segment_allocs as f64;
        let calls = r.device_mallocs as f64;
        assert!(
            (calls / segs - 1.0).abs() <= 0.02,
            "{name}: {calls} mallocs vs {segs} segment_alloc events"
        );
    }
}

macro_rules! fidelity {
    ($($test:ident: $name:literal),* $(,)?) => {$(
        #[test]
        fn $test() {
            check($name, Policy::Torch, "torch_default", 0.01);
            check($name, Policy::TorchExpandable, "torch_expandable", 0.02);
        }
    )*};
}

fidelity! {
    gpt2_train: "gpt2_train",
    bert_dynamic: "bert_dynamic",
    resnet_train: "resnet_train",
    llama_train_varlen: "llama_train_varlen",
}

#[test]
fn torch_makes_the_recordings_mallocs_on_every_bundled_trace() {
    let mut wrong = Vec::new();
    let mut read = 0;
    for dir in [traces_dir(), traces_dir().join("h200")] {
        for e in std::fs::read_dir(&dir).expect("the traces folder reads") {
            let path = e.expect("a folder entry").path();
            if !path.to_string_lossy().ends_with(".trace.csv.gz") {
                continue;
            }
            let trace = cudalloc_trace::read(&path).expect("bundled trace reads");
            read += 1;
            // A recording that ran out of memory freed segments on its way (PyTorch's ladder).
            assert_eq!(
                trace.recorded_ooms, 0,
                "{}: recorded out-of-memory",
                trace.name
            );
            let r = replay(
                &trace,
                &Config::for_policy(Policy::Torch),
                &ReplayOptions::default(),
            );
            // No bundled recording frees a segment (no `empty_cache`, no out-of-memory), so
            // what PyTorch reserved at its peak is every segment it made.
            let recorded: u64 = trace.segment_sizes.iter().sum();
            if r.device_mallocs != trace.segment_allocs || r.peak_reserved_bytes != recorded {
                wrong.push(format!(
                    "{}: {} mallocs, {} bytes reserved at the peak (recorded: {}, {})",
                    trace.name,
                    r.device_mallocs,
                    r.peak_reserved_bytes,
                    trace.segment_allocs,
                    recorded
                ));
            }
        }
    }
    assert!(read >= 58, "{read} bundled traces read");
    assert!(
        wrong.is_empty(),
        "torch off the recording:\n{}",
        wrong.join("\n")
    );
}
