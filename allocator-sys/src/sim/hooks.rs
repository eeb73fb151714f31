//! The [`SimDevice`]'s test hooks: call counts, fault injection, control of when simulated
//! streams complete their work, and introspection of what is outstanding, with the check of
//! the invariants the parent module lists.
//!
//! Invariant: the hooks only read the device's state, but for the faults they arm, the streams
//! they mark foreign, the work they complete (never past the work submitted) and the counters
//! they reset.

use super::SimDevice;
use crate::device::{Call, StreamId};

impl SimDevice {
    // ---- test hooks: counters, faults, streams ------------------------------------------------

    /// How many calls of kind `call` were made (successful or not).
    pub fn calls(&self, call: Call) -> u64 {
        self.state.lock().counts.get(call)
    }

    /// How many calls were made in all.
    pub fn total_calls(&self) -> u64 {
        self.state.lock().counts.total()
    }

    /// Sets every call counter back to zero.
    pub fn reset_calls(&self) {
        self.state.lock().counts.reset();
    }

    /// The `k`-th acquiring call from now fails (1-based); see [`FaultPlan`](crate::wrap::FaultPlan).
    pub fn fail_call(&self, k: u64) {
        self.state.lock().faults.fail_call(k);
    }

    /// Every `k`-th acquiring call fails; `k = 0` disables it.
    pub fn fail_every(&self, k: u64) {
        self.state.lock().faults.fail_every(k);
    }

    /// The next acquiring call fails.
    pub fn fail_next(&self) {
        self.state.lock().faults.fail_next();
    }

    /// The `k`-th release call from now fails (1-based); see [`FaultPlan::fail_release`](crate::wrap::FaultPlan::fail_release).
    pub fn fail_release(&self, k: u64) {
        self.state.lock().faults.fail_release(k);
    }

    /// Every call of kind `call` fails until [`SimDevice::clear_faults`]; see
    /// [`FaultPlan::fail_always`](crate::wrap::FaultPlan::fail_always).
    pub fn fail_always(&self, call: Call) {
        self.state.lock().faults.fail_always(call);
    }

    /// Makes `stream` a stream of another device: events cannot be recorded on it (CUDA refuses
    /// an event and a stream of different contexts) and [`Device::check_stream`](crate::device::Device::check_stream) refuses it.
    pub fn add_foreign_stream(&self, stream: StreamId) {
        self.state.lock().foreign.insert(stream);
    }

    /// Disarms every fault.
    pub fn clear_faults(&self) {
        self.state.lock().faults.clear();
    }

    /// Whether work on every stream completes as soon as it is recorded (default `true`).
    /// Turning it on does not complete work already pending.
    pub fn set_auto_complete(&self, on: bool) {
        self.state.lock().auto_complete = on;
    }

    /// Completes everything recorded on `stream` so far.
    pub fn complete_stream(&self, stream: StreamId) {
        if let Some(work) = self.state.lock().streams.get_mut(&stream) {
            work.completed = work.submitted;
        }
    }

    /// Completes everything recorded on every stream so far.
    pub fn complete_all(&self) {
        for work in self.state.lock().streams.values_mut() {
            work.completed = work.submitted;
        }
    }

    /// The work submitted so far on each stream that has any, as marks for
    /// [`SimDevice::complete_stream_to`] (a device that runs behind completes up to an earlier
    /// mark).
    pub fn submitted_work(&self) -> Vec<(StreamId, u64)> {
        let s = self.state.lock();
        s.streams.iter().map(|(&id, w)| (id, w.submitted)).collect()
    }

    /// Completes the work of `stream` up to `mark` (a count [`SimDevice::submitted_work`]
    /// returned); never un-completes work, nor completes work not yet submitted.
    pub fn complete_stream_to(&self, stream: StreamId, mark: u64) {
        if let Some(work) = self.state.lock().streams.get_mut(&stream) {
            work.completed = work.completed.max(mark.min(work.submitted));
        }
    }

    // ---- test hooks: introspection ------------------------------------------------------------

    /// Bytes in live segments plus live pages.
    pub fn outstanding_bytes(&self) -> u64 {
        self.state.lock().used()
    }

    /// Bytes in live segments (exact malloc sizes).
    pub fn malloc_bytes(&self) -> u64 {
        self.state.lock().malloc_bytes
    }

    /// Bytes in live physical pages.
    pub fn page_bytes(&self) -> u64 {
        self.state.lock().page_bytes
    }

    /// Bytes of virtual address space with a page mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.state.lock().mappings.values().map(|m| m.size).sum()
    }

    /// Bytes of virtual address space reserved.
    pub fn reserved_va_bytes(&self) -> u64 {
        self.state.lock().reservations.values().sum()
    }

    /// Number of live segments.
    pub fn live_mallocs(&self) -> usize {
        self.state.lock().segments.len()
    }

    /// Number of live physical pages.
    pub fn live_pages(&self) -> usize {
        self.state.lock().pages.len()
    }

    /// Number of live events.
    pub fn live_events(&self) -> usize {
        self.state.lock().events.len()
    }

    /// Asserts every invariant listed in the module documentation.
    ///
    /// # Panics
    /// If one does not hold.
    pub fn check_invariants(&self) {
        let s = self.state.lock();
        let g = self.cfg.granularity;
        let spans = s.segments.iter().map(|(&p, &n)| (p, n.next_multiple_of(g)));
        s.malloc_space.check(&spans.collect(), "malloc region");
        s.va_space.check(&s.reservations, "reserve region");
        let seg_bytes: u64 = s.segments.values().sum();
        let page_bytes = s
            .physical
            .check_invariants(s.pages.values().map(|p| p.physical));
        assert_eq!((s.malloc_bytes, s.page_bytes), (seg_bytes, page_bytes));
        assert!(s.used() <= self.cfg.capacity, "used bytes over capacity");
        let mut prev_end = 0;
        for (&va, m) in &s.mappings {
            assert!(va >= prev_end, "mappings overlap at {va:#x}");
            prev_end = va + m.size;
            assert!(
                s.reservation_of(va, m.size).is_some(),
                "{va:#x} not reserved"
            );
            let page = &s.pages[&m.page];
            assert!(page.mapped_at.contains(&va), "{va:#x} not among its page's");
            assert_eq!(page.size, m.size);
        }
        let mappings: usize = s.pages.values().map(|p| p.mapped_at.len()).sum();
        assert_eq!(mappings, s.mappings.len(), "a page's mappings disagree");
        for p in s.pages.values() {
            assert!(!p.released || !p.mapped_at.is_empty(), "released page kept");
        }
        for w in s.streams.values() {
            assert!(w.completed <= w.submitted, "completed > submitted");
        }
        for &(stream, target) in s.events.values().flatten() {
            assert!(target <= s.streams[&stream].submitted, "unsubmitted event");
        }
        let live = |event| s.events.contains_key(&event);
        s.captures
            .check_invariants(live, |stream| s.foreign.contains(&stream));
    }
}
