//! Idle stream shards give their cached memory back (the front rule "Idle streams" of
//! [`crate::policy::front`]).
//!
//! After a pool grew, [`CachingAllocator`] looks at every other shard whose look is due
//! ([`FrontRules::idle_look_due`](crate::policy::front::FrontRules::idle_look_due): the pools
//! grew since its last allocation, and by enough since the last look that found it not idle).
//! Its completed stream events are processed and its pages on their way back polled
//! (`Pool::idle_cached`, nothing waits); if the pools grew by at least the bytes it holds
//! cached since its last allocation (16 times more per strike: each time it allocated again
//! after such a give-back), it starts giving its free pages back (`Pool::give_back_idle`: they
//! go back once their stream's work before them has completed, at a later look or operation).
//! Cached bytes are the pool's reserved bytes less its allocated ones: free blocks, blocks
//! waiting for other streams' events (which become free), pages on their way back.
//! Before the looks, the shards' requested bytes are summed (every shard's lock tried, none
//! waited for: with one busy, the sum is skipped and the rule's shared ceiling with it) and
//! their reserved bytes (less those on their way back) summed and compared with the shared
//! ceiling, (1 + `fragmentation_budget`) times the most requested bytes they held together at
//! a growth (`over_shared_ceiling`): above it a
//! shard is idle sooner (the front rule's "over the shared ceiling"), until the give-backs of
//! the sweep have started back the bytes above it.
//!
//! Invariants: no shard lock is waited for (a busy shard is skipped until the next look); the
//! clock of a shard is noted while its lock is held, so a look never sees an allocation's shard
//! with its earlier clock; nothing is queried or given back while a capture is underway or the
//! pool sleeps (the pools refuse then), nor for a policy that keeps its caches (graph pools
//! never run `default`); a failed device call leaves the rest cached, for the next look or
//! `empty_cache`.

use crate::allocator::CachingAllocator;
use crate::policy::PolicyConfig;
use cudalloc_sys::Device;

impl<D: Device> CachingAllocator<D> {
    /// After shard `grown` grew (its clock already noted, its lock released): the idle rule's
    /// look at every other shard that is due one (see the module docs).
    pub(crate) fn sweep_idle(&self, grown: usize) {
        let mut over = self.over_shared_ceiling();
        for (i, s) in self.shards.iter().enumerate() {
            if i == grown || !self.rules.idle_look_due(i, over) {
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
            if !self.rules.idle_after(i, cached, over) {
                continue;
            }
            // A failed call may have started some pages back before it: that counts too.
            match pool.give_back_idle() {
                Ok(0) => {}
                gave => {
                    self.rules.note_given_back(i);
                    over = over.saturating_sub(gave.unwrap_or(0));
                }
            }
        }
    }

    /// The bytes the shards hold above the shared ceiling: (1 + the `default` policy's
    /// `fragmentation_budget`) times the most requested bytes they held together at a growth,
    /// this one's included. The shards' own bytes only (not the tag pools', nor pages whose
    /// release failed), pages on their way back left out (an earlier give-back covers them).
    /// 0 for another policy, or when a shard's lock is held (the sums would be short).
    fn over_shared_ceiling(&self) -> u64 {
        let PolicyConfig::Default(d) = self.cfg.policy_config() else {
            return 0;
        };
        let (mut live, mut reserved) = (0u64, 0u64);
        for s in self.shards.iter() {
            let Some(pool) = s.try_lock() else {
                return 0;
            };
            live += pool.requested_bytes();
            reserved += pool.reserved() - pool.releasing_bytes();
        }
        let peak = self.rules.note_live(live);
        let ceiling = (peak as f64 * (1.0 + d.fragmentation_budget)) as u64;
        reserved.saturating_sub(ceiling)
    }
}
