//! Policy configuration: PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax plus cudalloc's own keys.
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
//! | `fragmentation_budget` | 0 <= x <= 1 | `default` policy: cached bytes allowed above the peak live bytes, as a fraction of it |
//! | `max_chunk_mb` | even integer >= 2 (whole 2 MiB pages) | `default` policy: largest physical chunk mapped in one call (the memory vs driver-call knob) |
//! | `layout_plans` | `True`/`False` | `default` policy: place a sequence of large allocations that repeats at another scale by a packing of its last repetition (default: on; off under a memory cap) |
//! | `thread_cache` | `True`/`False` | keep a few freed blocks per thread and reuse them without locking (default: on for `default`, off for the PyTorch policies) |
//! | `thread_cache_mb` | integer | bytes a thread cache's small part holds at most (default 2); cached blocks count as allocated, so more is faster but reserves more, and the `default` policy's placement changes (docs/threads.md) |
//! | `thread_cache_block_mb` | integer >= 1 | largest block a thread cache's small part takes (default 1: the small pool's blocks) |
//! | `thread_cache_large` | integer 0..=4 | blocks of any size below `max_split_size` a thread cache keeps besides (the last freed; default 1); each thread may hold this many blocks beyond `thread_cache_mb` |
//! | `backend` | `native` | accepted for PyTorch compatibility (`cudaMallocAsync` is refused) |
//! | `pinned_use_cuda_host_register`, `pinned_use_hip_host_register`, `pinned_num_register_threads`, `pinned_use_background_threads`, `pinned_reserve_segment_size_mb`, `release_lock_on_cudamalloc`, `release_lock_on_hipmalloc` | any | accepted and ignored: they concern host memory or locking, not the device pool (their values are not checked, as PyTorch does) |
//! | `graph_capture_record_stream_reuse` | any | accepted and ignored: cudalloc has no CUDA-graph capture mode |
//!
//! `True`/`False` values are also taken as `true`/`false` and `1`/`0` (PyTorch takes only
//! `True`/`False`). Without a `policy` key, [`Config::parse`] gives the `default` policy. A key given twice takes
//! its last value, as in PyTorch. Spaces around words are dropped; a space inside a word
//! separates it, so `max_split_size_mb 128` is an error, not the key `max_split_size_mb128`.
//!
//! An unknown key, a missing value or a bad value is a [`ConfigError`] that names the key; so
//! is an entry written `key=value` (the error says to write `key:value`), and a key of the
//! `default` policy (`fragmentation_budget`, `max_chunk_mb`, `layout_plans`) in
//! a string that picks another policy, which would ignore it.

use std::fmt;

/// Number of power-of-two size intervals of `roundup_power2_divisions` (1 MiB .. 64 GiB).
pub const DIVISION_INTERVALS: usize = 16;

/// The rule set an allocator follows.
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

/// A config key that could not be accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The key (or the offending token when no key could be read).
    pub key: String,
    /// What was wrong.
    pub message: String,
}

impl ConfigError {
    fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "config key `{}`: {}", self.key, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// A complete policy configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The rule set.
    pub policy: Policy,
    /// Blocks of at least this size are never split (`u64::MAX`: no limit).
    pub max_split_size: u64,
    /// An oversize cached block may exceed the request by less than this.
    pub max_non_split_rounding: u64,
    /// Divisions per power-of-two interval, indexed from 1 MiB up (0 or 1: plain 512 B rounding).
    pub roundup_power2_divisions: [u64; DIVISION_INTERVALS],
    /// Fraction of the memory limit above which old cached segments are freed (0: off).
    pub garbage_collection_threshold: f64,
    /// `default` policy: cached bytes allowed above the peak live bytes, as a fraction of it.
    pub fragmentation_budget: f64,
    /// `default` policy: largest chunk mapped in one driver call, in bytes.
    pub max_chunk: u64,
    /// `default` policy: place a repeated sequence of large allocations by a packing of its last
    /// repetition (see `policy::default::plan`).
    pub layout_plans: bool,
    /// Per-thread caches of freed blocks in [`crate::CachingAllocator`] (`None`: the policy's
    /// default, on for `default` only).
    pub thread_cache: Option<bool>,
    /// Bytes one thread cache holds at most.
    pub thread_cache_bytes: u64,
    /// Largest block a thread cache's small part takes.
    pub thread_cache_block: u64,
    /// Blocks of any size a thread cache's large part holds (at most 4).
    pub thread_cache_large: usize,
    /// Cap on the memory held from each device, as a fraction of it (PyTorch's
    /// `per_process_memory_fraction` key; `None`: no cap). A pool applies it when it is made,
    /// as [`crate::Pool::set_memory_fraction`] would.
    pub memory_fraction: Option<f64>,
}

impl Default for Config {
    fn default() -> Self {
        Config::for_policy(Policy::Default)
    }
}

/// Keys that only the `default` policy reads: a config string that gives one of them and
/// picks another policy is an error.
pub const DEFAULT_ONLY_KEYS: [&str; 3] = ["fragmentation_budget", "max_chunk_mb", "layout_plans"];

/// The `default` policy's largest chunk when none is given.
pub const DEFAULT_MAX_CHUNK: u64 = 40 << 20;

/// The `default` policy's fragmentation budget when none is given.
pub const DEFAULT_FRAGMENTATION_BUDGET: f64 = 0.02;

impl Config {
    /// The configuration a policy has with no further keys.
    pub fn for_policy(policy: Policy) -> Config {
        Config {
            policy,
            max_split_size: u64::MAX,
            max_non_split_rounding: crate::sizes::LARGE_BUFFER,
            roundup_power2_divisions: [0; DIVISION_INTERVALS],
            garbage_collection_threshold: 0.0,
            fragmentation_budget: DEFAULT_FRAGMENTATION_BUDGET,
            max_chunk: DEFAULT_MAX_CHUNK,
            layout_plans: true,
            thread_cache: None,
            thread_cache_bytes: 2 << 20,
            thread_cache_block: 1 << 20,
            thread_cache_large: 1,
            memory_fraction: None,
        }
    }

    /// Parses a config string on top of `base` (whose policy a `policy` key may change).
    pub fn parse_onto(base: Config, s: &str) -> Result<Config, ConfigError> {
        let mut cfg = base;
        let tokens = lex(s);
        let mut p = Parser { tokens, i: 0 };
        // Applied after the other keys, so that its meaning does not depend on where the
        // `policy` key stands.
        let mut expandable = None;
        // Keys of the `default` policy given here: refused once the policy is known to be
        // another, where they would do nothing.
        let mut own_keys: Vec<String> = Vec::new();
        while !p.done() {
            let key = p.next_word("(start of entry)")?;
            if key == "," {
                return Err(ConfigError::new(
                    ",",
                    "an empty entry (a leading comma or two in a row)",
                ));
            }
            check_not_equals(&key, p.peek())?;
            p.expect(&key, ":")?;
            if key == "expandable_segments" {
                expandable = Some(p.boolean(&key)?);
            } else {
                cfg.apply(&key, &mut p)?;
            }
            if DEFAULT_ONLY_KEYS.contains(&key.as_str()) {
                own_keys.push(key.clone());
            }
            if !p.done() {
                p.expect(&key, ",")?;
            }
        }
        if let Some(on) = expandable {
            cfg.policy = with_expandable_segments(cfg.policy, on)?;
        }
        if let (Some(key), false) = (own_keys.first(), cfg.policy == Policy::Default) {
            return Err(ConfigError::new(
                key.as_str(),
                format!(
                    "applies to the `default` policy only; the policy here is `{}`, which \
                     would ignore it",
                    cfg.policy.name()
                ),
            ));
        }
        Ok(cfg)
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
        self.thread_cache.unwrap_or(self.policy == Policy::Default)
    }

    /// Divisions that apply to a request of `size` bytes.
    pub fn divisions_for(&self, size: u64) -> u64 {
        let log = 63 - size.max(1).leading_zeros() as usize;
        let index = log.saturating_sub(20).min(DIVISION_INTERVALS - 1);
        self.roundup_power2_divisions[index]
    }

    fn apply(&mut self, key: &str, p: &mut Parser) -> Result<(), ConfigError> {
        match key {
            "policy" => self.policy = Policy::parse(&p.next_word(key)?)?,
            "max_split_size_mb" => self.max_split_size = p.megabytes(key)?,
            "max_non_split_rounding_mb" => self.max_non_split_rounding = p.megabytes(key)?,
            "garbage_collection_threshold" => {
                let v = p.number(key)?;
                if !(v > 0.0 && v < 1.0) {
                    return Err(ConfigError::new(key, format!("{v} is not in (0, 1)")));
                }
                self.garbage_collection_threshold = v;
            }
            "fragmentation_budget" => {
                let v = p.number(key)?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(ConfigError::new(key, format!("{v} is not in [0, 1]")));
                }
                self.fragmentation_budget = v;
            }
            "roundup_power2_divisions" => self.parse_divisions(key, p)?,
            "per_process_memory_fraction" => {
                let v = p.number(key)?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(ConfigError::new(key, format!("{v} is not in [0, 1]")));
                }
                self.memory_fraction = Some(v);
            }
            "max_chunk_mb" => {
                let mb = p.integer(key)?;
                if !(2..=1 << 20).contains(&mb) {
                    return Err(ConfigError::new(
                        key,
                        format!("{mb} MB is not in [2, 1048576]"),
                    ));
                }
                if mb % 2 != 0 {
                    return Err(ConfigError::new(
                        key,
                        format!(
                            "{mb} MB is not a whole number of 2 MiB pages (use an even number)"
                        ),
                    ));
                }
                self.max_chunk = mb << 20;
            }
            "layout_plans" => self.layout_plans = p.boolean(key)?,
            "thread_cache" => self.thread_cache = Some(p.boolean(key)?),
            "thread_cache_mb" => self.thread_cache_bytes = p.integer(key)?.saturating_mul(1 << 20),
            "thread_cache_block_mb" => {
                let mb = p.integer(key)?;
                if mb == 0 {
                    return Err(ConfigError::new(
                        key,
                        "0 MB: use thread_cache:False to turn the cache off",
                    ));
                }
                self.thread_cache_block = mb.saturating_mul(1 << 20);
            }
            "thread_cache_large" => {
                let n = p.integer(key)?;
                if n > crate::tcache::MAX_LARGE as u64 {
                    return Err(ConfigError::new(
                        key,
                        "at most 4 large blocks per thread cache",
                    ));
                }
                self.thread_cache_large = n as usize;
            }
            "backend" => {
                let v = p.next_word(key)?;
                if v != "native" {
                    return Err(ConfigError::new(
                        key,
                        format!("`{v}` is not supported (only `native`)"),
                    ));
                }
            }
            "pinned_use_cuda_host_register"
            | "pinned_use_hip_host_register"
            | "pinned_num_register_threads"
            | "pinned_use_background_threads"
            | "pinned_reserve_segment_size_mb"
            | "release_lock_on_cudamalloc"
            | "release_lock_on_hipmalloc"
            | "graph_capture_record_stream_reuse" => {
                p.next_word(key)?;
            }
            _ => return Err(ConfigError::new(key, "unknown key")),
        }
        Ok(())
    }

    fn parse_divisions(&mut self, key: &str, p: &mut Parser) -> Result<(), ConfigError> {
        if p.peek() != Some("[") {
            let v = p.integer(key)?;
            check_division(key, v, false)?;
            self.roundup_power2_divisions = [v; DIVISION_INTERVALS];
            return Ok(());
        }
        p.expect(key, "[")?;
        let mut first = true;
        let mut last_index = 0usize;
        loop {
            let bound = p.next_word(key)?;
            if bound == "]" {
                return Ok(());
            }
            p.expect(key, ":")?;
            let v = p.integer(key)?;
            check_division(key, v, true)?;
            if bound == ">" {
                // After the last interval listed, as PyTorch's current parser fills (from
                // `last_index + 1`; some older releases started at the last listed interval).
                for d in
                    &mut self.roundup_power2_divisions[(last_index + 1).min(DIVISION_INTERVALS)..]
                {
                    *d = v;
                }
            } else {
                let mb: u64 = bound.parse().map_err(|_| {
                    ConfigError::new(key, format!("interval `{bound}` is not a number of MB"))
                })?;
                if !mb.is_power_of_two() {
                    return Err(ConfigError::new(
                        key,
                        format!("interval {mb} MB is not a power of two"),
                    ));
                }
                let index = (mb.trailing_zeros() as usize).min(DIVISION_INTERVALS - 1);
                if first {
                    for d in &mut self.roundup_power2_divisions[..index] {
                        *d = v;
                    }
                    first = false;
                }
                self.roundup_power2_divisions[index] = v;
                last_index = index;
            }
            match p.peek() {
                Some("]") => {}
                _ => p.expect(key, ",")?,
            }
        }
    }
}

/// `policy` after `expandable_segments:on`: PyTorch's two policies switch into each other;
/// `default` always maps pages into expandable ranges, so it takes `True` and refuses `False`.
fn with_expandable_segments(policy: Policy, on: bool) -> Result<Policy, ConfigError> {
    match (policy, on) {
        (Policy::Torch | Policy::TorchExpandable, true) => Ok(Policy::TorchExpandable),
        (Policy::Torch | Policy::TorchExpandable, false) => Ok(Policy::Torch),
        (Policy::Default, true) => Ok(Policy::Default),
        (Policy::Default, false) => Err(ConfigError::new(
            "expandable_segments",
            "the `default` policy always maps pages into expandable ranges; \
             add `policy:torch` for PyTorch's segments without them",
        )),
    }
}

/// Refuses `key=value` (and `key = value`), the mistake of writing an entry the way a sweep or
/// a shell assignment would, with an error naming the key and saying to write `key:value`.
fn check_not_equals(word: &str, next: Option<&str>) -> Result<(), ConfigError> {
    let (key, value) = match word.split_once('=') {
        Some(kv) => kv,
        None => match next.and_then(|t| t.strip_prefix('=')) {
            Some(v) => (word, v),
            None => return Ok(()),
        },
    };
    if key.is_empty() {
        return Ok(());
    }
    let message = if value.is_empty() {
        format!("an entry is written `{key}:value`, with a colon, not `=`")
    } else {
        format!("an entry is written `{key}:{value}`, with a colon, not `{key}={value}`")
    };
    Err(ConfigError::new(key, message))
}

fn check_division(key: &str, v: u64, zero_ok: bool) -> Result<(), ConfigError> {
    if (zero_ok && v == 0) || v.is_power_of_two() {
        Ok(())
    } else {
        Err(ConfigError::new(
            key,
            format!("{v} divisions is not a power of two"),
        ))
    }
}

/// Splits a config string into words and the punctuation `,` `:` `[` `]`; spaces end a word
/// and are dropped.
fn lex(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in s.chars() {
        match c {
            ',' | ':' | '[' | ']' => {
                if !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
                out.push(c.to_string());
            }
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

struct Parser {
    tokens: Vec<String>,
    i: usize,
}

impl Parser {
    fn done(&self) -> bool {
        self.i >= self.tokens.len()
    }

    fn peek(&self) -> Option<&str> {
        self.tokens.get(self.i).map(String::as_str)
    }

    fn next_word(&mut self, key: &str) -> Result<String, ConfigError> {
        let t = self
            .tokens
            .get(self.i)
            .cloned()
            .ok_or_else(|| ConfigError::new(key, "missing value"))?;
        self.i += 1;
        Ok(t)
    }

    fn expect(&mut self, key: &str, what: &str) -> Result<(), ConfigError> {
        match self.peek() {
            Some(t) if t == what => {
                self.i += 1;
                Ok(())
            }
            Some(t) => Err(ConfigError::new(
                key,
                format!("expected `{what}`, found `{t}`"),
            )),
            None => Err(ConfigError::new(
                key,
                format!("expected `{what}`, found the end"),
            )),
        }
    }

    fn integer(&mut self, key: &str) -> Result<u64, ConfigError> {
        let w = self.next_word(key)?;
        w.parse()
            .map_err(|_| ConfigError::new(key, format!("`{w}` is not a non-negative integer")))
    }

    fn number(&mut self, key: &str) -> Result<f64, ConfigError> {
        let w = self.next_word(key)?;
        w.parse()
            .map_err(|_| ConfigError::new(key, format!("`{w}` is not a number")))
    }

    fn boolean(&mut self, key: &str) -> Result<bool, ConfigError> {
        let w = self.next_word(key)?;
        match w.as_str() {
            "True" | "true" | "1" => Ok(true),
            "False" | "false" | "0" => Ok(false),
            _ => Err(ConfigError::new(key, format!("`{w}` is not True or False"))),
        }
    }

    fn megabytes(&mut self, key: &str) -> Result<u64, ConfigError> {
        let mb = self.integer(key)?;
        if mb < crate::sizes::LARGE_BUFFER >> 20 {
            return Err(ConfigError::new(
                key,
                format!("{mb} MB is below the minimum of 20 MB"),
            ));
        }
        Ok(mb.saturating_mul(1 << 20))
    }
}
