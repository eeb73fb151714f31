//! Tables of the simulated device keyed by small integers (page handles, physical ids, event
//! handles, stream handles), and its call counts.
//!
//! The keys are handed out by the device itself (or are stream handles), so nobody can choose
//! them to collide: [`IdMap`] hashes them with one multiplication instead of SipHash, which a
//! replay pays several times per driver call. Iteration order is unspecified, as for any
//! `HashMap`; nothing of the device depends on it.
//!
//! Invariant: [`Counts`] holds one count per [`Call`] kind, changed only under the device's lock.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use crate::device::Call;

/// A map keyed by device-made integers, hashed by [`IdHasher`].
pub(super) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// A set of device-made integers, hashed by [`IdHasher`].
pub(super) type IdSet<K> = HashSet<K, BuildHasherDefault<IdHasher>>;

/// Fibonacci hashing: the key times 2^64 / phi, rotated by half a word so that the table's
/// bucket (the low bits) comes from the product's well-spread high bits: keys aligned to a power
/// of two (stream handles that are host pointers) leave the product's low bits zero.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct IdHasher(u64);

const PHI: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0.rotate_left(32)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(PHI);
    }
}

/// Calls made, by kind (successful or not); kept in the locked state, so that counting a call
/// costs no atomic operation besides the lock the call takes anyway.
#[derive(Clone, Debug, Default)]
pub(super) struct Counts([u64; Call::ALL.len()]);

impl Counts {
    /// Counts one call of kind `call`.
    pub(super) fn record(&mut self, call: Call) {
        self.0[call.index()] += 1;
    }

    /// Calls of kind `call`.
    pub(super) fn get(&self, call: Call) -> u64 {
        self.0[call.index()]
    }

    /// Calls of every kind together.
    pub(super) fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// Every count back to zero.
    pub(super) fn reset(&mut self) {
        self.0 = [0; Call::ALL.len()];
    }
}
