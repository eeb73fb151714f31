//! The batched decode step's kernels (`cudalloc_sys::ops`, `ops/decode.rs`) against a CPU
//! computation, on a CUDA GPU: `linear_rows` on its float4 path (`in` a multiple of 4) and its
//! scalar path, with and without accumulation, for 1 to 32 rows and output counts that no block
//! divides; `decode_attention` split in chunks (head_dim 16, 128 and 132) and one block per
//! sequence and head (head_dim 6 and 66, not multiples of 4, and 260, past the split's 256;
//! and queries at an unaligned start), for positions below, at and past the cache's rows
//! (clamped); `argmax` over long rows on its float4 and scalar reads, with ties,
//! NaN and infinities. Shapes the kernels cannot take are refused before launch.

use super::interop::{allocator, data, new_stream, settled, Alloc};
use cudalloc::Policy;
use cudalloc_sys::buffer::cudarc::driver::CudaStream;
use cudalloc_sys::ops::{DecodeShape, Kernels, LINEAR_ROWS};
use std::sync::Arc;

/// Largest |got - want| over the largest |want| (f32 sums against f64 ones).
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(1e-30f64, |m, w| m.max(w.abs()));
    let worst = got.iter().zip(want).fold(0.0f64, |m, (g, w)| {
        let d = (*g as f64 - w).abs();
        if d.is_nan() {
            f64::INFINITY
        } else {
            m.max(d)
        }
    });
    worst / scale
}

/// An allocator, a stream of its device and the kernels loaded there.
fn setup() -> (Alloc, Arc<CudaStream>, Kernels) {
    let a = allocator(Policy::Default);
    let s = new_stream(&a);
    let k = Kernels::new(&a.with_device(|d| d.context().clone())).unwrap();
    (a, s, k)
}

/// The CPU's `y (+)= x w^T` for `[rows, in, out]` (`y` read only when accumulating).
fn linear_cpu(w: &[f32], x: &[f32], y: &[f32], rio: [usize; 3], accumulate: bool) -> Vec<f64> {
    let [rows, inp, out] = rio;
    (0..rows * out)
        .map(|e| {
            let (r, o) = (e / out, e % out);
            let dot: f64 = (0..inp)
                .map(|t| x[r * inp + t] as f64 * w[o * inp + t] as f64)
                .sum();
            dot + if accumulate { y[e] as f64 } else { 0.0 }
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_rows_matches_the_cpu() {
    let (a, s, k) = setup();
    // (rows, in, out): float4 rows, odd outputs, in not a multiple of 4, a whole tile and more.
    let shapes = [
        (1, 1024, 1024),
        (2, 100, 50),
        (3, 64, 97),
        (4, 66, 7),
        (8, 96, 64),
        (9, 128, 33),
        (17, 130, 33),
        (LINEAR_ROWS, 256, 1000),
    ];
    for (i, &(rows, inp, out)) in shapes.iter().enumerate() {
        for accumulate in [false, true] {
            let seed = 2 * i as u32 + accumulate as u32;
            let (wh, xh, yh) = (
                data(out * inp, seed + 1),
                data(rows * inp, seed + 100),
                data(rows * out, seed + 200),
            );
            let w = a.buffer_from(&wh, &s).unwrap();
            let x = a.buffer_from(&xh, &s).unwrap();
            let mut y = a.buffer_from(&yh, &s).unwrap();
            k.linear_rows(&s, &w, &x, &mut y, rows, inp, out, accumulate)
                .unwrap();
            let got = s.clone_dtoh(&y).unwrap();
            let want = linear_cpu(&wh, &xh, &yh, [rows, inp, out], accumulate);
            let err = rel_err(&got, &want);
            assert!(
                err < 1e-5,
                "rows {rows}, in {inp}, out {out}, accumulate {accumulate}: rel err {err:.2e}"
            );
        }
    }
    // An input one float past an aligned start (`in` a multiple of 4): the scalar reads.
    {
        let (rows, inp, out) = (6, 64, 9);
        let (wh, xh) = (data(out * inp, 7), data(rows * inp, 8));
        let mut padded = vec![0.0f32];
        padded.extend_from_slice(&xh);
        let padded = s.clone_htod(&padded).unwrap();
        let w = a.buffer_from(&wh, &s).unwrap();
        let mut y = a.buffer::<f32>(rows * out, &s).unwrap();
        k.linear_rows(&s, &w, &padded.slice(1..), &mut y, rows, inp, out, false)
            .unwrap();
        let want = linear_cpu(&wh, &xh, &[], [rows, inp, out], false);
        let err = rel_err(&s.clone_dtoh(&y).unwrap(), &want);
        assert!(err < 1e-5, "unaligned input: rel err {err:.2e}");
    }
    let w = a.buffer::<f32>(64 * 64, &s).unwrap();
    let x = a.buffer::<f32>(33 * 64, &s).unwrap();
    let mut y = a.buffer::<f32>(33 * 64, &s).unwrap();
    let too_many = k.linear_rows(&s, &w, &x, &mut y, 33, 64, 64, false);
    assert!(too_many.is_err(), "33 rows are refused");
    let short = k.linear_rows(&s, &w, &x, &mut y, 32, 64, 65, false);
    assert!(
        short.is_err(),
        "weights of 64 x 64 floats are short of 65 outputs"
    );
    drop((w, x, y));
    s.synchronize().unwrap();
    settled(&a);
}

/// The CPU's attention of one query per sequence: `[batch, heads, head_dim]`.
fn attention_cpu(s: DecodeShape, q: &[f32], kc: &[f32], vc: &[f32], pos: &[u32]) -> Vec<f64> {
    let (hd, dim) = (s.head_dim, s.heads * s.head_dim);
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0.0f64; s.batch * dim];
    for b in 0..s.batch {
        let len = (pos[b] as usize + 1).min(s.max_len);
        for h in 0..s.heads {
            let row = |c: &[f32], j: usize| {
                let at = (b * s.max_len + j) * dim + h * hd;
                c[at..at + hd].iter().map(|v| *v as f64).collect::<Vec<_>>()
            };
            let qr = &q[b * dim + h * hd..b * dim + (h + 1) * hd];
            let scores: Vec<f64> = (0..len)
                .map(|j| {
                    let kr = row(kc, j);
                    qr.iter().zip(&kr).map(|(a, b)| *a as f64 * b).sum::<f64>() * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|v| (v - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (j, p) in e.iter().enumerate() {
                for (c, v) in row(vc, j).iter().enumerate() {
                    out[b * dim + h * hd + c] += p / sum * v;
                }
            }
        }
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_attention_matches_the_cpu() {
    let (a, s, k) = setup();
    // head_dim 16, 128 and 132: the split kernels; 6, 66 (not a multiple of 4) and 260 (past
    // the split's 256): one block per sequence and head.
    let shapes = [(4, 16), (2, 128), (1, 132), (3, 6), (2, 66), (1, 260)];
    for (i, &(heads, head_dim)) in shapes.iter().enumerate() {
        let shape = DecodeShape {
            batch: 5,
            heads,
            head_dim,
            max_len: 300,
        };
        let dim = heads * head_dim;
        let cache = shape.batch * shape.max_len * dim;
        // Positions: one row, a few, most, the last row, and past the end (clamped).
        let pos = [0u32, 7, 257, 299, 1000];
        let seed = 10 * i as u32;
        let (qh, kh, vh) = (
            data(shape.batch * dim, seed + 1),
            data(cache, seed + 2),
            data(cache, seed + 3),
        );
        let q = a.buffer_from(&qh, &s).unwrap();
        let kc = a.buffer_from(&kh, &s).unwrap();
        let vc = a.buffer_from(&vh, &s).unwrap();
        let p = a.buffer_from(&pos, &s).unwrap();
        let mut scores = a.buffer::<f32>(shape.scratch().unwrap(), &s).unwrap();
        let mut out = a.buffer::<f32>(shape.batch * dim, &s).unwrap();
        let scale = 1.0 / (head_dim as f32).sqrt();
        k.decode_attention(&s, shape, &q, &kc, &vc, &mut scores, &mut out, &p, scale)
            .unwrap();
        let got = s.clone_dtoh(&out).unwrap();
        let want = attention_cpu(shape, &qh, &kh, &vh, &pos);
        let err = rel_err(&got, &want);
        assert!(
            err < 1e-5,
            "heads {heads}, head_dim {head_dim}: rel err {err:.2e}"
        );
        // Queries one float past an aligned start: the one-block-per-head kernel whatever
        // head_dim is.
        let mut padded = vec![0.0f32];
        padded.extend_from_slice(&qh);
        let padded = s.clone_htod(&padded).unwrap();
        let q_view = padded.slice(1..);
        k.fill(&s, &mut out, f32::NAN).unwrap();
        k.decode_attention(
            &s,
            shape,
            &q_view,
            &kc,
            &vc,
            &mut scores,
            &mut out,
            &p,
            scale,
        )
        .unwrap();
        let err = rel_err(&s.clone_dtoh(&out).unwrap(), &want);
        assert!(
            err < 1e-5,
            "unaligned queries, heads {heads}, head_dim {head_dim}: rel err {err:.2e}"
        );
        let mut small = a.buffer::<f32>(shape.scratch().unwrap() - 1, &s).unwrap();
        let refused = k.decode_attention(&s, shape, &q, &kc, &vc, &mut small, &mut out, &p, scale);
        assert!(refused.is_err(), "a short scratch buffer is refused");
        let short = a.buffer::<f32>(shape.batch * dim - 1, &s).unwrap();
        let refused = k.decode_attention(
            &s,
            shape,
            &short,
            &kc,
            &vc,
            &mut scores,
            &mut out,
            &p,
            scale,
        );
        assert!(refused.is_err(), "a short query buffer is refused");
    }
    s.synchronize().unwrap();
    settled(&a);
}

/// The CPU's argmax of each row: the first largest, NaN never wins, 0 if all are NaN.
fn argmax_cpu(x: &[f32], cols: usize) -> Vec<u32> {
    x.chunks(cols)
        .map(|row| {
            let mut best: Option<(usize, f32)> = None;
            for (j, &v) in row.iter().enumerate() {
                if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
                    best = Some((j, v));
                }
            }
            best.map_or(0, |(j, _)| j as u32)
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn argmax_matches_the_cpu() {
    let (a, s, k) = setup();
    // 32,000 columns: float4 reads; 32,001: scalar; 3: fewer columns than threads.
    for (i, &(rows, cols)) in [(5, 32_000), (4, 32_001), (4, 3)].iter().enumerate() {
        let mut xh = data(rows * cols, 40 + i as u32);
        // Row 0: a tie for the largest (the first wins); row 1: NaN and +inf; row 2: all NaN;
        // the last row: -inf everywhere but one column.
        let last = cols - 1;
        xh[last / 2] = 9.0;
        xh[last] = 9.0;
        xh[cols] = f32::NAN;
        xh[cols + last] = f32::INFINITY;
        xh[2 * cols..3 * cols].fill(f32::NAN);
        xh[(rows - 1) * cols..].fill(f32::NEG_INFINITY);
        xh[rows * cols - 2] = -1e30;
        let x = a.buffer_from(&xh, &s).unwrap();
        let mut ids = a.buffer::<u32>(rows, &s).unwrap();
        k.argmax(&s, &x, rows, cols, &mut ids).unwrap();
        let want = argmax_cpu(&xh, cols);
        assert_eq!(s.clone_dtoh(&ids).unwrap(), want, "{rows} x {cols}");
        assert_eq!(want[0], (last / 2) as u32, "the tie's first");
        assert_eq!(want[1], last as u32, "+inf wins over NaN");
        assert_eq!(want[2], 0, "all NaN gives 0");
        assert_eq!(
            want[rows - 1],
            (cols - 2) as u32,
            "a finite value beats -inf"
        );
    }
    s.synchronize().unwrap();
    settled(&a);
}
