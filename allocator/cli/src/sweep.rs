//! `--sweep` and `--cross`: the configurations a replay adds after each policy or
//! configuration asked for, one key changed at a time or every combination of the keys.
//!
//! Invariant: each configuration added is parsed from its own label, so that the label, given
//! to `--config`, replays the same configuration.

use crate::args::{entries, is_policy_entry, Variant};
use cudalloc::config::DEFAULT_ONLY_KEYS;
use cudalloc::{Config, Policy};

/// Most configurations `--cross` adds after one base: each replays every trace.
pub const MAX_CROSSED: usize = 1000;

/// `bases`, each followed by its swept configurations: one per value of each key alone, or
/// with `cross` one per combination of the values of the keys it reads; an error when a base
/// refuses a value, when a key only one policy reads applies to none of the configurations,
/// when `cross` is given a key twice or would add more than [`MAX_CROSSED`] after a base.
pub fn expand(bases: Vec<Variant>, sweeps: &[Sweep], cross: bool) -> Result<Vec<Variant>, String> {
    if cross {
        check_cross(sweeps)?;
    }
    let mut out = Vec::new();
    let mut used = vec![false; sweeps.len()];
    for base in bases {
        let swept = if cross {
            crossed(&base, sweeps, &mut used)?
        } else {
            let mut one_at_a_time = Vec::new();
            for (s, used) in sweeps.iter().zip(&mut used) {
                // A key only one policy reads is swept after its configurations only.
                if s.reads(&base) {
                    *used = true;
                    one_at_a_time.extend(s.apply(&base, &base.label)?);
                }
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

/// Refuses a key swept twice, and more combinations than [`MAX_CROSSED`].
fn check_cross(sweeps: &[Sweep]) -> Result<(), String> {
    if let Some((_, twice)) = sweeps
        .iter()
        .enumerate()
        .find(|(i, s)| sweeps[..*i].iter().any(|t| t.key == s.key))
    {
        return Err(format!(
            "--cross: `{}` is swept twice (give its values in one --sweep)",
            twice.key
        ));
    }
    let combinations = sweeps
        .iter()
        .try_fold(1usize, |n, s| n.checked_mul(s.values.len()))
        .filter(|&n| n <= MAX_CROSSED);
    match combinations {
        Some(_) => Ok(()),
        None => Err(format!(
            "--cross: more than {MAX_CROSSED} combinations of the swept values, each replaying \
             every trace: sweep fewer values"
        )),
    }
}

/// Every combination of the values of `sweeps` on `base`. The keys that change the policy
/// (`policy`, `expandable_segments`) are crossed first, then the others in order, the first
/// key's values outermost; a key only one policy reads is applied to the combinations of that
/// policy alone (the others keep their configuration without it). `used` marks the keys
/// applied to any combination. None when no key applies.
fn crossed(base: &Variant, sweeps: &[Sweep], used: &mut [bool]) -> Result<Vec<Variant>, String> {
    let mut order: Vec<usize> = (0..sweeps.len()).collect();
    order.sort_by_key(|&i| !POLICY_KEYS.contains(&sweeps[i].key.as_str()));
    let mut combos = vec![(base.clone(), false)];
    for i in order {
        let s = &sweeps[i];
        let mut next = Vec::with_capacity(combos.len() * s.values.len());
        for (c, changed) in combos {
            if s.reads(&c) {
                used[i] = true;
                next.extend(s.apply(&c, &base.label)?.into_iter().map(|v| (v, true)));
            } else {
                next.push((c, changed));
            }
        }
        combos = next;
    }
    Ok(combos
        .into_iter()
        .filter(|(_, changed)| *changed)
        .map(|(v, _)| v)
        .collect())
}

/// The keys whose value decides the policy a configuration runs.
const POLICY_KEYS: [&str; 2] = ["policy", "expandable_segments"];

/// The key a replay ignores under every policy but `torch`: only `torch`'s segments are ever
/// garbage-collected (the expandable policies' blocks are not:
/// `policy::torch::garbage_collect_cached_blocks`).
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
    /// Whether the policy `v` runs reads this key (every key but those only one policy reads).
    fn reads(&self, v: &Variant) -> bool {
        only_reader(&self.key).is_none_or(|p| p == v.cfg.policy())
    }

    /// `base` with the key set to each value in turn, labelled by a config string that gives
    /// the same configuration (a swept `policy` stands first, in place of the base's: the label
    /// names the policy replayed); an error, naming the configuration `named`, when `base`
    /// refuses a value.
    fn apply(&self, base: &Variant, named: &str) -> Result<Vec<Variant>, String> {
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
                    .map_err(|e| format!("--sweep {entry} on `{named}`: {e}"))?;
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
