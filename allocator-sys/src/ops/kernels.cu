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
// NaN). One block of THREADS threads per row. Each thread reads its elements in batches whose
// loads are all issued before the first compare (as float4 where cols is a multiple of 4 and x
// 16-byte aligned), so that a long row costs a few trips to memory, not one per element.
#define ARGMAX_BATCH 8

__device__ __forceinline__ void argmax_take(float v, u64 j, float& best, u32& bi) {
    if (v > best || (v == best && j < bi)) {
        best = v;
        bi = (u32)j;
    }
}

extern "C" __global__ void cudalloc_argmax_f32(const float* x, u32* out, u64 rows, u32 cols) {
    __shared__ float sv[THREADS];
    __shared__ u32 si[THREADS];
    const u64 r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + r * cols;
    float best = NEG_INF;
    u32 bi = cols;
    const u64 stride = blockDim.x;
    if ((cols & 3) == 0 && ((u64)x & 15) == 0) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
        const u64 n4 = cols >> 2;
        for (u64 i0 = threadIdx.x; i0 < n4; i0 += ARGMAX_BATCH * stride) {
            float4 v[ARGMAX_BATCH];
#pragma unroll
            for (int k = 0; k < ARGMAX_BATCH; ++k) {
                const u64 i = i0 + k * stride;
                v[k] = i < n4 ? row4[i] : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
            }
#pragma unroll
            for (int k = 0; k < ARGMAX_BATCH; ++k) {
                const u64 j = 4 * (i0 + k * stride);
                argmax_take(v[k].x, j, best, bi);
                argmax_take(v[k].y, j + 1, best, bi);
                argmax_take(v[k].z, j + 2, best, bi);
                argmax_take(v[k].w, j + 3, best, bi);
            }
        }
    } else {
        for (u64 j0 = threadIdx.x; j0 < cols; j0 += ARGMAX_BATCH * stride) {
            float v[ARGMAX_BATCH];
#pragma unroll
            for (int k = 0; k < ARGMAX_BATCH; ++k) {
                const u64 j = j0 + k * stride;
                v[k] = j < cols ? row[j] : NEG_INF;
            }
#pragma unroll
            for (int k = 0; k < ARGMAX_BATCH; ++k) argmax_take(v[k], j0 + k * stride, best, bi);
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

// Attention of one query per sequence over its cache: for sequence b and head h, s[j] =
// q[b, h, :] . k[b, j, h, :] * scale for j <= pos[b] (at most max_len rows), softmax over them,
// and out[b, h, :] = sum_j p[j] v[b, j, h, :]. Two ways, chosen by the launcher:
//
// - split (head_dim a multiple of 4, at most 4 * SPLIT_KEYS floats, every pointer 16-byte
//   aligned): the keys of a (sequence, head) in chunks of SPLIT_KEYS, one block each
//   (cudalloc_attention_part_f32), so that a long cache is read by many SMs at once; each block
//   keeps its chunk's maximum score m, the sum l of exp(s - m) and the output o unscaled in
//   `part`; cudalloc_attention_merge_f32 then rescales the chunks to their common maximum.
//   Rows are read as float4, several loads of a thread in flight at once.
// - one block per (sequence, head) otherwise (cudalloc_decode_attention_f32), scores kept in
//   `scores[g, :]` (max_len floats): one key per warp, lanes across head_dim, KEYS keys at a
//   time; the output one column per thread.
#define KEYS 4
#define SPLIT_KEYS 64
#define SPLIT_THREADS (2 * SPLIT_KEYS)

// The cache length of sequence b: pos[b] + 1, at most max_len.
__device__ u64 attention_len(const u32* pos, u64 b, u64 max_len) {
    const u64 len = (u64)pos[b] + 1;
    return len < max_len ? len : max_len;
}

extern "C" __global__ void cudalloc_decode_attention_f32(
    const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
    float* __restrict__ scores, float* __restrict__ out, u64 batch, u32 heads, u32 head_dim,
    u64 max_len, const u32* __restrict__ pos, float scale) {
    __shared__ float sh[32];
    const u64 g = blockIdx.x;
    if (g >= batch * heads) return;
    const u64 b = g / heads, h = g - b * heads, dim = (u64)heads * head_dim;
    const u64 len = attention_len(pos, b, max_len);
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
    const float inv = 1.0f / block_sum(sum, sh);
    float* orow = out + b * dim + h * head_dim;
    for (u32 c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float acc = 0.0f;
#pragma unroll 4
        for (u64 j = 0; j < len; ++j) acc += s[j] * vc[base + j * dim + c];
        orow[c] = acc * inv;
    }
}

__device__ float4 fma4(float p, float4 v, float4 acc) {
    return make_float4(acc.x + p * v.x, acc.y + p * v.y, acc.z + p * v.z, acc.w + p * v.w);
}

// One chunk of keys (split attention): block x = g * chunks + c for (sequence, head) g and
// chunk c, keys [c * SPLIT_KEYS, (c + 1) * SPLIT_KEYS) below the sequence's length; a chunk
// past the length does nothing (the merge does not read it). Writes o (head_dim floats) at
// part[x * head_dim] and (m, l) at part[blocks * head_dim + 2 * x], blocks = batch * heads *
// chunks. Two threads per key for the scores (alternate float4 of the row); for the output,
// groups of head_dim / 4 threads, group k summing keys k, k + groups, ..., then the groups
// added in `red`. blockDim.x is SPLIT_THREADS.
extern "C" __global__ void cudalloc_attention_part_f32(
    const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
    float* __restrict__ part, u64 batch, u32 heads, u32 head_dim, u64 max_len, u32 chunks,
    const u32* __restrict__ pos, float scale) {
    __shared__ float sh[32];
    __shared__ float s[SPLIT_KEYS];
    __shared__ float4 red[SPLIT_THREADS];
    __shared__ float4 q4[SPLIT_KEYS];
    const u64 blocks = batch * heads * chunks, x = blockIdx.x;
    // The launcher's conditions, kept here too so that no shape reads past q4 or a row.
    if (x >= blocks || blockDim.x != SPLIT_THREADS || (head_dim & 3) != 0 ||
        head_dim > 4 * SPLIT_KEYS)
        return;
    const u64 g = x / chunks, b = g / heads, h = g - b * heads, dim = (u64)heads * head_dim;
    const u64 j0 = (x - g * chunks) * SPLIT_KEYS, len = attention_len(pos, b, max_len);
    if (j0 >= len) return;
    const u32 n = len - j0 < SPLIT_KEYS ? (u32)(len - j0) : SPLIT_KEYS, d4 = head_dim >> 2;
    const float4* qr = reinterpret_cast<const float4*>(q + b * dim + h * head_dim);
    for (u32 c = threadIdx.x; c < d4; c += blockDim.x) q4[c] = qr[c];
    __syncthreads();
    // The chunk's first cache row of this head: k4[j * step + c] is float4 c of key j0 + j.
    const u64 step = dim >> 2, first = (b * max_len + j0) * dim + h * head_dim;
    const float4* k4 = reinterpret_cast<const float4*>(kc + first);
    const u32 key = threadIdx.x >> 1;
    float acc = 0.0f;
    if (key < n) {
#pragma unroll 8
        for (u32 c = threadIdx.x & 1; c < d4; c += 2) {
            const float4 kv = k4[key * step + c], qv = q4[c];
            acc += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    const float v = key < n ? acc * scale : NEG_INF;
    if ((threadIdx.x & 1) == 0 && key < n) s[key] = v;
    // block_max and block_sum end with __syncthreads: s is visible to every thread after each.
    const float m = block_max(v, sh);
    float e = 0.0f;
    if (threadIdx.x < n) {
        e = expf(s[threadIdx.x] - m);
        s[threadIdx.x] = e;
    }
    const float l = block_sum(e, sh);
    const u32 groups = blockDim.x / d4, c = threadIdx.x % d4, gi = threadIdx.x / d4;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (gi < groups) {
        const float4* v4 = reinterpret_cast<const float4*>(vc + first) + c;
#pragma unroll 4
        for (u32 j = gi; j < n; j += groups) o = fma4(s[j], v4[j * step], o);
    }
    red[threadIdx.x] = o;
    __syncthreads();
    if (threadIdx.x < d4) {
        float4 t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (u32 k = 0; k < groups; ++k) t = fma4(1.0f, red[k * d4 + threadIdx.x], t);
        reinterpret_cast<float4*>(part + x * head_dim)[threadIdx.x] = t;
    }
    if (threadIdx.x == 0) {
        part[blocks * head_dim + 2 * x] = m;
        part[blocks * head_dim + 2 * x + 1] = l;
    }
}

// The chunks of cudalloc_attention_part_f32 added up: one block per (sequence, head) g, out =
// sum_c o_c exp(m_c - M) / sum_c l_c exp(m_c - M), M the largest m_c, over the chunks that
// hold keys below the sequence's length.
extern "C" __global__ void cudalloc_attention_merge_f32(const float* __restrict__ part,
                                                        float* __restrict__ out, u64 batch,
                                                        u32 heads, u32 head_dim, u64 max_len,
                                                        u32 chunks, const u32* __restrict__ pos) {
    const u64 g = blockIdx.x, blocks = batch * heads * chunks;
    if (g >= batch * heads) return;
    const u64 b = g / heads, h = g - b * heads;
    const u64 used = (attention_len(pos, b, max_len) + SPLIT_KEYS - 1) / SPLIT_KEYS;
    const float* ml = part + blocks * head_dim + 2 * g * chunks;
    float mx = NEG_INF;
    for (u64 c = 0; c < used; ++c) mx = fmaxf(mx, ml[2 * c]);
    float l = 0.0f;
    for (u64 c = 0; c < used; ++c) l += ml[2 * c + 1] * expf(ml[2 * c] - mx);
    const float inv = 1.0f / l;
    const float* o = part + g * chunks * head_dim;
    float* orow = out + b * (u64)heads * head_dim + h * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (u64 c = 0; c < used; ++c) acc += o[c * head_dim + d] * expf(ml[2 * c] - mx);
        orow[d] = acc * inv;
    }
}

// y[r, o] = beta * y[r, o] + sum_i x[r, i] w[o, i] for r < rows (at most LINEAR_ROWS) and
// o < out: a linear layer for a few rows (a decode step's batch), w `[out, in]`, x `[rows, in]`,
// y `[rows, out]`. A block computes LINEAR_OUT outputs for a tile of rows; its threads split
// `in` (thread t takes elements t, t + blockDim.x, ...), so that the loads of a whole row of w
// are in flight at once; each keeps LINEAR_OUT x LINEAR_TILE sums, added across its warp (in
// warp_sums: one sum per lane), then across the warps in shared memory. blockIdx.x = tile +
// tiles * (output block), so the blocks that read the same rows of w run together and the
// later reads come from L2. Rows of w
// and x are read as float4 where `in` is a multiple of 4 and both pointers are 16-byte aligned,
// else as floats.
#define LINEAR_ROWS 32
#define LINEAR_TILE 8
#define LINEAR_OUT 4

template <typename V>
__device__ float dotv(V a, V b);
template <>
__device__ float dotv<float>(float a, float b) { return a * b; }
template <>
__device__ float dotv<float4>(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// This thread's LINEAR_OUT x TILE sums over its elements of `n` per row (type V); sum (a, t)
// in acc[a * TILE + t].
template <int TILE, typename V>
__device__ __forceinline__ void linear_sums(const V* w, const V* x, u32 n, u32 o0, u32 out,
                                            u32 r0, u32 rows, float (&acc)[LINEAR_OUT * TILE]) {
#pragma unroll 2
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        V wv[LINEAR_OUT];
#pragma unroll
        for (int a = 0; a < LINEAR_OUT; ++a) wv[a] = w[(u64)min(o0 + a, out - 1) * n + i];
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            const V xv = x[(u64)min(r0 + t, rows - 1) * n + i];
#pragma unroll
            for (int a = 0; a < LINEAR_OUT; ++a) acc[a * TILE + t] += dotv(wv[a], xv);
        }
    }
}

// log2 of a power of two, at compile time.
template <int N>
struct Log2 {
    static const int v = 1 + Log2<N / 2>::v;
};
template <>
struct Log2<1> {
    static const int v = 0;
};

// N values per lane (N a power of two, at most 32) added across the warp in N - 1 + log2(32 /
// N) shuffles: in round r a lane keeps half of its values and gives the other half to its
// partner across bit 16 >> r (the lane with that bit set keeps the upper half), then what is
// left is added as one value. Lane l returns the sum of value l / (32 / N). Every loop has a
// constant count, so that it unrolls and `v` stays in registers.
template <int N>
__device__ __forceinline__ float warp_sums(float (&v)[N]) {
    const u32 lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < Log2<N>::v; ++r) {
        const int half = N >> (r + 1);
        const bool upper = (lane & (16u >> r)) != 0;
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            if (i < half) {
                const float give = upper ? v[i] : v[i + half];
                const float keep = upper ? v[i + half] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, give, 16 >> r);
            }
        }
    }
    float sum = v[0];
#pragma unroll
    for (int r = Log2<N>::v; r < 5; ++r) sum += __shfl_xor_sync(0xffffffffu, sum, 16 >> r);
    return sum;
}

// One block's LINEAR_OUT x TILE outputs (see cudalloc_linear_rows_f32).
template <int TILE>
__device__ void linear_block(const float* w, const float* x, float* y, u32 rows, u32 in, u32 out,
                             float beta) {
    constexpr int N = LINEAR_OUT * TILE;
    __shared__ float red[THREADS / 32][N];
    const u32 tiles = (rows + TILE - 1) / TILE;
    const u32 tile = blockIdx.x % tiles, ob = blockIdx.x / tiles;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const u32 o0 = ob * LINEAR_OUT, r0 = tile * TILE;
    if (o0 >= out || warps > THREADS / 32) return;
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = 0.0f;
    // Rows past `out` or `rows` read the last one (in bounds) and are never written.
    if ((in & 3) == 0 && (((u64)w | (u64)x) & 15) == 0) {
        linear_sums<TILE>(reinterpret_cast<const float4*>(w), reinterpret_cast<const float4*>(x),
                          in >> 2, o0, out, r0, rows, acc);
    } else {
        linear_sums<TILE>(w, x, in, o0, out, r0, rows, acc);
    }
    const float v = warp_sums<N>(acc);
    if (lane % (32 / N) == 0) red[warp][lane / (32 / N)] = v;
    __syncthreads();
    if (threadIdx.x < N) {
        const u32 a = threadIdx.x / TILE, t = threadIdx.x % TILE;
        if (o0 + a < out && r0 + t < rows) {
            float sum = 0.0f;
            for (u32 k = 0; k < warps; ++k) sum += red[k][threadIdx.x];
            float* yp = y + (u64)(r0 + t) * out + o0 + a;
            *yp = beta == 0.0f ? sum : beta * *yp + sum;
        }
    }
}

// The tile is the smallest of 1, 2, 4 and LINEAR_TILE rows that holds `rows` (LINEAR_TILE
// beyond), so a step of few sequences sums no rows it does not have; the launcher's grid counts
// the same tiles (`linear_tile` in decode.rs).
extern "C" __global__ void cudalloc_linear_rows_f32(const float* __restrict__ w,
                                                    const float* __restrict__ x,
                                                    float* __restrict__ y, u32 rows, u32 in,
                                                    u32 out, float beta) {
    if (rows <= 1) linear_block<1>(w, x, y, rows, in, out, beta);
    else if (rows <= 2) linear_block<2>(w, x, y, rows, in, out, beta);
    else if (rows <= 4) linear_block<4>(w, x, y, rows, in, out, beta);
    else linear_block<LINEAR_TILE>(w, x, y, rows, in, out, beta);
}

// x[0..n) += v (positions after a decode step).
extern "C" __global__ void cudalloc_add_u32(u32* x, u64 n, u32 v) {
    GRID_STRIDE(i, n) x[i] += v;
}

// One thread that returns once `ns` nanoseconds of the device's global timer have passed: work
// queued behind it on its stream starts only then (what a profile uses to let the host queue
// a whole step before the device runs it).
extern "C" __global__ void cudalloc_spin_ns(u64 ns) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
