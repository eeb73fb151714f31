//! `cudalloc replay --answers`: a trace recorded with the device's answers to the allocator's
//! event queries (written here as the C library writes one, from a run of `default` whose
//! simulated device runs 10 operations behind) replays to the run's own figures, and the JSON
//! row and the table say how many answers the replay gave (and, when it gave fewer than were
//! recorded, why that may be); `--shards` drives the same stream shards on a device that keeps
//! up, where one pool's budget would give back another stream's cache, and a replay in one pool
//! of a trace of several streams says so on stderr.

use super::run::{bert, bundled, csv_trace, cudalloc, json_lines, scratch, stderr, stdout};
use cudalloc::record::Recorder;
use cudalloc::{CachingAllocator, Config};
use cudalloc_sys::wrap::RecordAnswers;
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use cudalloc_trace::replay::{Lagging, DEVICE_CAPACITY};
use cudalloc_trace::{read, Op};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What the recorded run reserved at most and its driver calls.
struct Ran {
    peak_reserved: u64,
    calls: u64,
}

/// Runs the first `ops` operations of `job` under `default` (no thread cache), its device 10
/// operations behind, recording each call's answers before its events into `to`.
fn record_lagging(job: &Path, ops: usize, to: &Path) -> Ran {
    let job = read(job).unwrap();
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(DEVICE_CAPACITY)));
    sim.set_auto_complete(false);
    let cfg = Config::parse("policy:default,thread_cache:False").unwrap();
    let alloc = CachingAllocator::new(RecordAnswers::new(sim.clone()), cfg);
    let mut lagging = Lagging::new(sim, 10);
    let mut rec = Recorder::new(std::fs::File::create(to).unwrap()).unwrap();
    let mut slots = vec![0u64; job.slots as usize];
    for op in job.ops.iter().take(ops) {
        lagging.tick();
        match *op {
            Op::Alloc { slot, stream, size } => {
                let s = StreamId(job.streams[stream as usize]);
                let (r, answers) = alloc.with_device(|d| d.record(|| alloc.allocate(size, s)));
                rec.answered(&answers);
                rec.allocated(&r, size, s);
                slots[slot as usize] = r.unwrap().ptr();
            }
            Op::Free { slot } => {
                let ptr = slots[slot as usize];
                let (r, answers) = alloc.with_device(|d| d.record(|| alloc.free_ptr(ptr)));
                r.unwrap();
                rec.answered(&answers);
                rec.freed(ptr);
            }
        }
    }
    rec.finish().unwrap();
    let s = alloc.stats();
    Ran {
        peak_reserved: s.reserved_bytes.0[0].peak as u64,
        calls: s.calls.total(),
    }
}

fn row(trace: &str, answers: bool) -> serde_json::Value {
    let mut args = vec!["replay", "--json", "--policy", "default", trace];
    if answers {
        args.push("--answers");
    }
    let o = cudalloc(&args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    json_lines(&o).swap_remove(0)
}

fn figures(v: &serde_json::Value) -> (u64, u64) {
    let calls = [
        "device_mallocs",
        "device_frees",
        "device_maps",
        "device_unmaps",
    ]
    .iter()
    .map(|k| v[k].as_u64().unwrap())
    .sum();
    (v["peak_reserved_bytes"].as_u64().unwrap(), calls)
}

#[test]
fn a_lagging_run_replays_to_its_own_figures_given_its_answers() {
    let path: PathBuf = scratch("answers").join("lagging.csv");
    let job = bundled("h200/gnn_train_dynamic.trace.csv.gz");
    let ran = record_lagging(Path::new(&job), 2_000, &path);
    let trace = path.to_str().unwrap();
    let given = row(trace, true);
    let a = &given["answers"];
    let recorded = a["recorded"].as_u64().unwrap();
    assert!(recorded > 0, "the device ran behind: {a}");
    assert_eq!(
        a["used"].as_u64(),
        Some(recorded),
        "every answer given: {a}"
    );
    assert_eq!(a["unrecorded"], 0);
    assert_eq!(figures(&given), (ran.peak_reserved, ran.calls));
    let plain = row(trace, false);
    assert!(plain["answers"].is_null());
    assert_ne!(
        figures(&plain),
        figures(&given),
        "the answers make the difference"
    );
    let o = cudalloc(&["replay", "--answers", "--policy", "default", trace]);
    let said = format!(
        "default: {} of the {} recorded answers to event queries given as the GPU gave them; \
         0 queries had none left",
        recorded, recorded
    );
    assert!(stdout(&o).contains(&said), "{}", stdout(&o));
    assert!(!stdout(&o).contains("asks at other times"));
    // Another policy asks at other times (`torch-expandable` never gives pages back).
    let o = cudalloc(&["replay", "--answers", "--policy", "torch-expandable", trace]);
    let said = format!("torch-expandable: 0 of the {recorded} recorded answers");
    assert!(stdout(&o).contains(&said), "{}", stdout(&o));
    assert!(stdout(&o).contains("asks at other times"), "{}", stdout(&o));
}

/// Stream 1 makes and frees sixteen 64 MiB blocks, then stream 2 makes sixteen and holds them.
fn two_streams_in_turn() -> String {
    let mib64 = 64u64 << 20;
    let mut lines = String::new();
    for i in 0..16u64 {
        lines += &format!("alloc,{},{mib64},1,0\n", (i + 1) * mib64);
    }
    for i in 0..16u64 {
        lines += &format!("free_completed,{},{mib64},1,0\n", (i + 1) * mib64);
    }
    for i in 0..16u64 {
        lines += &format!("alloc,{},{mib64},2,0\n", (i + 17) * mib64);
    }
    lines
}

#[test]
fn through_the_shards_a_finished_stream_keeps_its_cache_longer_than_in_one_pool() {
    let path = csv_trace("shards", "turns.csv", &two_streams_in_turn());
    let trace = path.to_str().unwrap();
    let pool = row(trace, false);
    let o = cudalloc(&["replay", "--json", "--shards", "--policy", "default", trace]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let shards = json_lines(&o).swap_remove(0);
    assert_eq!(
        (pool["shards"].as_bool(), shards["shards"].as_bool()),
        (Some(false), Some(true))
    );
    assert!(
        shards["answers"].is_null(),
        "no answers without --answers: {shards}"
    );
    let reserved = |v: &serde_json::Value| v["peak_reserved_bytes"].as_u64().unwrap();
    let live = 1u64 << 30;
    // One pool's budget gives stream 1's blocks back as stream 2 grows; a shard keeps them
    // until stream 2 has grown eight times (the front's rule over the shared ceiling).
    assert!(reserved(&pool) <= live + live / 16, "one pool: {pool}");
    assert!(reserved(&shards) >= live + live / 4, "shards: {shards}");
    assert!(reserved(&shards) <= live + live * 3 / 4, "shards: {shards}");
    let o = cudalloc(&["replay", "--shards", "--policy", "default", trace]);
    assert!(
        stdout(&o).contains("default: replayed through the allocator's stream shards"),
        "{}",
        stdout(&o)
    );
}

/// A trace of several streams replayed in one pool under `default` gets a note saying that a
/// program's stream shards may reserve more and how to replay them; with `--shards`, under
/// PyTorch's rules alone (no budget) or with one stream, none.
#[test]
fn a_trace_of_several_streams_notes_the_shards() {
    let lines = "alloc,4096,1048576,0,1\nalloc,8192,2097152,7,2\nfree_completed,4096,1048576,0,3\n\
                 free_completed,8192,2097152,7,4\n";
    let two = csv_trace("note-streams", "two.trace.csv", lines);
    let two = two.to_str().unwrap();
    let o = cudalloc(&["replay", "--policy", "default", two]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("two.trace.csv uses 2 streams") && stderr(&o).contains("--shards"),
        "{}",
        stderr(&o)
    );
    let quiet: [&[&str]; 2] = [
        &["--policy", "default", "--shards"],
        &["--policy", "torch", "--policy", "torch-expandable"],
    ];
    for flags in quiet {
        let args: Vec<&str> = ["replay"]
            .iter()
            .chain(flags)
            .chain([&two])
            .copied()
            .collect();
        let o = cudalloc(&args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        assert!(!stderr(&o).contains("streams"), "{flags:?}: {}", stderr(&o));
    }
    let o = cudalloc(&["replay", "--policy", "default", &bert()]);
    assert!(!stderr(&o).contains("streams"), "{}", stderr(&o));
}
