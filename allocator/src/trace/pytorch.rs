//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot()`): reading `device_traces`.

use super::{Trace, TraceError};
use std::path::Path;

/// Reads the `device_traces` of a snapshot pickle.
pub fn read_snapshot(path: &Path, _bytes: &[u8]) -> Result<Trace, TraceError> {
    Err(TraceError::file(
        path,
        "PyTorch snapshot pickles are not supported yet",
    ))
}
