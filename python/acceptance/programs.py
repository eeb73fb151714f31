"""The acceptance programs: real PyTorch programs that break when an allocator gets streams,
out-of-memory or the ``torch.cuda`` memory API wrong. Each function runs in a process of its
own (``run.py`` starts them) after the allocator was chosen, and returns a dict of results that
``run.py`` compares across allocators. Models are built from configs with random weights.

- ``side_stream``: a training whose input pipeline runs on a side stream, as prefetching loaders
  and FSDP do: each batch is made on the side stream, handed to the main stream with
  ``Tensor.record_stream``, and freed while the main stream may still read it. An allocator that
  drops ``record_stream`` hands the batch's memory to the next batch too early; the losses then
  differ from PyTorch's or the program crashes. Ten repeats in one process (a race shows only
  sometimes).
- ``oom_recover``: under ``set_per_process_memory_fraction``, 256 MiB tensors until
  ``torch.OutOfMemoryError``; the program catches it, frees, and goes on.
- ``oom_batch_search``: GPT-2 training steps under a memory fraction, halving the batch on
  ``torch.OutOfMemoryError`` until a step fits (what tools that fall back to a smaller batch do).
- ``memory_api``: ``torch.cuda.memory_stats``, ``memory_allocated``, ``max_memory_reserved``,
  ``reset_peak_memory_stats``, ``empty_cache`` and ``caching_allocator_alloc`` answer for the
  allocator in use, and so do ``reset_accumulated_memory_stats`` (which zeroes the driver-call
  counters the runner reads: its calls column for PyTorch's allocator reads 0),
  ``get_per_process_memory_fraction``, ``torch.accelerator.memory_allocated`` and an
  out-of-memory observer.
- ``memory_snapshot``: ``torch.cuda.memory_snapshot`` lists the allocator's segments and blocks:
  live tensors in allocated blocks, segments adding up to ``memory_reserved`` and
  ``memory_allocated``, a ``MemPool``'s segments named by its id.
- ``memory_history``: ``torch.cuda.memory._record_memory_history`` and ``_dump_snapshot``: the
  pickled trace lists the program's allocations and frees in order (and ``cudalloc replay``
  reads it when ``CUDALLOC_CLI`` names the command).
- ``graph_capture``: a transformer layer captured into a CUDA graph on the stream that eager
  code goes on using; eager tensors must survive the replays, which must match the eager layer.
- ``failed_capture``: a CUDA graph capture that fails (a host sync inside it), after which the
  program goes on eagerly, as code that falls back from graphs does: memory freed after it goes
  back on ``empty_cache``, a ``record_stream``'d side-stream tensor is freed, and a second
  capture replays correctly.
- ``compile_reduce_overhead``: ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees).
- ``compile_train_eval``: the same on a model trained and evaluated in turns at two batch sizes
  (several paths through one pool, checkpoints restored).
- ``compile_tree_paths``: CUDA graph trees that branch: after replaying a graph, a different
  graph is recorded as its child, so the pool is restored to a checkpoint that differs from its
  state (the outputs of the first recording were freed since); with graph trees' own checks of
  the pool's live allocations on.
- ``mem_pool``: ``torch.cuda.MemPool`` with ``use_mem_pool``.
- ``pool_under_cap``: a ``MemPool``'s memory counts against ``set_per_process_memory_fraction``.
- ``generate_kv``, ``serve_loop``: generation with a KV cache and rounds of requests of varied
  shapes (``serving.py``).
- ``train_autocast``: GPT-2 training with AdamW under bf16 autocast.
- ``train_near_cap``: GPT-2 training whose sequence length changes every step, without a cap and
  then under caps of 1.10x and 1.03x its live peak (``capped.py``): the steps each cap lets
  complete, their step time and device waits, and the capped losses held to the uncapped ones.
- ``graphed_callables``, ``decode_graphs``, ``checkpoint_fp16``, ``fsdp_train``, ``ddp_train``: see
  ``patterns.py``; ``threaded_serve``, ``cudnn_near_cap``: see ``concurrency.py``.
"""

import gc
import statistics
import time

import torch

from capped import timed_step, train_near_cap
from concurrency import cudnn_near_cap, threaded_serve
from patterns import checkpoint_fp16, ddp_train, decode_graphs, fsdp_train, graphed_callables
from serving import generate_kv, serve_loop

MiB = 1 << 20


def side_stream(quick):
    """Losses of 10 repeats of a training fed from a side stream, and whether each finished."""
    repeats = 2 if quick else 10
    dim, tokens, steps = (256, 512, 6) if quick else (2048, 8192, 24)
    runs = []
    for r in range(repeats):
        runs.append(_side_stream_training(dim, tokens, steps, seed=r))
    return {"losses": [loss for run in runs for loss in run]}


def _side_stream_training(dim, tokens, steps, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1000 + seed)
    project = torch.randn(dim, dim, device="cuda") / dim**0.5

    def prefetch():
        with torch.cuda.stream(side):
            x = torch.randn(tokens, dim, device="cuda", generator=gen)
            x = torch.tanh(x @ project)  # the loader's "augmentation", on the side stream
            done = side.record_event()
        return x, done

    losses = []
    batch = prefetch()
    for _ in range(steps):
        x, done = batch
        main.wait_event(done)
        x.record_stream(main)
        batch = prefetch()  # the side stream works on the next batch while the main one trains
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        del x, loss  # freed while the main stream may still read x
    torch.cuda.synchronize()
    return [float(v) for v in losses]


def oom_recover(quick):
    """How many 256 MiB tensors fit under a cap of 3.125 GiB before the error; whether the
    program went on."""
    # 3 GiB and a little (a cap of exactly twelve tensors would hold eleven or twelve, as the
    # fraction times the card's bytes rounds), or the whole of a smaller card.
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, ((3 << 30) + (128 << 20)) / total))
    chunks = []
    try:
        while len(chunks) < 4096:
            chunks.append(torch.empty(256 * MiB, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    else:
        raise RuntimeError("no out-of-memory error under a cap of 3.125 GiB")
    fitted = len(chunks)
    del chunks
    gc.collect()
    torch.cuda.empty_cache()
    again = [torch.ones(256 * MiB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    went_on = all(bool((t == 1).all()) for t in again)  # no int64 sum: 2 GiB under the cap
    return {"fitted": fitted, "error": error, "went_on": went_on,
            "num_ooms": torch.cuda.memory_stats().get("num_ooms")}


def oom_batch_search(quick):
    """The largest batch (halving from 64) whose GPT-2 training step fits under the cap."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if quick:
        cfg, length, fraction = GPT2Config(n_layer=2, n_embd=256, n_head=4), 128, 0.01
    else:
        cfg, length, fraction = GPT2Config(), 512, 0.06
    torch.cuda.set_per_process_memory_fraction(fraction)
    model = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch, tried = 64, []
    while batch >= 1:
        try:
            ids = torch.randint(0, cfg.vocab_size, (batch, length), device="cuda")
            loss, _ = timed_step(model, opt, ids)
            tried.append(batch)
            return {"largest_batch": batch, "tried": tried, "cap_bytes": _cap(fraction)}
        except torch.OutOfMemoryError:
            tried.append(-batch)
            ids = loss = None
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            batch //= 2
    raise RuntimeError(f"no batch fits: {tried}")


def _cap(fraction):
    return int(fraction * torch.cuda.get_device_properties(0).total_memory)


def memory_api(quick):
    """The ``torch.cuda`` memory functions, checked against what the program allocated."""
    base = torch.cuda.memory_allocated()
    a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    stats = torch.cuda.memory_stats()
    checks = {
        "allocated": torch.cuda.memory_allocated() - base >= 67 * MiB,
        "stats_keys": all(k in stats for k in ("allocated_bytes.all.current",
                                               "reserved_bytes.all.peak", "num_ooms",
                                               "segment.large_pool.current")),
        "reserved_at_least_allocated": torch.cuda.memory_reserved() >= torch.cuda.memory_allocated(),
    }
    del a
    torch.cuda.reset_peak_memory_stats()
    checks["peak_reset"] = torch.cuda.max_memory_allocated() < 64 * MiB + base + 3 * MiB
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    checks["empty_cache_released"] = torch.cuda.memory_reserved() < reserved
    p = torch.cuda.caching_allocator_alloc(5 * MiB)
    checks["raw_alloc_counted"] = torch.cuda.memory_allocated() >= 8 * MiB
    torch.cuda.caching_allocator_delete(p)
    del b
    checks["all_freed"] = torch.cuda.memory_allocated() == base
    checks.update(memory_api_more())
    if not all(checks.values()):
        raise RuntimeError(f"memory API checks failed: {checks}")
    return {"checks": checks}


def memory_api_more():
    """The accumulated statistics' reset, the memory fraction read back, ``torch.accelerator``'s
    figures and an out-of-memory observer (each where this torch has it)."""
    checks = {}
    kept = torch.empty(6 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.reset_accumulated_memory_stats()
    stats = torch.cuda.memory_stats()
    checks["accumulated_reset"] = (stats["allocation.all.allocated"] == 0
                                   and stats["num_ooms"] == 0
                                   and stats["allocation.all.current"] >= 1)
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):
        torch.cuda.set_per_process_memory_fraction(0.5)
        checks["fraction_read_back"] = abs(torch.cuda.get_per_process_memory_fraction() - 0.5) < 1e-6
        torch.cuda.set_per_process_memory_fraction(1.0)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "memory_allocated"):
        checks["accelerator_agrees"] = accelerator.memory_allocated() == torch.cuda.memory_allocated()
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        calls = []
        attach(lambda device, size, limit, free: calls.append(size))
        too_big = 2 * torch.cuda.get_device_properties(0).total_memory
        try:
            torch.empty(too_big, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        checks["oom_observer_called"] = calls[:1] == [too_big]
    del kept
    return checks


SEGMENT_KEYS = ("device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "segment_pool_id", "is_expandable",
                "blocks")
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")


def memory_snapshot(quick):
    """``torch.cuda.memory_snapshot`` lists the allocator's segments and blocks: every live
    tensor lies in an allocated block of at least its size, the blocks tile their segments, the
    segments add up to ``memory_reserved`` and their allocated bytes to ``memory_allocated``, and a
    ``MemPool``'s segments carry its id."""
    sizes = (1000, 3 * MiB, 64 * MiB, 200 * MiB + 5)
    tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    gone = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    del gone  # a freed block, cached
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        pooled = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    segments = [s for s in torch.cuda.memory_snapshot() if s["device"] == device]
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    blocks = [b for s in segments for b in s["blocks"]]

    def holder(t):
        """The segment and block that hold tensor t, None if none does."""
        ptr, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        for s in segments:
            for b in s["blocks"]:
                if b["address"] <= ptr and end <= b["address"] + b["size"]:
                    return s, b
        return None, None

    def tiles(s):
        at = s["address"]
        for b in s["blocks"]:
            if b["address"] != at:
                return False
            at += b["size"]
        return at == s["address"] + s["total_size"]

    only_pool = torch.cuda.memory_snapshot(mempool_id=pool.id)
    checks = {
        "segment_keys": bool(segments) and all(k in s for s in segments for k in SEGMENT_KEYS),
        "block_states": bool(blocks) and all(b["state"] in BLOCK_STATES for b in blocks),
        "segment_types": all(s["segment_type"] in ("small", "large") for s in segments),
        "live_tensors_in_allocated_blocks": all(
            (holder(t)[1] or {}).get("state") == "active_allocated" for t in tensors + [pooled]),
        "blocks_tile_segments": all(tiles(s) for s in segments),
        "total_size_is_reserved": sum(s["total_size"] for s in segments) == reserved,
        "allocated_size_is_allocated": sum(s["allocated_size"] for s in segments) == allocated,
        "pool_segment_named": tuple((holder(pooled)[0] or {}).get("segment_pool_id", ())) == tuple(pool.id),
        "pool_snapshot_only_its_own": bool(only_pool) and all(
            tuple(s["segment_pool_id"]) == tuple(pool.id) for s in only_pool),
        "traces_per_device": len(torch.cuda.memory._snapshot()["device_traces"]) == torch.cuda.device_count(),
    }
    del tensors, pooled, pool
    if not all(checks.values()):
        raise RuntimeError(f"memory snapshot checks failed: {checks}")
    return {"checks": checks}


def memory_history(quick):
    """``torch.cuda.memory._record_memory_history`` then ``_dump_snapshot``: the pickled trace
    lists each tensor's ``alloc`` and then its ``free_requested`` and ``free_completed``, in the
    order the program made them, with Unix-epoch times, and a tensor still live has no free;
    when ``CUDALLOC_CLI`` names the ``cudalloc`` command, ``cudalloc replay`` reads the pickle."""
    import os
    import pickle
    import subprocess
    import tempfile
    import time

    start_us = time.time() * 1e6
    torch.cuda.memory._record_memory_history(max_entries=100000)
    kept = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    made = []
    for n in (1000, 5 * MiB, 64 * MiB):
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        made.append(t.data_ptr())
        del t
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    model(torch.randn(256, 1024, device="cuda")).square().mean().backward()
    torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "history.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][torch.cuda.current_device()]

    def follows(ptr, actions, after=-1):
        """The index of the last of `actions` found in order for `ptr` after index `after`."""
        at = after
        for want in actions:
            at = next((i for i in range(at + 1, len(trace))
                       if trace[i]["action"] == want and trace[i].get("addr") == ptr), None)
            if at is None:
                return None
        return at

    at, in_order = -1, True
    for ptr in made:
        at = follows(ptr, ("alloc", "free_requested", "free_completed"), at)
        in_order = in_order and at is not None
        at = -1 if at is None else at
    kept_alloc = follows(kept.data_ptr(), ("alloc",))
    times = [e["time_us"] for e in trace]
    checks = {
        "tensors_alloc_then_free_in_order": in_order,
        "live_tensor_not_freed": kept_alloc is not None and follows(kept.data_ptr(), ("free_requested",), kept_alloc) is None,
        "training_step_recorded": sum(e["action"] == "alloc" for e in trace) >= 10,
        "times_epoch_and_ordered": bool(times) and times == sorted(times) and start_us - 1e6 <= times[0] <= time.time() * 1e6,
        "segments_listed": bool(snap["segments"]),
    }
    cli = os.environ.get("CUDALLOC_CLI")
    if cli:
        replay = subprocess.run([cli, "replay", "--policy", "torch", path], capture_output=True, text=True)
        checks["cudalloc_replay_reads_it"] = replay.returncode == 0
        if replay.returncode != 0:
            print(replay.stdout[-2000:], replay.stderr[-2000:])
    del kept, model
    if not all(checks.values()):
        raise RuntimeError(f"memory history checks failed: {checks}")
    return {"checks": checks}


def graph_capture(quick):
    """A transformer layer captured into a CUDA graph on the stream eager code goes on using,
    replayed while eager tensors live on that stream: the eager tensors must stay intact and the
    replays must match the eager layer."""
    torch.manual_seed(0)
    dim, tokens = (256, 64) if quick else (1024, 512)
    layer = torch.nn.TransformerEncoderLayer(dim, 16, 4 * dim, batch_first=True).cuda().eval()
    stream = torch.cuda.Stream()
    static_in = torch.randn(4, tokens, dim, device="cuda")
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):  # warm-up on the capture stream, as PyTorch's docs ask
            layer(static_in)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
        static_out = layer(static_in)
    overwritten, worst = 0, 0.0
    with torch.no_grad(), torch.cuda.stream(stream):
        for i in range(5):
            eager = torch.full((4 * tokens * dim,), float(i + 7), device="cuda")
            static_in.copy_(torch.randn_like(static_in))
            graph.replay()
            expected = layer(static_in)
            worst = max(worst, float((static_out - expected).abs().max()))
            overwritten += int((eager != float(i + 7)).sum())
            del eager, expected
    stream.synchronize()
    del graph
    if overwritten or worst >= 1e-3:
        raise RuntimeError(f"graph replays corrupted memory: {overwritten} eager elements "
                           f"overwritten, replay vs eager max abs diff {worst:.3g}")
    return {"overwritten": overwritten, "max_abs_diff": worst}


def failed_capture(quick):
    """A capture that fails (``.item()`` inside it: the driver refuses the sync and the capture
    is invalidated, so ending it raises; PyTorch's random generator stays in capture mode until
    a capture ends well), its graph dropped, then eager work on the stream the
    program was on: tensors, and one made on a side stream and handed over with
    ``record_stream``, freed; ``empty_cache`` must give their memory back (on cudalloc: PyTorch's
    own allocator keeps the failed capture underway and gives nothing back, so there the figure
    is reported, not required); then a second capture must replay correctly."""
    import sys
    on_cudalloc = "cudalloc_torch" in sys.modules and sys.modules["cudalloc_torch"].is_enabled()
    mib = 64 if quick else 256
    main = torch.cuda.current_stream()
    x = torch.randn(1024, 1024, device="cuda")
    # Warm up outside any capture, as PyTorch asks: a cuBLAS handle made inside the failed
    # capture is not usable by the next one (`cublasCreate` fails there on any allocator).
    (x @ x).sum()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    error = ""
    try:
        with torch.cuda.graph(graph):
            (x @ x).sum().item()
    except Exception as e:  # the driver's error, as RuntimeError or torch.AcceleratorError
        error = str(e)
    if "captur" not in error:
        raise RuntimeError(f"the capture with a host sync inside did not fail at its end: {error!r}")
    torch.cuda.set_stream(main)  # the graph's exit raised before it restored the stream
    del graph
    gc.collect()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    tensors = [torch.empty(mib * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
    with torch.cuda.stream(side):
        handed = torch.ones(2 * mib * MiB, dtype=torch.uint8, device="cuda")
    main.wait_stream(side)
    handed.record_stream(main)
    total = int(handed.sum())
    before = torch.cuda.memory_reserved()
    del tensors, handed
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    given_back = (before - torch.cuda.memory_reserved()) // MiB
    # No random numbers until a capture has ended well: the failed one left the generator in
    # capture mode ("Offset increment outside graph capture"), on any allocator.
    static = torch.linspace(-1, 1, 1024 * 1024, device="cuda").reshape(1024, 1024)
    expected = static @ static  # warm-up, outside the capture
    torch.cuda.synchronize()
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second):
        out = static @ static
    static.mul_(0.5).add_(0.25)
    second.replay()
    torch.cuda.synchronize()
    expected = static @ static
    diff = float((out - expected).abs().max() / expected.abs().max())  # relative
    del second, out, expected
    short = on_cudalloc and given_back < 10 * mib - 64
    if short or total != 2 * mib * MiB or not diff < 1e-3:  # a NaN fails too
        raise RuntimeError(f"after a failed capture: empty_cache gave back {given_back} MiB of "
                           f"{10 * mib} freed, sum {total}, replay max rel diff {diff:.3g}")
    return {"went_on": True, "given_back_mib": given_back, "max_rel_diff": diff}


def compile_reduce_overhead(quick):
    """``torch.compile(mode="reduce-overhead")`` (CUDA graph trees) on an MLP: outputs match the
    eager model's step after step."""
    torch.manual_seed(0)
    dim = 256 if quick else 1024
    model = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                torch.nn.Linear(4 * dim, dim)).cuda().eval()
    compiled = torch.compile(model, mode="reduce-overhead")
    worst = 0.0
    with torch.no_grad():
        for step in range(8):
            x = torch.randn(64, dim, device="cuda")
            y = compiled(x).clone()
            worst = max(worst, float((y - model(x)).abs().max()))
    torch.cuda.synchronize()
    if worst >= 1e-2:
        raise RuntimeError(f"compiled outputs differ from eager: max abs diff {worst:.3g}")
    return {"max_abs_diff": worst}


def compile_train_eval(quick):
    """``torch.compile(mode="reduce-overhead")`` on a model trained (forward and backward) and
    evaluated in turns, with two batch sizes: CUDA graph trees record several paths through one
    pool and go back along them (checkpoints of the pool restored); the losses and eval outputs."""
    torch.manual_seed(0)
    dim = 256 if quick else 1024
    model = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                torch.nn.Linear(4 * dim, dim)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, mode="reduce-overhead")
    losses = []
    for step in range(12):
        batch = 64 if step % 4 < 2 else 32
        torch.manual_seed(step)
        x = torch.randn(batch, dim, device="cuda")
        if step % 2 == 0:
            model.train()
            loss = compiled(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        else:
            model.eval()
            with torch.no_grad():
                losses.append(float(compiled(x).sum()))
    return {"losses": losses}


def _private_pool_live():
    """Addresses of the allocated blocks of private pools, from ``torch.cuda.memory_snapshot``."""
    live = set()
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0):
            continue
        addr = seg["address"]
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                live.add(addr)
            addr += block["size"]
    return live


def compile_tree_paths(quick):
    """CUDA graph trees along two paths from one graph: each step replays (or records) ``head``
    and then, alternately, ``left`` or ``right`` on its output, so that a new child is recorded
    after a replay and the pool goes back to a checkpoint it no longer matches. Counts the
    checkpoint restores and those that changed the pool's live blocks (wrapping PyTorch's
    ``_cuda_setCheckpointPoolState``), and checks every output against the eager functions, with
    graph trees' own checks of the pool (``slow_path_cudagraph_asserts``) on."""
    import torch._inductor.config as inductor_config

    inductor_config.triton.slow_path_cudagraph_asserts = True
    counts = {"restores": 0, "restores_that_changed_the_pool": 0}
    original = torch._C._cuda_setCheckpointPoolState

    def counted(*args):
        before = _private_pool_live()
        original(*args)
        counts["restores"] += 1
        counts["restores_that_changed_the_pool"] += int(_private_pool_live() != before)

    torch._C._cuda_setCheckpointPoolState = counted
    torch.manual_seed(0)
    dim = 256 if quick else 1024
    w = [torch.randn(dim, dim, device="cuda") / dim ** 0.5 for _ in range(3)]

    def head(x):
        return (x @ w[0]).relu() + 1

    def left(a):
        return (a @ w[1]).sigmoid()

    def right(a):
        return (a @ w[2]).tanh() * 2

    heads = torch.compile(head, mode="reduce-overhead")
    branches = {"left": torch.compile(left, mode="reduce-overhead"),
                "right": torch.compile(right, mode="reduce-overhead")}
    eager = {"left": left, "right": right}
    worst, sums = 0.0, []  # the outputs' sums, compared across allocators as losses
    try:
        with torch.no_grad():
            for step in range(12):
                torch.compiler.cudagraph_mark_step_begin()
                side = "left" if (step // 2) % 2 == 0 else "right"
                x = torch.randn(64, dim, device="cuda")
                out = branches[side](heads(x)).clone()
                want = eager[side](head(x))
                worst = max(worst, float((out - want).abs().max()))
                sums.append(round(float(out.sum()), 2))
                del out
        torch.cuda.synchronize()
    finally:
        torch._C._cuda_setCheckpointPoolState = original
    if worst >= 1e-3:
        raise RuntimeError(f"graph-tree outputs differ from eager: max abs diff {worst:.3g}")
    if counts["restores_that_changed_the_pool"] == 0:
        raise RuntimeError(f"no checkpoint restore changed the pool: {counts}")
    return {**counts, "losses": sums}


def mem_pool(quick):
    """``torch.cuda.MemPool`` and ``use_mem_pool``: tensors made in the pool work, the pool counts
    its uses, and memory freed in the pool is reused by the pool."""
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.randn(1 << 20, device="cuda")
        a_ptr = a.data_ptr()
        total = float(a.sum())
        del a
        b = torch.randn(1 << 20, device="cuda")
    c = torch.randn(1 << 20, device="cuda")  # outside the pool
    result = {"uses": pool.use_count(), "reused_in_pool": b.data_ptr() == a_ptr,
              "outside_differs": c.data_ptr() != a_ptr, "sum_finite": total == total}
    del b, c, pool
    if not result["outside_differs"]:
        raise RuntimeError("memory freed in a MemPool was handed out outside it")
    return result


def pool_under_cap(quick):
    """A ``MemPool``'s memory counts against ``set_per_process_memory_fraction``'s cap, as it does
    on PyTorch's allocator: with 1 GiB of room under the cap, a 768 MiB tensor in a pool leaves
    no room for a 512 MiB eager one (``torch.OutOfMemoryError``); once the pool is gone and the
    cache emptied, the eager tensor fits."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 1024 * MiB) / total)
    try:
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            held = torch.empty(768 * MiB, dtype=torch.uint8, device="cuda")
        try:
            extra = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
            refused = False
            del extra
        except torch.OutOfMemoryError:
            refused = True
        del held, pool
        gc.collect()
        torch.cuda.empty_cache()
        after = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        del after
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    if not refused:
        raise RuntimeError("a 512 MiB tensor fit beside 768 MiB of a MemPool under a 1 GiB cap")
    return {"eager_refused_while_the_pool_holds_memory": refused, "fits_once_the_pool_is_gone": True}


def train_autocast(quick):
    """GPT-2 training steps with AdamW under bf16 autocast; the losses, and the median time of a
    step after the first three."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4) if quick else GPT2Config()
    model = GPT2LMHeadModel(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []
    for step in range(8 if quick else 24):
        torch.manual_seed(100 + step)
        ids = torch.randint(0, cfg.vocab_size, (8, 256 + 64 * (step % 3)), device="cuda")
        loss, seconds = timed_step(model, opt, ids)
        times.append(seconds)
        losses.append(loss)
    return {"losses": [float(v) for v in losses], "step_ms": 1000 * statistics.median(times[3:])}


PROGRAMS = {
    "side_stream": side_stream,
    "oom_recover": oom_recover,
    "oom_batch_search": oom_batch_search,
    "memory_api": memory_api,
    "memory_snapshot": memory_snapshot,
    "memory_history": memory_history,
    "graph_capture": graph_capture,
    "failed_capture": failed_capture,
    "compile_reduce_overhead": compile_reduce_overhead,
    "compile_train_eval": compile_train_eval,
    "compile_tree_paths": compile_tree_paths,
    "mem_pool": mem_pool,
    "pool_under_cap": pool_under_cap,
    "generate_kv": generate_kv,
    "serve_loop": serve_loop,
    "train_autocast": train_autocast,
    "train_near_cap": train_near_cap,
    "graphed_callables": graphed_callables,
    "decode_graphs": decode_graphs,
    "checkpoint_fp16": checkpoint_fp16,
    "fsdp_train": fsdp_train,
    "ddp_train": ddp_train,
    "threaded_serve": threaded_serve,
    "cudnn_near_cap": cudnn_near_cap,
}
