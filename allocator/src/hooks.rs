//! Map hooks: callbacks told when device memory becomes usable by the allocator's blocks and
//! before it stops being so, so that an engine can register the memory with a library that
//! wants to know it in advance (NCCL's `ncclCommRegister`) once, keep it registered, and
//! deregister it before it goes back to the device.
//!
//! [`MapHooks::mapped`] is called after a chunk of pages is mapped into an expandable segment
//! and made accessible (or after a fixed segment is allocated by `cuMemAlloc`), before any block
//! in it is handed out; [`MapHooks::unmapping`] before that chunk is unmapped (or the segment
//! freed). Every path that maps or unmaps goes through them: growth, the release of free pages
//! (by a policy, the out-of-memory ladder or `empty_cache`), sleep and wake, graph pools and a
//! pool's teardown. The ranges are the chunks themselves: an `unmapping` names exactly a range
//! a `mapped` named, and a range is never announced twice without its withdrawal between.
//!
//! Invariants (the property test `tests/front/hooks.rs` checks them after every operation):
//! - every byte of every live allocation lies in a range announced and not withdrawn;
//! - the announced ranges are exactly the chunks and fixed segments the allocator's blocks
//!   live in, and the old addresses of moved pages until they are unmapped, every one mapped
//!   and accessible (a withdrawn range is not used again before it is announced again);
//! - a range is withdrawn while it is still mapped (before the unmap).
//!
//! When an unmap fails after its range was withdrawn, the range stays mapped and in use, so it
//! is announced again; a chunk left mapped but unusable by a failed call (`stuck`) is withdrawn
//! and stays so. Hooks run under the lock of the pool that maps or unmaps: they must not call
//! the allocator.
//!
//! Setting hooks ([`crate::CachingAllocator::set_map_hooks`]) announces to them every range
//! already mapped, and withdraws every one from the hooks they replace, so that a hook always
//! sees a range's announcement before its withdrawal.

use crate::allocator::CachingAllocator;
use crate::sync::Arc;
use cudalloc_sys::Device;

/// Callbacks on the allocator's device memory becoming usable and ceasing to be (see the module
/// documentation). Called with the device's ordinal, the first address and the bytes.
pub trait MapHooks: Send + Sync {
    /// `size` bytes at `addr` of device `device` are mapped and accessible; no block in them has
    /// been handed out yet.
    fn mapped(&self, device: usize, addr: u64, size: u64);
    /// `size` bytes at `addr` of device `device`, announced by [`MapHooks::mapped`], are about to
    /// be unmapped (or freed); nothing uses them any more.
    fn unmapping(&self, device: usize, addr: u64, size: u64);
}

/// A pool's hooks (none by default) and the ordinal they are told.
#[derive(Clone, Default)]
pub(crate) struct Hooks {
    hooks: Option<Arc<dyn MapHooks>>,
    device: usize,
}

impl Hooks {
    /// Hooks `hooks` for device `device`.
    pub(crate) fn new(hooks: Option<Arc<dyn MapHooks>>, device: usize) -> Hooks {
        Hooks { hooks, device }
    }

    /// Announces `addr..addr + size`.
    pub(crate) fn mapped(&self, addr: u64, size: u64) {
        if let Some(h) = &self.hooks {
            h.mapped(self.device, addr, size);
        }
    }

    /// Withdraws `addr..addr + size`.
    pub(crate) fn unmapping(&self, addr: u64, size: u64) {
        if let Some(h) = &self.hooks {
            h.unmapping(self.device, addr, size);
        }
    }
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("set", &self.hooks.is_some())
            .field("device", &self.device)
            .finish()
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Sets the map hooks of every pool of this allocator (its stream shards and its tags'
    /// pools; `None` removes them): the ranges already mapped are withdrawn from the hooks
    /// replaced and announced to the new ones before this returns. A graph pool made later starts
    /// with them; one made earlier keeps its own.
    pub fn set_map_hooks(&self, hooks: Option<Arc<dyn MapHooks>>) {
        for s in self.shards.iter() {
            s.lock().core.set_hooks(hooks.clone());
        }
        let mut set = self.tags.lock();
        set.hooks = hooks.clone();
        for t in set.pools.iter_mut() {
            t.pool.core.set_hooks(hooks.clone());
        }
    }

    /// The map hooks set, if any.
    pub fn map_hooks(&self) -> Option<Arc<dyn MapHooks>> {
        self.tags.lock().hooks.clone()
    }

    /// Every range announced to the map hooks and not withdrawn, by address: the chunks mapped
    /// into expandable segments, the addresses of moved pages not yet unmapped and the fixed
    /// segments, of every pool (a graph pool's are its own).
    pub fn mapped_ranges(&self) -> Vec<(u64, u64)> {
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for s in self.shards.iter() {
            ranges.extend(s.lock().core.mapped_ranges());
        }
        for t in self.tags.lock().pools.iter() {
            ranges.extend(t.pool.core.mapped_ranges());
        }
        ranges.sort_unstable();
        ranges
    }
}
