//! The `per_process_memory_fraction` config key caps a replay, as a replay's own capacity
//! does; the lower of the two wins.

use cudalloc::{Config, Policy};
use cudalloc_trace::replay::{replay, ReplayOptions};

const MIB: u64 = 1 << 20;

fn with_fraction(policy: Policy, f: &str) -> Config {
    Config::parse(&format!(
        "policy:{},per_process_memory_fraction:{f}",
        policy.name()
    ))
    .unwrap()
}

/// A replay honours the key: bert_dynamic (587 MiB live at its peak) fails under 0.4% of the
/// simulated H200 (575 MiB) and completes under 0.45% (647 MiB); a replay's own cap, when
/// lower, wins.
#[test]
fn a_replay_is_capped_by_the_key_and_by_its_own_cap() {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/bert_dynamic.trace.csv.gz");
    let trace = cudalloc_trace::read(&path).expect("bundled trace reads");
    let run = |f: &str, capacity: Option<u64>| {
        let opts = ReplayOptions {
            capacity,
            ..ReplayOptions::default()
        };
        replay(&trace, &with_fraction(Policy::Default, f), &opts)
    };
    let r = run("0.004", None);
    assert!(r.failure.is_some(), "completed under 575 MiB");
    let r = run("0.0045", None);
    assert!(r.failure.is_none(), "{:?}", r.failure);
    assert!(r.peak_reserved_bytes <= (0.0045 * 143_771.0 * MIB as f64) as u64);
    let r = run("0.0045", Some(500 * MIB));
    assert!(r.failure.is_some(), "the replay's 500 MiB cap is the lower");
}
