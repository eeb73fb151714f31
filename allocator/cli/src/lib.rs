//! The parts of the `cudalloc` command that other programs reuse: a [`report::Report`] of a
//! trace's replays, the table `cudalloc replay` prints ([`table::write_report`]) and a split
//! trace set ([`split::Split`]). A policy written in another crate is replayed with
//! `cudalloc_trace::replay::replay_policy` and set beside the built-in ones in the same table
//! (`examples/first_fit.rs`).

pub mod report;
pub mod split;
pub mod table;
