//! A second try of an allocation that ran out of memory, after the caller gave back memory held
//! outside this allocator (another allocator's or a private pool's cache on the same device,
//! under the same limit: the C library's graph pools and `MemPool`s).
//!
//! The second try is a whole allocation (thread caches, the stream's pool and, out of memory,
//! every other cache of the allocator given back and one more try: memory freed anywhere since
//! the first try is found), but its statistics are those of one allocation with the first: an
//! out-of-memory event it counts is not counted, and when it succeeds the first try's event is
//! taken back (PyTorch counts an allocation that failed, not each try). A second try that
//! fails for another reason (the tag went to sleep, a device error) leaves the first try's
//! event counted.
//!
//! Before any second try, the allocator's own memory held elsewhere goes back
//! ([`CachingAllocator::release_for_retry`]): the thread caches, the caches of the other stream
//! shards and tag pools, and under a limit every one of those pools' last resort (they all
//! count against the same limit). A graph pool's allocator gives nothing back.

use crate::error::AllocError;
use crate::policy::Policy as _;
use crate::{Allocation, CachingAllocator};
use cudalloc_sys::{Device, StreamId};
use std::sync::atomic::Ordering;

impl<D: Device> CachingAllocator<D> {
    /// Tries again an allocation that [`CachingAllocator::allocate`] refused for lack of
    /// memory (see the module docs).
    pub fn allocate_again(&self, size: u64, stream: StreamId) -> Result<Allocation, AllocError> {
        let before = self.shard(stream).core.stats.num_ooms;
        let r = self.allocate(size, stream);
        let ooms = &mut self.shard(stream).core.stats.num_ooms;
        *ooms = merged(*ooms, before, &r);
        r
    }

    /// Tries again an allocation that [`CachingAllocator::allocate_tagged`] refused for lack
    /// of memory (see the module docs).
    pub fn allocate_tagged_again(
        &self,
        size: u64,
        stream: StreamId,
        tag: &str,
    ) -> Result<Allocation, AllocError> {
        let before = self.tag_ooms(tag, |n| n);
        let r = self.allocate_tagged(size, stream, tag);
        self.tag_ooms(tag, |n| merged(n, before, &r));
        r
    }

    /// Sets the out-of-memory count of tag `tag`'s pool to `f` of it and returns the new count
    /// (0 and nothing set when the tag has no pool).
    fn tag_ooms(&self, tag: &str, f: impl FnOnce(u64) -> u64) -> u64 {
        let mut set = self.tags.lock();
        match set.pools.iter_mut().find(|t| t.name == tag) {
            Some(t) => {
                let n = &mut t.pool.core.stats.num_ooms;
                *n = f(*n);
                *n
            }
            None => 0,
        }
    }
}

/// A pool's out-of-memory count after a second try that found it at `before` and left it at
/// `after`: without the second try's own event, and without the first try's when it succeeded.
fn merged(after: u64, before: u64, r: &Result<Allocation, AllocError>) -> u64 {
    let own = after.saturating_sub(before).min(1);
    after.saturating_sub(own + u64::from(r.is_ok()))
}

impl<D: Device> CachingAllocator<D> {
    /// After the first try of a request of `size` bytes on `stream` ran out of memory (`e`) in
    /// shard `own` (`usize::MAX`: a tag's pool): gives back the memory held elsewhere, for a
    /// second try; true when anything was given back (nothing in a graph pool: it keeps its
    /// memory).
    ///
    /// A release that failed leaves its blocks cached (tried again at the next `empty_cache`
    /// or sweep); the request's own outcome is what is returned, an out-of-memory error when it
    /// still does not fit. Under a limit, for a policy with a last resort, the last resort of
    /// every shard and then of every tag's pool runs (all their pinned chunks count against
    /// the same limit), after the thread caches and the other pools gave their cached memory
    /// back; a shard's first try deferred it (`Pool::defer_last_resort`). A failure there may
    /// have lost live bytes: it is the error returned.
    pub(crate) fn release_for_retry(
        &self,
        e: &AllocError,
        own: usize,
        size: u64,
        stream: StreamId,
    ) -> Result<bool, AllocError> {
        if self.keeps_memory {
            return Ok(false);
        }
        let released = self.release_everything_else(own);
        if !matches!(e, AllocError::OutOfMemory { .. }) || !self.has_last_resort() {
            return Ok(released);
        }
        Ok(self.last_resort_everywhere(size, stream)? || released)
    }

    /// Runs the last resort ([`Pool::last_resort`]) of every shard, then of every tag's pool
    /// (each lock taken alone: the tags' after the shards'); true when one gave something
    /// back. Every pool runs it even after one failed; the first error is returned.
    fn last_resort_everywhere(&self, size: u64, stream: StreamId) -> Result<bool, AllocError> {
        let (mut gave, mut failed) = (false, None);
        let mut note = |r: Result<bool, AllocError>| match r {
            Ok(g) => gave |= g,
            Err(x) => {
                failed.get_or_insert(x);
            }
        };
        for s in self.shards.iter() {
            note(s.lock().last_resort(size, stream));
        }
        for t in self.tags.lock().pools.iter_mut() {
            note(t.pool.last_resort(size, stream));
        }
        failed.map_or(Ok(gave), Err)
    }

    /// True when this allocator has a memory limit and its policy a last resort under it
    /// ([`crate::policy::Policy::has_last_resort`]).
    fn has_last_resort(&self) -> bool {
        self.memory_limit().is_some() && self.shards[0].lock().policy().has_last_resort()
    }

    /// Flushes the thread caches and empties the caches of every shard but `except` and of every
    /// awake tag's pool; true when
    /// anything was released. A release that fails does not stop the others (what it could not
    /// release stays cached).
    pub(crate) fn release_everything_else(&self, except: usize) -> bool {
        if self.keeps_memory {
            return false;
        }
        let before = self.reserved.load(Ordering::Relaxed);
        let flushed = self.flush_thread_caches().unwrap_or(0);
        for (i, s) in self.shards.iter().enumerate() {
            if i != except {
                // One wait for all streams per out-of-memory ladder: `except`'s counted it.
                let _ = s.lock().release_all_cached();
            }
        }
        let _ = self.release_tags_cached();
        flushed > 0 || self.reserved.load(Ordering::Relaxed) < before
    }
}
