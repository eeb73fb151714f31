//! RMM's `logging_resource_adaptor` CSV.
//!
//! The adaptor writes the header `Thread,Time,Action,Pointer,Size,Stream`, then one line per
//! call, e.g. `140573312345856,08:23:45.123456,allocate,0x7f8a40000000,1024,0x0`:
//! - `Action` is `allocate` ([`Action::Alloc`]), `free` ([`Action::FreeCompleted`]; the spelling
//!   `deallocate` is taken too) or `allocate failure` ([`Action::Oom`]);
//! - `Pointer` is `%p`: hex with or without `0x`, `(nil)` for null; an `allocate` or `free` of
//!   a null pointer (what RMM logs for a 0-byte request) holds no memory and is read as a line
//!   and nothing more;
//! - `Size` is decimal bytes;
//! - `Stream` is hex with `0x`, or decimal without it;
//! - `Time` is the time of day `HH:MM:SS.ffffff` (`:` before the fraction is taken too), read as
//!   microseconds since midnight and carried across midnight (a jump back of more than 12 hours
//!   adds a day); seconds since the epoch (`1634567890.123456`) are taken too. A time that is
//!   neither reads as 0: the replay does not use it.
//! - `Thread` is not used.
//!
//! Fields may have spaces around them; blank lines are skipped; the header may follow a UTF-8
//! BOM. The input is streamed through a reused buffer. A wrong header, a line without six fields
//! or a field that does not parse is a [`TraceError`] naming the file and the line, and the field
//! and its value (control characters escaped: `super::shown`); a `Pointer`,
//! `Size` or `Stream` of valid digits whose value passes `u64::MAX` "overflows 64 bits".

use super::{Action, Event, Trace, TraceBuilder, TraceError};
use std::io::BufRead;
use std::path::Path;

/// The header's fields, in order.
pub const HEADER_FIELDS: [&str; 6] = ["Thread", "Time", "Action", "Pointer", "Size", "Stream"];

const DAY_US: u64 = 86_400_000_000;

/// Reads an RMM log from `r` (already decompressed).
pub fn read(path: &Path, mut r: impl BufRead) -> Result<Trace, TraceError> {
    let mut b = TraceBuilder::new(super::trace_name(path));
    let mut clock = Clock::default();
    let mut buf = Vec::with_capacity(128);
    let mut n = 0u64;
    loop {
        buf.clear();
        let got = super::read_line(path, &mut r, n + 1, &mut buf)?;
        if got == 0 {
            break;
        }
        n += 1;
        let text = std::str::from_utf8(&buf)
            .map_err(|_| TraceError::at(path, n, "not UTF-8 text"))?
            .trim();
        if n == 1 {
            check_header(text).map_err(|m| TraceError::at(path, 1, m))?;
        } else if !text.is_empty() {
            let e = parse_line(text, &mut clock).map_err(|m| TraceError::at(path, n, m))?;
            if e.addr == 0 && e.action != Action::Oom {
                // A null pointer: RMM's answer to a 0-byte request, and its free. No memory.
                b.count_line();
            } else {
                b.push(e, n);
            }
        }
    }
    if n == 0 {
        return Err(TraceError::file(path, "empty file (no header)"));
    }
    Ok(b.finish())
}

fn check_header(text: &str) -> Result<(), String> {
    let text = text.trim_start_matches('\u{feff}');
    if text.split(',').map(str::trim).eq(HEADER_FIELDS) {
        Ok(())
    } else {
        Err(format!(
            "expected RMM's header `{}`",
            HEADER_FIELDS.join(",")
        ))
    }
}

/// Parses one data line; `clock` carries the time of day across midnight.
fn parse_line(text: &str, clock: &mut Clock) -> Result<Event, String> {
    let mut fields = text.split(',').map(str::trim);
    let mut f = [""; 6];
    for (slot, name) in f.iter_mut().zip(HEADER_FIELDS) {
        *slot = fields
            .next()
            .ok_or_else(|| format!("missing field `{name}` (expected 6 fields)"))?;
    }
    if fields.next().is_some() {
        return Err("more than 6 fields".to_string());
    }
    let [_thread, time, action, pointer, size, stream] = f;
    Ok(Event {
        action: parse_action(action)?,
        addr: parse_pointer(pointer)?,
        size: field_number(size, size, 10, ("Size", "a decimal byte count"))?,
        stream: parse_stream(stream)?,
        time_us: clock.read(time),
    })
}

fn parse_action(s: &str) -> Result<Action, String> {
    match s {
        "allocate" => Ok(Action::Alloc),
        "free" | "deallocate" => Ok(Action::FreeCompleted),
        "allocate failure" => Ok(Action::Oom),
        _ => Err(format!("unknown action `{}`", super::shown(s.as_bytes()))),
    }
}

fn parse_pointer(s: &str) -> Result<u64, String> {
    if s == "(nil)" {
        return Ok(0);
    }
    let digits = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    field_number(s, digits, 16, ("Pointer", "a hex address"))
}

fn parse_stream(s: &str) -> Result<u64, String> {
    let name = ("Stream", "a hex (0x...) or decimal stream handle");
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => field_number(s, hex, 16, name),
        None => field_number(s, s, 10, name),
    }
}

/// The number `digits` (in `radix`) of field `s`, whose name and meaning are `name`: other
/// characters are "not {meaning}", a value past `u64::MAX` "overflows 64 bits".
fn field_number(s: &str, digits: &str, radix: u32, name: (&str, &str)) -> Result<u64, String> {
    let (field, what) = name;
    let shown = || super::shown(s.as_bytes());
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return Err(format!("field `{field}` is not {what}: `{}`", shown()));
    }
    u64::from_str_radix(digits, radix)
        .map_err(|_| format!("field `{field}` overflows 64 bits: `{}`", shown()))
}

fn parse_dec(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Turns `Time` fields into microseconds, carrying the time of day across midnight.
#[derive(Default)]
struct Clock {
    last: u64,
    days: u64,
}

impl Clock {
    fn read(&mut self, s: &str) -> u64 {
        if let Some(t) = time_of_day_us(s) {
            let mut at = self.days * DAY_US + t;
            if at + DAY_US / 2 < self.last {
                self.days += 1;
                at += DAY_US;
            }
            self.last = at;
            at
        } else {
            epoch_us(s).unwrap_or(0)
        }
    }
}

/// `HH:MM:SS.ffffff` or `HH:MM:SS:ffffff` as microseconds since midnight.
fn time_of_day_us(s: &str) -> Option<u64> {
    let mut parts = s.splitn(3, ':');
    let h = small(parts.next()?, 23)?;
    let m = small(parts.next()?, 59)?;
    let rest = parts.next()?;
    let (sec, frac) = rest.split_once(['.', ':']).unwrap_or((rest, ""));
    let sec = small(sec, 60)?;
    Some(((h * 60 + m) * 60 + sec) * 1_000_000 + fraction_us(frac)?)
}

/// `SECONDS[.ffffff]` since the epoch as microseconds.
fn epoch_us(s: &str) -> Option<u64> {
    let (sec, frac) = s.split_once('.').unwrap_or((s, ""));
    parse_dec(sec)?
        .checked_mul(1_000_000)?
        .checked_add(fraction_us(frac)?)
}

/// A number of at most two digits no larger than `max`.
fn small(s: &str, max: u64) -> Option<u64> {
    if s.len() > 2 {
        return None;
    }
    parse_dec(s).filter(|&v| v <= max)
}

/// Fractional-second digits as microseconds (digits past the sixth are dropped).
fn fraction_us(frac: &str) -> Option<u64> {
    if !frac.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let digits = &frac[..frac.len().min(6)];
    let v = if digits.is_empty() {
        0
    } else {
        digits.parse::<u64>().ok()?
    };
    Some(v * 10u64.pow(6 - digits.len() as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times() {
        assert_eq!(time_of_day_us("08:23:45.123456"), Some(30_225_123_456));
        assert_eq!(time_of_day_us("08:23:45:123456"), Some(30_225_123_456));
        assert_eq!(time_of_day_us("00:00:01.5"), Some(1_500_000));
        assert_eq!(time_of_day_us("25:00:00.0"), None);
        assert_eq!(epoch_us("1634567890.123456"), Some(1_634_567_890_123_456));
        let mut c = Clock::default();
        assert_eq!(c.read("23:59:59.999999"), DAY_US - 1);
        assert_eq!(c.read("00:00:00.000001"), DAY_US + 1);
        assert_eq!(c.read("not a time"), 0);
    }

    #[test]
    fn fields() {
        assert_eq!(parse_pointer("(nil)"), Ok(0));
        assert_eq!(parse_pointer("0x7f8a40000000"), Ok(0x7f8a_4000_0000));
        assert_eq!(parse_pointer("00007F8A40000000"), Ok(0x7f8a_4000_0000));
        assert!(parse_pointer("0xzz").is_err());
        assert_eq!(parse_stream("0x1f"), Ok(31));
        assert_eq!(parse_stream("31"), Ok(31));
        assert!(parse_stream("1f").is_err());
        assert_eq!(parse_action("allocate failure"), Ok(Action::Oom));
    }
}
