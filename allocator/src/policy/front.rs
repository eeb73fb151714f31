//! What the thread-safe front ([`crate::CachingAllocator`]) asks of the policies: the rules of
//! its thread caches that serve the pools' policies. The front measures (which shard's lock
//! threads find held, which pool watches its blocks) and acts (sends cached blocks back to
//! their pools); [`FrontRules`] decides.
//!
//! - **Watched pools.** While a pool's policy watches its large blocks
//!   ([`Policy::watches_large_blocks`](super::Policy::watches_large_blocks): `default` while a
//!   layout plan places them, or while the episode being recorded has two or more allocations
//!   live), its large blocks skip the thread caches: a block kept in a cache is a free and an
//!   allocation the pool never sees. Unless the shard is *crowded*: a score per shard gains
//!   [`CROWD_STEP`] each time a thread finds its lock held and loses 1 per look that finds it
//!   free (a pool allocation, a watched allocation or free; read and written without
//!   atomicity: a hint). From [`CROWDED`] on, its large blocks use the caches even while
//!   watched: threads sharing a stream at once give the pool no single sequence to learn from,
//!   and would queue behind its lock (16 threads looping over 16 MiB blocks on one stream:
//!   4-5 M pairs/s on the H200 without this rule). A thread that reads `stats()` or a snapshot
//!   holds every shard's lock a moment, and can raise the score of a one-thread program a
//!   little.
//! - **Other threads' large parts before a watched pool places.** Before a watched pool's
//!   large allocation, the blocks of its shard (all the streams the pool serves) that other
//!   threads' large parts hold go back to it (when some thread cache holds a large block and one
//!   took a large block of the shard since the last look: a flag per shard, set when one is
//!   cached, taken here). A block freed while the pool was not watched
//!   (between two episodes) and kept in the large part of a thread that allocates nothing more
//!   on that stream for a while (PyTorch's autograd thread at the end of a backward pass) is a
//!   free the pool has not seen: the episode it records, and the plan it follows, would treat
//!   those bytes as live (FSDP2's training made twice the driver calls without this rule;
//!   `docs/threads.md`). A thread alone never pays for it: its own large part goes back at its
//!   own miss already.
//! - **Cached memory before growth.** Before a pool grows, every thread's large part goes back
//!   to its pool, so that memory one thread freed serves another's request instead of new
//!   memory (a program that frees on one thread and allocates on another, as PyTorch's
//!   autograd does, would otherwise grow by whatever the first thread keeps cached); before a
//!   small-pool request makes its pool grow, the small blocks other threads hold cached on its
//!   stream go back too. A thread alone is never affected.
//! - **Idle streams.** Blocks are reused only by their own stream, so what a stream that stopped
//!   allocating keeps cached (the side stream of a finished input pipeline, the stream of an
//!   earlier repetition of a job) serves no one. After a pool grew, every other stream shard
//!   whose pool made no allocation while the pools together grew by at least the bytes it holds
//!   cached gives that cache back without waiting, if its policy does so
//!   ([`Policy::gives_back_idle`](super::Policy::gives_back_idle): `default`). Idleness is
//!   measured in bytes grown elsewhere, not in time or in looks, and a shard that allocates
//!   again after giving its cache back was not idle: the growth it must see next time is 16
//!   times larger (a strike; [`IDLE_STRIKES_MAX`] at most), so streams taking turns, which
//!   would otherwise give each other back in a chain (each regrowth making the next stream look
//!   idle), are each taken for idle at most a few times, in the warm-up where they all grow
//!   (`docs/threads.md` has the figures). A stream served by its thread cache loses only what
//!   its pool holds. A shard found not idle is looked at again once the growth since its last
//!   allocation has doubled or reached its threshold.
//!   Over the shared ceiling, a shard is idle sooner: when the shards together hold more than
//!   (1 + `fragmentation_budget`) times the most requested bytes they held together at any
//!   growth (the one-pool budget's bound, which no shard's own budget sees: each acts only on
//!   its own growth), a shard whose pool made no allocation during the last
//!   [`OVER_IDLE_GROWTHS`] growths of the pools (twice as many per strike) is idle too,
//!   whatever it holds. A finished side stream's cache then goes back while the next one
//!   grows, not once the next one has grown by as much as it holds; a stream whose pool
//!   allocates between the others' growths is never taken for idle this way (one served by its
//!   thread cache may be: its pool then gives back what it holds, such as the large blocks
//!   sent back to it before the growth). The sum and the ceiling are the shards' alone (tag
//!   pools, pages whose release failed and pages on their way back are left out), taken at
//!   growths only; a shard given back is looked at after every growth until it allocates, so
//!   that its pages on their way back are polled.
//!   Before the count, the shard's blocks whose stream events have completed return to it
//!   (`record_stream`: the batches a side stream handed to the main stream), and its pages on
//!   their way back are polled; a shard another thread holds is left for the next look.
//!
//! Invariant: the thread-cache rules change only where blocks wait (a cache or a pool), never
//! the blocks handed out or the statistics the callers see; the idle rule changes only how
//! much memory is reserved.

use crate::sync::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, CachePadded, Ordering};

/// What a shard's crowding score gains each time a thread finds its lock held.
pub const CROWD_STEP: usize = 8;
/// The score from which a watched pool's large blocks use the thread caches again.
pub const CROWDED: usize = 8 * CROWD_STEP;
/// The score's ceiling: from it, a shard needs `CROWD_MAX - CROWDED + 1` looks at a free lock
/// after its threads stop meeting to be watched again. Only pool allocations (cache misses) and
/// watched operations look; while crowded, cache hits do not, so a loop that always hits its
/// cache keeps the shard crowded (its blocks then use the caches).
pub const CROWD_MAX: usize = 1024;

/// Over the shared ceiling, the growths of the pools during which a shard made no allocation
/// that make it idle (twice as many per strike). Measured (the `side_stream` acceptance
/// program's trace with its GPU's answers, an H100's, `cudalloc replay --answers`): 2, 4, 8,
/// 16 and 32 give peaks of 5.18, 5.16, 5.41, 5.92 and 6.62 GiB (without the rule 8.27 GiB; 3.27 GiB
/// live); from 4 down, four streams taking turns with changing shapes make more than 1.5x the
/// driver calls of an allocator each (`allocator/tests/front/idle.rs`).
pub const OVER_IDLE_GROWTHS: u64 = 8;

/// Most doublings of the growth an idle shard must see (its strikes: give-backs it allocated
/// again after).
pub const IDLE_STRIKES_MAX: u32 = 15;

/// The thread-cache rules of one allocator, with the per-shard state they read.
pub struct FrontRules {
    /// Per shard, as of its pool's last operation: the pool watches its large blocks.
    watched: Box<[AtomicBool]>,
    /// Per shard: the crowding score.
    crowd: Box<[CachePadded<AtomicUsize>]>,
    /// Bytes the pools together have grown by (each growth's increase of reserved bytes).
    grown: AtomicU64,
    /// Growths of the pools so far (each allocation that grew one).
    growths: AtomicU64,
    /// The most requested bytes the shards held together at a growth, as the front summed
    /// them ([`FrontRules::note_live`]).
    live_peak: AtomicU64,
    /// Per shard: the idle rule's state.
    idle: Box<[CachePadded<IdleClock>]>,
    /// Per shard: a thread cache may have taken one of its large blocks since the flag was
    /// last taken ([`FrontRules::take_large_cached`]).
    large_cached: Box<[CachePadded<AtomicBool>]>,
}

/// One shard's state for the idle rule.
#[derive(Default)]
struct IdleClock {
    /// `grown` at its pool's last allocation.
    mark: AtomicU64,
    /// `growths` at its pool's last allocation.
    mark_growths: AtomicU64,
    /// `grown` from which the next look at it is due (0: at the next growth).
    due: AtomicU64,
    /// Its cache was given back since its pool's last allocation.
    given: AtomicBool,
    /// How many times it allocated again after its cache was given back.
    strikes: AtomicU32,
}

impl FrontRules {
    /// The rules for an allocator of `shards` stream shards.
    pub fn new(shards: usize) -> FrontRules {
        FrontRules {
            watched: (0..shards).map(|_| AtomicBool::new(false)).collect(),
            crowd: (0..shards)
                .map(|_| CachePadded::new(AtomicUsize::new(0)))
                .collect(),
            grown: AtomicU64::new(0),
            growths: AtomicU64::new(0),
            live_peak: AtomicU64::new(0),
            idle: (0..shards).map(|_| CachePadded::default()).collect(),
            large_cached: (0..shards).map(|_| CachePadded::default()).collect(),
        }
    }

    /// Shard `i`'s pool made an allocation, growing the pools by `grew` bytes: the idle rule's
    /// clock starts again for it (a strike if its cache was given back since its last one).
    /// Written only when something changed: one thread allocating on its stream writes nothing
    /// shared between growths.
    pub fn note_allocation(&self, i: usize, grew: u64) {
        let (now, growths) = match grew {
            0 => (
                self.grown.load(Ordering::Relaxed),
                self.growths.load(Ordering::Relaxed),
            ),
            _ => (
                self.grown.fetch_add(grew, Ordering::Relaxed) + grew,
                self.growths.fetch_add(1, Ordering::Relaxed) + 1,
            ),
        };
        let c = &self.idle[i];
        if c.mark.load(Ordering::Relaxed) != now {
            c.mark.store(now, Ordering::Relaxed);
            c.mark_growths.store(growths, Ordering::Relaxed);
            c.due.store(0, Ordering::Relaxed);
        }
        if c.given.load(Ordering::Relaxed) && c.given.swap(false, Ordering::Relaxed) {
            let s = &c.strikes;
            s.store(
                (s.load(Ordering::Relaxed) + 1).min(IDLE_STRIKES_MAX),
                Ordering::Relaxed,
            );
        }
    }

    /// True when a look at shard `i` is due: the pools grew since its last allocation, and
    /// enough since the last look that found it not idle; or they hold `over` bytes above
    /// the shared ceiling and it is idle over it ([`FrontRules::idle_over_ceiling`]); or its
    /// cache was given back since its last allocation (the look polls its pages on their way
    /// back, which the shared ceiling leaves out).
    pub fn idle_look_due(&self, i: usize, over: u64) -> bool {
        let (c, now) = (&self.idle[i], self.grown.load(Ordering::Relaxed));
        let due = now != c.mark.load(Ordering::Relaxed) && now >= c.due.load(Ordering::Relaxed);
        due || self.idle_over_ceiling(i, over) || c.given.load(Ordering::Relaxed)
    }

    /// True when the shards hold `over` bytes (more than none) above the shared ceiling and
    /// shard `i`'s pool, which has allocated, made no allocation during the last
    /// [`OVER_IDLE_GROWTHS`] growths of the pools, twice as many per strike.
    /// (Read without shard `i`'s lock, `growths` may be older than its mark: then it is not.)
    fn idle_over_ceiling(&self, i: usize, over: u64) -> bool {
        let c = &self.idle[i];
        let mark = c.mark.load(Ordering::Relaxed);
        if over == 0 || mark == 0 {
            return false;
        }
        let strikes = c.strikes.load(Ordering::Relaxed).min(IDLE_STRIKES_MAX);
        let growths = self.growths.load(Ordering::Relaxed);
        let since = growths.saturating_sub(c.mark_growths.load(Ordering::Relaxed));
        since >= OVER_IDLE_GROWTHS << strikes
    }

    /// Notes that the shards hold `live` requested bytes together at a growth; the most they
    /// held at any.
    pub fn note_live(&self, live: u64) -> u64 {
        self.live_peak.fetch_max(live, Ordering::Relaxed).max(live)
    }

    /// The growth shard `i` holding `cached` bytes must see to be idle: `cached`, 16 times more
    /// per strike.
    fn idle_threshold(&self, i: usize, cached: u64) -> u64 {
        let strikes = self.idle[i].strikes.load(Ordering::Relaxed);
        cached.saturating_mul(1u64 << (4 * strikes.min(IDLE_STRIKES_MAX)))
    }

    /// True when shard `i`, holding `cached` bytes cached, is idle: its pool made no allocation
    /// while the pools together grew by at least [`FrontRules::idle_threshold`], or they hold
    /// `over` bytes above the shared ceiling and it is idle over it
    /// ([`FrontRules::idle_over_ceiling`]) (and it holds some). When not, the next look is due
    /// once the growth since its last allocation reaches that threshold or twice the present
    /// one, whichever is more, so a shard that stays below is looked at a logarithmic number
    /// of times (over the shared ceiling, at every growth once it has sat out enough growths,
    /// until it allocates or the shards are back under it).
    pub fn idle_after(&self, i: usize, cached: u64, over: u64) -> bool {
        let (c, now) = (&self.idle[i], self.grown.load(Ordering::Relaxed));
        let mark = c.mark.load(Ordering::Relaxed);
        let since = now.wrapping_sub(mark);
        let need = self.idle_threshold(i, cached);
        if cached > 0 && (since >= need || self.idle_over_ceiling(i, over)) {
            return true;
        }
        let next = mark.saturating_add(need.max(since.saturating_mul(2)).max(1));
        c.due.store(next, Ordering::Relaxed);
        false
    }

    /// Shard `i` started giving its cache back as idle.
    pub fn note_given_back(&self, i: usize) {
        self.idle[i].given.store(true, Ordering::Relaxed);
    }

    /// Records whether shard `i`'s pool watches its large blocks, after an operation on it.
    pub fn note_watched(&self, i: usize, watched: bool) {
        self.watched[i].store(watched, Ordering::Relaxed);
    }

    /// True when a block of `size` bytes of shard `i` skips the thread caches: a large block
    /// of a watched pool whose threads do not crowd it.
    pub fn bypasses_caches(&self, i: usize, size: u64) -> bool {
        size > crate::sizes::SMALL_SIZE
            && self.watched[i].load(Ordering::Relaxed)
            && self.crowd[i].load(Ordering::Relaxed) < CROWDED
    }

    /// Counts one look at shard `i`'s lock in its crowding score (no write while the score is
    /// zero and the lock was free: one thread alone never writes it).
    pub fn note_lock(&self, i: usize, held: bool) {
        let score = &self.crowd[i];
        let now = score.load(Ordering::Relaxed);
        if held {
            score.store((now + CROWD_STEP).min(CROWD_MAX), Ordering::Relaxed);
        } else if now > 0 {
            score.store(now - 1, Ordering::Relaxed);
        }
    }

    /// Shard `i`'s crowding score.
    #[cfg(test)]
    pub fn crowding(&self, i: usize) -> usize {
        self.crowd[i].load(Ordering::Relaxed)
    }

    /// True when every thread's large part goes back to its pool before a pool grows.
    pub fn large_parts_before_growth(&self) -> bool {
        true
    }

    /// Notes that a thread cache took a large block of shard `i` (one write per change: many
    /// threads caching on one stream read the flag, and write it only when it is clear).
    pub fn note_large_cached(&self, i: usize) {
        let f = &self.large_cached[i];
        if !f.load(Ordering::Relaxed) {
            f.store(true, Ordering::Relaxed);
        }
    }

    /// True, once, when a thread cache may have taken a large block of shard `i` since the
    /// last call: before a watched pool's large allocation, with other threads caching, the
    /// front then sends every thread's large-part blocks of that shard back to the pool.
    pub fn take_large_cached(&self, i: usize) -> bool {
        let f = &self.large_cached[i];
        f.load(Ordering::Relaxed) && f.swap(false, Ordering::Relaxed)
    }

    /// True when, before a small-pool request of `size` bytes makes its pool grow, the small
    /// blocks other threads hold cached on its stream go back first.
    pub fn small_parts_before_growth(&self, size: u64) -> bool {
        size <= crate::sizes::SMALL_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shard 0 grows `n` times (the other shards sit them out).
    fn grow(rules: &FrontRules, n: u64) {
        for _ in 0..n {
            rules.note_allocation(0, 1 << 20);
        }
    }

    #[test]
    fn over_the_ceiling_a_shard_is_idle_after_sitting_out_eight_growths_more_per_strike() {
        let rules = FrontRules::new(4);
        rules.note_allocation(1, 1 << 20);
        grow(&rules, OVER_IDLE_GROWTHS - 1);
        assert!(!rules.idle_after(1, 1 << 30, 1), "after 7 growths");
        grow(&rules, 1);
        assert!(
            rules.idle_after(1, 1 << 30, 1),
            "after 8 growths, over the ceiling"
        );
        assert!(
            !rules.idle_after(1, 1 << 30, 0),
            "under the ceiling: 1 GiB of growth needed"
        );
        assert!(
            !rules.idle_after(2, 0, 1),
            "a shard that never allocated holds nothing"
        );
        assert!(!rules.idle_look_due(2, 1), "nor is it looked at");
        // Given back, it stays due (its pages on their way back are polled) until it
        // allocates again: a strike, after which it must sit out twice as many growths.
        rules.note_given_back(1);
        assert!(rules.idle_look_due(1, 0));
        rules.note_allocation(1, 0);
        assert!(!rules.idle_look_due(1, 1));
        grow(&rules, 2 * OVER_IDLE_GROWTHS - 1);
        assert!(
            !rules.idle_after(1, 1 << 30, 1),
            "after 15 growths, one strike"
        );
        grow(&rules, 1);
        assert!(rules.idle_after(1, 1 << 30, 1), "after 16");
    }

    #[test]
    fn a_mark_newer_than_the_growths_read_is_not_idle() {
        let rules = FrontRules::new(2);
        rules.note_allocation(1, 1 << 20);
        // As if another thread's growth were counted after this look read `growths`.
        rules.idle[1].mark_growths.store(5, Ordering::Relaxed);
        assert!(!rules.idle_over_ceiling(1, 1));
    }
}
