//! The cost of recording a trace: alloc+free pairs of 512 B through `CachingAllocator` on
//! `SimDevice`, one thread, (a) not recorded, (b) recorded by `RecordingAllocator` into a gzip
//! encoder on the allocating thread, (c) the same with the encoder behind a `BackgroundWriter`
//! (what `cudalloc_trace_start("x.csv.gz")` does). Each pair writes three events (~120 bytes),
//! so the gzip output is written to a sink that discards it.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use cudalloc::record::background::BackgroundWriter;
use cudalloc::record::RecordingAllocator;
use cudalloc::{CachingAllocator, Config};
use cudalloc_sys::{SimDevice, StreamId};
use flate2::write::GzEncoder;
use flate2::Compression;
use std::hint::black_box;
use std::io::{sink, Sink};
use std::time::Duration;

fn allocator() -> CachingAllocator<SimDevice> {
    CachingAllocator::new(SimDevice::with_capacity(1 << 30), Config::default())
}

fn gzip(level: Compression) -> GzEncoder<Sink> {
    GzEncoder::new(sink(), level)
}

fn record(c: &mut Criterion) {
    let mut g = c.benchmark_group("record/512B");
    g.throughput(Throughput::Elements(1))
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let s = StreamId::DEFAULT;
    let plain = allocator();
    g.bench_function("not_recorded", |b| {
        b.iter(|| {
            plain
                .free(black_box(plain.allocate(512, s).unwrap()))
                .unwrap()
        })
    });
    for (name, level) in [
        ("gzip6", Compression::default()),
        ("gzip1", Compression::fast()),
    ] {
        let inline = RecordingAllocator::new(allocator(), gzip(level)).unwrap();
        g.bench_function(format!("{name}_on_the_thread"), |b| {
            b.iter(|| {
                inline
                    .free(black_box(inline.allocate(512, s).unwrap()))
                    .unwrap()
            })
        });
        inline.finish().unwrap();
        let background = BackgroundWriter::new(gzip(level)).unwrap();
        let spooled = RecordingAllocator::new(allocator(), background).unwrap();
        g.bench_function(format!("{name}_on_a_writer_thread"), |b| {
            b.iter(|| {
                spooled
                    .free(black_box(spooled.allocate(512, s).unwrap()))
                    .unwrap()
            })
        });
        spooled.finish().unwrap().finish().unwrap();
    }
    let background = BackgroundWriter::new(sink()).unwrap();
    let spooled = RecordingAllocator::new(allocator(), background).unwrap();
    g.bench_function("uncompressed_on_a_writer_thread", |b| {
        b.iter(|| {
            spooled
                .free(black_box(spooled.allocate(512, s).unwrap()))
                .unwrap()
        })
    });
    spooled.finish().unwrap().finish().unwrap();
    g.finish();
}

criterion_group!(benches, record);
criterion_main!(benches);
