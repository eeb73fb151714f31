//! The rules of the `default` policy, one switch each, all on by default.
//!
//! Every switch names one decision the policy takes beyond its base (expandable ranges, pages
//! mapped in chunks under the fragmentation budget, PyTorch's best fit and split). With all on,
//! the policy is `default`; a switch off removes that one decision and leaves the others as
//! they are. They are not config keys: they exist so that each rule can be measured on and off
//! over the trace set (`cargo run --release -p cudalloc-cli --example rule_table`), and the
//! table in `docs/policies.md` says what each one is worth. The whole of the layout plans is
//! `layout_plans` in [`DefaultConfig`](super::DefaultConfig), a config key.

/// Switches for the rules of the `default` policy (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rules {
    /// The budget gives cached chunks back at all (off: reserved memory only grows).
    pub give_back: bool,
    /// The budget gives back first the smallest free block at least as large as its excess
    /// (off: largest first).
    pub give_back_best_fit: bool,
    /// A free block of at least `TAIL_MIN_CHUNKS` chunk windows at the end of its segment's
    /// mapped pages, or of at least `TAIL_INNER_MIN_CHUNKS` elsewhere (`TAIL_MIN_CHUNKS` when
    /// the excess is at most `TAIL_SMALL_EXCESS_PARTS`th of it), gives back only the
    /// chunks at its end that cover the excess, when that keeps `TAIL_MIN_HEAD_CHUNKS` windows
    /// of it (off: the whole block).
    pub give_back_tail: bool,
    /// A growth maps up to the end of the chunk window it ends in, while the budget has room.
    pub window_slack: bool,
    /// While nothing was freed yet (loading), a large-pool growth maps one page ahead (under a
    /// memory cap only where a next tensor of the same size then fits without a call, a page
    /// of the cap stays free and chunks are more than a page).
    pub page_ahead: bool,
    /// Under a memory cap, while nothing was freed yet (loading), a growth's slack may take up
    /// to one fragmentation budget of the cap, as far as the cap leaves room, rather than only
    /// the capped budget's room over the live bytes loaded so far (`budget::loading_room`).
    pub loading_slack_under_cap: bool,
    /// A small-pool growth's slack is at most one budget of the peak live bytes or
    /// `SMALL_SLACK_HELD_MULTIPLE` times what the small pool holds, whichever is more.
    pub small_slack_cap: bool,
    /// A small-pool growth may pass the budget's ceiling by up to one page rather than give
    /// cached chunks back for it.
    pub small_overshoot: bool,
    /// Without a memory cap, a small-pool growth whose chunk window does not fit in the
    /// budget's room (or whose need ends at its window's end) maps as many
    /// pages beyond its need as the room holds (with at least two pages of room), up to a
    /// quarter of what the small pool holds and eight pages; its room counts the page of
    /// overshoot (`small`).
    pub small_partial_slack: bool,
    /// While a plan places an episode, the budget counts the episode's expected peak as reached.
    pub expected_peak: bool,
    /// The cached pages of the plan's footprint are given back only past twice the budget.
    pub keep_footprint: bool,
    /// A footprint that needs new pages may be split in two at a clean cut of the plan.
    pub split_footprints: bool,
    /// A free block holding a piece of a split footprint gives back its pages outside it.
    pub give_back_beside_split: bool,
    /// A footprint goes to the last footprint's base when that is free there.
    pub reuse_last_footprint: bool,
    /// A footprint goes into the best-fitting free block that holds it, before a run of free
    /// and unmapped blocks.
    pub footprint_in_free_block: bool,
    /// The backtracking search for a packing within the live peak, after the greedy orders.
    pub packing_search: bool,
    /// Greedy order: largest first, latest first among equal sizes.
    pub order_latest_first: bool,
    /// Greedy order: largest first, earliest-ending first among equal sizes.
    pub order_earliest_end_first: bool,
    /// Greedy order: largest first, longest-lived first among equal sizes.
    pub order_longest_first: bool,
    /// Greedy order: largest bytes x lifetime first.
    pub order_largest_area_first: bool,
    /// An allocation a little smaller than planned still takes its planned place.
    pub smaller_matches: bool,
    /// An episode also ends once enough allocations came after its youngest live one and all
    /// of those are freed (the older ones, weights as a rule, outlive it).
    pub nested_episodes: bool,
    /// A growth first takes back pages of its own stream still on their way back to the device
    /// (`Core::reclaim_releasing`); off: it maps new pages. A replay cannot weigh it: on the
    /// simulated device a release completes at once.
    pub take_back_releasing: bool,
    /// Under a memory cap (and with `repage_under_cap` on), a large-pool request of at least
    /// `GIANT_MIN_CHUNKS` chunk windows and `GIANT_MIN_BYTES` that finds no cached block grows
    /// on a range of its own, mapped as one chunk (`giant`).
    pub giant_ranges: bool,
    /// Without a memory cap, a large-pool request of at least `GIANT_UNCAPPED_MIN_CHUNKS`
    /// chunk windows and `GIANT_UNCAPPED_MIN_BYTES` that finds no cached block grows on a range
    /// of its own, mapped as one chunk (`giant`).
    pub giant_ranges_uncapped: bool,
    /// The budget gives back the free blocks of giant ranges before any other, largest first
    /// (`giant`).
    pub give_back_giant_first: bool,
    /// Without a memory cap, pages the budget gave back for a growth that the device has not
    /// caught up with (their stream's work still queued) are taken back into the cache, and
    /// until a give-back completes at once the policy is *behind*: no giant range is made and
    /// giant blocks serve any request of the capped giant size by best fit (`behind`). A replay
    /// cannot weigh it unless its device runs behind (`cudalloc replay --device-lag`).
    pub keep_while_behind: bool,
    /// A growth maps the pages of its stream's releasing blocks at its own addresses before it
    /// creates pages (`Core::map_block_moving`), and without a cap the pages a give-back
    /// left on their way back for a growth of their own stream stay releasing for it to take
    /// (`keep_while_behind` takes back only those of other streams). A replay cannot weigh it
    /// unless its device runs behind (`cudalloc replay --device-lag`).
    pub move_pages: bool,
    /// A memory limit that is far (at least
    /// `FAR_LIMIT_WIDE_CEILINGS` (`policy/default/budget.rs`) times the capped
    /// mode's wide ceiling, once an episode of the layout plans has been evaluated, with
    /// `repage_under_cap` on) runs the uncapped rules; the limit itself and the ladder's last
    /// resort still hold (`DefaultPolicy::note_limit`).
    /// Off, any limit (even the whole device's memory) runs the capped mode.
    pub wide_budget_near_limit: bool,
}

/// A way to reach one switch of [`Rules`].
pub type Switch = fn(&mut Rules) -> &mut bool;

impl Rules {
    /// Every rule on: the `default` policy.
    pub const ALL: Rules = Rules {
        give_back: true,
        give_back_best_fit: true,
        give_back_tail: true,
        window_slack: true,
        page_ahead: true,
        loading_slack_under_cap: true,
        small_slack_cap: true,
        small_overshoot: true,
        small_partial_slack: true,
        expected_peak: true,
        keep_footprint: true,
        split_footprints: true,
        give_back_beside_split: true,
        reuse_last_footprint: true,
        footprint_in_free_block: true,
        packing_search: true,
        order_latest_first: true,
        order_earliest_end_first: true,
        order_longest_first: true,
        order_largest_area_first: true,
        smaller_matches: true,
        nested_episodes: true,
        take_back_releasing: true,
        giant_ranges: true,
        giant_ranges_uncapped: true,
        give_back_giant_first: true,
        keep_while_behind: true,
        move_pages: true,
        wide_budget_near_limit: true,
    };

    /// The name of each switch, and a way to reach it: for the measuring tool.
    pub fn switches() -> Vec<(&'static str, Switch)> {
        vec![
            ("give_back", |r| &mut r.give_back),
            ("give_back_best_fit", |r| &mut r.give_back_best_fit),
            ("give_back_tail", |r| &mut r.give_back_tail),
            ("window_slack", |r| &mut r.window_slack),
            ("page_ahead", |r| &mut r.page_ahead),
            ("loading_slack_under_cap", |r| {
                &mut r.loading_slack_under_cap
            }),
            ("small_slack_cap", |r| &mut r.small_slack_cap),
            ("small_overshoot", |r| &mut r.small_overshoot),
            ("small_partial_slack", |r| &mut r.small_partial_slack),
            ("expected_peak", |r| &mut r.expected_peak),
            ("keep_footprint", |r| &mut r.keep_footprint),
            ("split_footprints", |r| &mut r.split_footprints),
            ("give_back_beside_split", |r| &mut r.give_back_beside_split),
            ("reuse_last_footprint", |r| &mut r.reuse_last_footprint),
            ("footprint_in_free_block", |r| {
                &mut r.footprint_in_free_block
            }),
            ("packing_search", |r| &mut r.packing_search),
            ("order_latest_first", |r| &mut r.order_latest_first),
            ("order_earliest_end_first", |r| {
                &mut r.order_earliest_end_first
            }),
            ("order_longest_first", |r| &mut r.order_longest_first),
            ("order_largest_area_first", |r| {
                &mut r.order_largest_area_first
            }),
            ("smaller_matches", |r| &mut r.smaller_matches),
            ("nested_episodes", |r| &mut r.nested_episodes),
            ("take_back_releasing", |r| &mut r.take_back_releasing),
            ("giant_ranges", |r| &mut r.giant_ranges),
            ("giant_ranges_uncapped", |r| &mut r.giant_ranges_uncapped),
            ("give_back_giant_first", |r| &mut r.give_back_giant_first),
            ("keep_while_behind", |r| &mut r.keep_while_behind),
            ("move_pages", |r| &mut r.move_pages),
            ("wide_budget_near_limit", |r| &mut r.wide_budget_near_limit),
        ]
    }

    /// Which of the greedy packing orders are on, largest first (always on) first.
    pub(crate) fn orders(&self) -> [bool; 5] {
        [
            true,
            self.order_latest_first,
            self.order_earliest_end_first,
            self.order_longest_first,
            self.order_largest_area_first,
        ]
    }
}

impl Default for Rules {
    fn default() -> Rules {
        Rules::ALL
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_switch_turns_off_one_rule_of_its_own() {
        let switches = Rules::switches();
        let mut seen = Vec::new();
        for (name, switch) in &switches {
            let mut r = Rules::ALL;
            *switch(&mut r) = false;
            assert_ne!(r, Rules::ALL, "{name}");
            assert!(
                !seen.contains(&r),
                "{name} reaches a switch another name reaches"
            );
            seen.push(r);
        }
        // Every field has a switch: all off through the switches is all off.
        let mut none = Rules::ALL;
        for (_, switch) in &switches {
            *switch(&mut none) = false;
        }
        assert_eq!(none.orders(), [true, false, false, false, false]);
        assert_eq!(format!("{none:?}").matches("true").count(), 0);
        assert_eq!(Rules::default(), Rules::ALL);
    }
}
