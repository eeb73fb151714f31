//! What a [`CudaDevice`](super::CudaDevice) handed out and has not got back: the bookkeeping
//! that checks every call's arguments before the driver sees them.

use std::collections::{BTreeMap, HashMap};

#[derive(Debug)]
pub(super) struct Page {
    pub(super) size: u64,
    pub(super) mappings: usize,
    /// Released while still mapped (`cuMemRelease`): the handle takes no more calls, and the
    /// entry goes at the page's last unmap.
    pub(super) released: bool,
}

impl Page {
    /// A page just created or imported: mapped nowhere.
    pub(super) fn new(size: u64) -> Page {
        Page {
            size,
            mappings: 0,
            released: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Mapping {
    pub(super) size: u64,
    pub(super) page: u64,
}

/// What the device handed out and has not got back.
#[derive(Debug, Default)]
pub(super) struct Memory {
    /// `malloc` pointer -> size.
    pub(super) mallocs: HashMap<u64, u64>,
    /// Reservation start -> size.
    pub(super) reservations: BTreeMap<u64, u64>,
    /// Page handle -> size and how often it is mapped. A page released while mapped stays,
    /// under a key of its own once the driver hands its handle's value out again
    /// ([`Memory::add_page`]).
    pub(super) pages: HashMap<u64, Page>,
    /// The last key given to a released page whose handle's value came back (counting down
    /// from `u64::MAX`, never a handle the driver gives).
    pub(super) moved_keys: u64,
    /// Mapping start -> size and page.
    pub(super) mappings: BTreeMap<u64, Mapping>,
    /// Pinned host buffer start -> size (`alloc_host`).
    pub(super) host: BTreeMap<u64, u64>,
}

impl Memory {
    /// Page `handle` was released: it leaves the table, or stays (marked) while it is mapped.
    pub(super) fn page_released(&mut self, handle: u64) {
        match self.pages.get_mut(&handle) {
            Some(p) if p.mappings > 0 => p.released = true,
            _ => {
                self.pages.remove(&handle);
            }
        }
    }

    /// Enters page `handle` of `size` bytes, just created or imported. A page released while
    /// still mapped may have had the same value (the driver may hand it out again once
    /// released): that one moves to a key of its own, with its mappings.
    pub(super) fn add_page(&mut self, handle: u64, size: u64) {
        if let Some(old) = self.pages.remove(&handle).filter(|p| p.released) {
            self.moved_keys = self.moved_keys.wrapping_sub(1);
            let key = self.moved_keys;
            self.pages.insert(key, old);
            for m in self.mappings.values_mut().filter(|m| m.page == handle) {
                m.page = key;
            }
        }
        self.pages.insert(handle, Page::new(size));
    }

    /// True if `ptr..ptr + len` lies inside one pinned host buffer.
    pub(super) fn in_host_buffer(&self, ptr: u64, len: u64) -> bool {
        let before = self.host.range(..=ptr).next_back();
        let end = ptr.checked_add(len);
        before.is_some_and(|(&start, &size)| end.is_some_and(|e| e <= start + size))
    }

    /// True if `va..end` lies inside one reservation.
    pub(super) fn reserved(&self, va: u64, end: u64) -> bool {
        let before = self.reservations.range(..=va).next_back();
        before.is_some_and(|(&start, &size)| end <= start + size)
    }

    /// True if some mapping overlaps `va..end`.
    pub(super) fn overlaps_mapping(&self, va: u64, end: u64) -> bool {
        let before = self.mappings.range(..end).next_back();
        before.is_some_and(|(&start, m)| start + m.size > va)
    }

    /// True if whole mappings cover exactly `va..end` (starting at `va`, ending at `end`, none
    /// missing between: `cuMemSetAccess` takes a range of whole mappings).
    pub(super) fn fully_mapped(&self, va: u64, end: u64) -> bool {
        let mut at = va;
        while at < end {
            match self.mappings.get(&at) {
                Some(m) => at += m.size,
                None => return false,
            }
        }
        at == end
    }
}
