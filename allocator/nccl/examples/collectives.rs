//! An all-reduce and an all-gather with NCCL on every GPU of the machine (one process, one
//! rank per GPU, one thread driving them through group calls; with one GPU a single-rank
//! communicator), over four kinds of buffers in the same run:
//!
//! - `cudalloc+reg`: from a `CachingAllocator` whose map hooks register its pages with the
//!   communicators (`NcclRegistration`);
//! - `cudalloc`: from a `CachingAllocator` without hooks;
//! - `cuMemAlloc`: `cuMemAlloc`'d, not registered;
//! - `cuMemAlloc+reg`: `cuMemAlloc`'d and registered with `ncclCommRegister`.
//!
//! Every result is checked (the sum of the ranks' values; every rank's block gathered in
//! order). For each size it prints one line per kind and collective: the time per call and the
//! bus bandwidth (NCCL's tests' definition: all-reduce 2(n-1)/n, all-gather (n-1)/n times the
//! bytes over the time; 0 with one rank, so the algorithm bandwidth, bytes over time, is
//! printed too).
//!
//! `cargo run --release -p cudalloc-nccl --example collectives -- --mib 64,256 --iters 20`

use clap::Parser;
use cudalloc::{CachingAllocator, Config};
use cudalloc_nccl::NcclRegistration;
use cudalloc_sys::nccl::{group, Communicator, Registration};
use cudalloc_sys::{CudaDevice, Device, StreamId};
use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Sizes of the all-reduce buffer (and of each rank's all-gather block), in MiB.
    #[arg(long, value_delimiter = ',', default_value = "8,64,256")]
    mib: Vec<u64>,
    /// Timed calls per size, kind and collective (after 3 untimed ones).
    #[arg(long, default_value_t = 20)]
    iters: u32,
}

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// One rank: its device, stream, communicator and allocators.
struct Rank {
    dev: CudaDevice,
    stream: StreamId,
    comm: Arc<Communicator>,
    registered: CachingAllocator<CudaDevice>,
    plain: CachingAllocator<CudaDevice>,
}

/// Where a kind's buffers come from.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    CudallocRegistered,
    Cudalloc,
    MemAlloc,
    MemAllocRegistered,
}

impl Kind {
    const ALL: [Kind; 4] = [
        Kind::CudallocRegistered,
        Kind::Cudalloc,
        Kind::MemAlloc,
        Kind::MemAllocRegistered,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::CudallocRegistered => "cudalloc+reg",
            Kind::Cudalloc => "cudalloc",
            Kind::MemAlloc => "cuMemAlloc",
            Kind::MemAllocRegistered => "cuMemAlloc+reg",
        }
    }
}

/// A buffer of one rank and how to give it back.
struct Buf {
    ptr: u64,
    bytes: u64,
    kind: Kind,
    reg: Option<Registration>,
}

fn alloc(r: &Rank, kind: Kind, bytes: u64) -> Result<Buf> {
    let ptr = match kind {
        Kind::CudallocRegistered => r.registered.allocate(bytes, r.stream)?.ptr(),
        Kind::Cudalloc => r.plain.allocate(bytes, r.stream)?.ptr(),
        Kind::MemAlloc | Kind::MemAllocRegistered => r.dev.malloc(bytes)?,
    };
    let reg = match kind {
        Kind::MemAllocRegistered => Some(r.comm.register(ptr, bytes)?),
        _ => None,
    };
    Ok(Buf {
        ptr,
        bytes,
        kind,
        reg,
    })
}

fn free(r: &Rank, b: Buf) -> Result<()> {
    if let Some(reg) = b.reg {
        r.comm.deregister(reg)?;
    }
    match b.kind {
        Kind::CudallocRegistered => r.registered.free_ptr(b.ptr)?,
        Kind::Cudalloc => r.plain.free_ptr(b.ptr)?,
        Kind::MemAlloc | Kind::MemAllocRegistered => r.dev.free(b.ptr, b.bytes)?,
    }
    Ok(())
}

fn fill(dev: &CudaDevice, ptr: u64, count: usize, value: f32) -> Result<()> {
    let host: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), count)
        .flatten()
        .collect();
    Ok(dev.copy_to_device(ptr, &host)?)
}

fn read_f32(dev: &CudaDevice, ptr: u64) -> Result<f32> {
    let mut b = [0u8; 4];
    dev.copy_from_device(ptr, &mut b)?;
    Ok(f32::from_le_bytes(b))
}

fn sync_all(ranks: &[Rank]) -> Result<()> {
    for r in ranks {
        r.dev.synchronize()?;
    }
    Ok(())
}

/// Runs `calls` grouped over every rank `iters` times; seconds per call.
fn timed(ranks: &[Rank], iters: u32, call: &dyn Fn(usize, &Rank) -> Result<()>) -> Result<f64> {
    let once = || -> Result<()> {
        let mut first = Ok(());
        group(|| {
            for (i, r) in ranks.iter().enumerate() {
                if let Err(e) = call(i, r) {
                    first = Err(e.to_string());
                }
            }
            Ok(())
        })?;
        first.map_err(Into::into)
    };
    for _ in 0..3 {
        once()?;
    }
    sync_all(ranks)?;
    let start = Instant::now();
    for _ in 0..iters {
        once()?;
    }
    sync_all(ranks)?;
    Ok(start.elapsed().as_secs_f64() / f64::from(iters))
}

/// One kind at one size: both collectives, checked, timed, printed.
fn measure(ranks: &[Rank], kind: Kind, bytes: u64, iters: u32) -> Result<()> {
    let n = ranks.len();
    let count = (bytes / 4) as usize;
    let mut bufs = Vec::new();
    for (i, r) in ranks.iter().enumerate() {
        let send = alloc(r, kind, bytes)?;
        let recv = alloc(r, kind, bytes * n as u64)?;
        fill(&r.dev, send.ptr, count, (i + 1) as f32)?;
        bufs.push((send, recv));
    }
    let reduce = timed(ranks, iters, &|i, r| {
        let (s, d) = (&bufs[i].0, &bufs[i].1);
        Ok(r.comm.all_reduce_f32(s.ptr, d.ptr, count, r.stream.0)?)
    })?;
    let want = (n * (n + 1) / 2) as f32;
    for (r, (_, recv)) in ranks.iter().zip(&bufs) {
        let last = recv.ptr + bytes - 4;
        let got = (read_f32(&r.dev, recv.ptr)?, read_f32(&r.dev, last)?);
        if got != (want, want) {
            return Err(format!("{}: all-reduce gave {got:?}, not {want}", kind.name()).into());
        }
    }
    let gather = timed(ranks, iters, &|i, r| {
        let (s, d) = (&bufs[i].0, &bufs[i].1);
        Ok(r.comm.all_gather_f32(s.ptr, d.ptr, count, r.stream.0)?)
    })?;
    for (r, (_, recv)) in ranks.iter().zip(&bufs) {
        for block in 0..n as u64 {
            let got = read_f32(&r.dev, recv.ptr + block * bytes + bytes - 4)?;
            if got != (block + 1) as f32 {
                return Err(
                    format!("{}: all-gather block {block} holds {got}", kind.name()).into(),
                );
            }
        }
    }
    let gb = |b: f64, t: f64| b / t / 1e9;
    let (b, nf) = (bytes as f64, n as f64);
    let lines = [
        (
            "all_reduce",
            reduce,
            gb(b, reduce),
            gb(b, reduce) * 2.0 * (nf - 1.0) / nf,
        ),
        (
            "all_gather",
            gather,
            gb(b * nf, gather),
            gb(b * nf, gather) * (nf - 1.0) / nf,
        ),
    ];
    for (what, t, algbw, busbw) in lines {
        println!(
            "{:>8} MiB  {what:<10} {:<15} {:>9.1} us  algbw {algbw:>7.1} GB/s  busbw {busbw:>7.1} GB/s",
            bytes >> 20,
            kind.name(),
            t * 1e6
        );
    }
    for (r, (send, recv)) in ranks.iter().zip(bufs) {
        free(r, send)?;
        free(r, recv)?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let gpus = CudaDevice::device_count()?;
    let ordinals: Vec<usize> = (0..gpus).collect();
    let comms: Vec<Arc<Communicator>> = Communicator::init_all(&ordinals)?
        .into_iter()
        .map(Arc::new)
        .collect();
    let registration = Arc::new(NcclRegistration::new(comms.clone()));
    let mut ranks = Vec::new();
    for (&ordinal, comm) in ordinals.iter().zip(&comms) {
        let dev = CudaDevice::new(ordinal)?;
        let stream = dev.create_stream()?;
        let registered = CachingAllocator::new(CudaDevice::new(ordinal)?, Config::default());
        registered.set_map_hooks(Some(registration.clone()));
        let plain = CachingAllocator::new(CudaDevice::new(ordinal)?, Config::default());
        ranks.push(Rank {
            dev,
            stream,
            comm: comm.clone(),
            registered,
            plain,
        });
    }
    println!(
        "{gpus} GPU(s), one rank each; {} timed calls per line",
        args.iters
    );
    for &mib in &args.mib {
        for kind in Kind::ALL {
            measure(&ranks, kind, mib << 20, args.iters)?;
        }
    }
    let (ranges, bytes) = registration.registered();
    println!(
        "registered through the hooks: {ranges} ranges, {} MiB",
        bytes >> 20
    );
    let errors = registration.errors();
    if !errors.is_empty() {
        return Err(format!("registration errors: {errors:?}").into());
    }
    for r in &ranks {
        r.registered.set_map_hooks(None); // deregisters everything before the communicators go
    }
    println!("ok");
    Ok(())
}
