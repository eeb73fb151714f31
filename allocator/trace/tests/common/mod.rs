//! Helpers shared by the test files (not a test itself).

/// SplitMix64: a small deterministic generator for reproducible operation sequences.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A number in `lo..hi`.
    #[allow(dead_code)]
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }
}

/// Asserts two traces are the same in everything but the name and where their events come
/// from (lines or snapshot entries; a snapshot's allocations put before its history are lines
/// of the CSV the converter writes).
#[allow(dead_code)]
pub fn assert_same_trace(a: &cudalloc_trace::Trace, b: &cudalloc_trace::Trace) {
    assert_eq!(a.ops, b.ops);
    assert_eq!(a.streams, b.streams);
    assert_eq!(a.slots, b.slots);
    assert_eq!(a.events + a.before_history, b.events + b.before_history);
    assert_eq!(a.segment_allocs, b.segment_allocs);
    assert_eq!(a.segment_sizes, b.segment_sizes);
    assert_eq!(a.segment_addrs, b.segment_addrs);
    assert_eq!(a.peak_live, b.peak_live);
    assert_eq!(a.anomalies, b.anomalies);
}
