#!/usr/bin/env python3
"""The workloads behind ``traces/h200/``: PyTorch jobs recorded on an H200 to test cudalloc's
``default`` policy on traces it was not tuned on. Models are built from configs with random
weights (nothing is downloaded); shapes come from fixed seeds.

Record one (from the repository root, on a machine with a GPU, PyTorch, torchvision and
transformers)::

    PYTHONPATH=python python3 -m cudalloc_trace.record --out traces/h200/vit_train.trace.csv.gz \
        -- python/examples/h200_workloads.py vit_train

Workloads: ``vit_train``, ``gpt2_generate``, ``fcn_train``; ``roberta_dynamic``,
``t5_generate``, ``resnet_infer_dynamic``, ``gpt2_train_varlen``, ``bert_train_dynamic``
(dynamic shapes, the class ``bert_dynamic`` belongs to); ``llama_infer_dynamic``,
``vit_infer_dynamic``, ``mistral_train_varlen``, ``opt_generate``, ``deberta_dynamic``,
``convnext_train_dynamic``, ``deeplab_infer_dynamic`` (recorded to check the ``default``
policy's rules on jobs they were not measured on); ``fasterrcnn_infer_dynamic``,
``moe_train_dynamic``, ``whisper_generate``, ``lstm_train_varlen``, ``gpt2_checkpoint_train``,
``kv_serve``, ``unet_infer_dynamic`` (kinds of job none of the others is). When each was
recorded: ``docs/archive.md``.
"""
import random
import sys

import torch


def vit_train():
    import torchvision
    torch.manual_seed(0)
    m = torchvision.models.vit_b_16(weights=None).cuda()
    _classify_steps(m, [(bs, 224) for bs in [32, 48, 16, 40]])

def _classify_steps(m, shapes):
    """AdamW steps of a 1,000-class image classifier under bf16 autocast, one per (batch, side)."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for bs, r in shapes:
        x = torch.randn(bs, 3, r, r, device="cuda")
        y = torch.randint(0, 1000, (bs,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

def gpt2_generate():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0); random.seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12)).cuda().half().eval()
    with torch.no_grad():
        for _ in range(8):
            b = random.randint(1, 16); L = random.randint(16, 512)
            ids = torch.randint(0, 50000, (b, L), device="cuda")
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=random.randint(8, 64), do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()

def fcn_train():
    torch.manual_seed(0)
    import torchvision
    m = torchvision.models.segmentation.fcn_resnet50(weights=None, weights_backbone=None, num_classes=21).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    for bs, hw in [(8, 384), (4, 512), (12, 256), (6, 448)]:
        x = torch.randn(bs, 3, hw, hw, device="cuda")
        y = torch.randint(0, 21, (bs, hw, hw), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(x)["out"], y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def roberta_dynamic():
    from transformers import RobertaConfig, RobertaModel
    torch.manual_seed(1); random.seed(1)
    _encode_batches(RobertaModel(RobertaConfig(max_position_embeddings=514)), 50000)

def _encode_batches(model, vocab):
    """fp16 inference of a token encoder on 40 batches of random batch size and length."""
    m = model.cuda().half().eval()
    with torch.no_grad():
        for _ in range(40):
            b = random.randint(1, 32); L = random.randint(16, 512)
            ids = torch.randint(0, vocab, (b, L), device="cuda")
            m(input_ids=ids, attention_mask=torch.ones_like(ids))
    torch.cuda.synchronize()

def t5_generate():
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(2); random.seed(2)
    m = T5ForConditionalGeneration(T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, decoder_start_token_id=0)).cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        for _ in range(8):
            b = random.randint(1, 16); L = random.randint(32, 512)
            ids = torch.randint(0, 32000, (b, L), device="cuda")
            m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=random.randint(8, 48), do_sample=False)
    torch.cuda.synchronize()

def resnet_infer_dynamic():
    import torchvision
    torch.manual_seed(3); random.seed(3)
    m = torchvision.models.resnet50(weights=None).cuda().half().eval()
    with torch.no_grad():
        for _ in range(40):
            b = random.randint(1, 64); r = 32 * random.randint(4, 10)
            m(torch.randn(b, 3, r, r, device="cuda", dtype=torch.half))
    torch.cuda.synchronize()

def _train_lm(m, steps, batch, length, vocab, dtype):
    """AdamW steps of a token model on random ids, `batch` and `length` drawn per step."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for _ in range(steps):
        b = random.randint(*batch); L = random.randint(*length)
        ids = torch.randint(0, vocab, (b, L), device="cuda")
        with torch.autocast("cuda", dtype=dtype):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

def gpt2_train_varlen():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(4); random.seed(4)
    _train_lm(GPT2LMHeadModel(GPT2Config()).cuda(), 6, (2, 8), (128, 1024), 50000, torch.bfloat16)

def bert_train_dynamic():
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(5); random.seed(5)
    _train_lm(BertForMaskedLM(BertConfig()).cuda(), 8, (2, 32), (32, 512), 30000, torch.float16)

def llama_infer_dynamic():
    from transformers import LlamaConfig, LlamaModel
    torch.manual_seed(6); random.seed(6)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048)
    m = LlamaModel(cfg).cuda().half().eval()
    with torch.no_grad():
        for _ in range(40):
            b = random.randint(1, 16); L = random.randint(32, 1024)
            m(input_ids=torch.randint(0, 32000, (b, L), device="cuda"))
    torch.cuda.synchronize()

def vit_infer_dynamic():
    import torchvision
    torch.manual_seed(7); random.seed(7)
    m = torchvision.models.vit_b_16(weights=None).cuda().half().eval()
    with torch.no_grad():
        for _ in range(40):
            m(torch.randn(random.randint(1, 64), 3, 224, 224, device="cuda", dtype=torch.half))
    torch.cuda.synchronize()

def mistral_train_varlen():
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(8); random.seed(8)
    cfg = MistralConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=16,
                        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    _train_lm(MistralForCausalLM(cfg).cuda(), 8, (2, 8), (128, 1024), 32000, torch.bfloat16)

def opt_generate():
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(9); random.seed(9)
    cfg = OPTConfig(hidden_size=1024, ffn_dim=4096, num_hidden_layers=24, num_attention_heads=16,
                    word_embed_proj_dim=1024, max_position_embeddings=2048)
    m = OPTForCausalLM(cfg).cuda().half().eval()
    with torch.no_grad():
        for _ in range(8):
            b = random.randint(1, 16); L = random.randint(16, 512)
            ids = torch.randint(3, 50000, (b, L), device="cuda")
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=random.randint(8, 48), do_sample=False, pad_token_id=1)
    torch.cuda.synchronize()

def deberta_dynamic():
    from transformers import DebertaV2Config, DebertaV2Model
    torch.manual_seed(10); random.seed(10)
    _encode_batches(DebertaV2Model(DebertaV2Config(vocab_size=32000)), 32000)

def convnext_train_dynamic():
    import torchvision
    torch.manual_seed(11); random.seed(11)
    m = torchvision.models.convnext_tiny(weights=None).cuda()
    _classify_steps(m, [(random.randint(8, 48), 32 * random.randint(5, 8)) for _ in range(8)])

def deeplab_infer_dynamic():
    import torchvision
    torch.manual_seed(12); random.seed(12)
    m = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=21).cuda().half().eval()
    with torch.no_grad():
        for _ in range(30):
            b = random.randint(1, 16); r = 32 * random.randint(8, 16)
            m(torch.randn(b, 3, r, r, device="cuda", dtype=torch.half))
    torch.cuda.synchronize()

def fasterrcnn_infer_dynamic():
    import torchvision
    torch.manual_seed(13); random.seed(13)
    m = torchvision.models.detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None).cuda().eval()
    with torch.no_grad():
        for _ in range(20):
            images = [torch.rand(3, random.randint(300, 900), random.randint(300, 900), device="cuda")
                      for _ in range(random.randint(1, 4))]
            m(images)
    torch.cuda.synchronize()

class _MoE(torch.nn.Module):
    """A transformer block whose feed-forward part is 8 experts with top-2 routing: how many
    tokens each expert gets changes from step to step."""

    def __init__(self, d, experts):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(d, 16, batch_first=True)
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.router = torch.nn.Linear(d, experts)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
            for _ in range(experts))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x).flatten(0, 1)
        weights, chosen = torch.topk(self.router(h).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, (expert(h[rows]) * weights[rows, slot, None]).to(out.dtype))
        return x + out.view_as(x)

def moe_train_dynamic():
    torch.manual_seed(14); random.seed(14)
    d, vocab = 768, 32000
    emb, head = torch.nn.Embedding(vocab, d).cuda(), torch.nn.Linear(d, vocab).cuda()
    blocks = torch.nn.ModuleList(_MoE(d, 8) for _ in range(6)).cuda()
    params = [*emb.parameters(), *head.parameters(), *blocks.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    for _ in range(10):
        b = random.randint(2, 16); L = random.randint(64, 512)
        ids = torch.randint(0, vocab, (b, L), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = emb(ids)
            for blk in blocks:
                x = blk(x)
            loss = torch.nn.functional.cross_entropy(head(x).flatten(0, 1), ids.flatten())
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

def whisper_generate():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    from transformers.generation.utils import GenerationMixin
    torch.manual_seed(15); random.seed(15)
    cfg = WhisperConfig(d_model=768, encoder_layers=12, decoder_layers=12, encoder_attention_heads=12,
                        decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072)
    m = WhisperForConditionalGeneration(cfg).cuda().half().eval()
    with torch.no_grad():
        for _ in range(8):
            feats = torch.randn(random.randint(1, 16), cfg.num_mel_bins, 3000, device="cuda", dtype=torch.half)
            # The generic greedy loop: Whisper's own generate wants a trained model's language
            # and task tokens.
            GenerationMixin.generate(m, input_features=feats, max_new_tokens=random.randint(8, 64), do_sample=False)
    torch.cuda.synchronize()

def lstm_train_varlen():
    torch.manual_seed(16); random.seed(16)
    vocab = 32000
    emb = torch.nn.Embedding(vocab, 1024).cuda()
    lstm = torch.nn.LSTM(1024, 1024, num_layers=3, batch_first=True).cuda()
    head = torch.nn.Linear(1024, vocab).cuda()
    opt = torch.optim.AdamW([*emb.parameters(), *lstm.parameters(), *head.parameters()], lr=1e-4)
    for _ in range(12):
        b = random.randint(4, 64); L = random.randint(32, 256)
        ids = torch.randint(0, vocab, (b, L), device="cuda")
        loss = torch.nn.functional.cross_entropy(head(lstm(emb(ids))[0]).flatten(0, 1), ids.flatten())
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

def gpt2_checkpoint_train():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(17); random.seed(17)
    m = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16)).cuda()
    m.gradient_checkpointing_enable()
    m.config.use_cache = False
    _train_lm(m, 6, (2, 8), (128, 1024), 50000, torch.bfloat16)

def kv_serve():
    """Decoding with continuous batching: requests join and leave, each with its own key-value
    cache per layer grown by one token a step (torch.cat), as simple servers do."""
    torch.manual_seed(18); random.seed(18)
    layers, heads, hd, d = 12, 16, 64, 1024
    qkv = [torch.nn.Linear(d, 3 * d).cuda().half() for _ in range(layers)]
    mlp = [torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)).cuda().half()
           for _ in range(layers)]
    active = []  # (tokens left, per-layer [k, v], hidden state)
    with torch.no_grad():
        for step in range(200):
            while len(active) < 8 and random.random() < 0.3:
                prompt = random.randint(16, 512)
                h = torch.randn(1, prompt, d, device="cuda", dtype=torch.half)
                cache = []
                for l in range(layers):
                    k, v, _ = qkv[l](h).split(d, dim=-1)
                    cache.append([k.view(1, prompt, heads, hd).transpose(1, 2).contiguous(),
                                  v.view(1, prompt, heads, hd).transpose(1, 2).contiguous()])
                active.append([random.randint(16, 256), cache, h[:, -1:]])
            for req in active:
                h = req[2]
                for l in range(layers):
                    q, k, v = (t.view(1, 1, heads, hd).transpose(1, 2) for t in qkv[l](h).split(d, dim=-1))
                    req[1][l][0] = torch.cat([req[1][l][0], k], dim=2)
                    req[1][l][1] = torch.cat([req[1][l][1], v], dim=2)
                    a = torch.nn.functional.scaled_dot_product_attention(q, req[1][l][0], req[1][l][1])
                    h = h + a.transpose(1, 2).reshape(1, 1, d)
                    h = h + mlp[l](h)
                req[2] = h
                req[0] -= 1
            active = [r for r in active if r[0] > 0]
    torch.cuda.synchronize()

class _UNet(torch.nn.Module):
    """A small convolutional U-Net (four levels, skip connections)."""

    def __init__(self, c=64):
        super().__init__()
        def block(i, o):
            return torch.nn.Sequential(torch.nn.Conv2d(i, o, 3, padding=1), torch.nn.GroupNorm(8, o), torch.nn.SiLU(),
                                       torch.nn.Conv2d(o, o, 3, padding=1), torch.nn.GroupNorm(8, o), torch.nn.SiLU())
        chans = [c, 2 * c, 4 * c, 8 * c]
        self.inp = torch.nn.Conv2d(4, c, 3, padding=1)
        self.down = torch.nn.ModuleList(block(a, b) for a, b in zip([c] + chans[:-1], chans))
        self.up = torch.nn.ModuleList(block(2 * b, a) for a, b in zip([c] + chans[:-1], chans))
        self.out = torch.nn.Conv2d(c, 4, 3, padding=1)

    def forward(self, x):
        x, skips = self.inp(x), []
        for blk in self.down:
            x = blk(x); skips.append(x); x = torch.nn.functional.avg_pool2d(x, 2)
        for blk, s in zip(reversed(self.up), reversed(skips)):
            x = torch.nn.functional.interpolate(x, scale_factor=2.0)
            x = blk(torch.cat([x[:, :s.shape[1]], s], dim=1))
        return self.out(x)

def unet_infer_dynamic():
    torch.manual_seed(19); random.seed(19)
    m = _UNet().cuda().half().eval()
    with torch.no_grad():
        for _ in range(20):
            b = random.randint(1, 8); r = 16 * random.randint(4, 12)
            x = torch.randn(b, 4, r, r, device="cuda", dtype=torch.half)
            for _ in range(5):  # a few denoising steps on the same latents
                x = x - 0.1 * m(x)
    torch.cuda.synchronize()

WORKLOADS = {name: fn for name, fn in globals().items() if callable(fn) and not name.startswith("_")
             and fn.__module__ == __name__ and name != "main"}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in WORKLOADS:
        sys.exit(f"usage: {sys.argv[0]} WORKLOAD, one of: {', '.join(sorted(WORKLOADS))}")
    WORKLOADS[sys.argv[1]]()


if __name__ == "__main__":
    main()
