"""Review checks of ``torch.cuda.MemPool``'s options, and of ``empty_cache`` during a capture
while a ``use_mem_pool`` block is open, on cudalloc's extension backend, run by
``review_checks.py`` (``--only mempool_use_on_oom,mempool_no_split``) like its own checks:
each returns its findings (PASS), raises ``AssertionError`` (FAIL) or ``Skip``, and passes on
PyTorch's own allocator too (``--baseline``).

``MemPool``'s constructor takes a use of its pool (``createOrIncrefPool``) and then sets its
options (``setUseOnOOM``, ``setNoSplit``); an option the allocator refuses makes the constructor
raise, and no destructor gives that use back: the backend must give it back itself.
"""

import os
import sys
import threading

from check_base import MiB, Skip
from check_base import cuda_torch as _torch
from check_base import settle as _settle

GiB = 1 << 30


def _pools_in_use():
    """Private pools cudalloc has in use on device 0 (``None`` on PyTorch's allocator)."""
    if "cudalloc_torch" not in sys.modules:
        return None
    import cudalloc_torch

    return cudalloc_torch.stats(0)["capi"]["private_pools"]["active"]


def _mem_pool(torch, **options):
    try:
        return torch.cuda.MemPool(**options)
    except TypeError as e:  # a torch without the option
        raise Skip(f"torch.cuda.MemPool{tuple(options)}: {e}")


def _outside_after_pool_cached(torch, pool):
    """Caches 1 GiB in ``pool``, caps the process 512 MiB above what is reserved, and allocates
    1 GiB outside the pool: the tensor, or the ``torch.OutOfMemoryError`` raised."""
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    del x
    _settle(torch)
    total = torch.cuda.get_device_properties(0).total_memory
    cap = torch.cuda.memory_reserved() + 512 * MiB
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        return torch.empty(GiB, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        return e
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def check_mempool_use_on_oom():
    """MemPool(use_on_oom=True): an allocation outside the pool that does not fit under the
    cap uses the pool's free memory (PyTorch hands out the pool's free blocks; cudalloc gives
    them back to the driver for the allocation's second try). A pool without the option keeps
    its free memory: the same allocation raises torch.OutOfMemoryError (the control). Before
    the backend supported it, MemPool(use_on_oom=True) raised and kept a pool in use."""
    torch = _torch()
    _settle(torch)
    before = _pools_in_use()
    plain = torch.cuda.MemPool()
    control = _outside_after_pool_cached(torch, plain)
    if not isinstance(control, torch.OutOfMemoryError):
        raise Skip("the control allocation fitted without the pool's memory")
    del plain, control
    _settle(torch)
    pool = _mem_pool(torch, use_on_oom=True)
    uses = pool.use_count()
    lent = _outside_after_pool_cached(torch, pool)
    assert not isinstance(lent, Exception), (
        f"1 GiB outside a use_on_oom pool caching 1 GiB did not fit: {lent}")
    del lent, pool
    _settle(torch)
    after = _pools_in_use()
    assert uses == 1, f"use_count of a new MemPool(use_on_oom=True): {uses}"
    assert after == before, f"private pools in use before/after: {before}/{after}"
    return {"control": "OutOfMemoryError", "use_count": uses, "pools_in_use": [before, after]}


def check_mempool_no_split():
    """MemPool(no_split=True) either works (PyTorch's allocator) or raises RuntimeError naming
    the option, leaving no pool in use (the constructor's use given back) and every later
    MemPool working."""
    torch = _torch()
    _settle(torch)
    before = _pools_in_use()
    try:
        pool = _mem_pool(torch, no_split=True)
    except RuntimeError as e:
        message = str(e).strip().splitlines()[0][:300]
        assert "no_split" in message, f"the error does not name the option: {message}"
        after = _pools_in_use()
        assert after == before, f"private pools in use before/after: {before}/{after}"
        later = torch.cuda.MemPool()
        assert later.use_count() == 1, f"a later MemPool's use_count: {later.use_count()}"
        return {"raised": message, "pools_in_use": [before, after]}
    with torch.cuda.use_mem_pool(pool):
        x = torch.ones(MiB, device="cuda")
    assert float(x.sum()) == MiB
    return {"supported": True}


def check_empty_cache_during_capture():
    """torch.cuda.empty_cache() during a CUDA graph capture (global capture mode), from another
    thread that holds a use_mem_pool block before the capture's first allocation (only the
    capture's route holds it back) and from the capturing thread after it, with 256 MiB
    cached on the device: nothing may be released (a release waits for the device, which
    invalidates the capture; a use_mem_pool block alone does not hold empty_cache back on
    cudalloc), the capture must end and the graph replay to the right result. Fails with the
    capture's error if a release reached the driver."""
    torch = _torch()
    _settle(torch)
    a = torch.full((1 << 20,), 3.0, device="cuda")
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    del x
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    pool = torch.cuda.MemPool()
    inside, go, done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def other():
        with torch.cuda.use_mem_pool(pool):
            inside.set()
            if go.wait(60):  # the capture's route begun, nothing allocated in it yet
                try:
                    torch.cuda.empty_cache()
                    seen["reserved"] = torch.cuda.memory_reserved()
                except Exception as e:  # reported below, after the capture ended
                    seen["error"] = f"{type(e).__name__}: {e}"
            done.set()

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(60), "the other thread did not enter use_mem_pool"
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            b = a * 2  # warm-up outside the capture
            g.capture_begin()
            try:
                go.set()
                assert done.wait(60), "the other thread's empty_cache did not return"
                b = a * 2
                torch.cuda.empty_cache()  # the capture allocated: the library knows of it
                during = torch.cuda.memory_reserved()
                c = b + 1
            finally:
                go.set()
                g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
    finally:
        t.join()
    assert "error" not in seen, f"empty_cache on the other thread raised: {seen['error']}"
    a.fill_(5.0)
    g.replay()
    torch.cuda.synchronize()
    found = {"cached_mib": before // MiB, "during_mib": during // MiB,
             "other_thread_mib": seen["reserved"] // MiB}
    assert during >= before and seen["reserved"] >= before, f"memory went back: {found}"
    assert bool((c == 11.0).all()), f"the graph's replay gave {c[0].item()} instead of 11.0"
    return found


CHECKS = {
    "mempool_use_on_oom": check_mempool_use_on_oom,
    "mempool_no_split": check_mempool_no_split,
    "empty_cache_during_capture": check_empty_cache_during_capture,
}

if __name__ == "__main__":
    sys.exit("run through review_checks.py: " + os.path.basename(__file__) + " has no runner")
