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
  allocator in use.
"""

import gc

import torch

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
    """How many 256 MiB tensors fit under a cap before the error; whether the program went on."""
    torch.cuda.set_per_process_memory_fraction(0.02)
    chunks = []
    try:
        while len(chunks) < 4096:
            chunks.append(torch.empty(256 * MiB, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    else:
        raise RuntimeError("no out-of-memory error under a 2% cap")
    fitted = len(chunks)
    del chunks
    gc.collect()
    torch.cuda.empty_cache()
    again = [torch.ones(256 * MiB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    went_on = int(sum(int(t.sum()) for t in again))
    return {"fitted": fitted, "error": error, "went_on": went_on == 2 * 256 * MiB,
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
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
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
    if not all(checks.values()):
        raise RuntimeError(f"memory API checks failed: {checks}")
    return {"checks": checks}


PROGRAMS = {
    "side_stream": side_stream,
    "oom_recover": oom_recover,
    "oom_batch_search": oom_batch_search,
    "memory_api": memory_api,
}
