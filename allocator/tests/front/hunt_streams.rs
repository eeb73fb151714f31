//! Streams, captures, graph pools and thread caches through `CachingAllocator`, on the
//! simulated device with its work completing only when a test says so.
//!
//! Checked:
//! - a handle of a dropped graph pool is no allocation of the allocator it came from, even when
//!   that allocator has since handed out a block with the same address, size, stream, block
//!   number and handout number (it used to free the new owner's block);
//! - a graph pool dropped during a capture it was told of, while the device refuses one
//!   release, gives back the rest (it used to lose all of it);
//! - a random model (every policy; eager, tagged and graph-pool allocations on four streams,
//!   one of them captured now and then, told before or after the device's capture began;
//!   `record_stream`, frees on threads that exit, stream completions, `empty_cache`, memory
//!   limits, device faults, graph pools made and dropped): no allocation overlaps a live one or
//!   a range whose work on another stream may still run, no capture is invalidated, the
//!   statistics count the live allocations, a snapshot recomputes its statistics, the device
//!   holds what the allocators count, and every byte comes back at the end.

use cudalloc::{AllocError, CachingAllocator, Config};
use cudalloc_sys::{SimConfig, SimDevice, StreamId};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

type Alloc = CachingAllocator<Arc<SimDevice>>;

/// The stream the tests capture.
const CAP: StreamId = StreamId(5);
/// The streams of the model.
const STREAMS: [StreamId; 4] = [StreamId(2), StreamId(3), StreamId(4), CAP];

fn allocator(cfg: &str) -> (Arc<SimDevice>, Alloc) {
    let sim = Arc::new(SimDevice::new(SimConfig::with_capacity(8 * GIB)));
    let alloc = CachingAllocator::new(sim.clone(), Config::parse(cfg).unwrap());
    (sim, alloc)
}

/// A graph pool dropped while one of its allocations lives: the allocation dies with it. Its
/// handle, freed on the allocator the pool came from, must be refused, even though that
/// allocator's first allocation got the same address (the device reuses the range), size,
/// stream, block and handout number: freeing it would free the new owner's block, which the
/// next allocation would then share.
#[test]
fn a_dropped_graph_pools_handle_frees_nothing_of_its_parent() {
    for policy in ["policy:torch-expandable", "policy:torch"] {
        let (_sim, eager) = allocator(policy);
        let pool = eager.graph_pool();
        let stale = pool.allocate(4 * MIB, StreamId(3)).unwrap();
        drop(pool);
        let owner = eager.allocate(4 * MIB, StreamId(3)).unwrap();
        assert_eq!(
            owner.ptr(),
            stale.ptr(),
            "{policy}: the device reused the range"
        );
        let e = eager.free(stale).unwrap_err();
        assert!(matches!(e, AllocError::NotAllocated(_)), "{policy}: {e}");
        let next = eager.allocate(4 * MIB, StreamId(3)).unwrap();
        assert_ne!(next.ptr(), owner.ptr(), "{policy}: one block, two owners");
        eager.free(next).unwrap();
        eager.free(owner).unwrap();
        eager.check_invariants().unwrap();
    }
}

/// A graph pool dropped while a device release fails once gives back all the rest, during a
/// capture it was told of (where it waits for nothing) as outside one (where it waits for
/// the device and tries again): only the device's refusal may keep memory, and the next try
/// succeeds.
#[test]
fn a_graph_pool_dropped_during_a_capture_survives_a_failed_release() {
    use cudalloc_sys::CaptureMode;
    for captured in [false, true] {
        let (sim, eager) = allocator("policy:default");
        let pool = eager.graph_pool();
        let kept: Vec<_> = (0..3)
            .map(|_| pool.allocate(100 * MIB, CAP).unwrap())
            .collect();
        pool.free(pool.allocate(60 * MIB, CAP).unwrap()).unwrap();
        if captured {
            pool.begin_capture(CaptureMode::Relaxed);
            sim.begin_capture(CAP, CaptureMode::Relaxed).unwrap();
        }
        sim.fail_release(1);
        drop(kept); // the allocations die with the pool
        drop(pool);
        if captured {
            sim.end_capture(CAP).unwrap();
        }
        assert_eq!(
            sim.outstanding_bytes(),
            eager.reserved_bytes(),
            "captured {captured}: the pool's memory is lost"
        );
    }
}

/// Which allocator an allocation of the model came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum From {
    Eager,
    /// The eager allocator's tag "t".
    Tagged,
    Graph,
}

/// A live allocation of the model and the other streams it was recorded on.
struct Live {
    from: From,
    ptr: u64,
    size: u64,
    stream: StreamId,
    /// `None` once a free of it failed: it is freed by address then.
    a: Option<cudalloc::Allocation>,
    uses: Vec<StreamId>,
}

impl Live {
    fn range(&self) -> (u64, u64) {
        (self.ptr, self.ptr + self.size.max(1))
    }
}

/// A range freed while the work of stream `waits_for` on it may still run: until that work
/// completed, no allocation may overlap it, but one of `owner` (the stream that freed it, in
/// stream order; `None` when `waits_for` used it through `record_stream`).
struct Guarded {
    from: From,
    lo: u64,
    hi: u64,
    waits_for: StreamId,
    owner: Option<StreamId>,
}

/// The model: an allocator, maybe a graph pool of it, the live allocations, the ranges still
/// guarded and whether a capture of `CAP` is underway.
struct Model {
    sim: Arc<SimDevice>,
    eager: Alloc,
    graph: Option<Alloc>,
    live: Vec<Live>,
    guarded: Vec<Guarded>,
    capture: Option<cudalloc_sys::CaptureMode>,
    /// A device fault is armed: a call may fail (with a typed error, changing nothing).
    faulty: bool,
    /// A graph pool was dropped while a release could fail: the device may have refused to
    /// destroy one of its events, which the drop cannot report.
    events_may_leak: bool,
    /// A memory limit was set: an allocation may run out of memory.
    limited: bool,
    /// The device captures `CAP` but the allocators were not told yet (PyTorch's extension
    /// tells at the capture's first allocation): only frees and `record_stream` run.
    untold: bool,
    /// Handles of allocations that died with a dropped graph pool: no allocation of the eager
    /// allocator's, whatever it handed out since.
    dead: Vec<cudalloc::Allocation>,
    /// `waits` at the start of the step: the guards hold only while it is unchanged.
    waited: u64,
    rng: crate::common::Rng,
}

impl Model {
    fn new(cfg: &str, seed: u64) -> Model {
        let (sim, eager) = allocator(cfg);
        sim.set_auto_complete(false);
        Model {
            sim,
            eager,
            graph: None,
            live: Vec::new(),
            guarded: Vec::new(),
            capture: None,
            faulty: false,
            events_may_leak: false,
            limited: false,
            untold: false,
            waited: 0,
            dead: Vec::new(),
            rng: crate::common::Rng(seed),
        }
    }

    fn of(&self, from: From) -> &Alloc {
        match from {
            From::Eager | From::Tagged => &self.eager,
            From::Graph => self.graph.as_ref().expect("a graph pool"),
        }
    }

    fn stream(&mut self) -> StreamId {
        STREAMS[self.rng.below(STREAMS.len() as u64) as usize]
    }

    fn size(&mut self) -> u64 {
        match self.rng.below(4) {
            0 => self.rng.below(4096),
            1 => 4096 + self.rng.below(MIB),
            _ => MIB + self.rng.below(24 * MIB),
        }
    }
}

/// Device calls after which the device's work may have completed (waits), or that a driver
/// makes wait (`cuMemFree`).
fn waits(sim: &SimDevice) -> u64 {
    use cudalloc_sys::Call;
    [Call::SynchronizeDevice, Call::SynchronizeEvent, Call::Free]
        .iter()
        .map(|&c| sim.calls(c))
        .sum()
}

impl Model {
    /// Runs one random operation, then checks everything.
    fn step(&mut self) {
        self.waited = waits(&self.sim);
        let op = self.rng.below(23);
        self.run(op);
        if waits(&self.sim) != self.waited {
            self.guarded.clear();
        }
        self.check();
    }

    fn run(&mut self, op: u64) {
        if self.untold && !matches!(op, 9..=13 | 16) {
            return;
        }
        match op {
            0..=3 => self.allocate(From::Eager),
            4 => self.allocate(From::Tagged),
            5 => self.limit(),
            6..=8 => self.allocate(From::Graph),
            9..=12 => self.free(),
            13 => self.record(),
            14..=15 => self.complete(),
            16 => self.toggle_capture(),
            17 => self.empty_cache(),
            18 => self.toggle_graph(),
            19 => self.free_on_another_thread(),
            20 => self.free_a_dead_handle(),
            _ => self.with_a_fault(),
        }
    }

    /// Arms a device fault (an acquiring call or a release fails), runs another operation and
    /// disarms it.
    fn with_a_fault(&mut self) {
        match self.rng.below(2) {
            0 => self.sim.fail_next(),
            _ => self.sim.fail_release(1),
        }
        self.faulty = true;
        let op = self.rng.below(21);
        self.run(op);
        self.sim.clear_faults();
        self.faulty = false;
    }

    fn allocate(&mut self, from: From) {
        if (from == From::Graph && self.graph.is_none()) || self.live.len() >= 40 {
            return;
        }
        let (size, stream) = (self.size(), self.stream());
        let r = match from {
            From::Tagged => self.eager.allocate_tagged(size, stream, "t"),
            _ => self.of(from).allocate(size, stream),
        };
        let a = match r {
            Ok(a) => a,
            Err(AllocError::DuringCapture { .. }) if self.capture.is_some() => return,
            Err(e) if e.is_out_of_memory() && self.limited => return,
            Err(_) if self.faulty => return,
            Err(e) => panic!("{from:?} allocate({size}, {stream}): {e}"),
        };
        self.assert_fresh(from, &a);
        let (ptr, size, stream) = (a.ptr(), a.size(), a.stream());
        let (a, uses) = (Some(a), Vec::new());
        self.live.push(Live {
            from,
            ptr,
            size,
            stream,
            a,
            uses,
        });
    }

    /// `a` overlaps no live allocation and no range still guarded from its stream.
    fn assert_fresh(&self, from: From, a: &cudalloc::Allocation) {
        let (lo, hi) = (a.ptr(), a.ptr() + a.size().max(1));
        for l in &self.live {
            let (o, p) = l.range();
            assert!(
                hi <= o || lo >= p,
                "{from:?} {lo:#x}..{hi:#x} overlaps a live one"
            );
        }
        // A wait in this step (the ladder's, a `cudaFree`) may have completed the work.
        let guarded = if waits(&self.sim) == self.waited {
            &self.guarded[..]
        } else {
            &[]
        };
        for g in guarded {
            let apart = hi <= g.lo || lo >= g.hi || g.owner == Some(a.stream());
            assert!(
                apart,
                "{from:?} {lo:#x}..{hi:#x} on {} reuses {:#x}..{:#x} ({:?}'s) before {}'s \
                 work on it completed",
                a.stream(),
                g.lo,
                g.hi,
                g.from,
                g.waits_for
            );
        }
    }

    fn free(&mut self) {
        if self.live.is_empty() {
            return;
        }
        let i = self.rng.below(self.live.len() as u64) as usize;
        if self.rng.below(3) == 0 {
            self.record_on(i);
        }
        let mut l = self.live.swap_remove(i);
        let (lo, stream, from) = (l.ptr, l.stream, l.from);
        let r = match l.a.take() {
            Some(a) => self.of(from).free(a),
            None => self.of(from).free_on(lo, stream),
        };
        match r {
            Ok(()) => {}
            // The free changed nothing: the allocation is still live.
            Err(_) if self.faulty => return self.live.push(l),
            Err(e) => panic!("{from:?} free of {lo:#x}: {e}"),
        }
        self.guard(l);
    }

    fn record(&mut self) {
        if !self.live.is_empty() {
            let i = self.rng.below(self.live.len() as u64) as usize;
            self.record_on(i);
        }
    }

    /// Records live allocation `i` on another stream.
    fn record_on(&mut self, i: usize) {
        let s = self.stream();
        let l = &self.live[i];
        if s == l.stream || l.uses.contains(&s) {
            return;
        }
        match self.of(l.from).record_stream(l.ptr, s) {
            Ok(()) => {}
            Err(_) if self.faulty => return,
            Err(e) => panic!("{:?} record_stream: {e}", l.from),
        }
        self.live[i].uses.push(s);
    }

    fn complete(&mut self) {
        if self.rng.below(4) == 0 {
            self.sim.complete_all();
            self.guarded.clear();
            return;
        }
        let s = self.stream();
        self.sim.complete_stream(s);
        self.guarded.retain(|g| g.waits_for != s);
    }
}

impl Model {
    /// Begins a capture of `CAP` (the allocators told first), or ends the one underway (the
    /// device first): the device must not have refused any call of the allocators.
    fn toggle_capture(&mut self) {
        use cudalloc_sys::CaptureMode;
        match self.capture.take() {
            Some(mode) if self.untold => {
                self.tell(mode);
                self.untold = false;
                self.capture = Some(mode);
            }
            None => {
                let mode = CaptureMode::ALL[self.rng.below(3) as usize];
                self.untold = self.rng.below(2) == 0;
                if !self.untold {
                    self.tell(mode);
                }
                self.sim.begin_capture(CAP, mode).unwrap();
                self.capture = Some(mode);
            }
            Some(mode) => {
                if let Err(e) = self.sim.end_capture(CAP) {
                    panic!("the capture ({mode:?}) was invalidated: {e}");
                }
                let mut ends = vec![self.eager.end_capture(mode)];
                if let Some(g) = &self.graph {
                    ends.push(g.end_capture(mode));
                }
                // A record the device refused leaves blocks owed: the capture has ended.
                for r in ends {
                    assert!(r.is_ok() || self.faulty, "end_capture: {r:?}");
                }
            }
        }
    }

    /// Tells the allocators of a capture in `mode`.
    fn tell(&self, mode: cudalloc_sys::CaptureMode) {
        self.eager.begin_capture(mode);
        if let Some(g) = &self.graph {
            g.begin_capture(mode);
        }
    }

    /// Sets a memory limit (or none) on the eager allocator; a graph pool made later takes it.
    fn limit(&mut self) {
        let limit = match self.rng.below(3) {
            0 => None,
            _ => Some(256 * MIB + self.rng.below(2 * GIB)),
        };
        self.limited |= limit.is_some();
        self.eager.set_memory_limit(limit);
    }

    fn empty_cache(&mut self) {
        let from = [From::Eager, From::Graph][self.rng.below(2) as usize];
        if from == From::Graph && self.graph.is_none() {
            return;
        }
        match (self.of(from).empty_cache(), self.capture) {
            (Ok(()), None) | (Err(AllocError::DuringCapture { .. }), Some(_)) => {}
            (Err(_), _) if self.faulty => {}
            (r, c) => panic!("{from:?} empty_cache during {c:?}: {r:?}"),
        }
    }

    /// Makes a graph pool (outside a capture), or drops it with its live allocations.
    fn toggle_graph(&mut self) {
        match self.graph.take() {
            None if self.capture.is_none() => self.graph = Some(self.eager.graph_pool()),
            None => {}
            // A `torch` pool's `cudaFree` is refused during a strict capture, which it
            // invalidates, and its segments are lost (documented: `pool::capture`).
            Some(g) if self.strict_torch_capture() => self.graph = Some(g),
            Some(g) => {
                self.events_may_leak |= self.faulty;
                let (graph, eager) = std::mem::take(&mut self.live)
                    .into_iter()
                    .partition(|l| l.from == From::Graph);
                self.live = eager;
                self.dead
                    .extend(graph.into_iter().filter_map(|l: Live| l.a));
                drop(g);
                // What the pool held goes back with its live blocks (no wait during a capture).
                self.guarded.retain(|g| g.from != From::Graph);
            }
        }
    }

    fn strict_torch_capture(&self) -> bool {
        let strict = self
            .capture
            .is_some_and(|m| m != cudalloc_sys::CaptureMode::Relaxed);
        strict && self.eager.config().policy() == cudalloc::Policy::Torch
    }

    /// The invariants of both allocators, their statistics against the model, and the
    /// device's bytes against theirs.
    fn check(&self) {
        self.sim.check_invariants();
        let mut held = 0;
        for from in [From::Eager, From::Graph] {
            if from == From::Graph && self.graph.is_none() {
                continue;
            }
            let a = self.of(from);
            a.check_invariants().unwrap();
            let mine = |l: &&Live| l.from == from || (l.from, from) == (From::Tagged, From::Eager);
            let live = self.live.iter().filter(mine).count() as i64;
            let s = a.stats();
            assert_eq!(s.allocation.0[0].current, live, "{from:?}: allocations");
            for stat in [&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes] {
                assert!(stat.0.iter().all(|x| x.current >= 0), "{from:?}: {stat:?}");
            }
            let snap = a.snapshot();
            assert_eq!(snap.recompute(), snap.recorded(), "{from:?}: snapshot");
            held += a.reserved_bytes();
        }
        assert_eq!(self.sim.outstanding_bytes(), held, "device vs reserved");
    }

    /// Ends the capture, frees everything, completes all work, empties both caches: nothing
    /// is left reserved; dropping leaves the device empty.
    fn finish(mut self, label: &str) {
        while self.capture.is_some() {
            self.toggle_capture();
        }
        for l in std::mem::take(&mut self.live) {
            match l.a {
                Some(a) => self.of(l.from).free(a).unwrap(),
                None => self.of(l.from).free_on(l.ptr, l.stream).unwrap(),
            }
        }
        self.sim.complete_all();
        self.eager.empty_cache().unwrap();
        if let Some(g) = &self.graph {
            g.empty_cache().unwrap();
            assert_eq!(
                g.reserved_bytes(),
                0,
                "{label}: graph pool reserved at the end"
            );
        }
        assert_eq!(
            self.eager.reserved_bytes(),
            0,
            "{label}: reserved at the end"
        );
        let Model {
            sim,
            eager,
            graph,
            events_may_leak,
            ..
        } = self;
        drop(graph);
        drop(eager);
        if events_may_leak {
            assert_eq!(
                sim.outstanding_bytes(),
                0,
                "{label}: outstanding after drop"
            );
            assert_eq!(
                sim.reserved_va_bytes(),
                0,
                "{label}: reservations after drop"
            );
        } else {
            crate::common::assert_device_empty(&sim, label);
        }
    }
}

/// Random sequences of allocations and frees on four streams (one captured now and then),
/// with `record_stream`, stream completions, `empty_cache`, and a graph pool made and dropped,
/// for every policy: no range is handed out while a stream's work on it may still run, no two
/// live allocations overlap, the captures are never invalidated, the statistics stay exact,
/// and every byte comes back.
#[test]
fn streams_captures_and_graph_pools_keep_every_promise() {
    for cfg in ["policy:default", "policy:torch", "policy:torch-expandable"] {
        for seed in 0..40 {
            let mut m = Model::new(cfg, seed);
            for step in 0..300 {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.step()));
                if let Err(p) = r {
                    panic!(
                        "{cfg} seed {seed} step {step}: {}",
                        crate::common::panic_text(&p)
                    );
                }
            }
            m.finish(&format!("{cfg} seed {seed}"));
        }
    }
}

impl Model {
    /// Frees a live allocation of the eager allocator on a thread that then exits: the block
    /// waits in that thread's cache, then among the exited threads' blocks.
    fn free_on_another_thread(&mut self) {
        let Some(i) = self
            .live
            .iter()
            .position(|l| l.from == From::Eager && l.a.is_some())
        else {
            return;
        };
        let mut l = self.live.swap_remove(i);
        let (eager, a) = (&self.eager, l.a.take().expect("a handle"));
        match std::thread::scope(|t| t.spawn(|| eager.free(a)).join().unwrap()) {
            Ok(()) => {}
            Err(_) if self.faulty => return self.live.push(l),
            Err(e) => panic!("free on another thread: {e}"),
        }
        self.guard(l);
    }

    /// Guards the range of `l`, just freed, until its streams' work completed.
    fn guard(&mut self, l: Live) {
        let ((lo, hi), from) = (l.range(), l.from);
        let guard = |waits_for, owner| Guarded {
            from,
            lo,
            hi,
            waits_for,
            owner,
        };
        self.guarded.push(guard(l.stream, Some(l.stream)));
        for s in l.uses {
            self.guarded.push(guard(s, None));
        }
    }
}

impl Model {
    /// Frees a handle of a dropped graph pool on the eager allocator: refused.
    fn free_a_dead_handle(&mut self) {
        if let Some(a) = self.dead.pop() {
            match self.eager.free(a) {
                Err(AllocError::NotAllocated(_)) => {}
                r => panic!("a dead graph pool's handle freed on the eager allocator: {r:?}"),
            }
        }
    }
}
