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
    /// Page handle -> size and how often it is mapped.
    pub(super) pages: HashMap<u64, Page>,
    /// Mapping start -> size and page.
    pub(super) mappings: BTreeMap<u64, Mapping>,
    /// Pinned host buffer start -> size (`alloc_host`).
    pub(super) host: BTreeMap<u64, u64>,
}

impl Memory {
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
