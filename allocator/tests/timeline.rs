//! The replay's memory timeline (what `cudalloc replay --plot` draws): each point holds the most
//! of every figure over its interval, so the timeline's highest points are the replay's peaks
//! however few points there are.

use cudalloc::replay::{replay, ReplayOptions, Sample};
use cudalloc::trace::{self, Trace};
use cudalloc::Config;
use std::path::PathBuf;

fn bundled(name: &str) -> Trace {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../traces/{name}.trace.csv.gz"));
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
            assert_eq!(p.last().unwrap().op as u64, r.events, "{what}: last point");
        }
    }
}

/// Without a timeline asked for, none is kept.
#[test]
fn no_timeline_unless_asked() {
    let t = bundled("resnet_train");
    let r = replay(&t, &Config::default(), &ReplayOptions::default());
    assert!(r.timeline.is_empty());
}
