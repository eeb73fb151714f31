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
``kv_serve``, ``unet_infer_dynamic`` (kinds of job none of the others is);
``moe_top1_capacity_train``, ``moe_top2_capacity_train``, ``moe_fine_grained_train``,
``moe_infer_dynamic`` (mixture-of-experts routing: expert counts 4 to 64, top-1 to top-6, with
and without a capacity factor) and ``side_stream_prefetch1``/``2``/``3`` (an input pipeline on
a side stream, 1 to 3 batches in flight, pinned host copies, ``record_stream``);
``beam_search_generate``, ``diffusion_train``, ``gnn_train_dynamic``, ``clip_train``,
``rl_generate_train``, ``long_context_train`` and ``speculative_decode`` (a third set of kinds
none of the others is, recorded after the rules were set); ``gpt2_train_cycle`` (the uncapped
run of the acceptance program ``train_near_cap``); ``swin_infer_dynamic``,
``wav2vec2_infer_dynamic``, ``dlrm_train_dynamic`` and ``mamba_train_varlen`` (a fourth set,
``h200_fourth_set.py``, recorded on an H100); ``lora_train_varlen``, ``bart_train_varlen``,
``maskrcnn_train_dynamic`` and ``qwen2_accum_train`` (a fifth set, ``h200_fifth_set.py``);
``segformer_infer_dynamic``, ``dinov2_infer_dynamic``, ``marian_generate`` and
``qwen2_sample_generate`` (a sixth set, ``h200_sixth_set.py``); ``distill_train_varlen``,
``video_infer_dynamic`` and ``train_eval_cycle`` (an eighth set, ``h200_eighth_set.py``; the
seventh is two acceptance programs, ``traces/programs/``); ``speech_ctc_train_varlen`` and
``segmentation_train_multiscale`` (a ninth set, ``h200_ninth_set.py``); ``chunked_prefill_generate``
(a tenth set, ``h200_tenth_set.py``, not recorded yet). When each was recorded:
``docs/archive.md``, and for the fourth to ninth sets ``docs/policies.md`` ("A fourth set" to
"A ninth set") and ``traces/split.json``.
"""
import collections
import math
import random
import sys

import torch

from h200_fifth_set import FIFTH_SET
from h200_sixth_set import SIXTH_SET
from h200_eighth_set import EIGHTH_SET
from h200_ninth_set import NINTH_SET
from h200_tenth_set import TENTH_SET
from h200_fourth_set import FOURTH_SET


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

def _train_moe(seed, d, block, blocks, steps, batch, length, vocab=32000):
    """AdamW steps under bf16 autocast of a language model of ``blocks`` blocks made by
    ``block()``, between an embedding and an output layer of width ``d``; batch and length drawn
    per step."""
    torch.manual_seed(seed); random.seed(seed)
    emb, head = torch.nn.Embedding(vocab, d).cuda(), torch.nn.Linear(d, vocab).cuda()
    layers = torch.nn.ModuleList(block() for _ in range(blocks)).cuda()
    opt = torch.optim.AdamW([*emb.parameters(), *head.parameters(), *layers.parameters()], lr=1e-4)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (random.randint(*batch), random.randint(*length)), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = emb(ids)
            for blk in layers:
                x = blk(x)
            loss = torch.nn.functional.cross_entropy(head(x).flatten(0, 1), ids.flatten())
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

def moe_train_dynamic():
    _train_moe(14, 768, lambda: _MoE(768, 8), 6, 10, (2, 16), (64, 512))

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

class _RoutedMoE(torch.nn.Module):
    """A transformer block whose feed-forward part sends each token to ``top_k`` of ``experts``
    experts. With ``capacity`` (a capacity factor), each expert takes at most
    ``ceil(capacity * tokens * top_k / experts)`` tokens into one fixed-size buffer
    ``[experts, slots, d]`` run as a batched matrix product, and tokens past an expert's slots are
    dropped (as in Switch/GShard, simplified: slots go in (token, choice) order, not first
    choices first); without it every routed token is computed expert by expert (dropless), so
    the sizes change every step. ``shared`` adds an expert every token goes through
    (DeepSeek-MoE). The chosen gates are renormalised to sum to 1 (with top-1 every gate is 1,
    so the router learns nothing through them: these jobs are for their allocations, and the
    traces were recorded so)."""

    def __init__(self, d, heads, experts, top_k, d_ff, capacity=None, shared=False):
        super().__init__()
        self.top_k, self.experts, self.capacity = top_k, experts, capacity
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.router = torch.nn.Linear(d, experts)
        ffn = lambda f: torch.nn.Sequential(torch.nn.Linear(d, f), torch.nn.GELU(), torch.nn.Linear(f, d))
        self.shared = ffn(4 * d_ff) if shared else None
        if capacity is None:
            self.ffns = torch.nn.ModuleList(ffn(d_ff) for _ in range(experts))
        else:
            self.w1 = torch.nn.Parameter(torch.randn(experts, d, d_ff) * d ** -0.5)
            self.w2 = torch.nn.Parameter(torch.randn(experts, d_ff, d) * d_ff ** -0.5)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x).flatten(0, 1)
        weights, chosen = torch.topk(self.router(h).softmax(-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = self.shared(h).to(h.dtype) if self.shared is not None else torch.zeros_like(h)
        if self.capacity is None:
            for e, ffn in enumerate(self.ffns):
                rows, slot = torch.where(chosen == e)
                if rows.numel():
                    out = out.index_add(0, rows, (ffn(h[rows]) * weights[rows, slot, None]).to(out.dtype))
        else:
            out = out + self._dispatch(h, chosen.flatten(), weights.flatten())
        return x + out.view_as(x)

    def _dispatch(self, h, expert, weight):
        """The capacity path: place, compute all experts at once, combine."""
        tokens = h.shape[0]
        slots = math.ceil(self.capacity * tokens * self.top_k / self.experts)
        onehot = torch.nn.functional.one_hot(expert, self.experts)
        slot = (onehot.cumsum(0) - 1).gather(1, expert[:, None]).squeeze(1)
        keep = slot < slots
        token = torch.arange(tokens, device=h.device).repeat_interleave(self.top_k)[keep]
        expert, slot = expert[keep], slot[keep]
        buf = h.new_zeros(self.experts, slots, h.shape[1])
        buf[expert, slot] = h[token]
        y = torch.bmm(torch.nn.functional.gelu(torch.bmm(buf, self.w1)), self.w2)
        return torch.zeros_like(h).index_add(0, token, (y[expert, slot] * weight[keep, None]).to(h.dtype))

def moe_top1_capacity_train():
    """Switch-style: 4 experts, top-1, capacity factor 1.25 (tokens past it dropped)."""
    _train_moe(21, 1024, lambda: _RoutedMoE(1024, 16, 4, 1, 4096, capacity=1.25), 4, 12, (4, 24), (128, 1024))

def moe_top2_capacity_train():
    """GShard-style: 16 experts, top-2, capacity factor 2.0."""
    _train_moe(22, 640, lambda: _RoutedMoE(640, 10, 16, 2, 2560, capacity=2.0), 6, 12, (1, 32), (32, 768))

def moe_fine_grained_train():
    """DeepSeek-style: 64 small experts, top-6, dropless, plus a shared expert."""
    _train_moe(23, 512, lambda: _RoutedMoE(512, 8, 64, 6, 352, shared=True), 4, 10, (2, 12), (64, 1536))

def moe_infer_dynamic():
    """fp16 inference of a dropless 32-expert top-4 model on requests of random batch and length."""
    torch.manual_seed(24); random.seed(24)
    d, vocab = 1024, 32000
    emb = torch.nn.Embedding(vocab, d).cuda().half()
    layers = torch.nn.ModuleList(_RoutedMoE(d, 16, 32, 4, 1024) for _ in range(8)).cuda().half().eval()
    with torch.no_grad():
        for _ in range(40):
            x = emb(torch.randint(0, vocab, (random.randint(1, 48), random.randint(16, 1024)), device="cuda"))
            for blk in layers:
                x = blk(x)
    torch.cuda.synchronize()

def _side_stream_train(depth, model, batches, loss_of):
    """Training fed by a loader on a side stream with ``depth`` batches in flight: each batch
    (from ``batches``, tuples of pinned host tensors) is copied to the device on the side stream
    and, for uint8 images, scaled there; the main stream then waits for it and marks its tensors
    with ``record_stream`` before the step, as prefetching loaders do. With ``depth`` 1 nothing
    is fetched ahead: each batch is copied on the side stream just before its step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()

    def load(host):
        with torch.cuda.stream(side):
            dev = [t.to("cuda", non_blocking=True) for t in host]
            if dev[0].dtype == torch.uint8:
                dev[0] = dev[0].float().div_(255).sub_(0.5)
            ready = torch.cuda.Event()
            ready.record(side)
        return dev, ready

    def step(dev, ready):
        main.wait_event(ready)
        for t in dev:
            t.record_stream(main)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model, *dev)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

    queue = collections.deque()
    for host in batches:
        queue.append(load(host))
        if len(queue) == depth:
            step(*queue.popleft())
    while queue:
        step(*queue.popleft())
    torch.cuda.synchronize()

def _pinned_images(count, batch, side):
    for _ in range(count):
        b, r = random.randint(*batch), 32 * random.randint(*side)
        yield (torch.randint(0, 256, (b, 3, r, r), dtype=torch.uint8).pin_memory(),
               torch.randint(0, 1000, (b,)).pin_memory())

def side_stream_prefetch1():
    """ResNet-50 on uint8 images of random size, one batch in flight."""
    import torchvision
    torch.manual_seed(25); random.seed(25)
    m = torchvision.models.resnet50(weights=None).cuda()
    _side_stream_train(1, m, _pinned_images(16, (32, 128), (4, 9)),
                       lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))

def side_stream_prefetch2():
    """A GPT-2-style model (1024 wide, 8 layers) on token batches of random length, two in flight."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(26); random.seed(26)
    m = GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=1024, n_head=16)).cuda()
    ids = ((torch.randint(0, 50000, (random.randint(2, 12), random.randint(64, 1024))).pin_memory(),)
           for _ in range(16))
    _side_stream_train(2, m, ids, lambda m, x: m(input_ids=x, labels=x).loss)

def side_stream_prefetch3():
    """EfficientNet-B0 on uint8 images of random size, three batches in flight."""
    import torchvision
    torch.manual_seed(27); random.seed(27)
    m = torchvision.models.efficientnet_b0(weights=None).cuda()
    _side_stream_train(3, m, _pinned_images(20, (16, 160), (4, 10)),
                       lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y))


def beam_search_generate():
    """Beam search (4 beams): each step reorders the key-value cache by the surviving beams."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(22); random.seed(22)
    m = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16)).cuda().half().eval()
    with torch.no_grad():
        for _ in range(8):
            b = random.randint(1, 8); L = random.randint(16, 384); new = random.randint(16, 64)
            ids = torch.randint(0, 50000, (b, L), device="cuda")
            m.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()

def diffusion_train():
    """A denoising U-Net trained on latents of random batch and resolution, a noise level per sample."""
    torch.manual_seed(23); random.seed(23)
    m = _UNet(c=96).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for _ in range(16):
        b = random.randint(2, 16); r = 16 * random.randint(3, 8)
        x0 = torch.randn(b, 4, r, r, device="cuda"); noise = torch.randn_like(x0)
        t = torch.rand(b, 1, 1, 1, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(m(t.sqrt() * x0 + (1 - t).sqrt() * noise), noise)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

def gnn_train_dynamic():
    """A 3-layer graph network on random graphs of changing size: each layer gathers messages
    along the edges and sums them into the nodes (``index_add_``); node classification."""
    torch.manual_seed(24); random.seed(24)
    d, classes = 256, 40
    inp, head = torch.nn.Linear(128, d).cuda(), torch.nn.Linear(d, classes).cuda()
    layers = torch.nn.ModuleList(torch.nn.Linear(2 * d, d) for _ in range(3)).cuda()
    opt = torch.optim.AdamW([*inp.parameters(), *head.parameters(), *layers.parameters()], lr=1e-3)
    for _ in range(20):
        n = random.randint(20_000, 300_000); e = n * random.randint(4, 12)
        src = torch.randint(0, n, (e,), device="cuda"); dst = torch.randint(0, n, (e,), device="cuda")
        h = inp(torch.randn(n, 128, device="cuda"))
        deg = torch.zeros(n, device="cuda").index_add_(0, dst, torch.ones(e, device="cuda")).clamp_(min=1)
        for lin in layers:
            agg = torch.zeros_like(h).index_add_(0, dst, h[src]) / deg.unsqueeze(1)
            h = torch.relu(lin(torch.cat([h, agg], dim=1)))
        loss = torch.nn.functional.cross_entropy(head(h), torch.randint(0, classes, (n,), device="cuda"))
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

def clip_train():
    """Contrastive image-text training (CLIP's ViT-B/32 and text towers) at changing batch sizes."""
    from transformers import CLIPConfig, CLIPModel
    torch.manual_seed(25); random.seed(25)
    m = CLIPModel(CLIPConfig()).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for _ in range(10):
        b = random.choice([64, 128, 192, 256]); L = random.randint(16, 77)
        ids = torch.randint(0, 49408, (b, L), device="cuda")
        px = torch.randn(b, 3, 224, 224, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=ids, pixel_values=px, return_loss=True).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

def rl_generate_train():
    """Rounds of sampled completions (no gradients, a key-value cache) followed by training on
    them with a reward per sequence, on one model, as RL fine-tuning loops alternate."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(26); random.seed(26)
    m = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12)).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    for _ in range(5):
        b = random.randint(8, 32); L = random.randint(32, 256); new = random.randint(32, 128)
        ids = torch.randint(0, 50000, (b, L), device="cuda")
        m.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            seqs = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=True, top_k=50, pad_token_id=0)
        m.train()
        reward = torch.randn(seqs.shape[0], device="cuda")
        for s, r in zip(seqs.split(8), reward.split(8)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp = torch.log_softmax(m(input_ids=s).logits[:, L - 1:-1].float(), -1)
                loss = -(logp.gather(-1, s[:, L:].unsqueeze(-1)).squeeze(-1).sum(1) * r).mean()
            loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

def long_context_train():
    """A Llama-style model trained on one or two long sequences a step (2k-16k tokens), with
    activation checkpointing."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(27); random.seed(27)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=16384)
    m = LlamaForCausalLM(cfg).cuda()
    m.gradient_checkpointing_enable()
    m.config.use_cache = False
    _train_lm(m, 8, (1, 2), (2048, 16384), 32000, torch.bfloat16)

def speculative_decode():
    """Speculative decoding: a 2-layer draft proposes 4 tokens (its own ``generate``), the
    24-layer target checks them in one forward over the sequence, and the agreeing prefix and
    the target's next token are kept."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(28); random.seed(28)
    target = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16)).cuda().half().eval()
    draft = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=1024, n_head=16)).cuda().half().eval()
    with torch.no_grad():
        for _ in range(6):
            b = random.randint(1, 8)
            seq = torch.randint(0, 50000, (b, random.randint(16, 256)), device="cuda")
            goal = seq.shape[1] + random.randint(32, 96)
            while seq.shape[1] < goal:
                n = seq.shape[1]
                prop = draft.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=4,
                                      min_new_tokens=4, do_sample=False, pad_token_id=0)
                best = target(input_ids=prop).logits[:, n - 1:-1].argmax(-1)
                agree = int((best == prop[:, n:]).all(0).int().cumprod(0).sum())
                seq = torch.cat([prop[:, :n + agree], best[:, agree:agree + 1]], dim=1)
    torch.cuda.synchronize()


def gpt2_train_cycle():
    """The uncapped run of the acceptance program ``train_near_cap``: a fresh GPT-2 trained 16
    steps whose sequence lengths cycle twice through eight values, the longest first."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config()).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for step, length in enumerate((512, 128, 384, 256, 448, 192, 320, 64) * 2):
        torch.manual_seed(100 + step)
        ids = torch.randint(0, 50257, (8, length), device="cuda")
        torch.cuda.synchronize()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        float(loss)
    torch.cuda.synchronize()


WORKLOADS = {name: fn for name, fn in globals().items() if callable(fn) and not name.startswith("_")
             and fn.__module__ == __name__ and name != "main"}
WORKLOADS.update(FOURTH_SET)
WORKLOADS.update(FIFTH_SET)
WORKLOADS.update(SIXTH_SET)
WORKLOADS.update(EIGHTH_SET)
WORKLOADS.update(NINTH_SET)
WORKLOADS.update(TENTH_SET)


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in WORKLOADS:
        sys.exit(f"usage: {sys.argv[0]} WORKLOAD, one of: {', '.join(sorted(WORKLOADS))}")
    WORKLOADS[sys.argv[1]]()


if __name__ == "__main__":
    main()
