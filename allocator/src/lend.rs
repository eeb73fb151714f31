//! Free blocks lent across streams (`lend_blocks:True`, the `default` policy's; off by default:
//! see [`Policy::lends_blocks`](crate::policy::Policy::lends_blocks) and `docs/threads.md` for
//! what it gave on replays and on a GPU).
//!
//! [`CachingAllocator`] keeps one pool per stream shard, and a block is reused by its own stream:
//! a program whose streams take turns (a side stream that loads batches, threads that each serve
//! on a stream of their own) would grow one stream's pool while another's cache holds a block
//! that fits. Before a request makes its pool grow, the front asks the other shards' pools
//! (each lock tried, none waited for; only shards that have allocated since the allocator was
//! made) for a free block of one of their streams, and takes the first one lent:
//!
//! - the lending pool picks, among its streams with a free block of at least the request's
//!   size, the first whose work has all completed: an event recorded on that stream now and
//!   reported completed at once (`Core::stream_idle`). Every earlier use of the block was
//!   queued on its stream before its free, so it is done; a stream with work still queued is
//!   skipped (counted in `lends_refused_busy`), never waited for;
//! - the block is allocated from the lending pool on its own stream, by that pool's rules
//!   (best fit and split, as for its stream), and used on the borrowing stream as by
//!   `record_stream`: its free waits for the borrowing stream's work before the block returns
//!   to its stream's cache, and skips the thread caches. The [`Allocation`] names the block's own
//!   stream (where its free goes); a free on either stream is the free of it
//!   (`Entry::made_for`);
//! - nothing is lent while a capture is underway (told, or the driver says the borrowing or
//!   the lending stream is captured), from a pool that sleeps or keeps its memory (graph
//!   pools), to or from the per-thread default stream (its handle names another stream on each
//!   thread), nor while a trace or memory history is recorded (`track_completions`: its
//!   `free_completed` events are kept per stream shard, and its replay with the device's
//!   answers, which lends nothing either, makes the same calls as the run).
//!
//! Invariants: a lent block is an allocation of its own pool, in its statistics
//! (`lent_blocks`), with the borrowing stream among its stream uses; the borrower's request
//! counts as one allocation, in the lender's pool; no shard lock is waited for while another is
//! held.

use crate::allocator::{shard_of, CachingAllocator};
use crate::error::AllocError;
use crate::ladder::Pool;
use crate::live::Entry;
use crate::policy::Policy;
use crate::pool::Allocation;
use crate::sync::{AtomicBool, AtomicU64, Ordering};
use cudalloc_sys::{Device, StreamId};

/// The front's part: whether its policy lends, and which shards have allocated (a bit each:
/// the only ones that may hold a block to lend).
#[derive(Default)]
pub(crate) struct Lending {
    on: bool,
    /// A trace is recorded (`CachingAllocator::track_completions`).
    paused: AtomicBool,
    used: AtomicU64,
}

impl Lending {
    /// For a front whose pools' policy lends (`on`).
    pub fn new(on: bool) -> Lending {
        Lending {
            on,
            paused: AtomicBool::new(false),
            used: AtomicU64::new(0),
        }
    }

    /// Lends nothing while `paused` (a trace is recorded), as if the policy did not lend.
    pub fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::Relaxed);
    }

    /// Shard `i` allocated (read first: one stream allocating writes nothing shared).
    pub fn note_used(&self, i: usize) {
        let bit = 1u64 << i;
        if self.on && self.used.load(Ordering::Relaxed) & bit == 0 {
            self.used.fetch_or(bit, Ordering::Relaxed);
        }
    }

    /// The shards other than `i` that may lend to it (none when the policy does not lend or
    /// lending is paused).
    fn others(&self, i: usize) -> u64 {
        if !self.on || self.paused.load(Ordering::Relaxed) {
            return 0;
        }
        self.used.load(Ordering::Relaxed) & !(1u64 << i)
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Before a request of `size` bytes on `stream` makes its pool grow: a cached block of its
    /// own pool, else one lent by another shard's (see the module docs). `None`: the pool must
    /// grow.
    pub(crate) fn lend_before_growth(
        &self,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<Allocation>, AllocError> {
        let i = shard_of(stream);
        if self.lending.others(i) == 0 {
            return Ok(None);
        }
        if let Some(a) = self.try_allocate_cached(size, stream)? {
            return Ok(Some(a));
        }
        let borrows = self.device.check_stream(stream).is_ok()
            && matches!(self.device.is_capturing(stream), Ok(false));
        Ok(borrows.then(|| self.borrow(size, stream, i)).flatten())
    }

    /// The first block another shard's pool lends to `stream` (shard `i`).
    fn borrow(&self, size: u64, stream: StreamId, i: usize) -> Option<Allocation> {
        let mut others = self.lending.others(i);
        while others != 0 {
            let j = others.trailing_zeros() as usize;
            others &= others - 1;
            let Some(mut pool) = self.shards[j].try_lock() else {
                continue;
            };
            let Some(a) = pool.lend(size, stream) else {
                continue;
            };
            let b = pool.block(a.0.block).expect("lent block");
            self.live.insert(Entry::lent(a.0, b.size, b.pool, stream));
            self.note_watched(a.0.stream, &pool);
            self.rules.note_allocation(j, 0);
            return Some(a);
        }
        None
    }
}

impl<D: Device> Pool<D> {
    /// A free block of at least `size` bytes of one of this pool's streams whose work has
    /// completed, allocated on that stream and used on `borrower` (see the module docs).
    pub(crate) fn lend(&mut self, size: u64, borrower: StreamId) -> Option<Allocation> {
        if !self.may_lend() {
            return None;
        }
        let req = self.request(size, borrower);
        let lenders: Vec<StreamId> = self
            .core
            .free_index(req.pool)
            .streams_with_at_least(req.size)
            .map(StreamId)
            .filter(|&s| s != borrower)
            .collect();
        for s in lenders {
            if self.core.device().check_stream(s).is_err() {
                continue;
            }
            if !self.core.stream_idle(s) {
                self.core.stats.lends_refused_busy += 1;
                continue;
            }
            let Ok(Some(a)) = self.allocate_cached(size, s) else {
                continue;
            };
            if self
                .core
                .record_stream(a.0.block, a.0.ptr, borrower)
                .is_err()
            {
                let _ = self.free(a); // cannot happen: a live block and a checked stream
                return None;
            }
            self.core.stats.lent_blocks += 1;
            return Some(a);
        }
        None
    }

    /// Whether this pool's policy lends blocks across streams.
    pub(crate) fn lends_blocks(&self) -> bool {
        self.policy.lends_blocks() && !self.keeps_memory
    }

    /// Whether this pool may lend now (see the module docs for each refusal; the borrowing
    /// stream is the front's to check).
    fn may_lend(&self) -> bool {
        self.lends_blocks() && !self.core.capturing() && !self.core.asleep()
    }
}
