//! The map floor: the fewest map operations any allocator can make on a trace while it keeps its
//! memory within a slack of the live bytes.
//!
//! An allocator that promises to reserve at most `(1 + slack)` times the peak live bytes on
//! *every* trace may, at no moment, hold more than `(1 + slack)` times the live peak reached so
//! far: the trace might end right there. With memory in whole pages, the upper line is that
//! figure rounded down to pages, or the live peak rounded up to pages when this is more (no
//! allocator holds less than its live bytes). Below the line, the fewest maps are made by the
//! allocator that maps only when the live bytes no longer fit, maps up to the line each time,
//! never gives memory back and packs blocks perfectly. By induction, its k-th map comes no
//! earlier than any other such allocator's k-th map (after a map it holds the most it may, and
//! the line never falls; it only maps at a new live peak, since it held the old one), so no
//! allocator within the slack maps fewer times; one that fragments or gives memory back maps
//! more.
//!
//! The floor ignores pools, streams and fragmentation, so real allocators sit above it; it is the
//! part of a trace's driver calls that no placement or caching rule can remove. Invariants: the
//! result is deterministic, at least 1 for a trace that allocates anything, and does not grow
//! when the slack grows.

use crate::{Op, Trace};

/// Pages of the simulated device (the H200's mapping granularity).
pub const PAGE: u64 = 2 << 20;

/// The fewest map operations an allocator holding at most `(1 + slack)` times the live peak so
/// far (in whole `page`s, and at least that peak) can make on `trace` (see the module
/// documentation).
pub fn map_floor(trace: &Trace, slack: f64, page: u64) -> u64 {
    let page = page.max(1);
    let mut sizes = vec![0u64; trace.slots as usize];
    let (mut live, mut peak, mut held, mut maps) = (0u64, 0u64, 0u64, 0u64);
    for op in &trace.ops {
        match *op {
            Op::Alloc { slot, size, .. } => {
                sizes[slot as usize] = size;
                live = live.saturating_add(size);
                peak = peak.max(live);
                if live > held {
                    let upper = ((1.0 + slack) * peak as f64) as u64 / page * page;
                    held = upper.max(live.div_ceil(page).saturating_mul(page));
                    maps += 1;
                }
            }
            Op::Free { slot } => {
                live = live.saturating_sub(std::mem::take(&mut sizes[slot as usize]))
            }
        }
    }
    maps
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A trace of `ops`: positive = allocate that many MiB into a new slot, negative = free the
    /// allocation made by operation `-n - 1`.
    fn trace(ops: &[i64]) -> Trace {
        let mut t = Trace {
            name: "t".into(),
            ops: Vec::new(),
            streams: vec![0],
            slots: ops.len() as u32,
            events: ops.len() as u64,
            segment_allocs: 0,
            segment_sizes: Vec::new(),
            segment_addrs: Vec::new(),
            peak_live: 0,
            ..Trace::default()
        };
        for (i, &o) in ops.iter().enumerate() {
            t.ops.push(if o > 0 {
                Op::Alloc {
                    slot: i as u32,
                    stream: 0,
                    size: o as u64 * MIB,
                }
            } else {
                Op::Free {
                    slot: (-o - 1) as u32,
                }
            });
        }
        t
    }

    #[test]
    fn without_slack_every_new_peak_maps() {
        let t = trace(&[10; 10]);
        assert_eq!(map_floor(&t, 0.0, PAGE), 10);
    }

    #[test]
    fn slack_lets_one_map_cover_the_next_allocations() {
        // Live 10, 20, ..., 100 MiB with 100% slack: maps at 10 (to 20), 30 (to 60), 70 (to 140).
        let t = trace(&[10; 10]);
        assert_eq!(map_floor(&t, 1.0, PAGE), 3);
    }

    #[test]
    fn memory_freed_and_asked_for_again_is_not_mapped_again() {
        let t = trace(&[100, -1, 100, -3, 100]);
        assert_eq!(map_floor(&t, 0.0, PAGE), 1);
    }

    #[test]
    fn a_request_beyond_the_slack_is_mapped_whole() {
        // 1 MiB, then 300 MiB: the second map must hold 301 MiB (rounded up to pages).
        let t = trace(&[1, 300, 2]);
        assert_eq!(map_floor(&t, 0.05, PAGE), 2);
    }

    #[test]
    fn more_slack_never_needs_more_maps() {
        let t = trace(&[3, 7, -1, 12, 5, -2, 30, 1, 1, 40, -4, 9]);
        let floors: Vec<u64> = [0.0, 0.01, 0.05, 0.2, 1.0]
            .iter()
            .map(|&s| map_floor(&t, s, PAGE))
            .collect();
        assert!(floors.windows(2).all(|w| w[0] >= w[1]), "{floors:?}");
        assert!(floors[4] >= 1);
    }

    #[test]
    fn a_request_of_u64_max_bytes_does_not_overflow() {
        let mut t = trace(&[1, 1]);
        if let Op::Alloc { size, .. } = &mut t.ops[1] {
            *size = u64::MAX;
        }
        assert_eq!(map_floor(&t, 0.05, PAGE), 2);
    }

    #[test]
    fn an_empty_trace_needs_no_map() {
        assert_eq!(map_floor(&trace(&[]), 0.05, PAGE), 0);
    }
}
