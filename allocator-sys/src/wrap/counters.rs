//! Counting calls by kind ([`CallCounters`], for the wrappers) and deciding which upcoming calls
//! fail ([`FaultPlan`], shared by the wrappers and [`crate::SimDevice`]). The simulated device
//! counts its calls under its own lock instead, in plain integers.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::{Call, DeviceError, DeviceResult};

/// One counter per [`Call`] kind; lock-free, used by [`CountCalls`](super::CountCalls).
#[derive(Debug, Default)]
pub struct CallCounters {
    counts: [AtomicU64; Call::ALL.len()],
}

impl CallCounters {
    /// All counters at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one call of kind `call`.
    pub fn record(&self, call: Call) {
        self.counts[call.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// How many calls of kind `call` were recorded since creation or the last reset.
    pub fn get(&self, call: Call) -> u64 {
        self.counts[call.index()].load(Ordering::Relaxed)
    }

    /// Calls of every kind together.
    pub fn total(&self) -> u64 {
        Call::ALL.iter().map(|&c| self.get(c)).sum()
    }

    /// Sets every counter back to zero.
    pub fn reset(&self) {
        for c in &self.counts {
            c.store(0, Ordering::Relaxed);
        }
    }
}

/// Which upcoming calls fail: shared by [`crate::SimDevice`] and [`FailCalls`](super::FailCalls).
///
/// Acquiring calls (those with `!call.is_release()`) are counted and failed by a one-shot fault
/// ([`FaultPlan::fail_call`]) and a periodic fault ([`FaultPlan::fail_every`]), which may be
/// armed together; a call fails if either fires. Release calls fail only when a release fault
/// is armed ([`FaultPlan::fail_release`], counted over release calls alone), so cleanup paths
/// stay testable under acquiring faults and the release paths' own failures can be tested too.
/// A lasting fault ([`FaultPlan::fail_always`]) fails every call of its kinds, acquiring or
/// release, until the plan is cleared: a device that keeps refusing a call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Acquiring calls left until the one-shot fault (1 = the next one).
    countdown: Option<u64>,
    /// Release calls left until the one-shot release fault (1 = the next one).
    release_countdown: Option<u64>,
    /// Period of the periodic fault; 0 disables it.
    every: u64,
    /// Acquiring calls seen since the periodic fault last fired (or was armed).
    seen: u64,
    /// The kinds of call that always fail, one bit per [`Call::index`].
    always: u32,
}

// `FaultPlan::always` holds one bit per kind of call.
const _: () = assert!(Call::ALL.len() <= u32::BITS as usize);

/// Counts a one-shot fault down by one call; true when this call is the one that fails.
fn count_down(countdown: &mut Option<u64>) -> bool {
    match *countdown {
        Some(1) => {
            *countdown = None;
            true
        }
        Some(n) => {
            *countdown = Some(n - 1);
            false
        }
        None => false,
    }
}

impl FaultPlan {
    /// A plan that fails nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// The `k`-th acquiring call from now fails (1-based); `k = 0` disarms the one-shot fault.
    pub fn fail_call(&mut self, k: u64) {
        self.countdown = (k > 0).then_some(k);
    }

    /// Every `k`-th acquiring call from now fails; `k = 0` disables the periodic fault.
    pub fn fail_every(&mut self, k: u64) {
        self.every = k;
        self.seen = 0;
    }

    /// The next acquiring call fails; shorthand for `fail_call(1)`.
    pub fn fail_next(&mut self) {
        self.fail_call(1);
    }

    /// The `k`-th release call from now (`free`, `unreserve`, `release_page`, `unmap`,
    /// `destroy_event`) fails (1-based); `k = 0` disarms it.
    pub fn fail_release(&mut self, k: u64) {
        self.release_countdown = (k > 0).then_some(k);
    }

    /// Every call of kind `call` fails from now on (with those of the kinds armed before),
    /// until [`FaultPlan::clear`]; it consumes no other fault.
    pub fn fail_always(&mut self, call: Call) {
        self.always |= 1 << call.index();
    }

    /// Disarms every fault.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// True while some fault is still to come.
    pub fn is_armed(&self) -> bool {
        self.countdown.is_some()
            || self.every > 0
            || self.release_countdown.is_some()
            || self.always != 0
    }

    /// Advances the plan by one call and says whether that call must fail.
    pub fn tick(&mut self, call: Call) -> bool {
        if self.always & (1 << call.index()) != 0 {
            return true;
        }
        if call.is_release() {
            return count_down(&mut self.release_countdown);
        }
        let one_shot = count_down(&mut self.countdown);
        let periodic = self.every > 0 && {
            self.seen += 1;
            self.seen == self.every
        };
        if periodic {
            self.seen = 0;
        }
        one_shot || periodic
    }

    /// [`FaultPlan::tick`], turned into the injected error when the call must fail.
    /// `requested` is the size argument of the call, if it has one.
    pub fn check(&mut self, call: Call, requested: u64) -> DeviceResult<()> {
        if self.tick(call) {
            Err(Self::injected(call, requested))
        } else {
            Ok(())
        }
    }

    /// The error an injected fault produces: out-of-memory for the calls that supply memory or
    /// address space (`malloc`, `create_page`, `reserve`), driver error 999 for the others.
    pub fn injected(call: Call, requested: u64) -> DeviceError {
        match call {
            Call::Malloc | Call::CreatePage | Call::Reserve => DeviceError::OutOfMemory {
                call: call.name(),
                requested,
            },
            _ => DeviceError::Driver {
                call: call.name(),
                code: 999,
                message: "injected fault".into(),
            },
        }
    }
}
