//! The batched decode step that `--graphs` captures: one token for each of `batch` sequences,
//! written so that a CUDA graph can replay it.
//!
//! A graph replays the launches it captured with the arguments and addresses they had, and no
//! host code runs in between. So everything a step reads or writes from one step to the next
//! lives in [`Slots`], static buffers allocated once from the eager allocator before any
//! capture: the tokens to feed (`ids`, which the step overwrites with its greedy choice), each
//! sequence's position (`pos`, which the step advances by one), and the KV cache (one
//! `[SLOTS, max_len, hidden]` pair per layer, sequence `r` in rows `[r * max_len, (r + 1) *
//! max_len)`). Positions are read on the device (`Kernels::rope_at`, `store_rows`,
//! `decode_attention`), so no launch argument depends on how long the sequences are. The
//! step's own buffers (activations, attention scores, logits) come from the allocator passed
//! as `scratch`, all freed before it returns: the eager allocator when it runs eagerly, the
//! graph pool when it is captured. The step never synchronizes, never copies to or from the
//! host, and makes no driver call of its own besides launches; the host reads the tokens
//! between steps (one copy of `ids` per step, eager and replayed alike).
//!
//! Prefill stays eager and per sequence (`Model::forward`); [`prefill`] copies each sequence's
//! cache into its slot.

use super::mem::{Mem, PoolMem, Result};
use super::model::{linear, Model};
use cudalloc::CachingAllocator;
use cudalloc_sys::buffer::cudarc::driver::CudaStream;
use cudalloc_sys::buffer::Buffer;
use cudalloc_sys::ops::{gemm_f32, DecodeShape};
use cudalloc_sys::CudaDevice;
use std::sync::Arc;

/// Sequences the static buffers hold: the largest batch captured.
pub const SLOTS: usize = 32;

/// The batch sizes captured, one graph each.
pub const BATCHES: [usize; 6] = [1, 2, 4, 8, 16, 32];

/// The static state of batched decoding (see the module docs).
pub struct Slots {
    /// Rows of cache per sequence: the longest prompt plus the tokens to generate.
    pub max_len: usize,
    /// The token each sequence feeds to the next step (`[SLOTS]`).
    pub ids: Buffer<u32>,
    /// Each sequence's position: the cache rows it holds (`[SLOTS]`).
    pub pos: Buffer<u32>,
    /// Keys and values of each layer, `[SLOTS, max_len, hidden]` each.
    pub cache: Vec<(Buffer<f32>, Buffer<f32>)>,
    /// What [`Slots::reset`] puts back: the token after each prompt, and its length.
    pub first: Vec<u32>,
    pub start: Vec<u32>,
}

impl Slots {
    /// Static buffers for `model`, from its eager allocator.
    pub fn new(model: &Model<PoolMem>, max_len: usize) -> Result<Slots> {
        let (m, d) = (&model.mem, model.shape.hidden);
        let (alloc, st) = (m.allocator(), m.stream());
        let rows = SLOTS * max_len * d;
        let cache = (0..model.shape.layers)
            .map(|_| Ok((alloc.buffer(rows, st)?, alloc.buffer(rows, st)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Slots {
            max_len,
            ids: alloc.buffer(SLOTS, st)?,
            pos: alloc.buffer(SLOTS, st)?,
            cache,
            first: vec![0; SLOTS],
            start: vec![0; SLOTS],
        })
    }

    /// Every sequence back to the end of its prompt: the cache rows past it are written again
    /// before they are read, so only `ids` and `pos` need copying.
    pub fn reset(&mut self, st: &Arc<CudaStream>) -> Result<()> {
        st.memcpy_htod(&self.first, &mut self.ids)?;
        st.memcpy_htod(&self.start, &mut self.pos)?;
        Ok(())
    }

    /// The tokens the last step chose, for the first `batch` sequences (waits for the stream).
    pub fn chosen(&self, st: &Arc<CudaStream>, batch: usize) -> Result<Vec<u32>> {
        let mut ids = st.clone_dtoh(&self.ids)?;
        ids.truncate(batch);
        Ok(ids)
    }
}

/// Prefills `prompts` (at most [`SLOTS`]) one by one with `Model::forward` and copies each
/// one's cache into its slot; sets what [`Slots::reset`] restores (then call it).
pub fn prefill(model: &Model<PoolMem>, slots: &mut Slots, prompts: &[Vec<u32>]) -> Result<()> {
    let (st, k, d) = (model.mem.stream(), model.kernels(), model.shape.hidden);
    if prompts.len() > SLOTS {
        return Err(format!("{} prompts for {SLOTS} slots", prompts.len()).into());
    }
    for (r, p) in prompts.iter().enumerate() {
        if p.len() >= slots.max_len {
            return Err(format!("a prompt of {} tokens leaves no room", p.len()).into());
        }
        let mut seq = model.new_seq();
        let logits = model.forward(&mut seq, p)?;
        slots.first[r] = model.argmax(&logits)?;
        slots.start[r] = p.len() as u32;
        for (l, (kc, vc)) in slots.cache.iter_mut().enumerate() {
            let (ko, vo) = seq.layer_cache(l).ok_or("prefill left no cache")?;
            let (at, n) = (r * slots.max_len * d, p.len() * d);
            k.copy(st, ko, 0, kc, at, n)?;
            k.copy(st, vo, 0, vc, at, n)?;
        }
    }
    st.synchronize()?;
    Ok(())
}

/// One decode step for the first `batch` sequences of `slots`: reads `ids` and `pos`, appends
/// to the cache, writes the greedy choice to `ids` and advances `pos`; its buffers come from
/// `scratch` (see the module docs).
pub fn decode_step(
    model: &Model<PoolMem>,
    slots: &mut Slots,
    batch: usize,
    scratch: &Arc<CachingAllocator<CudaDevice>>,
) -> Result<()> {
    let (s, st, k, w) = (
        &model.shape,
        model.mem.stream(),
        model.kernels(),
        model.weights(),
    );
    let (n, d) = (batch, s.hidden);
    if n == 0 || n > SLOTS {
        return Err(format!("batch {n} outside 1..={SLOTS}").into());
    }
    let buf = |len: usize| -> Result<Buffer<f32>> { Ok(scratch.buffer_uninit(len, st)?) };
    let mut x = buf(n * d)?;
    k.embedding(st, &w.embed, s.vocab, d, &slots.ids, n, &mut x)?;
    for (l, lw) in w.layers.iter().enumerate() {
        attention(model, slots, l, n, &mut x, &buf)?;
        // x += W2 (silu(W1 h) * W3 h), h = RMSNorm(x)
        let f = s.ffn;
        let mut hn = buf(n * d)?;
        k.rmsnorm(st, &x, &lw.mlp_norm, &mut hn, n, d, s.eps)?;
        let (mut g, mut u) = (buf(n * f)?, buf(n * f)?);
        gemm_f32(
            model.mem.blas(),
            linear(n, d, f, false),
            &lw.w1,
            &hn,
            &mut g,
        )?;
        gemm_f32(
            model.mem.blas(),
            linear(n, d, f, false),
            &lw.w3,
            &hn,
            &mut u,
        )?;
        drop(hn);
        let mut a = buf(n * f)?;
        k.silu_mul(st, &g, &u, &mut a, n * f)?;
        drop((g, u));
        gemm_f32(model.mem.blas(), linear(n, f, d, true), &lw.w2, &a, &mut x)?;
    }
    let mut normed = buf(n * d)?;
    k.rmsnorm(st, &x, &w.final_norm, &mut normed, n, d, s.eps)?;
    drop(x);
    let mut logits = buf(n * s.vocab)?;
    let head = linear(n, d, s.vocab, false);
    gemm_f32(model.mem.blas(), head, &w.lm_head, &normed, &mut logits)?;
    drop(normed);
    k.argmax(st, &logits, n, s.vocab, &mut slots.ids)?;
    k.add_u32(st, &mut slots.pos, n, 1)?;
    Ok(())
}

/// `x += Attention(RMSNorm(x))` for layer `l`, one new token per sequence at its position.
fn attention(
    model: &Model<PoolMem>,
    slots: &mut Slots,
    l: usize,
    n: usize,
    x: &mut Buffer<f32>,
    buf: &dyn Fn(usize) -> Result<Buffer<f32>>,
) -> Result<()> {
    let (s, st, k) = (&model.shape, model.mem.stream(), model.kernels());
    let (d, h, hd) = (s.hidden, s.heads, s.head_dim());
    let lw = &model.weights().layers[l];
    let blas = model.mem.blas();
    let mut hn = buf(n * d)?;
    k.rmsnorm(st, &*x, &lw.attn_norm, &mut hn, n, d, s.eps)?;
    let (mut q, mut kn, mut vn) = (buf(n * d)?, buf(n * d)?, buf(n * d)?);
    gemm_f32(blas, linear(n, d, d, false), &lw.wq, &hn, &mut q)?;
    gemm_f32(blas, linear(n, d, d, false), &lw.wk, &hn, &mut kn)?;
    gemm_f32(blas, linear(n, d, d, false), &lw.wv, &hn, &mut vn)?;
    drop(hn);
    k.rope_at(st, &mut q, n, h, hd, &slots.pos, s.theta)?;
    k.rope_at(st, &mut kn, n, h, hd, &slots.pos, s.theta)?;
    let max_len = slots.max_len;
    let (kc, vc) = &mut slots.cache[l];
    k.store_rows(st, &kn, kc, n, d, max_len, &slots.pos)?;
    k.store_rows(st, &vn, vc, n, d, max_len, &slots.pos)?;
    drop((kn, vn));
    let mut scores = buf(n * h * max_len)?;
    let mut att = buf(n * d)?;
    let shape = DecodeShape {
        batch: n,
        heads: h,
        head_dim: hd,
        max_len,
    };
    let scale = 1.0 / (hd as f32).sqrt();
    k.decode_attention(
        st,
        shape,
        &q,
        &*kc,
        &*vc,
        &mut scores,
        &mut att,
        &slots.pos,
        scale,
    )?;
    drop((q, scores));
    gemm_f32(blas, linear(n, d, d, true), &lw.wo, &att, x)?;
    Ok(())
}
