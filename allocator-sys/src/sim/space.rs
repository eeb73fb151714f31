//! Building blocks of the simulated device: a first-fit address space and sparse host backing.
//!
//! Invariants: `Space` keeps its free ranges sorted, disjoint and coalesced; `Sparse` stores
//! only chunks that were written (reads of never-written bytes are zero).

use super::{CHUNK, REGION_SIZE};
use std::collections::{BTreeMap, HashMap};

/// Free ranges of one address region, keyed by start, coalesced.
#[derive(Debug, Default)]
pub(super) struct Space {
    base: u64,
    free: BTreeMap<u64, u64>,
}

impl Space {
    pub(super) fn new(base: u64) -> Self {
        Self {
            base,
            free: BTreeMap::from([(base, REGION_SIZE)]),
        }
    }

    /// Takes `len` bytes from the lowest free range that fits.
    pub(super) fn take(&mut self, len: u64) -> Option<u64> {
        let (&start, &have) = self.free.iter().find(|(_, &have)| have >= len)?;
        self.free.remove(&start);
        if have > len {
            self.free.insert(start + len, have - len);
        }
        Some(start)
    }

    /// Takes `start..start + len` if all of it is free: false (nothing taken) otherwise, and for
    /// an empty range.
    pub(super) fn take_at(&mut self, start: u64, len: u64) -> bool {
        if len == 0 {
            return false;
        }
        let Some((&from, &have)) = self.free.range(..=start).next_back() else {
            return false;
        };
        let end = start.checked_add(len);
        if end.is_none_or(|end| end > from + have) {
            return false;
        }
        self.free.remove(&from);
        if start > from {
            self.free.insert(from, start - from);
        }
        let rest = from + have - (start + len);
        if rest > 0 {
            self.free.insert(start + len, rest);
        }
        true
    }

    /// Gives `start..start + len` back, merging it with its free neighbours.
    pub(super) fn give(&mut self, mut start: u64, mut len: u64) {
        if let Some((&prev, &plen)) = self.free.range(..start).next_back() {
            if prev + plen == start {
                self.free.remove(&prev);
                start = prev;
                len += plen;
            }
        }
        if let Some(next_len) = self.free.remove(&(start + len)) {
            len += next_len;
        }
        self.free.insert(start, len);
    }

    /// Asserts that the free ranges are coalesced and, with `used`, tile the region exactly.
    pub(super) fn check(&self, used: &BTreeMap<u64, u64>, what: &str) {
        let mut all: Vec<(u64, u64, bool)> =
            self.free.iter().map(|(&s, &l)| (s, l, true)).collect();
        all.extend(used.iter().map(|(&s, &l)| (s, l, false)));
        all.sort_unstable();
        let mut at = self.base;
        let mut prev_free = false;
        for (start, len, free) in all {
            assert_eq!(start, at, "{what}: gap or overlap at {start:#x}");
            assert!(
                !(free && prev_free),
                "{what}: free ranges not coalesced at {start:#x}"
            );
            at = start + len;
            prev_free = free;
        }
        assert_eq!(at, self.base + REGION_SIZE, "{what}: region not covered");
    }
}

/// Sparse, lazily allocated host storage; never-written bytes read as zero.
#[derive(Default)]
pub(super) struct Sparse {
    chunks: HashMap<u64, Box<[u8]>>,
}

impl std::fmt::Debug for Sparse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sparse({} chunks)", self.chunks.len())
    }
}

impl Sparse {
    /// Splits `off..off + len` into (chunk index, offset in chunk, offset in buffer, length).
    fn pieces(off: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize, usize)> {
        let mut done = 0usize;
        std::iter::from_fn(move || {
            if done == len {
                return None;
            }
            let at = off + done as u64;
            let inner = (at % CHUNK) as usize;
            let n = (CHUNK as usize - inner).min(len - done);
            let piece = (at / CHUNK, inner, done, n);
            done += n;
            Some(piece)
        })
    }

    pub(super) fn write(&mut self, off: u64, data: &[u8]) {
        for (chunk, inner, from, n) in Self::pieces(off, data.len()) {
            let buf = self
                .chunks
                .entry(chunk)
                .or_insert_with(|| vec![0; CHUNK as usize].into_boxed_slice());
            buf[inner..inner + n].copy_from_slice(&data[from..from + n]);
        }
    }

    pub(super) fn read(&self, off: u64, out: &mut [u8]) {
        for (chunk, inner, from, n) in Self::pieces(off, out.len()) {
            let dst = &mut out[from..from + n];
            match self.chunks.get(&chunk) {
                Some(buf) => dst.copy_from_slice(&buf[inner..inner + n]),
                None => dst.fill(0),
            }
        }
    }
}
