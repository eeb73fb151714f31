"""Acceptance programs of concurrent use: several host threads and streams at once, and a
library that catches out-of-memory errors itself (the registry and the other programs:
``programs.py``).

- ``threaded_serve``: requests served by four Python threads at once, each on a CUDA stream of
  its own, as a threaded inference server runs them. A worker makes its request's input and runs
  the model on its stream, then hands the output tensor to the main thread through a queue and
  drops it; the main thread reads it on its own stream (``wait_event``, ``record_stream``) behind
  a long matrix product, and frees it there, calling ``torch.cuda.empty_cache()`` after every
  eighth. So tensors are freed on another thread than the one that allocated them, while another
  stream may still read them, and the workers' next requests allocate meanwhile. Each output's
  sums must equal those of the same request run alone on the default stream before the threads
  start (an allocator that hands out memory still in use overwrites them), and the run must
  match PyTorch's allocator's.
- ``cudnn_near_cap``: a ResNet-18 trained on images whose size changes every step with
  ``torch.backends.cudnn.benchmark`` on, first without a cap and then under
  ``set_per_process_memory_fraction`` at 1.15 times the first part's peak allocated bytes, on
  new sizes. cuDNN's benchmark asks for the workspaces of the algorithms it times and skips
  those an out-of-memory error refuses (PyTorch catches it), so the allocator's errors must be
  catchable and leave it sound. Every step must run, the capped part must reserve no more than
  the cap, and the losses must be close to those on PyTorch's allocator (cuDNN's benchmark
  picks algorithms by timing them, so not bit-identical). The first part's peak includes the
  benchmark's workspaces, which depend on what the allocator says is free, so the cap is each
  allocator's own; ``ooms`` counts the out-of-memory errors (those PyTorch caught included).
  The peak reserved column is the larger of the two parts' peaks.
"""

import math
import queue
import random
import threading

import torch

MiB = 1 << 20


def threaded_serve(quick):
    """Per-request output sums of a transformer served by four threads, each on its stream."""
    torch.manual_seed(0)
    dim, layers, heads = (128, 2, 4) if quick else (1024, 6, 16)
    layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).cuda().eval()
    rng = random.Random(0)
    longest = 64 if quick else 512
    count = 24 if quick else 96
    requests = [(rng.choice([1, 2, 4, 8]), rng.randint(16, longest)) for _ in range(count)]

    def run(i):
        batch, length = requests[i]
        gen = torch.Generator(device="cuda")
        gen.manual_seed(10_000 + i)
        x = torch.randn(batch, length, dim, device="cuda", generator=gen)
        with torch.no_grad():
            return model(x)

    # A LayerNorm ends the model, so a plain sum of an output is about 0 and the sum of its
    # squares the element count whatever it holds: the checksums project it on a fixed vector.
    probe = torch.randn(dim, device="cuda", dtype=torch.float64)

    def sums(y):
        projected = y.double() @ probe
        return torch.stack([projected.sum(), projected.abs().sum()])

    reference = [sums(run(i)) for i in range(len(requests))]
    reference = torch.stack(reference).tolist()
    torch.cuda.synchronize()

    todo, done = queue.Queue(), queue.Queue()
    for i in range(len(requests)):
        todo.put(i)
    errors = []

    def worker():
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                while True:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    y = run(i)
                    done.put((i, y, stream.record_event()))
                    del y  # the main thread holds the only reference now
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            done.put(None)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    main = torch.cuda.current_stream()
    weight = torch.randn(2048, 2048, device="cuda")
    got, finished = {}, 0
    while finished < len(threads):
        item = done.get()
        if item is None:
            finished += 1
            continue
        i, y, ready = item
        main.wait_event(ready)
        y.record_stream(main)
        busy = weight @ weight  # the main stream falls behind the workers' streams
        got[i] = sums(y) + 0 * busy[0, 0]
        del item, y, busy  # freed on this thread while the main stream may still read them
        if len(got) % 8 == 0:  # as servers that release the cache between requests do
            torch.cuda.empty_cache()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    torch.cuda.synchronize()
    served = [got[i].tolist() for i in range(len(requests))]
    differing = [i for i in range(len(requests)) if served[i] != reference[i]]
    worst = max((abs(a - b) / max(abs(b), 1e-12)
                 for i in range(len(requests)) for a, b in zip(served[i], reference[i])),
                key=lambda d: math.inf if math.isnan(d) else d)
    if not worst <= 1e-3:  # a NaN fails too
        raise RuntimeError(f"request {differing[0]}'s output differs from its run alone on the "
                           f"default stream (max rel diff {worst:.3g}): memory reused too early")
    return {"losses": [v for s in served for v in s], "differing_from_alone": len(differing),
            "max_rel_diff_alone": worst}


def cudnn_near_cap(quick):
    """Losses of ResNet-18 training with cuDNN benchmark on, without a cap and under one."""
    import torchvision

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet18(num_classes=100).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = 8 if quick else 64
    free_sizes = [96, 128, 160] if quick else [160, 192, 224, 256]
    capped_sizes = [112, 144] if quick else [176, 208, 240]

    def step(size, seed):
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed)
        x = torch.randn(batch, 3, size, size, device="cuda", generator=gen)
        labels = torch.randint(0, 100, (batch,), device="cuda", generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    losses = [step(size, seed) for seed, size in enumerate(free_sizes)]
    peak = torch.cuda.max_memory_allocated()
    free_reserved = torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = int(1.15 * peak)
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    torch.cuda.reset_peak_memory_stats()
    losses += [step(size, 100 + seed) for seed, size in enumerate(capped_sizes)]
    reserved = torch.cuda.max_memory_reserved()
    torch.cuda.set_per_process_memory_fraction(1.0)
    if reserved > cap:
        raise RuntimeError(f"{reserved} bytes reserved under a cap of {cap}")
    return {"losses": losses, "cap_mib": round(cap / MiB),
            "capped_reserved_mib": round(reserved / MiB),
            "peak_reserved": max(free_reserved, reserved),
            "ooms": torch.cuda.memory_stats().get("num_ooms", 0)}
