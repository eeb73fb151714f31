//! Helpers shared by the tests that drive a `Pool` on the simulated device (the `core` folder and
//! most of `policies`); each uses a part of them.
#![allow(dead_code)]

use cudalloc::policy::default::DefaultConfig;
use cudalloc::policy::PolicyConfig;
use cudalloc::snapshot::BlockState;
use cudalloc::{Allocation, Config, Policy, Pool};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::Arc;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const S0: StreamId = StreamId(0);
pub const S1: StreamId = StreamId(1);
pub const S2: StreamId = StreamId(2);

pub type Sim = Arc<SimDevice>;

pub fn pool_with(cfg: Config, capacity: u64) -> (Sim, Pool<Sim>) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(capacity)));
    let pool = Pool::new(sim.clone(), cfg);
    (sim, pool)
}

/// A pool of `default` as `d` says, past its loading ([`past_loading`]), on a 16 GiB device
/// whose work completes only when the test says (`SimDevice::set_auto_complete(false)`): a
/// device that runs behind.
pub fn behind(d: DefaultConfig) -> (Sim, Pool<Sim>) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(16 * GIB)));
    let cfg = Config::default()
        .with_policy(PolicyConfig::Default(d))
        .unwrap();
    let mut pool = Pool::new(sim.clone(), cfg);
    past_loading(&mut pool);
    sim.set_auto_complete(false);
    (sim, pool)
}

/// Takes a fresh pool past its loading: one small block allocated and freed, the cache
/// emptied. Under `default` a pool that has never freed a block maps a page ahead in the large
/// pool; tests about other rules start here so that each growth maps what it needs.
#[allow(dead_code)]
pub fn past_loading(pool: &mut Pool<Sim>) {
    let a = pool.allocate(512, S0).unwrap();
    pool.free(a).unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
}

pub fn torch() -> (Sim, Pool<Sim>) {
    pool_with(Config::for_policy(Policy::Torch), 4 * GIB)
}

pub fn torch_with(s: &str) -> (Sim, Pool<Sim>) {
    let cfg = Config::parse_onto(Config::for_policy(Policy::Torch), s).unwrap();
    pool_with(cfg, 4 * GIB)
}

/// Every invariant the pool and the device promise, plus "device bytes == reserved bytes".
pub fn check(sim: &SimDevice, pool: &Pool<Sim>) {
    pool.check_invariants().unwrap();
    sim.check_invariants();
    assert_eq!(
        sim.outstanding_bytes(),
        pool.reserved(),
        "device vs reserved"
    );
}

/// [`check`] for a `CachingAllocator`: its invariants (every shard and tag pool), the device's,
/// and "device bytes == reserved bytes".
pub fn check_caching(sim: &SimDevice, a: &cudalloc::CachingAllocator<Sim>) {
    a.check_invariants().unwrap();
    sim.check_invariants();
    assert_eq!(
        sim.outstanding_bytes(),
        a.reserved_bytes(),
        "device vs reserved"
    );
}

pub fn alloc(pool: &mut Pool<Sim>, size: u64, stream: StreamId) -> Allocation {
    let a = pool
        .allocate(size, stream)
        .unwrap_or_else(|e| panic!("allocate({size}) failed: {e}"));
    assert_eq!(a.ptr() % 512, 0);
    a
}

pub fn free(pool: &mut Pool<Sim>, a: Allocation) {
    pool.free(a).unwrap();
}

/// The segments as (size, [(block size, state)]).
pub fn layout(pool: &Pool<Sim>) -> Vec<(u64, Vec<(u64, BlockState)>)> {
    pool.snapshot()
        .segments
        .iter()
        .map(|s| (s.size, s.blocks.iter().map(|b| (b.size, b.state)).collect()))
        .collect()
}

pub fn block_size(pool: &Pool<Sim>, a: &Allocation) -> u64 {
    pool.block(a.block()).expect("live block").size
}
