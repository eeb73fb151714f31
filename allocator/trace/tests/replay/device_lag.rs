//! A device that runs behind the host (`ReplayOptions::device_lag`, `replay::Lagging`): work
//! queued during an operation completes a given number of operations later, and only the
//! pages a pool gives back while work is queued feel it.

use cudalloc::{Config, Policy};
use cudalloc_sys::{Device, SimConfig, SimDevice, StreamId};
use cudalloc_trace::replay::{replay, Lagging, ReplayOptions};
use std::path::PathBuf;
use std::sync::Arc;

fn bundled(name: &str) -> cudalloc_trace::Trace {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../traces/{name}.trace.csv.gz"));
    cudalloc_trace::read(&path).expect("bundled trace reads")
}

/// An event recorded on a stream during tick `t` completes at tick `t + lag`, on every stream
/// alike, and never earlier.
#[test]
fn work_completes_exactly_lag_operations_later() {
    for lag in [1u64, 3] {
        let dev = Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
        dev.set_auto_complete(false);
        let mut lagging = Lagging::new(dev.clone(), lag);
        let streams = [StreamId(0), StreamId(7)];
        let mut recorded = Vec::new();
        for t in 0..10u64 {
            lagging.tick();
            for (&(ev, at), s) in recorded.iter().zip(streams.iter().cycle()) {
                let done = dev.query_event(ev).expect("query");
                assert_eq!(
                    done,
                    t >= at + lag,
                    "lag {lag}: event of tick {at} on {s:?} at {t}"
                );
            }
            let ev = dev.create_event().expect("event");
            let s = streams[recorded.len() % 2];
            dev.record_event(ev, s).expect("record");
            recorded.push((ev, t));
        }
    }
}

/// Policies that give nothing back while a trace runs (PyTorch's rules, on one stream) replay
/// the same with a device that runs behind: only an asynchronous release waits for the device.
#[test]
fn a_lagging_device_changes_nothing_for_policies_that_never_give_back() {
    let trace = bundled("bert_dynamic");
    for policy in [Policy::Torch, Policy::TorchExpandable] {
        let cfg = Config::for_policy(policy);
        let keeping_up = replay(&trace, &cfg, &ReplayOptions::default());
        for lag in [1, 50] {
            let opts = ReplayOptions {
                device_lag: Some(lag),
                ..ReplayOptions::default()
            };
            let r = replay(&trace, &cfg, &opts);
            assert!(r.failure.is_none(), "{policy:?} lag {lag}: {:?}", r.failure);
            let figures = |r: &cudalloc_trace::replay::ReplayResult| {
                (r.peak_reserved_bytes, r.driver_calls(), r.device_waits)
            };
            assert_eq!(figures(&r), figures(&keeping_up), "{policy:?} lag {lag}");
        }
    }
}

/// `default` completes every bundled trace with a lagging device, never reserving less than
/// the live bytes, and without waiting for the device (no memory cap).
#[test]
fn default_completes_with_a_lagging_device_without_waiting() {
    for name in ["bert_dynamic", "gpt2_train", "h200/gnn_train_dynamic"] {
        let trace = bundled(name);
        let opts = ReplayOptions {
            device_lag: Some(100),
            ..ReplayOptions::default()
        };
        let r = replay(&trace, &Config::for_policy(Policy::Default), &opts);
        assert!(r.failure.is_none(), "{name}: {:?}", r.failure);
        assert!(r.peak_reserved_bytes >= r.peak_live_bytes, "{name}");
        assert_eq!(r.device_waits, 0, "{name}");
    }
}

/// Through the stream shards (`shards`) the device runs behind too: on a side-stream pipeline
/// pages given back while the device is behind move to growths of their stream
/// (`pages_moved`, none while it keeps up), nothing waits, and a shard may lend no block
/// (`lend_blocks:True`): a freshly recorded event never completes at once on this device.
#[test]
fn the_stream_shards_replay_with_a_lagging_device() {
    let trace = bundled("h200/side_stream_prefetch1");
    let run = |lag, config: &str| {
        let opts = ReplayOptions {
            shards: true,
            device_lag: Some(lag),
            ..ReplayOptions::default()
        };
        replay(&trace, &Config::parse(config).unwrap(), &opts)
    };
    let keeping_up = run(0, "policy:default");
    let behind = run(20, "policy:default");
    for r in [&keeping_up, &behind] {
        assert!(r.failure.is_none(), "{:?}", r.failure);
        assert!(r.shards);
        assert_eq!(r.device_waits, 0);
    }
    assert_eq!(keeping_up.pages_moved, 0);
    assert!(behind.pages_moved > 0, "the lag reached the shards");
    let lending = run(20, "policy:default,lend_blocks:True");
    assert_eq!(
        (lending.peak_reserved_bytes, lending.driver_calls()),
        (behind.peak_reserved_bytes, behind.driver_calls()),
        "no stream is ever idle at once on a lagging device"
    );
}
