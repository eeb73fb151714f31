//! Config strings (pure, no device): `Config::parse`, `Config::parse_onto` and
//! `Config::from_env`.
//!
//! Checked: good strings parse to the expected fields; an unknown key, a missing value or a bad
//! value is a `ConfigError` whose `key` names the key (30 malformed strings: missing values,
//! unknown keys and policies, numbers out of range, NaN and infinity, bad division lists,
//! unbalanced brackets, separators only, a NUL, non-ASCII keys, 100,000 commas);
//! `expandable_segments` switches between `torch` and `torch-expandable` wherever the `policy`
//! key stands, is accepted as `True` and refused as `False` by `default`; `policy:` picks the
//! rule set; `CUDALLOC_CONF` unset is the default, and bad or not UTF-8 is an error naming the
//! key or the variable (the one test that sets the variable; no other test reads it).

use cudalloc::config::{DefaultConfig, PolicyConfig, DIVISION_INTERVALS};
use cudalloc::{Config, ConfigError, Policy};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

const MIB: u64 = 1 << 20;

fn torch() -> Config {
    Config::for_policy(Policy::Torch)
}

fn parse_torch(s: &str) -> Config {
    Config::parse_onto(torch(), s).unwrap_or_else(|e| panic!("`{s}` should parse: {e}"))
}

fn parse_err(s: &str) -> ConfigError {
    match Config::parse_onto(torch(), s) {
        Ok(c) => panic!("`{s}` should be refused, parsed as {c:?}"),
        Err(e) => e,
    }
}

/// The `default` policy's settings of `c`.
fn defaults(c: &Config) -> DefaultConfig {
    match c.policy_config() {
        PolicyConfig::Default(d) => *d,
        other => panic!("not the default policy: {other:?}"),
    }
}

// ---- config parsing -----------------------------------------------------------------------------

#[test]
fn empty_string_gives_the_base() {
    assert_eq!(Config::parse("").unwrap(), Config::default());
    assert_eq!(Config::parse_onto(torch(), "").unwrap(), torch());
    assert_eq!(Config::default().policy(), Policy::Default);
}

#[test]
fn for_policy_has_pytorchs_defaults() {
    let c = torch();
    assert_eq!(c.policy(), Policy::Torch);
    assert_eq!(c.pool().max_split_size, u64::MAX);
    assert_eq!(c.pool().max_non_split_rounding, 20 * MIB);
    assert_eq!(c.pool().roundup_power2_divisions, [0; DIVISION_INTERVALS]);
    assert_eq!(c.pool().garbage_collection_threshold, 0.0);
}

#[test]
fn a_full_pytorch_string_parses() {
    let c = parse_torch(
        "max_split_size_mb:128,roundup_power2_divisions:[64:8,256:4,>:1],garbage_collection_threshold:0.8",
    );
    assert_eq!(c.policy(), Policy::Torch);
    assert_eq!(c.pool().max_split_size, 128 * MIB);
    assert_eq!(c.pool().garbage_collection_threshold, 0.8);
    assert_eq!(c.pool().roundup_power2_divisions[0], 8);
    assert_eq!(c.pool().roundup_power2_divisions[8], 4);
    assert_eq!(c.pool().roundup_power2_divisions[15], 1);
}

#[test]
fn every_key_parses() {
    let c = parse_torch(
        " max_split_size_mb : 20 , max_non_split_rounding_mb:40, \
         backend:native, pinned_use_cuda_host_register:True, pinned_num_register_threads:8, \
         pinned_use_background_threads:False, release_lock_on_cudamalloc:True, \
         pinned_reserve_segment_size_mb:64, release_lock_on_hipmalloc:True, \
         pinned_use_hip_host_register:False, graph_capture_record_stream_reuse:True",
    );
    assert_eq!(c.pool().max_split_size, 20 * MIB);
    assert_eq!(c.pool().max_non_split_rounding, 40 * MIB);
    assert_eq!(c.policy(), Policy::Torch);
    // The `default` policy's own keys parse under it (and are refused under the others:
    // `malformed_configs_are_errors_naming_the_key` below).
    let c = Config::parse("fragmentation_budget:0.5,max_chunk_mb:16,layout_plans:false").unwrap();
    assert_eq!(defaults(&c).fragmentation_budget, 0.5);
    assert_eq!(defaults(&c).max_chunk, 16 * MIB);
    assert!(!defaults(&c).layout_plans);
    assert_eq!(c.policy(), Policy::Default);
}

#[test]
fn expandable_segments_switches_the_policy() {
    assert_eq!(
        parse_torch("expandable_segments:True").policy(),
        Policy::TorchExpandable
    );
    assert_eq!(
        parse_torch("expandable_segments:true").policy(),
        Policy::TorchExpandable
    );
    assert_eq!(
        parse_torch("expandable_segments:False").policy(),
        Policy::Torch
    );
    let exp = Config::for_policy(Policy::TorchExpandable);
    let off = Config::parse_onto(exp, "expandable_segments:False").unwrap();
    assert_eq!(off.policy(), Policy::Torch);
    assert_eq!(
        Config::parse("policy:torch,expandable_segments:True")
            .unwrap()
            .policy(),
        Policy::TorchExpandable
    );
    assert_eq!(
        Config::parse("expandable_segments:True,policy:torch")
            .unwrap()
            .policy(),
        Policy::TorchExpandable,
        "the policy key may come after it"
    );
    assert_eq!(
        Config::parse("expandable_segments:False,policy:torch-expandable")
            .unwrap()
            .policy(),
        Policy::Torch
    );
    // The `default` policy always maps into expandable ranges: it takes True, refuses False.
    assert_eq!(
        Config::parse("expandable_segments:True").unwrap().policy(),
        Policy::Default
    );
    let e = Config::parse("expandable_segments:False").unwrap_err();
    assert_eq!(e.key, "expandable_segments");
    assert!(e.message.contains("policy:torch"), "{e}");
}

#[test]
fn policy_key_picks_the_rule_set() {
    assert_eq!(parse_torch("policy:default").policy(), Policy::Default);
    assert_eq!(
        Config::parse("policy:torch").unwrap().policy(),
        Policy::Torch
    );
    assert_eq!(
        Config::parse("policy:torch-expandable").unwrap().policy(),
        Policy::TorchExpandable
    );
    for p in Policy::ALL {
        assert_eq!(Policy::parse(p.name()).unwrap(), p);
        let c = Config::parse(&format!("policy:{}", p.name())).unwrap();
        assert_eq!(c.policy(), p);
    }
    assert!(!Policy::Torch.is_expandable());
    assert!(Policy::TorchExpandable.is_expandable());
    assert!(Policy::Default.is_expandable());
}

#[test]
fn unknown_key_names_the_key() {
    let e = parse_err("max_split_size_mb:128,no_such_key:3");
    assert_eq!(e.key, "no_such_key");
    assert!(e.to_string().contains("no_such_key"), "{e}");
    let e = parse_err("expandable:True");
    assert_eq!(e.key, "expandable");
}

#[test]
fn bad_values_name_the_key() {
    let cases = [
        ("max_split_size_mb:abc", "max_split_size_mb"),
        ("max_split_size_mb:-5", "max_split_size_mb"),
        ("max_split_size_mb:19", "max_split_size_mb"),
        ("max_split_size_mb:", "max_split_size_mb"),
        ("max_split_size_mb", "max_split_size_mb"),
        ("max_non_split_rounding_mb:1", "max_non_split_rounding_mb"),
        (
            "garbage_collection_threshold:0",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:1",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:1.5",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:x",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:NaN",
            "garbage_collection_threshold",
        ),
        ("fragmentation_budget:2", "fragmentation_budget"),
        ("fragmentation_budget:-0.1", "fragmentation_budget"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        ("roundup_power2_divisions:0", "roundup_power2_divisions"),
        ("roundup_power2_divisions:x", "roundup_power2_divisions"),
        (
            "roundup_power2_divisions:[64:3]",
            "roundup_power2_divisions",
        ),
        (
            "roundup_power2_divisions:[63:4]",
            "roundup_power2_divisions",
        ),
        ("roundup_power2_divisions:[x:4]", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[64:8", "roundup_power2_divisions"),
        (
            "roundup_power2_divisions:[64 8]",
            "roundup_power2_divisions",
        ),
        ("expandable_segments:maybe", "expandable_segments"),
        ("expandable_segments", "expandable_segments"),
        ("max_chunk_mb:5", "max_chunk_mb"),
        ("max_chunk_mb:41", "max_chunk_mb"),
        ("max_split_size_mb 128", "max_split_size_mb"),
        ("max_split_size_mb:128,,policy:torch", ","),
        (",policy:torch", ","),
        ("backend:cudaMallocAsync", "backend"),
        ("policy:pytorch", "policy"),
        ("policy:", "policy"),
    ];
    for (s, key) in cases {
        let e = parse_err(s);
        assert_eq!(e.key, key, "`{s}`: {e}");
        assert!(e.to_string().contains(key), "`{s}`: {e}");
        assert!(!e.message.is_empty(), "`{s}`");
    }
}

#[test]
fn entries_must_be_separated_by_commas() {
    let e = parse_err("max_split_size_mb:128 garbage_collection_threshold:0.5");
    // A space ends a word: the next key stands where a comma should.
    assert_eq!(e.key, "max_split_size_mb");
    assert!(e.message.contains("garbage_collection_threshold"), "{e}");
    let e = parse_err("max_split_size_mb 128");
    assert!(e.message.contains("`128`"), "names what it found: {e}");
    let e = parse_err("max_split_size_mb:128:5");
    assert_eq!(e.key, "max_split_size_mb");
}

#[test]
fn parse_onto_keeps_the_base_fields() {
    let base = parse_torch("max_split_size_mb:64");
    let c = Config::parse_onto(base, "garbage_collection_threshold:0.6").unwrap();
    assert_eq!(c.pool().max_split_size, 64 * MIB);
    assert_eq!(c.pool().garbage_collection_threshold, 0.6);
    // A later key overrides an earlier one.
    let c = parse_torch("max_split_size_mb:64,max_split_size_mb:32");
    assert_eq!(c.pool().max_split_size, 32 * MIB);
}

#[test]
fn thread_cache_keys() {
    let c = Config::parse("thread_cache:True,thread_cache_mb:64,thread_cache_block_mb:8").unwrap();
    assert!(c.thread_cache_on());
    assert_eq!(
        (c.front().thread_cache_bytes, c.front().thread_cache_block),
        (64 << 20, 8 << 20)
    );
    assert!(!Config::parse("thread_cache:False")
        .unwrap()
        .thread_cache_on());
    assert!(!Config::for_policy(Policy::Torch).thread_cache_on());
    let e = Config::parse("thread_cache_block_mb:0").unwrap_err();
    assert_eq!(e.key, "thread_cache_block_mb");
    let e = Config::parse("thread_cache_mb:lots").unwrap_err();
    assert_eq!(e.key, "thread_cache_mb");
}

#[test]
fn layout_plans_key() {
    assert!(
        defaults(&Config::default()).layout_plans,
        "on under `default`"
    );
    assert!(!defaults(&Config::parse("layout_plans:False").unwrap()).layout_plans);
    assert!(defaults(&Config::parse("layout_plans:true").unwrap()).layout_plans);
    let e = Config::parse("layout_plans:sometimes").unwrap_err();
    assert_eq!(e.key, "layout_plans");
    assert!(e.to_string().contains("sometimes"), "{e}");
    assert!(
        defaults(&Config::default()).repage_under_cap,
        "on under `default`"
    );
    assert!(!defaults(&Config::parse("repage_under_cap:False").unwrap()).repage_under_cap);
    let e = Config::parse("policy:torch,repage_under_cap:True").unwrap_err();
    assert_eq!(e.key, "repage_under_cap");
    assert!(
        !defaults(&Config::default()).lend_blocks,
        "off under `default`"
    );
    assert!(defaults(&Config::parse("lend_blocks:True").unwrap()).lend_blocks);
    let e = Config::parse("policy:torch-expandable,lend_blocks:True").unwrap_err();
    assert_eq!(e.key, "lend_blocks");
    let e = Config::parse("lend_blocks:often").unwrap_err();
    assert_eq!(e.key, "lend_blocks");
    // The thread caches' small part takes the small pool's blocks only (1 MiB).
    assert_eq!(Config::default().front().thread_cache_block, 1 << 20);
}

// ---- malformed strings --------------------------------------------------------------------------

#[test]
fn malformed_configs_are_errors_naming_the_key() {
    let long_commas = ",".repeat(100_000);
    let cases: &[(&str, &str)] = &[
        (",", ","),
        (":", ":"),
        (":::", ":"),
        ("max_split_size_mb", "max_split_size_mb"),
        ("max_split_size_mb:", "max_split_size_mb"),
        ("max_split_size_mb:abc", "max_split_size_mb"),
        ("max_split_size_mb:-5", "max_split_size_mb"),
        ("max_split_size_mb:19", "max_split_size_mb"),
        (
            "max_split_size_mb:18446744073709551616",
            "max_split_size_mb",
        ),
        ("max_non_split_rounding_mb:1.5", "max_non_split_rounding_mb"),
        (
            "garbage_collection_threshold:1.5",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:0",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:NaN",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:inf",
            "garbage_collection_threshold",
        ),
        ("fragmentation_budget:-0.1", "fragmentation_budget"),
        ("fragmentation_budget:nan", "fragmentation_budget"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        (
            "roundup_power2_divisions:[64:3]",
            "roundup_power2_divisions",
        ),
        (
            "roundup_power2_divisions:[63:4]",
            "roundup_power2_divisions",
        ),
        ("roundup_power2_divisions:[64:4", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[x:4]", "roundup_power2_divisions"),
        ("expandable_segments:maybe", "expandable_segments"),
        ("policy:pytorch", "policy"),
        ("policy:torch max_split_size_mb:40", "policy"),
        ("backend:cudaMallocAsync", "backend"),
        ("max_chunk_mb:1", "max_chunk_mb"),
        ("max_chunk_mb:99999999", "max_chunk_mb"),
        ("policy:torch,,max_split_size_mb:40", ","),
        // Keys only `default` reads, in a string that picks another policy (either order).
        ("policy:torch,max_chunk_mb:16", "max_chunk_mb"),
        (
            "fragmentation_budget:0.05,policy:torch-expandable",
            "fragmentation_budget",
        ),
        (
            "layout_plans:false,expandable_segments:True,policy:torch",
            "layout_plans",
        ),
        ("ключ:1", "ключ"),
        ("\0:1", "\0"),
        (&long_commas, ","),
    ];
    for (s, key) in cases {
        let shown: String = s.chars().take(40).collect();
        let e = Config::parse(s).expect_err(&shown);
        assert_eq!(&e.key, key, "{shown}: {e}");
        assert!(!e.message.is_empty(), "{shown}");
        assert!(e.to_string().contains(key), "{shown}: {e}");
    }
}

// ---- CUDALLOC_CONF ------------------------------------------------------------------------------

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
