"""Review checks of ``torch.cuda.MemPool``'s options on cudalloc's extension backend, run by
``review_checks.py`` (``--only mempool_use_on_oom,mempool_no_split``) like its own checks:
each returns its findings (PASS), raises ``AssertionError`` (FAIL) or ``Skip``, and passes on
PyTorch's own allocator too (``--baseline``).

``MemPool``'s constructor takes a use of its pool (``createOrIncrefPool``) and then sets its
options (``setUseOnOOM``, ``setNoSplit``); an option the allocator refuses makes the constructor
raise, and no destructor gives that use back: the backend must give it back itself.
"""

import os
import sys

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


CHECKS = {
    "mempool_use_on_oom": check_mempool_use_on_oom,
    "mempool_no_split": check_mempool_no_split,
}

if __name__ == "__main__":
    sys.exit("run through review_checks.py: " + os.path.basename(__file__) + " has no runner")
