//! Alloc+free pairs through `CachingAllocator` with 1, 4 and 16 threads, each on its own stream
//! and all on one stream, for 512 B .. 256 MiB; on `SimDevice`, and on `CudaDevice` beside the
//! same loop through `cuMemAllocAsync`/`cuMemFreeAsync` when a GPU is present. Throughput is in
//! pairs (elements) per second over all threads.
//!
//! `CUDALLOC_BENCH_THREADS=1,2` replaces the thread counts (for machines with few cores).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use cudalloc::{CachingAllocator, Config};
use cudalloc_benches::{pairs, Streams};
use cudalloc_sys::{CudaDevice, Device, SimDevice, StreamId};
use std::time::Duration;

const SIZES: [u64; 5] = [512, 64 << 10, 1 << 20, 16 << 20, 256 << 20];
const THREADS: [usize; 3] = [1, 4, 16];

/// The thread counts to run: `CUDALLOC_BENCH_THREADS` (comma-separated) or [`THREADS`].
fn threads() -> Vec<usize> {
    match std::env::var("CUDALLOC_BENCH_THREADS") {
        Ok(v) => v
            .split(',')
            .map(|t| {
                t.trim()
                    .parse()
                    .expect("CUDALLOC_BENCH_THREADS: a list of counts")
            })
            .collect(),
        Err(_) => THREADS.to_vec(),
    }
}

fn label(size: u64) -> String {
    match size {
        s if s >= 1 << 20 => format!("{}MiB", s >> 20),
        s if s >= 1 << 10 => format!("{}KiB", s >> 10),
        s => format!("{s}B"),
    }
}

/// The thread's stream: `real` streams when given (a CUDA device syncs and records on them),
/// else the bench's stream number itself.
fn stream_of(real: &[StreamId], s: u64) -> StreamId {
    if real.is_empty() {
        StreamId(s)
    } else {
        real[((s - 0x1000) / 0x40) as usize % real.len()]
    }
}

fn cached<D: Device>(
    c: &mut Criterion,
    name: &str,
    cfg: &Config,
    real: &[StreamId],
    make: impl Fn() -> D,
) {
    for streams in [Streams::Own, Streams::Shared] {
        let mut g = c.benchmark_group(format!("{name}/{streams:?}"));
        g.measurement_time(Duration::from_secs(1))
            .warm_up_time(Duration::from_millis(200))
            .sample_size(10);
        for threads in threads() {
            for size in SIZES {
                g.throughput(Throughput::Elements(threads as u64));
                let alloc = CachingAllocator::new(make(), cfg.clone());
                let id = BenchmarkId::new(format!("{threads}t"), label(size));
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        pairs(threads, streams, iters, |s| {
                            let a = alloc.allocate(size, stream_of(real, s)).expect("allocate");
                            alloc.free(a).expect("free");
                        })
                    })
                });
            }
        }
        g.finish();
    }
}

fn stream_ordered(c: &mut Criterion, dev: &CudaDevice) {
    for streams in [Streams::Own, Streams::Shared] {
        let mut g = c.benchmark_group(format!("cuMemAllocAsync/{streams:?}"));
        g.measurement_time(Duration::from_secs(1))
            .warm_up_time(Duration::from_millis(200))
            .sample_size(10);
        let real: Vec<StreamId> = (0..16)
            .map(|_| dev.create_stream().expect("stream"))
            .collect();
        for threads in threads() {
            for size in SIZES {
                g.throughput(Throughput::Elements(threads as u64));
                let id = BenchmarkId::new(format!("{threads}t"), label(size));
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        pairs(threads, streams, iters, |s| {
                            let stream = stream_of(&real, s);
                            let p = dev.malloc_async(size, stream).expect("cuMemAllocAsync");
                            dev.free_async(p, stream).expect("cuMemFreeAsync");
                        })
                    })
                });
            }
        }
        g.finish();
    }
}

fn benches(c: &mut Criterion) {
    let dflt = Config::default();
    // Thread caches big enough for every benchmarked size: speed before memory.
    let speed = Config::parse("thread_cache_mb:1024,thread_cache_block_mb:512").expect("config");
    cached(c, "sim", &dflt, &[], SimDevice::default);
    match CudaDevice::new(0) {
        Ok(dev) => {
            let real: Vec<StreamId> = (0..16)
                .map(|_| dev.create_stream().expect("stream"))
                .collect();
            cached(c, "cuda", &dflt, &real, || {
                CudaDevice::new(0).expect("device")
            });
            cached(c, "cuda-bigcache", &speed, &real, || {
                CudaDevice::new(0).expect("device")
            });
            stream_ordered(c, &dev);
        }
        Err(e) => eprintln!("skipping the CUDA benchmarks: {e}"),
    }
}

criterion_group!(hot, benches);
criterion_main!(hot);
