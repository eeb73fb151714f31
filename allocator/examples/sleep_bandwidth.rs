//! Sleep and wake against the pinned-memory copy bandwidth, measured in the same run on a CUDA
//! GPU.
//!
//! 1. A tag ("weights") of `--gib` GiB in allocations of mixed sizes, filled on a stream of the
//!    program's own.
//! 2. Pinned copies: one pinned host buffer of the same total (`Device::alloc_host`) and, on a
//!    stream of its own (`Device::open_stream`), one `copy_to_host_async` per allocation, then
//!    one `copy_to_device_async` per allocation, each direction timed from the first enqueue
//!    to the host's wait for an event after the last copy; best of three.
//! 3. `--cycles` sleep/wake cycles: `sleep(["weights"], ["weights"])` timed to its return (the
//!    pages are released by then), `wake(["weights"], stream)` timed to the end of a host wait
//!    on that stream (the copies are done by then). The first cycle pins the host buffer; the
//!    later ones reuse it.
//!
//! Printed: both pinned rates in GB/s, each cycle's sleep and wake rate (offloaded bytes over
//! time) and its ratio to the pinned rate of the same direction, the best ratio over the warm
//! cycles against the target of 0.80, and the device memory that came back after each sleep
//! (`cuMemGetInfo`, at least 99% of the tag's reserved bytes). After every wake the first and
//! last MiB of each allocation and a sample of its middle are read back; a wrong byte or less
//! than 99% of the memory back exits with status 1, a missed target with status 2.
//!
//! ```text
//! cargo run --release -p cudalloc --example sleep_bandwidth -- --gib 8 --policy default
//! cargo run --release -p cudalloc --example sleep_bandwidth -- --gib 8 --policy torch-expandable
//! ```

use cudalloc::{Allocation, CachingAllocator, Config, Policy};
use cudalloc_sys::{CudaDevice, Device, StreamId};
use std::process::ExitCode;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The issue's target: sleep and wake at 80% of the pinned copy bandwidth or more.
const TARGET: f64 = 0.8;

type Result<T> = std::result::Result<T, String>;

struct Args {
    gib: u64,
    policy: Policy,
    cycles: usize,
}

fn args() -> Result<Args> {
    let mut a = Args {
        gib: 4,
        policy: Policy::Default,
        cycles: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().ok_or(format!("{k} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{k} {v}: {e}");
        match k.as_str() {
            "--gib" => a.gib = v.parse().map_err(|e| bad(&e))?,
            "--cycles" => a.cycles = v.parse().map_err(|e| bad(&e))?,
            "--policy" => a.policy = Policy::parse(&v).map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown argument {k} (--gib, --cycles, --policy)")),
        }
    }
    if a.gib == 0 || a.cycles < 2 {
        return Err("--gib must be at least 1 and --cycles at least 2".into());
    }
    Ok(a)
}

/// Sizes of allocations adding up to about `gib` GiB: large ones and a few odd small ones.
fn sizes(gib: u64) -> Vec<u64> {
    let mut v = vec![300 * MIB + 12_345, 4096, 7 * MIB + 1, 65_536];
    let mut left = (gib << 30).saturating_sub(v.iter().sum());
    while left > 0 {
        let n = left.min(512 * MIB);
        v.push(n);
        left -= n;
    }
    v
}

/// The byte at offset `at` of allocation `i`'s pattern.
fn byte(i: usize, at: u64) -> u8 {
    (at.wrapping_mul(131) ^ (at >> 12) ^ (i as u64 * 29)) as u8
}

/// Where allocation `a`'s pattern is written and checked: its first and last MiB and 64 KiB in
/// its middle.
fn windows(a: &Allocation) -> Vec<(u64, u64)> {
    let n = a.size();
    let w = n.min(MIB);
    let mid = (n / 2).min(n - n.min(65_536));
    vec![(0, w), (n - w, w), (mid, n.min(65_536))]
}

fn fill(dev: &CudaDevice, w: &[Allocation], s: StreamId) -> Result<()> {
    for (i, a) in w.iter().enumerate() {
        dev.memset_async(a.ptr(), i as u8 + 1, a.size(), s)
            .map_err(|e| e.to_string())?;
    }
    dev.wait_stream(s).map_err(|e| e.to_string())?;
    for (i, a) in w.iter().enumerate() {
        for (at, n) in windows(a) {
            let bytes: Vec<u8> = (at..at + n).map(|k| byte(i, k)).collect();
            dev.copy_to_device(a.ptr() + at, &bytes)
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// Reads back every window of every allocation; the first wrong one, if any.
fn verify(dev: &CudaDevice, w: &[Allocation]) -> Result<()> {
    for (i, a) in w.iter().enumerate() {
        for (at, n) in windows(a) {
            let mut back = vec![0u8; n as usize];
            dev.copy_from_device(a.ptr() + at, &mut back)
                .map_err(|e| e.to_string())?;
            if back.iter().zip(at..).any(|(&b, k)| b != byte(i, k)) {
                return Err(format!("allocation {i}: bytes {at}..{} differ", at + n));
            }
        }
    }
    Ok(())
}

/// Times one direction of plain pinned copies of every allocation, best of three.
fn pinned(dev: &CudaDevice, w: &[Allocation], to_host: bool) -> Result<Duration> {
    let total: u64 = w.iter().map(|a| a.size()).sum();
    let e = |e: cudalloc_sys::DeviceError| e.to_string();
    let host = dev.alloc_host(total).map_err(e)?;
    let stream = dev.open_stream().map_err(e)?;
    let ev = dev.create_event().map_err(e)?;
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let mut off = 0;
        for a in w {
            if to_host {
                dev.copy_to_host_async(host + off, a.ptr(), a.size(), stream)
            } else {
                dev.copy_to_device_async(a.ptr(), host + off, a.size(), stream)
            }
            .map_err(e)?;
            off += a.size();
        }
        dev.record_event(ev, stream).map_err(e)?;
        dev.synchronize_event(ev).map_err(e)?;
        best = best.min(t.elapsed());
    }
    dev.destroy_event(ev).map_err(e)?;
    dev.close_stream(stream).map_err(e)?;
    dev.free_host(host, total).map_err(e)?;
    Ok(best)
}

/// GB/s of `bytes` in `d`.
fn gbs(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// What the run measured and found.
#[derive(Default)]
struct Outcome {
    wrong: bool,
    missed: bool,
}

fn run(a: &Args) -> Result<Outcome> {
    let dev = CudaDevice::new(0).map_err(|e| format!("no CUDA device: {e}"))?;
    let alloc = CachingAllocator::new(dev, Config::for_policy(a.policy));
    let s = alloc
        .with_device(|d| d.create_stream())
        .map_err(|e| e.to_string())?;
    let w: Vec<Allocation> = sizes(a.gib)
        .iter()
        .map(|&n| alloc.allocate_tagged(n, s, "weights"))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let total: u64 = w.iter().map(|x| x.size()).sum();
    // The pinned copies write the allocations (host to device): measure them before filling.
    let (d2h, h2d) =
        alloc.with_device(|d| Ok::<_, String>((pinned(d, &w, true)?, pinned(d, &w, false)?)))?;
    alloc.with_device(|d| fill(d, &w, s))?;
    let (d2h, h2d) = (gbs(total, d2h), gbs(total, h2d));
    println!(
        "policy {}, {:.2} GiB offloaded in {} allocations",
        a.policy.name(),
        total as f64 / (1u64 << 30) as f64,
        w.len()
    );
    println!("pinned copies (same run, best of 3): device->host {d2h:.1} GB/s, host->device {h2d:.1} GB/s");
    let mut out = Outcome::default();
    let (mut best_sleep, mut best_wake) = (0f64, 0f64);
    for c in 1..=a.cycles {
        let tagged = alloc.tag_stats()[0].reserved_bytes;
        let free = |alloc: &CachingAllocator<CudaDevice>| {
            alloc.with_device(|d| d.mem_info().map(|m| m.0).unwrap_or(0))
        };
        let before = free(&alloc);
        let t = Instant::now();
        alloc
            .sleep(&["weights"], &["weights"])
            .map_err(|e| e.to_string())?;
        let slept = t.elapsed();
        let back = free(&alloc).saturating_sub(before);
        let t = Instant::now();
        alloc.wake(&["weights"], s).map_err(|e| e.to_string())?;
        alloc
            .with_device(|d| d.wait_stream(s))
            .map_err(|e| e.to_string())?;
        let woke = t.elapsed();
        let (rs, rw) = (gbs(total, slept), gbs(total, woke));
        let cold = if c == 1 { " (host buffer pinned)" } else { "" };
        println!(
            "cycle {c}{cold}: sleep {:.1} ms, {rs:.1} GB/s = {:.2} of pinned; wake {:.1} ms, {rw:.1} GB/s = {:.2} of pinned; memory back after sleep {:.2}% of {:.2} GiB",
            slept.as_secs_f64() * 1e3,
            rs / d2h,
            woke.as_secs_f64() * 1e3,
            rw / h2d,
            100.0 * back as f64 / tagged as f64,
            tagged as f64 / (1u64 << 30) as f64,
        );
        if (back as f64) < 0.99 * tagged as f64 {
            println!("FAIL: less than 99% of the tag's memory came back");
            out.wrong = true;
        }
        if let Err(e) = alloc.with_device(|d| verify(d, &w)) {
            println!("FAIL: cycle {c}: {e}");
            out.wrong = true;
        }
        if c > 1 {
            best_sleep = best_sleep.max(rs / d2h);
            best_wake = best_wake.max(rw / h2d);
        }
    }
    let verdict = |r: f64| if r >= TARGET { "met" } else { "MISSED" };
    println!(
        "warm cycles, best: sleep {best_sleep:.2} of device->host ({}), wake {best_wake:.2} of host->device ({}); target {TARGET:.2}",
        verdict(best_sleep),
        verdict(best_wake)
    );
    out.missed = best_sleep < TARGET || best_wake < TARGET;
    for x in w {
        alloc.free(x).map_err(|e| e.to_string())?;
    }
    alloc.release_host_buffers().map_err(|e| e.to_string())?;
    alloc.empty_cache().map_err(|e| e.to_string())?;
    alloc
        .with_device(|d| d.destroy_stream(s))
        .map_err(|e| e.to_string())?;
    Ok(out)
}

fn main() -> ExitCode {
    let outcome = args().and_then(|a| run(&a));
    match outcome {
        Err(e) => {
            eprintln!("sleep_bandwidth: {e}");
            ExitCode::FAILURE
        }
        Ok(o) if o.wrong => ExitCode::FAILURE,
        Ok(o) if o.missed => ExitCode::from(2),
        Ok(_) => ExitCode::SUCCESS,
    }
}
