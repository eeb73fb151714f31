//! Private pools for CUDA graphs ([`CachingAllocator::graph_pool`]), PyTorch's graph pools in
//! the Rust API.
//!
//! A graph replays into the addresses its capture was given. If a block the capture freed went
//! back to the allocator that eager work uses, eager work between replays could take it, and
//! the next replay would overwrite it; if its pages were given back, the replay would write to
//! unmapped addresses. A graph pool is an allocator of its own over the same device: what is
//! allocated from it is only ever handed out by it, however it is freed, and it gives nothing
//! back while it lives: no budget (where the allocator it comes from runs the `default`
//! policy, it follows `torch-expandable`'s rules, but maps each growth as one chunk rather than
//! page by page, so a block that lives on keeps its whole growth mapped, as a live block of a
//! PyTorch private pool keeps its whole `cudaMalloc` segment) and, out of memory, no rung
//! of the ladder but growth (an allocation that does not fit fails, the blocks it holds free
//! stay; PyTorch's allocator, with its default settings, keeps a private pool in use whole
//! too). Only its `empty_cache` gives memory back: called once its graphs are gone, or, for a
//! `MemPool(use_on_oom=True)` of the C library that no capture allocated from, when an
//! allocation on the device (in that pool too) runs out of memory. Several graphs captured one
//! after another, and replayed one at a time, may share one pool; dropping the pool (after its
//! graphs) gives its memory back.
//!
//! Invariants: a graph pool's blocks and an allocator's blocks never overlap (they are two
//! allocators over one device); a graph pool's policy is never `default`; an allocator and its
//! graph pools count their reserved bytes into one group counter, which the limit caps.

use crate::allocator::CachingAllocator;
use crate::config::{Config, FrontConfig, PolicyConfig};
use cudalloc_sys::Device;

impl<D: Device> CachingAllocator<D> {
    /// A private pool for CUDA graphs over this allocator's device (see the module docs):
    /// allocate a graph's memory from it during its warm-up and capture, tell it of the capture
    /// ([`CachingAllocator::begin_capture`]) as you tell this one, and drop it after its graphs.
    /// Its configuration is this allocator's, with `torch-expandable`'s rules in place of
    /// `default`'s (each growth mapped as one chunk: [`Config::for_graph_pool`]) and no thread
    /// caches. Its memory counts against this allocator's memory
    /// limit ([`CachingAllocator::set_memory_limit`]), as PyTorch's memory fraction caps its
    /// private pools: the pool starts with this allocator's limit, and the two together hold at
    /// most that many bytes.
    /// It starts with this allocator's map hooks ([`CachingAllocator::set_map_hooks`]) and peer
    /// devices ([`CachingAllocator::set_peer_access`]); each has its own afterwards.
    pub fn graph_pool(&self) -> CachingAllocator<D> {
        let pool = CachingAllocator::on_shared_device(
            self.shared_device(),
            self.config().for_graph_pool(),
            self.group.clone(),
            true,
        );
        pool.set_memory_limit(self.memory_limit());
        // Nothing is mapped in the new pool yet, so no access is granted and nothing can fail.
        let _ = pool.set_peer_access(&self.peer_access());
        if let Some(hooks) = self.map_hooks() {
            pool.set_map_hooks(Some(hooks));
        }
        pool
    }
}

impl Config {
    /// The configuration of a graph pool made from an allocator configured with `self`: the
    /// same, with `torch-expandable`'s rules in place of `default`'s, each growth mapped in one
    /// chunk instead of its pages (`whole_growths`: the pool gives nothing back while it lives,
    /// so pages mapped one call each would buy nothing) and no thread caches (the C library's
    /// private pools use it too).
    pub fn for_graph_pool(&self) -> Config {
        let mut pool = self.pool().clone();
        let policy = match self.policy_config() {
            PolicyConfig::Default(_) => {
                pool.whole_growths = true;
                PolicyConfig::TorchExpandable
            }
            other => other.clone(),
        };
        let front = FrontConfig {
            thread_cache: Some(false),
            ..self.front().clone()
        };
        Config::new(policy, pool, front).expect("parts of a valid config")
    }
}
