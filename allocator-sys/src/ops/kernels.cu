// The kernels of `cudalloc_sys::ops`, compiled at run time with NVRTC.
//
// Every launcher in ops.rs checks the lengths of the buffers it passes against the sizes given
// here before launching; each kernel also keeps its indices below those sizes. Row kernels
// (rmsnorm, softmax, argmax) run one block of exactly THREADS threads per row.

typedef unsigned long long u64;
typedef unsigned int u32;

#define THREADS 256
#define NEG_INF __int_as_float((int)0xff800000u)
#define QNAN __int_as_float(0x7fc00000)

#define GRID_STRIDE(i, n) \
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// Sum over the block; every thread gets the result. `sh` holds 32 floats.
__device__ float block_sum(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = (threadIdx.x < (blockDim.x >> 5)) ? sh[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    const float r = sh[0];
    __syncthreads();
    return r;
}

// Maximum over the block; every thread gets the result. `sh` holds 32 floats.
__device__ float block_max(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = (threadIdx.x < (blockDim.x >> 5)) ? sh[lane] : NEG_INF;
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    const float r = sh[0];
    __syncthreads();
    return r;
}

// x[0..n) = v
extern "C" __global__ void cudalloc_fill_f32(float* x, u64 n, float v) {
    GRID_STRIDE(i, n) x[i] = v;
}

// dst[0..n) = src[0..n) (the launcher passes pointers already offset)
extern "C" __global__ void cudalloc_copy_f32(const float* src, float* dst, u64 n) {
    GRID_STRIDE(i, n) dst[i] = src[i];
}

// out[r, c] = table[ids[r], c] for r < rows, c < dim; NaN for an id >= vocab.
extern "C" __global__ void cudalloc_embedding_f32(const float* table, const u32* ids, float* out,
                                                  u64 rows, u64 dim, u64 vocab) {
    const u64 n = rows * dim;
    GRID_STRIDE(i, n) {
        const u64 r = i / dim, c = i - r * dim;
        const u64 id = ids[r];
        out[i] = id < vocab ? table[id * dim + c] : QNAN;
    }
}

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w   (one block per row)
extern "C" __global__ void cudalloc_rmsnorm_f32(const float* x, const float* w, float* out,
                                                u64 rows, u32 dim, float eps) {
    __shared__ float sh[32];
    const u64 r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * dim;
    float* orow = out + r * dim;
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss, sh);
    const float inv = rsqrtf(ss / (float)dim + eps);
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) orow[c] = xr[c] * inv * w[c];
}

// Rotary position embedding, in place, on x[rows, heads, head_dim]: the pair (2p, 2p + 1) of
// row r turns by (pos0 + r) * theta^(-2p / head_dim). Angles in double precision.
extern "C" __global__ void cudalloc_rope_f32(float* x, u64 rows, u32 heads, u32 head_dim,
                                             u64 pos0, float theta) {
    const u64 half = head_dim / 2;
    const u64 n = rows * heads * half;
    GRID_STRIDE(i, n) {
        const u64 p = i % half, t = i / half;
        const u64 h = t % heads, r = t / heads;
        const double freq = pow((double)theta, -2.0 * (double)p / (double)head_dim);
        const double ang = (double)(pos0 + r) * freq;
        const float c = (float)cos(ang), s = (float)sin(ang);
        const u64 base = (r * heads + h) * head_dim + 2 * p;
        const float a = x[base], b = x[base + 1];
        x[base] = a * c - b * s;
        x[base + 1] = a * s + b * c;
    }
}

// Causal softmax, in place, on s[total_rows, cols] where row g is query g % rows at position
// pos0 + g % rows: columns past that position become 0. One block per row.
extern "C" __global__ void cudalloc_softmax_causal_f32(float* s, u64 total_rows, u32 rows,
                                                       u32 cols, u64 pos0) {
    __shared__ float sh[32];
    const u64 g = blockIdx.x;
    if (g >= total_rows) return;
    u64 lim = pos0 + g % rows + 1;
    if (lim > cols) lim = cols;
    float* row = s + g * cols;
    float m = NEG_INF;
    for (u64 j = threadIdx.x; j < lim; j += blockDim.x) m = fmaxf(m, row[j]);
    m = block_max(m, sh);
    float sum = 0.0f;
    for (u64 j = threadIdx.x; j < lim; j += blockDim.x) sum += expf(row[j] - m);
    sum = block_sum(sum, sh);
    const float inv = 1.0f / sum;
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) row[j] = j < lim ? expf(row[j] - m) * inv : 0.0f;
}

// out = silu(a) * b, elementwise over n.
extern "C" __global__ void cudalloc_silu_mul_f32(const float* a, const float* b, float* out, u64 n) {
    GRID_STRIDE(i, n) {
        const float v = a[i];
        out[i] = v / (1.0f + expf(-v)) * b[i];
    }
}

// out[r] = index of the largest x[r, :] (the first one on ties; NaN never wins; 0 if all are
// NaN). One block of THREADS threads per row.
extern "C" __global__ void cudalloc_argmax_f32(const float* x, u32* out, u64 rows, u32 cols) {
    __shared__ float sv[THREADS];
    __shared__ u32 si[THREADS];
    const u64 r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + r * cols;
    float best = NEG_INF;
    u32 bi = cols;
    for (u32 j = threadIdx.x; j < cols; j += blockDim.x) {
        const float v = row[j];
        if (v > best || (v == best && j < bi)) {
            best = v;
            bi = j;
        }
    }
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (u32 s = THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = sv[threadIdx.x + s];
            const u32 oi = si[threadIdx.x + s];
            if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[r] = si[0] < cols ? si[0] : 0;
}

// ---------------------------------------------------------------------------------------------
// The batched decode step (the engine's CUDA graphs): one token per sequence, every position
// read from device memory, so that a graph captured once runs at any position. Sequence r's
// cache rows live at [r * max_len, (r + 1) * max_len) of a [slots, max_len, dim] cache; pos[r]
// is the position of its new token. A position at or past max_len writes nothing and reads at
// most max_len cache rows.

// Rotary position embedding, in place, on x[rows, heads, head_dim]: as cudalloc_rope_f32, row r
// at position pos[r].
extern "C" __global__ void cudalloc_rope_at_f32(float* x, u64 rows, u32 heads, u32 head_dim,
                                                const u32* pos, float theta) {
    const u64 half = head_dim / 2;
    const u64 n = rows * heads * half;
    GRID_STRIDE(i, n) {
        const u64 p = i % half, t = i / half;
        const u64 h = t % heads, r = t / heads;
        const double freq = pow((double)theta, -2.0 * (double)p / (double)head_dim);
        const double ang = (double)pos[r] * freq;
        const float c = (float)cos(ang), s = (float)sin(ang);
        const u64 base = (r * heads + h) * head_dim + 2 * p;
        const float a = x[base], b = x[base + 1];
        x[base] = a * c - b * s;
        x[base + 1] = a * s + b * c;
    }
}

// cache[r * max_len + pos[r], :] = src[r, :] for r < rows (rows of dim floats); nothing for a
// position >= max_len.
extern "C" __global__ void cudalloc_store_rows_f32(const float* src, float* cache, u64 rows,
                                                   u64 dim, u64 max_len, const u32* pos) {
    const u64 n = rows * dim;
    GRID_STRIDE(i, n) {
        const u64 r = i / dim, c = i - r * dim;
        const u64 p = pos[r];
        if (p < max_len) cache[(r * max_len + p) * dim + c] = src[i];
    }
}

// Attention of one query per sequence over its cache: for sequence b and head h (one block
// each, g = b * heads + h), s[j] = q[b, h, :] . k[b, j, h, :] * scale for j <= pos[b] (at most
// max_len rows), softmax over them (kept in scores[g, :], max_len floats), and
// out[b, h, :] = sum_j p[j] v[b, j, h, :]. Scores: each warp takes KEYS keys at a time, its lanes
// across head_dim.
// Output: with head_dim <= THREADS / 2, THREADS / head_dim groups of threads each sum every
// groups-th key for all head_dim columns, then the groups' partial sums are added in `red`.
#define KEYS 4

extern "C" __global__ void cudalloc_decode_attention_f32(
    const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
    float* __restrict__ scores, float* __restrict__ out, u64 batch, u32 heads, u32 head_dim,
    u64 max_len, const u32* __restrict__ pos, float scale) {
    __shared__ float sh[32];
    __shared__ float red[THREADS];
    const u64 g = blockIdx.x;
    if (g >= batch * heads) return;
    const u64 b = g / heads, h = g - b * heads, dim = (u64)heads * head_dim;
    u64 len = (u64)pos[b] + 1;
    if (len > max_len) len = max_len;
    const float* qr = q + b * dim + h * head_dim;
    const u64 base = b * max_len * dim + h * head_dim;
    float* s = scores + g * max_len;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float m = NEG_INF;
    // KEYS keys per warp at a time, so that their loads are in flight together.
    for (u64 j0 = (u64)warp * KEYS; j0 < len; j0 += (u64)warps * KEYS) {
        float dot[KEYS];
#pragma unroll
        for (int u = 0; u < KEYS; ++u) {
            float acc = 0.0f;
            if (j0 + u < len) {
                const float* kr = kc + base + (j0 + u) * dim;
                for (u32 c = lane; c < head_dim; c += 32) acc += qr[c] * kr[c];
            }
            dot[u] = acc;
        }
#pragma unroll
        for (int u = 0; u < KEYS; ++u) {
            float v = dot[u];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            v *= scale;
            if (j0 + u < len) {
                if (lane == 0) s[j0 + u] = v;
                m = fmaxf(m, v);
            }
        }
    }
    // block_max and block_sum end with __syncthreads: the s[j] written before each are
    // visible to every thread after it.
    m = block_max(m, sh);
    float sum = 0.0f;
    for (u64 j = threadIdx.x; j < len; j += blockDim.x) {
        const float e = expf(s[j] - m);
        s[j] = e;
        sum += e;
    }
    sum = block_sum(sum, sh);
    const float inv = 1.0f / sum;
    float* orow = out + b * dim + h * head_dim;
    if (2 * head_dim <= blockDim.x) {
        const u32 groups = blockDim.x / head_dim;
        const u32 c = threadIdx.x % head_dim, gi = threadIdx.x / head_dim;
        float acc = 0.0f;
        if (gi < groups) {
#pragma unroll 8
            for (u64 j = gi; j < len; j += groups) acc += s[j] * vc[base + j * dim + c];
        }
        red[threadIdx.x] = acc;
        __syncthreads();
        if (threadIdx.x < head_dim) {
            float t = 0.0f;
            for (u32 k = 0; k < groups; ++k) t += red[k * head_dim + threadIdx.x];
            orow[threadIdx.x] = t * inv;
        }
    } else {
        for (u32 c = threadIdx.x; c < head_dim; c += blockDim.x) {
            float acc = 0.0f;
#pragma unroll 4
            for (u64 j = 0; j < len; ++j) acc += s[j] * vc[base + j * dim + c];
            orow[c] = acc * inv;
        }
    }
}

// x[0..n) += v (positions after a decode step).
extern "C" __global__ void cudalloc_add_u32(u32* x, u64 n, u32 v) {
    GRID_STRIDE(i, n) x[i] += v;
}
