//! Fidelity: replaying the bundled traces (recorded from PyTorch 2.11 on an H200) with the
//! `torch` and `torch-expandable` policies lands on PyTorch's own figures (`traces/anchors.json`,
//! copied from `shared/anchors.json`): peak reserved bytes within 1% (`torch`) and 2%
//! (`torch-expandable`), and `torch` issues as many device mallocs as the trace has
//! `segment_alloc` events, within 2%.

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
