"""A tenth set of workloads for ``h200_workloads.py``, not recorded yet: a kind of job no trace of
``traces/h200/`` is. Its recording on an H100 did not end within the 40 s it was given
(2026-12-07); record it with a longer ``RECORD_TIMEOUT`` (``tools/gpu-record.sh``), then hold it
out in ``traces/split.json``. Until its trace is in ``traces/h200/``, it stays out of
``torch_models.H200_FILES`` (whose test pairs every workload there with its trace). The model is
built from a config with random weights; shapes come from fixed seeds.

- ``chunked_prefill_generate``: a Llama-style model (grouped-query attention) that reads prompts
  of 512-6,144 tokens in chunks of 256-1,024 (the last one the rest; a growing key-value cache),
  then decodes 16-64 tokens greedily, batches of 1-4.
"""
import random

import torch


def chunked_prefill_generate():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(92); random.seed(92)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=8192)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for _ in range(10):
            b = random.randint(1, 4); prompt = random.randint(512, 6144)
            ids = torch.randint(0, cfg.vocab_size, (b, prompt), device="cuda")
            cache, at = None, 0
            while at < prompt:
                n = min(random.choice((256, 512, 1024)), prompt - at)
                out = m(ids[:, at:at + n], past_key_values=cache, use_cache=True)
                cache, at = out.past_key_values, at + n
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(random.randint(16, 64)):
                out = m(token, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                token = out.logits[:, -1:].argmax(-1)
            del cache, out, token
    torch.cuda.synchronize()


TENTH_SET = {f.__name__: f for f in (chunked_prefill_generate,)}
