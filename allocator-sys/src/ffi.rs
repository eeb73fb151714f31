//! Pointers that arrive through the C ABI (the `cudalloc-capi` crate), read and written here so
//! that every line of `unsafe` code of the project stays in this crate.
//!
//! The C functions take plain `const char*` and `char*` + `size_t` arguments. On the Rust side
//! those arguments have the types below, which have exactly the layout of the C types
//! (`#[repr(transparent)]` over the raw pointer or the `usize`) but can only be made from valid
//! memory by safe code. That keeps the exported functions sound to call from Rust without being
//! `unsafe fn`s, and the reads and writes through them are safe methods:
//!
//! - [`CStrArg`]: a `const char*` that is null or points to a NUL-terminated string.
//! - [`CArray`], [`CArrayMut`] and [`CCount`]: arrays whose length is a separate argument
//!   (`arrays`), and [`CIn`]/[`COut`], a pointer to one value.
//! - [`CBuf`] and [`CBufLen`]: a `char*` output buffer and its length. The two carry the same
//!   brand lifetime `'id`, so a buffer can only be paired with its own length:
//!   [`with_c_buffer`] hands out one pair for a Rust byte slice, and a C caller promises in the
//!   header that `buf` is null or writable for `len` bytes.
//!
//! # What the C caller promises
//!
//! These are the preconditions the C header (`capi/include/cudalloc.h`) states; nothing on the
//! Rust side can check them:
//!
//! - a `const char*` is null, or points to a NUL-terminated string that stays valid and
//!   unchanged for the duration of the call;
//! - a `char* buf` with a `size_t len` is null, or is valid for writes of `len` bytes that no
//!   other thread touches during the call.

use std::ffi::{c_char, CStr};
use std::marker::PhantomData;

mod arrays;
pub use arrays::{with_c_arrays, with_c_arrays_mut, CArray, CArrayMut, CCount, CIn, COut};

/// An invariant lifetime: two values can only share it if they were made together.
type Brand<'id> = PhantomData<fn(&'id ()) -> &'id ()>;

/// A `const char*` argument: null, or a NUL-terminated string readable for `'a`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub struct CStrArg<'a> {
    ptr: *const c_char,
    _life: PhantomData<&'a CStr>,
}

impl<'a> CStrArg<'a> {
    /// The null pointer.
    pub const fn null() -> Self {
        CStrArg {
            ptr: std::ptr::null(),
            _life: PhantomData,
        }
    }

    /// A pointer to `s`.
    pub fn new(s: &'a CStr) -> Self {
        CStrArg {
            ptr: s.as_ptr(),
            _life: PhantomData,
        }
    }

    /// Wraps a raw pointer.
    ///
    /// # Safety
    ///
    /// `ptr` is null, or points to a NUL-terminated string that is valid for reads and not
    /// mutated for `'a`.
    pub unsafe fn from_ptr(ptr: *const c_char) -> Self {
        CStrArg {
            ptr,
            _life: PhantomData,
        }
    }

    /// True for the null pointer.
    pub fn is_null(self) -> bool {
        self.ptr.is_null()
    }

    /// The bytes of the string without its NUL; `None` for the null pointer.
    pub fn to_bytes(self) -> Option<&'a [u8]> {
        if self.ptr.is_null() {
            return None;
        }
        // SAFETY: a non-null `CStrArg<'a>` points to a NUL-terminated string valid for reads and
        // unchanged for `'a`: `new` takes it from a `&'a CStr`, `from_ptr` requires it, and a C
        // caller promises it in the header.
        let s = unsafe { CStr::from_ptr(self.ptr) };
        Some(s.to_bytes())
    }

    /// The string, if it is valid UTF-8; `None` for the null pointer or invalid UTF-8.
    pub fn to_string(self) -> Option<String> {
        self.to_bytes()
            .and_then(|b| std::str::from_utf8(b).ok())
            .map(str::to_owned)
    }
}

/// A `char*` output buffer argument. Only the [`CBufLen`] with the same brand `'id` describes
/// how many bytes it holds.
#[repr(transparent)]
#[derive(Debug)]
pub struct CBuf<'id> {
    ptr: *mut c_char,
    _brand: Brand<'id>,
}

/// The `size_t` length of a [`CBuf`] with the same brand `'id`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub struct CBufLen<'id> {
    len: usize,
    _brand: Brand<'id>,
}

impl<'id> CBuf<'id> {
    /// The null buffer (nothing is ever written through it).
    pub const fn null() -> Self {
        CBuf {
            ptr: std::ptr::null_mut(),
            _brand: PhantomData,
        }
    }

    /// Wraps a raw pointer and its length.
    ///
    /// # Safety
    ///
    /// `ptr` is null, or is valid for writes of `len` bytes for `'id` and no other code reads or
    /// writes those bytes meanwhile.
    pub unsafe fn from_raw(ptr: *mut c_char, len: usize) -> (Self, CBufLen<'id>) {
        let buf = CBuf {
            ptr,
            _brand: PhantomData,
        };
        let len = CBufLen {
            len,
            _brand: PhantomData,
        };
        (buf, len)
    }

    /// True for the null buffer.
    pub fn is_null(&self) -> bool {
        self.ptr.is_null()
    }

    /// Writes `bytes` and a terminating NUL if both fit in `len` bytes (and the buffer is not
    /// null); writes nothing otherwise. Returns `bytes.len()`, the length a caller needs (plus
    /// one for the NUL) to retry with a larger buffer.
    pub fn write_c_string(self, len: CBufLen<'id>, bytes: &[u8]) -> usize {
        let n = bytes.len();
        if self.ptr.is_null() || n >= len.len {
            return n;
        }
        let dst = self.ptr.cast::<u8>();
        // SAFETY: `self.ptr` is non-null and, paired with `len` by the shared brand, valid for
        // writes of `len.len > n` bytes that nothing else touches (see `from_raw`,
        // `with_c_buffer` and the C header). `bytes` is a distinct Rust slice, so the ranges do
        // not overlap, and `n + 1 <= len.len` bytes are written in all.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, n);
            dst.add(n).write(0);
        }
        n
    }
}

impl<'id> CBuf<'id> {
    /// Writes `bytes` if they fit in `len` bytes (and the buffer is not null); writes nothing
    /// otherwise. Returns `bytes.len()`, the length a caller needs to retry with a larger buffer.
    pub fn write_bytes(self, len: CBufLen<'id>, bytes: &[u8]) -> usize {
        let n = bytes.len();
        if self.ptr.is_null() || n > len.len {
            return n;
        }
        // SAFETY: `self.ptr` is non-null and, paired with `len` by the shared brand, valid for
        // writes of `len.len >= n` bytes that nothing else touches (see `from_raw`,
        // `with_c_buffer` and the C header); `bytes` is a distinct Rust slice, so the ranges do
        // not overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.cast::<u8>(), n) };
        n
    }
}

impl CBufLen<'_> {
    /// The length in bytes.
    pub fn get(self) -> usize {
        self.len
    }
}

/// Calls `f` with a [`CBuf`] over `out` and its length, as a C caller would pass them, and
/// returns what `f` returns. The brand keeps the pair from leaving `f` or meeting another pair.
pub fn with_c_buffer<R>(
    out: &mut [u8],
    f: impl for<'id> FnOnce(CBuf<'id>, CBufLen<'id>) -> R,
) -> R {
    // SAFETY: `out` is exclusively borrowed for the whole call and valid for writes of
    // `out.len()` bytes; the brand stops the pair from outliving `f`.
    let (buf, len) = unsafe { CBuf::from_raw(out.as_mut_ptr().cast::<c_char>(), out.len()) };
    f(buf, len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_bytes_only_when_they_fit() {
        let mut out = [b'x'; 4];
        assert_eq!(with_c_buffer(&mut out, |b, l| b.write_bytes(l, b"abcd")), 4);
        assert_eq!(&out, b"abcd");
        let mut small = [b'x'; 3];
        assert_eq!(
            with_c_buffer(&mut small, |b, l| b.write_bytes(l, b"abcd")),
            4
        );
        assert_eq!(
            &small, b"xxx",
            "nothing is written when the bytes do not fit"
        );
        assert_eq!(
            with_c_buffer(&mut [], |b, l| b.write_bytes(l, b"ab")),
            2,
            "an empty buffer gets the length needed"
        );
    }

    #[test]
    fn writes_only_when_the_string_and_its_nul_fit() {
        let mut out = [b'x'; 6];
        assert_eq!(
            with_c_buffer(&mut out, |b, l| b.write_c_string(l, b"hello")),
            5
        );
        assert_eq!(&out, b"hello\0");
        let mut small = [b'x'; 5];
        assert_eq!(
            with_c_buffer(&mut small, |b, l| b.write_c_string(l, b"hello")),
            5
        );
        assert_eq!(&small, b"xxxxx");
        let mut empty: [u8; 0] = [];
        assert_eq!(
            with_c_buffer(&mut empty, |b, l| b.write_c_string(l, b"")),
            0
        );
        assert_eq!(
            with_c_buffer(&mut out, |_, l| CBuf::null().write_c_string(l, b"a")),
            1
        );
    }

    #[test]
    fn reads_c_strings() {
        let s = c"a/b.csv";
        assert_eq!(CStrArg::new(s).to_string().as_deref(), Some("a/b.csv"));
        assert_eq!(CStrArg::null().to_bytes(), None);
        assert!(CStrArg::null().is_null());
        let bad = c"\xff";
        assert_eq!(CStrArg::new(bad).to_bytes(), Some(&b"\xff"[..]));
        assert_eq!(CStrArg::new(bad).to_string(), None);
    }
}
