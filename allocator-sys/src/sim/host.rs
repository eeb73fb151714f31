//! Host backing of the simulated device: data written to a segment or to accessible mapped
//! pages reads back (see [`SimDevice::write`]).
//!
//! Invariant: a host access touches only live segments and mapped pages made accessible; any
//! other address is refused before a byte is copied.

use super::{SimDevice, State};
use crate::device::{DeviceError, DevicePtr, DeviceResult};

/// Where a piece of a host read or write lands.
enum Target {
    Segment(u64),
    Page(u64),
}

/// Pieces of a host access: (target, offset in target, offset in buffer, length).
type Route = Vec<(Target, u64, usize, usize)>;

impl SimDevice {
    /// Every range work may use now, by address: each live segment (its exact `malloc` size)
    /// and each mapped page made accessible (the ranges a host access may touch, with or
    /// without host backing).
    pub fn accessible_ranges(&self) -> Vec<(u64, u64)> {
        let s = self.state.lock();
        let segments = s.segments.iter().map(|(&p, &n)| (p, n));
        let pages = s.mappings.iter().filter(|(_, m)| m.accessible);
        let mut ranges: Vec<(u64, u64)> =
            segments.chain(pages.map(|(&va, m)| (va, m.size))).collect();
        ranges.sort_unstable();
        ranges
    }

    /// Copies `data` to device address `addr` (needs host backing). The range must lie inside
    /// one live segment, or inside consecutive mapped pages that were made accessible.
    pub fn write(&self, addr: DevicePtr, data: &[u8]) -> DeviceResult<()> {
        self.write_locked("write", &mut self.state.lock(), addr, data)
    }

    /// [`SimDevice::write`] with the state already locked; `call` names the caller's call.
    pub(super) fn write_locked(
        &self,
        call: &'static str,
        s: &mut State,
        addr: DevicePtr,
        data: &[u8],
    ) -> DeviceResult<()> {
        for (target, off, from, n) in self.route(call, s, addr, data.len())? {
            let bytes = &data[from..from + n];
            let store = match target {
                Target::Segment(p) => s.segment_data.entry(p).or_default(),
                Target::Page(id) => s.physical.data_mut(s.pages[&id].physical),
            };
            store.write(off, bytes);
        }
        Ok(())
    }

    /// Copies device memory at `addr` into `out` (needs host backing); never-written bytes read
    /// as zero. The same addresses as for [`SimDevice::write`] are valid.
    pub fn read(&self, addr: DevicePtr, out: &mut [u8]) -> DeviceResult<()> {
        self.read_locked("read", &self.state.lock(), addr, out)
    }

    /// [`SimDevice::read`] with the state already locked; `call` names the caller's call.
    pub(super) fn read_locked(
        &self,
        call: &'static str,
        s: &State,
        addr: DevicePtr,
        out: &mut [u8],
    ) -> DeviceResult<()> {
        for (target, off, from, n) in self.route(call, s, addr, out.len())? {
            let dst = &mut out[from..from + n];
            let store = match target {
                Target::Segment(p) => s.segment_data.get(&p),
                Target::Page(id) => Some(s.physical.data(s.pages[&id].physical)),
            };
            match store {
                Some(store) => store.read(off, dst),
                None => dst.fill(0),
            }
        }
        Ok(())
    }

    /// Splits a host access of `len` bytes at `addr` into (target, offset in target, offset in
    /// buffer, length) pieces, or says which address is not accessible.
    fn route(&self, call: &'static str, s: &State, addr: u64, len: usize) -> DeviceResult<Route> {
        if !self.cfg.host_backing {
            let msg = "the device has no host backing";
            return Err(DeviceError::invalid(call, msg));
        }
        Self::route_any(call, s, addr, len)
    }

    /// Checks that `addr..addr + len` lies inside one live segment or inside consecutive
    /// accessible mapped pages, with host backing or without (a copy between device ranges).
    pub(super) fn accessible(
        call: &'static str,
        s: &State,
        addr: u64,
        len: u64,
    ) -> DeviceResult<()> {
        Self::route_any(call, s, addr, len as usize).map(drop)
    }

    /// [`SimDevice::route`] with host backing or without.
    fn route_any(call: &'static str, s: &State, addr: u64, len: usize) -> DeviceResult<Route> {
        let fail = |msg: String| Err(DeviceError::invalid(call, msg));
        let Some(end) = addr.checked_add(len as u64).filter(|_| len > 0) else {
            return if len == 0 {
                Ok(Vec::new())
            } else {
                fail(format!("{addr:#x} overflows"))
            };
        };
        if let Some((&p, &size)) = s.segments.range(..=addr).next_back() {
            if addr < p + size && end <= p + size {
                return Ok(vec![(Target::Segment(p), addr - p, 0, len)]);
            }
            if addr < p + size {
                return fail(format!("{:#x} is past the segment at {p:#x}", p + size));
            }
        }
        let mut pieces = Vec::new();
        let mut at = addr;
        while at < end {
            let hit = s.mappings.range(..=at).next_back();
            let Some((&va, m)) = hit.filter(|(&va, m)| at < va + m.size && m.accessible) else {
                return fail(format!("{at:#x} is not in a segment or an accessible page"));
            };
            let n = (va + m.size).min(end) - at;
            pieces.push((
                Target::Page(m.page),
                at - va,
                (at - addr) as usize,
                n as usize,
            ));
            at += n;
        }
        Ok(pieces)
    }
}
