"""The acceptance program that runs near a memory cap (``train_near_cap``): the case the
``default`` policy's capped mode is for, judged on a real program rather than on a replay.

A GPT-2 training whose sequence length changes every step (the shapes that fragment a cache)
runs first without a cap, which gives the losses and the live peak
(``torch.cuda.max_memory_allocated``: the same bytes under every allocator), and then again
from the same weights and batches under caps of 1.10x and 1.03x that live peak
(``set_per_process_memory_fraction``, the same bytes for every allocator). A capped run stops
at its first ``torch.OutOfMemoryError`` (later steps would start from other weights); the steps
it completed must give the uncapped run's losses (within 1e-3, as the runner holds runs to
PyTorch's), or the program fails: an allocator that moves or gives back memory under a cap
must not lose a live tensor's bytes. Reported per cap: the steps completed, the median step
time and the synchronizations of every stream (``num_sync_all_streams``, where both allocators
count their waits for the device). It needs PyTorch's statistics, so it runs on the extension
backend (the pluggable one raises on them)."""

import gc
import math
import statistics
import time

CAP_FACTORS = (1.10, 1.03)

# Sequence lengths, one per step: every length of the cycle, in an order that makes the cache
# serve a longer step after shorter ones.
LENGTHS = (512, 128, 384, 256, 448, 192, 320, 64)
LOSS_TOLERANCE = 1e-3


def train_near_cap(quick):
    """Dynamic-shape GPT-2 training without a cap, then under caps of 1.10x and 1.03x its live
    peak; the uncapped losses, and per cap the steps completed, step time and device waits."""
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4) if quick else GPT2Config()
    batch = 4 if quick else 8
    lengths = [n // 4 if quick else n for n in LENGTHS] * 2
    free = _training(cfg, batch, lengths, cap=None)
    # `peak_reserved` (the runner's column) is the uncapped run's: the capped runs stop at
    # different steps under different allocators.
    out = {"losses": free["losses"], "live_peak_mib": round(free["live_peak"] / (1 << 20)),
           "step_ms_uncapped": free["step_ms"], "peak_reserved": free["peak_reserved"]}
    for factor in CAP_FACTORS:
        run = _training(cfg, batch, lengths, cap=int(factor * free["live_peak"]))
        _check_losses(run["losses"], free["losses"], factor)
        key = f"{factor:.2f}x"
        out[f"steps_{key}"] = f"{len(run['losses'])}/{len(lengths)}"
        out[f"syncs_{key}"] = run["syncs"]
        if len(run["losses"]) == len(lengths):  # step times of the same steps only
            out[f"step_ms_{key}"] = run["step_ms"]
    # The runner compares `step_ms` with PyTorch's: the 1.10x cap's, when every step ran.
    if "step_ms_1.10x" in out:
        out["step_ms"] = out["step_ms_1.10x"]
    return out


def _training(cfg, batch, lengths, cap):
    """One training run from fresh weights (seed 0), under `cap` bytes when given: its losses
    up to its first out-of-memory error, the median time of a step after the first three, the
    live peak and the synchronizations of every stream during the run."""
    import torch
    from transformers import GPT2LMHeadModel

    total = torch.cuda.get_device_properties(0).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total) if cap else 1.0)
    torch.cuda.reset_peak_memory_stats()
    syncs = torch.cuda.memory_stats().get("num_sync_all_streams", 0)
    losses, times = [], []
    model = opt = ids = loss = None
    try:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step, length in enumerate(lengths):
            torch.manual_seed(100 + step)
            ids = torch.randint(0, cfg.vocab_size, (batch, length), device="cuda")
            loss, seconds = timed_step(model, opt, ids)
            times.append(seconds)
            losses.append(float(loss))
    except torch.OutOfMemoryError:
        pass  # the run ends at its first out-of-memory error, even one while loading the model
    finally:
        # Read before the clean-up below, whose `empty_cache` waits for the device too.
        stats = torch.cuda.memory_stats()
        model = opt = ids = loss = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {"losses": losses,
            "step_ms": 1000 * statistics.median(times[3:]) if len(times) > 3 else None,
            "live_peak": stats.get("allocated_bytes.all.peak", 0),
            "peak_reserved": stats.get("reserved_bytes.all.peak", 0),
            "syncs": stats.get("num_sync_all_streams", 0) - syncs}


def timed_step(model, opt, ids, dtype="bfloat16"):
    """One training step of a language model on `ids` (its own labels) under autocast to
    `dtype` (a ``torch`` dtype's name; None: no autocast), timed from an idle device to the end
    of its work: the loss (detached) and the seconds."""
    import contextlib

    import torch

    cast = contextlib.nullcontext()
    if dtype:
        cast = torch.autocast("cuda", dtype=getattr(torch, dtype))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with cast:
        loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return loss.detach(), time.perf_counter() - t0


def _check_losses(capped, free, factor):
    """Fails the program when a completed capped step's loss is not the uncapped run's (a NaN
    or an infinity, what lost bytes often give, is never the same)."""
    for step, (a, b) in enumerate(zip(capped, free)):
        if not (math.isfinite(a) and abs(a - b) <= LOSS_TOLERANCE * max(abs(b), 1e-12)):
            raise RuntimeError(f"under the {factor:.2f}x cap step {step} gave loss {a!r}, "
                               f"without a cap {b!r}: a live tensor's bytes changed")
