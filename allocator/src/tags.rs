//! Tags: allocations a caller names ("weights", "kv"), each tag's kept in a [`Pool`] of its own,
//! so that a tag can sleep (its pages go back to the device, its addresses stay reserved) and
//! wake (new pages at the same addresses, its bytes restored when it was offloaded) while the
//! other tags and untagged allocations keep working ([`CachingAllocator::sleep`],
//! [`CachingAllocator::wake`], `pool::sleep`).
//!
//! A tag's pool follows the allocator's policy and settings, shares its memory limit, reserved
//! counter and peak, and skips the thread caches (tagged allocations are few and large); out of
//! memory, a tagged request and an untagged one release the same memory elsewhere before their
//! second try, the last resort of every shard and tag pool included. Its
//! number (its place in the list, from 1) is in its handles ([`crate::pool::Handle::tag`]), so a
//! free or a `record_stream` finds it without a search; untagged handles carry 0 and take the
//! stream shards as before.
//!
//! Invariants: a tag's name appears once, its pool's `Core::tag` is its number (a handle whose
//! number names no tag here, another allocator's, is no allocation of this one), a new tag's pool
//! gets the limit, peers, map hooks and captures the others have, and the tags' lock is never held while a
//! stream shard's is taken (the tags' lock comes after every shard's in the views that take
//! them all, and nothing takes a shard under it).

use crate::allocator::CachingAllocator;
use crate::config::Policy;
use crate::error::AllocError;
use crate::hooks::MapHooks;
use crate::ladder::Pool;
use crate::live::Entry;
use crate::pool::{Allocation, Handle};
use crate::sync::{Arc, Mutex, MutexGuard};
use cudalloc_sys::{CaptureMode, Device, StreamId};

/// One tag's pool.
pub(crate) struct TagPool<D: Device> {
    pub name: String,
    pub pool: Pool<Arc<D>>,
    /// Allocations freed while the tag slept: their frees run when it wakes.
    pub deferred: Vec<Entry>,
}

/// Frees the allocations freed while `t` slept (it is awake). One whose free fails (a device
/// error recording its other streams' events) stays deferred, for the tag's next free or wake:
/// its caller was told the free was taken.
fn free_deferred<D: Device>(t: &mut TagPool<D>) {
    let mut kept = Vec::new();
    for e in std::mem::take(&mut t.deferred) {
        if t.pool.free_handle(&e.alloc).is_err() {
            kept.push(e);
        }
    }
    t.deferred = kept;
}

/// Every tag's pool, in the order the tags were first used, and what a new one must inherit:
/// the limit and peers set on the allocator, the captures underway (kept here, so that making a
/// pool takes no shard lock).
pub(crate) struct TagSet<D: Device> {
    pub pools: Vec<TagPool<D>>,
    /// The limit last set on the allocator (`None`: never set, the config's stands).
    limit: Option<Option<u64>>,
    peers: Vec<usize>,
    captures: Vec<CaptureMode>,
    /// The map hooks set on the allocator.
    pub(crate) hooks: Option<Arc<dyn MapHooks>>,
}

/// The tags behind their one lock.
pub(crate) struct Tags<D: Device>(Mutex<TagSet<D>>);

impl<D: Device> Default for Tags<D> {
    fn default() -> Self {
        Tags(Mutex::new(TagSet {
            pools: Vec::new(),
            limit: None,
            peers: Vec::new(),
            captures: Vec::new(),
            hooks: None,
        }))
    }
}

impl<D: Device> Tags<D> {
    /// Locks every tag's pool.
    pub(crate) fn lock(&self) -> MutexGuard<'_, TagSet<D>> {
        self.0.lock()
    }
}

/// What one tag holds ([`CachingAllocator::tag_stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TagStats {
    /// The tag.
    pub tag: String,
    /// Live allocations.
    pub allocations: u64,
    /// Bytes of the live allocations' blocks (rounded).
    pub allocated_bytes: u64,
    /// Bytes the callers asked for, over the live allocations.
    pub requested_bytes: u64,
    /// Bytes the tag's pool holds from the device now (0 while it sleeps).
    pub reserved_bytes: u64,
    /// True while the tag sleeps.
    pub asleep: bool,
    /// Bytes of the pages its sleep gave back (0 while awake).
    pub slept_bytes: u64,
    /// Bytes of its allocations kept in pinned host memory while it sleeps (0 unless
    /// offloaded).
    pub offloaded_bytes: u64,
    /// Bytes of the pinned host buffer its offloading sleeps copy into, kept while awake too
    /// for the next sleep ([`CachingAllocator::release_host_buffers`] frees it).
    pub host_buffer_bytes: u64,
    /// Bytes of its pages still mapped while it sleeps after an incomplete sleep
    /// ([`AllocError::SleepIncomplete`]; 0 otherwise).
    pub mapped_while_asleep: u64,
}

/// Puts the tag's name into an [`AllocError::Asleep`] or [`AllocError::SleepIncomplete`] from
/// its pool.
fn named(e: AllocError, name: &str) -> AllocError {
    match e {
        AllocError::Asleep { what, tag: None } => AllocError::Asleep {
            what,
            tag: Some(name.to_string()),
        },
        AllocError::SleepIncomplete {
            tag: None,
            mapped,
            source,
        } => AllocError::SleepIncomplete {
            tag: Some(name.to_string()),
            mapped,
            source,
        },
        other => other,
    }
}

impl<D: Device> CachingAllocator<D> {
    /// The number of tag `name` (its place from 1), its pool made on first use with the
    /// allocator's settings, limit, peers and captures.
    fn tag_number(&self, set: &mut TagSet<D>, name: &str) -> usize {
        if let Some(i) = set.pools.iter().position(|t| t.name == name) {
            return i + 1;
        }
        let mut pool = Pool::new(self.device.clone(), self.cfg.clone());
        pool.share_reserved(self.reserved.clone());
        pool.share_group(&self.group);
        pool.share_reserved_peak(self.reserved_peak.clone());
        pool.share_unfreed(self.unfreed.clone());
        if let Some(limit) = set.limit {
            pool.set_limit(limit);
        }
        pool.core.peers = set.peers.clone(); // nothing mapped yet: no access to grant
        pool.keeps_memory = self.keeps_memory;
        pool.core.set_hooks(set.hooks.clone());
        for &mode in &set.captures {
            pool.begin_capture(mode);
        }
        pool.core.tag = (set.pools.len() + 1) as u32;
        let name = name.to_string();
        set.pools.push(TagPool {
            name,
            pool,
            deferred: Vec::new(),
        });
        set.pools.len()
    }

    /// Allocates `size` bytes for use on `stream`, tagged `tag`: it comes from the tag's pool,
    /// whose pages hold no other tag's or untagged memory, and sleeps and wakes with the tag.
    /// A sleeping tag refuses it ([`AllocError::Asleep`]). Out of memory, what an untagged
    /// request would release goes back (the caches of the shards and the other tags, and
    /// under a limit the last resort of every pool) and it is tried once more. Freed like any
    /// allocation.
    pub fn allocate_tagged(
        &self,
        size: u64,
        stream: StreamId,
        tag: &str,
    ) -> Result<Allocation, AllocError> {
        match self.try_allocate_tagged(size, stream, tag, false) {
            Err(e) if e.is_out_of_memory() => {
                // As an untagged request: the stream shards' pinned chunks count against the
                // same limit ([`CachingAllocator::release_for_retry`]).
                if !self.release_for_retry(&e, usize::MAX, size, stream)? {
                    return Err(e);
                }
                self.try_allocate_tagged(size, stream, tag, true)
            }
            other => other,
        }
    }

    fn try_allocate_tagged(
        &self,
        size: u64,
        stream: StreamId,
        tag: &str,
        again: bool,
    ) -> Result<Allocation, AllocError> {
        let mut set = self.tags.lock();
        let n = self.tag_number(&mut set, tag);
        let pool = &mut set.pools[n - 1].pool;
        let a = if again {
            pool.allocate_again(size, stream)
        } else {
            pool.allocate(size, stream)
        };
        let a = a.map_err(|e| named(e, tag))?;
        let b = pool.block(a.0.block).expect("allocated block");
        self.live.insert(Entry::live(a.0, b.size, b.pool));
        Ok(a)
    }

    /// Frees a tagged allocation (the free of a handle whose `tag` is not 0). While its tag
    /// sleeps the allocation is no longer the caller's at once, and its block is freed when
    /// the tag wakes (a deleter that frees a sleeping model's tensors loses nothing).
    pub(crate) fn free_tagged(&self, a: &Handle) -> Result<(), AllocError> {
        let mut set = self.tags.lock();
        // Another allocator's handle may carry a number no tag of this one has.
        let Some(t) = set.pools.get_mut(a.tag as usize - 1) else {
            return Err(AllocError::NotAllocated(a.ptr));
        };
        let e = self.live.take_live(a)?;
        if t.pool.asleep() {
            t.deferred.push(e);
            return Ok(());
        }
        free_deferred(t);
        if let Err(err) = t.pool.free_handle(&e.alloc) {
            self.live.insert(e);
            return Err(named(err, &t.name));
        }
        Ok(())
    }

    /// `record_stream` of a tagged allocation.
    pub(crate) fn record_tagged(&self, a: &Handle, stream: StreamId) -> Result<(), AllocError> {
        let mut set = self.tags.lock();
        let t = &mut set.pools[a.tag as usize - 1];
        if t.pool.asleep() {
            return Err(named(
                AllocError::Asleep {
                    what: "record_stream",
                    tag: None,
                },
                &t.name,
            ));
        }
        t.pool.record_block_stream(a.block, a.ptr, stream)
    }

    /// Puts `tags` to sleep, in order: each gives every page back to the device while its
    /// addresses stay reserved; the live allocations of those also in `offload` are first
    /// copied to the tag's pinned host buffer (on a stream of the allocator's own, after the
    /// work of every stream that used the tag's memory, waited for through events, not a
    /// device-wide wait), the others come back uninitialised. Other tags and untagged
    /// allocations keep working. Every stream the tag's blocks belong to (free ones included)
    /// must still exist. A tag never used sleeps empty; a sleeping tag stays as it is (but for
    /// pages a first sleep could not unmap, which it tries again). Refused during a capture
    /// ([`AllocError::DuringCapture`]) and under the `torch` policy
    /// ([`AllocError::SleepUnsupported`]). An error stops at the tag that failed: the tags
    /// before it sleep, those after it do not; the failed tag is awake and unchanged, except
    /// after [`AllocError::SleepIncomplete`] (some pages were unmapped, but not all), where it
    /// sleeps with the others still mapped.
    pub fn sleep(&self, tags: &[&str], offload: &[&str]) -> Result<(), AllocError> {
        if self.cfg.policy() == Policy::Torch {
            return Err(AllocError::SleepUnsupported);
        }
        let mut set = self.tags.lock();
        for tag in tags {
            let n = self.tag_number(&mut set, tag);
            let t = &mut set.pools[n - 1];
            t.pool
                .sleep(offload.contains(tag))
                .map_err(|e| named(e, &t.name))?;
        }
        Ok(())
    }

    /// Frees the pinned host buffers that offloading sleeps copy into, kept by every awake tag
    /// for its next sleep (a sleeping tag keeps its own: it holds the tag's bytes). Each is
    /// freed once the copies into or out of it completed. The first error is returned; the
    /// other tags' buffers are freed all the same.
    pub fn release_host_buffers(&self) -> Result<(), AllocError> {
        let mut first = Ok(());
        for t in self.tags.lock().pools.iter_mut() {
            let r = t.pool.release_host_buffer();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Wakes `tags`, in order: new pages at the same addresses, the offloaded bytes copied back,
    /// and work submitted after the call to `stream`, or to a stream that used the tag's memory,
    /// ordered after the copies (the host does not wait for them: synchronize `stream` before
    /// reading the bytes from the host). The tag keeps its host buffer for its next sleep. A tag
    /// that cannot get its memory tries once more as an allocation's second try does (every
    /// cached block of the allocator back to the device and, under a limit, every pool's last
    /// resort; nothing in a graph pool: it keeps its memory); then it fails with
    /// [`AllocError::OutOfMemory`] and stays asleep and intact (the tags before it are awake);
    /// waking it again once memory was freed succeeds. An awake or unknown tag is left as it is.
    /// Every stream that used the tag's memory must still exist at the wake (it is made to wait
    /// for the copies). Allocations freed while the tag slept are freed now.
    pub fn wake(&self, tags: &[&str], stream: StreamId) -> Result<(), AllocError> {
        for tag in tags {
            match self.wake_one(tag, stream) {
                Err(e) if e.is_out_of_memory() => {
                    let requested = match e {
                        AllocError::OutOfMemory { requested, .. } => requested,
                        _ => 0,
                    };
                    if !self.release_for_retry(&e, usize::MAX, requested, stream)? {
                        return Err(e);
                    }
                    self.wake_one(tag, stream)?;
                }
                other => other?,
            }
        }
        Ok(())
    }

    fn wake_one(&self, tag: &str, stream: StreamId) -> Result<(), AllocError> {
        let mut set = self.tags.lock();
        let Some(t) = set.pools.iter_mut().find(|t| t.name == tag) else {
            return Ok(());
        };
        t.pool.wake(stream)?;
        // The frees made while it slept (stream order: after the wake's copies, on the
        // allocations' own streams, as any free).
        free_deferred(t);
        Ok(())
    }

    /// True while `tag` sleeps.
    pub fn is_asleep(&self, tag: &str) -> bool {
        let set = self.tags.lock();
        set.pools.iter().any(|t| t.name == tag && t.pool.asleep())
    }

    /// What each tag holds, in the order the tags were first used.
    pub fn tag_stats(&self) -> Vec<TagStats> {
        let set = self.tags.lock();
        set.pools
            .iter()
            .map(|t| {
                let s = t.pool.stats();
                TagStats {
                    tag: t.name.clone(),
                    allocations: s.allocation.0[0].current as u64,
                    allocated_bytes: s.allocated_bytes.0[0].current as u64,
                    requested_bytes: s.requested_bytes.0[0].current as u64,
                    reserved_bytes: t.pool.reserved(),
                    asleep: t.pool.asleep(),
                    slept_bytes: t.pool.slept_bytes(),
                    offloaded_bytes: t.pool.offloaded_bytes(),
                    host_buffer_bytes: t.pool.host_buffer_bytes(),
                    mapped_while_asleep: t.pool.mapped_while_asleep(),
                }
            })
            .collect()
    }

    /// Releases every awake tag's cached blocks (the out-of-memory ladder, `empty_cache`).
    pub(crate) fn release_tags_cached(&self) -> Result<(), AllocError> {
        let mut first = Ok(());
        for t in self.tags.lock().pools.iter_mut() {
            let r = t.pool.release_all_cached();
            if first.is_ok() {
                first = r;
            }
        }
        first.map_err(AllocError::from)
    }

    /// Tells every tag's pool of a capture beginning (`true`) or ending in `mode`.
    pub(crate) fn tags_capture(&self, mode: CaptureMode, begin: bool) -> Result<(), AllocError> {
        let mut first = Ok(());
        let mut set = self.tags.lock();
        if begin {
            set.captures.push(mode);
        } else if let Some(i) = set.captures.iter().position(|&m| m == mode) {
            set.captures.remove(i);
        }
        for t in set.pools.iter_mut() {
            if begin {
                t.pool.begin_capture(mode);
            } else {
                let r = t.pool.end_capture(mode);
                if first.is_ok() {
                    first = r;
                }
            }
        }
        first
    }

    /// Sets every tag's pool's limit and peers as the shards'; the first failure to grant a
    /// peer access to pages mapped already is returned (`Core::set_peers`: that pool keeps its
    /// peers), every other pool set.
    pub(crate) fn tags_settings(
        &self,
        limit: Option<Option<u64>>,
        peers: Option<&[usize]>,
    ) -> Result<(), AllocError> {
        let mut set = self.tags.lock();
        if limit.is_some() {
            set.limit = limit;
        }
        if let Some(p) = peers {
            set.peers = p.to_vec();
        }
        let mut first = Ok(());
        for t in set.pools.iter_mut() {
            if let Some(l) = limit {
                t.pool.set_limit(l);
            }
            if let Some(p) = peers {
                let r = t.pool.set_peers(p.to_vec());
                if first.is_ok() {
                    first = r;
                }
            }
        }
        first
    }
}
