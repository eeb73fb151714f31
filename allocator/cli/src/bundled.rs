//! Finding the bundled traces (`traces/` at the repository root) when no TRACE is given.

use crate::error::CliError;
use std::path::{Path, PathBuf};

/// The trace files of the first `traces/` directory found, sorted by name: `./traces`, then a
/// `traces/` beside the executable or up to three directories above it, then the one next to
/// this crate's source.
pub fn find() -> Result<Vec<PathBuf>, CliError> {
    let candidates = candidates();
    for dir in &candidates {
        let files = trace_files(dir);
        if !files.is_empty() {
            return Ok(files);
        }
    }
    let looked: Vec<String> = candidates.iter().map(|d| d.display().to_string()).collect();
    Err(CliError::msg(format!(
        "no TRACE given and no bundled traces found; looked in: {}",
        looked.join(", ")
    )))
}

fn candidates() -> Vec<PathBuf> {
    let mut dirs = vec![PathBuf::from("traces")];
    if let Ok(exe) = std::env::current_exe() {
        let above = exe.ancestors().skip(1).take(4);
        dirs.extend(above.map(|d| d.join("traces")));
    }
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces"));
    dirs
}

/// Regular files in `dir` that look like traces, sorted by name (empty if `dir` is unreadable).
fn trace_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && looks_like_trace(p))
        .collect();
    files.sort();
    files
}

fn looks_like_trace(p: &Path) -> bool {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    !name.starts_with('.') && (name.contains(".csv") || name.contains(".pickle"))
}
