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
use super::model::{self, Model};
use cudalloc::CachingAllocator;
use cudalloc_sys::buffer::cudarc::driver::sys::CUevent_flags;
use cudalloc_sys::buffer::cudarc::driver::{CudaEvent, CudaStream};
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
    /// How the step computes its linear layers.
    pub linear: Linear,
}

/// How the batched step computes its linear layers (`engine --step-linear`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Linear {
    /// `Kernels::linear_rows`: one block per 4 outputs and 8 sequences, the whole device at work.
    Rows,
    /// cuBLAS `Sgemm` (a thin product: few of its tiles, on few SMs).
    Cublas,
}

impl Linear {
    pub fn name(self) -> &'static str {
        match self {
            Linear::Rows => "linear_rows",
            Linear::Cublas => "cuBLAS Sgemm",
        }
    }
}

/// `y[n, out] (+)= x[n, in] w[out, in]^T` for a step of `n` sequences (`nio = [n, in, out]`).
#[allow(clippy::too_many_arguments)]
fn linear(
    model: &Model<PoolMem>,
    how: Linear,
    w: &Buffer<f32>,
    x: &Buffer<f32>,
    y: &mut Buffer<f32>,
    nio: [usize; 3],
    accumulate: bool,
) -> Result<()> {
    let [n, i, o] = nio;
    match how {
        Linear::Rows => {
            let st = model.mem.stream();
            model
                .kernels()
                .linear_rows(st, w, x, y, n, i, o, accumulate)?;
        }
        Linear::Cublas => {
            let cfg = model::linear(n, i, o, accumulate);
            gemm_f32(model.mem.blas(), cfg, w, x, y)?;
        }
    }
    Ok(())
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
            linear: Linear::Rows,
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

/// Events recorded between the ops of eager steps, to time each kind of op
/// (`engine --graphs --step-profile`). Never used during a capture: an event recorded there
/// would become a node of the graph. The events are made once and recorded again at each step.
#[derive(Default)]
pub struct Probe {
    /// Each mark of the current steps: the op that ended there and its event's index.
    marks: Vec<(&'static str, usize)>,
    /// The events, made as the marks first need them.
    events: Vec<CudaEvent>,
}

impl Probe {
    /// Records an event after the op `label` (the first mark of a step only starts the clock).
    fn mark(&mut self, st: &Arc<CudaStream>, label: &'static str) -> Result<()> {
        let i = self.marks.len();
        if i == self.events.len() {
            let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
            self.events.push(st.context().new_event(timed)?);
        }
        self.events[i].record(st)?;
        self.marks.push((label, i));
        Ok(())
    }

    /// Milliseconds between each mark and the one before, summed per label over the marks so
    /// far (the stream must be done with them), in the order the labels first ended; the marks
    /// are cleared, the events kept.
    pub fn take(&mut self) -> Result<Vec<(&'static str, f64)>> {
        let mut sums: Vec<(&'static str, f64)> = Vec::new();
        for pair in self.marks.windows(2) {
            let ((_, start), (label, end)) = (pair[0], pair[1]);
            if label == START {
                continue;
            }
            let ms = self.events[start].elapsed_ms(&self.events[end])? as f64;
            match sums.iter_mut().find(|(l, _)| *l == label) {
                Some((_, sum)) => *sum += ms,
                None => sums.push((label, ms)),
            }
        }
        self.marks.clear();
        Ok(sums)
    }
}

/// The label of the mark that starts each step (not an op).
const START: &str = "start";

/// Marks `label` on `probe` if there is one.
fn mark(probe: &mut Option<&mut Probe>, st: &Arc<CudaStream>, label: &'static str) -> Result<()> {
    match probe {
        Some(p) => p.mark(st, label),
        None => Ok(()),
    }
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
    decode_step_probed(model, slots, batch, scratch, None)
}

/// [`decode_step`], with an event recorded after each op on `probe` when one is given.
pub fn decode_step_probed(
    model: &Model<PoolMem>,
    slots: &mut Slots,
    batch: usize,
    scratch: &Arc<CachingAllocator<CudaDevice>>,
    mut probe: Option<&mut Probe>,
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
    let p = &mut probe;
    mark(p, st, START)?;
    let mut x = buf(n * d)?;
    k.embedding(st, &w.embed, s.vocab, d, &slots.ids, n, &mut x)?;
    mark(p, st, "embedding")?;
    for (l, lw) in w.layers.iter().enumerate() {
        attention(model, slots, l, n, &mut x, &buf, p)?;
        // x += W2 (silu(W1 h) * W3 h), h = RMSNorm(x)
        let f = s.ffn;
        let mut hn = buf(n * d)?;
        k.rmsnorm(st, &x, &lw.mlp_norm, &mut hn, n, d, s.eps)?;
        mark(p, st, "rmsnorm")?;
        let (mut g, mut u) = (buf(n * f)?, buf(n * f)?);
        linear(model, slots.linear, &lw.w1, &hn, &mut g, [n, d, f], false)?;
        linear(model, slots.linear, &lw.w3, &hn, &mut u, [n, d, f], false)?;
        drop(hn);
        mark(p, st, "gemm w1, w3")?;
        let mut a = buf(n * f)?;
        k.silu_mul(st, &g, &u, &mut a, n * f)?;
        drop((g, u));
        mark(p, st, "silu_mul")?;
        linear(model, slots.linear, &lw.w2, &a, &mut x, [n, f, d], true)?;
        mark(p, st, "gemm w2")?;
    }
    let mut normed = buf(n * d)?;
    k.rmsnorm(st, &x, &w.final_norm, &mut normed, n, d, s.eps)?;
    drop(x);
    mark(p, st, "rmsnorm")?;
    let mut logits = buf(n * s.vocab)?;
    linear(
        model,
        slots.linear,
        &w.lm_head,
        &normed,
        &mut logits,
        [n, d, s.vocab],
        false,
    )?;
    drop(normed);
    mark(p, st, "gemm lm_head")?;
    k.argmax(st, &logits, n, s.vocab, &mut slots.ids)?;
    k.add_u32(st, &mut slots.pos, n, 1)?;
    mark(p, st, "argmax, add")?;
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
    p: &mut Option<&mut Probe>,
) -> Result<()> {
    let (s, st, k) = (&model.shape, model.mem.stream(), model.kernels());
    let (d, h, hd) = (s.hidden, s.heads, s.head_dim());
    let lw = &model.weights().layers[l];
    let mut hn = buf(n * d)?;
    k.rmsnorm(st, &*x, &lw.attn_norm, &mut hn, n, d, s.eps)?;
    mark(p, st, "rmsnorm")?;
    let (mut q, mut kn, mut vn) = (buf(n * d)?, buf(n * d)?, buf(n * d)?);
    linear(model, slots.linear, &lw.wq, &hn, &mut q, [n, d, d], false)?;
    linear(model, slots.linear, &lw.wk, &hn, &mut kn, [n, d, d], false)?;
    linear(model, slots.linear, &lw.wv, &hn, &mut vn, [n, d, d], false)?;
    drop(hn);
    mark(p, st, "gemm q, k, v")?;
    k.rope_at(st, &mut q, n, h, hd, &slots.pos, s.theta)?;
    k.rope_at(st, &mut kn, n, h, hd, &slots.pos, s.theta)?;
    let max_len = slots.max_len;
    let (kc, vc) = &mut slots.cache[l];
    k.store_rows(st, &kn, kc, n, d, max_len, &slots.pos)?;
    k.store_rows(st, &vn, vc, n, d, max_len, &slots.pos)?;
    drop((kn, vn));
    mark(p, st, "rope_at, store_rows")?;
    let shape = DecodeShape {
        batch: n,
        heads: h,
        head_dim: hd,
        max_len,
    };
    let mut scratch = buf(shape.scratch()?)?;
    let mut att = buf(n * d)?;
    let scale = 1.0 / (hd as f32).sqrt();
    k.decode_attention(
        st,
        shape,
        &q,
        &*kc,
        &*vc,
        &mut scratch,
        &mut att,
        &slots.pos,
        scale,
    )?;
    drop((q, scratch));
    mark(p, st, "decode_attention")?;
    linear(model, slots.linear, &lw.wo, &att, x, [n, d, d], true)?;
    mark(p, st, "gemm wo")?;
    Ok(())
}
