//! `--sweep` and `--cross`: the configurations a replay adds after each policy or
//! configuration asked for, one key changed at a time or every combination of the keys.
//!
//! Invariant: each configuration added is parsed from its own label, so that the label, given
//! to `--config`, replays the same configuration.

use crate::args::{entries, is_policy_entry, Variant};
use cudalloc::config::DEFAULT_ONLY_KEYS;
use cudalloc::{Config, Policy};

/// `bases`, each followed by its swept configurations: one per value of each key alone, or
/// with `cross` one per combination of the values of the keys it reads; an error when a base
/// refuses a value, when a key only one policy reads applies to none of the bases, or when
/// `cross` is given a key twice.
pub fn expand(bases: Vec<Variant>, sweeps: &[Sweep], cross: bool) -> Result<Vec<Variant>, String> {
    if cross {
        if let Some(twice) = sweeps
            .iter()
            .enumerate()
            .find(|(i, s)| sweeps[..*i].iter().any(|t| t.key == s.key))
        {
            return Err(format!(
                "--cross: `{}` is swept twice (give its values in one --sweep)",
                twice.1.key
            ));
        }
    }
    let mut out = Vec::new();
    let mut used = vec![false; sweeps.len()];
    for base in bases {
        let mut applied = Vec::new();
        for (s, used) in sweeps.iter().zip(&mut used) {
            // A key only one policy reads is swept after its configurations only.
            if only_reader(&s.key).is_some_and(|p| p != base.cfg.policy()) {
                continue;
            }
            *used = true;
            applied.push(s);
        }
        let swept = if cross {
            crossed(&base, &applied)?
        } else {
            let mut one_at_a_time = Vec::new();
            for s in applied {
                one_at_a_time.extend(s.apply(&base)?);
            }
            one_at_a_time
        };
        out.push(base);
        out.extend(swept);
    }
    if let Some((s, _)) = sweeps.iter().zip(&used).find(|(_, u)| !**u) {
        let policy = only_reader(&s.key).map_or("", Policy::name);
        return Err(format!(
            "--sweep {}: the key applies to the `{policy}` policy only, and none of the \
             configurations asked for is one",
            s.key
        ));
    }
    Ok(out)
}

/// Every combination of the values of `sweeps` on `base`, the first key's values outermost;
/// none without a key.
fn crossed(base: &Variant, sweeps: &[&Sweep]) -> Result<Vec<Variant>, String> {
    if sweeps.is_empty() {
        return Ok(Vec::new());
    }
    let mut combos = vec![base.clone()];
    for s in sweeps {
        let mut next = Vec::with_capacity(combos.len() * s.values.len());
        for c in &combos {
            next.extend(s.apply(c)?);
        }
        combos = next;
    }
    Ok(combos)
}

/// The key a replay ignores under every policy but `torch`: only `torch`'s segments are ever
/// garbage-collected (the expandable policies' blocks are not: `policy::torch::garbage_collect_cached_blocks`).
pub const GARBAGE_COLLECTION_KEY: &str = "garbage_collection_threshold";

/// The one policy that reads `key`, for a key only one policy reads.
fn only_reader(key: &str) -> Option<Policy> {
    if DEFAULT_ONLY_KEYS.contains(&key) {
        Some(Policy::Default)
    } else if key == GARBAGE_COLLECTION_KEY {
        Some(Policy::Torch)
    } else {
        None
    }
}

/// One key and the values `--sweep` replays it at.
#[derive(Clone, Debug)]
pub struct Sweep {
    pub(crate) key: String,
    pub(crate) values: Vec<String>,
}

impl Sweep {
    /// `base` with the key set to each value in turn, labelled by a config string that gives
    /// the same configuration (a swept `policy` stands first, in place of the base's: the label
    /// names the policy replayed); an error when `base` refuses a value.
    fn apply(&self, base: &Variant) -> Result<Vec<Variant>, String> {
        self.values
            .iter()
            .map(|v| {
                let entry = format!("{}:{v}", self.key);
                let config = if self.key == "policy" {
                    with_policy(&base.config, &entry)
                } else {
                    format!("{},{entry}", base.config)
                };
                // Parsed from the label itself, so that the label gives this configuration
                // whatever the keys (`expandable_segments` is applied after the others).
                let cfg = Config::parse(&config)
                    .map_err(|e| format!("--sweep {entry} on `{}`: {e}", base.label))?;
                Ok(Variant {
                    label: config.clone(),
                    cfg,
                    config,
                    without_policy: None,
                })
            })
            .collect()
    }
}

/// `config` with its `policy` entries dropped and `entry` (`policy:NAME`) first: the same
/// configuration as `config,entry` (a policy key sets the policy alone, and
/// `expandable_segments` applies after it wherever it stands).
fn with_policy(config: &str, entry: &str) -> String {
    let rest = entries(config).into_iter().filter(|e| !is_policy_entry(e));
    std::iter::once(entry)
        .chain(rest)
        .collect::<Vec<_>>()
        .join(",")
}

/// `KEY=V1,V2,...`; the values are split at commas outside brackets (a value may be a list,
/// as `roundup_power2_divisions`' is), and each must be a valid value of the key.
pub fn parse_sweep(s: &str) -> Result<Sweep, String> {
    let (key, list) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected KEY=V1,V2,... (e.g. max_chunk_mb=16,40,64)"))?;
    let key = key.trim().to_string();
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("`{s}`: `{key}` is not one config key"));
    }
    let values: Vec<String> = entries(list).iter().map(|v| v.trim().to_string()).collect();
    if values.iter().any(String::is_empty) {
        return Err(format!("`{s}`: an empty value for `{key}`"));
    }
    // Checked alone here, on `default` and on `torch` (a value one of them refuses may suit the
    // other); `Sweep::apply` checks it again on each configuration it is swept from.
    for v in &values {
        let entry = format!("{key}:{v}");
        let torch = Config::for_policy(cudalloc::Policy::Torch);
        Config::parse(&entry)
            .or_else(|e| Config::parse_onto(torch, &entry).map_err(|_| e))
            .map_err(|e| e.to_string())?;
    }
    Ok(Sweep { key, values })
}
