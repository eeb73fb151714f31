//! The thread-local last error (its message and its kind) and the guard every exported
//! function runs its body in.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Bytes of a thread's last-error storage, the NUL included; longer messages are cut.
const CAPACITY: usize = 1024;

thread_local! {
    /// The NUL-terminated message of the most recent failed call on this thread ("" before the
    /// first). Overwritten in place, so a pointer to it stays valid as long as the thread.
    static LAST_ERROR: RefCell<[u8; CAPACITY]> = const { RefCell::new([0; CAPACITY]) };
    /// The kind of the most recent failed call on this thread ([`ErrorKind::None`] before the
    /// first), set together with the message.
    static LAST_KIND: Cell<ErrorKind> = const { Cell::new(ErrorKind::None) };
}

/// What kind of failure the last error was: `cudalloc_last_error_kind`'s values
/// (`CUDALLOC_ERROR_*` in the header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum ErrorKind {
    /// No call on this thread has failed.
    None = 0,
    /// Any failure other than out of memory (bad input, a driver error, a bad config ...).
    Other = 1,
    /// The device or the allocator's cap could not supply the memory (address space and
    /// requests too large for any device included): the failure PyTorch reports as
    /// `torch.OutOfMemoryError`.
    OutOfMemory = 2,
    /// `cudalloc_sleep` unmapped some pages but not all (the driver refused an unmap, or a wait
    /// for the copies of later pages failed): the tag sleeps all the same (a wake restores it),
    /// with those pages still mapped; sleeping it again retries them.
    SleepIncomplete = 3,
}

/// A failure of an exported function's body: the message and its kind.
#[derive(Debug)]
pub(crate) struct Failure {
    pub message: String,
    pub kind: ErrorKind,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure {
            message,
            kind: ErrorKind::Other,
        }
    }
}

/// This thread's last error kind, as the C ABI returns it.
pub(crate) fn last_error_kind() -> c_int {
    LAST_KIND.try_with(Cell::get).unwrap_or(ErrorKind::None) as c_int
}

/// Stores `message` as this thread's last error, of kind `kind`: cut to `CAPACITY - 1` bytes
/// at a character boundary, interior NULs turned into spaces. Does nothing while the thread is
/// being torn down.
pub(crate) fn set_last_error(message: &str, kind: ErrorKind) {
    let _ = LAST_KIND.try_with(|k| k.set(kind));
    let mut end = message.len().min(CAPACITY - 1);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let _ = LAST_ERROR.try_with(|e| {
        let mut buf = e.borrow_mut();
        for (dst, &b) in buf.iter_mut().zip(&message.as_bytes()[..end]) {
            *dst = if b == 0 { b' ' } else { b };
        }
        buf[end] = 0;
    });
}

/// This thread's last error message ("" if no call on this thread has failed).
pub fn last_error_message() -> String {
    LAST_ERROR
        .try_with(|e| {
            let buf = e.borrow();
            let len = buf.iter().position(|&b| b == 0).unwrap_or(CAPACITY);
            String::from_utf8_lossy(&buf[..len]).into_owned()
        })
        .unwrap_or_default()
}

/// A pointer to this thread's last error as a NUL-terminated string, valid (its content
/// changing with later failures) until the thread exits.
pub(crate) fn last_error_ptr() -> *const c_char {
    static EMPTY: &std::ffi::CStr = c"";
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr().cast::<c_char>())
        .unwrap_or(EMPTY.as_ptr())
}

/// Runs `body`, turning an `Err` or a panic into `fail` with the message stored as the last
/// error. No panic leaves this function.
pub(crate) fn guard<R>(fail: R, body: impl FnOnce() -> Result<R, String>) -> R {
    guard_kind(fail, || body().map_err(Failure::from))
}

/// [`guard`] for a body whose failures carry their kind.
pub(crate) fn guard_kind<R>(fail: R, body: impl FnOnce() -> Result<R, Failure>) -> R {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => value,
        Ok(Err(failure)) => {
            set_last_error(&failure.message, failure.kind);
            fail
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_string());
            // Dropping the payload could itself panic; leak it instead (a panic is a bug anyway).
            std::mem::forget(payload);
            set_last_error(
                &format!("internal error in cudalloc (panic): {what}"),
                ErrorKind::Other,
            );
            fail
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_and_panics_become_the_failure_value_and_a_message() {
        assert_eq!(guard(-1, || Ok(3)), 3);
        assert_eq!(last_error_message(), "");
        assert_eq!(last_error_kind(), ErrorKind::None as c_int);
        assert_eq!(guard(-1, || Err("no\0pe".to_string())), -1);
        assert_eq!(last_error_message(), "no pe");
        assert_eq!(last_error_kind(), ErrorKind::Other as c_int);
        let oom = Failure {
            message: "out of memory".into(),
            kind: ErrorKind::OutOfMemory,
        };
        assert_eq!(guard_kind(-1, || Err(oom)), -1);
        assert_eq!(last_error_kind(), ErrorKind::OutOfMemory as c_int);
        assert_eq!(guard(-1, || Err("no\0pe".to_string())), -1);
        assert_eq!(guard(-1, || Ok(4)), 4);
        assert_eq!(
            last_error_message(),
            "no pe",
            "a success keeps the last error"
        );
        let r = guard(-1, || -> Result<i32, String> { panic!("boom {}", 7) });
        assert_eq!(r, -1);
        assert_eq!(
            last_error_message(),
            "internal error in cudalloc (panic): boom 7"
        );
        let p = last_error_ptr();
        assert!(!p.is_null());
        guard(0, || Err("x".repeat(5000) + "é"));
        assert_eq!(last_error_message(), "x".repeat(CAPACITY - 1));
        assert_eq!(last_error_ptr(), p, "the storage does not move");
        guard(0, || Err(format!("{}é", "y".repeat(CAPACITY - 2))));
        assert_eq!(
            last_error_message(),
            "y".repeat(CAPACITY - 2),
            "cut at a char boundary"
        );
    }
}
