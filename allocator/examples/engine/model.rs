//! A decoder-only transformer (Llama-shaped: RMSNorm, rotary attention with a KV cache, SwiGLU
//! MLP, untied LM head) in `f32`, with random weights, running on any [`Mem`] backend.
//!
//! Matrix products go through cuBLAS (`gemm_f32`, strided batched over heads for attention);
//! elementwise work through NVRTC-compiled kernels (`cudalloc_sys::ops`). Every device
//! buffer comes from the backend, and the KV cache grows by reallocation, one step at a time,
//! the way a concatenating cache (Hugging Face's `DynamicCache`) does: each forward allocates
//! the longer cache, copies the old one and the new rows in, and frees the old one. That churn,
//! with the activations of every layer, is what the allocator sees.
//!
//! Layouts (row-major): activations `[tokens, hidden]`; weights `[out, in]` (`y = x W^T`);
//! attention tensors `[tokens, heads, head_dim]` inside `[tokens, hidden]`; scores
//! `[heads, queries, keys]`.

use super::mem::{Mem, Result};
use cudalloc_sys::buffer::cudarc::cublas::sys::cublasOperation_t as Op;
use cudalloc_sys::buffer::cudarc::cublas::{GemmConfig, StridedBatchedConfig};
use cudalloc_sys::ops::{gemm_f32, gemm_strided_batched_f32, Kernels};

/// The model's sizes.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub layers: usize,
    pub ffn: usize,
    pub eps: f32,
    pub theta: f32,
}

impl Shape {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    pub fn check(&self) -> Result<()> {
        if self.heads == 0
            || self.hidden != self.heads * self.head_dim()
            || self.head_dim() & 1 != 0
        {
            return Err(format!(
                "hidden {} must split into {} heads of an even size",
                self.hidden, self.heads
            )
            .into());
        }
        Ok(())
    }

    /// Parameters in the model.
    pub fn params(&self) -> usize {
        let d = self.hidden;
        let layer = 2 * d + 4 * d * d + 3 * d * self.ffn;
        2 * self.vocab * d + d + self.layers * layer
    }
}

/// Weights of one layer (host or device).
pub struct Layer<F> {
    pub attn_norm: F,
    pub wq: F,
    pub wk: F,
    pub wv: F,
    pub wo: F,
    pub mlp_norm: F,
    /// Gate projection `[ffn, hidden]`.
    pub w1: F,
    /// Up projection `[ffn, hidden]`.
    pub w3: F,
    /// Down projection `[hidden, ffn]`.
    pub w2: F,
}

impl<F> Layer<F> {
    fn map<G>(&self, mut f: impl FnMut(&F) -> Result<G>) -> Result<Layer<G>> {
        Ok(Layer {
            attn_norm: f(&self.attn_norm)?,
            wq: f(&self.wq)?,
            wk: f(&self.wk)?,
            wv: f(&self.wv)?,
            wo: f(&self.wo)?,
            mlp_norm: f(&self.mlp_norm)?,
            w1: f(&self.w1)?,
            w3: f(&self.w3)?,
            w2: f(&self.w2)?,
        })
    }
}

/// All weights (host or device).
pub struct Weights<F> {
    pub embed: F,
    pub layers: Vec<Layer<F>>,
    pub final_norm: F,
    pub lm_head: F,
}

/// A deterministic xorshift generator.
struct Rng(u64);

impl Rng {
    /// Uniform in `[-1, 1)`.
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }

    fn fill(&mut self, n: usize, scale: f32, offset: f32) -> Vec<f32> {
        (0..n).map(|_| offset + scale * self.next()).collect()
    }
}

impl Weights<Vec<f32>> {
    /// Random weights scaled so activations stay near unit size.
    pub fn random(s: &Shape, seed: u64) -> Weights<Vec<f32>> {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let (d, f) = (s.hidden, s.ffn);
        let lin =
            |r: &mut Rng, out: usize, inp: usize| r.fill(out * inp, (3.0 / inp as f32).sqrt(), 0.0);
        let layers = (0..s.layers)
            .map(|_| Layer {
                attn_norm: r.fill(d, 0.1, 1.0),
                wq: lin(&mut r, d, d),
                wk: lin(&mut r, d, d),
                wv: lin(&mut r, d, d),
                wo: lin(&mut r, d, d),
                mlp_norm: r.fill(d, 0.1, 1.0),
                w1: lin(&mut r, f, d),
                w3: lin(&mut r, f, d),
                w2: lin(&mut r, d, f),
            })
            .collect();
        Weights {
            embed: r.fill(s.vocab * d, 1.0, 0.0),
            layers,
            final_norm: r.fill(d, 0.1, 1.0),
            lm_head: lin(&mut r, s.vocab, d),
        }
    }
}

/// One sequence being generated: its tokens and its KV cache (one `[len, hidden]` pair per
/// layer, reallocated as it grows).
pub struct Seq<F> {
    pub tokens: Vec<u32>,
    cache: Vec<Option<(F, F)>>,
    len: usize,
}

impl<F> Seq<F> {
    /// Tokens in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Layer `l`'s cache: keys and values, `[len, hidden]` each (`None` before the first
    /// forward).
    pub fn layer_cache(&self, l: usize) -> Option<&(F, F)> {
        self.cache.get(l).and_then(Option::as_ref)
    }
}

/// The model on a backend.
pub struct Model<M: Mem> {
    pub shape: Shape,
    w: Weights<M::F>,
    k: Kernels,
    // Last: buffers above go back to the backend's pool before it goes away.
    pub mem: M,
}

/// `y[rows, out] (+)= x[rows, in] W[out, in]^T` as cuBLAS sees it (column-major `y^T = W x^T`).
pub fn linear(rows: usize, inp: usize, out: usize, accumulate: bool) -> GemmConfig<f32> {
    GemmConfig {
        transa: Op::CUBLAS_OP_T,
        transb: Op::CUBLAS_OP_N,
        m: out as i32,
        n: rows as i32,
        k: inp as i32,
        alpha: 1.0,
        lda: inp as i32,
        ldb: inp as i32,
        beta: if accumulate { 1.0 } else { 0.0 },
        ldc: out as i32,
    }
}

impl<M: Mem> Model<M> {
    /// Uploads `host` to the backend.
    pub fn new(mem: M, shape: Shape, host: &Weights<Vec<f32>>) -> Result<Model<M>> {
        shape.check()?;
        let k = Kernels::new(mem.stream().context())?;
        let up = |v: &Vec<f32>| mem.upload(v);
        let w = Weights {
            embed: up(&host.embed)?,
            layers: host
                .layers
                .iter()
                .map(|l| l.map(up))
                .collect::<Result<Vec<_>>>()?,
            final_norm: up(&host.final_norm)?,
            lm_head: up(&host.lm_head)?,
        };
        Ok(Model { shape, w, k, mem })
    }

    /// The weights on the device.
    pub fn weights(&self) -> &Weights<M::F> {
        &self.w
    }

    /// The elementwise kernels, loaded into the backend's context.
    pub fn kernels(&self) -> &Kernels {
        &self.k
    }

    pub fn new_seq(&self) -> Seq<M::F> {
        Seq {
            tokens: Vec::new(),
            cache: (0..self.shape.layers).map(|_| None).collect(),
            len: 0,
        }
    }

    fn gemm(&self, cfg: GemmConfig<f32>, a: &M::F, b: &M::F, c: &mut M::F) -> Result<()> {
        Ok(gemm_f32(self.mem.blas(), cfg, a, b, c)?)
    }

    fn batched(
        &self,
        cfg: StridedBatchedConfig<f32>,
        a: &M::F,
        b: &M::F,
        c: &mut M::F,
    ) -> Result<()> {
        Ok(gemm_strided_batched_f32(self.mem.blas(), cfg, a, b, c)?)
    }

    /// Runs `ids` through the model after what `seq` holds; returns the logits of the last one
    /// (`[vocab]`) and appends `ids` to the sequence and its cache.
    pub fn forward(&self, seq: &mut Seq<M::F>, ids: &[u32]) -> Result<M::F> {
        let (s, m, st) = (&self.shape, &self.mem, self.mem.stream());
        let (n, d, p0) = (ids.len(), s.hidden, seq.len);
        if n == 0 {
            return Err("forward needs at least one token".into());
        }
        let ids_d = m.upload_ids(ids)?;
        let mut x = m.floats(n * d)?;
        self.k
            .embedding(st, &self.w.embed, s.vocab, d, &ids_d, n, &mut x)?;
        for (l, w) in self.w.layers.iter().enumerate() {
            self.attention(seq, l, w, &mut x, n, p0)?;
            self.mlp(w, &mut x, n)?;
        }
        let mut last = m.floats(d)?;
        self.k.copy(st, &x, (n - 1) * d, &mut last, 0, d)?;
        let mut normed = m.floats(d)?;
        self.k
            .rmsnorm(st, &last, &self.w.final_norm, &mut normed, 1, d, s.eps)?;
        let mut logits = m.floats(s.vocab)?;
        self.gemm(
            linear(1, d, s.vocab, false),
            &self.w.lm_head,
            &normed,
            &mut logits,
        )?;
        seq.len += n;
        seq.tokens.extend_from_slice(ids);
        Ok(logits)
    }

    /// `x += Attention(RMSNorm(x))` for layer `l`, growing its cache by `n` rows.
    fn attention(
        &self,
        seq: &mut Seq<M::F>,
        l: usize,
        w: &Layer<M::F>,
        x: &mut M::F,
        n: usize,
        p0: usize,
    ) -> Result<()> {
        let (s, m, st) = (&self.shape, &self.mem, self.mem.stream());
        let (d, h, hd) = (s.hidden, s.heads, s.head_dim());
        let t = p0 + n;
        let mut hn = m.floats(n * d)?;
        self.k
            .rmsnorm(st, &*x, &w.attn_norm, &mut hn, n, d, s.eps)?;
        let (mut q, mut k, mut v) = (m.floats(n * d)?, m.floats(n * d)?, m.floats(n * d)?);
        self.gemm(linear(n, d, d, false), &w.wq, &hn, &mut q)?;
        self.gemm(linear(n, d, d, false), &w.wk, &hn, &mut k)?;
        self.gemm(linear(n, d, d, false), &w.wv, &hn, &mut v)?;
        drop(hn);
        self.k.rope(st, &mut q, n, h, hd, p0, s.theta)?;
        self.k.rope(st, &mut k, n, h, hd, p0, s.theta)?;

        // The cache grows by reallocation: [p0, d] + [n, d] -> [t, d].
        let (mut kc, mut vc) = (m.floats(t * d)?, m.floats(t * d)?);
        if let Some((ko, vo)) = seq.cache[l].take() {
            self.k.copy(st, &ko, 0, &mut kc, 0, p0 * d)?;
            self.k.copy(st, &vo, 0, &mut vc, 0, p0 * d)?;
        }
        self.k.copy(st, &k, 0, &mut kc, p0 * d, n * d)?;
        self.k.copy(st, &v, 0, &mut vc, p0 * d, n * d)?;
        drop((k, v));

        // scores[h, i, j] = q[i, h, :] . k[j, h, :] / sqrt(hd); column-major per head:
        // S_h^T [t, n] = (K_h^T)^T Q_h^T with K_h^T, Q_h^T [hd, *] at leading dimension d.
        let mut scores = m.floats(h * n * t)?;
        let qk = StridedBatchedConfig {
            gemm: GemmConfig {
                transa: Op::CUBLAS_OP_T,
                transb: Op::CUBLAS_OP_N,
                m: t as i32,
                n: n as i32,
                k: hd as i32,
                alpha: 1.0 / (hd as f32).sqrt(),
                lda: d as i32,
                ldb: d as i32,
                beta: 0.0,
                ldc: t as i32,
            },
            batch_size: h as i32,
            stride_a: hd as i64,
            stride_b: hd as i64,
            stride_c: (n * t) as i64,
        };
        self.batched(qk, &kc, &q, &mut scores)?;
        drop(q);
        self.k.softmax_causal(st, &mut scores, h, n, t, p0)?;

        // out[i, h, :] = sum_j p[h, i, j] v[j, h, :]; column-major: O_h^T [hd, n] = V_h^T P_h^T.
        let mut att = m.floats(n * d)?;
        let pv = StridedBatchedConfig {
            gemm: GemmConfig {
                transa: Op::CUBLAS_OP_N,
                transb: Op::CUBLAS_OP_N,
                m: hd as i32,
                n: n as i32,
                k: t as i32,
                alpha: 1.0,
                lda: d as i32,
                ldb: t as i32,
                beta: 0.0,
                ldc: d as i32,
            },
            batch_size: h as i32,
            stride_a: hd as i64,
            stride_b: (n * t) as i64,
            stride_c: hd as i64,
        };
        self.batched(pv, &vc, &scores, &mut att)?;
        drop(scores);
        seq.cache[l] = Some((kc, vc));
        // x += att Wo^T
        self.gemm(linear(n, d, d, true), &w.wo, &att, x)
    }

    /// `x += W2 (silu(W1 h) * W3 h)` with `h = RMSNorm(x)`.
    fn mlp(&self, w: &Layer<M::F>, x: &mut M::F, n: usize) -> Result<()> {
        let (s, m, st) = (&self.shape, &self.mem, self.mem.stream());
        let (d, f) = (s.hidden, s.ffn);
        let mut hn = m.floats(n * d)?;
        self.k.rmsnorm(st, &*x, &w.mlp_norm, &mut hn, n, d, s.eps)?;
        let (mut g, mut u) = (m.floats(n * f)?, m.floats(n * f)?);
        self.gemm(linear(n, d, f, false), &w.w1, &hn, &mut g)?;
        self.gemm(linear(n, d, f, false), &w.w3, &hn, &mut u)?;
        drop(hn);
        let mut a = m.floats(n * f)?;
        self.k.silu_mul(st, &g, &u, &mut a, n * f)?;
        drop((g, u));
        self.gemm(linear(n, f, d, true), &w.w2, &a, x)
    }

    /// The logits on the host.
    pub fn to_host(&self, logits: &M::F) -> Result<Vec<f32>> {
        Ok(self.mem.stream().clone_dtoh(logits)?)
    }

    /// Greedy choice: the index of the largest logit (waits for the stream).
    pub fn argmax(&self, logits: &M::F) -> Result<u32> {
        let mut id = self.mem.ids(1)?;
        self.k
            .argmax(self.mem.stream(), logits, 1, self.shape.vocab, &mut id)?;
        Ok(self.mem.stream().clone_dtoh(&id)?[0])
    }
}
