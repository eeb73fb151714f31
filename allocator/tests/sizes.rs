//! Size classes and config parsing (testing tier 1: pure functions, no device).
//!
//! Invariants checked:
//! - `round_size` never returns less than 512 B and always a multiple of 512 B; with
//!   `roundup_power2_divisions` it rounds to the next of N equal steps between two powers of two
//!   (PyTorch's `roundup_power2_next_division`), both in the single-value and the list form;
//! - `PoolKind::for_size` puts requests up to 1 MiB in the small pool, the rest in the large one;
//! - `segment_size` is 2 MiB for small requests, 20 MiB below 10 MiB, and the request rounded up
//!   to 2 MiB from 10 MiB on;
//! - config strings: good strings parse to the expected fields; an unknown key, a missing value
//!   or a bad value is a `ConfigError` whose `key` names the key; `expandable_segments` switches
//!   between `torch` and `torch-expandable` wherever the `policy` key stands, is accepted as
//!   `True` and refused as `False` by `default`; `policy:` picks the rule set.

use cudalloc::config::DIVISION_INTERVALS;
use cudalloc::sizes::SMALL_SIZE;
use cudalloc::sizes::{round_size, round_up, segment_size, PoolKind};
use cudalloc::sizes::{LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER};
use cudalloc::{Config, ConfigError, Policy};

const KIB: u64 = 1 << 10;
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

// ---- constants ----------------------------------------------------------------------------------

#[test]
fn constants_are_pytorchs() {
    assert_eq!(MIN_BLOCK, 512);
    assert_eq!(SMALL_SIZE, MIB);
    assert_eq!(SMALL_BUFFER, 2 * MIB);
    assert_eq!(LARGE_BUFFER, 20 * MIB);
    assert_eq!(MIN_LARGE_ALLOC, 10 * MIB);
    assert_eq!(ROUND_LARGE, 2 * MIB);
}

#[test]
fn round_up_rounds_to_multiples() {
    assert_eq!(round_up(0, 512), 0);
    assert_eq!(round_up(1, 512), 512);
    assert_eq!(round_up(512, 512), 512);
    assert_eq!(round_up(513, 512), 1024);
    assert_eq!(round_up(3 * MIB + 1, 2 * MIB), 4 * MIB);
}

// ---- round_size ---------------------------------------------------------------------------------

#[test]
fn round_size_has_a_512_byte_minimum() {
    let cfg = torch();
    for size in [0, 1, 2, 100, 511, 512] {
        assert_eq!(round_size(size, &cfg), 512, "size {size}");
    }
}

#[test]
fn round_size_rounds_to_512() {
    let cfg = torch();
    let cases = [
        (513, 1024),
        (1000, 1024),
        (1024, 1024),
        (1025, 1536),
        (4097, 4608),
        (MIB - 1, MIB),
        (MIB, MIB),
        (MIB + 1, MIB + 512),
        (1_258_291, 1_258_496),
        (12 * MIB + 1, 12 * MIB + 512),
        (100 * MIB + 3, 100 * MIB + 512),
    ];
    for (size, want) in cases {
        assert_eq!(round_size(size, &cfg), want, "size {size}");
    }
}

#[test]
fn round_size_is_a_multiple_of_512_and_at_least_the_request() {
    let configs = [
        torch(),
        parse_torch("roundup_power2_divisions:4"),
        parse_torch("roundup_power2_divisions:[64:8,256:4,>:1]"),
        parse_torch("roundup_power2_divisions:2"),
    ];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let size = x % (2 * 1024 * MIB);
        for cfg in &configs {
            let r = round_size(size, cfg);
            assert!(r >= size && r >= 512, "size {size} -> {r}");
            assert_eq!(r % 512, 0, "size {size} -> {r}");
            // Never more than one division step (size / divisions) above the request.
            assert!(r - size < size.max(1024), "size {size} -> {r}");
        }
    }
}

#[test]
fn roundup_power2_divisions_4_rounds_to_quarters() {
    let cfg = parse_torch("roundup_power2_divisions:4");
    assert_eq!(cfg.roundup_power2_divisions, [4; DIVISION_INTERVALS]);
    // 1.2 MiB lies between 1 MiB and 2 MiB: quarters are 256 KiB, so 1.25 MiB.
    assert_eq!(round_size(1_258_291, &cfg), 1_310_720);
    assert_eq!(round_size(1_258_291, &cfg), MIB + MIB / 4);
    // On a division boundary: unchanged.
    assert_eq!(round_size(MIB + MIB / 2, &cfg), MIB + MIB / 2);
    assert_eq!(round_size(MIB + MIB / 2 + 1, &cfg), MIB + 3 * MIB / 4);
    // Powers of two are unchanged.
    assert_eq!(round_size(2 * MIB, &cfg), 2 * MIB);
    assert_eq!(round_size(64 * MIB, &cfg), 64 * MIB);
    // Just above a power of two: the first quarter step.
    assert_eq!(round_size(64 * MIB + 1, &cfg), 80 * MIB);
    assert_eq!(round_size(100 * MIB, &cfg), 112 * MIB);
    // Below 1 MiB the first interval's divisions apply too (4097 B -> 5 KiB instead of 4.5 KiB).
    assert_eq!(round_size(4097, &cfg), 5 * KIB);
    // Requests up to 512 * divisions keep plain 512 B rounding.
    assert_eq!(round_size(1025, &cfg), 1536);
    assert_eq!(round_size(2048, &cfg), 2048);
    assert_eq!(round_size(600, &cfg), 1024);
}

#[test]
fn roundup_power2_divisions_2_rounds_to_halves() {
    let cfg = parse_torch("roundup_power2_divisions:2");
    assert_eq!(round_size(MIB + 1, &cfg), MIB + MIB / 2);
    assert_eq!(round_size(3 * MIB, &cfg), 3 * MIB);
    assert_eq!(round_size(3 * MIB + 1, &cfg), 4 * MIB);
}

#[test]
fn roundup_power2_divisions_1_means_plain_rounding() {
    let cfg = parse_torch("roundup_power2_divisions:1");
    assert_eq!(round_size(MIB + 1, &cfg), MIB + 512);
    assert_eq!(round_size(100 * MIB + 3, &cfg), 100 * MIB + 512);
}

#[test]
fn roundup_power2_divisions_list_form() {
    let cfg = parse_torch("roundup_power2_divisions:[64:8,256:4,>:1]");
    // Index i covers sizes in [2^(20+i), 2^(21+i)); the first entry fills everything below it,
    // `>` fills everything after the last listed entry; unlisted intervals in between stay 0.
    let mut want = [0u64; DIVISION_INTERVALS];
    want[..=6].fill(8);
    want[8] = 4;
    want[9..].fill(1);
    assert_eq!(cfg.roundup_power2_divisions, want);

    assert_eq!(cfg.divisions_for(4 * KIB), 8);
    assert_eq!(cfg.divisions_for(MIB), 8);
    assert_eq!(cfg.divisions_for(100 * MIB), 8);
    assert_eq!(cfg.divisions_for(150 * MIB), 0);
    assert_eq!(cfg.divisions_for(300 * MIB), 4);
    assert_eq!(cfg.divisions_for(600 * MIB), 1);
    assert_eq!(cfg.divisions_for(1 << 40), 1);

    // 8 divisions: 1.1 MiB -> 1.125 MiB (eighths of 1 MiB), not 1.25 MiB.
    assert_eq!(round_size(1_153_434, &cfg), MIB + MIB / 8);
    assert_eq!(round_size(1_258_291, &cfg), MIB + MIB / 4);
    assert_eq!(round_size(100 * MIB, &cfg), 104 * MIB);
    // Interval 128..256 MiB is unlisted: plain 512 B rounding.
    assert_eq!(round_size(150 * MIB + 3, &cfg), 150 * MIB + 512);
    // 4 divisions between 256 and 512 MiB.
    assert_eq!(round_size(300 * MIB, &cfg), 320 * MIB);
    // 1 division from 512 MiB on: plain rounding.
    assert_eq!(round_size(600 * MIB + 3, &cfg), 600 * MIB + 512);
}

#[test]
fn roundup_power2_divisions_list_with_zero_and_spaces() {
    let cfg = parse_torch("roundup_power2_divisions: [ 1:2 , 2:0 , >:16 ]");
    assert_eq!(cfg.roundup_power2_divisions[0], 2);
    assert_eq!(cfg.roundup_power2_divisions[1], 0);
    assert!(cfg.roundup_power2_divisions[2..].iter().all(|&d| d == 16));
    assert_eq!(round_size(MIB + 1, &cfg), MIB + MIB / 2);
    assert_eq!(round_size(3 * MIB, &cfg), 3 * MIB);
    assert_eq!(round_size(4 * MIB + 1, &cfg), 4 * MIB + MIB / 4);
}

// ---- PoolKind and segment_size ------------------------------------------------------------------

#[test]
fn pool_kind_splits_at_one_mib() {
    assert_eq!(PoolKind::for_size(512), PoolKind::Small);
    assert_eq!(PoolKind::for_size(MIB - 512), PoolKind::Small);
    assert_eq!(PoolKind::for_size(MIB), PoolKind::Small);
    assert_eq!(PoolKind::for_size(MIB + 512), PoolKind::Large);
    assert_eq!(PoolKind::for_size(64 * MIB), PoolKind::Large);
    assert_eq!(PoolKind::Small.name(), "small");
    assert_eq!(PoolKind::Large.name(), "large");
}

#[test]
fn segment_size_follows_pytorch() {
    let cases = [
        (512, 2 * MIB),
        (4 * KIB, 2 * MIB),
        (MIB, 2 * MIB),
        (MIB + 512, 20 * MIB),
        (5 * MIB, 20 * MIB),
        (10 * MIB - 512, 20 * MIB),
        (10 * MIB, 10 * MIB),
        (12 * MIB, 12 * MIB),
        (12 * MIB + 512, 14 * MIB),
        (19 * MIB, 20 * MIB),
        (20 * MIB, 20 * MIB),
        (21 * MIB, 22 * MIB),
        (100 * MIB + 512, 102 * MIB),
    ];
    for (rounded, want) in cases {
        assert_eq!(segment_size(rounded), want, "rounded {rounded}");
    }
}

// ---- config parsing -----------------------------------------------------------------------------

#[test]
fn empty_string_gives_the_base() {
    assert_eq!(Config::parse("").unwrap(), Config::default());
    assert_eq!(Config::parse_onto(torch(), "").unwrap(), torch());
    assert_eq!(Config::default().policy, Policy::Default);
}

#[test]
fn for_policy_has_pytorchs_defaults() {
    let c = torch();
    assert_eq!(c.policy, Policy::Torch);
    assert_eq!(c.max_split_size, u64::MAX);
    assert_eq!(c.max_non_split_rounding, 20 * MIB);
    assert_eq!(c.roundup_power2_divisions, [0; DIVISION_INTERVALS]);
    assert_eq!(c.garbage_collection_threshold, 0.0);
}

#[test]
fn a_full_pytorch_string_parses() {
    let c = parse_torch(
        "max_split_size_mb:128,roundup_power2_divisions:[64:8,256:4,>:1],garbage_collection_threshold:0.8",
    );
    assert_eq!(c.policy, Policy::Torch);
    assert_eq!(c.max_split_size, 128 * MIB);
    assert_eq!(c.garbage_collection_threshold, 0.8);
    assert_eq!(c.roundup_power2_divisions[0], 8);
    assert_eq!(c.roundup_power2_divisions[8], 4);
    assert_eq!(c.roundup_power2_divisions[15], 1);
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
    assert_eq!(c.max_split_size, 20 * MIB);
    assert_eq!(c.max_non_split_rounding, 40 * MIB);
    assert_eq!(c.policy, Policy::Torch);
    // The `default` policy's own keys parse under it (and are refused under the others:
    // bad_input.rs).
    let c = Config::parse("fragmentation_budget:0.5,max_chunk_mb:16,layout_plans:false").unwrap();
    assert_eq!(c.fragmentation_budget, 0.5);
    assert_eq!(c.max_chunk, 16 * MIB);
    assert!(!c.layout_plans);
    assert_eq!(c.policy, Policy::Default);
}

#[test]
fn expandable_segments_switches_the_policy() {
    assert_eq!(
        parse_torch("expandable_segments:True").policy,
        Policy::TorchExpandable
    );
    assert_eq!(
        parse_torch("expandable_segments:true").policy,
        Policy::TorchExpandable
    );
    assert_eq!(
        parse_torch("expandable_segments:False").policy,
        Policy::Torch
    );
    let exp = Config::for_policy(Policy::TorchExpandable);
    let off = Config::parse_onto(exp, "expandable_segments:False").unwrap();
    assert_eq!(off.policy, Policy::Torch);
    assert_eq!(
        Config::parse("policy:torch,expandable_segments:True")
            .unwrap()
            .policy,
        Policy::TorchExpandable
    );
    assert_eq!(
        Config::parse("expandable_segments:True,policy:torch")
            .unwrap()
            .policy,
        Policy::TorchExpandable,
        "the policy key may come after it"
    );
    assert_eq!(
        Config::parse("expandable_segments:False,policy:torch-expandable")
            .unwrap()
            .policy,
        Policy::Torch
    );
    // The `default` policy always maps into expandable ranges: it takes True, refuses False.
    assert_eq!(
        Config::parse("expandable_segments:True").unwrap().policy,
        Policy::Default
    );
    let e = Config::parse("expandable_segments:False").unwrap_err();
    assert_eq!(e.key, "expandable_segments");
    assert!(e.message.contains("policy:torch"), "{e}");
}

#[test]
fn policy_key_picks_the_rule_set() {
    assert_eq!(parse_torch("policy:default").policy, Policy::Default);
    assert_eq!(Config::parse("policy:torch").unwrap().policy, Policy::Torch);
    assert_eq!(
        Config::parse("policy:torch-expandable").unwrap().policy,
        Policy::TorchExpandable
    );
    for p in Policy::ALL {
        assert_eq!(Policy::parse(p.name()).unwrap(), p);
        let c = Config::parse(&format!("policy:{}", p.name())).unwrap();
        assert_eq!(c.policy, p);
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
    assert_eq!(c.max_split_size, 64 * MIB);
    assert_eq!(c.garbage_collection_threshold, 0.6);
    // A later key overrides an earlier one.
    let c = parse_torch("max_split_size_mb:64,max_split_size_mb:32");
    assert_eq!(c.max_split_size, 32 * MIB);
}

#[test]
fn thread_cache_keys() {
    let c = Config::parse("thread_cache:True,thread_cache_mb:64,thread_cache_block_mb:8").unwrap();
    assert!(c.thread_cache_on());
    assert_eq!(
        (c.thread_cache_bytes, c.thread_cache_block),
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
    assert!(Config::default().layout_plans, "on under `default`");
    assert!(!Config::parse("layout_plans:False").unwrap().layout_plans);
    assert!(Config::parse("layout_plans:true").unwrap().layout_plans);
    let e = Config::parse("layout_plans:sometimes").unwrap_err();
    assert_eq!(e.key, "layout_plans");
    assert!(e.to_string().contains("sometimes"), "{e}");
    // The thread caches' small part takes the small pool's blocks only (1 MiB).
    assert_eq!(Config::default().thread_cache_block, 1 << 20);
}
