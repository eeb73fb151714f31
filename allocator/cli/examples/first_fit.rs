//! A policy written outside cudalloc, replayed on the bundled traces beside `torch` and
//! `default`, in the table `cudalloc replay` prints:
//!
//! ```sh
//! cargo run --release -p cudalloc-cli --example first_fit [TRACE...]
//! ```
//!
//! The policy is address-ordered first fit (as in many classic malloc implementations and in
//! RMM's `fixed_size` and `pool` resources' free lists): a request takes the free block of its
//! stream and pool with the lowest address that holds it, split when the rest is worth keeping,
//! and new memory comes as one fixed segment per miss, sized as PyTorch sizes them. Everything
//! else (rounding, size classes, the out-of-memory ladder, statistics, invariants) is cudalloc's
//! core, which also checks every block the policy hands out. The ns/op and Mlines/s columns
//! time one replay each (the command times the median of warm replays).

use cudalloc::policy::BlockId;
use cudalloc::policy::{torch, Policy as Rules};
use cudalloc::policy::{Core, Request};
use cudalloc::{Config, Policy};
use cudalloc_cli::report::{Report, Run};
use cudalloc_cli::table::write_report;
use cudalloc_sys::{Device, DeviceError};
use cudalloc_trace::replay::{replay, replay_policy, ReplayOptions};
use std::error::Error;
use std::path::{Path, PathBuf};

/// Address-ordered first fit over fixed segments.
struct FirstFit;

impl Rules for FirstFit {
    fn place<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
        _may_grow: bool,
    ) -> Result<Option<BlockId>, DeviceError> {
        let index = core.free_index(req.pool);
        let lowest = index
            .at_least(req.stream.0, req.size)
            .filter_map(|(_, id)| Some((core.block(id)?.addr, id)))
            .min();
        Ok(lowest.map(|(_, id)| {
            core.unindex_free(id);
            id
        }))
    }

    fn should_split<D: Device>(&self, core: &Core<D>, id: BlockId, size: u64) -> bool {
        torch::should_split(core, id, size, false)
    }

    fn grow<D: Device>(
        &mut self,
        core: &mut Core<D>,
        req: &Request,
    ) -> Result<Option<BlockId>, DeviceError> {
        core.alloc_segment(req)
    }
}

/// The traces named on the command line, or the bundled ones.
fn traces() -> Result<Vec<PathBuf>, Box<dyn Error>> {
    let named: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    if !named.is_empty() {
        return Ok(named);
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.to_string_lossy().ends_with(".trace.csv.gz"))
        .collect();
    found.sort();
    Ok(found)
}

fn main() -> Result<(), Box<dyn Error>> {
    let opts = ReplayOptions::default();
    let torch_rules = Config::for_policy(Policy::Torch);
    let mut out = std::io::stdout().lock();
    for path in traces()? {
        let trace = cudalloc_trace::read(&path)?;
        let run = |label: &str, result| Run {
            label: label.to_string(),
            result,
            min_capacity: None,
            device_lag: 0,
        };
        let runs = vec![
            run("torch", replay(&trace, &torch_rules, &opts)),
            run(
                "default",
                replay(&trace, &Config::for_policy(Policy::Default), &opts),
            ),
            run(
                "first-fit",
                replay_policy(FirstFit, &trace, &torch_rules, &opts),
            ),
        ];
        write_report(&mut out, &Report::new(&trace, runs), None)?;
    }
    Ok(())
}
