//! Policies written outside the crate, through the public `Policy` trait and `Core` operations:
//! an adaptor that counts the hooks of the policy it wraps (in the style of RMM's resource
//! adaptors) changes nothing the pool does and hears of every range released, those the policy
//! it wraps releases itself included, and a first-fit policy of its own keeps every invariant
//! the core checks.

use crate::common::pool;

use cudalloc::policy::BlockId;
use cudalloc::policy::{torch, DefaultConfig, DefaultPolicy, Policy, Torch, TorchExpandable};
use cudalloc::policy::{Core, Request};
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
    /// The ranges the pool said went back to the device.
    released: Vec<u32>,
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

    fn release<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<bool, DeviceError> {
        self.inner.release(core, req)
    }

    fn release_pinned<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<bool, DeviceError> {
        self.inner.release_pinned(core, req)
    }

    fn on_alloc<D: Device>(&mut self, core: &mut Core<D>, id: BlockId) {
        self.allocs += 1;
        self.inner.on_alloc(core, id);
    }

    fn on_marked_free<D: Device>(&mut self, core: &Core<D>, id: BlockId, mark: u64) {
        self.inner.on_marked_free(core, id, mark);
    }

    fn on_segment_released(&mut self, segment: u32) {
        self.released.push(segment);
        self.inner.on_segment_released(segment);
    }

    fn watches_large_blocks(&self) -> bool {
        self.inner.watches_large_blocks()
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
        ptrs.push(a.ptr());
        live.push(a);
        if back > 0 && live.len() > back {
            let a = live.remove(live.len() - 1 - back);
            pool.free(a).unwrap();
        }
        pool.check_invariants().unwrap();
    }
    for a in live {
        pool.free(a).unwrap();
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
    let mut counted =
        Pool::with_policy(sim(), cfg.pool().clone(), Counted::<Torch>::default()).unwrap();
    assert_eq!(run(&mut plain), run(&mut counted));
    assert_eq!(plain.stats(), counted.stats());
    let c = counted.policy();
    assert_eq!((c.places, c.allocs), (400, 400));
    assert_eq!(c.grows, counted.stats().num_device_alloc);
}

/// `default` releases an empty giant range itself (`policy::default::giant`) during a growth;
/// the pool tells the adaptor around it once the growth returns.
#[test]
fn an_adaptor_hears_of_a_range_the_policy_it_wraps_released() {
    let cfg = Config::for_policy(cudalloc::Policy::Default);
    let policy = Counted {
        inner: DefaultPolicy::new(DefaultConfig {
            fragmentation_budget: 1.0,
            layout_plans: false,
            ..DefaultConfig::default()
        }),
        places: 0,
        grows: 0,
        allocs: 0,
        released: Vec::new(),
    };
    let mut pool = Pool::with_policy(sim(), cfg.pool().clone(), policy).unwrap();
    pool.set_limit(Some(GIB));
    // A 400 MiB giant range, emptied by the cap for a 700 MiB one, which it cannot hold: the
    // growth releases it.
    let a = pool.allocate(400 * MIB, S0).unwrap();
    pool.free(a).unwrap();
    assert!(pool.policy().released.is_empty());
    let b = pool.allocate(700 * MIB, S0).unwrap();
    let snap = pool.snapshot();
    assert_eq!(snap.segments.len(), 1, "{:?}", snap.segments);
    assert_eq!(pool.policy().released.len(), 1);
    pool.free(b).unwrap();
    pool.check_invariants().unwrap();
}

#[test]
fn a_first_fit_policy_of_its_own_keeps_the_core_invariants() {
    let cfg = Config::for_policy(cudalloc::Policy::Torch);
    let mut pool = Pool::with_policy(sim(), cfg.pool().clone(), FirstFit).unwrap();
    run(&mut pool);
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
}

/// Places whatever free block of the pool fits, whichever stream it belongs to: a bug the core
/// must catch, since another stream may still be using the block.
struct AnyStream;

impl Policy for AnyStream {
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        _may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        let any = core.free_index(req.pool).all_free_at_least(req.size).next();
        Ok(any.inspect(|&id| assert!(core.unindex_free(id))))
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

#[test]
fn a_block_of_another_stream_is_not_handed_out() {
    let cfg = Config::for_policy(cudalloc::Policy::Torch);
    let mut pool = Pool::with_policy(sim(), cfg.pool().clone(), AnyStream).unwrap();
    let a = pool.allocate(30 * MIB, S0).unwrap();
    pool.free(a).unwrap();
    let err = pool.allocate(30 * MIB, pool::S1).unwrap_err();
    assert!(
        matches!(err, cudalloc::AllocError::PolicyBroke { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("another stream"), "{err}");
    assert_eq!(
        pool.stats().allocation.0[0].current,
        0,
        "nothing handed out"
    );
}

/// Grows by a small-pool segment whatever the request: too small for a large request.
struct Undersized;

impl Policy for Undersized {
    fn place<D: Device>(
        &mut self,
        _core: &mut Core<D>,
        _req: &Request,
        _may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        Ok(None)
    }

    fn should_split<D: Device>(&self, _core: &Core<D>, _id: BlockId, _size: u64) -> bool {
        false
    }

    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        let small = Request {
            pool: cudalloc::sizes::PoolKind::Small,
            size: 512,
            alloc_size: 2 * MIB,
            ..*req
        };
        core.alloc_segment(&small)
    }
}

#[test]
fn a_grown_block_smaller_than_the_request_is_not_handed_out() {
    let cfg = Config::for_policy(cudalloc::Policy::Torch);
    let mut pool = Pool::with_policy(sim(), cfg.pool().clone(), Undersized).unwrap();
    let err = pool.allocate(8 * MIB, S0).unwrap_err();
    assert!(
        matches!(err, cudalloc::AllocError::PolicyBroke { .. }),
        "{err}"
    );
    assert_eq!(pool.stats().allocation.0[0].current, 0);
}

/// `torch`'s rules (or `torch-expandable`'s, when `expandable`), trying to release every block
/// it has just handed out: as a segment and as pages.
#[derive(Default)]
struct ReleasesInUse {
    expandable: bool,
    released: Vec<bool>,
    pages: Vec<u64>,
}

impl Policy for ReleasesInUse {
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        match self.expandable {
            true => TorchExpandable.place(core, req, may_grow),
            false => Torch.place(core, req, may_grow),
        }
    }

    fn should_split<D: Device>(&self, core: &Core<D>, id: BlockId, size: u64) -> bool {
        match self.expandable {
            true => TorchExpandable.should_split(core, id, size),
            false => Torch.should_split(core, id, size),
        }
    }

    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        match self.expandable {
            true => TorchExpandable.grow(core, req),
            false => Torch.grow(core, req),
        }
    }

    fn on_alloc<D: Device>(&mut self, core: &mut Core<D>, id: BlockId) {
        self.released.push(core.release_block(id).unwrap());
        self.pages.push(core.release_pages(id).unwrap());
    }
}

#[test]
fn release_block_refuses_a_block_in_use() {
    let cfg = Config::for_policy(cudalloc::Policy::Torch);
    let mut pool = Pool::with_policy(sim(), cfg.pool().clone(), ReleasesInUse::default()).unwrap();
    let a = pool.allocate(30 * MIB, S0).unwrap();
    let b = pool.allocate(4096, S0).unwrap();
    assert_eq!(pool.policy().released, [false, false]);
    assert_eq!(pool.policy().pages, [0, 0]);
    assert_eq!(pool.stats().allocation.0[0].current, 2);
    pool.check_invariants().unwrap();
    pool.free(a).unwrap();
    pool.free(b).unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
}

#[test]
fn release_pages_refuses_a_block_in_use() {
    let cfg = Config::for_policy(cudalloc::Policy::TorchExpandable);
    let policy = ReleasesInUse {
        expandable: true,
        ..ReleasesInUse::default()
    };
    let mut pool = Pool::with_policy(sim(), cfg.pool().clone(), policy).unwrap();
    let a = pool.allocate(30 * MIB, S0).unwrap();
    let b = pool.allocate(4096, S0).unwrap();
    assert_eq!(pool.policy().pages, [0, 0]);
    assert_eq!(pool.releasing_bytes(), 0);
    pool.check_invariants().unwrap();
    pool.free(a).unwrap();
    pool.free(b).unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(pool.reserved(), 0);
}

/// A policy value built outside a `Config` is checked too: `Pool::with_policy` refuses the
/// `default` policy with a budget out of range, naming the key.
#[test]
fn a_pool_refuses_a_policy_value_with_a_bad_setting() {
    use cudalloc::policy::default::{DefaultConfig, DefaultPolicy};
    let cfg = Config::default();
    for budget in [f64::NAN, -0.5, 2.0] {
        let bad = DefaultPolicy::new(DefaultConfig {
            fragmentation_budget: budget,
            ..DefaultConfig::default()
        });
        match Pool::with_policy(sim(), cfg.pool().clone(), bad) {
            Err(e) => assert_eq!(e.key, "fragmentation_budget", "{budget}"),
            Ok(_) => panic!("budget {budget} accepted"),
        }
    }
    let good = DefaultPolicy::new(DefaultConfig::default());
    assert!(Pool::with_policy(sim(), cfg.pool().clone(), good).is_ok());
}
