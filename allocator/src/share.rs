//! Sharing an allocation with another process on the same GPU (CUDA IPC over expandable
//! segments): the exporter describes it, the importer maps the same physical pages into an
//! address range of its own.
//!
//! With `shareable_segments:True` the pages of expandable segments are created exportable.
//! [`CachingAllocator::share`] takes a live allocation and returns a [`SharedAllocation`]: the
//! device, the segment's id (stable while the segment lives, never reused in the process), the
//! allocation's offset from the first page behind it and its size, and one file descriptor per
//! page (chunk) behind it, freshly exported and owned by the caller. The pages may hold other
//! allocations' bytes too (a page is the unit of export). [`SharedAllocation::send`] moves it
//! over a Unix socket (the description as bytes, the descriptors as `SCM_RIGHTS`),
//! [`SharedAllocation::receive`] takes it on the other side; [`SharedMapping::open`] (or
//! [`CachingAllocator::open_shared`]) imports the pages, reserves a range, maps them end to end
//! and makes them accessible; [`SharedMapping::close`] (or dropping it) unmaps, releases the
//! imported handles and frees the range.
//!
//! # Lifetimes
//!
//! The descriptors must be imported while the exporter still holds the allocation (after its
//! free the pages may be unmapped and released). Once imported, the physical pages live as long
//! as the importer's handles: an importer that outlives the exporter's segment (the exporter
//! freed the allocation, emptied its cache, or exited) still reads and writes the same memory
//! until it closes its mapping; the memory goes back to the device when the last handle, in any
//! process, is released. Neither side sees the other's frees: the caller orders the two
//! processes' use (as with PyTorch's CUDA IPC, the exporter keeps the allocation alive while
//! the importer uses it, or the two agree that the importer owns what it keeps).
//!
//! # Errors
//!
//! Sharing an allocation of a segment that was not made shareable is
//! [`AllocError::NotShareable`], naming the key to set (`shareable_segments`, or the policy for
//! `torch`'s `cuMemAlloc` segments); a description whose pages are not whole device pages, or
//! whose allocation does not lie inside them, is [`AllocError::BadShare`]; a driver failure
//! while opening undoes what was done and is [`AllocError::Device`].

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::allocator::CachingAllocator;
use crate::error::AllocError;
use crate::sync::Arc;
use cudalloc_sys::fds::{recv_fds, send_fds, MAX_FDS};
use cudalloc_sys::{Device, PageHandle};

/// One page behind a shared allocation: its bytes and the descriptor it was exported as.
#[derive(Debug)]
pub struct SharedPage {
    /// Bytes of the page (a multiple of the device's granularity).
    pub size: u64,
    /// The exported page.
    pub fd: OwnedFd,
}

/// What another process needs to open an allocation (see the module documentation).
#[derive(Debug)]
pub struct SharedAllocation {
    /// The exporter's device ordinal.
    pub device: usize,
    /// The id of the segment the allocation lives in.
    pub segment: u64,
    /// Bytes from the start of the first page to the allocation.
    pub offset: u64,
    /// The allocation's bytes.
    pub size: u64,
    /// The pages behind it, in address order, end to end.
    pub pages: Vec<SharedPage>,
}

/// First bytes of a description: a format tag.
const MAGIC: &[u8; 8] = b"cudalsh1";
/// Words of a description before the page sizes.
const HEADER_WORDS: usize = 5;

impl SharedAllocation {
    /// Bytes of the pages behind the allocation.
    pub fn page_bytes(&self) -> u64 {
        self.pages.iter().map(|p| p.size).sum()
    }

    /// The description without the descriptors: a tag, then little-endian `u64`s: device,
    /// segment, offset, size, page count and each page's size.
    pub fn description(&self) -> Vec<u8> {
        let head = [
            self.device as u64,
            self.segment,
            self.offset,
            self.size,
            self.pages.len() as u64,
        ];
        let sizes = self.pages.iter().map(|p| p.size);
        let words = head.into_iter().chain(sizes);
        let mut out = MAGIC.to_vec();
        words.for_each(|w| out.extend_from_slice(&w.to_le_bytes()));
        out
    }

    /// The allocation a description (from [`SharedAllocation::description`]) and its
    /// descriptors, in page order, describe.
    pub fn from_description(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<Self, AllocError> {
        let bad = |why: String| AllocError::BadShare { why };
        let body = bytes
            .strip_prefix(MAGIC)
            .ok_or_else(|| bad("the description does not start with its tag".into()))?;
        if body.len() % 8 != 0 || body.len() < HEADER_WORDS * 8 {
            return Err(bad(format!("a description of {} bytes", bytes.len())));
        }
        let words: Vec<u64> = body
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .collect();
        let count = words[4] as usize;
        if words.len() != HEADER_WORDS + count || fds.len() != count {
            let why = format!(
                "{count} pages described, {} sizes and {} descriptors given",
                words.len() - HEADER_WORDS,
                fds.len()
            );
            return Err(bad(why));
        }
        let sizes = &words[HEADER_WORDS..];
        let pages = sizes.iter().zip(fds);
        let pages = pages.map(|(&size, fd)| SharedPage { size, fd }).collect();
        Ok(SharedAllocation {
            device: words[0] as usize,
            segment: words[1],
            offset: words[2],
            size: words[3],
            pages,
        })
    }

    /// Sends the allocation over `sock`: the description's length and bytes, then the
    /// descriptors, at most [`MAX_FDS`] per message of one byte.
    pub fn send(&self, sock: &UnixStream) -> io::Result<()> {
        let description = self.description();
        let mut w = sock;
        w.write_all(&(description.len() as u64).to_le_bytes())?;
        w.write_all(&description)?;
        for batch in self.pages.chunks(MAX_FDS) {
            let fds: Vec<_> = batch.iter().map(|p| p.fd.as_fd()).collect();
            send_fds(sock, &[batch.len() as u8], &fds)?;
        }
        Ok(())
    }

    /// Receives an allocation [`SharedAllocation::send`] sent over `sock`.
    pub fn receive(sock: &UnixStream) -> io::Result<Self> {
        let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        let mut r = sock;
        let mut len = [0u8; 8];
        r.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len);
        if len > 1 << 30 {
            return Err(invalid(format!("a description of {len} bytes")));
        }
        let mut description = vec![0u8; len as usize];
        r.read_exact(&mut description)?;
        let count = description
            .len()
            .saturating_sub(MAGIC.len() + HEADER_WORDS * 8)
            / 8;
        let mut fds = Vec::with_capacity(count);
        while fds.len() < count {
            let mut n = [0u8; 1];
            let got = recv_fds(sock, &mut n, MAX_FDS)?;
            if got.len() != n[0] as usize {
                let why = format!("{} descriptors arrived, {} announced", got.len(), n[0]);
                return Err(invalid(why));
            }
            fds.extend(got);
        }
        Self::from_description(&description, fds).map_err(|e| invalid(e.to_string()))
    }
}

/// A shared allocation mapped into this process (see the module documentation). Dropping it
/// closes it, ignoring errors; [`SharedMapping::close`] reports them.
#[derive(Debug)]
pub struct SharedMapping<D: Device> {
    device: D,
    base: u64,
    reserved: u64,
    /// Imported pages: address, bytes, handle, mapped.
    pages: Vec<(u64, u64, PageHandle, bool)>,
    offset: u64,
    size: u64,
    open: bool,
}

impl<D: Device> SharedMapping<D> {
    /// Imports the pages of `shared` on `device` (the exporter's GPU), maps them end to end in a
    /// range of its own and makes them accessible. On failure nothing stays imported or mapped.
    pub fn open(device: D, shared: &SharedAllocation) -> Result<Self, AllocError> {
        let g = device.granularity()?;
        let total = shared.page_bytes();
        let whole = shared.pages.iter().all(|p| p.size > 0 && p.size % g == 0);
        if !whole || shared.pages.is_empty() {
            let why = format!("its pages are not whole multiples of {g} bytes (or there are none)");
            return Err(AllocError::BadShare { why });
        }
        if shared
            .offset
            .checked_add(shared.size)
            .is_none_or(|end| end > total)
        {
            let (offset, size) = (shared.offset, shared.size);
            let why = format!("{size} bytes at offset {offset} do not lie in its {total} bytes");
            return Err(AllocError::BadShare { why });
        }
        let base = device.reserve(total)?;
        let mut m = SharedMapping {
            device,
            base,
            reserved: total,
            pages: Vec::new(),
            offset: shared.offset,
            size: shared.size,
            open: true,
        };
        if let Err(e) = m.map_all(shared) {
            let _ = m.release();
            return Err(e.into());
        }
        Ok(m)
    }

    fn map_all(&mut self, shared: &SharedAllocation) -> Result<(), cudalloc_sys::DeviceError> {
        let mut at = self.base;
        for p in &shared.pages {
            let handle = self.device.import_page(p.fd.as_fd(), p.size)?;
            self.pages.push((at, p.size, handle, false));
            self.device.map(at, p.size, handle)?;
            self.pages.last_mut().expect("pushed").3 = true;
            at += p.size;
        }
        self.device.set_access(self.base, self.reserved, &[])
    }

    /// The allocation's address in this process.
    pub fn ptr(&self) -> u64 {
        self.base + self.offset
    }

    /// The allocation's bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The first page's address and the bytes of every page mapped.
    pub fn range(&self) -> (u64, u64) {
        (self.base, self.reserved)
    }

    /// Unmaps the pages, releases the imported handles (the memory goes back to the device if
    /// no other handle holds it) and frees the range. The first failure is returned; the rest
    /// is still attempted.
    pub fn close(mut self) -> Result<(), AllocError> {
        self.release().map_err(AllocError::from)
    }

    fn release(&mut self) -> Result<(), cudalloc_sys::DeviceError> {
        if !std::mem::replace(&mut self.open, false) {
            return Ok(());
        }
        let mut first = Ok(());
        let mut keep = |r: Result<(), cudalloc_sys::DeviceError>| {
            if first.is_ok() {
                first = r;
            }
        };
        for &(at, size, handle, mapped) in self.pages.iter().rev() {
            if mapped {
                keep(self.device.unmap(at, size));
            }
            keep(self.device.release_page(handle));
        }
        keep(self.device.unreserve(self.base, self.reserved));
        first
    }
}

impl<D: Device> Drop for SharedMapping<D> {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

impl<D: Device> CachingAllocator<D> {
    /// Describes the live allocation at `ptr` for another process (see the module
    /// documentation): its pages are exported as descriptors the caller owns. Refused for an
    /// allocation of a segment not made shareable ([`AllocError::NotShareable`], naming the
    /// key) and for a sleeping tag's ([`AllocError::Asleep`]).
    pub fn share(&self, ptr: u64) -> Result<SharedAllocation, AllocError> {
        let a = self.live.live(ptr)?.alloc;
        if a.tag != 0 {
            let set = self.tags.lock();
            let t = &set.pools[a.tag as usize - 1];
            return t
                .pool
                .core
                .share_block(a.block, a.ptr, a.size)
                .map_err(|e| match e {
                    AllocError::Asleep { what, .. } => AllocError::Asleep {
                        what,
                        tag: Some(t.name.clone()),
                    },
                    other => other,
                });
        }
        let pool = self.shards[crate::allocator::shard_of(a.stream)].lock();
        pool.core.share_block(a.block, a.ptr, a.size)
    }

    /// Opens an allocation another process shared ([`CachingAllocator::share`]) on this
    /// allocator's device, which must be the exporter's GPU ([`SharedMapping::open`]). The
    /// mapping is not the allocator's: it holds no block and counts in no statistic.
    pub fn open_shared(
        &self,
        shared: &SharedAllocation,
    ) -> Result<SharedMapping<Arc<D>>, AllocError> {
        SharedMapping::open(self.shared_device(), shared)
    }
}
