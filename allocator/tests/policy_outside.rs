//! Policies written outside the crate, through the public `Policy` trait and `Core` operations:
//! an adaptor that counts the hooks of the policy it wraps (in the style of RMM's resource
//! adaptors) changes nothing the pool does, and a first-fit policy of its own keeps every
//! invariant the core checks.

#[path = "common/pool.rs"]
mod pool;

use cudalloc::policy::{torch, Policy, Torch};
use cudalloc::pool::block::BlockId;
use cudalloc::pool::{Core, Request};
use cudalloc::{Config, Pool};
use cudalloc_sys::{Device, DeviceError, SimConfig, SimDevice};
use pool::{GIB, MIB, S0};
use std::sync::Arc;

/// Wraps a policy and counts how often the pool asks it.
#[derive(Default)]
struct Counted<P> {
    inner: P,
    places: u64,
    grows: u64,
    allocs: u64,
}

impl<P: Policy> Policy for Counted<P> {
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        self.places += 1;
        self.inner.place(core, req, may_grow)
    }

    fn should_split<D: Device>(&self, core: &Core<D>, id: BlockId, size: u64) -> bool {
        self.inner.should_split(core, id, size)
    }

    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        self.grows += 1;
        self.inner.grow(core, req)
    }

    fn on_alloc<D: Device>(&mut self, core: &mut Core<D>, id: BlockId) {
        self.allocs += 1;
        self.inner.on_alloc(core, id);
    }
}

/// The lowest-addressed free block of the stream that fits, fixed segments as `torch` grows.
struct FirstFit;

impl Policy for FirstFit {
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        _may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        let idx = core.free_index(req.pool);
        let lowest = idx
            .at_least(req.stream.0, req.size)
            .min_by_key(|&(_, id)| core.block(id).map(|b| b.addr));
        Ok(lowest.map(|(_, id)| {
            assert!(core.unindex_free(id));
            id
        }))
    }

    fn should_split<D: Device>(&self, core: &Core<D>, id: BlockId, size: u64) -> bool {
        torch::should_split(core, id, size, false)
    }

    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        core.alloc_segment(req)
    }
}

/// Sizes of a small mixed workload: (size, free the allocation made this many steps before).
fn workload() -> Vec<(u64, usize)> {
    let sizes = [
        3 * MIB,
        512,
        700_000,
        24 * MIB,
        5 * MIB,
        1 << 20,
        64 * MIB,
        4096,
    ];
    (0..400)
        .map(|i| (sizes[i * 7 % sizes.len()], i % 5))
        .collect()
}

fn run<P: Policy>(pool: &mut Pool<Arc<SimDevice>, P>) -> Vec<u64> {
    let mut live = Vec::new();
    let mut ptrs = Vec::new();
    for (size, back) in workload() {
        let a = pool.allocate(size, S0).unwrap();
        ptrs.push(a.ptr);
        live.push(a);
        if back > 0 && live.len() > back {
            let a = live.remove(live.len() - 1 - back);
            pool.free(&a).unwrap();
        }
        pool.check_invariants().unwrap();
    }
    for a in live {
        pool.free(&a).unwrap();
    }
    pool.check_invariants().unwrap();
    ptrs
}

fn sim() -> Arc<SimDevice> {
    Arc::new(SimDevice::new(SimConfig::with_capacity(4 * GIB)))
}

#[test]
fn an_adaptor_around_torch_changes_nothing_and_sees_every_request() {
    let cfg = Config::for_policy(cudalloc::Policy::Torch);
    let mut plain = Pool::new(sim(), cfg.clone());
    let mut counted = Pool::with_policy(sim(), cfg, Counted::<Torch>::default());
    assert_eq!(run(&mut plain), run(&mut counted));
    assert_eq!(plain.stats(), counted.stats());
    let c = counted.policy();
    assert_eq!((c.places, c.allocs), (400, 400));
    assert_eq!(c.grows, counted.stats().num_device_alloc);
}

#[test]
fn a_first_fit_policy_of_its_own_keeps_the_core_invariants() {
    let cfg = Config::for_policy(cudalloc::Policy::Torch);
    let mut pool = Pool::with_policy(sim(), cfg, FirstFit);
    run(&mut pool);
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
}
