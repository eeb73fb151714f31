//! Physical memory of the simulated device, and pages shared between two processes on one GPU,
//! simulated on one [`SimDevice`]: the exporter's pages and the importer's are handles of the
//! same device, as two processes' handles are of the same GPU.
//!
//! A page handle points at physical memory ([`Physical`]). `create_page` and
//! `create_shareable_page` make physical memory with one handle; `export_page` hands out a real
//! file descriptor (the write end of a pipe whose read end the device keeps, so that the
//! descriptor is known by its inode however it is duplicated or passed over a socket);
//! `import_page` finds the physical memory by the descriptor's inode and makes another handle
//! to it, so that a write through one handle's mapping reads back through the other's. The
//! physical memory is freed (its bytes leave the capacity's count) when its last handle is
//! released and mapped nowhere (a page released while mapped lives until its last unmap), and
//! its exports are forgotten: importing one of them afterwards is refused, as the
//! driver refuses a descriptor of memory that no longer exists.
//!
//! Errors, as the driver gives them: exporting a page not made shareable is driver code
//! [`NOT_EXPORTABLE`]; a shareable page on a device configured without sharing
//! ([`SimConfig::shareable`](super::SimConfig::shareable)) is code 801
//! (`CUDA_ERROR_NOT_SUPPORTED`); importing an unknown descriptor, or with a size other than the
//! page's, is code 1 (`CUDA_ERROR_INVALID_VALUE`).
//!
//! Invariants (checked by [`Memory::check_invariants`]): every physical memory has at least one
//! handle, and its count of handles equals the number of pages pointing at it; the device's
//! page bytes are the sum of the physical sizes (an import adds none); every export names live
//! physical memory.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::io::PipeReader;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

use super::ids::IdMap;
use super::space::Sparse;
use super::{oom, Page, SimDevice, State};
use crate::device::{Call, DeviceError, DeviceResult, PageHandle, NOT_EXPORTABLE};
use smallvec::SmallVec;

/// `CUDA_ERROR_NOT_SUPPORTED`.
const NOT_SUPPORTED: i32 = 801;
/// `CUDA_ERROR_INVALID_VALUE`.
const INVALID_VALUE: i32 = 1;

/// Physical memory: its bytes and how many page handles point at it.
#[derive(Debug)]
pub(super) struct Physical {
    size: u64,
    data: Sparse,
    handles: u32,
    shareable: bool,
}

/// Every physical memory by id, and the descriptors exported from them by inode.
#[derive(Debug, Default)]
pub(super) struct Memory {
    physical: IdMap<u64, Physical>,
    /// (device, inode) of an exported descriptor -> the kept read end and the physical id.
    exports: HashMap<(u64, u64), (PipeReader, u64)>,
    next: u64,
}

impl Memory {
    /// The bytes of physical memory `id`.
    pub(super) fn data(&self, id: u64) -> &Sparse {
        &self.physical[&id].data
    }

    /// The bytes of physical memory `id`, to write.
    pub(super) fn data_mut(&mut self, id: u64) -> &mut Sparse {
        &mut self
            .physical
            .get_mut(&id)
            .expect("live physical memory")
            .data
    }

    /// Asserts the invariants of the module documentation, given the physical id of every live
    /// page; returns the bytes of physical memory.
    pub(super) fn check_invariants(&self, pages: impl Iterator<Item = u64>) -> u64 {
        let mut handles: HashMap<u64, u32> = HashMap::new();
        for id in pages {
            *handles.entry(id).or_default() += 1;
        }
        for (id, p) in &self.physical {
            assert!(p.handles > 0, "physical memory {id} without a handle");
            assert_eq!(handles.get(id), Some(&p.handles), "handles of {id}");
        }
        assert_eq!(handles.len(), self.physical.len(), "a page of freed memory");
        for (_, id) in self.exports.values() {
            assert!(self.physical.contains_key(id), "export of freed memory");
        }
        self.physical.values().map(|p| p.size).sum()
    }
}

/// The (device, inode) pair that names the file behind `fd`.
fn identity(fd: BorrowedFd<'_>) -> std::io::Result<(u64, u64)> {
    let file = std::fs::File::from(fd.try_clone_to_owned()?);
    let meta = file.metadata()?;
    Ok((meta.dev(), meta.ino()))
}

fn driver(call: Call, code: i32, message: &str) -> DeviceError {
    DeviceError::Driver {
        call: call.name(),
        code,
        message: message.into(),
    }
}

impl State {
    /// Removes page `id` (released, mapped nowhere); its physical memory goes with its last
    /// page, and the descriptors exported from it with the memory.
    pub(super) fn drop_page(&mut self, id: u64) {
        let p = self.pages.remove(&id).expect("a live page");
        let Entry::Occupied(mut phys) = self.physical.physical.entry(p.physical) else {
            unreachable!("a live page's physical memory is live");
        };
        phys.get_mut().handles -= 1;
        if phys.get().handles == 0 {
            let size = phys.remove().size;
            let exports = &mut self.physical.exports;
            if !exports.is_empty() {
                exports.retain(|_, (_, of)| *of != p.physical);
            }
            self.page_bytes -= size;
        }
    }
}

impl SimDevice {
    /// `create_page` (`shareable`: `create_shareable_page`).
    pub(super) fn sim_create_page(&self, size: u64, shareable: bool) -> DeviceResult<PageHandle> {
        let mut s = self.enter(Call::CreatePage, size)?;
        self.size_ok(Call::CreatePage, size)?;
        if shareable && !self.cfg.shareable {
            let msg = "operation not supported (no POSIX file-descriptor handles)";
            return Err(driver(Call::CreatePage, NOT_SUPPORTED, msg));
        }
        if !s.fits(size, self.cfg.capacity) {
            return Err(oom(Call::CreatePage, size));
        }
        let m = &mut s.physical;
        m.next += 1;
        let physical = m.next;
        let data = Sparse::default();
        let p = Physical {
            size,
            data,
            handles: 1,
            shareable,
        };
        m.physical.insert(physical, p);
        s.page_bytes += size;
        let id = s.handle();
        let page = Page {
            size,
            mapped_at: SmallVec::new(),
            physical,
            released: false,
        };
        s.pages.insert(id, page);
        Ok(PageHandle(id))
    }

    /// `release_page`: the handle goes now; the page goes at once when it is mapped nowhere,
    /// else at its last unmap (as `cuMemRelease`), and the physical memory when its last
    /// page does.
    pub(super) fn sim_release_page(&self, page: PageHandle) -> DeviceResult<()> {
        let mut s = self.enter(Call::ReleasePage, 0)?;
        let Some(p) = s.pages.get_mut(&page.0).filter(|p| !p.released) else {
            let msg = format!("unknown page {}", page.0);
            return Err(DeviceError::invalid(Call::ReleasePage.name(), msg));
        };
        if p.mapped_at.is_empty() {
            s.drop_page(page.0);
        } else {
            p.released = true;
        }
        Ok(())
    }

    /// `export_page`: a pipe's write end, known by its inode.
    pub(super) fn sim_export_page(&self, page: PageHandle) -> DeviceResult<OwnedFd> {
        let mut s = self.enter(Call::ExportPage, 0)?;
        let Some(p) = s.pages.get(&page.0).filter(|p| !p.released) else {
            let msg = format!("unknown page {}", page.0);
            return Err(DeviceError::invalid(Call::ExportPage.name(), msg));
        };
        let id = p.physical;
        if !s.physical.physical[&id].shareable {
            let msg = "invalid argument (the page was not created exportable)";
            return Err(driver(Call::ExportPage, NOT_EXPORTABLE, msg));
        }
        let host = |e: std::io::Error| driver(Call::ExportPage, 999, &e.to_string());
        let (reader, writer) = std::io::pipe().map_err(host)?;
        let fd = OwnedFd::from(writer);
        let key = identity(fd.as_fd()).map_err(host)?;
        s.physical.exports.insert(key, (reader, id));
        Ok(fd)
    }

    /// `import_page`: another handle to the physical memory `fd` was exported from.
    pub(super) fn sim_import_page(
        &self,
        fd: BorrowedFd<'_>,
        size: u64,
    ) -> DeviceResult<PageHandle> {
        let mut s = self.enter(Call::ImportPage, size)?;
        let unknown = "invalid argument (not a descriptor of live exported memory)";
        let key = identity(fd).map_err(|_| driver(Call::ImportPage, INVALID_VALUE, unknown))?;
        let Some(&(_, id)) = s.physical.exports.get(&key) else {
            return Err(driver(Call::ImportPage, INVALID_VALUE, unknown));
        };
        let phys = s
            .physical
            .physical
            .get_mut(&id)
            .expect("live physical memory");
        if phys.size != size {
            let msg = format!(
                "invalid argument (the page has {} bytes, not {size})",
                phys.size
            );
            return Err(driver(Call::ImportPage, INVALID_VALUE, &msg));
        }
        phys.handles += 1;
        let handle = s.handle();
        let page = Page {
            size,
            mapped_at: SmallVec::new(),
            physical: id,
            released: false,
        };
        s.pages.insert(handle, page);
        Ok(PageHandle(handle))
    }
}
