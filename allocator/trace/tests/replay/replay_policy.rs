//! `replay_policy` replays a policy given as a value (one of another crate) as `replay` replays
//! the built-in ones: `torch`'s rules given as a value land on `replay`'s figures for `torch`.

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
