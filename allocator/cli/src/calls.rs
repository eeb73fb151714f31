//! `cudalloc replay --calls FILE.csv`: the operations that made driver calls, one CSV row each
//! (`cudalloc_trace::call_log`), for every trace under every configuration, in the order the
//! replays ran. Columns: [`HEADER`]. The file is written once every replay is done (not when
//! the output is cut short: a closed pipe, a plot that could not be written); an existing file
//! is overwritten only when it is a calls file of an earlier run.

use crate::error::{say, CliError};
use crate::replay_cmd::check_output;
use crate::report::Report;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The CSV's columns (`new_high`: 1 for an allocation that took the live bytes to a new high of
/// its replay, `CallStep::new_high`).
pub const HEADER: &str = "trace,config,op,action,bytes,stream,live_bytes,reserved_bytes,mallocs,\
                          frees,maps,unmaps,new_high";

/// The columns of a calls file written before `new_high` was added: such a file is overwritten
/// as one of this command's.
const HEADER_BEFORE_NEW_HIGH: &str =
    "trace,config,op,action,bytes,stream,live_bytes,reserved_bytes,mallocs,frees,maps,unmaps";

/// Refuses a path that does not end in `.csv`, that names one of the traces to replay (it
/// would be overwritten), or that cannot be written; before the replays.
pub fn check_path(path: &Path, traces: &[PathBuf]) -> Result<(), CliError> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase());
    let name = name.unwrap_or_default();
    if !name.ends_with(".csv") || name.len() == ".csv".len() {
        return Err(CliError::msg(format!(
            "--calls writes a CSV file; give it a file name ending in .csv, not {}",
            path.display()
        )));
    }
    let same = |t: &PathBuf| match (path.canonicalize(), t.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if let Some(t) = traces.iter().find(|t| same(t)) {
        return Err(CliError::msg(format!(
            "--calls {} is a trace this replays ({}): it would be overwritten",
            path.display(),
            t.display()
        )));
    }
    // `--calls` takes a value: `--calls run.csv` with the name forgotten would overwrite the
    // trace `run.csv`. Only a calls file of an earlier run is overwritten.
    if path.exists() && !is_calls_file(path) {
        return Err(CliError::msg(format!(
            "--calls {} exists and is not a calls file of an earlier run (its first line is \
             not `{HEADER}`, nor the same without `,new_high`): it would be overwritten; give a \
             new name or remove it",
            path.display()
        )));
    }
    check_output(path, "the driver calls")
}

/// True when the first line of the file at `path` is [`HEADER`] or [`HEADER_BEFORE_NEW_HIGH`].
fn is_calls_file(path: &Path) -> bool {
    use std::io::BufRead;
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let mut first = String::new();
    let read = std::io::BufReader::new(file).read_line(&mut first);
    read.is_ok() && [HEADER, HEADER_BEFORE_NEW_HIGH].contains(&first.trim_end())
}

/// Writes the calls of every replay in `reports` to `path`, and says where on stderr.
pub fn write(path: &Path, reports: &[Report]) -> Result<(), CliError> {
    let fail = |e: std::io::Error| {
        CliError::msg(format!(
            "cannot write the driver calls to {}: {e}",
            path.display()
        ))
    };
    let file = std::fs::File::create(path).map_err(fail)?;
    let mut out = BufWriter::new(file);
    let rows = rows(&mut out, reports).map_err(fail)?;
    out.flush().map_err(fail)?;
    let (high, all) = calls_at_new_highs(reports);
    say!(
        "driver calls of {rows} operations written to {} ({high} of the {all} calls made by \
         allocations that took the live bytes to a new high)",
        path.display()
    );
    Ok(())
}

/// The driver calls of every replay in `reports` made by allocations to a new high of the live
/// bytes, and all of them (the rows' sums).
fn calls_at_new_highs(reports: &[Report]) -> (u64, u64) {
    let steps = reports
        .iter()
        .flat_map(|r| &r.runs)
        .flat_map(|run| &run.result.calls);
    steps.fold((0, 0), |(high, all), s| {
        let n = s.calls.total();
        (high + if s.new_high { n } else { 0 }, all + n)
    })
}

/// Writes the header and one row per step; returns the rows written.
fn rows(out: &mut impl Write, reports: &[Report]) -> std::io::Result<usize> {
    writeln!(out, "{HEADER}")?;
    let mut n = 0;
    for r in reports {
        for run in &r.runs {
            for s in &run.result.calls {
                let action = if s.alloc { "alloc" } else { "free" };
                let c = s.calls;
                writeln!(
                    out,
                    "{},{},{},{action},{},{},{},{},{},{},{},{},{}",
                    quoted(&r.name),
                    quoted(&run.label),
                    s.op,
                    s.bytes,
                    s.stream,
                    s.live,
                    s.reserved,
                    c.mallocs,
                    c.frees,
                    c.maps,
                    c.unmaps,
                    u8::from(s.new_high)
                )?;
                n += 1;
            }
        }
    }
    Ok(n)
}

/// A CSV field: quoted when it holds a comma, a quote or a line break (a configuration label
/// holds commas; a trace's name comes from its file's).
fn quoted(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A calls file of this command or of one before `new_high` is overwritten; another CSV is
    /// not.
    #[test]
    fn calls_files_of_either_header_are_recognised() {
        let dir = std::env::temp_dir().join(format!("cudalloc-calls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.csv");
        for (first, is) in [
            (HEADER, true),
            (HEADER_BEFORE_NEW_HIGH, true),
            ("action,addr,size,stream", false),
        ] {
            std::fs::write(&file, format!("{first}\n1,2\n")).unwrap();
            assert_eq!(is_calls_file(&file), is, "{first}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
