//! The kernels of a batched decode step whose every launch argument stays fixed from one step
//! to the next (what a CUDA graph needs: it replays the arguments it captured): one token per
//! sequence, the positions in a device array `pos` (`u32`, one per sequence), the KV cache a
//! fixed `[slots, max_len, dim]` array per layer in which sequence `r` owns rows
//! `[r * max_len, (r + 1) * max_len)`.
//!
//! The kernels read `pos` on the device, so the host cannot check it: a position at or past
//! `max_len` stores nothing and attends to at most `max_len` rows (the kernels clamp), which
//! keeps every access inside the buffers checked here whatever `pos` holds.

use super::{launch, mul, need, rows_cfg, shape, stride_cfg, to_u32, Kernels, OpsError};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use std::sync::Arc;

/// Most rows [`Kernels::linear_rows`] takes (`LINEAR_ROWS` in `kernels.cu`).
pub const LINEAR_ROWS: usize = 32;
/// Most rows of `x` one block of `linear_rows` sums over (`LINEAR_TILE`).
const LINEAR_TILE: usize = 8;
/// Outputs per block of `linear_rows` (`LINEAR_OUT`).
const LINEAR_OUT: usize = 4;
/// Threads per block of `linear_rows` (at most `THREADS`: its shared memory has room for that).
const LINEAR_THREADS: u32 = 128;
/// Keys per block of the split attention (`SPLIT_KEYS`).
const SPLIT_KEYS: usize = 64;
/// Threads per block of `cudalloc_attention_part_f32` (`SPLIT_THREADS`).
const SPLIT_THREADS: u32 = 2 * SPLIT_KEYS as u32;

/// Rows per block of `linear_rows` for `rows` rows: as the kernel chooses its tile.
fn linear_tile(rows: usize) -> usize {
    match rows {
        0..=1 => 1,
        2 => 2,
        3..=4 => 4,
        _ => LINEAR_TILE,
    }
}

/// The sizes of a batched decode step's attention: `batch` sequences of `heads` heads of
/// `head_dim`, caches of `max_len` rows per sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub max_len: usize,
}

impl DecodeShape {
    /// Floats of one row (`heads * head_dim`).
    fn dim(&self) -> Result<usize, OpsError> {
        mul("heads x head_dim", self.heads, self.head_dim)
    }

    /// Floats of the scratch [`Kernels::decode_attention`] needs, for each sequence and head:
    /// `max_len` scores, or where the keys may be split in chunks of 64, the larger of that and
    /// each chunk's output and (maximum, sum).
    pub fn scratch(&self) -> Result<usize, OpsError> {
        let chunks = self.max_len.div_ceil(SPLIT_KEYS);
        let per_head = if self.splits() {
            let chunk = self.head_dim.saturating_add(2);
            self.max_len.max(mul("chunks x head_dim", chunks, chunk)?)
        } else {
            self.max_len
        };
        mul(
            "batch x heads x scratch",
            mul("batch x heads", self.batch, self.heads)?,
            per_head,
        )
    }

    /// Whether the split kernels take this shape (float4 rows of at most `SPLIT_KEYS` float4).
    fn splits(&self) -> bool {
        self.head_dim.is_multiple_of(4) && self.head_dim <= 4 * SPLIT_KEYS
    }

    /// Floats of the cache rows of `batch` sequences.
    fn cache(&self) -> Result<usize, OpsError> {
        mul(
            "batch x max_len x dim",
            mul("batch x max_len", self.batch, self.max_len)?,
            self.dim()?,
        )
    }
}

impl Kernels {
    /// Rotary position embedding in place on `x` as `[rows, heads, head_dim]` (`head_dim`
    /// even), row `r` at position `pos[r]`: the same turn as [`Kernels::rope`].
    #[allow(clippy::too_many_arguments)]
    pub fn rope_at<X: DevicePtrMut<f32>, P: DevicePtr<u32>>(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut X,
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos: &P,
        theta: f32,
    ) -> Result<(), OpsError> {
        if head_dim & 1 != 0 {
            return Err(shape(format!(
                "rope needs an even head_dim, not {head_dim}"
            )));
        }
        let n = mul(
            "rows x heads x head_dim",
            mul("rows x heads", rows, heads)?,
            head_dim,
        )?;
        need("rope input", x, n)?;
        need("rope positions", pos, rows)?;
        if n == 0 {
            return Ok(());
        }
        let (r64, h32, d32) = (
            rows as u64,
            to_u32("heads", heads)?,
            to_u32("head_dim", head_dim)?,
        );
        let (xp, _x) = x.device_ptr_mut(stream);
        let (pp, _p) = pos.device_ptr(stream);
        let mut b = stream.launch_builder(&self.rope_at);
        b.arg(&xp)
            .arg(&r64)
            .arg(&h32)
            .arg(&d32)
            .arg(&pp)
            .arg(&theta);
        // SAFETY: cudalloc_rope_at_f32(float*, u64, u32, u32, const u32*, float) touches
        // x[0..rows*heads*head_dim) and reads pos[0..rows), checked above; the arguments above
        // match its parameters in order and type.
        unsafe { launch(&mut b, stride_cfg(n / 2)) }
    }

    /// `cache[r * max_len + pos[r], :] = src[r, :]` for `r < rows`, rows of `dim` floats (a
    /// position at or past `max_len` stores nothing): the new token's keys or values.
    #[allow(clippy::too_many_arguments)]
    pub fn store_rows<S: DevicePtr<f32>, C: DevicePtrMut<f32>, P: DevicePtr<u32>>(
        &self,
        stream: &Arc<CudaStream>,
        src: &S,
        cache: &mut C,
        rows: usize,
        dim: usize,
        max_len: usize,
        pos: &P,
    ) -> Result<(), OpsError> {
        let n = mul("rows x dim", rows, dim)?;
        need("stored rows", src, n)?;
        need(
            "cache",
            cache,
            mul(
                "rows x max_len x dim",
                mul("rows x max_len", rows, max_len)?,
                dim,
            )?,
        )?;
        need("store positions", pos, rows)?;
        if n == 0 {
            return Ok(());
        }
        let (r64, d64, m64) = (rows as u64, dim as u64, max_len as u64);
        let (sp, _s) = src.device_ptr(stream);
        let (cp, _c) = cache.device_ptr_mut(stream);
        let (pp, _p) = pos.device_ptr(stream);
        let mut b = stream.launch_builder(&self.store_rows);
        b.arg(&sp).arg(&cp).arg(&r64).arg(&d64).arg(&m64).arg(&pp);
        // SAFETY: cudalloc_store_rows_f32(const float*, float*, u64, u64, u64, const u32*) reads
        // src[0..rows*dim) and pos[0..rows), and writes cache rows below rows*max_len only (a
        // position >= max_len writes nothing), all checked above; the arguments above match its
        // parameters in order and type.
        unsafe { launch(&mut b, stride_cfg(n)) }
    }

    /// One query per sequence against its cache: for sequence `b < s.batch` and each head,
    /// softmax over `j <= pos[b]` (at most `s.max_len` rows) of `q[b, h, :] . k[b, j, h, :] *
    /// scale`, then `out[b, h, :] = sum_j p_j v[b, j, h, :]`. `q` and `out` are
    /// `[batch, heads, head_dim]`, the caches `[batch.., max_len, heads, head_dim]`, `scratch`
    /// at least [`DecodeShape::scratch`] floats. Where `head_dim` is a multiple of 4 of at most
    /// 256 and `q`, the caches and `scratch` start 16 bytes aligned, the keys are split in
    /// chunks of 64, one block each, and a second kernel adds the chunks up; otherwise one
    /// block per sequence and head.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_attention<Q, K, V, S, O, P>(
        &self,
        stream: &Arc<CudaStream>,
        s: DecodeShape,
        q: &Q,
        k: &K,
        v: &V,
        scratch: &mut S,
        out: &mut O,
        pos: &P,
        scale: f32,
    ) -> Result<(), OpsError>
    where
        Q: DevicePtr<f32>,
        K: DevicePtr<f32>,
        V: DevicePtr<f32>,
        S: DevicePtrMut<f32>,
        O: DevicePtrMut<f32>,
        P: DevicePtr<u32>,
    {
        let rows = mul("batch x dim", s.batch, s.dim()?)?;
        need("attention queries", q, rows)?;
        need("attention output", out, rows)?;
        need("key cache", k, s.cache()?)?;
        need("value cache", v, s.cache()?)?;
        need("attention scratch", scratch, s.scratch()?)?;
        need("attention positions", pos, s.batch)?;
        if rows == 0 || s.max_len == 0 {
            return Ok(());
        }
        let heads = mul("batch x heads", s.batch, s.heads)?;
        let (b64, h32, d32, m64) = (
            s.batch as u64,
            to_u32("heads", s.heads)?,
            to_u32("head_dim", s.head_dim)?,
            s.max_len as u64,
        );
        let (qp, _q) = q.device_ptr(stream);
        let (kp, _k) = k.device_ptr(stream);
        let (vp, _v) = v.device_ptr(stream);
        let (sp, _s) = scratch.device_ptr_mut(stream);
        let (op, _o) = out.device_ptr_mut(stream);
        let (pp, _p) = pos.device_ptr(stream);
        if !s.splits() || !(qp | kp | vp | sp).is_multiple_of(16) {
            let mut b = stream.launch_builder(&self.decode_attention);
            b.arg(&qp).arg(&kp).arg(&vp).arg(&sp).arg(&op);
            b.arg(&b64)
                .arg(&h32)
                .arg(&d32)
                .arg(&m64)
                .arg(&pp)
                .arg(&scale);
            // SAFETY: cudalloc_decode_attention_f32(const float*, const float*, const float*,
            // float*, float*, u64, u32, u32, u64, const u32*, float) runs one block per
            // (sequence, head) below batch*heads; it reads q[0..batch*dim), pos[0..batch) and
            // cache rows below batch*max_len (the length is clamped to max_len), and writes
            // scratch[0..batch*heads*max_len) and out[0..batch*dim), all checked above; the
            // arguments above match its parameters in order and type.
            return unsafe { launch(&mut b, rows_cfg(heads)?) };
        }
        let chunks = s.max_len.div_ceil(SPLIT_KEYS);
        let c32 = to_u32("chunks", chunks)?;
        let mut cfg = rows_cfg(mul("batch x heads x chunks", heads, chunks)?)?;
        cfg.block_dim.0 = SPLIT_THREADS;
        let mut b = stream.launch_builder(&self.attention_part);
        b.arg(&qp).arg(&kp).arg(&vp).arg(&sp);
        b.arg(&b64)
            .arg(&h32)
            .arg(&d32)
            .arg(&m64)
            .arg(&c32)
            .arg(&pp)
            .arg(&scale);
        // SAFETY: cudalloc_attention_part_f32(const float*, const float*, const float*, float*,
        // u64, u32, u32, u64, u32, const u32*, float) runs one block per (sequence, head,
        // chunk) below batch*heads*chunks with SPLIT_THREADS threads; it reads q[0..batch*dim),
        // pos[0..batch) and cache rows below batch*max_len (the length is clamped to max_len)
        // as float4 (head_dim a multiple of 4 of at most 4*SPLIT_KEYS, every pointer 16-byte
        // aligned: checked above), and writes scratch below blocks*(head_dim+2) <= scratch(),
        // checked above; the arguments above match its parameters in order and type.
        unsafe { launch(&mut b, cfg) }?;
        let mut b = stream.launch_builder(&self.attention_merge);
        b.arg(&sp).arg(&op);
        b.arg(&b64).arg(&h32).arg(&d32).arg(&m64).arg(&c32).arg(&pp);
        // SAFETY: cudalloc_attention_merge_f32(const float*, float*, u64, u32, u32, u64, u32,
        // const u32*) runs one block per (sequence, head) below batch*heads; it reads the
        // scratch the launch above wrote (chunks below the clamped length only) and pos[0..
        // batch), and writes out[0..batch*dim), all checked above; the arguments above match
        // its parameters in order and type.
        unsafe { launch(&mut b, rows_cfg(heads)?) }
    }

    /// `y[r, o] = (y[r, o] if accumulate) + sum_i x[r, i] w[o, i]` for `r < rows` (at most
    /// [`LINEAR_ROWS`]), `o < out`: a linear layer of a decode step's batch, `w` `[out, inp]`,
    /// `x` `[rows, inp]`, `y` `[rows, out]`: one block per 4 outputs and at most 8 rows, its
    /// threads splitting `inp`, so that a whole row of `w` is read at once.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_rows<W: DevicePtr<f32>, X: DevicePtr<f32>, Y: DevicePtrMut<f32>>(
        &self,
        stream: &Arc<CudaStream>,
        w: &W,
        x: &X,
        y: &mut Y,
        rows: usize,
        inp: usize,
        out: usize,
        accumulate: bool,
    ) -> Result<(), OpsError> {
        if rows > LINEAR_ROWS {
            return Err(shape(format!(
                "linear_rows takes at most {LINEAR_ROWS} rows, not {rows}"
            )));
        }
        need("linear weights", w, mul("out x in", out, inp)?)?;
        need("linear input", x, mul("rows x in", rows, inp)?)?;
        need("linear output", y, mul("rows x out", rows, out)?)?;
        if rows == 0 || out == 0 {
            return Ok(());
        }
        let (r32, i32_, o32) = (
            to_u32("rows", rows)?,
            to_u32("in", inp)?,
            to_u32("out", out)?,
        );
        let beta: f32 = if accumulate { 1.0 } else { 0.0 };
        let blocks = rows.div_ceil(linear_tile(rows)) * out.div_ceil(LINEAR_OUT);
        let mut cfg = rows_cfg(blocks)?;
        cfg.block_dim.0 = LINEAR_THREADS;
        let (wp, _w) = w.device_ptr(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (yp, _y) = y.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&self.linear_rows);
        b.arg(&wp)
            .arg(&xp)
            .arg(&yp)
            .arg(&r32)
            .arg(&i32_)
            .arg(&o32)
            .arg(&beta);
        // SAFETY: cudalloc_linear_rows_f32(const float*, const float*, float*, u32, u32, u32,
        // float) reads w[0..out*in) and x[0..rows*in), and reads and writes y[0..rows*out)
        // (it reads rows past out or rows as the last one, and writes none of them), all
        // checked above; the arguments above match its parameters in order and type.
        unsafe { launch(&mut b, cfg) }
    }

    /// `x[..n] += value` (the positions after a step).
    pub fn add_u32<X: DevicePtrMut<u32>>(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut X,
        n: usize,
        value: u32,
    ) -> Result<(), OpsError> {
        need("add_u32 input", x, n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let (xp, _x) = x.device_ptr_mut(stream);
        let mut b = stream.launch_builder(&self.add_u32);
        b.arg(&xp).arg(&n64).arg(&value);
        // SAFETY: cudalloc_add_u32(u32*, u64, u32) touches x[0..n), checked above; the arguments
        // above match its parameters in order and type.
        unsafe { launch(&mut b, stride_cfg(n)) }
    }
}
