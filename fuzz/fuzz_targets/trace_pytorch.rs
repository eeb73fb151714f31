//! Fuzz target `trace_pytorch`: PyTorch memory-snapshot pickles through
//! `cudalloc_trace::pytorch::read_snapshot` on arbitrary bytes (seeded with the fixtures
//! `allocator/tests/data/*.pickle`). It must return a trace or an error, never panic, overflow
//! the stack or run away with memory; an error's line is a trace entry number; a trace it
//! returns must be well formed and replay under every policy with the pool's invariants holding.

#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| cudalloc_fuzz::tolerating_known_bugs(|| {
    match cudalloc_trace::pytorch::read_snapshot(Path::new("fuzz.pickle"), data) {
        Ok(t) => {
            cudalloc_fuzz::check_trace(&t);
            cudalloc_fuzz::replay_all(&t, data.len() as u8);
        }
        Err(e) => {
            // Entry numbers are bounded by the input: every entry takes at least one byte.
            cudalloc_fuzz::check_error(&e, data.len() as u64);
        }
    }
}));
