//! What the bad-input files share: sizes no device holds, streams never seen, a simulated device,
//! and the invariant check of the front after each step.

use cudalloc::sizes::MAX_REQUEST;
use cudalloc::CachingAllocator;
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::Arc;

pub(super) const MIB: u64 = 1 << 20;
pub(super) const GIB: u64 = 1 << 30;
pub(super) const S0: StreamId = StreamId(0);
pub(super) const UNKNOWN_STREAMS: [StreamId; 2] = [StreamId(u64::MAX), StreamId(0xdead_beef)];
pub(super) const HUGE: [u64; 7] = [
    u64::MAX,
    u64::MAX - 511,
    1 << 63,
    1 << 62,
    MAX_REQUEST + 1,
    MAX_REQUEST,
    200 * GIB,
];

pub(super) type Sim = Arc<SimDevice>;

pub(super) fn sim() -> Sim {
    Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)))
}

pub(super) fn check_front(sim: &SimDevice, a: &CachingAllocator<Sim>, what: &str) {
    a.check_invariants()
        .unwrap_or_else(|e| panic!("after {what}: {e}"));
    sim.check_invariants();
    assert_eq!(sim.outstanding_bytes(), a.reserved_bytes(), "after {what}");
}
