//! Replay speed (operations per second) of each policy on the bundled traces, of `default` without
//! layout plans beside it, the same for `default` in trace lines per second (every action of the
//! trace over the replay's time: the measure the replay-speed target, "events per second", is
//! stated in; group `replay-lines`), and reading speed (lines per second, opening the file
//! included) of the bundled gzip CSV traces and of one given in `CUDALLOC_BENCH_TRACE`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use cudalloc::{Config, Policy};
use cudalloc_trace::replay::{replay, ReplayOptions};
use std::path::PathBuf;
use std::time::Duration;

fn traces() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../traces");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("bundled traces")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".csv.gz"))
        .collect();
    if let Ok(extra) = std::env::var("CUDALLOC_BENCH_TRACE") {
        v.push(PathBuf::from(extra));
    }
    v.sort();
    v
}

fn bench(c: &mut Criterion) {
    for path in traces() {
        let trace = cudalloc_trace::read(&path).expect("trace");
        let mut g = c.benchmark_group(format!("replay/{}", trace.name));
        g.measurement_time(Duration::from_secs(3)).sample_size(10);
        g.throughput(Throughput::Elements(trace.ops.len() as u64));
        for policy in Policy::ALL {
            let cfg = Config::for_policy(policy);
            // A replay that stops early would be credited with every operation of the trace.
            let once = replay(&trace, &cfg, &ReplayOptions::default());
            assert!(once.failure.is_none(), "{}: {:?}", trace.name, once.failure);
            g.bench_function(policy.name(), |b| {
                b.iter(|| replay(&trace, &cfg, &ReplayOptions::default()))
            });
        }
        // What layout plans cost (and save) in the replayer's own time.
        let cfg = Config::parse("layout_plans:false").expect("config");
        g.bench_function("default-without-plans", |b| {
            b.iter(|| replay(&trace, &cfg, &ReplayOptions::default()))
        });
        g.finish();
        let mut g = c.benchmark_group(format!("replay-lines/{}", trace.name));
        g.measurement_time(Duration::from_secs(3)).sample_size(10);
        g.throughput(Throughput::Elements(trace.events));
        let cfg = Config::for_policy(Policy::Default);
        g.bench_function("default", |b| {
            b.iter(|| replay(&trace, &cfg, &ReplayOptions::default()))
        });
        g.finish();
        let mut g = c.benchmark_group(format!("parse/{}", trace.name));
        g.measurement_time(Duration::from_secs(3)).sample_size(10);
        g.throughput(Throughput::Elements(trace.events + 1));
        // Opening and reading the file, whatever its format (CSV for the bundled traces).
        g.bench_function("read", |b| {
            b.iter(|| cudalloc_trace::read(&path).expect("trace"))
        });
        g.finish();
    }
}

criterion_group!(replay_benches, bench);
criterion_main!(replay_benches);
