//! Helpers shared by the test folders (not a test itself): each folder's `main.rs` declares
//! `mod common` with `#[path = "../common/mod.rs"]`; `pool` holds the pool tests' helpers and
//! `steps` the layout-plan sequences.

pub mod pool;
pub mod steps;

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

/// Checks that a simulated device holds nothing any more: no memory, no pages, no reserved
/// address space, no events (after the allocator that used it was dropped).
#[allow(dead_code)]
pub fn assert_device_empty(sim: &cudalloc_sys::SimDevice, label: &str) {
    sim.check_invariants();
    assert_eq!(
        sim.outstanding_bytes(),
        0,
        "{label}: outstanding after drop"
    );
    assert_eq!(sim.live_pages(), 0, "{label}: pages after drop");
    assert_eq!(
        sim.reserved_va_bytes(),
        0,
        "{label}: reservations after drop"
    );
    assert_eq!(sim.live_events(), 0, "{label}: events after drop");
}

/// The message of a caught panic.
#[allow(dead_code)]
pub fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic)".into())
}
