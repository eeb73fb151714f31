//! The same transformer on the CPU, straight from the definitions (no cache: every call runs the
//! whole sequence), accumulating in `f64`. The engine's logits are checked against it.

use super::model::{Shape, Weights};

/// `y[out] = W[out, in] x[in]`.
fn matvec(w: &[f32], x: &[f64], out: usize) -> Vec<f64> {
    let inp = x.len();
    (0..out)
        .map(|o| {
            let row = &w[o * inp..(o + 1) * inp];
            row.iter().zip(x).map(|(a, b)| *a as f64 * b).sum()
        })
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(v, g)| v * inv * *g as f64).collect()
}

/// Rotary embedding of one `[heads, head_dim]` row at position `pos`.
fn rope(x: &mut [f64], heads: usize, hd: usize, pos: usize, theta: f32) {
    for h in 0..heads {
        for p in 0..hd / 2 {
            let freq = (theta as f64).powf(-2.0 * p as f64 / hd as f64);
            let (s, c) = (pos as f64 * freq).sin_cos();
            let (i, j) = (h * hd + 2 * p, h * hd + 2 * p + 1);
            let (a, b) = (x[i], x[j]);
            x[i] = a * c - b * s;
            x[j] = a * s + b * c;
        }
    }
}

/// Logits of the last of `tokens`.
pub fn logits(s: &Shape, w: &Weights<Vec<f32>>, tokens: &[u32]) -> Vec<f64> {
    let (d, h, hd) = (s.hidden, s.heads, s.head_dim());
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            let t = t as usize;
            w.embed[t * d..(t + 1) * d]
                .iter()
                .map(|v| *v as f64)
                .collect()
        })
        .collect();
    for l in &w.layers {
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let hn = rmsnorm(x, &l.attn_norm, s.eps);
            let mut q = matvec(&l.wq, &hn, d);
            let mut k = matvec(&l.wk, &hn, d);
            rope(&mut q, h, hd, pos, s.theta);
            rope(&mut k, h, hd, pos, s.theta);
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&l.wv, &hn, d));
        }
        for (i, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0f64; d];
            for head in 0..h {
                let r = head * hd..(head + 1) * hd;
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let dot: f64 = qs[i][r.clone()]
                            .iter()
                            .zip(&ks[j][r.clone()])
                            .map(|(a, b)| a * b)
                            .sum();
                        dot / (hd as f64).sqrt()
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|v| (v - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    for c in r.clone() {
                        att[c] += p / sum * vs[j][c];
                    }
                }
            }
            let o = matvec(&l.wo, &att, d);
            x.iter_mut().zip(o).for_each(|(a, b)| *a += b);
            let hn = rmsnorm(x, &l.mlp_norm, s.eps);
            let g = matvec(&l.w1, &hn, s.ffn);
            let u = matvec(&l.w3, &hn, s.ffn);
            let a: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = matvec(&l.w2, &a, d);
            x.iter_mut().zip(down).for_each(|(a, b)| *a += b);
        }
    }
    let last = xs.last().expect("at least one token");
    let hn = rmsnorm(last, &w.final_norm, s.eps);
    matvec(&w.lm_head, &hn, s.vocab)
}

/// `max |got - want| / max |want|`.
pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs()));
    if got.len() != want.len() || got.iter().any(|g| !g.is_finite()) {
        return f64::INFINITY;
    }
    diff / scale
}

/// Index of the largest value (the first on ties).
pub fn argmax(v: &[f64]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}
