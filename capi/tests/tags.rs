//! Tags, sleep and wake through the C ABI. Without a GPU: the per-thread tag stack
//! (`cudalloc_tag_push`/`pop`/`depth`), the errors of bad tags and lists (each names what is
//! wrong) and of a missing device; on the simulated device with host backing: allocations made
//! under a pushed tag land in it (`tags::allocate` with `tags::current`, as `cudalloc_malloc`
//! does), a free needs no tag, `json::tag_stats` reports each tag, a sleep and a wake keep the
//! bytes. On a GPU (ignored elsewhere): the same through the exported functions, with the
//! error kind of an out-of-memory wake, and a free taken while asleep.

use cudalloc_capi::{
    cudalloc_free, cudalloc_last_error_kind, cudalloc_malloc, cudalloc_release_host_buffers,
    cudalloc_set_memory_fraction, cudalloc_sleep, cudalloc_tag_current, cudalloc_tag_depth,
    cudalloc_tag_pop, cudalloc_tag_push, cudalloc_tag_stats_json, cudalloc_wake, json,
    last_error_message, tags, with_c_buffer, CStrArg, CUDALLOC_ERROR_OTHER,
    CUDALLOC_ERROR_OUT_OF_MEMORY,
};
use cudalloc_core::{CachingAllocator, Config, Policy};
use cudalloc_sys::{CudaDevice, SimConfig, SimDevice, StreamId};
use serde_json::Value;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, MutexGuard};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn has_gpu() -> bool {
    matches!(CudaDevice::device_count(), Ok(n) if n > 0)
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn tag_stats(device: i32) -> Value {
    let mut buf = vec![0u8; 1 << 16];
    let n = with_c_buffer(&mut buf, |b, l| cudalloc_tag_stats_json(device, b, l));
    assert!(n > 0, "{}", last_error_message());
    serde_json::from_slice(&buf[..n]).unwrap()
}

/// Tag `name`'s entry in device `device`'s tag statistics.
fn tag_entry(device: i32, name: &str) -> Value {
    let stats = tag_stats(device);
    let entry = stats.as_array().unwrap().iter().find(|t| t["tag"] == name);
    entry.expect("the tag is listed").clone()
}

#[test]
fn tags_nest_on_each_thread_and_bad_tags_are_refused_with_a_reason() {
    let (w, kv) = (c("weights"), c("kv"));
    assert_eq!(cudalloc_tag_depth(), 0);
    assert_eq!(cudalloc_tag_push(CStrArg::new(&w)), 0);
    assert_eq!(cudalloc_tag_push(CStrArg::new(&kv)), 0);
    assert_eq!(cudalloc_tag_depth(), 2);
    assert_eq!(tags::current().as_deref(), Some("kv"));
    let mut buf = [b'x'; 8];
    assert_eq!(
        with_c_buffer(&mut buf, |b, l| cudalloc_tag_current(b, l)),
        2
    );
    assert_eq!(&buf[..3], b"kv\0");
    std::thread::spawn(|| assert_eq!(cudalloc_tag_depth(), 0))
        .join()
        .unwrap();
    assert_eq!(cudalloc_tag_pop(), 0);
    assert_eq!(tags::current().as_deref(), Some("weights"));
    assert_eq!(cudalloc_tag_pop(), 0);
    assert_eq!(
        with_c_buffer(&mut buf, |b, l| cudalloc_tag_current(b, l)),
        0
    );
    assert_eq!(cudalloc_tag_pop(), -1);
    assert!(last_error_message().starts_with("cudalloc_tag_pop: no tag was pushed"));
    assert_eq!(cudalloc_last_error_kind(), CUDALLOC_ERROR_OTHER);
    let bad = c("a,b");
    assert_eq!(cudalloc_tag_push(CStrArg::new(&bad)), -1);
    let msg = last_error_message();
    assert!(msg.starts_with("cudalloc_tag_push: tag \"a,b\"") && msg.contains("comma"));
    assert_eq!(cudalloc_tag_push(CStrArg::null()), -1);
    assert_eq!(cudalloc_tag_depth(), 0);
}

#[test]
fn sleep_and_wake_name_a_bad_list_and_a_missing_device() {
    let _g = serial();
    let (good, bad) = (c("weights"), c("weights,,kv"));
    assert_eq!(cudalloc_sleep(0, CStrArg::null(), CStrArg::null()), -1);
    assert_eq!(last_error_message(), "cudalloc_sleep: the tags are NULL");
    assert_eq!(
        cudalloc_sleep(0, CStrArg::new(&good), CStrArg::new(&bad)),
        -1
    );
    let msg = last_error_message();
    assert!(
        msg.starts_with("cudalloc_sleep: offload: tag \"\""),
        "{msg}"
    );
    assert_eq!(
        cudalloc_wake(0, CStrArg::new(&bad), std::ptr::null_mut()),
        -1
    );
    assert!(last_error_message().starts_with("cudalloc_wake: tags: tag \"\""));
    let per_thread = 0x2 as *mut c_void;
    assert_eq!(cudalloc_wake(0, CStrArg::new(&good), per_thread), -1);
    assert!(last_error_message().contains("cudaStreamPerThread"));
    if has_gpu() {
        return;
    }
    assert_eq!(cudalloc_sleep(0, CStrArg::new(&good), CStrArg::null()), -1);
    assert!(last_error_message().starts_with("cudalloc_sleep: no CUDA device"));
    assert_eq!(
        cudalloc_wake(0, CStrArg::new(&good), std::ptr::null_mut()),
        -1
    );
    assert!(last_error_message().starts_with("cudalloc_wake: no CUDA device"));
    assert_eq!(cudalloc_release_host_buffers(0), -1);
    let mut buf = [b'x'; 8];
    assert_eq!(
        with_c_buffer(&mut buf, |b, l| cudalloc_tag_stats_json(0, b, l)),
        0
    );
    assert!(last_error_message().starts_with("cudalloc_tag_stats_json: no CUDA device"));
}

/// What `cudalloc_malloc` does under a pushed tag, on the simulated device: the allocation is
/// the tag's, the JSON says so, a sleep and a wake keep its bytes, and an untagged allocation
/// after the pop is not the tag's.
#[test]
fn allocations_under_a_pushed_tag_sleep_and_wake_with_it_on_the_simulated_device() {
    let dev = Arc::new(SimDevice::new(
        SimConfig::with_capacity(1 << 30).host_backing(true),
    ));
    let alloc = CachingAllocator::new(dev.clone(), Config::for_policy(Policy::Default));
    let s = StreamId(4);
    let w = c("weights");
    assert_eq!(cudalloc_tag_push(CStrArg::new(&w)), 0);
    let a = tags::allocate(&alloc, 3 << 20, s, tags::current().as_deref(), &|| false).unwrap();
    assert_eq!(cudalloc_tag_pop(), 0);
    let plain = tags::allocate(&alloc, 1 << 20, s, tags::current().as_deref(), &|| false).unwrap();
    let gone = tags::allocate(&alloc, 1 << 20, s, Some("weights"), &|| false).unwrap();
    let bytes: Vec<u8> = (0..a.size()).map(|i| (i * 7 % 251) as u8).collect();
    dev.write(a.ptr(), &bytes).unwrap();

    let doc: Value = serde_json::from_str(&json::tag_stats(&alloc)).unwrap();
    assert_eq!(doc.as_array().unwrap().len(), 1, "{doc}");
    assert_eq!(doc[0]["tag"], "weights");
    assert_eq!(doc[0]["allocations"], 2);
    assert_eq!(doc[0]["requested_bytes"], 4 << 20);
    assert_eq!(doc[0]["asleep"], false);

    let names = vec!["weights".to_string()];
    tags::sleep(&alloc, &names, &names).unwrap();
    let doc: Value = serde_json::from_str(&json::tag_stats(&alloc)).unwrap();
    assert_eq!(doc[0]["asleep"], true);
    assert_eq!(doc[0]["reserved_bytes"], 0);
    assert_eq!(doc[0]["offloaded_bytes"], 4 << 20);
    assert_eq!(doc[0]["mapped_while_asleep"], 0);
    alloc.free_ptr(gone.ptr()).unwrap();
    tags::wake(&alloc, &names, s, &|| false).unwrap();
    let mut back = vec![0u8; bytes.len()];
    dev.read(a.ptr(), &mut back).unwrap();
    assert!(back == bytes, "bytes restored");
    let doc: Value = serde_json::from_str(&json::tag_stats(&alloc)).unwrap();
    assert_eq!(doc[0]["host_buffer_bytes"], 4 << 20);
    assert_eq!(
        doc[0]["allocations"], 1,
        "the free made asleep ran at the wake"
    );
    alloc.free_ptr(a.ptr()).unwrap();
    alloc.free_ptr(plain.ptr()).unwrap();
    alloc.release_host_buffers().unwrap();
    assert_eq!(dev.host_bytes(), 0);
    alloc.check_invariants().unwrap();
}

/// The exported functions on device 0 of a GPU: `cudalloc_malloc` under a tag, a sleep that
/// gives its memory back, a free taken while asleep, an out-of-memory wake under a cap, a
/// wake that restores the bytes once the cap is lifted.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_exported_functions_sleep_and_wake_a_tag_on_a_gpu() {
    let _g = serial();
    let n: usize = 256 << 20;
    let t = c("capi-weights");
    let list = CStrArg::new(&t);
    assert_eq!(cudalloc_tag_push(list), 0);
    let p = cudalloc_malloc(n, 0, std::ptr::null_mut());
    let gone = cudalloc_malloc(1 << 20, 0, std::ptr::null_mut());
    assert_eq!(cudalloc_tag_pop(), 0);
    assert!(!p.is_null() && !gone.is_null(), "{}", last_error_message());
    let dev = CudaDevice::new(0).unwrap();
    let bytes: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 13 % 241) as u8).collect();
    let last = p as u64 + n as u64 - bytes.len() as u64;
    dev.copy_to_device(p as u64, &bytes).unwrap();
    dev.copy_to_device(last, &bytes).unwrap();

    assert_eq!(cudalloc_sleep(0, list, list), 0, "{}", last_error_message());
    let me = tag_entry(0, "capi-weights");
    assert_eq!(me["asleep"], true);
    assert_eq!(me["reserved_bytes"], 0);
    assert_eq!(me["offloaded_bytes"], n as u64 + (1 << 20));
    // A free while asleep is taken; its block goes back at the wake.
    cudalloc_free(gone, 1 << 20, 0, std::ptr::null_mut());

    // No room under a tiny cap: out of memory, and the tag stays asleep.
    assert_eq!(cudalloc_set_memory_fraction(1e-6, 0), 0);
    assert_eq!(cudalloc_wake(0, list, std::ptr::null_mut()), -1);
    assert_eq!(cudalloc_last_error_kind(), CUDALLOC_ERROR_OUT_OF_MEMORY);
    assert_eq!(cudalloc_set_memory_fraction(1.0, 0), 0);
    assert_eq!(
        cudalloc_wake(0, list, std::ptr::null_mut()),
        0,
        "{}",
        last_error_message()
    );
    dev.synchronize().unwrap();
    let mut back = vec![0u8; bytes.len()];
    dev.copy_from_device(p as u64, &mut back).unwrap();
    assert!(back == bytes, "first MiB restored");
    dev.copy_from_device(last, &mut back).unwrap();
    assert!(back == bytes, "last MiB restored");
    let me = tag_entry(0, "capi-weights");
    assert_eq!(me["allocations"], 1, "the free made asleep ran at the wake");
    cudalloc_free(p, n, 0, std::ptr::null_mut());
    assert_eq!(cudalloc_release_host_buffers(0), 0);
}

/// Set in the child process of `tag_calls_while_a_thread_exits_answer_as_for_no_tag`.
const TEARDOWN_CHILD: &str = "CUDALLOC_TEST_TEARDOWN_CHILD";

/// Calls the tag functions from a thread-local's destructor, after the library's tag stack of
/// that thread was destroyed (its destructor was registered later, so it ran first).
struct CallsAtThreadExit;

impl Drop for CallsAtThreadExit {
    fn drop(&mut self) {
        let depth = cudalloc_tag_depth();
        let mut buf = [b'x'; 16];
        let n = with_c_buffer(&mut buf, |b, l| cudalloc_tag_current(b, l));
        let push = cudalloc_tag_push(CStrArg::new(&c("late")));
        let pop = cudalloc_tag_pop();
        eprintln!("at thread exit: depth {depth}, current {n}, push {push}, pop {pop}");
    }
}

thread_local! {
    static AT_EXIT: CallsAtThreadExit = const { CallsAtThreadExit };
}

/// A thread-local destructor of the caller (a C++ `thread_local`, a pthread key) may call the
/// library while the thread exits, after the library's own thread-locals are gone: the tag
/// functions then answer as for a thread without tags (a push or pop is an error, -1), rather
/// than panicking ("cannot access a Thread Local Storage value during or after destruction")
/// out of an `extern "C"` function, which aborts the process, or inside one, which prints a
/// backtrace. Runs in a child process, so that an abort fails this test instead
/// of ending the test binary.
#[test]
fn tag_calls_while_a_thread_exits_answer_as_for_no_tag() {
    if std::env::var_os(TEARDOWN_CHILD).is_some() {
        std::thread::spawn(|| {
            AT_EXIT.with(|_| ()); // its destructor is registered first, so it runs last
            assert_eq!(cudalloc_tag_push(CStrArg::new(&c("weights"))), 0);
            assert_eq!(cudalloc_tag_pop(), 0);
        })
        .join()
        .unwrap();
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "tag_calls_while_a_thread_exits_answer_as_for_no_tag",
            "--exact",
            "--nocapture",
        ])
        .env(TEARDOWN_CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(
        stderr.contains("at thread exit: depth 0, current 0, push -1, pop -1"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
