"""What every review check shares (``review_checks.py``, ``pool_checks.py``): the ``Skip``
exception a check raises when the machine or the torch version cannot run it, and small
helpers."""

import gc

MiB = 1 << 20


class Skip(Exception):
    """The check cannot run here; the message says why."""


def line(e):
    """The first line of an exception's message (at most 300 characters)."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def cuda_torch():
    """torch, with CUDA initialised."""
    import torch

    torch.cuda.init()
    return torch


def settle(torch):
    """Collects garbage, waits for every device and empties the cache."""
    gc.collect()
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    torch.cuda.empty_cache()
