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

use crate::error::AllocError;
use crate::{Allocation, CachingAllocator};
use cudalloc_sys::{Device, StreamId};

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
