//! Replays through the real driver (`ReplayOptions::cuda`, `cudalloc replay --cuda`); every
//! test needs a CUDA GPU. A trace's stream handles are the recording process's pointers: the
//! replay runs each stream of the trace on a stream it opens, never on those handles.

use cudalloc::{Config, Policy};
use cudalloc_sys::Call;
use cudalloc_trace::replay::{replay, ReplayOptions};
use std::path::PathBuf;

/// A side-stream pipeline (batches copied on a side stream, used on the default one with
/// `record_stream`) replays on GPU 0 under every policy with the simulated device's live bytes,
/// and without waiting for the device under `default`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_trace_of_several_streams_replays_on_the_gpu() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/h200/side_stream_prefetch1.trace.csv.gz");
    let trace = cudalloc_trace::read(&path).expect("bundled trace reads");
    assert!(
        trace.streams.iter().any(|&s| s != 0),
        "streams {:x?}",
        trace.streams
    );
    for policy in Policy::ALL {
        let cfg = Config::for_policy(policy);
        let sim = replay(&trace, &cfg, &ReplayOptions::default());
        let opts = ReplayOptions {
            cuda: true,
            ..ReplayOptions::default()
        };
        let gpu = replay(&trace, &cfg, &opts);
        assert!(gpu.failure.is_none(), "{policy:?}: {:?}", gpu.failure);
        assert_eq!(gpu.peak_live_bytes, sim.peak_live_bytes, "{policy:?}");
        if policy == Policy::Default {
            assert_eq!(gpu.driver_waits, Some(0), "{policy:?}");
        }
        // The driver's time per kind of call, over the span the replay times: as many maps and
        // mallocs as the pool counted, each taking some time, and no more time in the driver
        // than in the whole span.
        let kinds = gpu
            .driver_time
            .as_deref()
            .expect("timed through the driver");
        let calls = |kind| {
            let t = kinds.iter().find(|(c, _)| *c == kind);
            t.map_or(0, |(_, t)| t.calls)
        };
        assert_eq!(calls(Call::Map), gpu.device_maps, "{policy:?}");
        assert_eq!(calls(Call::Malloc), gpu.device_mallocs, "{policy:?}");
        assert!(kinds.iter().all(|(_, t)| t.ns > 0), "{policy:?}");
        let driver_ns: u64 = kinds.iter().map(|(_, t)| t.ns).sum();
        let replay_ns = gpu.ns_per_event * gpu.events as f64;
        assert!((driver_ns as f64) < replay_ns, "{policy:?}: {driver_ns} ns");
    }
}
