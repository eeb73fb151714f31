//! Tags through the C ABI: each thread has a stack of tags (`cudalloc_tag_push`,
//! `cudalloc_tag_pop`), and its `cudalloc_malloc` calls allocate in the tag on top
//! ([`CachingAllocator::allocate_tagged`]); with none, they allocate untagged memory as before.
//! A free needs no tag: the allocator finds it from the pointer's live entry. Lists of tags
//! (`cudalloc_sleep`, `cudalloc_wake`) are one string, the tags separated by commas.
//!
//! A tag is 1 to [`MAX_TAG`] bytes of UTF-8 without a comma or a control character (so that a
//! list and the JSON of `cudalloc_tag_stats_json` spell it unambiguously).

use crate::api::malloc_error_kind;
use crate::error::ErrorKind;
use cudalloc_core::{AllocError, Allocation, CachingAllocator};
use cudalloc_sys::ffi::CStrArg;
use cudalloc_sys::{Device, StreamId};
use std::cell::RefCell;

/// The longest tag, in bytes.
pub const MAX_TAG: usize = 255;

thread_local! {
    /// This thread's tags, innermost last.
    static STACK: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Checks one tag's spelling; `what` names the argument in the message.
fn check(tag: &str, what: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("{what} {tag:?}: {why}"));
    if tag.is_empty() {
        return bad("a tag is not empty");
    }
    if tag.len() > MAX_TAG {
        return bad(&format!("a tag has at most {MAX_TAG} bytes"));
    }
    if tag.contains(',') {
        return bad("a tag has no comma (commas separate the tags of a list)");
    }
    if tag.chars().any(char::is_control) {
        return bad("a tag has no control character");
    }
    Ok(())
}

/// The string `arg`, which must be UTF-8; `what` names it in the message.
fn text<'a>(arg: CStrArg<'a>, what: &str) -> Result<Option<&'a str>, String> {
    match arg.to_bytes() {
        None => Ok(None),
        Some(b) => std::str::from_utf8(b)
            .map(Some)
            .map_err(|_| format!("{what} is not valid UTF-8")),
    }
}

/// Makes `tag` this thread's tag until the matching [`pop`].
pub(crate) fn push(tag: CStrArg<'_>) -> Result<(), String> {
    let tag = text(tag, "the tag")?.ok_or("the tag is NULL")?;
    check(tag, "tag")?;
    STACK
        .try_with(|s| s.borrow_mut().push(tag.to_string()))
        .map_err(|_| TEARDOWN.to_string())
}

/// The error of a tag call while the thread's thread-locals are being destroyed.
const TEARDOWN: &str = "this thread is exiting: its tags are gone";

/// Drops this thread's innermost tag, making the one pushed before it current again.
pub(crate) fn pop() -> Result<(), String> {
    STACK
        .try_with(|s| s.borrow_mut().pop())
        .map_err(|_| TEARDOWN.to_string())?
        .map(drop)
        .ok_or_else(|| "no tag was pushed on this thread".to_string())
}

/// This thread's tag (innermost), if any; none while the thread's thread-locals are being
/// destroyed (a destructor of the caller's may still allocate then).
pub fn current() -> Option<String> {
    STACK
        .try_with(|s| s.borrow().last().cloned())
        .ok()
        .flatten()
}

/// Tags pushed on this thread and not popped (0 while its thread-locals are being destroyed).
pub fn depth() -> usize {
    STACK.try_with(|s| s.borrow().len()).unwrap_or(0)
}

/// The tags of the comma-separated list `arg`; NULL or "" is the empty list.
pub(crate) fn list(arg: CStrArg<'_>, what: &str) -> Result<Vec<String>, String> {
    let Some(s) = text(arg, what)? else {
        return Ok(Vec::new());
    };
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|t| check(t, &format!("{what}: tag")).map(|()| t.to_string()))
        .collect()
}

/// Allocates `size` bytes on `stream` in this thread's tag, or untagged without one. Out of
/// memory, `release` gives back memory held elsewhere on the device (true when it gave any),
/// and then the allocation tries once more, as part of the same allocation ([`with_retry`]).
pub fn allocate<D: Device>(
    alloc: &CachingAllocator<D>,
    size: u64,
    stream: StreamId,
    tag: Option<&str>,
    release: &dyn Fn() -> bool,
) -> Result<Allocation, AllocError> {
    with_retry(
        |again| allocate_once(alloc, size, stream, tag, again),
        release,
    )
}

/// One try of [`allocate`]: the first, or (`again`) the second, after memory elsewhere was given
/// back ([`CachingAllocator::allocate_again`]: it counts no out-of-memory event of its own, and
/// takes back the first try's when it succeeds).
pub fn allocate_once<D: Device>(
    alloc: &CachingAllocator<D>,
    size: u64,
    stream: StreamId,
    tag: Option<&str>,
    again: bool,
) -> Result<Allocation, AllocError> {
    match (tag, again) {
        (Some(t), false) => alloc.allocate_tagged(size, stream, t),
        (Some(t), true) => alloc.allocate_tagged_again(size, stream, t),
        (None, false) => alloc.allocate(size, stream),
        (None, true) => alloc.allocate_again(size, stream),
    }
}

/// `attempt(false)`; when that runs out of memory and `release` gives memory back, then
/// `attempt(true)`, whose outcome is returned. `release` runs between the tries, so a caller can
/// keep what it records of each try apart from the release's own driver calls.
pub fn with_retry<T>(
    mut attempt: impl FnMut(bool) -> Result<T, AllocError>,
    release: &dyn Fn() -> bool,
) -> Result<T, AllocError> {
    match attempt(false) {
        Err(e) if malloc_error_kind(&e) == ErrorKind::OutOfMemory => {
            if !release() {
                return Err(e);
            }
            attempt(true)
        }
        other => other,
    }
}

/// `alloc.sleep` with owned lists.
pub fn sleep<D: Device>(
    alloc: &CachingAllocator<D>,
    tags: &[String],
    offload: &[String],
) -> Result<(), AllocError> {
    let tags: Vec<&str> = tags.iter().map(String::as_str).collect();
    let offload: Vec<&str> = offload.iter().map(String::as_str).collect();
    alloc.sleep(&tags, &offload)
}

/// `alloc.wake` with an owned list. Out of memory, `release` gives back memory held elsewhere
/// on the device (true when it gave any: the retired private pools' caches, as for an
/// allocation), and the wake tries once more ([`with_retry`]; the tags woken by the first try
/// stay awake).
pub fn wake<D: Device>(
    alloc: &CachingAllocator<D>,
    tags: &[String],
    stream: StreamId,
    release: &dyn Fn() -> bool,
) -> Result<(), AllocError> {
    let tags: Vec<&str> = tags.iter().map(String::as_str).collect();
    with_retry(|_| alloc.wake(&tags, stream), release)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    fn arg(s: &CString) -> CStrArg<'_> {
        CStrArg::new(s)
    }

    #[test]
    fn tags_nest_per_thread_and_bad_ones_are_named() {
        assert_eq!(current(), None);
        let (w, kv) = (
            CString::new("weights").unwrap(),
            CString::new("kv").unwrap(),
        );
        push(arg(&w)).unwrap();
        push(arg(&kv)).unwrap();
        assert_eq!((current().as_deref(), depth()), (Some("kv"), 2));
        std::thread::spawn(|| assert_eq!(current(), None))
            .join()
            .unwrap();
        pop().unwrap();
        assert_eq!(current().as_deref(), Some("weights"));
        pop().unwrap();
        assert_eq!(current(), None);
        assert!(pop().unwrap_err().contains("no tag was pushed"));
        for (bad, why) in [("", "not empty"), ("a,b", "comma"), ("a\nb", "control")] {
            let e = push(arg(&CString::new(bad).unwrap())).unwrap_err();
            assert!(e.contains(why) && e.contains("tag"), "{e}");
        }
        let long = CString::new("x".repeat(MAX_TAG + 1)).unwrap();
        assert!(push(arg(&long)).unwrap_err().contains("at most 255 bytes"));
        assert!(push(CStrArg::null()).unwrap_err().contains("NULL"));
        let not_utf8 = CString::new(vec![0xff, 0xfe]).unwrap();
        assert!(push(arg(&not_utf8)).unwrap_err().contains("UTF-8"));
        assert_eq!(depth(), 0, "a refused tag is not pushed");
    }

    #[test]
    fn lists_split_on_commas_and_name_a_bad_entry() {
        let l = |s: &str| list(arg(&CString::new(s).unwrap()), "offload");
        assert_eq!(l("weights,kv").unwrap(), ["weights", "kv"]);
        assert_eq!(l("").unwrap(), Vec::<String>::new());
        assert_eq!(
            list(CStrArg::null(), "offload").unwrap(),
            Vec::<String>::new()
        );
        let e = l("weights,,kv").unwrap_err();
        assert!(e.starts_with("offload: tag \"\""), "{e}");
    }
}
