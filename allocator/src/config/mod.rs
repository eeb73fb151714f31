//! Configuration: a [`Config`] is the rule set with its own settings ([`PolicyConfig`]), the
//! settings every policy shares ([`PoolConfig`]) and those of the thread-safe front
//! ([`FrontConfig`]). It is built in code ([`Config::for_policy`], [`Config::new`] and the
//! `with_*` methods, each of which validates what it is given) or parsed from a string in
//! PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax plus cudalloc's own keys ([`Config::parse`]).
//! Either way a `Config` holds only values its keys accept (invariant).
//!
//! A config string is a comma-separated list of `key:value` entries, for example
//! `max_split_size_mb:128,roundup_power2_divisions:[64:8,256:4,>:1],garbage_collection_threshold:0.8`.
//! The environment variable `CUDALLOC_CONF` is read by [`Config::from_env`].
//!
//! | key | value | meaning |
//! | --- | --- | --- |
//! | `policy` | `torch`, `torch-expandable`, `default` | the rule set (see [`Policy`]) |
//! | `max_split_size_mb` | integer >= 20 | blocks this large are never split (PyTorch) |
//! | `max_non_split_rounding_mb` | integer >= 20 | how much larger an unsplit oversize block may be than the request (PyTorch) |
//! | `roundup_power2_divisions` | power of two, or `[MB:div,...,>:div]` | rounding of request sizes (PyTorch) |
//! | `garbage_collection_threshold` | 0 < x < 1 | free old cached segments above this fraction of the memory limit (PyTorch) |
//! | `per_process_memory_fraction` | 0 <= x <= 1 | cap the memory held from each device at this fraction of it, as `set_memory_fraction` does; 1 sets no cap (PyTorch 2.10) |
//! | `expandable_segments` | `True`/`False` | PyTorch's expandable segments: with `policy:torch` or `policy:torch-expandable`, picks between the two; `True` is accepted by `default` (which always maps pages into expandable ranges), `False` is refused there |
//! | `fragmentation_budget` | 0 <= x <= 1 | `default` policy: cached bytes allowed above the peak live bytes, as a fraction of it (ten times it under a memory cap, within the cap; a small-pool growth may pass the budget, never the cap, by a page) |
//! | `max_chunk_mb` | even integer >= 2 (whole 2 MiB pages) | `default` policy: largest physical chunk mapped in one call (the memory vs driver-call knob), but for a giant request that finds no cached block (16 chunks and 640 MiB or more; under a memory cap 8 and 320 MiB, with `repage_under_cap` on), mapped as one chunk on a range of its own |
//! | `layout_plans` | `True`/`False` | `default` policy: place a sequence of large allocations that repeats at another scale by a packing of its last repetition (default: on) |
//! | `repage_under_cap` | `True`/`False` | `default` policy under a memory cap: when a growth still does not fit at the end of the out-of-memory ladder, make chunks that live blocks keep mapped again from their live pages only, so their free pages go back (waits for the device and copies live bytes device to device; default: on). Off: a capped pool maps single pages instead and never moves bytes; turn it off when other threads may launch work on this allocator's memory while one allocates (a kernel could then fault or lose its writes; docs/policies.md) |
//! | `lend_blocks` | `True`/`False` | `default` policy: a request that would make its stream's pool grow may take a free block cached for another stream instead, when that stream has completed all its work (checked with an event, never waited for); the block returns to its own stream's cache once the borrowing stream's work before the free completes (default: off: on a GPU it reserved more on both programs of several streams it was run on, docs/threads.md) |
//! | `shareable_segments` | `True`/`False` | create expandable segments' pages exportable as POSIX file descriptors, so that an allocation can be shared with another process (`CachingAllocator::share`; default off; refused with `policy:torch`, and by `CachingAllocator::try_new` on a device that cannot export) |
//! | `thread_cache` | `True`/`False` | keep a few freed blocks per thread and reuse them without locking (default: on for `default`, off for the PyTorch policies) |
//! | `thread_cache_mb` | integer | bytes a thread cache's small part holds at most (default 2); cached blocks count as allocated, so more is faster but reserves more, and the `default` policy's placement changes (docs/threads.md) |
//! | `thread_cache_block_mb` | integer >= 1 | largest block a thread cache's small part takes (default 1: the small pool's blocks) |
//! | `thread_cache_large` | integer 0..=4 | blocks of any size below `max_split_size` a thread cache keeps besides (the last freed; default 1); each thread may hold this many blocks beyond `thread_cache_mb` |
//! | `backend` | `native` | accepted for PyTorch compatibility (`cudaMallocAsync` is refused) |
//! | `pinned_use_cuda_host_register`, `pinned_use_hip_host_register`, `pinned_num_register_threads`, `pinned_use_background_threads`, `pinned_reserve_segment_size_mb`, `release_lock_on_cudamalloc`, `release_lock_on_hipmalloc` | any | accepted and ignored: they concern host memory or locking, not the device pool (their values are not checked, as PyTorch does) |
//! | `graph_capture_record_stream_reuse` | any | accepted and ignored: during a capture the allocator always keeps a block used on other streams from reuse until the capture ends (`pool::capture`) |
//!
//! `True`/`False` values are also taken as `true`/`false` and `1`/`0` (PyTorch takes only
//! `True`/`False`). Without a `policy` key, [`Config::parse`] gives the `default` policy. A key given twice takes
//! its last value, as in PyTorch. Spaces around words are dropped; a space inside a word
//! separates it, so `max_split_size_mb 128` is an error, not the key `max_split_size_mb128`.
//!
//! An unknown key, a missing value or a bad value is a [`ConfigError`] that names the key; so
//! is an entry written `key=value` (the error says to write `key:value`), and a key of the
//! `default` policy (`fragmentation_budget`, `max_chunk_mb`, `layout_plans`, `repage_under_cap`,
//! `lend_blocks`) in a string that picks another policy, which would ignore it.

mod parse;

pub use crate::error::ConfigError;
pub use crate::policy::{DefaultConfig, PolicyConfig};
pub use crate::pool::config::{PoolConfig, DIVISION_INTERVALS};
use parse::Draft;

/// The name of a built-in rule set (the `policy` key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Policy {
    /// PyTorch's caching allocator, rule for rule.
    Torch,
    /// PyTorch's caching allocator with `expandable_segments:True`.
    TorchExpandable,
    /// cudalloc's own: one growable virtual range per pool and stream, 2 MiB pages mapped in
    /// batches, cached pages released once they exceed a fragmentation budget.
    Default,
}

impl Policy {
    /// Every policy, in the order reports list them.
    pub const ALL: [Policy; 3] = [Policy::Torch, Policy::TorchExpandable, Policy::Default];

    /// The policy's name as the command line and config strings spell it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Torch => "torch",
            Policy::TorchExpandable => "torch-expandable",
            Policy::Default => "default",
        }
    }

    /// Parses a policy name.
    pub fn parse(s: &str) -> Result<Policy, ConfigError> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                ConfigError::new(
                    "policy",
                    format!("unknown policy `{s}` (expected torch, torch-expandable or default)"),
                )
            })
    }

    /// True when the policy maps pages into reserved virtual ranges.
    pub fn is_expandable(self) -> bool {
        !matches!(self, Policy::Torch)
    }
}

impl PolicyConfig {
    /// The policy `policy` names, with its default settings.
    pub fn for_policy(policy: Policy) -> PolicyConfig {
        match policy {
            Policy::Torch => PolicyConfig::Torch,
            Policy::TorchExpandable => PolicyConfig::TorchExpandable,
            Policy::Default => PolicyConfig::Default(DefaultConfig::default()),
        }
    }

    /// The name of the policy.
    pub fn policy(&self) -> Policy {
        match self {
            PolicyConfig::Torch => Policy::Torch,
            PolicyConfig::TorchExpandable => Policy::TorchExpandable,
            PolicyConfig::Default(_) => Policy::Default,
        }
    }

    /// Checks the policy's own settings; the error names the key and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self {
            PolicyConfig::Default(d) => d.validate(),
            _ => Ok(()),
        }
    }
}

/// The settings of the thread-safe front ([`crate::CachingAllocator`]): its thread caches.
#[derive(Clone, Debug, PartialEq)]
pub struct FrontConfig {
    /// Per-thread caches of freed blocks (`None`: the policy's default, on for `default` only).
    /// Key `thread_cache`.
    pub thread_cache: Option<bool>,
    /// Bytes one thread cache's small part holds at most. Key `thread_cache_mb`.
    pub thread_cache_bytes: u64,
    /// Largest block a thread cache's small part takes (at least 1 byte). Key
    /// `thread_cache_block_mb`.
    pub thread_cache_block: u64,
    /// Blocks of any size a thread cache's large part holds (at most 4). Key
    /// `thread_cache_large`.
    pub thread_cache_large: usize,
}

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig {
            thread_cache: None,
            thread_cache_bytes: 2 << 20,
            thread_cache_block: 1 << 20,
            thread_cache_large: 1,
        }
    }
}

impl FrontConfig {
    /// Checks every value against what its key accepts; the error names the key and the value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.thread_cache_block == 0 {
            return Err(ConfigError::new(
                "thread_cache_block_mb",
                "0 bytes: use thread_cache:False to turn the cache off",
            ));
        }
        if self.thread_cache_large > crate::tcache::MAX_LARGE {
            return Err(ConfigError::new(
                "thread_cache_large",
                format!(
                    "{} blocks: at most 4 large blocks per thread cache",
                    self.thread_cache_large
                ),
            ));
        }
        Ok(())
    }
}

/// A complete configuration (see the module docs); every value in it is valid.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    policy: PolicyConfig,
    pool: PoolConfig,
    front: FrontConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config::for_policy(Policy::Default)
    }
}

/// Keys that only the `default` policy reads: a config string that gives one of them and
/// picks another policy is an error.
pub const DEFAULT_ONLY_KEYS: [&str; 5] = [
    "fragmentation_budget",
    "max_chunk_mb",
    "layout_plans",
    "repage_under_cap",
    "lend_blocks",
];

impl Config {
    /// The configuration a policy has with no further keys.
    pub fn for_policy(policy: Policy) -> Config {
        Config {
            policy: PolicyConfig::for_policy(policy),
            pool: PoolConfig::default(),
            front: FrontConfig::default(),
        }
    }

    /// A configuration of these parts, each validated; the error names the first key whose
    /// value is refused.
    pub fn new(
        policy: PolicyConfig,
        pool: PoolConfig,
        front: FrontConfig,
    ) -> Result<Config, ConfigError> {
        policy.validate()?;
        pool.validate()?;
        front.validate()?;
        if pool.shareable_segments && !policy.policy().is_expandable() {
            return Err(ConfigError::new(
                "shareable_segments",
                "the `torch` policy allocates segments with cuMemAlloc, whose pages cannot be \
                 exported; use `policy:default` or `policy:torch-expandable` \
                 (`expandable_segments:True`)",
            ));
        }
        if pool.whole_growths && policy.policy() != Policy::TorchExpandable {
            return Err(ConfigError::new(
                "whole_growths",
                format!(
                    "only `torch-expandable`'s rules read it (graph pools of a `default` \
                     allocator set it); the `{}` policy would ignore it",
                    policy.policy().name()
                ),
            ));
        }
        Ok(Config {
            policy,
            pool,
            front,
        })
    }

    /// This configuration under another rule set (validated).
    pub fn with_policy(self, policy: PolicyConfig) -> Result<Config, ConfigError> {
        Config::new(policy, self.pool, self.front)
    }

    /// This configuration with other shared settings (validated).
    pub fn with_pool(self, pool: PoolConfig) -> Result<Config, ConfigError> {
        Config::new(self.policy, pool, self.front)
    }

    /// This configuration with other front settings (validated).
    pub fn with_front(self, front: FrontConfig) -> Result<Config, ConfigError> {
        Config::new(self.policy, self.pool, front)
    }

    /// The name of the rule set.
    pub fn policy(&self) -> Policy {
        self.policy.policy()
    }

    /// The rule set with its own settings.
    pub fn policy_config(&self) -> &PolicyConfig {
        &self.policy
    }

    /// The settings every policy shares.
    pub fn pool(&self) -> &PoolConfig {
        &self.pool
    }

    /// The front's settings.
    pub fn front(&self) -> &FrontConfig {
        &self.front
    }

    /// Parses a config string on top of `base` (whose policy a `policy` key may change).
    pub fn parse_onto(base: Config, s: &str) -> Result<Config, ConfigError> {
        Draft::of(&base).parse(s)?.build()
    }

    /// Parses a config string on top of the `default` policy.
    pub fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse_onto(Config::default(), s)
    }

    /// Reads `CUDALLOC_CONF` (absent: the `default` policy; not valid UTF-8: an error).
    pub fn from_env() -> Result<Config, ConfigError> {
        match std::env::var("CUDALLOC_CONF") {
            Ok(s) => Config::parse(&s),
            Err(std::env::VarError::NotPresent) => Ok(Config::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(ConfigError::new(
                "CUDALLOC_CONF",
                "the variable is not valid UTF-8",
            )),
        }
    }

    /// True when [`crate::CachingAllocator`] keeps per-thread caches of freed blocks.
    pub fn thread_cache_on(&self) -> bool {
        self.front
            .thread_cache
            .unwrap_or(self.policy() == Policy::Default)
    }
}
