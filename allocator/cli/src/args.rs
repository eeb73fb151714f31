//! The command line: subcommands, options, and the parsers of their values (policy names,
//! config strings, byte counts with units).

use crate::sweep::{self, Sweep};
use clap::{Args, Parser, Subcommand};
use cudalloc::{Config, Policy};
use std::num::IntErrorKind;
use std::path::PathBuf;

/// Replays recorded GPU allocation traces against cudalloc's policies on a simulated H200.
#[derive(Parser, Debug)]
#[command(name = "cudalloc", version)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Replay traces under one or more policies and compare the memory each reserves.
    ///
    /// Exit status: 0 when every replay completed, 1 when one failed (out of memory under
    /// --capacity, or beyond the simulated device), 2 on a usage or input error (--cuda without
    /// a GPU included: nothing is replayed then).
    // Boxed, as `Stats`: its options are far larger than a pointer.
    Replay(Box<ReplayArgs>),
    /// Replay one trace and print PyTorch-style memory statistics as JSON.
    ///
    /// The statistics are `torch.cuda.memory_stats()`'s keys, sorted, taken at the end of the
    /// trace before leftover allocations are freed, with the fragmentation of the pool then,
    /// and the trace's `anomalies` as `replay --json` gives them (and a warning on stderr when
    /// there are any). Exit status: 0, 1 when an allocation failed, 2 on a usage or input error.
    // Boxed: it holds a whole `Config`, far larger than the other variants.
    Stats(Box<StatsArgs>),
}

/// Options of `cudalloc replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Add a policy to compare: torch, torch-expandable or default (repeatable; with neither
    /// --policy nor --config, all three are compared).
    #[arg(long = "policy", value_name = "POLICY", value_parser = parse_policy)]
    pub policies: Vec<Policy>,

    /// Add a configuration to compare, in PYTORCH_CUDA_ALLOC_CONF syntax plus cudalloc's keys,
    /// e.g. `policy:torch,max_split_size_mb:128` (repeatable; labelled by the string itself).
    /// Without a `policy` key it is the `default` policy with those keys, labelled
    /// `policy:default,STR` and said on stderr (add `policy:torch` for PyTorch's rules); a key
    /// given twice takes its last value. Keys: policy, max_split_size_mb, max_non_split_rounding_mb,
    /// roundup_power2_divisions, garbage_collection_threshold (`torch` only, and only under a
    /// cap: --capacity, --min-capacity or per_process_memory_fraction),
    /// per_process_memory_fraction (a cap at that fraction of the device, as --capacity sets
    /// one; with both, the lower), expandable_segments, fragmentation_budget,
    /// max_chunk_mb, layout_plans, repage_under_cap and lend_blocks (the last five for the
    /// `default` policy only; lend_blocks acts only with --shards; values and
    /// meanings: docs/policies.md and the `cudalloc::config` module docs). The thread_cache keys
    /// are refused: a replay drives the pool on one thread, without thread caches.
    #[arg(long = "config", value_name = "STR", value_parser = parse_variant)]
    pub configs: Vec<Variant>,

    /// Add, after each policy or configuration (the `default` policy when none is given), one
    /// configuration per value of a key, that key alone changed: `max_chunk_mb=16,40,64` adds
    /// `...,max_chunk_mb:16` and so on (repeatable; each key is swept on its own, not crossed
    /// with the others, unless --cross; a key only one policy reads, such as max_chunk_mb for
    /// `default` or garbage_collection_threshold for `torch`, only after that policy's
    /// configurations). One point of the memory / driver-call frontier per value.
    #[arg(long = "sweep", value_name = "KEY=V1,V2,...", value_parser = sweep::parse_sweep)]
    pub sweeps: Vec<Sweep>,

    /// Cross the --sweep keys: after each policy or configuration, one configuration per
    /// combination of their values (`--sweep max_chunk_mb=6,8 --sweep
    /// fragmentation_budget=0.01,0.015 --cross` adds four) instead of one per value of each key
    /// alone. A key swept twice is an error then.
    #[arg(long, requires = "sweeps")]
    pub cross: bool,

    /// Cap the pool at this many bytes (`80GiB`, `512MiB`, `1.5GB` or plain bytes) and report
    /// where a replay fails. Without it (and without per_process_memory_fraction in the
    /// configuration) a replay may use the whole device (the simulated H200's 143,771 MiB, or
    /// GPU 0's memory with --cuda); with both, the lower cap holds. Under a cap the `default`
    /// policy runs in its capped mode (under any cap, even the whole device, until an episode of
    /// its layout plans has ended; from then on a cap of eight times the wide ceiling below or more
    /// runs the uncapped rules; never with layout_plans:False): cached memory kept up to ten
    /// fragmentation budgets above the peak live bytes (20% at the default budget) as far as the
    /// cap allows, no page kept for a layout plan's footprint, a page ahead while loading only
    /// where it lets a next tensor of the same size fit without a call and leaves a page of the cap
    /// free, a large request of eight chunks and 320 MiB or more that finds no cached block gets a
    /// range of its own mapped as one chunk, and when a growth does not fit, chunks that live
    /// blocks keep mapped are made again from their live pages (repage_under_cap; turned off, it
    /// maps one 2 MiB page per call instead, many more driver calls).
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub capacity: Option<u64>,

    /// Also find, by bisection, the smallest cap each replay completes under (in whole 2 MiB
    /// pages of the simulated device). The probes are capped, so the `default` policy runs them
    /// in its capped mode (see --capacity), under the lower of the probe's cap and the one a
    /// per_process_memory_fraction sets; the other figures come from the replay without a cap
    /// unless --capacity (or the fraction) caps it.
    #[arg(long)]
    pub min_capacity: bool,

    /// Replay on GPU 0 through the CUDA driver instead of the simulated device (real mallocs,
    /// page maps and unmaps; ns/op then includes driver time). Each stream of the trace but
    /// the default one runs on a stream the replay opens.
    #[arg(long)]
    pub cuda: bool,

    /// Replay as if the GPU ran N operations behind the host, as it does in a program that
    /// queues kernels without waiting for them: work the allocator queues on a stream during
    /// one operation (the event a release of pages waits for) completes N operations later, so
    /// pages given back stay held until then. The simulated device only (not with --cuda, nor
    /// with --min-capacity, whose probes run with the device keeping up). Without it the device
    /// keeps up, and a release completes at once.
    #[arg(long, value_name = "N")]
    pub device_lag: Option<u64>,

    /// Answer the allocator's event queries (is the work before this event done?) as the
    /// recording's GPU answered them: traces written by the C library (`cudalloc_trace_start`)
    /// hold those answers (`event_done`, `event_pending`), each in the call it was given in.
    /// The replay then drives the allocator a program runs (its stream shards, no thread
    /// cache) rather than one pool, so that a real run of `default` whose GPU ran behind,
    /// recorded with `thread_cache:False`, replays as it ran. Each query gets the first answer
    /// not given yet that was recorded in its operation about its event's stream; a query with
    /// none (another policy asks at other times) is answered done. The simulated device only,
    /// not with --device-lag nor --min-capacity; a trace without answers is refused.
    #[arg(long)]
    pub answers: bool,

    /// Drive the allocator a program runs (its stream shards, each a pool with its own budget;
    /// no thread cache) rather than one pool, on a device that keeps up: where a job's streams
    /// each hold a cache, the figures a program gets (one pool's budget gives back any
    /// stream's blocks). Implied by --answers; the simulated device only, not with
    /// --device-lag nor --min-capacity.
    #[arg(long)]
    pub shards: bool,

    /// Also say where the reserved bytes are at their peak: what live allocations asked for,
    /// rounding, blocks waiting for other streams, free memory the pool could give back, and
    /// free memory pinned by live blocks in the same chunk or segment (and how much of it lies in
    /// whole pages that no live block touches, which smaller chunks would give back); and which
    /// chunks or segments pin the most, beside which blocks (and the operation that allocated
    /// them).
    #[arg(long)]
    pub breakdown: bool,

    /// Write live, allocated and reserved bytes over each trace to a self-contained HTML file
    /// (each point the most of each figure over its stretch of operations, so the plotted
    /// peaks are the replay's).
    #[arg(long, value_name = "FILE.html")]
    pub plot: Option<PathBuf>,

    /// Write every operation that made driver calls, of every trace under every policy or
    /// configuration, to a CSV file: the trace, the configuration, the operation's index, alloc
    /// or free, its bytes and stream, the live and reserved bytes after it, and the mallocs,
    /// frees, maps and unmaps it made, and whether it took the live bytes to a new high. Shows
    /// where a policy's calls go (which phase of a trace, which request sizes, growth to new
    /// highs of the live bytes against the rest).
    #[arg(long, value_name = "FILE.csv")]
    pub calls: Option<PathBuf>,

    /// A split of the trace set (a JSON object of parts, each an array of trace paths or names,
    /// e.g. traces/split.json): after the summary, one summary per part of the traces replayed,
    /// and one of those in no part; with --json, each line names the trace's part (split_part).
    #[arg(long, value_name = "FILE.json")]
    pub split: Option<PathBuf>,

    /// Print one JSON object per (trace, policy) per line instead of tables (keys: docs/cli.md;
    /// `completed` and `failure` say whether and where a replay stopped).
    #[arg(long)]
    pub json: bool,

    /// The device whose events to read from PyTorch snapshot pickles (default: device 0 if it
    /// has events, else the only device that has); an error for a CSV or RMM trace.
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,

    /// Trace files (our CSV, plain or gzip; PyTorch snapshot pickles; RMM logs). None: the
    /// bundled traces in `traces/`.
    #[arg(value_name = "TRACE")]
    pub traces: Vec<PathBuf>,
}

impl ReplayArgs {
    /// The configurations to compare, in order: the policies, then the config strings.
    /// With `--sweep`, each of them is followed by its swept configurations; a swept value that
    /// one of them refuses (`expandable_segments:False` on `default`) is an error naming both.
    pub fn variants(&self) -> Result<Vec<Variant>, String> {
        let bases: Vec<Variant> = if !self.policies.is_empty() || !self.configs.is_empty() {
            let policies = self.policies.iter().copied().map(Variant::policy);
            policies.chain(self.configs.iter().cloned()).collect()
        } else if self.sweeps.is_empty() {
            Policy::ALL.into_iter().map(Variant::policy).collect()
        } else {
            vec![Variant::policy(Policy::Default)]
        };
        sweep::expand(bases, &self.sweeps, self.cross)
    }
}

/// The entries of a config string or a `--sweep` value list: split at the commas outside
/// brackets (a value may be a list, as `roundup_power2_divisions`' is), untrimmed.
pub fn entries(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// Options of `cudalloc stats`.
#[derive(Args, Debug)]
pub struct StatsArgs {
    /// The trace file.
    #[arg(value_name = "TRACE")]
    pub trace: PathBuf,

    /// The policy: torch, torch-expandable or default (the default, as for a config string
    /// without a `policy` key).
    #[arg(long, value_name = "POLICY", default_value = "default", value_parser = parse_policy)]
    pub policy: Policy,

    /// A config string instead of --policy (see `cudalloc replay --help`); without a `policy`
    /// key it is the `default` policy with those keys, labelled `policy:default,STR`.
    #[arg(long, value_name = "STR", value_parser = parse_variant, conflicts_with = "policy")]
    pub config: Option<Variant>,

    /// The device whose events to read from a PyTorch snapshot pickle (as `replay --device`).
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
}

impl StatsArgs {
    /// The configuration asked for.
    pub fn variant(&self) -> Variant {
        self.config
            .clone()
            .unwrap_or_else(|| Variant::policy(self.policy))
    }
}

/// A configuration to replay under, with the label reports give it.
#[derive(Clone, Debug)]
pub struct Variant {
    /// The policy name or the config string.
    pub label: String,
    /// The configuration.
    pub cfg: Config,
    /// A config string that gives `cfg` (`policy:NAME` for a policy), which `--sweep` extends.
    pub(crate) config: String,
    /// The string given, when it has no `policy` key (its policy is then `default`).
    pub(crate) without_policy: Option<String>,
}

impl Variant {
    /// A policy with no further keys, labelled by its name.
    pub fn policy(p: Policy) -> Variant {
        Variant {
            label: p.name().to_string(),
            cfg: Config::for_policy(p),
            config: format!("policy:{}", p.name()),
            without_policy: None,
        }
    }

    /// What to say on stderr about a config string given without a `policy` key: which
    /// policy it runs, and its label.
    pub fn note(&self) -> Option<String> {
        let given = self.without_policy.as_ref()?;
        Some(format!(
            "note: config '{given}' has no policy key: it runs the {} policy (labelled `{}`); \
             add policy:torch for PyTorch's rules",
            self.cfg.policy().name(),
            self.label
        ))
    }
}

/// True for a config string entry whose key is `policy`.
pub(crate) fn is_policy_entry(entry: &&str) -> bool {
    entry
        .split(':')
        .next()
        .is_some_and(|k| k.trim() == "policy")
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    Policy::parse(s).map_err(|e| e.message)
}

fn parse_variant(s: &str) -> Result<Variant, String> {
    if s.trim().trim_matches(',').trim().is_empty() {
        return Err(
            "an empty config string (for the default policy, give --policy default)".into(),
        );
    }
    let cfg = Config::parse(s).map_err(|e| e.to_string())?;
    // A trailing comma is accepted alone, not before another entry.
    let config = s.trim().trim_end_matches(',').trim_end().to_string();
    if entries(&config).iter().any(is_policy_entry) {
        return Ok(Variant {
            label: s.to_string(),
            cfg,
            config,
            without_policy: None,
        });
    }
    // Without a `policy` key the string runs the `default` policy: the label says so, and
    // gives the same configuration (`expandable_segments` applies after the policy).
    let config = format!("policy:{},{config}", cfg.policy().name());
    Ok(Variant {
        label: config.clone(),
        cfg,
        config,
        without_policy: Some(s.to_string()),
    })
}

/// Byte units: decimal (`kB`, `MB`, `GB`, `TB`) and binary (`KiB`, `MiB`, `GiB`, `TiB`).
const UNITS: [(&str, u64); 9] = [
    ("b", 1),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
];

/// Parses `1073741824`, `80GiB`, `512 MiB`, `1.5GB` (units are case-insensitive).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim());
    let exponent = unit
        .strip_prefix(['e', 'E'])
        .map(|e| e.trim_start_matches(['+', '-']));
    if !number.is_empty() && exponent.is_some_and(|e| e.starts_with(|c: char| c.is_ascii_digit())) {
        return Err(format!(
            "`{s}`: exponents are not read; write the bytes with a unit (e.g. 1GB, 1.5GiB)"
        ));
    }
    if unit.is_empty() {
        // Only digits can be too large (`1.5.5` past 64 bits is malformed, not large).
        let digits = number.bytes().all(|b| b.is_ascii_digit());
        return number.parse::<u64>().map_err(|e| match e.kind() {
            IntErrorKind::PosOverflow if digits => format!("`{s}` is too large"),
            _ => format!("`{s}` is not a byte count (e.g. 80GiB, 512MiB, 1.5GB, 1048576)"),
        });
    }
    let scale = UNITS
        .iter()
        .find(|(u, _)| u.eq_ignore_ascii_case(unit))
        .map(|(_, m)| *m)
        .ok_or_else(|| {
            format!("unknown unit `{unit}` in `{s}` (use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB)")
        })?;
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{number}` in `{s}` is not a number"))?;
    let bytes = (value * scale as f64).round();
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is too large"));
    }
    if bytes == 0.0 && value > 0.0 {
        return Err(format!("`{s}` rounds to 0 bytes"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, Cli, Command, ReplayArgs};
    use crate::sweep::parse_sweep;
    use clap::Parser;
    use cudalloc::{Config, Policy};

    fn replay_args(args: &[&str]) -> ReplayArgs {
        let argv = ["cudalloc", "replay"].iter().chain(args);
        match Cli::try_parse_from(argv).expect("valid arguments").command {
            Command::Replay(r) => *r,
            other => panic!("{other:?}"),
        }
    }

    fn labels(args: &[&str]) -> Vec<String> {
        replay_args(args)
            .variants()
            .expect("valid variants")
            .into_iter()
            .map(|v| v.label)
            .collect()
    }

    #[test]
    fn a_crossed_sweep_adds_every_combination_after_each_base() {
        let sweeps = [
            "--sweep",
            "max_chunk_mb=6,8",
            "--sweep",
            "fragmentation_budget=0.01,0.015",
            "--sweep",
            "max_split_size_mb=128",
        ];
        let args: Vec<&str> = ["--policy", "default", "--policy", "torch"]
            .into_iter()
            .chain(sweeps)
            .chain(["--cross"])
            .collect();
        let v = replay_args(&args).variants().expect("valid variants");
        let got: Vec<&str> = v.iter().map(|v| v.label.as_str()).collect();
        let d = "policy:default";
        let combo = |c: u32, b: &str| {
            format!("{d},max_chunk_mb:{c},fragmentation_budget:{b},max_split_size_mb:128")
        };
        let want = [
            "default".to_string(),
            combo(6, "0.01"),
            combo(6, "0.015"),
            combo(8, "0.01"),
            combo(8, "0.015"),
            // `torch` reads only the key it shares with `default`.
            "torch".into(),
            "policy:torch,max_split_size_mb:128".into(),
        ];
        assert_eq!(got, want);
        // Each added label gives its configuration (a base's is a policy's name).
        for x in v.iter().filter(|x| x.label.contains(':')) {
            let again = Config::parse(&x.label).expect("a label is a config string");
            assert_eq!(again.policy_config(), x.cfg.policy_config(), "{}", x.label);
        }
        assert_eq!(v[4].cfg.pool().max_split_size, 128 << 20);
        // One key alone crosses with nothing: the same as without --cross.
        assert_eq!(
            labels(&["--sweep", "max_chunk_mb=6,8", "--cross"]),
            labels(&["--sweep", "max_chunk_mb=6,8"])
        );
        let twice = [
            "--sweep",
            "max_chunk_mb=6",
            "--sweep",
            "max_chunk_mb=8",
            "--cross",
        ];
        let e = replay_args(&twice).variants().unwrap_err();
        assert!(e.contains("`max_chunk_mb` is swept twice"), "{e}");
        // A swept policy is crossed first; a key only `default` reads skips `torch`'s rows.
        assert_eq!(
            labels(&[
                "--sweep",
                "max_chunk_mb=8",
                "--sweep",
                "policy=torch,default",
                "--cross"
            ]),
            ["default", "policy:torch", "policy:default,max_chunk_mb:8"]
        );
        let many = [
            "--sweep",
            "max_chunk_mb=2,4,6,8",
            "--sweep",
            "max_split_size_mb=128,256,512",
        ];
        let values: Vec<String> = (1..=84).map(|i| format!("0.{i:03}")).collect();
        let budget = format!("fragmentation_budget={}", values.join(","));
        let args: Vec<&str> = many
            .into_iter()
            .chain(["--sweep", &budget, "--cross"])
            .collect();
        let e = replay_args(&args).variants().unwrap_err();
        assert!(e.contains("more than 1000 combinations"), "{e}");
        let argv = ["cudalloc", "replay", "--cross", "t.csv"];
        assert!(
            Cli::try_parse_from(argv).is_err(),
            "--cross without --sweep"
        );
    }

    #[test]
    fn a_sweep_follows_each_base_with_one_key_changed_at_a_time() {
        assert_eq!(
            labels(&[
                "--sweep",
                "max_chunk_mb=16,64",
                "--sweep",
                "fragmentation_budget=0.05"
            ]),
            [
                "default",
                "policy:default,max_chunk_mb:16",
                "policy:default,max_chunk_mb:64",
                "policy:default,fragmentation_budget:0.05",
            ]
        );
        let args = replay_args(&[
            "--policy",
            "torch",
            "--config",
            "policy:default,max_chunk_mb:8",
            "--sweep",
            "max_split_size_mb=128",
        ]);
        let v = args.variants().expect("valid variants");
        let got: Vec<&str> = v.iter().map(|v| v.label.as_str()).collect();
        assert_eq!(
            got,
            [
                "torch",
                "policy:torch,max_split_size_mb:128",
                "policy:default,max_chunk_mb:8",
                "policy:default,max_chunk_mb:8,max_split_size_mb:128",
            ]
        );
        assert_eq!(v[1].cfg.pool().max_split_size, 128 << 20);
        let want = Config::parse("max_chunk_mb:8").unwrap();
        assert_eq!(
            v[3].cfg.policy_config(),
            want.policy_config(),
            "the base's keys are kept"
        );
        assert_eq!(v[3].cfg.pool().max_split_size, 128 << 20);
        assert_eq!(
            v[0].cfg.pool().max_split_size,
            u64::MAX,
            "the base itself is unchanged"
        );
    }

    /// `expandable_segments:False` suits PyTorch's policies and not `default`: swept from
    /// `torch` it is a configuration, swept from `default` an error naming both.
    #[test]
    fn a_swept_value_one_base_refuses_is_an_error_naming_both() {
        let v = replay_args(&[
            "--policy",
            "torch",
            "--sweep",
            "expandable_segments=True,False",
        ])
        .variants()
        .expect("torch takes both");
        let policies: Vec<_> = v.iter().map(|v| v.cfg.policy()).collect();
        assert_eq!(
            policies,
            [Policy::Torch, Policy::TorchExpandable, Policy::Torch]
        );
        let e = replay_args(&["--sweep", "expandable_segments=False"])
            .variants()
            .unwrap_err();
        assert!(
            e.contains("expandable_segments:False") && e.contains("`default`"),
            "{e}"
        );
    }

    #[test]
    fn a_sweep_splits_values_outside_brackets_and_names_what_is_wrong() {
        let s = parse_sweep("roundup_power2_divisions=[256:1,>:2],4").unwrap();
        assert_eq!(s.values, ["[256:1,>:2]", "4"]);
        assert!(parse_sweep("max_chunk_mb")
            .unwrap_err()
            .contains("KEY=V1,V2"));
        assert!(parse_sweep("max_chunk_mb=16,,64")
            .unwrap_err()
            .contains("empty"));
        assert!(parse_sweep("max_chunk_mbs=16")
            .unwrap_err()
            .contains("max_chunk_mbs"));
        assert!(parse_sweep("max_chunk_mb=lots")
            .unwrap_err()
            .contains("max_chunk_mb"));
        let two = parse_sweep("layout_plans:false,max_chunk_mb=16").unwrap_err();
        assert!(two.contains("not one config key"), "{two}");
    }

    /// A swept configuration is its base with the key set to the value, and its label is a
    /// config string that gives it (a base written with a trailing comma included);
    /// `expandable_segments` in the base still applies after a swept `policy`, as in the label.
    #[test]
    fn a_swept_configuration_is_its_base_with_one_key_changed() {
        let args = replay_args(&[
            "--policy",
            "torch-expandable",
            "--config",
            "policy:default, ",
            "--sweep",
            "max_split_size_mb=64,256",
            "--sweep",
            "roundup_power2_divisions=[256:1,>:2]",
        ]);
        let variants = args.variants().expect("valid variants");
        let bases = [
            Config::for_policy(Policy::TorchExpandable),
            Config::default(),
        ];
        let entries = [
            "max_split_size_mb:64",
            "max_split_size_mb:256",
            "roundup_power2_divisions:[256:1,>:2]",
        ];
        for (chunk, base) in variants.chunks(1 + entries.len()).zip(bases) {
            assert_eq!(chunk[0].cfg, base);
            for (v, entry) in chunk[1..].iter().zip(entries) {
                let want = Config::parse_onto(base.clone(), entry).unwrap();
                assert_eq!(v.cfg, want, "{}", v.label);
                assert_eq!(Config::parse(&v.label).as_ref(), Ok(&want), "{}", v.label);
            }
        }
        let v = replay_args(&[
            "--config",
            "policy:torch,expandable_segments:True",
            "--sweep",
            "policy=torch,default",
        ])
        .variants()
        .expect("valid variants");
        let policies: Vec<_> = v.iter().map(|v| v.cfg.policy()).collect();
        assert_eq!(
            policies,
            [
                Policy::TorchExpandable,
                Policy::TorchExpandable,
                Policy::Default
            ]
        );
    }

    #[test]
    fn bytes_with_units() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("80GiB"), Ok(80 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("2gib"), Ok(2 << 30));
        assert!(parse_bytes("1.5").is_err());
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("-1GiB").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
        // Digits past u64::MAX are a byte count too large, not a malformed one.
        assert_eq!(
            parse_bytes("18446744073709551616"),
            Err("`18446744073709551616` is too large".to_string())
        );
        assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX));
    }
}
