//! The error of a command: a message for stderr (exit status 2), or a closed stdout; and
//! [`say!`], which writes a line to stderr.

use std::fmt;
use std::io::Write;

/// Writes a line to stderr (a note, a warning, an error), as `eprintln!` does, but never
/// panics: a stderr that cannot be written (a pipe its reader closed, `2>&1 | grep -q`; a full
/// disk) loses the line and changes neither the work nor the exit status.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::error::say_line(format_args!($($arg)*))
    };
}
pub(crate) use say;

/// The line [`say!`] writes.
pub fn say_line(line: fmt::Arguments) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Why a command could not do its work.
#[derive(Debug)]
pub enum CliError {
    /// Reported on stderr; exit status 2.
    Message(String),
    /// stdout was closed by its reader (e.g. `| head`); exit quietly.
    BrokenPipe,
}

impl CliError {
    /// An error with a message.
    pub fn msg(m: impl Into<String>) -> Self {
        CliError::Message(m.into())
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::BrokenPipe => CliError::BrokenPipe,
            _ => CliError::Message(format!("cannot write the output: {e}")),
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Message(m) => f.write_str(m),
            CliError::BrokenPipe => f.write_str("broken pipe"),
        }
    }
}
