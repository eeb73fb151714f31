//! The data of a layout plan: an episode's allocations with their lifetimes ([`Lifetime`]),
//! and a packing of them ([`Plan`]), which the packer (`packing`) and its search (`search`)
//! both make.
//!
//! Invariant: a `Plan` has one offset per lifetime, and no two allocations whose lifetimes
//! overlap lie on overlapping bytes.

/// One allocation of an episode: rounded size, and when it was made and freed (ticks of the
/// episode's clock, which advances on each of its allocations and frees).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    /// Rounded bytes.
    pub size: u64,
    /// Tick of the allocation.
    pub start: u32,
    /// Tick of the free (`u32::MAX` while live).
    pub end: u32,
}

/// A packing of an episode: where each allocation goes, relative to the footprint's base.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The episode it was packed from.
    pub lifetimes: Vec<Lifetime>,
    /// Offset of each allocation.
    pub offsets: Vec<u64>,
    /// Bytes the packing spans.
    pub extent: u64,
    /// The most bytes live at once in the episode.
    pub live_peak: u64,
}
