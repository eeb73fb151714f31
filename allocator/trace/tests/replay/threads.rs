//! A real program's trace replayed on the threads that made its calls: FSDP2's training
//! (`fsdp_train` of the acceptance suite, recorded on an H100 with `thread_cache:False`) frees
//! and allocates on three threads, and the thread caches must not cost its pools driver calls.
//!
//! A trace does not say which thread made a call, so the replay gives each call the thread
//! PyTorch runs it on: the forward pass and the optimizer on the main thread; the backward pass
//! (from each step's peak of live bytes to the low point after it) on the autograd thread; and
//! the frees of the collectives' tensors (blocks allocated on the process group's streams) on a
//! thread that never allocates, as NCCL's watchdog thread drops the tensors of completed
//! collectives. The threads take strict turns in the trace's order, so the replay is
//! deterministic.

use cudalloc::{Allocation, CachingAllocator, Config};
use cudalloc_sys::{Call, SimConfig, SimDevice, StreamId};
use cudalloc_trace::replay::Lagging;
use cudalloc_trace::{read, Op, Trace};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const MAIN: u8 = 0;
const AUTOGRAD: u8 = 1;
const WATCHDOG: u8 = 2;

/// Operations from one step's peak of live bytes to the next are at least this many apart.
const STEP_OPS: usize = 600;

/// The thread of each operation of `trace`, as described in the module docs.
fn threads(trace: &Trace) -> Vec<u8> {
    let (mut size, mut stream) = (vec![0; trace.slots as usize], vec![0; trace.slots as usize]);
    let mut live = 0u64;
    let mut curve = Vec::with_capacity(trace.ops.len());
    let mut thread = vec![MAIN; trace.ops.len()];
    for (i, op) in trace.ops.iter().enumerate() {
        match *op {
            Op::Alloc {
                slot,
                stream: s,
                size: n,
            } => {
                (size[slot as usize], stream[slot as usize]) = (n, s);
                live += n;
            }
            Op::Free { slot } => {
                live -= size[slot as usize];
                if stream[slot as usize] != 0 {
                    thread[i] = WATCHDOG;
                }
            }
        }
        curve.push(live);
    }
    let n = curve.len();
    let mut peaks: Vec<usize> = Vec::new();
    for i in 0..n {
        let window = &curve[i.saturating_sub(STEP_OPS)..(i + STEP_OPS).min(n)];
        let apart = peaks.last().is_none_or(|&p| i > p + STEP_OPS);
        if apart && window.iter().all(|&v| v <= curve[i]) {
            peaks.push(i);
        }
    }
    for (k, &p) in peaks.iter().enumerate() {
        let next = peaks.get(k + 1).copied().unwrap_or(n);
        let low = (p..next).min_by_key(|&j| curve[j]).unwrap_or(p);
        for t in thread[p + 1..=low].iter_mut().filter(|t| **t == MAIN) {
            *t = AUTOGRAD;
        }
    }
    thread
}

/// Replays `trace` on its three threads under `cfg`, on a device `lag` operations behind
/// (0: keeping up); returns the driver calls that map or free memory.
fn replay_on_threads(trace: &Trace, cfg: &str, lag: u64) -> u64 {
    let sim = Arc::new(SimDevice::new(SimConfig::default()));
    sim.set_auto_complete(lag == 0);
    let lagging = Mutex::new(Lagging::new(sim.clone(), lag));
    let alloc = CachingAllocator::new(sim.clone(), Config::parse(cfg).unwrap());
    let slots: Mutex<Vec<Option<Allocation>>> =
        Mutex::new((0..trace.slots).map(|_| None).collect());
    let (thread, next) = (threads(trace), AtomicUsize::new(0));
    let run = |me: u8| loop {
        let i = next.load(Ordering::Acquire);
        if i == trace.ops.len() {
            return;
        }
        if thread[i] != me {
            std::thread::yield_now();
            continue;
        }
        if lag > 0 {
            lagging.lock().unwrap().tick();
        }
        match trace.ops[i] {
            Op::Alloc { slot, stream, size } => {
                let s = StreamId(trace.streams[stream as usize]);
                let a = alloc.allocate(size, s).unwrap();
                slots.lock().unwrap()[slot as usize] = Some(a);
            }
            Op::Free { slot } => {
                let a = slots.lock().unwrap()[slot as usize].take().unwrap();
                alloc.free(a).unwrap();
            }
        }
        next.store(i + 1, Ordering::Release);
    };
    std::thread::scope(|s| {
        for me in [MAIN, AUTOGRAD, WATCHDOG] {
            s.spawn(move || run(me));
        }
    });
    sim.complete_all();
    [Call::Map, Call::Unmap, Call::Malloc, Call::Free]
        .iter()
        .map(|&c| sim.calls(c))
        .sum()
}

/// With thread caches on, FSDP2's pools make at most 5% more driver calls than without them,
/// with the device keeping up and running 20 and 200 operations behind. Before the rule that
/// sends other threads' large-part blocks back to a watched pool (`policy::front`), a 150 MiB
/// block kept in the autograd thread's large part through the next forward pass made 411, 559
/// and 534 calls against 351, 304 and 287 (the real program on an H100: 554 and 660 against
/// 302).
#[test]
fn fsdp_training_on_its_three_threads_makes_no_more_calls_with_thread_caches() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/programs/fsdp_train.trace.csv.gz");
    let trace = read(&path).unwrap();
    let on_threads = threads(&trace);
    for t in [MAIN, AUTOGRAD, WATCHDOG] {
        assert!(on_threads.contains(&t), "thread {t} makes some calls");
    }
    for lag in [0, 20, 200] {
        let cached = replay_on_threads(&trace, "policy:default", lag);
        let uncached = replay_on_threads(&trace, "policy:default,thread_cache:False", lag);
        println!("lag {lag}: {cached} calls with thread caches, {uncached} without");
        assert!(
            cached as f64 <= 1.05 * uncached as f64,
            "lag {lag}: {cached} driver calls with thread caches, {uncached} without"
        );
    }
}
