//! The policies: config strings, the rules of `default` (budget, layout plans, split footprints),
//! a config key every policy reads, and policies written outside the crate through the public
//! `Policy` trait.
//!
//! Invariants checked in this folder:
//! - a config string parses to the fields it names, and a bad one is a `ConfigError` naming the
//!   key or token, never a panic;
//! - whatever a policy decides, the core's invariants hold after every step (`check`:
//!   `Pool::check_invariants`, `SimDevice::check_invariants`, device outstanding bytes ==
//!   reserved bytes), and the device is empty once the pool is dropped;
//! - each rule of `default` does what it is for: the budget gives back the smallest block that
//!   covers its excess, a layout plan reserves no more than best fit alone, a split footprint
//!   uses the block a conversion left; under a memory limit a growth that does not fit makes
//!   the chunks live blocks keep mapped page by page, keeping every live byte, and gives back
//!   no page still mapped at the old addresses of moved pages;
//! - a small-pool growth near the budget's ceiling maps part of its window when the room
//!   holds it (without a cap), and ends within the ceiling plus a page;
//! - a policy from outside the crate, or an adaptor around one of ours, changes nothing the core
//!   checks;
//! - while the device runs behind, a growth takes its own stream's pages on their way back
//!   (never another stream's, none during a capture), and their old addresses go once the
//!   device catches up;
//! - a memory limit far above the job runs the uncapped rules, a near one (or one that other
//!   pools sharing it fill, or any with `repage_under_cap:False`) the capped mode.
//!
//! Files: `config.rs`, `memory_fraction_key.rs`, `budget_rules.rs`, `capped_repage.rs`,
//! `far_limit.rs`, `giant_ranges.rs`, `async_release.rs`, `keep_while_behind.rs`,
//! `move_pages.rs`, `repage_moved.rs`, `plans.rs`, `split_footprints.rs`,
//! `small_partial_slack.rs`, `policy_outside.rs`.

#[path = "../common/mod.rs"]
#[allow(dead_code)]
mod common;

mod async_release;
mod budget_rules;
mod capped_repage;
mod config;
mod far_limit;
mod giant_ranges;
mod keep_while_behind;
mod memory_fraction_key;
mod move_pages;
mod plans;
mod policy_outside;
mod repage_moved;
mod small_partial_slack;
mod split_footprints;
