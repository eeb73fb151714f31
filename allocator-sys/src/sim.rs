//! [`SimDevice`]: a deterministic, host-only device for tests, fuzzing and trace replay.
//!
//! It follows the [`Device`] contract to the letter and adds test hooks: call counts
//! ([`SimDevice::calls`]), fault injection ([`FaultPlan`]), simulated streams whose work completes
//! only when a test says so, introspection of what is outstanding, and optional host backing so
//! that data written to a segment or a page can be read back. Like a driver, it knows nothing of
//! the blocks the allocator carves out of its segments and pages. The test hooks are in the
//! `hooks` submodule.
//!
//! # Address assignment
//!
//! `malloc` hands out segments first fit, lowest address first, from a region starting at
//! `0x7000_0000_0000`; `reserve` does the same for virtual address ranges from a separate region
//! at `0x7f00_0000_0000`. Each region spans 2^46 bytes. Every result is aligned to the
//! granularity and occupies its size rounded up to the granularity; freed ranges are coalesced
//! with their neighbours and reused. The same sequence of calls always yields the same addresses.
//! A plan of placements ([`SimDevice::plan_mallocs`]: a replayed trace's recorded segments, so
//! that best fit breaks ties by address as it did in the recording) sends each malloc of the
//! size it names next to the offset it names instead, when that range is free, aligned and
//! below the reservations' region.
//!
//! # Capacity
//!
//! Used bytes are the exact sizes of live segments plus live physical pages (not rounded). A
//! `malloc` or `create_page` that would push them over the capacity is out of memory.
//!
//! # Invariants (checked by [`SimDevice::check_invariants`])
//!
//! - No two live segments (malloc results, rounded to the granularity) overlap, and no two
//!   reservations overlap; each region's free ranges and live ranges tile it exactly.
//! - Used bytes equal the live segment bytes plus the live page bytes, and never exceed the
//!   capacity.
//! - Every mapped range lies inside one reservation, and mapped ranges do not overlap.
//! - A page's recorded mappings agree with the mapping table (a page may be mapped at several
//!   addresses, as with `cuMemMap`); a released page is live only while it is still mapped
//!   (its memory goes at its last unmap, as with `cuMemRelease`); the physical memory's
//!   invariants are the `share` submodule's.
//! - On every stream, completed work never exceeds submitted work, and every recorded event
//!   targets work that was submitted.
//! - The captures' invariants, listed in the `capture` submodule's documentation.
//!
//! # Streams
//!
//! Each stream has a count of submitted and of completed work. `record_event` submits one unit
//! and remembers it as the event's target; the event is complete once the stream's completed
//! count reaches the target. With auto-complete on (the default) work completes at once; with it
//! off, work completes only through [`SimDevice::complete_stream`], [`SimDevice::complete_all`],
//! [`SimDevice::complete_stream_to`] (up to a mark of [`SimDevice::submitted_work`]: a device
//! that runs behind the host) or `synchronize_event` (which completes the stream up to that
//! event, like a wait).
//!
//! Pinned host memory, copies and the streams the device makes are in the `transfer`
//! submodule's documentation: copies move bytes only with host backing. Exported and imported
//! pages (two processes on one GPU, simulated on one device) are in the `share` submodule's.
//!
//! # Graph capture
//!
//! [`SimDevice::begin_capture`] and [`SimDevice::end_capture`] simulate capturing a stream into
//! a CUDA graph; while a capture is underway the calls its mode forbids fail with driver code
//! 900 and invalidate it, as on the H200. The rules and their invariants are in the `capture`
//! submodule's documentation.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{BorrowedFd, OwnedFd};

use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

use crate::device::{
    Call, Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostPtr, PageHandle, StreamId,
    MALLOC_ALIGNMENT,
};
use crate::wrap::FaultPlan;

/// Start of the region `malloc` assigns segments from.
pub const MALLOC_BASE: u64 = 0x7000_0000_0000;
/// Start of the region `reserve` assigns virtual address ranges from.
pub const RESERVE_BASE: u64 = 0x7f00_0000_0000;
/// Size of each address region.
pub const REGION_SIZE: u64 = 1 << 46;
/// Host backing storage is allocated lazily in chunks of this many bytes.
const CHUNK: u64 = 64 << 10;

mod config;
pub use config::SimConfig;
mod ids;
use ids::{Counts, IdMap, IdSet};
mod space;
use space::{Space, Sparse};
mod capture;
use capture::Captures;
mod hooks;
mod host;
mod share;
mod transfer;
pub use transfer::HOST_BASE;

/// A page handle: physical memory (`share::Physical`, which other handles may share after an
/// export and an import) and where the handle is mapped.
#[derive(Debug)]
struct Page {
    size: u64,
    /// The addresses it is mapped at (one, unless a page moved: no allocation then).
    mapped_at: SmallVec<[u64; 2]>,
    physical: u64,
    /// Released while still mapped: the handle is gone (no call takes it), and the page with
    /// its memory goes at its last unmap.
    released: bool,
}

/// A mapped page inside a reservation.
#[derive(Debug)]
struct Mapping {
    size: u64,
    page: u64,
    accessible: bool,
}

/// Work counts of one simulated stream.
#[derive(Clone, Copy, Debug, Default)]
struct Work {
    submitted: u64,
    completed: u64,
}

/// Everything behind the device's one lock.
#[derive(Debug, Default)]
struct State {
    malloc_space: Space,
    va_space: Space,
    /// Live segments: address -> exact size.
    segments: BTreeMap<u64, u64>,
    segment_data: HashMap<u64, Sparse>,
    /// Live reservations: address -> size.
    reservations: BTreeMap<u64, u64>,
    pages: IdMap<u64, Page>,
    /// Physical memory behind the pages, and the descriptors exported from it.
    physical: share::Memory,
    /// Mapped pages: virtual address -> mapping.
    mappings: BTreeMap<u64, Mapping>,
    /// Events: handle -> (stream, target) of the last record, if any.
    events: IdMap<u64, Option<(StreamId, u64)>>,
    streams: IdMap<StreamId, Work>,
    /// Streams of another device ([`SimDevice::add_foreign_stream`]).
    foreign: IdSet<StreamId>,
    counts: Counts,
    malloc_bytes: u64,
    page_bytes: u64,
    next_handle: u64,
    auto_complete: bool,
    faults: FaultPlan,
    captures: Captures,
    transfers: transfer::Transfers,
    /// Where the next `malloc`s go ([`SimDevice::plan_mallocs`]): (size, address), in order.
    malloc_plan: VecDeque<(u64, Option<u64>)>,
}

/// A deterministic, host-only [`Device`]; see the module documentation.
#[derive(Debug)]
pub struct SimDevice {
    cfg: SimConfig,
    state: Mutex<State>,
}

impl Default for SimDevice {
    fn default() -> Self {
        Self::new(SimConfig::default())
    }
}

/// Returns [`DeviceError::InvalidArgument`] for `Call::$call` with a formatted message.
macro_rules! bail {
    ($call:ident, $($msg:tt)+) => {
        return Err(DeviceError::invalid(Call::$call.name(), format!($($msg)+)))
    };
}

fn oom(call: Call, requested: u64) -> DeviceError {
    DeviceError::OutOfMemory {
        call: call.name(),
        requested,
    }
}

impl SimDevice {
    /// A device configured by `cfg`.
    ///
    /// # Panics
    /// If the granularity is not a power of two of at least [`MALLOC_ALIGNMENT`] bytes.
    pub fn new(cfg: SimConfig) -> Self {
        let g = cfg.granularity;
        assert!(
            g.is_power_of_two() && g >= MALLOC_ALIGNMENT,
            "bad granularity {g}"
        );
        let state = State {
            malloc_space: Space::new(MALLOC_BASE),
            va_space: Space::new(RESERVE_BASE),
            next_handle: 1,
            auto_complete: true,
            ..State::default()
        };
        let state = Mutex::new(state);
        Self { cfg, state }
    }

    /// Plans where the next `malloc`s go: the first entry `(size, offset)` of the plan places
    /// the next malloc of exactly `size` bytes at [`MALLOC_BASE`] + `offset`, and is used up,
    /// when that range is free, `offset` is a multiple of the granularity and the range ends
    /// below [`RESERVE_BASE`] (else the malloc goes where it goes without a plan, and the entry
    /// is used up all the same); a malloc of another size leaves the plan as it is. A replay
    /// of a recorded trace passes the recording's segments, so that its segments lie in the
    /// order the recording's did: PyTorch's best fit breaks ties between free blocks of one
    /// size by address.
    pub fn plan_mallocs(&self, plan: impl IntoIterator<Item = (u64, u64)>) {
        let g = self.cfg.granularity;
        let mut s = self.state.lock();
        // The malloc region's part below the reservations' region.
        let room = RESERVE_BASE - MALLOC_BASE;
        let at = |size: u64, offset: u64| {
            let end = offset.checked_add(size.checked_next_multiple_of(g)?)?;
            (offset.is_multiple_of(g) && end <= room).then_some(MALLOC_BASE + offset)
        };
        s.malloc_plan = plan
            .into_iter()
            .map(|(size, offset)| (size, at(size, offset)))
            .collect();
    }

    /// The default configuration with `bytes` of capacity.
    pub fn with_capacity(bytes: u64) -> Self {
        Self::new(SimConfig::with_capacity(bytes))
    }

    /// The configuration the device was made with.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// Counts `call`, applies the capture rules, then the fault plan, and returns the locked
    /// state.
    fn enter(&self, call: Call, requested: u64) -> DeviceResult<MutexGuard<'_, State>> {
        let mut s = self.state.lock();
        s.counts.record(call);
        s.captures.check(call)?;
        s.faults.check(call, requested)?;
        Ok(s)
    }

    /// True if `value` is a multiple of the granularity.
    fn aligned(&self, value: u64) -> bool {
        value & (self.cfg.granularity - 1) == 0
    }

    /// Checks that `size` is a non-zero multiple of the granularity.
    fn size_ok(&self, call: Call, size: u64) -> DeviceResult<()> {
        if size == 0 || !self.aligned(size) {
            let g = self.cfg.granularity;
            let msg = format!("size {size:#x} is not a non-zero multiple of {g:#x}");
            return Err(DeviceError::invalid(call.name(), msg));
        }
        Ok(())
    }
}

impl State {
    fn used(&self) -> u64 {
        self.malloc_bytes + self.page_bytes
    }

    /// Takes `span` bytes of malloc space for a malloc of `size`: where the plan says, if it
    /// names this size next and the range is free, else the lowest free range that fits.
    fn place_malloc(&mut self, size: u64, span: u64) -> Option<u64> {
        if self.malloc_plan.front().is_some_and(|&(s, _)| s == size) {
            let (_, at) = self.malloc_plan.pop_front()?;
            if let Some(at) = at.filter(|&at| self.malloc_space.take_at(at, span)) {
                return Some(at);
            }
        }
        self.malloc_space.take(span)
    }

    fn fits(&self, size: u64, capacity: u64) -> bool {
        self.used().checked_add(size).is_some_and(|n| n <= capacity)
    }

    fn handle(&mut self) -> u64 {
        self.next_handle += 1;
        self.next_handle - 1
    }

    /// The reservation containing `va..va + size`, if one does.
    fn reservation_of(&self, va: u64, size: u64) -> Option<u64> {
        let (&r, &len) = self.reservations.range(..=va).next_back()?;
        (va.checked_add(size)? <= r + len).then_some(r)
    }

    /// True if some mapping intersects `va..va + size`.
    fn any_mapped(&self, va: u64, size: u64) -> bool {
        // Mappings do not overlap: the last one starting before the end is the only one that
        // can reach into the range if any does.
        let last = self.mappings.range(..va + size).next_back();
        last.is_some_and(|(&m, info)| m + info.size > va)
    }

    /// The last record of `event` (`None` if never recorded), or an error if it is unknown.
    fn event(&mut self, call: Call, event: EventHandle) -> DeviceResult<&mut Recorded> {
        let unknown = || DeviceError::invalid(call.name(), format!("unknown event {}", event.0));
        self.events.get_mut(&event.0).ok_or_else(unknown)
    }
}

/// The stream an event was last recorded on and the work count it waits for.
type Recorded = Option<(StreamId, u64)>;

impl Device for SimDevice {
    fn ordinal(&self) -> usize {
        self.cfg.ordinal
    }

    fn malloc(&self, size: u64) -> DeviceResult<DevicePtr> {
        let mut s = self.enter(Call::Malloc, size)?;
        if size == 0 {
            bail!(Malloc, "zero-size allocation");
        }
        let span = size.checked_next_multiple_of(self.cfg.granularity);
        let ptr = span
            .filter(|_| s.fits(size, self.cfg.capacity))
            .and_then(|span| s.place_malloc(size, span))
            .ok_or_else(|| oom(Call::Malloc, size))?;
        s.segments.insert(ptr, size);
        s.malloc_bytes += size;
        Ok(ptr)
    }

    fn free(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let mut s = self.enter(Call::Free, size)?;
        if s.segments.get(&ptr) != Some(&size) {
            bail!(Free, "no live segment of {size} bytes at {ptr:#x}");
        }
        s.segments.remove(&ptr);
        s.segment_data.remove(&ptr);
        s.malloc_bytes -= size;
        let span = size.next_multiple_of(self.cfg.granularity);
        s.malloc_space.give(ptr, span);
        Ok(())
    }

    fn mem_info(&self) -> DeviceResult<(u64, u64)> {
        let s = self.enter(Call::MemInfo, 0)?;
        Ok((self.cfg.capacity - s.used(), self.cfg.capacity))
    }

    fn granularity(&self) -> DeviceResult<u64> {
        Ok(self.cfg.granularity)
    }

    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        let mut s = self.enter(Call::Reserve, size)?;
        self.size_ok(Call::Reserve, size)?;
        let va = s.va_space.take(size);
        let va = va.ok_or_else(|| oom(Call::Reserve, size))?;
        s.reservations.insert(va, size);
        Ok(va)
    }

    fn unreserve(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        let mut s = self.enter(Call::Unreserve, size)?;
        if s.reservations.get(&va) != Some(&size) {
            bail!(Unreserve, "no reservation of {size} bytes at {va:#x}");
        }
        if s.any_mapped(va, size) {
            bail!(Unreserve, "a page is still mapped inside {va:#x}");
        }
        s.reservations.remove(&va);
        s.va_space.give(va, size);
        Ok(())
    }

    fn create_page(&self, size: u64) -> DeviceResult<PageHandle> {
        self.sim_create_page(size, false)
    }

    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        self.sim_release_page(page)
    }

    fn map(&self, va: DevicePtr, size: u64, page: PageHandle) -> DeviceResult<()> {
        let mut s = self.enter(Call::Map, size)?;
        if !self.aligned(va) {
            bail!(Map, "address {va:#x} is not aligned to the granularity");
        }
        let Some(p) = s.pages.get(&page.0).filter(|p| !p.released) else {
            bail!(Map, "unknown page {}", page.0);
        };
        if p.size != size {
            bail!(Map, "page {} has {} bytes, not {size}", page.0, p.size);
        }
        if s.reservation_of(va, size).is_none() {
            bail!(Map, "{va:#x} + {size} is not inside one reservation");
        }
        if s.any_mapped(va, size) {
            bail!(Map, "{va:#x} + {size} is already mapped");
        }
        s.pages
            .get_mut(&page.0)
            .expect("checked")
            .mapped_at
            .push(va);
        let (page, accessible) = (page.0, false);
        s.mappings.insert(
            va,
            Mapping {
                size,
                page,
                accessible,
            },
        );
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> DeviceResult<()> {
        let mut s = self.enter(Call::Unmap, size)?;
        let page = match s.mappings.remove(&va) {
            Some(m) if m.size == size => m.page,
            other => {
                if let Some(m) = other {
                    s.mappings.insert(va, m); // another size: left mapped
                }
                bail!(Unmap, "no page of {size} bytes is mapped at {va:#x}")
            }
        };
        let p = s.pages.get_mut(&page).expect("mapped page");
        p.mapped_at.retain(|at| *at != va);
        if p.released && p.mapped_at.is_empty() {
            s.drop_page(page);
        }
        Ok(())
    }

    /// Peers are accepted and ignored: the simulated device has no peers to grant access to.
    fn set_access(&self, va: DevicePtr, size: u64, _peers: &[usize]) -> DeviceResult<()> {
        let mut s = self.enter(Call::SetAccess, size)?;
        self.size_ok(Call::SetAccess, size)?;
        let Some(end) = va.checked_add(size).filter(|_| self.aligned(va)) else {
            bail!(
                SetAccess,
                "address {va:#x} is misaligned or the range overflows"
            );
        };
        // The usual range, one whole mapping, in one lookup.
        if let Some(m) = s.mappings.get_mut(&va).filter(|m| m.size == size) {
            m.accessible = true;
            return Ok(());
        }
        let mut at = va;
        for (&m, info) in s.mappings.range(va..end) {
            if m != at {
                break;
            }
            at = m + info.size;
        }
        if at < end {
            bail!(SetAccess, "{at:#x} is not mapped");
        }
        if at > end {
            // CUDA takes whole mappings: a range ending inside one is refused.
            bail!(
                SetAccess,
                "{va:#x} + {size} ends inside a mapping (at {at:#x})"
            );
        }
        for (_, info) in s.mappings.range_mut(va..end) {
            info.accessible = true;
        }
        Ok(())
    }

    fn create_event(&self) -> DeviceResult<EventHandle> {
        let mut s = self.enter(Call::CreateEvent, 0)?;
        let id = s.handle();
        s.events.insert(id, None);
        Ok(EventHandle(id))
    }

    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        let mut s = self.enter(Call::DestroyEvent, 0)?;
        s.event(Call::DestroyEvent, event)?;
        s.events.remove(&event.0);
        s.captures.forget_event(event.0);
        Ok(())
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        let mut s = self.enter(Call::RecordEvent, 0)?;
        s.event(Call::RecordEvent, event)?;
        if s.foreign.contains(&stream) {
            bail!(
                RecordEvent,
                "stream {:#x} belongs to another device",
                stream.0
            );
        }
        if s.captures.record(event.0, stream) {
            return Ok(()); // a node of the graph: no work is submitted
        }
        let auto = s.auto_complete;
        let work = s.streams.entry(stream).or_default();
        work.submitted += 1;
        if auto {
            work.completed = work.submitted;
        }
        let target = work.submitted;
        *s.event(Call::RecordEvent, event)? = Some((stream, target));
        Ok(())
    }

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let mut s = self.enter(Call::QueryEvent, 0)?;
        let recorded = *s.event(Call::QueryEvent, event)?;
        s.captures.check_event(Call::QueryEvent, event.0)?;
        let Some((stream, target)) = recorded else {
            return Ok(true);
        };
        Ok(s.streams[&stream].completed >= target)
    }

    /// Not a counted call (nothing is acquired); refuses the streams of another device.
    fn check_stream(&self, stream: StreamId) -> DeviceResult<()> {
        if self.state.lock().foreign.contains(&stream) {
            let msg = format!("stream {:#x} belongs to another device", stream.0);
            return Err(DeviceError::invalid("check_stream", msg));
        }
        Ok(())
    }

    fn synchronize_device(&self) -> DeviceResult<()> {
        let mut s = self.enter(Call::SynchronizeDevice, 0)?;
        for work in s.streams.values_mut() {
            work.completed = work.submitted;
        }
        Ok(())
    }

    fn is_capturing(&self, stream: StreamId) -> DeviceResult<bool> {
        let s = self.enter(Call::CaptureStatus, 0)?;
        Ok(s.captures.is_capturing(stream))
    }

    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()> {
        let mut s = self.enter(Call::SynchronizeEvent, 0)?;
        let recorded = *s.event(Call::SynchronizeEvent, event)?;
        s.captures.check_event(Call::SynchronizeEvent, event.0)?;
        if let Some((stream, target)) = recorded {
            let work = s.streams.get_mut(&stream).expect("recorded stream");
            work.completed = work.completed.max(target);
        }
        Ok(())
    }

    fn alloc_host(&self, size: u64) -> DeviceResult<HostPtr> {
        self.sim_alloc_host(size)
    }
    fn free_host(&self, ptr: HostPtr, size: u64) -> DeviceResult<()> {
        self.sim_free_host(ptr, size)
    }
    fn copy_to_host_async(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        self.sim_copy_to_host_async(dst, src, n, s)
    }
    fn copy_to_device_async(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        self.sim_copy_to_device_async(dst, src, n, s)
    }
    fn copy_device_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: u64,
        s: StreamId,
    ) -> DeviceResult<()> {
        self.sim_copy_device_async(dst, src, n, s)
    }
    fn open_stream(&self) -> DeviceResult<StreamId> {
        self.sim_open_stream()
    }
    fn close_stream(&self, stream: StreamId) -> DeviceResult<()> {
        self.sim_close_stream(stream)
    }
    fn wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        self.sim_wait_event(stream, event)
    }
    fn can_share(&self) -> DeviceResult<bool> {
        Ok(self.cfg.shareable)
    }
    fn create_shareable_page(&self, size: u64) -> DeviceResult<PageHandle> {
        self.sim_create_page(size, true)
    }
    fn export_page(&self, page: PageHandle) -> DeviceResult<OwnedFd> {
        self.sim_export_page(page)
    }
    fn import_page(&self, fd: BorrowedFd<'_>, size: u64) -> DeviceResult<PageHandle> {
        self.sim_import_page(fd, size)
    }
}
