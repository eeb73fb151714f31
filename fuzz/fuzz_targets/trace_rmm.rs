//! Fuzz target `trace_rmm`: the reader of RMM's `logging_resource_adaptor` CSV on arbitrary
//! bytes. It must return a trace or an error naming a line of the input, never panic; a trace it
//! returns must be well formed and replay under every policy with the pool's invariants holding.

#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| cudalloc_fuzz::tolerating_known_bugs(|| {
    let lines = data.split(|&c| c == b'\n').count() as u64;
    match cudalloc_trace::rmm::read(Path::new("fuzz.rmm.csv"), data) {
        Ok(t) => {
            cudalloc_fuzz::check_trace(&t);
            cudalloc_fuzz::replay_all(&t, data.len() as u8);
        }
        Err(e) => cudalloc_fuzz::check_error(&e, lines),
    }
}));
