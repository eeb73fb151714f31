//! Gzip'd traces: a reader of one or more gzip members whose errors say what is wrong.
//!
//! Rules (`gzip -d` takes the same files, save the last):
//! - members follow each other (`cat a.gz b.gz`); the output is their contents in order;
//! - a file that ends inside a member is [`GzipError::Truncated`];
//! - a member whose deflate data, header or checksum is bad is [`GzipError::Corrupt`];
//! - bytes after the last member that do not start another one (gzip's magic `1f 8b`) are
//!   [`GzipError::TrailingData`]: an error, where `gzip -d` warns and drops them, since a trace
//!   with something appended is not the trace that was written.
//!
//! The errors reach the readers as [`io::Error`]s that carry a [`GzipError`] ([`cause`]), whose
//! text is the [`GzipError`]'s.

use flate2::bufread::GzDecoder;
use std::fmt;
use std::io::{self, BufRead, Read};

/// What was wrong with a gzip stream.
#[derive(Debug)]
pub enum GzipError {
    /// The file ends inside a member.
    Truncated,
    /// A member's data, header or checksum is bad.
    Corrupt(String),
    /// Bytes after the last member that are not a gzip member.
    TrailingData,
}

impl fmt::Display for GzipError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GzipError::Truncated => write!(f, "truncated gzip stream (the file ends inside it)"),
            GzipError::Corrupt(e) => write!(f, "corrupt gzip stream: {e}"),
            GzipError::TrailingData => write!(f, "trailing data after the gzip stream"),
        }
    }
}

impl std::error::Error for GzipError {}

/// The [`GzipError`] a read error carries, if it is one.
pub fn cause(e: &io::Error) -> Option<&GzipError> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<GzipError>())
}

/// Decompresses gzip members one after another; see the module documentation.
pub struct Members<R: BufRead> {
    /// `None` once the input is used up or has failed.
    member: Option<GzDecoder<R>>,
}

impl<R: BufRead> Members<R> {
    /// A reader of the members in `r` (which starts with the first one).
    pub fn new(r: R) -> Self {
        Members {
            member: Some(GzDecoder::new(r)),
        }
    }

    /// After a member: starts the next one, or ends at the end of the input.
    fn next_member(&mut self) -> io::Result<bool> {
        let Some(done) = self.member.take() else {
            return Ok(false);
        };
        let mut rest = done.into_inner();
        let head = rest.fill_buf()?;
        match head {
            [] => Ok(false),
            [0x1f] | [0x1f, 0x8b, ..] => {
                self.member = Some(GzDecoder::new(rest));
                Ok(true)
            }
            _ => Err(failure(GzipError::TrailingData)),
        }
    }
}

impl<R: BufRead> Read for Members<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            let Some(member) = self.member.as_mut() else {
                return Ok(0);
            };
            match member.read(buf) {
                Ok(0) => {
                    if !self.next_member()? {
                        return Ok(0);
                    }
                }
                Ok(n) => return Ok(n),
                Err(e) => {
                    self.member = None;
                    return Err(classify(e));
                }
            }
        }
    }
}

fn classify(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => failure(GzipError::Truncated),
        _ => failure(GzipError::Corrupt(e.to_string())),
    }
}

fn failure(g: GzipError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gz(text: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(text).unwrap();
        e.finish().unwrap()
    }

    fn read_all(bytes: &[u8]) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        Members::new(bytes)
            .read_to_end(&mut out)
            .map(|_| out)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn members_in_a_row_read_as_one() {
        let mut two = gz(b"first\n");
        two.extend(gz(b"second\n"));
        assert_eq!(read_all(&two).unwrap(), b"first\nsecond\n");
        assert_eq!(read_all(&gz(b"")).unwrap(), b"");
    }

    #[test]
    fn truncation_corruption_and_trailing_data_are_told_apart() {
        let whole = gz(b"action,addr,size,stream,time_us\n");
        for cut in [1, 5, 10, whole.len() - 4, whole.len() - 1] {
            let e = read_all(&whole[..cut]).unwrap_err();
            assert!(e.starts_with("truncated gzip stream"), "cut {cut}: {e}");
        }
        let mut bad_crc = whole.clone();
        let n = bad_crc.len();
        bad_crc[n - 8] ^= 1;
        let e = read_all(&bad_crc).unwrap_err();
        assert!(e.starts_with("corrupt gzip stream"), "{e}");
        for tail in [&b"garbage\n"[..], b"\0\0\0\0", b"\x1f\x00"] {
            let mut t = whole.clone();
            t.extend_from_slice(tail);
            let e = read_all(&t).unwrap_err();
            assert_eq!(e, "trailing data after the gzip stream", "{tail:?}");
        }
    }
}
