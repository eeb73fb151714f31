//! Policies: the rules a pool follows, behind one [`Policy`] trait.
//!
//! The [`Core`] owns the mechanism (blocks, free indexes, segments and pages, split and merge,
//! device calls, statistics); a policy decides. [`Pool`](crate::Pool) runs PyTorch's allocation
//! ladder over the two and asks the policy at each step:
//!
//! | hook | asked | may |
//! | --- | --- | --- |
//! | [`place`](Policy::place) | for every request, after pending events were processed | take a free block out of the free index (best fit, or anywhere it likes), or map pages to make one; `None`: nothing cached fits (without `may_grow` it must not map) |
//! | [`should_split`](Policy::should_split) | for the block `place` or `grow` returned | only read |
//! | [`grow`](Policy::grow) | when `place` found nothing and the caller may grow; again after each release rung of the ladder | get device memory (a fixed segment, pages mapped into a range) and return a free block of at least the request, out of the free index; give cached memory back first; `Ok(None)`: out of memory |
//! | [`release`](Policy::release) | the ladder's second rung, after `grow` ran out of memory | give cached memory back so that a retry may fit; true when it did |
//! | [`release_pinned`](Policy::release_pinned) | the ladder's last resort, after every cached block went back and a retry still ran out of memory | give back the free pages of chunks live blocks keep mapped ([`Core::repage_pinned`]); true when it did (a last retry follows) |
//! | [`on_alloc`](Policy::on_alloc) | after the block is handed out (allocated, split, counted) | read the core; mark the block ([`Core::set_mark`]) |
//! | [`on_marked_free`](Policy::on_marked_free) | when a marked block returns to its pool, before it merges (the core has cleared the mark) | only read |
//! | [`on_segment_released`](Policy::on_segment_released) | when an expandable range goes back to the device (its index may be reused); for a range the policy released itself during `grow` ([`Core::release_empty_range`]), once `grow` returned | forget what it kept about the range |
//! | [`watches_large_blocks`](Policy::watches_large_blocks) | by the thread-safe front, after each operation on the pool | say that every large free must reach the pool (no thread cache) |
//!
//! What the core keeps whatever a policy does (its invariants, [`Core::check_invariants`]): blocks
//! tile their segments; no two free mapped neighbours; a block is indexed iff it is free or
//! unmapped; statistics equal what the blocks recompute; reserved bytes equal what the device
//! holds; the memory limit is never passed through `Core::claim`. A hook works through the
//! core's operations (take a block out of the index, map and unmap, reserve and release ranges,
//! allocate segments), never by editing blocks' links or sizes itself. The core checks what it
//! hands out: a block `place` or `grow` returns must be free, mapped, waiting for no stream,
//! out of the free index, of the request's pool and stream and at least its size, else the
//! allocation fails with [`AllocError::PolicyBroke`](crate::AllocError::PolicyBroke) and
//! nothing is handed out; [`Core::release_block`] releases only a whole free fixed segment in
//! the index (otherwise it does nothing and says so). An adaptor that wraps another policy
//! forwards every hook, the defaulted ones included (`tests/policies/policy_outside.rs`). Rounding, the pools' size classes, the ladder's
//! garbage collection and its last rung (release everything, retry) are PyTorch's and shared;
//! the last resort after it (`release_pinned`) is a policy's.
//!
//! The three built-in policies are modules that read like their sources: [`torch`] and
//! `torch_expandable` follow PyTorch's `CUDACachingAllocator`; [`default`] is cudalloc's own
//! (its own module tree and state). [`Builtin`] picks one of them from a config, with static
//! dispatch (a `match` per hook). A policy written in another crate implements [`Policy`] and
//! runs in a [`Pool`](crate::Pool) through [`Pool::with_policy`](crate::Pool::with_policy);
//! [`crate::CachingAllocator`] runs the built-in ones only. `front` holds the rules the
//! thread-safe front asks about its thread caches (which blocks skip them, when cached blocks go
//! back before a pool grows).

pub mod default;
pub(crate) mod front;
pub mod torch;
mod torch_expandable;
#[cfg(test)]
mod torch_tests;

use crate::pool::Observer;
use cudalloc_sys::{Device, DeviceError};
// What a policy works with: the core, the request, the blocks and the free index.
pub use crate::pool::block::{Block, BlockId, NO_MARK};
pub use crate::pool::index::FreeIndex;
pub use crate::pool::{Core, Request};
pub use default::{DefaultConfig, DefaultPolicy};
pub use torch::Torch;
pub use torch_expandable::TorchExpandable;

/// The rules of a pool; see the module docs for what each hook may do.
pub trait Policy {
    /// A cached block for `req`, taken out of the free index; `None` when nothing cached fits.
    /// Without `may_grow`, maps no page.
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError>;

    /// Whether block `id`, about to serve a request of rounded size `size`, gives back its rest.
    fn should_split<D: Device>(&self, core: &Core<D>, id: BlockId, size: u64) -> bool;

    /// New device memory for `req`: a free block of at least `req.size` bytes, out of the free
    /// index; `Ok(None)` is out of memory.
    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError>;

    /// Cached memory given back so that `req` may fit when `grow` is tried again; true when any
    /// was. PyTorch's `release_available_cached_blocks` unless a policy says otherwise.
    fn release<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<bool, DeviceError> {
        torch::release_available_cached_blocks(core, req)
    }

    /// The ladder's last resort, after every cached block went back and `grow` still ran out
    /// of memory: give back what chunks kept mapped by live blocks hold free
    /// ([`Core::repage_pinned`], which waits for the device and moves live bytes); true when
    /// any was, and `grow` is tried once more. Nothing unless a policy says otherwise.
    fn release_pinned<D: Device>(
        &mut self,
        _core: &mut Core<D>,
        _req: &Request,
    ) -> Result<bool, DeviceError> {
        Ok(false)
    }

    /// True when [`Policy::release_pinned`] may give something back under a memory limit (a
    /// front then tries a growth past the limit once more after it). False unless a policy
    /// says otherwise.
    fn has_last_resort(&self) -> bool {
        false
    }

    /// True when a front with one pool per stream may give back, without waiting, the cached
    /// memory of a pool whose stream stopped allocating while other pools grew by at least as
    /// much (`Core::give_back_idle`): memory a finished stream keeps serves no other stream.
    /// False unless a policy says otherwise (PyTorch's rules keep a stream's cache until
    /// `empty_cache`).
    fn gives_back_idle(&self) -> bool {
        false
    }

    /// True when a front with one pool per stream may lend a free block of this pool's streams
    /// to another stream's request that would otherwise grow its own pool (`crate::lend`).
    /// False unless a policy says otherwise (PyTorch's rules reuse a block only on its stream).
    fn lends_blocks(&self) -> bool {
        false
    }

    /// Block `id` was just handed out.
    fn on_alloc<D: Device>(&mut self, _core: &mut Core<D>, _id: BlockId) {}

    /// Block `id`, which carried `mark`, returns to its pool.
    fn on_marked_free<D: Device>(&mut self, _core: &Core<D>, _id: BlockId, _mark: u64) {}

    /// Expandable range `segment` went back to the device.
    fn on_segment_released(&mut self, _segment: u32) {}

    /// True while every large block freed should reach the pool rather than a thread cache.
    fn watches_large_blocks(&self) -> bool {
        false
    }

    /// Checks the policy's own settings before a pool runs it ([`crate::Pool::with_policy`]);
    /// an error names the setting and its value. A policy without settings accepts.
    fn validate(&self) -> Result<(), crate::ConfigError> {
        Ok(())
    }
}

/// A built-in policy with its own settings: the rule set of a [`Config`](crate::Config)
/// (`policy` key; [`PolicyConfig::policy`] names it). The PyTorch policies have no settings of
/// their own: the ones they read are every policy's ([`PoolConfig`](crate::config::PoolConfig)).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum PolicyConfig {
    /// [`torch`].
    Torch,
    /// `torch-expandable`.
    TorchExpandable,
    /// [`default`], with its settings.
    Default(DefaultConfig),
}

/// Every policy hears what the core tells it through its hooks.
impl<P: Policy> Observer for P {
    fn marked_free<D: Device>(&mut self, core: &Core<D>, id: BlockId, mark: u64) {
        self.on_marked_free(core, id, mark);
    }

    fn segment_released(&mut self, segment: u32) {
        self.on_segment_released(segment);
    }
}

/// The built-in policy a config names.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per pool, and a box would cost an indirection per hook
#[non_exhaustive]
pub enum Builtin {
    /// [`torch`].
    Torch(Torch),
    /// `torch_expandable`.
    TorchExpandable(TorchExpandable),
    /// [`default`].
    Default(DefaultPolicy),
}

impl Builtin {
    /// The policy `cfg` names, with its settings.
    pub fn new(cfg: &PolicyConfig) -> Builtin {
        match cfg {
            PolicyConfig::Torch => Builtin::Torch(Torch),
            PolicyConfig::TorchExpandable => Builtin::TorchExpandable(TorchExpandable),
            PolicyConfig::Default(d) => Builtin::Default(DefaultPolicy::new(*d)),
        }
    }

    /// The `default` policy's state, when it is the one.
    pub fn as_default(&self) -> Option<&DefaultPolicy> {
        match self {
            Builtin::Default(p) => Some(p),
            _ => None,
        }
    }

    /// True while a layout plan places large blocks (`default` only; see `default::plan`).
    pub fn has_plan(&self) -> bool {
        self.as_default().is_some_and(DefaultPolicy::has_plan)
    }

    /// Allocations placed by a layout plan so far (`default` only).
    pub fn planned_allocations(&self) -> u64 {
        self.as_default()
            .map_or(0, DefaultPolicy::planned_allocations)
    }

    /// Episodes evaluated for a layout plan so far (`default` only).
    pub fn evaluated_episodes(&self) -> u64 {
        self.as_default()
            .map_or(0, DefaultPolicy::evaluated_episodes)
    }
}

/// Runs `$body` with `$p` bound to the policy inside a [`Builtin`].
macro_rules! each {
    ($self:expr, $p:ident => $body:expr) => {
        match $self {
            Builtin::Torch($p) => $body,
            Builtin::TorchExpandable($p) => $body,
            Builtin::Default($p) => $body,
        }
    };
}

impl Policy for Builtin {
    #[inline]
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        each!(self, p => p.place(core, req, may_grow))
    }

    #[inline]
    fn should_split<D: Device>(&self, core: &Core<D>, id: BlockId, size: u64) -> bool {
        each!(self, p => p.should_split(core, id, size))
    }

    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        each!(self, p => p.grow(core, req))
    }

    fn release<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<bool, DeviceError> {
        each!(self, p => p.release(core, req))
    }

    fn release_pinned<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<bool, DeviceError> {
        each!(self, p => p.release_pinned(core, req))
    }

    fn has_last_resort(&self) -> bool {
        each!(self, p => p.has_last_resort())
    }

    fn gives_back_idle(&self) -> bool {
        each!(self, p => p.gives_back_idle())
    }

    fn lends_blocks(&self) -> bool {
        each!(self, p => p.lends_blocks())
    }

    #[inline]
    fn on_alloc<D: Device>(&mut self, core: &mut Core<D>, id: BlockId) {
        each!(self, p => p.on_alloc(core, id))
    }

    fn on_marked_free<D: Device>(&mut self, core: &Core<D>, id: BlockId, mark: u64) {
        each!(self, p => p.on_marked_free(core, id, mark))
    }

    fn on_segment_released(&mut self, segment: u32) {
        each!(self, p => p.on_segment_released(segment))
    }

    fn watches_large_blocks(&self) -> bool {
        each!(self, p => p.watches_large_blocks())
    }

    fn validate(&self) -> Result<(), crate::ConfigError> {
        each!(self, p => Policy::validate(p))
    }
}
