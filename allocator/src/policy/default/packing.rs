//! Packing an episode offline, once every lifetime is known (the layout plans of `plan`): the
//! packer, and a model of best fit on the same sequence to compare it with.
//!
//! Invariants: a packing places no two allocations whose lifetimes overlap on overlapping
//! bytes, and spans at least the episode's live peak. The episodes the pool records have unique
//! ticks (one allocation or free each, `0..2n`) and every lifetime ends after it starts; other
//! input (shared ticks, lifetimes still live) is taken too, more slowly (`timeline`).

use super::lifetime::{Lifetime, Plan};
use super::rules::Rules;
use super::search::search;

/// The search for a packing within the live peak (`search`) runs when the best order spans
/// more than this many times the live peak: slack under the default fragmentation budget (2%)
/// is not worth its work, which could hold later evaluations back (`plan`'s work bound).
/// Measured (`rule_table`'s all-on row, geometric means): 1.01 to 1.05 give the same figures;
/// 1.0 costs the held-out traces (1.0426 / 261.8 against 1.0414 / 260.6).
pub const SEARCH_ABOVE_LIVE_PEAK: f64 = 1.02;

/// Steps charged per allocation for sorting it into an order, besides the placing (a sort of
/// n keys takes about log2(n) comparisons each: 8 for a few hundred allocations).
const SORT_WORK_PER_ALLOC: u64 = 8;

/// A sort key for allocations: the smaller one is placed first.
type OrderKey = fn(&Lifetime) -> (u64, u64);

/// The orders [`pack`] tries, as keys to sort allocations by (smallest key placed first).
/// Largest first suits steps whose sizes differ widely; latest first among equal sizes suits
/// decoding, where the key-value cache of each new token outlives the work around it; largest
/// area (bytes x lifetime) first suits convolutional nets, whose early layers are large and
/// short-lived.
const ORDERS: [OrderKey; 5] = [
    |t| (!t.size, u64::from(t.start)),
    |t| (!t.size, !u64::from(t.start)),
    |t| (!t.size, u64::from(t.end)),
    |t| (!t.size, !u64::from(t.end.saturating_sub(t.start))),
    |t| {
        let area = (t.size / 512).saturating_mul(u64::from(t.end.saturating_sub(t.start)));
        (!area, u64::from(t.start))
    },
];

/// Packs allocations of known lifetimes: in each of a few orders (`ORDERS`), each at the
/// lowest offset where it overlaps no placed allocation whose lifetime overlaps its own; keeps
/// the packing that spans least (the first one that spans no more than the live peak, which
/// none can beat). When that one spans more than [`SEARCH_ABOVE_LIVE_PEAK`] times the live peak, a
/// search (`search`, at most [`MAX_SEARCH_WORK`] steps) looks for a packing within the live peak.
/// An allocation still live (`end` of `u32::MAX`) lives to the end. (The policy packs within
/// bounds, [`pack_within`]; this unbounded form is for tests.)
#[cfg(any(test, feature = "testing"))]
pub fn pack(lifetimes: &[Lifetime]) -> Plan {
    pack_within(lifetimes, u64::MAX, u64::MAX, &Rules::ALL)
        .0
        .expect("some order packs within an unbounded extent and work")
}

/// Most steps the search for a packing within the live peak takes, however much work
/// the evaluation is given: about a millisecond (the search may take time exponential in
/// the allocations to find that there is none). A bound on time, not a tuned figure. Inside a
/// pool an evaluation's own bound (`plan::MAX_EVALUATION_WORK`, a quarter of this) is the lower.
pub const MAX_SEARCH_WORK: u64 = 1 << 18;

/// [`pack`], keeping only packings that span at most `bound` bytes (an order is given up as
/// soon as it spans more, or as much as the best so far), and spending at most about
/// `max_work` steps (the best packing found by then, if any); also the steps it took, the unit of
/// [`EVALUATION_WORK_PER_ALLOC`](super::plan::EVALUATION_WORK_PER_ALLOC). The search runs only when
/// an order packed within `bound`. `rules` says which orders are tried, and whether the search
/// runs. (The policy, which knows the live peak already, runs [`pack_within_peak`].)
#[cfg(any(test, feature = "testing"))]
pub(crate) fn pack_within(
    lifetimes: &[Lifetime],
    bound: u64,
    max_work: u64,
    rules: &Rules,
) -> (Option<Plan>, u64) {
    pack_within_peak(lifetimes, live_peak(lifetimes), bound, max_work, rules)
}

/// [`pack_within`] given the live peak of `lifetimes` (`floor`, [`live_peak`]; [`best_fit`]
/// finds it on its way), so that it is not computed again.
pub(crate) fn pack_within_peak(
    lifetimes: &[Lifetime],
    floor: u64,
    bound: u64,
    max_work: u64,
    rules: &Rules,
) -> (Option<Plan>, u64) {
    debug_assert_eq!(floor, live_peak(lifetimes));
    let Some(overlaps) = Overlaps::of(lifetimes, max_work) else {
        return (None, max_work);
    };
    let orders = rules.orders();
    let (mut best, mut work) = pack_in_orders(lifetimes, &overlaps, floor, bound, max_work, orders);
    // Slack left above the live peak: search for a packing without it.
    if rules.packing_search
        && best
            .as_ref()
            .is_some_and(|p| p.extent as f64 > SEARCH_ABOVE_LIVE_PEAK * floor as f64)
    {
        let left = max_work.saturating_sub(work).min(MAX_SEARCH_WORK);
        let (found, steps) = search(lifetimes, |i| overlaps.of_one(i), floor, left);
        work += steps;
        if let Some(mut plan) = found {
            plan.live_peak = floor;
            best = Some(plan);
        }
    }
    (best, work)
}

/// The orders part of [`pack_within`]: the tightest packing of [`ORDERS`] within `bound`
/// (`floor` is the live peak, where it stops), and the steps it took, counting those of
/// `overlaps`.
fn pack_in_orders(
    lifetimes: &[Lifetime],
    overlaps: &Overlaps,
    floor: u64,
    bound: u64,
    max_work: u64,
    orders: [bool; 5],
) -> (Option<Plan>, u64) {
    let (mut best, mut limit) = (None, bound);
    let mut work = overlaps.list.len() as u64;
    let mut keyed: Vec<(u64, u64, usize)> = Vec::with_capacity(lifetimes.len());
    for (key, _) in ORDERS.into_iter().zip(orders).filter(|o| o.1) {
        keyed.clear();
        keyed.extend(lifetimes.iter().enumerate().map(|(i, t)| {
            let (a, b) = key(t);
            (a, b, i)
        }));
        keyed.sort_unstable();
        let order: Vec<usize> = keyed.iter().map(|k| k.2).collect();
        work += SORT_WORK_PER_ALLOC * lifetimes.len() as u64;
        let left = max_work.saturating_sub(work);
        let (placed, steps) = place_in_order(lifetimes, overlaps, &order, limit, left);
        work += steps;
        match placed {
            Placed::Within(mut plan) => {
                plan.live_peak = floor;
                limit = plan.extent.saturating_sub(1);
                let done = plan.extent <= floor;
                best = Some(plan);
                if done {
                    break;
                }
            }
            Placed::Beyond => {}
            Placed::OutOfWork => break,
        }
    }
    (best, work)
}

/// For each allocation, the others whose lifetimes overlap its own: those of allocation `i`
/// are `list[first[i]..first[i + 1]]`.
struct Overlaps {
    first: Vec<usize>,
    list: Vec<u32>,
}

impl Overlaps {
    /// The lists, or `None` when there are more than `max_pairs` overlapping pairs.
    fn of(lifetimes: &[Lifetime], max_pairs: u64) -> Option<Overlaps> {
        let live_together = |a: &Lifetime, b: &Lifetime| a.start < b.end && b.start < a.end;
        let mut by_start: Vec<(u32, usize)> = lifetimes
            .iter()
            .enumerate()
            .map(|(i, t)| (t.start, i))
            .collect();
        by_start.sort_unstable();
        // Each pair once, from the one that starts first: the others start before it ends.
        let mut pairs: Vec<(u32, u32)> = Vec::new();
        for (p, &(_, i)) in by_start.iter().enumerate() {
            let a = &lifetimes[i];
            for &(start, j) in &by_start[p + 1..] {
                if start >= a.end {
                    break;
                }
                if live_together(a, &lifetimes[j]) {
                    pairs.push((i as u32, j as u32));
                }
                if pairs.len() as u64 > max_pairs {
                    return None;
                }
            }
        }
        let mut first = vec![0usize; lifetimes.len() + 1];
        for &(i, j) in &pairs {
            first[i as usize + 1] += 1;
            first[j as usize + 1] += 1;
        }
        for k in 1..first.len() {
            first[k] += first[k - 1];
        }
        let mut next = first.clone();
        let mut list = vec![0u32; 2 * pairs.len()];
        for &(i, j) in &pairs {
            list[next[i as usize]] = j;
            next[i as usize] += 1;
            list[next[j as usize]] = i;
            next[j as usize] += 1;
        }
        Some(Overlaps { first, list })
    }

    fn of_one(&self, i: usize) -> &[u32] {
        &self.list[self.first[i]..self.first[i + 1]]
    }
}

/// What [`place_in_order`] made of an order.
enum Placed {
    /// A packing within the limit.
    Within(Plan),
    /// The packing spans more than the limit.
    Beyond,
    /// The work allowed ran out first.
    OutOfWork,
}

/// Places the allocations in `order`, each at the lowest offset clear of those placed before
/// it whose lifetimes overlap its own, giving up when the packing spans more than `limit`
/// bytes or the steps (allocations looked at, and sorted) pass `max_work`; also the steps it
/// took.
fn place_in_order(
    lifetimes: &[Lifetime],
    overlaps: &Overlaps,
    order: &[usize],
    limit: u64,
    max_work: u64,
) -> (Placed, u64) {
    const UNPLACED: u64 = u64::MAX;
    let mut offsets = vec![UNPLACED; lifetimes.len()];
    // Bytes taken, as (offset, end), by the placed allocations live with the one being placed.
    let mut taken: Vec<(u64, u64)> = Vec::new();
    let (mut extent, mut work) = (0, 0);
    for &i in order {
        let size = lifetimes[i].size;
        let others = overlaps.of_one(i);
        taken.clear();
        taken.extend(others.iter().filter_map(|&j| {
            let at = offsets[j as usize];
            (at != UNPLACED).then(|| (at, at + lifetimes[j as usize].size))
        }));
        taken.sort_unstable();
        work += (others.len() + 2 * taken.len()) as u64;
        let mut at = 0;
        for &(lo, hi) in &taken {
            if lo >= at + size {
                break;
            }
            at = at.max(hi);
        }
        offsets[i] = at;
        extent = extent.max(at + size);
        if extent > limit {
            return (Placed::Beyond, work);
        }
        if work > max_work {
            return (Placed::OutOfWork, work);
        }
    }
    let plan = Plan {
        lifetimes: lifetimes.to_vec(),
        offsets,
        extent,
        live_peak: 0,
    };
    (Placed::Within(plan), work)
}

/// The episode's allocations and frees in clock order: (is an allocation, index). An
/// episode's ticks are unique and below twice its allocations, so this is a placement by tick;
/// other input (shared ticks, allocations still live at `u32::MAX`) is sorted instead, frees
/// before allocations on a shared tick.
fn timeline(lifetimes: &[Lifetime]) -> Vec<(bool, usize)> {
    const EMPTY: (bool, usize) = (false, usize::MAX);
    let ticks = 2 * lifetimes.len();
    let mut at: Vec<(bool, usize)> = vec![EMPTY; ticks];
    for (i, t) in lifetimes.iter().enumerate() {
        for (tick, alloc) in [(t.start, true), (t.end, false)] {
            match at.get_mut(tick as usize) {
                Some(slot) if *slot == EMPTY => *slot = (alloc, i),
                _ => return sorted_timeline(lifetimes),
            }
        }
    }
    // n lifetimes fill 2n distinct ticks below 2n: every one.
    at
}

/// [`timeline`] for any ticks: events in (tick, free before allocation, index) order. Ticks below
/// twice the allocations are counted into place (a stable counting sort: every free is placed
/// before every allocation, each in index order); later ones (allocations still live, at
/// `u32::MAX`) are sorted and follow.
fn sorted_timeline(lifetimes: &[Lifetime]) -> Vec<(bool, usize)> {
    let ticks = 2 * lifetimes.len();
    let events = || {
        let frees = lifetimes.iter().enumerate().map(|(i, t)| (t.end, false, i));
        frees.chain(
            lifetimes
                .iter()
                .enumerate()
                .map(|(i, t)| (t.start, true, i)),
        )
    };
    // `next[tick]`: where the next event of `tick` goes, once the counts are summed.
    let mut next = vec![0usize; ticks + 1];
    let mut late = Vec::new();
    for (tick, alloc, i) in events() {
        match next
            .get_mut(tick as usize + 1)
            .filter(|_| (tick as usize) < ticks)
        {
            Some(n) => *n += 1,
            None => late.push((tick, alloc, i)),
        }
    }
    for k in 1..next.len() {
        next[k] += next[k - 1];
    }
    let counted = next[ticks];
    let mut out = vec![(false, 0); counted];
    for (tick, alloc, i) in events().filter(|e| (e.0 as usize) < ticks) {
        let at = &mut next[tick as usize];
        out[*at] = (alloc, i);
        *at += 1;
    }
    late.sort_unstable();
    out.extend(late.into_iter().map(|(_, alloc, i)| (alloc, i)));
    out
}

/// Bytes best fit spans placing the allocations in order in an empty range (lowest address
/// among the smallest free blocks that fit, freed bytes merged with free neighbours). For
/// tests; the policy runs [`best_fit`] with a bound on its work.
#[cfg(any(test, feature = "testing"))]
pub fn best_fit_extent(lifetimes: &[Lifetime]) -> u64 {
    best_fit(lifetimes, u64::MAX)
        .expect("unbounded work")
        .extent
}

/// What [`best_fit`] found.
pub(crate) struct BestFit {
    /// Bytes best fit spans.
    pub extent: u64,
    /// The most bytes live at once ([`live_peak`]), found on the way.
    pub live_peak: u64,
    /// Steps taken (free ranges looked at).
    pub work: u64,
}

/// [`best_fit_extent`], the live peak and the steps it took; `None` once the steps pass
/// `max_work`.
pub(crate) fn best_fit(lifetimes: &[Lifetime], max_work: u64) -> Option<BestFit> {
    let mut free = FreeRanges::default();
    let mut work = 0;
    let mut at = vec![0u64; lifetimes.len()];
    let (mut extent, mut live, mut live_peak) = (0, 0, 0);
    for (alloc, i) in timeline(lifetimes) {
        let size = lifetimes[i].size;
        work += 1 + free.by_addr.len() as u64;
        if work > max_work {
            return None;
        }
        if alloc {
            at[i] = free.take(size);
            extent = extent.max(at[i] + size);
            live += size;
            live_peak = live_peak.max(live);
        } else {
            free.give(at[i], size);
            live -= size;
        }
    }
    Some(BestFit {
        extent,
        live_peak,
        work,
    })
}

/// The free ranges of [`best_fit_extent`]'s model, below `top` by address; all from `top` up is
/// free. An episode leaves few holes (at most a few dozen on the recorded traces), so a scan
/// finds the best fit faster than an index would.
#[derive(Default)]
struct FreeRanges {
    /// (address, bytes), by address; no two adjacent.
    by_addr: Vec<(u64, u64)>,
    top: u64,
}

impl FreeRanges {
    /// Best fit for `size` bytes (the smallest range that holds them, the lowest among equals);
    /// its address.
    fn take(&mut self, size: u64) -> u64 {
        let mut best: Option<(usize, u64)> = None;
        for (j, &(_, len)) in self.by_addr.iter().enumerate() {
            if len >= size && best.is_none_or(|(_, l)| len < l) {
                best = Some((j, len));
                if len == size {
                    break;
                }
            }
        }
        let Some((j, len)) = best else {
            self.top += size;
            return self.top - size;
        };
        let addr = self.by_addr[j].0;
        if len > size {
            self.by_addr[j] = (addr + size, len - size);
        } else {
            self.by_addr.remove(j);
        }
        addr
    }

    /// Frees `size` bytes at `addr`, merged with free neighbours (or lowering the top).
    fn give(&mut self, addr: u64, size: u64) {
        let (mut lo, mut hi) = (addr, addr + size);
        let mut j = self.by_addr.partition_point(|r| r.0 < lo);
        if j < self.by_addr.len() && self.by_addr[j].0 == hi {
            hi += self.by_addr.remove(j).1;
        }
        if j > 0 && self.by_addr[j - 1].0 + self.by_addr[j - 1].1 == lo {
            j -= 1;
            lo = self.by_addr.remove(j).0;
        }
        if hi == self.top {
            self.top = lo;
        } else {
            self.by_addr.insert(j, (lo, hi - lo));
        }
    }
}

/// The most bytes live at once.
pub fn live_peak(lifetimes: &[Lifetime]) -> u64 {
    let (mut live, mut peak) = (0u64, 0u64);
    for (alloc, i) in timeline(lifetimes) {
        if alloc {
            live += lifetimes[i].size;
            peak = peak.max(live);
        } else {
            live -= lifetimes[i].size;
        }
    }
    peak
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::policy::default) fn t(size: u64, start: u32, end: u32) -> Lifetime {
        Lifetime { size, start, end }
    }

    /// No two allocations alive at once share a byte.
    pub(in crate::policy::default) fn assert_disjoint(p: &Plan) {
        for (i, a) in p.lifetimes.iter().enumerate() {
            for (j, b) in p.lifetimes.iter().enumerate().skip(i + 1) {
                let live_together = a.start < b.end && b.start < a.end;
                let (ao, bo) = (p.offsets[i], p.offsets[j]);
                let overlap = ao < bo + b.size && bo < ao + a.size;
                assert!(!(live_together && overlap), "{i} and {j} overlap");
            }
        }
    }

    #[test]
    fn packing_reuses_bytes_of_allocations_already_freed() {
        // A lives 0..2, B 1..4, C 3..5: C can take A's bytes.
        let p = pack(&[t(4, 0, 2), t(4, 1, 4), t(4, 3, 5)]);
        assert_disjoint(&p);
        assert_eq!(p.extent, 8);
        assert_eq!(p.offsets[0], p.offsets[2]);
    }

    #[test]
    fn packing_puts_large_first_and_small_in_the_gaps() {
        // Two large ones one after the other, a small one living across both.
        let p = pack(&[t(1, 0, 9), t(4, 1, 3), t(4, 4, 6)]);
        assert_disjoint(&p);
        assert_eq!(p.offsets[1], 0);
        assert_eq!(
            p.offsets[2], 0,
            "the second large one reuses the first one's bytes"
        );
        assert_eq!(p.extent, 5);
    }

    #[test]
    fn packing_tries_other_orders_when_largest_first_leaves_a_hole() {
        // Largest first puts the 4 living 1..5 above the one living 0..2, and the 2 then finds
        // no room below it: 10. Latest first among equals packs to the live peak, 9.
        let lifetimes = [t(4, 0, 2), t(2, 4, 6), t(4, 1, 5), t(3, 3, 7)];
        assert_eq!(live_peak(&lifetimes), 9);
        let overlaps = Overlaps::of(&lifetimes, u64::MAX).unwrap();
        let largest_first = [0, 2, 3, 1];
        match place_in_order(&lifetimes, &overlaps, &largest_first, u64::MAX, u64::MAX).0 {
            Placed::Within(p) => assert_eq!(p.extent, 10),
            _ => panic!("an unbounded order places"),
        }
        let p = pack(&lifetimes);
        assert_disjoint(&p);
        assert_eq!(p.extent, 9);
        // Bounded at 9, the orders that pass it are given up and the one within is kept.
        let (within, _) = pack_within(&lifetimes, 9, u64::MAX, &Rules::ALL);
        assert_eq!(within.map(|p| p.extent), Some(9));
    }

    #[test]
    fn evaluations_stop_at_their_work_limit() {
        let lifetimes = [t(4, 0, 2), t(2, 4, 6), t(4, 1, 5), t(3, 3, 7)];
        assert!(best_fit(&lifetimes, 3).is_none());
        assert!(best_fit(&lifetimes, 1000).is_some());
        assert!(pack_within(&lifetimes, u64::MAX, 2, &Rules::ALL)
            .0
            .is_none());
    }

    #[test]
    fn allocations_still_live_or_sharing_a_tick_are_packed_too() {
        // Still live (u32::MAX) and a free on the tick of another's allocation: sorted, not
        // placed by tick.
        let lifetimes = [t(4, 0, u32::MAX), t(2, 1, 3), t(2, 3, 5)];
        assert_eq!(live_peak(&lifetimes), 6);
        let p = pack(&lifetimes);
        assert_disjoint(&p);
        assert_eq!(p.extent, 6);
        assert_eq!(best_fit_extent(&lifetimes), 6);
    }

    #[test]
    fn best_fit_reuses_the_lowest_of_the_smallest_holes() {
        // 4 and 2 side by side, the 4 freed: a 3 takes the start of its hole, a 1 the byte
        // left (not the top), a 2 goes on top: 8 bytes, 9 had the 1 gone on top.
        let lifetimes = [t(4, 0, 2), t(2, 1, 9), t(3, 3, 9), t(1, 4, 9), t(2, 5, 9)];
        assert_eq!(best_fit_extent(&lifetimes), 8);
        // Freed bytes at the top are reused.
        assert_eq!(best_fit_extent(&[t(8, 0, 1), t(8, 2, 3)]), 8);
    }

    /// A random episode: allocations and frees on unique ticks, sizes in 512-byte units.
    fn episode(seed: u64, n: usize) -> Vec<Lifetime> {
        let mut x = seed | 1;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let (mut v, mut live, mut clock) = (Vec::new(), Vec::new(), 0u32);
        while v.len() < n || !live.is_empty() {
            if v.len() < n && (live.is_empty() || rnd(100) < 55) {
                v.push(t((1 + rnd(64)) * 512, clock, u32::MAX));
                live.push(v.len() - 1);
            } else {
                let i = live.swap_remove(rnd(live.len() as u64) as usize);
                v[i].end = clock;
            }
            clock += 1;
        }
        v
    }

    proptest::proptest! {
        #[test]
        fn the_counted_timeline_is_the_sorted_one(raw in proptest::collection::vec((0u32..40, 0u32..44), 0..20)) {
            // Shared ticks, ticks past twice the allocations and allocations still live.
            let lifetimes: Vec<Lifetime> = raw
                .iter()
                .map(|&(s, e)| t(1, s, if e >= 40 { u32::MAX - (e - 40) } else { s.max(e) }))
                .collect();
            let mut sorted: Vec<(u32, bool, usize)> = lifetimes
                .iter()
                .enumerate()
                .flat_map(|(i, t)| [(t.start, true, i), (t.end, false, i)])
                .collect();
            sorted.sort_unstable();
            let want: Vec<(bool, usize)> = sorted.into_iter().map(|(_, a, i)| (a, i)).collect();
            proptest::prop_assert_eq!(sorted_timeline(&lifetimes), want.clone());
            proptest::prop_assert_eq!(timeline(&lifetimes), want);
        }
    }

    proptest::proptest! {
        #[test]
        fn packings_are_disjoint_and_the_bound_is_exact(seed in proptest::prelude::any::<u64>(), n in 1usize..120) {
            let lifetimes = episode(seed, n);
            let p = pack(&lifetimes);
            assert_disjoint(&p);
            proptest::prop_assert!(p.extent >= live_peak(&lifetimes));
            let overlaps = Overlaps::of(&lifetimes, u64::MAX).unwrap();
            let mut first: Vec<usize> = (0..lifetimes.len()).collect();
            first.sort_by_key(|&i| ORDERS[0](&lifetimes[i]));
            if let (Placed::Within(g), _) = place_in_order(&lifetimes, &overlaps, &first, u64::MAX, u64::MAX) {
                proptest::prop_assert!(p.extent <= g.extent, "never worse than largest first");
            }
            // The orders' bound is exact: the best order within it, none below it.
            let floor = live_peak(&lifetimes);
            let orders = |bound| pack_in_orders(&lifetimes, &overlaps, floor, bound, u64::MAX, [true; 5]).0.map(|q| q.extent);
            let e = orders(u64::MAX).expect("unbounded");
            proptest::prop_assert!(p.extent <= e);
            proptest::prop_assert_eq!(orders(e), Some(e));
            proptest::prop_assert!(orders(e - 1).is_none());
            // The search runs only on top of an order within the bound.
            if e > floor {
                proptest::prop_assert!(pack_within(&lifetimes, e - 1, u64::MAX, &Rules::ALL).0.is_none());
            }
        }
    }
}
