//! `Config::from_env` reads `CUDALLOC_CONF` (a test binary of its own: it sets the variable).

use cudalloc::Config;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

#[test]
fn cudalloc_conf_unset_bad_and_not_utf8() {
    std::env::remove_var("CUDALLOC_CONF");
    assert_eq!(Config::from_env().unwrap(), Config::default());
    std::env::set_var("CUDALLOC_CONF", "policy:torch,bogus:1");
    assert_eq!(Config::from_env().unwrap_err().key, "bogus");
    // Not valid UTF-8: an error naming the variable, not the default policy.
    std::env::set_var("CUDALLOC_CONF", OsStr::from_bytes(b"policy:\xff"));
    let e = Config::from_env().unwrap_err();
    assert_eq!(e.key, "CUDALLOC_CONF", "{e}");
    assert!(e.to_string().contains("UTF-8"), "{e}");
}
