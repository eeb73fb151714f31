//! Every lock and atomic the allocator uses, in one place, so that a model checker can stand in
//! for them: built with `RUSTFLAGS="--cfg loom"`, the locks, atomics and thread locals
//! below are loom's, and `allocator/tests/loom.rs` explores the interleavings of the concurrent
//! pieces (stream shards, the live table, thread caches, the shared reserved counter).

pub use crossbeam_utils::CachePadded;
/// Reference counting is not modelled: `Arc` is std's in both builds.
pub use std::sync::Arc;

#[cfg(not(loom))]
pub use parking_lot::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub use std::thread_local;

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub use loom::thread_local;
#[cfg(loom)]
pub use loom_mutex::{Mutex, MutexGuard};

/// A process-wide counter for ids: a plain atomic even under loom (ids only need to be
/// distinct, and loom atomics cannot live in statics).
pub type IdCounter = std::sync::atomic::AtomicU64;

#[cfg(loom)]
mod loom_mutex {
    /// loom's mutex with parking_lot's interface (no poisoning).
    #[derive(Debug, Default)]
    pub struct Mutex<T>(loom::sync::Mutex<T>);

    /// The guard of [`Mutex`].
    pub type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

    impl<T> Mutex<T> {
        /// A new mutex.
        pub fn new(t: T) -> Self {
            Mutex(loom::sync::Mutex::new(t))
        }

        /// Locks it.
        pub fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }

        /// Locks it if no other thread holds it.
        pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            match self.0.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        }

        /// True while a thread holds it (parking_lot's `is_locked`).
        pub fn is_locked(&self) -> bool {
            self.try_lock().is_none()
        }

        /// The value, consuming the mutex.
        pub fn into_inner(self) -> T {
            self.0.into_inner().unwrap_or_else(|e| e.into_inner())
        }
    }
}
