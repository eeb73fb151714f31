//! Fuzz target `trace_file`: `cudalloc_trace::read`, the reader users call, on arbitrary file
//! contents: gzip (one member, several, cut short, corrupt, with trailing data) or plain, and
//! then whichever of our CSV, RMM's log or a snapshot pickle the content is taken for. It must
//! return a trace or an error with a message, never panic or run away with memory; a trace it
//! returns must be well formed and replay under every policy with the pool's invariants
//! holding. Seeds: gzip'd traces of each format (`seeds/trace_file`).

#![no_main]

use libfuzzer_sys::fuzz_target;
use std::io::Write;

fuzz_target!(|data: &[u8]| cudalloc_fuzz::tolerating_known_bugs(|| {
    // One file per fuzzing process, rewritten for every input.
    let path = std::env::temp_dir().join(format!("cudalloc-fuzz-{}.trace", std::process::id()));
    let mut f = std::fs::File::create(&path).expect("temporary file");
    f.write_all(data).expect("temporary file");
    drop(f);
    match cudalloc_trace::read(&path) {
        Ok(t) => {
            cudalloc_fuzz::check_trace(&t);
            cudalloc_fuzz::replay_all(&t, data.len() as u8);
        }
        Err(e) => {
            // A gzip'd input's lines are those of its content, which can be far more than its
            // bytes: only plain input bounds the line an error names.
            let gzip = data.starts_with(&[0x1f, 0x8b]);
            let bound = if gzip {
                u64::MAX
            } else {
                data.len() as u64 + 1
            };
            cudalloc_fuzz::check_error(&e, bound);
        }
    }
}));
