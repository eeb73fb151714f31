//! `replay_policy` replays a policy given as a value (one of another crate) as `replay` replays
//! the built-in ones: `torch`'s rules given as a value land on `replay`'s figures for `torch`,
//! and `default` built with every rule on on those for `default`.

use cudalloc::policy::default::{DefaultConfig, DefaultPolicy, Rules};
use cudalloc::policy::Torch;
use cudalloc::{Config, Policy};
use cudalloc_trace::replay::{replay, replay_policy, ReplayOptions};
use std::path::Path;

#[test]
fn torch_as_a_value_replays_like_the_torch_config() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/resnet_train.trace.csv.gz");
    let trace = cudalloc_trace::read(&path).unwrap();
    let cfg = Config::for_policy(Policy::Torch);
    for capacity in [None, Some(5 << 30)] {
        let opts = ReplayOptions {
            capacity,
            ..Default::default()
        };
        let a = replay(&trace, &cfg, &opts);
        let b = replay_policy(Torch, &trace, &cfg, &opts);
        assert_eq!(a.events, b.events);
        assert_eq!(a.failure.is_some(), b.failure.is_some(), "{capacity:?}");
        assert_eq!(
            (
                a.peak_reserved_bytes,
                a.peak_allocated_bytes,
                a.peak_live_bytes
            ),
            (
                b.peak_reserved_bytes,
                b.peak_allocated_bytes,
                b.peak_live_bytes
            )
        );
        assert_eq!(
            (a.device_mallocs, a.device_frees),
            (b.device_mallocs, b.device_frees)
        );
    }
}

/// `default` built as a value with every rule on (as `rule_table` builds it) is the `default`
/// the config names; a rule switched off changes the figures of a trace it serves.
#[test]
fn default_as_a_value_with_every_rule_on_replays_like_the_default_config() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/bert_dynamic.trace.csv.gz");
    let trace = cudalloc_trace::read(&path).unwrap();
    let cfg = Config::for_policy(Policy::Default);
    let opts = ReplayOptions::default();
    let figures =
        |r: &cudalloc_trace::replay::ReplayResult| (r.peak_reserved_bytes, r.driver_calls());
    let all = DefaultConfig::default();
    assert_eq!(all.rules, Rules::ALL);
    let a = replay(&trace, &cfg, &opts);
    let b = replay_policy(DefaultPolicy::new(all), &trace, &cfg, &opts);
    assert_eq!(figures(&a), figures(&b));
    let no_search = DefaultConfig {
        rules: Rules {
            packing_search: false,
            ..Rules::ALL
        },
        ..all
    };
    let c = replay_policy(DefaultPolicy::new(no_search), &trace, &cfg, &opts);
    assert!(
        c.driver_calls() > a.driver_calls(),
        "{:?} {:?}",
        figures(&a),
        figures(&c)
    );
}
