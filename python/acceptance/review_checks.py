"""Review checks for cudalloc's PyTorch extension backend (``python/cudalloc_torch/csrc/``).

Each ``check_*`` function is a small PyTorch program that shows one suspected defect of the
backend against what PyTorch 2.11's callers expect of a ``CUDAAllocator`` (the review report
gives the evidence). A check returns a dict of findings (PASS), raises ``AssertionError`` with
the reason (FAIL) or ``Skip`` (the machine or the torch version cannot run it: fewer than two
GPUs, an API this torch lacks, a control measurement that came out inconclusive).

By default every check runs in a process of its own, after ``cudalloc_torch.enable()``, so
that a check that kills its process (an illegal memory access is sticky, an abort ends the
process) is reported as FAIL with its exit status and the end of its stderr, and the other
checks still run. Lines the backend writes to stderr (``cudalloc: ...``, its reports of
failures it does not raise) are shown after the check's detail.

    PYTHONPATH=python python3 python/acceptance/review_checks.py                 # every check
    PYTHONPATH=python python3 python/acceptance/review_checks.py --only peer_copy,oom_observer
    PYTHONPATH=python python3 python/acceptance/review_checks.py --baseline      # PyTorch's allocator

``--baseline`` runs the same checks on PyTorch's own caching allocator (no ``enable()``): every
check but ``empty_cache_in_use_mem_pool`` (which asks for more than PyTorch's allocator does)
is written to PASS there (or SKIP), which validates the check itself. ``--conf`` sets
``CUDALLOC_CONF`` (default ``policy:default``); ``--lib`` the library (default: what
``cudalloc_torch`` finds, ``$CUDALLOC_LIB`` first); ``--in-process`` runs every check in this
process, one after another (faster; a crash ends the run). Exit status 1 when a check failed.
"""

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
import traceback

import ipc_checks
import pool_checks
from check_base import RUN, MiB, Skip
from check_base import cuda_torch as _torch
from check_base import line as _line
from check_base import settle as _settle

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
MARK = "REVIEW_CHECK_RESULT "


def _need_gpus(torch, n):
    if torch.cuda.device_count() < n:
        raise Skip(f"needs {n} GPUs, this machine has {torch.cuda.device_count()}")


# ---------------------------------------------------------------------------------------------
# Members CUDAPluggableAllocator leaves as TORCH_CHECK(false, ...) stubs: the backend overrides
# them (each raised or read PyTorch's unused allocator before it did)
# ---------------------------------------------------------------------------------------------


def check_get_memory_fraction():
    """torch.cuda.get_per_process_memory_fraction() after set_per_process_memory_fraction(0.5)
    returns 0.5, as PyTorch's allocator does (getMemoryFraction; the pluggable base raises
    "does not yet support getMemoryFraction")."""
    torch = _torch()
    if not hasattr(torch.cuda, "get_per_process_memory_fraction"):
        raise Skip("this torch has no torch.cuda.get_per_process_memory_fraction")
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        try:
            got = torch.cuda.get_per_process_memory_fraction()
        except RuntimeError as e:
            raise AssertionError(f"get_per_process_memory_fraction() raised after set(0.5): {_line(e)}")
        assert abs(got - 0.5) < 1e-6, f"get_per_process_memory_fraction() = {got}, 0.5 was set"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {"fraction": got}


def check_reset_accumulated_stats():
    """torch.cuda.reset_accumulated_memory_stats() zeroes the "allocated"/"freed" counters,
    num_alloc_retries and num_ooms, as PyTorch's allocator does (resetAccumulatedStats; the
    pluggable base raises)."""
    torch = _torch()
    a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    del a
    before = torch.cuda.memory_stats()
    assert before.get("allocation.all.allocated", 0) >= 1, "the allocation was not counted"
    try:
        torch.cuda.reset_accumulated_memory_stats()
    except RuntimeError as e:
        raise AssertionError(f"reset_accumulated_memory_stats() raised: {_line(e)}")
    after = torch.cuda.memory_stats()
    keys = ("allocation.all.allocated", "allocation.all.freed", "allocated_bytes.all.allocated",
            "allocated_bytes.all.freed", "num_ooms", "num_alloc_retries")
    left = {k: after.get(k) for k in keys if after.get(k)}
    assert not left, f"accumulated counters not reset: {left}"
    return {"reset": list(keys)}


def check_oom_observer():
    """torch._C._cuda_attach_out_of_memory_observer(fn) (the documented recipe that dumps a
    memory snapshot on OOM): attaching works and the observer is called before
    torch.OutOfMemoryError is raised, as PyTorch's allocator calls every observer
    (attachOutOfMemoryObserver; the pluggable base raises)."""
    torch = _torch()
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        raise Skip("this torch has no torch._C._cuda_attach_out_of_memory_observer")
    calls = []

    def observer(device, alloc, device_alloc, device_free):
        calls.append((int(device), int(alloc), int(device_alloc), int(device_free)))

    try:
        attach(observer)
    except RuntimeError as e:
        raise AssertionError(f"attaching an out-of-memory observer raised: {_line(e)}")
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        raise AssertionError("allocating twice the device's memory did not raise")
    except torch.OutOfMemoryError:
        pass
    assert calls, "torch.OutOfMemoryError was raised but the observer was never called"
    return {"observer_calls": calls[:2]}


def check_accelerator_api():
    """torch.accelerator's memory functions go through c10::getDeviceAllocator(kCUDA), i.e.
    c10::GetAllocator(kCUDA). torch.cuda.memory.change_current_allocator stores the new
    allocator in CUDACachingAllocator::allocator only, not in c10's allocator table, so the
    backend registers itself there too (register_device_allocator); without it those
    functions report PyTorch's unused native allocator (zeros; empty_cache a no-op)."""
    torch = _torch()
    acc = getattr(torch, "accelerator", None)
    if acc is None or not hasattr(acc, "memory_allocated"):
        raise Skip("this torch has no torch.accelerator.memory_allocated")
    _settle(torch)
    a = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    via_cuda = torch.cuda.memory_allocated()
    try:
        via_acc = acc.memory_allocated()
    except RuntimeError as e:
        raise AssertionError(f"torch.accelerator.memory_allocated() raised: {_line(e)}")
    found = {"torch.cuda.memory_allocated": via_cuda, "torch.accelerator.memory_allocated": via_acc}
    assert via_acc == via_cuda, f"torch.accelerator and torch.cuda disagree: {found}"
    del a
    if hasattr(acc, "empty_cache"):
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        del x
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        acc.empty_cache()
        after = torch.cuda.memory_reserved()
        found["accelerator_empty_cache_released"] = before - after
        if before - torch.cuda.memory_allocated() >= 256 * MiB:
            assert before - after >= 256 * MiB, (
                f"torch.accelerator.empty_cache() released {before - after} of "
                f"{before - torch.cuda.memory_allocated()} cached bytes")
    return found


def check_peer_copy():
    """Cross-device copies of cudalloc memory (needs 2 GPUs). PyTorch's copy kernel calls
    CUDAAllocator::memcpyAsync and, once get_p2p_access() enables P2P, enablePeerAccess.
    cudalloc's expandable policies map pages with cuMemMap, accessible only from the devices
    named, so the backend's enablePeerAccess grants the peer access to every page
    (cudalloc_enable_peer_access), as PyTorch's own allocator does for its expandable segments
    (addPeerAccess), and its memcpyAsync uses cudaMemcpyPeerAsync without P2P; with the
    pluggable base's (cudaDeviceEnablePeerAccess only, a plain cudaMemcpyAsync) a copy fails,
    faults or gives wrong bytes."""
    torch = _torch()
    _need_gpus(torch, 2)
    p2p = torch.cuda.can_device_access_peer(0, 1)
    torch.manual_seed(0)
    x = torch.randn(1024, 1024, device="cuda:0")
    ref = x.cpu()
    steps = {}

    def step(name, fn, want):
        try:
            got = fn()
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
        except RuntimeError as e:
            raise AssertionError(f"{name}: raised {_line(e)} (p2p={p2p}; done: {steps})")
        assert torch.equal(got.cpu(), want), f"{name}: wrong values (p2p={p2p}; done: {steps})"
        steps[name] = "ok"
        return got

    y = step("contiguous 0->1", lambda: x.to("cuda:1"), ref)
    step("contiguous 1->0", lambda: y.to("cuda:0"), ref)
    dst = torch.empty(1024, 1024, device="cuda:1")
    step("transposed 0->1 (copy kernel with P2P)", lambda: dst.copy_(x.t()), ref.t())
    step("dtype change 0->1", lambda: x.to("cuda:1", dtype=torch.float64), ref.double())
    back = torch.empty(1024, 1024, device="cuda:0")
    step("transposed 1->0", lambda: back.copy_(y.t()), ref.t())
    return {"p2p": p2p, "steps": steps}


# ---------------------------------------------------------------------------------------------
# Methods the backend overrides
# ---------------------------------------------------------------------------------------------


def check_empty_cache_in_use_mem_pool():
    """torch.cuda.empty_cache() while a torch.cuda.use_mem_pool block is open, on this thread
    or on another, must release the device's cached blocks (backend.cpp holds back only while
    a capture is underway). PyTorch's allocator keeps the device's cached blocks there (it
    counts a use_mem_pool as a capture underway): measured on an H100 with torch 2.11
    (2026-12-07), this check FAILs under --baseline, where cudalloc goes further. A control
    run outside any pool first shows the cache is releasable; when it is not (the policy gave
    the memory back at the free), the check is SKIP."""
    torch = _torch()

    def cached_then_empty(ctx):
        _settle(torch)
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        del x
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        with ctx():
            torch.cuda.empty_cache()
            after = torch.cuda.memory_reserved()
        return before, after

    b0, a0 = cached_then_empty(contextlib.nullcontext)
    if b0 - a0 < 256 * MiB:
        raise Skip(f"control: empty_cache outside a pool released only {(b0 - a0) // MiB} MiB "
                   "(nothing was cached after the free; try --conf policy:torch)")
    found = {"control_released_mib": (b0 - a0) // MiB}
    pool = torch.cuda.MemPool()
    b1, a1 = cached_then_empty(lambda: torch.cuda.use_mem_pool(pool))
    found["same_thread_released_mib"] = (b1 - a1) // MiB

    other = torch.cuda.MemPool()
    entered, leave = threading.Event(), threading.Event()

    def holder():
        with torch.cuda.use_mem_pool(other):
            entered.set()
            leave.wait(60)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert entered.wait(60), "the other thread did not enter use_mem_pool"
        b2, a2 = cached_then_empty(contextlib.nullcontext)
    finally:
        leave.set()
        t.join()
    found["other_thread_released_mib"] = (b2 - a2) // MiB
    bad = [k for k in ("same_thread_released_mib", "other_thread_released_mib") if found[k] < 256]
    assert not bad, f"empty_cache released nothing while a use_mem_pool was open: {found}"
    return found


def check_release_pool_with_live_blocks():
    """A MemPool deleted while a tensor allocated in it is alive (MemPool::~MemPool calls
    releasePool then emptyCache(id)). The tensor must stay
    valid and untouched, new allocations must not overlap it, and once it is freed its memory
    must go back at empty_cache, as with PyTorch's allocator (the pool becomes freeable and is
    dropped when empty). Crash/corruption if the bytes are reused; wrong result if the memory
    never comes back."""
    torch = _torch()
    _settle(torch)
    base_alloc = torch.cuda.memory_allocated()
    base_reserved = torch.cuda.memory_reserved()
    n = 64 * MiB  # floats: 256 MiB
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        t = torch.ones(n, device="cuda")
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    u = torch.zeros(n, device="cuda")
    lo, hi = t.data_ptr(), t.data_ptr() + 4 * n
    overlap = u.data_ptr() < hi and lo < u.data_ptr() + 4 * n
    assert not overlap, "a new allocation overlaps a live tensor of the released pool"
    s = float(t.sum())
    assert s == float(n), f"the live tensor of the released pool changed: sum {s}, want {n}"
    del t, u
    _settle(torch)
    found = {"allocated_delta": torch.cuda.memory_allocated() - base_alloc,
             "reserved_delta_mib": (torch.cuda.memory_reserved() - base_reserved) // MiB}
    assert found["allocated_delta"] == 0, f"memory still counted as allocated: {found}"
    assert torch.cuda.memory_reserved() - base_reserved < 64 * MiB, (
        f"the released pool's memory did not go back at empty_cache: {found}")
    return found


def check_mempool_use_count():
    """MemPool.use_count() (getPoolUseCount): 1 after MemPool(), 2 inside
    use_mem_pool, 1 after, as PyTorch's allocator counts. Wrong result if it differs."""
    torch = _torch()
    pool = torch.cuda.MemPool()
    counts = [pool.use_count()]
    with torch.cuda.use_mem_pool(pool):
        counts.append(pool.use_count())
    counts.append(pool.use_count())
    assert counts == [1, 2, 1], f"use_count before/inside/after use_mem_pool: {counts}"
    return {"counts": counts}


def check_pool_oom_is_out_of_memory_error():
    """An allocation in a MemPool that cannot fit raises torch.OutOfMemoryError (PyTorch's
    allocator raises it for pool allocations too), not RuntimeError: checked_malloc
    relies on cudalloc_last_error_kind() after cudalloc_pool_malloc."""
    torch = _torch()
    total = torch.cuda.get_device_properties(0).total_memory
    pool = torch.cuda.MemPool()
    try:
        with torch.cuda.use_mem_pool(pool):
            try:
                torch.empty(2 * total, dtype=torch.uint8, device="cuda")
                raise AssertionError("allocating twice the device's memory in a pool did not raise")
            except torch.OutOfMemoryError as e:
                kind = "OutOfMemoryError"
                msg = _line(e)
            except RuntimeError as e:
                raise AssertionError(f"raised RuntimeError, not torch.OutOfMemoryError: {_line(e)}")
    finally:
        del pool
    return {"raised": kind, "message": msg}


def check_record_stream_other_device():
    """Tensor.record_stream with a stream of another device (needs 2 GPUs). PyTorch's
    allocator accepts it (insert_events switches to the stream's device to record the event);
    backend.cpp passes it to cudalloc_record_stream, which refuses a stream of another
    device, and check() raises. Wrong result (RuntimeError where PyTorch works)."""
    torch = _torch()
    _need_gpus(torch, 2)
    x = torch.ones(1 << 20, device="cuda:0")
    s1 = torch.cuda.Stream(device=1)
    try:
        x.record_stream(s1)
    except RuntimeError as e:
        raise AssertionError(f"record_stream with a stream of cuda:1 on a cuda:0 tensor raised: {_line(e)}")
    del x
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    y = torch.ones(1 << 20, device="cuda:0")
    assert float(y.sum()) == float(1 << 20)
    return {"recorded": True}


def check_stats_second_device():
    """The statistics, snapshot and empty_cache of the second device (needs 2 GPUs):
    memory_allocated(1) counts a cuda:1 tensor and memory_allocated(0) does not, the snapshot
    names its segment's device 1, caching_allocator_alloc on device 1 is counted there, and
    empty_cache releases device 1's cache."""
    torch = _torch()
    _need_gpus(torch, 2)
    _settle(torch)
    a0, a1 = torch.cuda.memory_allocated(0), torch.cuda.memory_allocated(1)
    t = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:1")
    found = {"dev1_delta": torch.cuda.memory_allocated(1) - a1,
             "dev0_delta": torch.cuda.memory_allocated(0) - a0}
    assert found["dev1_delta"] >= 64 * MiB and found["dev0_delta"] == 0, f"per-device stats: {found}"
    segs = [s for s in torch.cuda.memory_snapshot() if s["device"] == 1]
    assert any(b["state"] == "active_allocated" and b["size"] >= 64 * MiB
               for s in segs for b in s["blocks"]), "no allocated block on device 1 in the snapshot"
    p = torch.cuda.caching_allocator_alloc(8 * MiB, device=1)
    assert torch.cuda.memory_allocated(1) - a1 >= 72 * MiB, "caching_allocator_alloc(device=1) not counted"
    torch.cuda.caching_allocator_delete(p)
    del t
    torch.cuda.synchronize(1)
    before = torch.cuda.memory_reserved(1)
    torch.cuda.empty_cache()
    found["dev1_released_mib"] = (before - torch.cuda.memory_reserved(1)) // MiB
    return found


def check_history_current_device():
    """torch.cuda.memory._record_memory_history on a program that runs on cuda:1 (needs 2
    GPUs; torchrun's ranks other than 0 do this after set_device(local_rank)). The library keeps
    device 0's history only (cudalloc.h "Device 0's allocation history"), so
    the snapshot's device_traces[1] is empty; PyTorch's allocator records every device. Wrong
    result (known limitation, documented in the code)."""
    torch = _torch()
    _need_gpus(torch, 2)
    torch.cuda.set_device(1)
    torch.cuda.memory._record_memory_history(max_entries=10000)
    try:
        a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda:1")
        del a
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap.get("device_traces", [])
    ev1 = traces[1] if len(traces) > 1 else []
    allocs = [e for e in ev1 if e.get("action") == "alloc" and e.get("size", 0) >= 8 * MiB]
    assert allocs, f"no alloc event of device 1 in device_traces (lengths {[len(t) for t in traces]})"
    return {"device1_events": len(ev1)}


def check_free_first_in_capture():
    """Frees inside a CUDA graph capture before the capture's first allocation. The library is
    told of a capture (cudalloc_capture_begin) only at the first allocation on the captured
    stream (tell_capture); until then cudalloc_free runs its normal path:
    a record_stream'ed block records its event on the stream being captured (PyTorch defers that
    event while captures_underway is non-empty, insert_events_deferred_until_no_capture, and
    CUDAGraph::capture_begin calls beginAllocateToPool before cudaStreamBeginCapture precisely so
    that such frees see it), and a large free may give pages back. Expected on cudalloc: the
    capture fails, or the freed block never comes back (event query of a captured event fails),
    or errors on stderr. Crash (capture invalidated) or leak."""
    torch = _torch()
    _settle(torch)
    x = torch.randn(1 << 20, device="cuda")
    base_active = torch.cuda.memory_stats()["active_bytes.all.current"]
    total = torch.cuda.get_device_properties(0).total_memory
    big = torch.empty(min(4 << 30, total // 8), dtype=torch.uint8, device="cuda")
    big.fill_(0)
    s = torch.cuda.Stream()
    side = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    side.fill_(0)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        side.add_(1)
    side.record_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=s):
            del side  # first thing in the capture: its event goes on the capturing stream
            del big   # a large free: pages may go back
            y = x * 2
    except RuntimeError as e:
        raise AssertionError(f"the capture failed: {_line(e)}")
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2), "the replay computed a wrong result"
    for _ in range(3):  # later allocations process the allocator's pending events
        t = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        t.fill_(1)
        del t
        torch.cuda.synchronize()
    del y, g
    _settle(torch)
    t = torch.empty(1 * MiB, dtype=torch.uint8, device="cuda")
    del t
    active = torch.cuda.memory_stats()["active_bytes.all.current"]
    found = {"active_delta_mib": (active - base_active) / MiB}
    assert active - base_active < 2 * MiB, f"freed blocks stay active (pending) after the capture: {found}"
    return found


def check_snapshot_tools():
    """torch.cuda.memory._snapshot() with history, through PyTorch's own tools:
    torch.cuda.memory_summary() and torch.cuda._memory_viz's segsum, trace, trace_plot and
    segment_plot. They read the snapshot's keys (segments, device_traces, the blocks' state,
    size, requested_size and frames; segsum asserts that the blocks add up to each segment's
    total_size). Wrong result (tooling) if one raises."""
    torch = _torch()
    from torch.cuda import _memory_viz as viz

    torch.cuda.memory._record_memory_history(max_entries=10000)
    try:
        keep = [torch.empty(k * MiB, dtype=torch.uint8, device="cuda") for k in (1, 3, 65)]
        del keep[1]
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    missing = [k for k in ("segments", "device_traces") if k not in snap]
    assert not missing, f"snapshot lacks {missing}; keys {sorted(snap)}"
    errors, ran = {}, []
    calls = [("memory_summary", lambda: torch.cuda.memory_summary())]
    # segsum and trace read the segments' blocks (state, size, requested_size, frames) and the
    # trace entries; segments()/memory() are left out: they fetch flamegraph.pl from the network.
    for name in ("segsum", "trace", "trace_plot", "segment_plot"):
        fn = getattr(viz, name, None)
        if fn is not None:
            calls.append((f"_memory_viz.{name}", lambda fn=fn: fn(snap)))
    for name, fn in calls:
        try:
            fn()
            ran.append(name)
        except Exception as e:  # a tool reading a key the backend does not fill
            errors[name] = f"{type(e).__name__}: {_line(e)}"
    assert not errors, f"tools failed on the snapshot: {errors}"
    allocs = [e for e in snap["device_traces"][0] if e.get("action") == "alloc"] if snap["device_traces"] else []
    return {"tools": ran, "alloc_events": len(allocs), "top_keys": sorted(snap)}


def check_cudnn_benchmark_cache_info():
    """cuDNN benchmark mode asks the allocator for the largest block it could hand out
    (cacheInfo parses cudalloc_stats_json). A conv forward and backward
    must run."""
    torch = _torch()
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
    x = torch.randn(8, 64, 56, 56, device="cuda", requires_grad=True)
    conv(x).sum().backward()
    torch.cuda.synchronize()
    return {"ran": True}


def check_ipc_share_raises_cleanly():
    """Sharing a CUDA tensor with another process (Storage._share_cuda_, what
    torch.multiprocessing's reduction calls) without shareable_segments:True in the config:
    the backend's shareIpcHandle raises a RuntimeError naming the key, and the process must go
    on. PASS on PyTorch's allocator too (it returns a handle); ipc_share_tensor shares one."""
    torch = _torch()
    t = torch.ones(1 << 20, device="cuda")
    try:
        t.untyped_storage()._share_cuda_()
        outcome = "shared"
    except RuntimeError as e:
        outcome = f"RuntimeError: {_line(e)}"
        if "cudalloc" in str(e):  # not PyTorch's own error on the pluggable fallback
            assert "shareable_segments" in str(e), f"the error names no config key: {outcome}"
    u = torch.ones(1 << 20, device="cuda")
    assert float(u.sum()) == float(1 << 20)
    return {"outcome": outcome}


def check_caching_allocator_enable():
    """torch.cuda.caching_allocator_enable(False) (CUDAAllocator::enable, not overridden):
    PyTorch's allocator then hands out uncached cudaMalloc memory; here the call must at least
    not raise, and allocations must go on working. Informational (cosmetic at worst)."""
    torch = _torch()
    if not hasattr(torch.cuda, "caching_allocator_enable"):
        raise Skip("this torch has no torch.cuda.caching_allocator_enable")
    try:
        torch.cuda.caching_allocator_enable(False)
        a = torch.ones(1 << 20, device="cuda")
        s = float(a.sum())
        del a
    except RuntimeError as e:
        raise AssertionError(f"caching_allocator_enable(False) then an allocation raised: {_line(e)}")
    finally:
        with contextlib.suppress(RuntimeError):
            torch.cuda.caching_allocator_enable(True)
    return {"sum": s}


CHECKS = {
    "get_memory_fraction": check_get_memory_fraction,
    "reset_accumulated_stats": check_reset_accumulated_stats,
    "oom_observer": check_oom_observer,
    "accelerator_api": check_accelerator_api,
    "peer_copy": check_peer_copy,
    "empty_cache_in_use_mem_pool": check_empty_cache_in_use_mem_pool,
    "release_pool_with_live_blocks": check_release_pool_with_live_blocks,
    "mempool_use_count": check_mempool_use_count,
    "pool_oom_is_out_of_memory_error": check_pool_oom_is_out_of_memory_error,
    "record_stream_other_device": check_record_stream_other_device,
    "stats_second_device": check_stats_second_device,
    "history_current_device": check_history_current_device,
    "free_first_in_capture": check_free_first_in_capture,
    "snapshot_tools": check_snapshot_tools,
    "cudnn_benchmark_cache_info": check_cudnn_benchmark_cache_info,
    "ipc_share_raises_cleanly": check_ipc_share_raises_cleanly,
    "caching_allocator_enable": check_caching_allocator_enable,
    **pool_checks.CHECKS,
    **ipc_checks.CHECKS,
}


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def enable_backend(args):
    """cudalloc_torch.enable() as python/acceptance/run.py does it (nothing with --baseline).
    Returns the backend's name."""
    RUN.update(conf=args.conf, lib=args.lib, backend=args.backend, baseline=args.baseline,
               python_dir=PYTHON_DIR)
    if args.baseline:
        return "torch"
    sys.path.insert(0, PYTHON_DIR)
    import cudalloc_torch

    cudalloc_torch.enable(lib_path=args.lib, conf=args.conf, backend=args.backend)
    return cudalloc_torch.backend()


def run_check(name):
    """Runs one check here: ``{"name", "status", "detail", "findings"}``."""
    t0 = time.perf_counter()
    try:
        findings = CHECKS[name]()
        status, detail = "PASS", json.dumps(findings, default=str)[:400]
    except Skip as e:
        status, detail, findings = "SKIP", str(e), None
    except AssertionError as e:
        status, detail, findings = "FAIL", str(e) or "assertion failed", None
    except Exception as e:  # an unexpected error is a failure of the check too
        status, detail, findings = "FAIL", f"{type(e).__name__}: {_line(e)}", None
        traceback.print_exc()
    return {"name": name, "status": status, "detail": detail, "findings": findings,
            "seconds": round(time.perf_counter() - t0, 2)}


def child(args):
    try:
        backend = enable_backend(args)
    except Exception as e:
        print(MARK + json.dumps({"name": args.child, "status": "FAIL",
                                 "detail": f"enable() failed: {type(e).__name__}: {_line(e)}"}), flush=True)
        return
    result = run_check(args.child)
    result["backend"] = backend
    print(MARK + json.dumps(result, default=str), flush=True)


def in_subprocess(name, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--conf", args.conf,
           "--backend", args.backend]
    if args.lib:
        cmd += ["--lib", args.lib]
    if args.baseline:
        cmd.append("--baseline")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PYTHON_DIR, env.get("PYTHONPATH")) if p)
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "status": "FAIL", "detail": f"timed out after {args.timeout} s (hang?)"}
    result = None
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            result = json.loads(line[len(MARK):])
    backend_lines = [l.strip() for l in p.stderr.splitlines() if l.startswith("cudalloc:")]
    if result is None:
        tail = " | ".join(l.strip() for l in p.stderr.strip().splitlines()[-4:])
        result = {"name": name, "status": "FAIL",
                  "detail": f"the process died (exit status {p.returncode}): {tail[-600:]}"}
    if backend_lines:
        result["detail"] += f"  [stderr: {' | '.join(backend_lines[:3])[:400]}]"
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated check names (default: all)")
    ap.add_argument("--conf", default="policy:default", help="CUDALLOC_CONF (default policy:default)")
    ap.add_argument("--lib", default=None, help="libcudalloc_capi.so (default: cudalloc_torch's choice)")
    ap.add_argument("--backend", default="extension", help="cudalloc_torch backend (default extension)")
    ap.add_argument("--baseline", action="store_true", help="PyTorch's own allocator (validates the checks)")
    ap.add_argument("--in-process", action="store_true", help="every check in this process")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per check process")
    ap.add_argument("--list", action="store_true", help="list the checks and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        for name, fn in CHECKS.items():
            doc = " ".join(fn.__doc__.split())
            print(f"{name}: {doc[:160]}")
        return 0
    if args.child:
        child(args)
        return 0
    names = list(CHECKS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"unknown checks {unknown}; see --list")
    mode = "PyTorch's allocator (baseline)" if args.baseline else f"cudalloc {args.backend}, {args.conf}"
    print(f"review checks on {mode}", flush=True)
    results = []
    if args.in_process:
        backend = enable_backend(args)
        print(f"backend: {backend}", flush=True)
        for name in names:
            results.append(run_check(name))
            r = results[-1]
            print(f"{r['name']:<34} {r['status']:<4} {r['detail']}", flush=True)
    else:
        for name in names:
            r = in_subprocess(name, args)
            results.append(r)
            print(f"{r['name']:<34} {r['status']:<4} {r['detail']}", flush=True)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
