#!/usr/bin/env python3
"""Sleep and wake a PyTorch model on cudalloc: its weights leave the GPU and come back at the
same addresses, its KV cache is dropped and reused, and greedy generation gives the same tokens
before and after.

1. cudalloc becomes PyTorch's allocator (``cudalloc_torch.enable``, policy ``default``).
2. A GPT-2 shaped model (the public GPT-2 configs: ``--config small``, ``medium``, ``large`` or
   ``xl``; random weights, plain ``torch.nn`` modules, float32) is built on the CPU and moved to
   the GPU inside ``with cudalloc_torch.tag("weights")``; a preallocated KV cache inside
   ``with cudalloc_torch.tag("kv")``.
3. Greedy generation of ``--tokens`` tokens for a batch of random prompts.
4. The allocator is capped a little above what it holds now, so that the next step fits only
   while the model sleeps; ``cudalloc_torch.sleep(["weights", "kv"], offload=["weights"])``.
5. Something else that needs the memory: a tensor of ``--other`` times the tags' bytes, filled
   and reduced, then freed.
6. ``cudalloc_torch.wake(["weights", "kv"])`` (the memory the other work cached goes back to the
   device first, since the wake needs it under the cap), and greedy generation again from the
   same prompts (the KV cache is refilled: its old contents were not kept).

Printed: the tags' bytes, the device memory that came back after the sleep
(``torch.cuda.mem_get_info``), the sleep and wake times with the GB/s of the offloaded weights,
the other work's size, and whether the tokens after the wake equal those before. Exit status 1
if they differ or less than 99% of the tags' memory came back.

Run on a GPU machine, from the repository root, with ``libcudalloc_capi.so`` built
(``cargo build --release -p cudalloc-capi``) or pointed at by ``CUDALLOC_LIB``::

    PYTHONPATH=python python3 python/examples/sleep_wake.py --config xl
"""

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cudalloc_torch  # noqa: E402

# The public GPT-2 configurations (layers, embedding, heads); vocabulary 50257, 1024 positions.
CONFIGS = {"small": (12, 768, 12), "medium": (24, 1024, 16), "large": (36, 1280, 20), "xl": (48, 1600, 25)}
VOCAB, POSITIONS = 50257, 1024


def build(torch, layers, dim, heads):
    """The model classes, defined once torch is imported (after ``enable``)."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x, cache, pos):
            """``x``: [batch, tokens, dim]; ``cache``: [2, batch, heads, POSITIONS, head_dim],
            written at ``pos`` onwards."""
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(dim, dim=2)
            q, k, v = (z.view(b, t, heads, dim // heads).transpose(1, 2) for z in (q, k, v))
            cache[0, :, :, pos:pos + t] = k
            cache[1, :, :, pos:pos + t] = v
            keys, values = cache[0, :, :, :pos + t], cache[1, :, :, :pos + t]
            # A prefill starts at 0 (queries and keys aligned: causal); a decode step has one
            # query that sees every key.
            a = F.scaled_dot_product_attention(q, keys, values, is_causal=t > 1)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, dim))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, dim), nn.Embedding(POSITIONS, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)

        def forward(self, ids, kv, pos):
            """Logits of the last position; ``kv``: [layers, 2, batch, heads, POSITIONS,
            head_dim]."""
            x = self.wte(ids) + self.wpe(torch.arange(pos, pos + ids.shape[1], device=ids.device))
            for i, block in enumerate(self.blocks):
                x = block(x, kv[i], pos)
            return self.ln_f(x[:, -1]) @ self.wte.weight.t()  # tied, as GPT-2's

    return GPT2()


def generate(torch, model, kv, prompts, tokens):
    """Greedy generation: the new token ids, [batch, tokens]."""
    out = []
    with torch.no_grad():
        logits = model(prompts, kv, 0)
        pos = prompts.shape[1]
        for _ in range(tokens):
            nxt = logits.argmax(-1)
            out.append(nxt)
            logits = model(nxt[:, None], kv, pos)
            pos += 1
    return torch.stack(out, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="large")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--other", type=float, default=0.8, help="the other work's tensor, in multiples of the tags' bytes")
    p.add_argument("--policy", default="default", choices=["default", "torch-expandable"])
    args = p.parse_args()
    if args.prompt + args.tokens > POSITIONS:
        p.error(f"--prompt + --tokens must be at most {POSITIONS}")

    cudalloc_torch.enable(conf=f"policy:{args.policy}")
    import torch

    layers, dim, heads = CONFIGS[args.config]
    torch.manual_seed(0)
    cpu_model = build(torch, layers, dim, heads).eval()
    with cudalloc_torch.tag("weights"):
        model = cpu_model.cuda()
    with cudalloc_torch.tag("kv"):
        kv = torch.empty(layers, 2, args.batch, heads, POSITIONS, dim // heads, device="cuda")
    prompts = torch.randint(0, VOCAB, (args.batch, args.prompt), device="cuda")
    before = generate(torch, model, kv, prompts, args.tokens)
    torch.cuda.synchronize()

    tags = cudalloc_torch.tag_stats()
    weights, kv_bytes = tags["weights"]["requested_bytes"], tags["kv"]["requested_bytes"]
    tagged = tags["weights"]["reserved_bytes"] + tags["kv"]["reserved_bytes"]
    gib = 1 << 30
    print(f"model GPT-2 {args.config}: weights {weights / gib:.2f} GiB, KV cache {kv_bytes / gib:.2f} GiB "
          f"(tags reserve {tagged / gib:.2f} GiB), policy {args.policy}, backend {cudalloc_torch.backend()}")

    # Cap the allocator so that the other work fits only while the model sleeps.
    free0, total = torch.cuda.mem_get_info()
    reserved = cudalloc_torch.memory_stats()["reserved_bytes.all.current"]
    other_bytes = int(args.other * tagged)
    cap = reserved + other_bytes // 2
    cudalloc_torch.set_memory_fraction(min(1.0, cap / total))
    print(f"cap {cap / gib:.2f} GiB: held now {reserved / gib:.2f} GiB + other work {other_bytes / gib:.2f} GiB "
          f"does not fit with the model awake")

    t = time.perf_counter()
    cudalloc_torch.sleep(["weights", "kv"], offload=["weights"])
    slept = time.perf_counter() - t
    free1 = torch.cuda.mem_get_info()[0]
    back = free1 - free0
    print(f"sleep {slept * 1e3:.1f} ms ({weights / slept / 1e9:.1f} GB/s of weights offloaded); "
          f"device memory back {back / gib:.2f} GiB = {100 * back / tagged:.1f}% of the tags'")

    other = torch.empty(other_bytes // 4, device="cuda")
    other.normal_()
    total_sum = float(other.sum())
    del other
    torch.cuda.synchronize()
    print(f"other work: {other_bytes / gib:.2f} GiB tensor, sum {total_sum:.1f} (finite: {math.isfinite(total_sum)})")

    t = time.perf_counter()
    cudalloc_torch.wake(["weights", "kv"])
    torch.cuda.synchronize()
    woke = time.perf_counter() - t
    print(f"wake {woke * 1e3:.1f} ms ({weights / woke / 1e9:.1f} GB/s of weights restored)")

    after = generate(torch, model, kv, prompts, args.tokens)
    same = bool(torch.equal(before, after))
    print(f"tokens after the wake: {'identical' if same else 'DIFFERENT'} ({after.numel()} tokens)")
    cudalloc_torch.set_memory_fraction(1.0)
    ok = same and back >= 0.99 * tagged
    if back < 0.99 * tagged:
        print("FAIL: less than 99% of the tags' memory came back after the sleep")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
