//! Every lock and atomic the allocator uses, in one place, so that a model checker can stand in
//! for them (`--cfg loom` swaps in loom's types where they exist).

pub use crossbeam_utils::CachePadded;
pub use parking_lot::{Mutex, MutexGuard};
pub use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
pub use std::sync::Arc;
