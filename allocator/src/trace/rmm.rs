//! RMM's `logging_resource_adaptor` CSV.

use super::{Trace, TraceError};
use std::io::BufRead;
use std::path::Path;

/// Reads an RMM log.
pub fn read(path: &Path, _r: impl BufRead) -> Result<Trace, TraceError> {
    Err(TraceError::file(path, "RMM logs are not supported yet"))
}
