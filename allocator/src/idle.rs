//! Idle stream shards give their cached memory back (the front rule "Idle streams" of
//! [`crate::policy::front`]).
//!
//! After a pool grew, [`CachingAllocator`] looks at every other shard whose pool has not
//! allocated since the pools last grew: its completed stream events are processed and its
//! pages on their way back polled (`Pool::idle_cached`, nothing waits), and if the pools grew
//! by at least the bytes it still holds cached since its last allocation (16 times more per
//! strike: each time it allocated again after such a give-back), it starts giving them back (`Pool::give_back_idle`: pages go back once their stream's work before them has
//! completed, at a later look or operation).
//!
//! Invariants: no shard lock is waited for (a busy shard is skipped until the next look); a
//! shard that allocated since the pools last grew is not looked at; nothing is queried or given
//! back while a capture is underway or the pool sleeps (the pools refuse then), nor for a
//! policy that keeps its caches; a failed device call leaves the rest cached, for the next look
//! or `empty_cache`.

use crate::allocator::CachingAllocator;
use cudalloc_sys::Device;

impl<D: Device> CachingAllocator<D> {
    /// After shard `grown` allocated, growing by `bytes`: the idle rule's clock, and when it
    /// grew, its look at every other shard (see the module docs).
    pub(crate) fn note_idle_clock(&self, grown: usize, bytes: u64) {
        if bytes == 0 {
            self.rules.note_allocation(grown);
            return;
        }
        self.rules.note_growth(bytes);
        self.rules.note_allocation(grown);
        for (i, s) in self.shards.iter().enumerate() {
            if i == grown || !self.rules.grown_since(i) {
                continue;
            }
            let Some(mut pool) = s.try_lock() else {
                continue;
            };
            let cached = match pool.idle_cached() {
                Ok(Some(c)) => c,
                Ok(None) => return, // every shard has the same policy
                Err(_) => continue,
            };
            if self.rules.idle_after(i, cached) && pool.give_back_idle().is_ok_and(|b| b > 0) {
                self.rules.note_given_back(i);
            }
        }
    }
}
