//! The config string's parser: PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax plus cudalloc's own
//! keys (the table is in [`crate::config`]), applied onto a [`Draft`] of every setting and
//! turned into a [`Config`] once the policy is known.
//!
//! Invariant: every value the parser accepts passes the settings' `validate`, so a parsed
//! config is as valid as one built in code.

use super::{Config, FrontConfig, Policy, DEFAULT_ONLY_KEYS};
use crate::error::ConfigError;
use crate::policy::{DefaultConfig, PolicyConfig};
use crate::pool::config::{PoolConfig, DIVISION_INTERVALS};
use crate::tcache::MAX_LARGE;

/// Every setting a config string may give, whichever policy it ends up naming.
pub(super) struct Draft {
    policy: Policy,
    pool: PoolConfig,
    /// The `default` policy's settings (kept whatever the policy, so that a `policy` key
    /// anywhere in the string picks them up).
    default: DefaultConfig,
    front: FrontConfig,
}

impl Draft {
    /// The settings of `cfg`, to parse more onto.
    pub(super) fn of(cfg: &Config) -> Draft {
        let default = match cfg.policy_config() {
            PolicyConfig::Default(d) => *d,
            _ => DefaultConfig::default(),
        };
        Draft {
            policy: cfg.policy(),
            pool: cfg.pool().clone(),
            default,
            front: cfg.front().clone(),
        }
    }

    /// The config the draft describes.
    pub(super) fn build(self) -> Result<Config, ConfigError> {
        let policy = match self.policy {
            Policy::Default => PolicyConfig::Default(self.default),
            other => PolicyConfig::for_policy(other),
        };
        Config::new(policy, self.pool, self.front)
    }

    /// Parses config string `s` on top of `self` (whose policy a `policy` key may change).
    pub(super) fn parse(mut self, s: &str) -> Result<Draft, ConfigError> {
        let cfg = &mut self;
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
        Ok(self)
    }

    fn apply(&mut self, key: &str, p: &mut Parser) -> Result<(), ConfigError> {
        match key {
            "policy" => self.policy = Policy::parse(&p.next_word(key)?)?,
            "max_split_size_mb" => self.pool.max_split_size = p.megabytes(key)?,
            "max_non_split_rounding_mb" => self.pool.max_non_split_rounding = p.megabytes(key)?,
            "garbage_collection_threshold" => {
                let v = p.number(key)?;
                if !(v > 0.0 && v < 1.0) {
                    return Err(ConfigError::new(key, format!("{v} is not in (0, 1)")));
                }
                self.pool.garbage_collection_threshold = v;
            }
            "fragmentation_budget" => {
                let v = p.number(key)?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(ConfigError::new(key, format!("{v} is not in [0, 1]")));
                }
                self.default.fragmentation_budget = v;
            }
            "roundup_power2_divisions" => self.parse_divisions(key, p)?,
            "per_process_memory_fraction" => {
                let v = p.number(key)?;
                if !(0.0..=1.0).contains(&v) {
                    return Err(ConfigError::new(key, format!("{v} is not in [0, 1]")));
                }
                self.pool.memory_fraction = Some(v);
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
                self.default.max_chunk = mb << 20;
            }
            "layout_plans" => self.default.layout_plans = p.boolean(key)?,
            "repage_under_cap" => self.default.repage_under_cap = p.boolean(key)?,
            "lend_blocks" => self.default.lend_blocks = p.boolean(key)?,
            "shareable_segments" => self.pool.shareable_segments = p.boolean(key)?,
            "thread_cache" => self.front.thread_cache = Some(p.boolean(key)?),
            "thread_cache_mb" => {
                self.front.thread_cache_bytes = p.integer(key)?.saturating_mul(1 << 20)
            }
            "thread_cache_block_mb" => {
                let mb = p.integer(key)?;
                if mb == 0 {
                    return Err(ConfigError::new(
                        key,
                        "0 MB: use thread_cache:False to turn the cache off",
                    ));
                }
                self.front.thread_cache_block = mb.saturating_mul(1 << 20);
            }
            "thread_cache_large" => {
                let n = p.integer(key)?;
                if n > MAX_LARGE as u64 {
                    return Err(ConfigError::new(
                        key,
                        "at most 4 large blocks per thread cache",
                    ));
                }
                self.front.thread_cache_large = n as usize;
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
            self.pool.roundup_power2_divisions = [v; DIVISION_INTERVALS];
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
                for d in &mut self.pool.roundup_power2_divisions
                    [(last_index + 1).min(DIVISION_INTERVALS)..]
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
                    for d in &mut self.pool.roundup_power2_divisions[..index] {
                        *d = v;
                    }
                    first = false;
                }
                self.pool.roundup_power2_divisions[index] = v;
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
        w.parse().map_err(|e: std::num::ParseIntError| {
            // Only digits can be too large: the parser stops at the first fault it meets, and
            // `99999999999999999999x` overflows before it reaches the `x`.
            let digits = w.bytes().all(|b| b.is_ascii_digit());
            let why = match e.kind() {
                std::num::IntErrorKind::PosOverflow if digits => {
                    "is too large (it overflows 64 bits)"
                }
                _ => "is not a non-negative integer",
            };
            ConfigError::new(key, format!("`{w}` {why}"))
        })
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
