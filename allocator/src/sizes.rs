//! Size classes: how a request is rounded, which pool serves it and how large a new segment is.
//!
//! These are PyTorch's constants and rules (`CUDACachingAllocator.cpp`), written down once:
//!
//! | name | value | meaning |
//! | --- | --- | --- |
//! | [`MIN_BLOCK`] | 512 B | every block size is a multiple of it |
//! | [`SMALL_SIZE`] | 1 MiB | requests up to this size use the small pool |
//! | [`SMALL_BUFFER`] | 2 MiB | segment size (and page size) of the small pool |
//! | [`LARGE_BUFFER`] | 20 MiB | segment size for large requests below [`MIN_LARGE_ALLOC`]; page size of PyTorch's large expandable segments |
//! | [`MIN_LARGE_ALLOC`] | 10 MiB | from here on a segment is the request rounded to [`ROUND_LARGE`] |
//! | [`ROUND_LARGE`] | 2 MiB | rounding of large segments |

/// Every block size is a multiple of this.
pub const MIN_BLOCK: u64 = 512;
/// Largest request served by the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size for mid-sized large requests.
pub const LARGE_BUFFER: u64 = 20 << 20;
/// Requests from this size get a segment of their own rounded size.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Rounding of large segments.
pub const ROUND_LARGE: u64 = 2 << 20;

/// 1 EiB: PyTorch refuses a request of this size or more before its allocator sees it (not
/// counted in `num_ooms`).
pub const ONE_EIB: u64 = 1 << 60;

/// Largest request accepted (256 TiB, far above any device); larger ones are refused as errors
/// ([`crate::AllocError::TooLarge`] from `Pool` and [`crate::CachingAllocator`]) rather than overflows in
/// rounding.
pub const MAX_REQUEST: u64 = 1 << 48;

/// Which of the two pools a block belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum PoolKind {
    /// Requests up to [`SMALL_SIZE`].
    Small,
    /// Everything larger.
    Large,
}

impl PoolKind {
    /// The pool that serves a rounded size.
    pub fn for_size(rounded: u64) -> PoolKind {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// `"small"` or `"large"`.
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small",
            PoolKind::Large => "large",
        }
    }
}

/// Rounds `x` up to a multiple of `to` (a non-zero number), saturating at the largest multiple
/// that fits in 64 bits.
pub fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to).saturating_mul(to) / to * to
}

/// Rounds a request the way PyTorch's `round_size` does: at least 512 B, then either to the next
/// of `divisions` power-of-two divisions (when `roundup_power2_divisions` asks for more than one
/// in the request's interval: [`crate::config::PoolConfig::round_size`]) or to a multiple of
/// 512 B.
pub fn round_size(size: u64, divisions: u64) -> u64 {
    if size < MIN_BLOCK {
        return MIN_BLOCK;
    }
    if divisions > 1 && size > MIN_BLOCK.saturating_mul(divisions) {
        roundup_power2_next_division(size, divisions)
    } else {
        round_up(size, MIN_BLOCK)
    }
}

/// Rounds `size` up to the next of `divisions` equal steps between two powers of two.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = floor >> divisions.trailing_zeros();
    if step == 0 {
        return floor.saturating_mul(2);
    }
    let down = size & !(step - 1);
    if down == size {
        size
    } else {
        down.saturating_add(step)
    }
}

/// The segment size PyTorch asks `cudaMalloc` for when no cached block fits a rounded request.
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        round_up(rounded, ROUND_LARGE)
    }
}
