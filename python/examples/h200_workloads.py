#!/usr/bin/env python3
"""The workloads behind ``traces/h200/``: PyTorch jobs recorded on an H200 to test cudalloc's
``default`` policy on traces it was not tuned on. Models are built from configs with random
weights (nothing is downloaded); shapes come from fixed seeds.

Record one (from the repository root, on a machine with a GPU, PyTorch, torchvision and
transformers)::

    PYTHONPATH=python python3 -m cudalloc_trace.record --out traces/h200/vit_train.trace.csv.gz \
        -- python/examples/h200_workloads.py vit_train

Workloads: ``vit_train``, ``gpt2_generate``, ``fcn_train`` (recorded in the second session);
``roberta_dynamic``, ``t5_generate``, ``resnet_infer_dynamic``, ``gpt2_train_varlen``,
``bert_train_dynamic`` (dynamic shapes, the class ``bert_dynamic`` belongs to);
``llama_infer_dynamic``, ``vit_infer_dynamic`` (recorded in the fifth session, after its changes,
to check them on jobs they were not measured on); ``mistral_train_varlen``, ``opt_generate``,
``deberta_dynamic``, ``convnext_train_dynamic``, ``deeplab_infer_dynamic`` (sixth session, the
same kind of check).
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

WORKLOADS = {name: fn for name, fn in globals().items() if callable(fn) and not name.startswith("_")
             and fn.__module__ == __name__ and name != "main"}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in WORKLOADS:
        sys.exit(f"usage: {sys.argv[0]} WORKLOAD, one of: {', '.join(sorted(WORKLOADS))}")
    WORKLOADS[sys.argv[1]]()


if __name__ == "__main__":
    main()
