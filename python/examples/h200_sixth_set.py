"""A sixth set of workloads for ``h200_workloads.py``: inference and generation, the kinds of
job the ``default`` policy does worst on, recorded after every rule was set so that their
figures are out of sample. Models are built from configs with random weights; shapes come from
fixed seeds.

- ``segformer_infer_dynamic``: semantic segmentation (SegFormer with a MiT-b2 encoder) in fp16
  on batches of random count of images of random height and width;
- ``dinov2_infer_dynamic``: a ViT-L/14 feature extractor (DINOv2's layout, position embeddings
  interpolated to each input) in bf16 on batches of random size and side;
- ``marian_generate``: translation by beam search (Marian at its config's defaults, 4 beams)
  on batches of random size and source length;
- ``qwen2_sample_generate``: sampled generation (top-p, temperature, several sequences per
  prompt) from a Qwen2-style model in bf16 (Qwen2-1.5B's shapes with the output layer untied,
  1.8B parameters), prompts of random length.
"""
import random

import torch


def segformer_infer_dynamic():
    from transformers import SegformerConfig, SegformerForSemanticSegmentation
    torch.manual_seed(60); random.seed(60)
    cfg = SegformerConfig(depths=[3, 4, 6, 3], hidden_sizes=[64, 128, 320, 512],
                          decoder_hidden_size=768, num_labels=150)
    m = SegformerForSemanticSegmentation(cfg).cuda().half().eval()
    with torch.no_grad():
        for _ in range(24):
            b = random.randint(1, 8)
            h = 32 * random.randint(8, 32); w = 32 * random.randint(8, 32)
            x = torch.randn(b, 3, h, w, device="cuda", dtype=torch.float16)
            logits = m(pixel_values=x).logits
            up = torch.nn.functional.interpolate(logits, size=(h, w), mode="bilinear")
            up.argmax(1)
    torch.cuda.synchronize()


def dinov2_infer_dynamic():
    from transformers import Dinov2Config, Dinov2Model
    torch.manual_seed(61); random.seed(61)
    cfg = Dinov2Config(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16)
    m = Dinov2Model(cfg).cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        for _ in range(24):
            b = random.randint(1, 16); side = 14 * random.randint(16, 37)
            x = torch.randn(b, 3, side, side, device="cuda", dtype=torch.bfloat16)
            out = m(pixel_values=x)
            out.pooler_output.float().norm(dim=-1)
    torch.cuda.synchronize()


def marian_generate():
    from transformers import MarianConfig, MarianMTModel
    torch.manual_seed(62); random.seed(62)
    cfg = MarianConfig()
    m = MarianMTModel(cfg).cuda().half().eval()
    with torch.no_grad():
        for _ in range(8):
            b = random.randint(1, 16); length = random.randint(16, 256)
            ids = torch.randint(1, cfg.vocab_size - 1, (b, length), device="cuda")
            new = random.randint(16, 96)
            m.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4,
                       max_new_tokens=new, min_new_tokens=new // 2,
                       decoder_start_token_id=cfg.decoder_start_token_id,
                       pad_token_id=cfg.pad_token_id, eos_token_id=cfg.eos_token_id)
    torch.cuda.synchronize()


def qwen2_sample_generate():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(63); random.seed(63)
    cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)
    m = Qwen2ForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for _ in range(3):
            b = random.randint(1, 8); length = random.randint(32, 1024)
            ids = torch.randint(0, cfg.vocab_size, (b, length), device="cuda")
            new = random.randint(32, 96)
            m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_p=0.9,
                       temperature=0.8, num_return_sequences=random.randint(1, 4),
                       max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    torch.cuda.synchronize()


SIXTH_SET = {f.__name__: f for f in (segformer_infer_dynamic, dinov2_infer_dynamic,
                                     marian_generate, qwen2_sample_generate)}
