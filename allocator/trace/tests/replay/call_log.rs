//! The steps a replay keeps with `ReplayOptions::calls`: those marked `new_high` are exactly the
//! allocations that took the live bytes, counted from the trace itself, above every figure they
//! had reached after an earlier operation (with or without driver calls), and each step's live
//! bytes are the trace's.

use cudalloc::{Config, Policy};
use cudalloc_trace::replay::{replay, ReplayOptions};
use cudalloc_trace::{Op, Trace};
use std::path::PathBuf;

/// The live (requested) bytes after each operation of `trace`.
fn live_after_each(trace: &Trace) -> Vec<u64> {
    let mut sizes = vec![0u64; trace.slots as usize];
    let mut live = 0u64;
    let mut out = Vec::with_capacity(trace.ops.len());
    for op in &trace.ops {
        match *op {
            Op::Alloc { slot, size, .. } => {
                sizes[slot as usize] = size;
                live += size;
            }
            Op::Free { slot } => live -= std::mem::take(&mut sizes[slot as usize]),
        }
        out.push(live);
    }
    out
}

#[test]
fn new_high_marks_exactly_the_allocations_above_every_earlier_live_figure() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    for name in ["bert_dynamic", "h200/t5_generate", "h200/vit_infer_dynamic"] {
        let path = root.join(format!("{name}.trace.csv.gz"));
        let trace = cudalloc_trace::read(&path).expect("bundled trace reads");
        let live = live_after_each(&trace);
        for policy in [Policy::Default, Policy::TorchExpandable] {
            let opts = ReplayOptions {
                calls: true,
                ..ReplayOptions::default()
            };
            let r = replay(&trace, &Config::for_policy(policy), &opts);
            assert!(r.failure.is_none(), "{name} {policy:?}: {:?}", r.failure);
            let mut steps = r.calls.iter().peekable();
            let (mut high, mut marked) = (0, 0);
            for (i, op) in trace.ops.iter().enumerate() {
                let expect = matches!(op, Op::Alloc { .. }) && live[i] > high;
                high = high.max(live[i]);
                if let Some(s) = steps.next_if(|s| s.op == i) {
                    assert_eq!(s.live, live[i], "{name} {policy:?} op {i}");
                    assert_eq!(s.new_high, expect, "{name} {policy:?} op {i}");
                    marked += u64::from(s.new_high);
                }
            }
            assert!(
                steps.next().is_none(),
                "{name} {policy:?}: a step past the trace"
            );
            assert!(marked > 0, "{name} {policy:?}: no step at a new high");
        }
    }
}
