//! Tests of the tracer (`trace`) on the simulated device.

use super::*;
use cudalloc_core::record::Action;
use cudalloc_core::Config;
use cudalloc_sys::{SimConfig, SimDevice};
use cudalloc_trace::read;

/// PyTorch's rules: no per-thread caches, so a freed block is free in the snapshot.
fn sim_allocator() -> Traced<SimDevice> {
    allocator_for(cudalloc_core::Policy::Torch)
}

fn allocator_for(policy: cudalloc_core::Policy) -> Traced<SimDevice> {
    let sim = SimDevice::new(SimConfig::with_capacity(1 << 30));
    CachingAllocator::new(RecordAnswers::new(sim), Config::for_policy(policy))
}

fn lines(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines().map(str::to_string).collect()
}

#[test]
fn records_only_while_on_and_starts_from_the_live_set() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.csv");
    let alloc = sim_allocator();
    let t = Tracer::new();
    let s = StreamId(7);
    let before = t.allocate(&alloc, 1000, s, None).unwrap();
    let gone = t.allocate(&alloc, 3000, s, None).unwrap();
    t.free(&alloc, gone.ptr()).unwrap();
    t.start(&path, Some(&alloc)).unwrap();
    assert!(t.is_recording());
    assert!(t
        .start(&path, Some(&alloc))
        .unwrap_err()
        .contains("already"));
    let a = t.allocate(&alloc, 2 << 20, s, None).unwrap();
    assert!(t.allocate(&alloc, 4 << 30, s, None).is_err());
    assert!(
        t.allocate(&alloc, 1 << 50, s, None).is_err(),
        "more than any device holds"
    );
    t.free(&alloc, before.ptr()).unwrap();
    t.free(&alloc, a.ptr()).unwrap();
    t.stop(Some(&alloc)).unwrap();
    assert!(!t.is_recording());
    let after = t.allocate(&alloc, 10, s, None).unwrap();
    t.free(&alloc, after.ptr()).unwrap();
    let l = lines(&path);
    assert_eq!(l[0], cudalloc_core::record::csv::HEADER);
    assert_eq!(l[1], format!("alloc,{},1000,7,0", before.ptr()));
    let actions: Vec<&str> = l[1..]
        .iter()
        .map(|x| x.split(',').next().unwrap())
        .collect();
    assert_eq!(
        actions,
        [
            "alloc",
            "alloc",
            "oom",
            "oom",
            "free_requested",
            "free_completed",
            "free_requested",
            "free_completed"
        ]
    );
    assert!(l[3].starts_with(&format!("oom,0,{},7,", 4u64 << 30)));
    assert!(l[4].starts_with(&format!("oom,0,{},7,", 1u64 << 50)));
    let trace = read(&path).unwrap();
    assert_eq!(trace.anomalies.unmatched_frees, 0);
    assert!(t.stop(Some(&alloc)).unwrap_err().contains("no trace"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Under the `default` rules a freed block may stay in its thread's cache: the trace does
/// not start with it as live, so its next hand-out (a cache hit) is no second `alloc` of a
/// live address.
#[test]
fn a_block_in_a_thread_cache_is_not_in_the_starting_live_set() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-tc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.csv");
    let alloc = allocator_for(cudalloc_core::Policy::Default);
    let t = Tracer::new();
    let s = StreamId(7);
    let keep = t.allocate(&alloc, 1000, s, None).unwrap();
    let cached = t.allocate(&alloc, 3000, s, None).unwrap();
    t.free(&alloc, cached.ptr()).unwrap();
    t.start(&path, Some(&alloc)).unwrap();
    let again = t.allocate(&alloc, 3000, s, None).unwrap();
    assert_eq!(again.ptr(), cached.ptr(), "a thread-cache hit");
    t.free(&alloc, again.ptr()).unwrap();
    t.free(&alloc, keep.ptr()).unwrap();
    t.stop(Some(&alloc)).unwrap();
    let l = lines(&path);
    assert_eq!(l[1], format!("alloc,{},1000,7,0", keep.ptr()));
    assert!(l[2].starts_with(&format!("alloc,{},3000,7,", cached.ptr())));
    assert_eq!(l.len(), 7, "{l:?}");
    assert_eq!(read(&path).unwrap().anomalies, Default::default());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gzip_when_the_name_ends_in_gz() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-gz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.csv.gz");
    let alloc = sim_allocator();
    let t = Tracer::new();
    t.start::<SimDevice>(&path, None).unwrap();
    let a = t.allocate(&alloc, 512, StreamId::DEFAULT, None).unwrap();
    t.free(&alloc, a.ptr()).unwrap();
    t.stop(Some(&alloc)).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..2], &[0x1f, 0x8b]);
    let trace = read(&path).unwrap();
    assert_eq!(trace.anomalies, Default::default());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gzip_when_the_file_is_named_just_gz() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-dotgz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(".gz");
    let t = Tracer::new();
    t.start::<SimDevice>(&path, None).unwrap();
    t.stop::<SimDevice>(None).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..2], &[0x1f, 0x8b], "not gzip'd");
    assert!(read(&path).unwrap().ops.is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Records a few calls to `path` and stops: the result of `stop`.
fn trace_a_few_calls(path: &Path) -> Result<(), String> {
    let alloc = sim_allocator();
    let t = Tracer::new();
    t.start::<SimDevice>(path, None)?;
    for _ in 0..100 {
        let a = t.allocate(&alloc, 512, StreamId::DEFAULT, None).unwrap();
        t.free(&alloc, a.ptr()).unwrap();
    }
    t.stop(Some(&alloc))
}

/// /dev/null takes every byte, but is not a file that fsync can sync (EINVAL on Linux).
#[cfg(unix)]
#[test]
fn a_trace_to_a_character_device_stops_cleanly() {
    trace_a_few_calls(Path::new("/dev/null")).unwrap();
}

/// A FIFO (as `/dev/stdout | cat` is a pipe) gets the whole trace, and stopping succeeds.
#[cfg(unix)]
#[test]
fn a_trace_to_a_fifo_is_read_whole_and_stops_cleanly() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("t.csv");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", fifo.display());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
    };
    // Checked before the join: a trace that never opened the FIFO leaves the reader waiting.
    trace_a_few_calls(&fifo).unwrap();
    let text = reader.join().unwrap();
    assert!(
        text.starts_with(cudalloc_core::record::csv::HEADER),
        "{text}"
    );
    assert_eq!(text.lines().count(), 1 + 100 * 3, "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_path_is_an_error() {
    let t = Tracer::new();
    let e = t
        .start::<SimDevice>(Path::new("/nonexistent-dir/x/t.csv"), None)
        .unwrap_err();
    assert!(
        e.contains("cannot write a trace to /nonexistent-dir/x/t.csv"),
        "{e}"
    );
    assert!(!t.is_recording());
}

/// An allocation used on another stream is freed while that stream's work is pending: the
/// trace writes `free_requested` at the free and `free_completed` only when the block went
/// back to the pool (at the allocation after the work completed), before the allocation
/// that reuses it, so a replay reuses it no earlier. Before, both were written at the free.
/// The device's answers to the allocator's queries of that stream's event are written before
/// the allocation whose call asked.
#[test]
fn a_free_waiting_for_another_stream_completes_when_its_block_returns() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-rs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.csv");
    let sim = std::sync::Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
    sim.set_auto_complete(false);
    let alloc = CachingAllocator::new(
        RecordAnswers::new(sim.clone()),
        Config::for_policy(cudalloc_core::Policy::Torch),
    );
    let t = Tracer::new();
    let (s1, s2) = (StreamId(1), StreamId(2));
    t.start::<std::sync::Arc<SimDevice>>(&path, None).unwrap();
    let a = t.allocate(&alloc, 64 << 20, s1, None).unwrap();
    t.record_stream(&alloc, a.ptr(), s2).unwrap();
    t.free(&alloc, a.ptr()).unwrap();
    let b = t.allocate(&alloc, 64 << 20, s1, None).unwrap();
    assert_ne!(b.ptr(), a.ptr(), "the block waits for stream 2");
    t.free(&alloc, b.ptr()).unwrap();
    sim.complete_stream(s2);
    let c = t.allocate(&alloc, 64 << 20, s1, None).unwrap();
    t.free(&alloc, c.ptr()).unwrap();
    t.stop(Some(&alloc)).unwrap();
    let events: Vec<String> = lines(&path)[1..]
        .iter()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let who = if f[0].starts_with("event_") {
                format!("stream {}", f[3])
            } else if f[1] == a.ptr().to_string() {
                "a".into()
            } else {
                "other".into()
            };
            format!("{} {who}", f[0])
        })
        .collect();
    assert_eq!(
        events,
        [
            "alloc a",
            "free_requested a",
            // The query of stream 2's event (in the allocation that follows) and its answer.
            "event_pending stream 2",
            "alloc other",
            "free_requested other",
            "free_completed other",
            "free_completed a",
            "event_done stream 2",
            "alloc a",
            "free_requested a",
            "free_completed a",
        ]
    );
    let trace = read(&path).unwrap();
    assert_eq!(trace.anomalies, Default::default());
    let r = cudalloc_trace::replay::replay(
        &trace,
        &Config::for_policy(cudalloc_core::Policy::Torch),
        &Default::default(),
    );
    let live = alloc.stats();
    assert_eq!(
        (r.peak_reserved_bytes, r.device_mallocs),
        (live.reserved_bytes.0[0].peak as u64, live.num_device_alloc),
        "the replay reserves what the allocator did"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes fail on the writer thread (`/dev/full`: no space left); the allocator keeps
/// serving, and stopping reports the error.
#[cfg(target_os = "linux")]
#[test]
fn a_write_error_on_the_writer_thread_is_reported_by_stop() {
    let alloc = sim_allocator();
    let t = Tracer::new();
    t.start::<SimDevice>(Path::new("/dev/full"), None).unwrap();
    for _ in 0..5_000 {
        let a = t.allocate(&alloc, 512, StreamId::DEFAULT, None).unwrap();
        t.free(&alloc, a.ptr()).unwrap();
    }
    let e = t.stop(Some(&alloc)).unwrap_err();
    assert!(e.contains("writing the trace to /dev/full failed"), "{e}");
    assert!(!t.is_recording());
}

/// The history keeps the latest events in memory, from the live set on, with Unix-epoch
/// times; a free waiting for another stream completes when its block returns, as in a trace.
#[test]
fn the_history_keeps_the_latest_events_in_order() {
    let sim = std::sync::Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
    sim.set_auto_complete(false);
    let alloc = CachingAllocator::new(
        RecordAnswers::new(sim.clone()),
        Config::for_policy(cudalloc_core::Policy::Torch),
    );
    let t = Tracer::new();
    let (s1, s2) = (StreamId(1), StreamId(2));
    let before = t.allocate(&alloc, 1 << 20, s1, None).unwrap();
    let started = epoch_us();
    t.start_history(100, false, Some(&alloc)).unwrap();
    assert!(t.is_keeping_history());
    let a = t.allocate(&alloc, 64 << 20, s1, None).unwrap();
    t.record_stream(&alloc, a.ptr(), s2).unwrap();
    t.free(&alloc, a.ptr()).unwrap();
    assert!(
        t.allocate(&alloc, 1 << 40, s1, None).is_err(),
        "out of memory"
    );
    sim.complete_stream(s2);
    t.free(&alloc, before.ptr()).unwrap();
    let got: Vec<(Action, u64)> = t.history().iter().map(|e| (e.action, e.addr)).collect();
    assert_eq!(
        got,
        [
            (Action::Alloc, before.ptr()),
            (Action::Alloc, a.ptr()),
            (Action::FreeRequested, a.ptr()),
            // The out-of-memory ladder waited for stream 2 before it failed.
            (Action::FreeCompleted, a.ptr()),
            (Action::Oom, 0),
            (Action::FreeRequested, before.ptr()),
            (Action::FreeCompleted, before.ptr()),
        ]
    );
    let times: Vec<u64> = t.history().iter().map(|e| e.time_us).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(times[0] >= started && times[6] <= epoch_us(), "epoch times");
    // Stopped, the events stay; a smaller history keeps the latest; `clear` empties it.
    t.stop_history(Some(&alloc)).unwrap();
    assert!(!t.is_keeping_history());
    assert_eq!(t.history().len(), 7);
    assert!(t
        .stop_history(Some(&alloc))
        .unwrap_err()
        .contains("no memory history"));
    // A new history starts from the live set alone: no allocation appears twice.
    let live = t.allocate(&alloc, 1000, s1, None).unwrap();
    t.start_history(100, false, Some(&alloc)).unwrap();
    let got: Vec<(Action, u64)> = t.history().iter().map(|e| (e.action, e.addr)).collect();
    assert_eq!(got, [(Action::Alloc, live.ptr())]);
    t.free(&alloc, live.ptr()).unwrap();
    t.start_history(2, false, Some(&alloc)).unwrap();
    let kept: Vec<Action> = t.history().iter().map(|e| e.action).collect();
    assert_eq!(
        kept,
        [Action::FreeRequested, Action::FreeCompleted],
        "max 2"
    );
    t.start_history(2, true, Some(&alloc)).unwrap();
    assert!(t.history().is_empty(), "cleared while kept");
    let a = t.allocate(&alloc, 1000, s1, None).unwrap();
    t.stop_history(Some(&alloc)).unwrap();
    assert_eq!(t.history().len(), 1);
    t.clear_history();
    assert!(t.history().is_empty(), "cleared once stopped");
    alloc.free(a).unwrap();
}

/// One recording at a time: a trace file and the history refuse each other, and each stop
/// stops only its own.
#[test]
fn a_trace_and_the_history_exclude_each_other() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-hx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.csv");
    let alloc = sim_allocator();
    let t = Tracer::new();
    t.start_history(10, false, Some(&alloc)).unwrap();
    let e = t.start(&path, Some(&alloc)).unwrap_err();
    assert!(e.contains("memory history is being recorded"), "{e}");
    assert!(t.stop(Some(&alloc)).unwrap_err().contains("no trace"));
    assert!(
        t.is_keeping_history(),
        "a failed trace stop leaves the history on"
    );
    t.stop_history(Some(&alloc)).unwrap();
    t.start(&path, Some(&alloc)).unwrap();
    let e = t.start_history(10, false, Some(&alloc)).unwrap_err();
    assert!(e.contains("a trace is already being recorded"), "{e}");
    assert!(t.stop_history(Some(&alloc)).is_err());
    t.stop(Some(&alloc)).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run of `default` whose device runs behind, traced with the device's answers to its event
/// queries, replays as it ran when the replay gives those answers again (`--answers`): the
/// same peak reserved bytes and driver calls, on one stream and on two (the replay drives the
/// allocator's stream shards as the run did). The same trace replayed on a device that keeps
/// up reserves differently: the answers are what tells them apart.
#[test]
fn a_replay_given_the_recorded_answers_reserves_what_the_lagging_run_did() {
    for streams in [1, 2] {
        let (trace, ran) = lagging_run(streams);
        assert!(
            trace.answers.iter().any(|a| !a.done),
            "the device ran behind"
        );
        let cfg = Config::for_policy(cudalloc_core::Policy::Default);
        let replay = |answers| {
            let opts = cudalloc_trace::replay::ReplayOptions {
                answers,
                ..Default::default()
            };
            cudalloc_trace::replay::replay(&trace, &cfg, &opts)
        };
        let given = replay(true);
        assert_eq!(
            given.peak_live_bytes, trace.peak_live,
            "{streams} stream(s)"
        );
        let used = given.answers.unwrap();
        assert_eq!(
            used.used, used.recorded,
            "{streams} stream(s): every answer asked for"
        );
        assert_eq!(used.unrecorded, 0, "{streams} stream(s)");
        assert_eq!(
            (given.peak_reserved_bytes, given.driver_calls()),
            ran,
            "{streams} stream(s): the replay reserves and calls what the run did"
        );
        let kept_up = replay(false);
        assert_ne!(
            (kept_up.peak_reserved_bytes, kept_up.driver_calls()),
            ran,
            "{streams} stream(s): without the answers the replay is another run"
        );
    }
}

/// Runs `gnn_train_dynamic` under `default` without thread caches on a simulated device 10
/// operations behind, its allocations spread over `streams` streams, through a tracer: the
/// trace read back, and the run's peak reserved bytes (of all its shards at once) and driver
/// calls.
fn lagging_run(streams: u64) -> (cudalloc_trace::Trace, (u64, u64)) {
    let dir = std::env::temp_dir().join(format!(
        "cudalloc-capi-answers-{}-{streams}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.csv.gz");
    let job =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces/h200/gnn_train_dynamic.trace.csv.gz");
    let job = read(&job).unwrap();
    let cfg = Config::parse("policy:default,thread_cache:False").unwrap();
    let sim = std::sync::Arc::new(SimDevice::new(SimConfig::with_capacity(
        cudalloc_trace::replay::DEVICE_CAPACITY,
    )));
    sim.set_auto_complete(false);
    let alloc = CachingAllocator::new(RecordAnswers::new(sim.clone()), cfg);
    let mut lagging = cudalloc_trace::replay::Lagging::new(sim.clone(), 10);
    let t = Tracer::new();
    t.start(&path, Some(&alloc)).unwrap();
    let mut slots = vec![0u64; job.slots as usize];
    for op in &job.ops {
        lagging.tick();
        match *op {
            cudalloc_trace::Op::Alloc { slot, stream, size } => {
                let s = StreamId(job.streams[stream as usize] + u64::from(slot) % streams);
                slots[slot as usize] = t.allocate(&alloc, size, s, None).unwrap().ptr();
            }
            cudalloc_trace::Op::Free { slot } => t.free(&alloc, slots[slot as usize]).unwrap(),
        }
    }
    t.stop(Some(&alloc)).unwrap();
    let ran = (alloc.group_reserved_peak(), alloc.stats().calls.total());
    let trace = read(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    (trace, ran)
}

/// The answers of a call that writes no operation of a replay (an allocation that runs out of
/// memory) are not written: a replay would give them to the next operation's queries.
#[test]
fn a_failed_allocation_writes_no_answers() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-oom-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.csv");
    let sim = std::sync::Arc::new(SimDevice::new(SimConfig::with_capacity(1 << 30)));
    sim.set_auto_complete(false);
    let cfg = Config::for_policy(cudalloc_core::Policy::Default);
    let alloc = CachingAllocator::new(RecordAnswers::new(sim.clone()), cfg);
    let t = Tracer::new();
    t.start(&path, Some(&alloc)).unwrap();
    let s = StreamId(1);
    let mut ooms = 0;
    for round in 0..40u64 {
        let size = (96 + 8 * (round % 5)) << 20;
        let held: Vec<u64> = (0..12)
            .map_while(|_| t.allocate(&alloc, size, s, None).ok().map(|a| a.ptr()))
            .collect();
        ooms += u64::from(held.len() < 12);
        for p in held {
            t.free(&alloc, p).unwrap();
        }
    }
    t.stop(Some(&alloc)).unwrap();
    let actions: Vec<String> = lines(&path)[1..]
        .iter()
        .map(|l| l.split(',').next().unwrap().to_string())
        .collect();
    assert!(ooms > 0, "the device was full");
    assert!(
        actions.iter().any(|a| a == "event_pending"),
        "the device ran behind"
    );
    for (i, w) in actions.windows(2).enumerate() {
        if w[0].starts_with("event_") {
            assert!(
                w[1].starts_with("event_") || w[1] == "alloc" || w[1] == "free_requested",
                "line {}: {} before {}",
                i + 2,
                w[0],
                w[1]
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A traced allocation that runs out of memory, has another allocator's cache given back and
/// tries again is one line of the trace (`oom` when the second try fails, `alloc` when it fits)
/// and one out-of-memory event at most.
#[test]
fn a_retried_allocation_is_one_line() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-retry-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.csv");
    let alloc = allocator_for(cudalloc_core::Policy::Default);
    let pool = alloc.graph_pool();
    let t = Tracer::new();
    let s = StreamId(7);
    t.start(&path, Some(&alloc)).unwrap();
    let released = std::cell::Cell::new(0);
    let release = || {
        released.set(released.get() + 1);
        pool.empty_cache().unwrap();
        true
    };
    assert!(t
        .allocate_releasing(&alloc, 4 << 30, s, None, &release)
        .is_err());
    let cached = pool.allocate(900 << 20, s).unwrap();
    pool.free(cached).unwrap();
    let a = t
        .allocate_releasing(&alloc, 600 << 20, s, None, &release)
        .expect("fits once the pool's cache went back");
    t.free(&alloc, a.ptr()).unwrap();
    t.stop(Some(&alloc)).unwrap();
    assert_eq!(released.get(), 2);
    let actions: Vec<String> = lines(&path)[1..]
        .iter()
        .map(|l| l.split(',').next().unwrap().to_string())
        .collect();
    assert_eq!(
        actions,
        ["oom", "alloc", "free_requested", "free_completed"]
    );
    assert_eq!(alloc.stats().num_ooms, 1);
}

/// A second try that fails for another reason than memory (here the tag went to sleep during
/// the release) leaves the first try's out-of-memory event counted, and the trace writes it.
#[test]
fn a_retry_failing_otherwise_writes_the_first_tries_oom() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-asleep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.csv");
    let alloc = allocator_for(cudalloc_core::Policy::Default);
    let t = Tracer::new();
    t.start(&path, Some(&alloc)).unwrap();
    let release = || {
        alloc.sleep(&["w"], &[]).unwrap();
        true
    };
    let r = t.allocate_releasing(&alloc, 4 << 30, StreamId(7), Some("w"), &release);
    assert!(matches!(r, Err(AllocError::Asleep { .. })), "{r:?}");
    t.stop(Some(&alloc)).unwrap();
    let ooms = lines(&path)
        .iter()
        .filter(|l| l.starts_with("oom,"))
        .count();
    assert_eq!((ooms, alloc.stats().num_ooms), (1, 1));
}

/// A trace started on an allocator that lends blocks across streams (`lend_blocks:True`)
/// pauses lending from its start: the first allocation it records, on a stream whose pool is
/// empty while another stream's holds a block that fits, grows its own pool, as the replay
/// with the run's answers (which lends nothing) does.
#[test]
fn a_trace_lends_nothing_from_its_first_allocation() {
    let dir = std::env::temp_dir().join(format!("cudalloc-capi-lend-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("lend.csv");
    let alloc = CachingAllocator::new(
        RecordAnswers::new(SimDevice::new(SimConfig::with_capacity(8 << 30))),
        Config::parse("policy:default,lend_blocks:True,thread_cache:False").unwrap(),
    );
    let t = Tracer::new();
    let a = t.allocate(&alloc, 64 << 20, StreamId(1), None).unwrap();
    let cached = a.ptr();
    t.free(&alloc, cached).unwrap();
    t.start(&path, Some(&alloc)).unwrap();
    let b = t.allocate(&alloc, 64 << 20, StreamId(3), None).unwrap();
    assert_ne!(
        b.ptr(),
        cached,
        "stream 1's block lent while a trace is recorded"
    );
    assert_eq!(alloc.stats().lent_blocks, 0);
    t.free(&alloc, b.ptr()).unwrap();
    t.stop(Some(&alloc)).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
