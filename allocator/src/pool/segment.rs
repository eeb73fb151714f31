//! Expandable segments: one reserved virtual range whose pages are mapped on demand.
//!
//! A segment owns `size` bytes of virtual addresses starting at `va` and a set of *chunks*: one
//! physical allocation each, created, mapped and made accessible in one map operation, and
//! unmapped and released in one unmap operation. Under `torch-expandable` every chunk is exactly
//! one page (2 MiB in the small pool, 20 MiB in the large, as PyTorch does); under `default` a
//! chunk is any multiple of the device's granularity, so that growing by many pages costs one map.
//!
//! Invariants: chunks do not overlap, lie inside `va..va + size` and start and end on page
//! boundaries; `mapped` is the sum of their sizes.

use crate::sizes::PoolKind;
use cudalloc_sys::{Device, DeviceError, PageHandle, StreamId};
use std::collections::BTreeMap;

/// One mapped physical allocation.
#[derive(Clone, Copy, Debug)]
pub struct Chunk {
    /// Bytes.
    pub size: u64,
    /// The physical allocation.
    pub handle: PageHandle,
}

/// A reserved virtual range with chunks mapped into it.
#[derive(Debug)]
pub struct ExpSegment {
    /// First virtual address.
    pub va: u64,
    /// Reserved bytes.
    pub size: u64,
    /// Page size: mapping and unmapping work in multiples of it.
    pub page: u64,
    /// The stream whose blocks live here.
    pub stream: StreamId,
    /// The pool whose blocks live here.
    pub pool: PoolKind,
    /// Chunks by start address.
    pub chunks: BTreeMap<u64, Chunk>,
    /// Sum of chunk sizes.
    pub mapped: u64,
    /// Pages unmapped whose release failed, to release again at the next unmap.
    pub leaked: Vec<PageHandle>,
}

/// What [`ExpSegment::unmap`] did, and the error that stopped it, if one did.
#[derive(Debug)]
pub struct Unmapped {
    /// The chunks unmapped, one range from the first.
    pub range: Range,
    /// The failed call that stopped the unmapping early.
    pub error: Option<DeviceError>,
}

/// What a map or unmap operation did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Range {
    /// First address.
    pub addr: u64,
    /// Bytes (0: nothing happened).
    pub size: u64,
    /// Map or unmap operations issued (chunks).
    pub ops: u64,
}

impl ExpSegment {
    /// Rounds `addr` down to a page boundary of this segment.
    pub fn page_floor(&self, addr: u64) -> u64 {
        self.va + (addr - self.va) / self.page * self.page
    }

    /// Rounds `addr` up to a page boundary of this segment.
    pub fn page_ceil(&self, addr: u64) -> u64 {
        self.va + (addr - self.va).div_ceil(self.page) * self.page
    }

    /// Maps the pages covering `addr..addr + size`, which must all be unmapped and start on a
    /// page boundary, as chunks of at most `max_chunk` bytes that never cross a multiple of
    /// `max_chunk` from the segment's start (so a chunk lies inside one aligned window, and a
    /// large free range holds whole chunks that can be unmapped). `max_chunk` is a multiple of
    /// the page size.
    /// Out of memory yields an empty [`Range`] with nothing left mapped; other errors are returned
    /// with nothing left mapped either, unless rolling back the chunks already mapped fails too
    /// (a release call failing): then that error is returned and the chunks it could not unmap
    /// stay listed here, mapped, while the pool does not count them (a known gap: the pool's
    /// reserved bytes are then below the device's mapped bytes).
    pub fn map<D: Device>(
        &mut self,
        dev: &D,
        addr: u64,
        size: u64,
        max_chunk: u64,
        peers: &[usize],
    ) -> Result<Range, DeviceError> {
        let begin = self.page_floor(addr);
        let end = self.page_ceil(addr + size).min(self.va + self.size);
        debug_assert_eq!(begin, addr, "map must start on a page boundary");
        let window = max_chunk.max(self.page);
        let mut at = begin;
        let mut ops = 0;
        while at < end {
            let boundary = self.va + ((at - self.va) / window + 1) * window;
            let len = (end - at).min(boundary - at);
            match map_chunk(dev, at, len, peers) {
                Ok(handle) => {
                    self.chunks.insert(at, Chunk { size: len, handle });
                    self.mapped += len;
                    ops += 1;
                    at += len;
                }
                Err(e) => {
                    self.unmap_exact(dev, begin, at)?;
                    return if e.is_out_of_memory() {
                        Ok(Range::default())
                    } else {
                        Err(e)
                    };
                }
            }
        }
        Ok(Range {
            addr: begin,
            size: end - begin,
            ops,
        })
    }

    /// Unmaps and releases every chunk lying entirely inside `addr..addr + size`, in address
    /// order, after waiting for the work queued on the device. A failed call stops it: what it
    /// did until then is in [`Unmapped::range`] (chunks of a mapped range lie end to end, so
    /// those released form one range from the first), the error in [`Unmapped::error`]. A chunk
    /// whose `unmap` failed stays mapped and listed; one whose `unmap` succeeded and whose
    /// `release_page` failed is unmapped (counted in the range) and its page is released again
    /// at the segment's next unmap.
    pub fn unmap<D: Device>(&mut self, dev: &D, addr: u64, size: u64) -> Unmapped {
        self.retry_leaked(dev);
        let inside: Vec<(u64, Chunk)> = self
            .chunks
            .range(addr..addr + size)
            .filter(|(a, c)| **a + c.size <= addr + size)
            .map(|(a, c)| (*a, *c))
            .collect();
        let first = inside.first().map_or(addr, |c| c.0);
        let mut done = Unmapped {
            range: Range {
                addr: first,
                size: 0,
                ops: 0,
            },
            error: None,
        };
        if inside.is_empty() {
            return done;
        }
        // Work queued on these pages may still run (a block is freed in stream order, before
        // its kernels ran): wait for it, as PyTorch does before unmapping. The whole device,
        // since the segment's stream may have been destroyed.
        if let Err(e) = dev.synchronize_device() {
            done.error = Some(e);
            return done;
        }
        for (a, c) in &inside {
            if let Err(e) = dev.unmap(*a, c.size) {
                done.error = Some(e);
                break;
            }
            self.chunks.remove(a);
            self.mapped -= c.size;
            done.range.size += c.size;
            done.range.ops += 1;
            if let Err(e) = dev.release_page(c.handle) {
                self.leaked.push(c.handle);
                done.error = Some(e);
                break;
            }
        }
        done
    }

    /// Releases again the pages whose release failed after their unmap (best effort: one that
    /// fails again stays for the next time).
    pub(crate) fn retry_leaked<D: Device>(&mut self, dev: &D) {
        self.leaked.retain(|&h| dev.release_page(h).is_err());
    }

    /// Unmaps exactly the chunks in `from..to` (used to roll back a partial map).
    fn unmap_exact<D: Device>(&mut self, dev: &D, from: u64, to: u64) -> Result<(), DeviceError> {
        if to > from {
            if let Some(e) = self.unmap(dev, from, to - from).error {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Unmaps everything and frees the reservation.
    pub fn destroy<D: Device>(mut self, dev: &D) -> Result<(), DeviceError> {
        let (va, size) = (self.va, self.size);
        if let Some(e) = self.unmap(dev, va, size).error {
            return Err(e);
        }
        if !self.leaked.is_empty() {
            // Still held by the device: keep the range until they go (the caller keeps `self`
            // only through the error; nothing is lost silently).
            return Err(DeviceError::invalid(
                "release_page",
                format!(
                    "{} pages of an unmapped range could not be released",
                    self.leaked.len()
                ),
            ));
        }
        dev.unreserve(va, size)
    }

    /// True when every byte of `addr..addr + size` is mapped.
    pub fn is_mapped(&self, addr: u64, size: u64) -> bool {
        let mut at = addr;
        let end = addr + size;
        match self.chunks.range(..=at).next_back() {
            Some((a, c)) if *a + c.size > at => at = *a + c.size,
            _ => return size == 0,
        }
        if at >= end {
            return true;
        }
        for (a, c) in self.chunks.range(at..end) {
            if *a != at {
                return false;
            }
            at = *a + c.size;
        }
        at >= end
    }
}

/// Creates one physical allocation of `len` bytes, maps it at `at` and makes it accessible;
/// on failure nothing is left behind.
fn map_chunk<D: Device>(
    dev: &D,
    at: u64,
    len: u64,
    peers: &[usize],
) -> Result<PageHandle, DeviceError> {
    let handle = dev.create_page(len)?;
    if let Err(e) = dev.map(at, len, handle) {
        let _ = dev.release_page(handle);
        return Err(e);
    }
    if let Err(e) = dev.set_access(at, len, peers) {
        let _ = dev.unmap(at, len);
        let _ = dev.release_page(handle);
        return Err(e);
    }
    Ok(handle)
}
