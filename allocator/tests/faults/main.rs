//! Faults and bad input: device calls that fail (every k-th, one at a time through a fixed
//! sequence, or any call in random sequences against a reference model; testing tiers 2 and 3),
//! a capped device, and every kind of bad argument at the pool and at the front.
//!
//! Invariants checked in this folder, after every operation, failed or not:
//! - a failure is a typed error (`AllocError::OutOfMemory`, `Device(_)`, or the variant naming the
//!   bad argument, with the values that explain it), never a panic;
//! - `Pool::check_invariants`, `SimDevice::check_invariants`, and device outstanding bytes == the
//!   pool's reserved bytes: nothing leaks on an error path;
//! - a free that fails leaves the allocation live, and freeing it later works;
//! - once faults are cleared the allocator works again (every size class on every stream), and
//!   dropping it leaves no segment, page, reservation or event behind;
//! - against the model: live allocations never overlap, their data reads back unchanged, and
//!   `allocation.all.current` is the number of live allocations.
//!
//! Files: `faults.rs`, `fault_sweep.rs`, `lasting.rs`, `model.rs`, `bad_input_pool.rs`, `bad_input_front.rs`
//! (with `bad_args.rs`, what the two share).

#[path = "../common/mod.rs"]
#[allow(dead_code)]
mod common;

mod bad_args;
mod bad_input_front;
mod bad_input_pool;
mod fault_sweep;
mod faults;
mod lasting;
mod model;
