//! A bad `CUDALLOC_CONF` makes every call fail with the config error, GPU or not. Its own test
//! binary: the config is read once per process, on the first call.

use cudalloc_capi::{
    cudalloc_check, cudalloc_empty_cache, cudalloc_free, cudalloc_malloc, cudalloc_stats_json,
    last_error_message, with_c_buffer,
};

#[test]
fn a_bad_config_fails_every_call_with_its_error() {
    std::env::set_var("CUDALLOC_CONF", "policy:default,max_split_size_mb:nope");
    for _ in 0..2 {
        assert!(cudalloc_malloc(1024, 0, std::ptr::null_mut()).is_null());
        let msg = last_error_message();
        assert!(msg.contains("bad CUDALLOC_CONF"), "{msg}");
        assert!(msg.contains("max_split_size_mb"), "{msg}");
    }
    assert_eq!(cudalloc_check(), -1);
    assert!(last_error_message().starts_with("cudalloc_check: bad CUDALLOC_CONF"));
    assert_eq!(cudalloc_empty_cache(0), -1);
    assert!(last_error_message().contains("bad CUDALLOC_CONF"));
    let mut buf = [0u8; 4096];
    assert_eq!(
        with_c_buffer(&mut buf, |b, l| cudalloc_stats_json(0, b, l)),
        0
    );
    cudalloc_free(
        0x1000 as *mut std::ffi::c_void,
        512,
        0,
        std::ptr::null_mut(),
    );
    assert!(last_error_message().starts_with("cudalloc_free: bad CUDALLOC_CONF"));
}
