//! Replaying a trace against a policy on the simulated device, and the figures it yields.
//!
//! `alloc` allocates, `free_completed` frees (see [`crate`]); allocations still live at
//! the end are freed. Figures: peak live bytes (sum of requested sizes), peak allocated and
//! reserved bytes, driver calls, out-of-memory events and time per event. With a capacity the
//! pool is capped at that many bytes (as PyTorch's memory fraction does) and the replay stops at
//! the first allocation that fails even after the out-of-memory ladder. With `breakdown`, the
//! reserved bytes are broken down ([`Excess`]) after the operation at which they first reach
//! their highest value (a peak reached and left inside one operation is not seen there), and the
//! units that pin the most bytes then are kept ([`PeakPinning`]), each with the operation that
//! allocated its largest block in use.

use crate::bound::PAGE;
use crate::call_log::{CallLog, CallStep};
use crate::{Op, Trace};
use cudalloc::config::Config;
use cudalloc::policy::Policy;
use cudalloc::snapshot::{Excess, PinnedUnit};
use cudalloc::AllocError;
use cudalloc::{Allocation, Pool};
use cudalloc_sys::wrap::{AnswerUse, CallTime, TimeCalls};
use cudalloc_sys::{Call, Device, SimConfig, SimDevice, StreamId};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

mod pace;
mod target;
pub use pace::Lagging;
use pace::{replay_answered, replay_lagging};
pub(crate) use target::Target;

/// Capacity of the simulated device: an H200's 143,771 MiB.
pub const DEVICE_CAPACITY: u64 = 143_771 << 20;

/// One point of a memory timeline: the highest value of each figure over the operations since
/// the previous point (so a peak between two points is not lost, however few the points).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// Index of the last operation the point covers.
    pub op: u32,
    /// Live (requested) bytes, the most in the interval.
    pub live: u64,
    /// Allocated (rounded) bytes, the most in the interval.
    pub allocated: u64,
    /// Reserved bytes, the most in the interval.
    pub reserved: u64,
}

impl Sample {
    /// The figures of `pool` now.
    fn of(pool: &impl Target, op: usize) -> Sample {
        let s = pool.stats();
        Sample {
            op: op as u32,
            live: s.requested_bytes.0[0].current as u64,
            allocated: s.allocated_bytes.0[0].current as u64,
            reserved: s.reserved_bytes.0[0].current as u64,
        }
    }

    /// The highest of each figure of `self` and `other`, at `other`'s operation.
    fn max(self, other: Sample) -> Sample {
        Sample {
            op: other.op,
            live: self.live.max(other.live),
            allocated: self.allocated.max(other.allocated),
            reserved: self.reserved.max(other.reserved),
        }
    }
}

/// Builds a timeline of about `samples` points, each the most of every figure over its
/// interval of operations ([`Sample`]).
struct Timeline {
    /// Operations per point.
    every: usize,
    /// Operations seen in the current interval.
    seen: usize,
    /// The most of each figure in the current interval.
    acc: Sample,
    points: Vec<Sample>,
}

impl Timeline {
    fn new(ops: usize, samples: usize) -> Timeline {
        Timeline {
            every: ops.checked_div(samples).map_or(usize::MAX, |n| n.max(1)),
            seen: 0,
            acc: Sample::default(),
            points: Vec::with_capacity(samples + 3),
        }
    }

    /// Takes in the figures after operation `op`; closes the interval when it is full.
    fn after(&mut self, pool: &impl Target, op: usize) {
        self.acc = self.acc.max(Sample::of(pool, op));
        self.seen += 1;
        if self.seen == self.every {
            self.close();
        }
    }

    fn close(&mut self) {
        if self.seen > 0 {
            self.points.push(self.acc);
        }
        self.acc = Sample::default();
        self.seen = 0;
    }

    /// The points, the current interval's included, then `end`: the figures after the last
    /// operation.
    fn finish(mut self, end: Sample) -> Vec<Sample> {
        self.close();
        self.points.push(end);
        self.points
    }
}

/// Where a capped replay failed.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    /// Index of the operation that failed.
    pub op: usize,
    /// The error.
    pub error: AllocError,
}

/// What a replay measured.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayResult {
    /// Operations replayed.
    pub events: u64,
    /// Peak of the sum of requested bytes of live allocations.
    pub peak_live_bytes: u64,
    /// Peak allocated (rounded) bytes (with `answers`, the sum of the stream shards' peaks:
    /// at least the peak of their sum).
    pub peak_allocated_bytes: u64,
    /// Peak reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Device `malloc` calls.
    pub device_mallocs: u64,
    /// Device `free` calls.
    pub device_frees: u64,
    /// Map operations.
    pub device_maps: u64,
    /// Unmap operations.
    pub device_unmaps: u64,
    /// Times the pool waited for the device (`Stats::device_waits`): only on the out-of-memory
    /// ladder's last rung.
    pub device_waits: u64,
    /// Pages a growth took from a releasing block of its stream (`Stats::pages_moved`): only
    /// when the device runs behind (`device_lag`).
    pub pages_moved: u64,
    /// Bytes whose pages started going back to the device (`Stats::given_back_bytes`).
    pub given_back_bytes: u64,
    /// Bytes on their way back taken back into the cache before the device caught up with
    /// them (`Stats::taken_back_bytes`): only when the device runs behind (`device_lag`) or an
    /// unmap fails.
    pub taken_back_bytes: u64,
    /// With `--cuda`: the waits for the device (`cuCtxSynchronize`, `cuEventSynchronize`) that
    /// a timing wrapper around the driver saw while the trace's operations ran (the span
    /// `ns_per_event` times: not the frees of what the trace left live, nor the pool's drop);
    /// `None` on the simulated device.
    pub driver_waits: Option<u64>,
    /// With `--cuda`: the driver calls of each kind made over the same span as
    /// [`driver_waits`](Self::driver_waits) and the wall time spent in them, kinds called at least
    /// once in [`Call::ALL`]'s order (one map is `cuMemCreate`, `cuMemMap` and `cuMemSetAccess`:
    /// [`Call::CreatePage`], [`Call::Map`], [`Call::SetAccess`]), so that `ns_per_event` x
    /// `events` less their time is the allocator's own work; `None` on the simulated device.
    pub driver_time: Option<Vec<(Call, CallTime)>>,
    /// Allocations that failed with out-of-memory.
    pub ooms: u64,
    /// Wall time per operation.
    pub ns_per_event: f64,
    /// The first failure, when capped.
    pub failure: Option<Failure>,
    /// Memory over time (when asked for).
    pub timeline: Vec<Sample>,
    /// Where the reserved bytes were after the operation at which they first reached their
    /// highest value (when asked for): the operation's index and the breakdown.
    pub peak_excess: Option<(usize, Excess)>,
    /// What held the pinned bytes at that moment (when asked for).
    pub peak_pinning: Option<PeakPinning>,
    /// The operations that made driver calls, in order (when asked for: `calls`).
    pub calls: Vec<CallStep>,
    /// With `answers`: the trace's recorded answers to the allocator's event queries that the
    /// replay gave, and its queries that had none left in their operation.
    pub answers: Option<AnswerUse>,
    /// The replay drove a `CachingAllocator`'s stream shards (`answers` or `shards`), not one
    /// pool.
    pub shards: bool,
}

/// How many of the units holding the most pinned bytes [`PeakPinning`] keeps.
pub const PINNING_SHOWN: usize = 5;

/// What held the pinned bytes at the reserved peak (the pool's `Core::pinning`, as
/// [`PinnedUnit`]s).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeakPinning {
    /// Units (chunks or `cudaMalloc` segments) holding pinned bytes then.
    pub units: usize,
    /// Their pinned bytes together (the breakdown's).
    pub pinned: u64,
    /// The [`PINNING_SHOWN`] holding the most, each with the index of the operation that
    /// allocated its largest block in use (`None` when that block is waiting for events).
    pub most: Vec<(PinnedUnit, Option<usize>)>,
}

impl ReplayResult {
    /// Driver calls of every kind.
    pub fn driver_calls(&self) -> u64 {
        self.device_mallocs + self.device_frees + self.device_maps + self.device_unmaps
    }
}

/// How to replay.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// Cap on the pool's bytes (`None`: only the device's capacity, and the config's
    /// `per_process_memory_fraction` if it has one; with both caps, the lower).
    pub capacity: Option<u64>,
    /// Record about this many timeline samples (0: none).
    pub samples: usize,
    /// Replay on GPU 0 (real driver calls) instead of the simulated device.
    pub cuda: bool,
    /// Break the reserved bytes down ([`Excess`]) at their peak.
    pub breakdown: bool,
    /// Keep every operation that made driver calls ([`crate::call_log`]).
    pub calls: bool,
    /// Replay as if the device ran this many operations behind the host (simulated device
    /// only, and [`replay`] only: `replay_on`, `replay_pool` and `replay_policy` run with the
    /// device they are given; `None` or 0: the device keeps up, as it does by default): work a pool queues on a
    /// stream during operation `i` (the event a release waits for) completes when operation
    /// `i + n` starts, so pages given back during a growth are still held while it maps new
    /// ones ([`Lagging`]).
    pub device_lag: Option<u64>,
    /// Answer the allocator's event queries as the recording's device answered them
    /// ([`Trace::answers`]): each query of operation `i` gets the first answer not given yet
    /// that was recorded in it about its event's stream, a query with none the simulated
    /// device's (done) (`PlayAnswers`). The replay then drives a `CachingAllocator` with the
    /// config's settings and thread caches off, and under `default` no block lent across
    /// streams (a traced run lends none), from one thread (its stream shards, as a
    /// program ran it), not one pool: its allocated peak is the sum of its shards' peaks, its
    /// time includes the front's locks, and under a cap its out-of-memory fallback (every
    /// other shard's cache given back, one more try) may wait for the device once more.
    /// Simulated device and [`replay`] only, as `device_lag`, which it overrides.
    pub answers: bool,
    /// Drive a `CachingAllocator`'s stream shards, as `answers` does, on a device that keeps
    /// up (every event query answered done), or with `device_lag` one that runs behind: the
    /// figures a program's allocator gives where one pool's budget would act across streams.
    /// Implied by `answers` (which overrides `device_lag`); simulated device and [`replay`]
    /// only.
    pub shards: bool,
}

/// Replays `trace` under `cfg` on the simulated device, or on GPU 0 when `opts.cuda` is set
/// (a missing GPU is a failure at operation 0).
pub fn replay(trace: &Trace, cfg: &Config, opts: &ReplayOptions) -> ReplayResult {
    if (opts.answers || opts.shards) && !opts.cuda {
        return replay_answered(trace, cfg, opts);
    }
    if let Some(lag) = opts.device_lag.filter(|&n| n > 0 && !opts.cuda) {
        return replay_lagging(trace, cfg, opts, lag);
    }
    if !opts.cuda {
        return replay_on(simulated_device(trace), trace, cfg, opts);
    }
    match cudalloc_sys::CudaDevice::new(0) {
        Ok(dev) => replay_cuda(dev, trace, cfg, opts),
        Err(e) => failed_at_start(e.into()),
    }
}

/// The simulated H200 a replay of `trace` runs on, with the trace's [`malloc_plan`].
pub fn simulated_device(trace: &Trace) -> SimDevice {
    let device = SimDevice::new(SimConfig::with_capacity(DEVICE_CAPACITY));
    device.plan_mallocs(malloc_plan(trace));
    device
}

/// Where a replay of `trace` puts its mallocs ([`SimDevice::plan_mallocs`]): the recording's
/// segments (size, and address less the lowest of them), in the order it made them, so that
/// `torch`'s best fit, which breaks ties between free blocks of one size by address, chooses as
/// PyTorch did. Empty for a snapshot with allocations from before its history, whose replay
/// first mallocs segments the recording made before it. (The CSV `cudalloc_trace.convert`
/// writes of such a snapshot holds them as plain allocations: their mallocs go first fit, and
/// a planned range they take is not used.)
pub fn malloc_plan(trace: &Trace) -> Vec<(u64, u64)> {
    if trace.before_history > 0 {
        return Vec::new();
    }
    let low = trace.segment_addrs.iter().copied().min().unwrap_or(0);
    let offsets = trace.segment_addrs.iter().map(|&a| a - low);
    trace.segment_sizes.iter().copied().zip(offsets).collect()
}

/// Replays `trace` on GPU 0, each stream of the trace on a stream of its own: the handles a
/// trace recorded belong to the process that recorded it, so every one but the legacy default
/// stream's (0) is replaced by a stream opened here, and closed once the pool is dropped (its
/// last events recorded and waited for).
fn replay_cuda(
    dev: cudalloc_sys::CudaDevice,
    trace: &Trace,
    cfg: &Config,
    opts: &ReplayOptions,
) -> ReplayResult {
    let timed = Arc::new(TimeCalls::new(dev));
    let mut streams = Vec::with_capacity(trace.streams.len());
    for &s in &trace.streams {
        match if s == 0 {
            Ok(StreamId(0))
        } else {
            timed.open_stream()
        } {
            Ok(id) => streams.push(id),
            Err(e) => {
                close_streams(&*timed, &streams);
                return failed_at_start(e.into());
            }
        }
    }
    let mut pool = Pool::new(timed.clone(), cfg.clone());
    let (mut first, mut last) = (Vec::new(), Vec::new());
    let span = Span {
        start: || first = timed.times(),
        end: || last = timed.times(),
    };
    let mut r = replay_in(&mut pool, trace, &streams, opts, span, |_| {});
    let kinds = since(&first, last);
    let waits = kinds
        .iter()
        .filter(|(c, _)| matches!(c, Call::SynchronizeDevice | Call::SynchronizeEvent));
    r.driver_waits = Some(waits.map(|(_, t)| t.calls).sum());
    r.driver_time = Some(kinds);
    drop(pool);
    close_streams(&*timed, &streams);
    r
}

/// The calls and time of each kind in `now` less those in `before`, kinds with calls left (the
/// wrapper's counts only grow, so `now` holds at least `before`'s of each kind).
fn since(before: &[(Call, CallTime)], now: Vec<(Call, CallTime)>) -> Vec<(Call, CallTime)> {
    now.into_iter()
        .map(|(c, t)| {
            let b = before
                .iter()
                .find(|(k, _)| *k == c)
                .map_or(CallTime::default(), |x| x.1);
            let left = CallTime {
                calls: t.calls - b.calls,
                ns: t.ns - b.ns,
            };
            (c, left)
        })
        .filter(|(_, t)| t.calls > 0)
        .collect()
}

/// Closes the streams [`replay_cuda`] opened (all but the default stream).
fn close_streams<D: Device>(device: &D, streams: &[StreamId]) {
    for &s in streams.iter().filter(|s| s.0 != 0) {
        let _ = device.close_stream(s);
    }
}

/// A replay that failed before its first operation.
fn failed_at_start(error: AllocError) -> ReplayResult {
    ReplayResult {
        events: 0,
        peak_live_bytes: 0,
        peak_allocated_bytes: 0,
        peak_reserved_bytes: 0,
        device_mallocs: 0,
        device_frees: 0,
        device_maps: 0,
        device_unmaps: 0,
        device_waits: 0,
        pages_moved: 0,
        given_back_bytes: 0,
        taken_back_bytes: 0,
        driver_waits: None,
        driver_time: None,
        ooms: 0,
        ns_per_event: 0.0,
        failure: Some(Failure { op: 0, error }),
        timeline: Vec::new(),
        peak_excess: None,
        peak_pinning: None,
        answers: None,
        shards: false,
        calls: Vec::new(),
    }
}

/// Replays `trace` under `cfg` on `device`, with the trace's stream handles as the device's
/// streams: for a simulated device, where any handle is a stream. On a GPU, where they are the
/// recording process's pointers, use [`replay`] with `cuda`, which opens streams of its own.
pub fn replay_on<D: Device>(
    device: D,
    trace: &Trace,
    cfg: &Config,
    opts: &ReplayOptions,
) -> ReplayResult {
    replay_pool(Pool::new(device, cfg.clone()), trace, opts)
}

/// Replays `trace` on the simulated device under `policy`, a policy of any crate (with `cfg`'s
/// rounding, size classes and cap), as [`replay`] replays the built-in ones.
pub fn replay_policy<P: Policy>(
    policy: P,
    trace: &Trace,
    cfg: &Config,
    opts: &ReplayOptions,
) -> ReplayResult {
    let device = simulated_device(trace);
    let pool = Pool::with_policy(device, cfg.pool().clone(), policy)
        .expect("the shared settings of a valid config");
    replay_pool(pool, trace, opts)
}

/// Replays `trace` on `pool`, with the trace's stream handles as its device's streams (see
/// [`replay_on`]).
pub fn replay_pool<D: Device, P: Policy>(
    mut pool: Pool<D, P>,
    trace: &Trace,
    opts: &ReplayOptions,
) -> ReplayResult {
    let streams = trace_streams(trace);
    replay_in(&mut pool, trace, &streams, opts, Span::NONE, |_| {})
}

/// What to do at the two ends of the span a replay times (`ns_per_event`): `start` just before
/// its first operation, `end` just after its last (before the frees of what the trace left
/// live).
struct Span<S: FnOnce(), E: FnOnce()> {
    start: S,
    end: E,
}

/// Nothing, at either end of a [`Span`].
fn nothing() {}

impl Span<fn(), fn()> {
    /// Nothing at either end.
    const NONE: Self = Span {
        start: nothing,
        end: nothing,
    };
}

/// The trace's stream handles as the simulated device's streams (any handle is one there).
fn trace_streams(trace: &Trace) -> Vec<StreamId> {
    trace.streams.iter().map(|&s| StreamId(s)).collect()
}

/// Replays `trace` on `pool`, its stream `i` as `streams[i]`; the pool is left holding what
/// the trace left cached.
fn replay_in(
    pool: &mut impl Target,
    trace: &Trace,
    streams: &[StreamId],
    opts: &ReplayOptions,
    span: Span<impl FnOnce(), impl FnOnce()>,
    mut before_op: impl FnMut(usize),
) -> ReplayResult {
    if let Some(cap) = opts.capacity {
        pool.cap(cap);
    }
    let mut slots: Vec<Option<Allocation>> = (0..trace.slots).map(|_| None).collect();
    let mut timeline = (opts.samples > 0).then(|| {
        let mut t = Timeline::new(trace.ops.len(), opts.samples);
        t.points.push(Sample::of(pool, 0));
        t
    });
    let mut failure = None;
    let mut peak = opts.breakdown.then(Peak::default);
    let mut calls = opts.calls.then(CallLog::default);
    (span.start)();
    let start = Instant::now();
    for (i, op) in trace.ops.iter().enumerate() {
        before_op(i);
        if let Some(p) = peak.as_mut() {
            p.before(op, &slots);
        }
        if let Some(c) = calls.as_mut() {
            c.before(op, &slots, &trace.streams, pool);
        }
        let stepped = step(pool, &mut slots, streams, op);
        if let Some(c) = calls.as_mut() {
            c.after(i, op, pool);
        }
        if let Err(error) = stepped {
            failure = Some(Failure { op: i, error });
            break;
        }
        if let Some(p) = peak.as_mut() {
            p.after(i, op, &slots, pool);
        }
        if let Some(t) = timeline.as_mut() {
            t.after(pool, i);
        }
    }
    let elapsed = start.elapsed();
    (span.end)();
    let done = failure.as_ref().map_or(trace.ops.len(), |f| f.op + 1);
    // The last point: the figures after the last operation, before what is still live is
    // freed below (a trace that ends with memory live does not end at zero).
    let end = Sample::of(pool, done.saturating_sub(1));
    for a in slots.into_iter().flatten() {
        let _ = pool.free(a);
    }
    let timeline = timeline.map_or_else(Vec::new, |t| t.finish(end));
    let s = pool.stats();
    let [peak_live_bytes, peak_allocated_bytes, peak_reserved_bytes] = pool.peaks();
    ReplayResult {
        events: done as u64,
        peak_live_bytes,
        peak_allocated_bytes,
        peak_reserved_bytes,
        device_mallocs: s.calls.mallocs,
        device_frees: s.calls.frees,
        device_maps: s.calls.maps,
        device_unmaps: s.calls.unmaps,
        device_waits: s.device_waits,
        pages_moved: s.pages_moved,
        given_back_bytes: s.given_back_bytes,
        taken_back_bytes: s.taken_back_bytes,
        driver_waits: None,
        driver_time: None,
        ooms: s.num_ooms,
        ns_per_event: elapsed.as_nanos() as f64 / done.max(1) as f64,
        failure,
        timeline,
        peak_excess: peak.as_ref().and_then(|p| p.excess),
        peak_pinning: peak.and_then(|p| p.pinning),
        calls: calls.map_or_else(Vec::new, |c| c.steps),
        answers: None,
        shards: false,
    }
}

/// The breakdown at the reserved peak, kept up to date as a replay runs (`breakdown`).
#[derive(Default)]
struct Peak {
    excess: Option<(usize, Excess)>,
    pinning: Option<PeakPinning>,
    /// The operation that made each live allocation, by address.
    made: HashMap<u64, usize>,
}

impl Peak {
    /// Forgets the allocation operation `op` is about to free.
    fn before(&mut self, op: &Op, slots: &[Option<Allocation>]) {
        if let Op::Free { slot } = *op {
            if let Some(a) = &slots[slot as usize] {
                self.made.remove(&a.ptr());
            }
        }
    }

    /// Notes the allocation operation `i` made, and takes the breakdown when the reserved
    /// bytes pass their highest value so far.
    fn after(&mut self, i: usize, op: &Op, slots: &[Option<Allocation>], pool: &impl Target) {
        if let Op::Alloc { slot, .. } = *op {
            if let Some(a) = &slots[slot as usize] {
                self.made.insert(a.ptr(), i);
            }
        }
        if self
            .excess
            .is_some_and(|(_, e)| pool.reserved() <= e.reserved)
        {
            return;
        }
        self.excess = Some((i, pool.excess()));
        let units = pool.pinning();
        let most = units
            .iter()
            .take(PINNING_SHOWN)
            .map(|u| (*u, self.made.get(&u.largest.0).copied()))
            .collect();
        self.pinning = Some(PeakPinning {
            units: units.len(),
            pinned: units.iter().map(|u| u.pinned).sum(),
            most,
        });
    }
}

fn step(
    pool: &mut impl Target,
    slots: &mut [Option<Allocation>],
    streams: &[StreamId],
    op: &Op,
) -> Result<(), AllocError> {
    match *op {
        Op::Alloc { slot, stream, size } => {
            let a = pool.allocate(size, streams[stream as usize])?;
            slots[slot as usize] = Some(a);
        }
        Op::Free { slot } => {
            if let Some(a) = slots[slot as usize].take() {
                pool.free(a)?;
            }
        }
    }
    Ok(())
}

/// The pages [`min_capacity`] bisects between: the most that cannot hold `peak_live` bytes (a
/// cap that fails) and the fewest that hold `upper` bytes.
pub fn search_pages(peak_live: u64, upper: u64) -> (u64, u64) {
    let hi = upper.div_ceil(PAGE);
    let lo = peak_live.div_ceil(PAGE).saturating_sub(1);
    (lo.min(hi.saturating_sub(1)), hi)
}

/// A cap under which the replay completes while one page less does not, in whole pages of the
/// simulated device (2 MiB, the unit every policy reserves in there), found by bisection
/// between the peak live bytes (a cap below them cannot complete) and `upper`, which must be a
/// cap that completes (the peak reserved bytes of an uncapped replay). A capped replay is not
/// monotone in its cap (`llama_generate` under `torch` completes at 1,086 pages, fails at 1,087
/// to 1,090 and completes at 1,091, which is the answer), so a smaller cap may complete too; the
/// answer always completes. `progress` is told each probe.
pub fn min_capacity(
    trace: &Trace,
    cfg: &Config,
    upper: u64,
    mut progress: impl FnMut(u64, bool),
) -> u64 {
    let completes = |pages: u64| {
        let r = replay(
            trace,
            cfg,
            &ReplayOptions {
                capacity: Some(pages.saturating_mul(PAGE)),
                ..ReplayOptions::default()
            },
        );
        r.failure.is_none()
    };
    let (_, mut hi) = search_pages(trace.peak_live, upper);
    if hi == 0 {
        // Nothing was ever reserved: no cap is too small.
        return 0;
    }
    if !completes(hi) {
        // The uncapped run's peak should always complete; search upward if it does not.
        while !completes(hi) {
            hi = hi.saturating_mul(2);
        }
    }
    let (mut lo, _) = search_pages(trace.peak_live, hi.saturating_mul(PAGE));
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        let ok = completes(mid);
        progress(mid * PAGE, ok);
        if ok {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi * PAGE
}
