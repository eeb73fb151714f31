//! The device's pace in a replay: a simulated device that runs a fixed number of operations
//! behind the host ([`Lagging`], `ReplayOptions::device_lag`), or one that answers the
//! allocator's event queries as the recording's device answered them
//! (`ReplayOptions::answers`, [`PlayAnswers`]).
//!
//! Invariant: both replay the trace's operations in order and change only what the device says
//! about its work, never what the allocator asks it to do. The lagging replay drives one pool,
//! as [`replay_on`](super::replay_on) does; the answered one the allocator a program ran, its
//! stream shards included (`target::Front`), so that its queries come when the recorded ones
//! came.

use super::target::Front;
use super::{replay_in, simulated_device, trace_streams, ReplayOptions, ReplayResult, Span};
use crate::Trace;
use cudalloc::config::{Config, Policy};
use cudalloc::{CachingAllocator, Pool};
use cudalloc_sys::wrap::PlayAnswers;
use cudalloc_sys::{SimDevice, StreamId};
use std::sync::Arc;

/// Replays `trace` on a simulated device that runs `lag` operations behind the host
/// ([`ReplayOptions::device_lag`]); what is still queued at the end completes before the pool
/// is dropped.
pub(super) fn replay_lagging(
    trace: &Trace,
    cfg: &Config,
    opts: &ReplayOptions,
    lag: u64,
) -> ReplayResult {
    let device = Arc::new(simulated_device(trace));
    device.set_auto_complete(false);
    let mut pool = Pool::new(device.clone(), cfg.clone());
    let mut lagging = Lagging::new(device.clone(), lag);
    let r = replay_in(
        &mut pool,
        trace,
        &trace_streams(trace),
        opts,
        Span::NONE,
        |_| lagging.tick(),
    );
    device.complete_all();
    r
}

/// Replays `trace` through a [`CachingAllocator`] without thread caches (its stream shards, as
/// a program ran it, one thread making every call) on a simulated device that answers the
/// allocator's event queries as the recording's device did ([`ReplayOptions::answers`]), or,
/// without `answers`, keeps up ([`ReplayOptions::shards`]: every query answered done), or runs
/// `device_lag` operations behind ([`Lagging`]; `shards` without `answers` only).
pub(super) fn replay_answered(trace: &Trace, cfg: &Config, opts: &ReplayOptions) -> ReplayResult {
    let sim = Arc::new(simulated_device(trace));
    let recorded = if opts.answers {
        trace.answers.clone()
    } else {
        Vec::new()
    };
    let lag = opts.device_lag.filter(|&n| n > 0 && !opts.answers);
    let mut lagging = lag.map(|n| {
        sim.set_auto_complete(false);
        Lagging::new(sim.clone(), n)
    });
    let device = Arc::new(PlayAnswers::new(sim.clone(), recorded));
    let cfg = Config::parse_onto(cfg.clone(), "thread_cache:False")
        .expect("thread_cache:False holds on any valid config");
    // A traced run lends no block across streams (`lend`): nor does its replay with answers.
    let cfg = if opts.answers && cfg.policy() == Policy::Default {
        Config::parse_onto(cfg, "lend_blocks:False").expect("a key of `default`")
    } else {
        cfg
    };
    let mut front = Front::new(CachingAllocator::new(device.clone(), cfg));
    let mut r = replay_in(
        &mut front,
        trace,
        &trace_streams(trace),
        opts,
        Span {
            start: || {},
            end: || device.finish(),
        },
        |i| {
            if let Some(l) = lagging.as_mut() {
                l.tick();
            }
            device.at_op(i as u64)
        },
    );
    // What is still queued completes before the allocator is dropped.
    sim.complete_all();
    r.answers = opts.answers.then(|| device.usage());
    r.shards = true;
    r
}

/// A simulated device running behind: before each operation it completes the work that was
/// submitted `lag` operations earlier (marks of [`SimDevice::submitted_work`], one per
/// operation, the oldest first).
pub struct Lagging {
    device: Arc<SimDevice>,
    lag: usize,
    marks: std::collections::VecDeque<Vec<(StreamId, u64)>>,
}

impl Lagging {
    /// `device` (auto-complete off) running `lag` operations behind (at least 1).
    pub fn new(device: Arc<SimDevice>, lag: u64) -> Lagging {
        Lagging {
            device,
            lag: usize::try_from(lag.max(1)).unwrap_or(usize::MAX),
            marks: std::collections::VecDeque::new(),
        }
    }

    /// Called before each operation: the work submitted up to `lag` operations ago completes.
    pub fn tick(&mut self) {
        self.marks.push_back(self.device.submitted_work());
        while self.marks.len() >= self.lag {
            let Some(mark) = self.marks.pop_front() else {
                break;
            };
            for (stream, upto) in mark {
                self.device.complete_stream_to(stream, upto);
            }
        }
    }
}
