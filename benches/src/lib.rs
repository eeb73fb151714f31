//! Shared pieces of the benchmarks: the alloc/free loop run by many threads.
//!
//! `pairs` runs `threads` threads that each run an allocate-and-free pair `iters` times, each on
//! its own stream or all on one stream, and returns the wall time of the whole run: throughput
//! is `threads * iters / time`. What a pair allocates (sizes, blocks kept live) is the caller's
//! closure.

use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Where the threads allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Streams {
    /// Each thread on its own stream.
    Own,
    /// All threads on one stream.
    Shared,
}

/// Runs `threads` threads doing `iters` alloc+free pairs each with `pair(stream)` (the stream
/// handle: the thread's own, or one for all under [`Streams::Shared`]), and returns the wall
/// time from the moment all threads started.
pub fn pairs<F>(threads: usize, streams: Streams, iters: u64, pair: F) -> Duration
where
    F: Fn(u64) + Sync,
{
    let barrier = Barrier::new(threads);
    let start = std::sync::Mutex::new(None::<Instant>);
    let elapsed = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, start, pair) = (&barrier, &start, &pair);
                s.spawn(move || {
                    let stream = match streams {
                        Streams::Own => 0x1000 + t as u64 * 0x40,
                        Streams::Shared => 0x1000,
                    };
                    barrier.wait();
                    start.lock().unwrap().get_or_insert_with(Instant::now);
                    for _ in 0..iters {
                        pair(stream);
                    }
                    Instant::now()
                })
            })
            .collect();
        let ends: Vec<Instant> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let first = start.lock().unwrap().expect("threads ran");
        ends.into_iter()
            .map(|e| e - first)
            .max()
            .unwrap_or_default()
    });
    elapsed
}
