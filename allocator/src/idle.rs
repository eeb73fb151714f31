//! Idle stream shards give their cached memory back (the front rule "Idle streams" of
//! [`crate::policy::front`]).
//!
//! A block is reused only by the stream it was allocated on, so the cached memory of a stream
//! that no longer allocates (a side stream whose loader finished, a stream of an earlier
//! repetition of the job) serves no later request, and nothing in its own pool ever gives it
//! back: its budget acts only when it grows. After any shard grew, [`CachingAllocator`] looks
//! at every other shard: one whose pool made no allocation since the previous look starts
//! giving back its cached memory (`Pool::give_back_idle`: blocks whose stream events have
//! completed are freed first, nothing waits, pages go back once their stream's work is done).
//!
//! Invariants: no shard lock is waited for (a busy shard is skipped until the next look); a
//! shard that allocated since the last look keeps its cache; nothing happens while a capture
//! is underway (the pools refuse then), nor for a policy that keeps its caches.

use crate::allocator::CachingAllocator;
use crate::policy::Policy as _;
use cudalloc_sys::Device;

impl<D: Device> CachingAllocator<D> {
    /// After shard `grown` grew: every other shard idle since the last look gives back its
    /// cached memory without waiting (see the module docs). A failed device call leaves the
    /// rest cached, for the next look or `empty_cache`.
    pub(crate) fn sweep_idle(&self, grown: usize) {
        for (i, s) in self.shards.iter().enumerate() {
            if i == grown {
                continue;
            }
            let Some(mut pool) = s.try_lock() else {
                continue;
            };
            if !pool.policy().gives_back_idle() {
                return; // every shard has the same policy
            }
            if self.rules.idle_since_last_look(i, pool.allocations()) {
                let _ = pool.give_back_idle();
            }
        }
    }
}
