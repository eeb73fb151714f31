//! The replay's memory timeline (what `cudalloc replay --plot` draws): each point holds the most
//! of every figure over its interval, so the timeline's highest points are the replay's peaks
//! however few points there are.

use cudalloc::Config;
use cudalloc_trace::replay::{replay, ReplayOptions, Sample};
use cudalloc_trace::{self as trace, Trace};
use std::path::PathBuf;

fn bundled(name: &str) -> Trace {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../traces/{name}.trace.csv.gz"));
    trace::read(&path).expect("bundled trace")
}

fn highest(points: &[Sample], figure: impl Fn(&Sample) -> u64) -> u64 {
    points.iter().map(figure).max().unwrap_or(0)
}

/// On every bundled trace and policy, with few points (where one sample every N operations
/// missed the live peak by 5-11%), the timeline reaches exactly the replay's peaks.
#[test]
fn the_timeline_reaches_the_peaks() {
    for name in [
        "gpt2_train",
        "llama_train_varlen",
        "bert_dynamic",
        "resnet_train",
    ] {
        let t = bundled(name);
        for cfg in ["policy:default", "policy:torch", "policy:torch-expandable"] {
            let opts = ReplayOptions {
                samples: 40,
                ..ReplayOptions::default()
            };
            let r = replay(&t, &Config::parse(cfg).unwrap(), &opts);
            let p = &r.timeline;
            let what = format!("{name} under {cfg}");
            assert_eq!(highest(p, |s| s.live), r.peak_live_bytes, "{what}: live");
            assert_eq!(
                highest(p, |s| s.allocated),
                r.peak_allocated_bytes,
                "{what}: allocated"
            );
            assert_eq!(
                highest(p, |s| s.reserved),
                r.peak_reserved_bytes,
                "{what}: reserved"
            );
            // The start, the full intervals, a last partial one and the end.
            assert!(p.len() <= opts.samples + 3, "{what}: {} points", p.len());
            assert!(p.windows(2).all(|w| w[0].op <= w[1].op), "{what}: order");
            // The end: the figures after the last operation, what is still live included
            // (not after the replay freed it: every plot ended with a drop to zero).
            let end = p.last().unwrap();
            assert_eq!(end.op as u64, r.events - 1, "{what}: last point");
            assert_eq!(end.live, live_at_end(&t), "{what}: live at the end");
        }
    }
}

/// Requested bytes of the allocations a trace leaves live.
fn live_at_end(t: &cudalloc_trace::Trace) -> u64 {
    use cudalloc_trace::Op;
    let mut sizes = vec![0u64; t.slots as usize];
    for op in &t.ops {
        match *op {
            Op::Alloc { slot, size, .. } => sizes[slot as usize] = size,
            Op::Free { slot } => sizes[slot as usize] = 0,
        }
    }
    sizes.iter().sum()
}

/// Without a timeline asked for, none is kept.
#[test]
fn no_timeline_unless_asked() {
    let t = bundled("resnet_train");
    let r = replay(&t, &Config::default(), &ReplayOptions::default());
    assert!(r.timeline.is_empty());
}
