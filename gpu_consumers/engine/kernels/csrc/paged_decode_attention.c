/* Decode attention over a paged KV cache, read in place through each sequence's block table.

   One query token per sequence; the `group` query heads that share a KV head are scored together, so
   each K and V row is read from memory once per step. Softmax is online, one rescale per block. Work is
   split over (sequence, KV head) pairs with OpenMP; in a process that has imported torch the runtime is
   torch's own libgomp (same soname), so this adds no second thread pool.

   Layouts (all contiguous, row-major):
     q            [D, kv_heads, group, head_dim] float32, rows q_row_stride elements apart (a q|k|v row's
                  leading part, read where the projection put it)
     k, v         [num_blocks, block_size, kv_heads, head_dim] of the cache's element type
     block_tables [D, max_blocks] int64; lens [D] int64 (context length, >= 1)
     out          [D, kv_heads, group, head_dim] float32
   Built by native_library.py: cc -O3 -march=native -fopenmp -shared.

   Two implementations of one contract. Where the compiler targets AVX-512 and the shape is a common one
   (head_dim 64 or 128, group <= 8, block_size <= 16), a block's 16 scores of a query head are one vector:
   its max, exp and sum are vector operations, the group's accumulators stay in registers, and the next
   block's rows are prefetched, since blocks lie wherever the pool put them and no hardware prefetcher can
   guess the next one. Every other shape runs the portable loop below, which is what the compiler
   vectorizes by itself. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])

#define DEFINE_PORTABLE(NAME, T, LOAD)                                                                  \
static void NAME(const float *q, int64_t q_row_stride, const T *k, const T *v, const int64_t *block_tables, \
          const int64_t *lens, float *out, int64_t D, int64_t kv_heads, int64_t group, int64_t head_dim, \
          int64_t block_size, int64_t max_blocks, float scale, int num_threads) {                       \
    const int64_t row = kv_heads * head_dim;        /* one position's K (or V) of every head */        \
    const int64_t block_stride = block_size * row;                                                      \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                               \
    for (int64_t item = 0; item < D * kv_heads; item++) {                                               \
        const int64_t d = item / kv_heads, h = item % kv_heads;                                         \
        const float *qd = q + d * q_row_stride + h * group * head_dim;                                  \
        float acc[group][head_dim];                                                                     \
        float m[group], l[group], s[group][block_size];                                                 \
        memset(acc, 0, sizeof acc);                                                                     \
        for (int64_t g = 0; g < group; g++) { m[g] = -INFINITY; l[g] = 0.0f; }                           \
        const int64_t len = lens[d];                                                                    \
        const int64_t nblocks = (len + block_size - 1) / block_size;                                    \
        for (int64_t j = 0; j < nblocks; j++) {                                                         \
            const int64_t base = block_tables[d * max_blocks + j] * block_stride + h * head_dim;       \
            const int64_t n = (j == nblocks - 1) ? len - j * block_size : block_size;                   \
            for (int64_t g = 0; g < group; g++) {                                                       \
                const float *qg = qd + g * head_dim;                                                    \
                float block_max = -INFINITY;                                                            \
                for (int64_t p = 0; p < n; p++) {                                                       \
                    const T *kp = k + base + p * row;                                                   \
                    float dot = 0.0f;                                                                   \
                    _Pragma("omp simd reduction(+:dot)")                                                \
                    for (int64_t e = 0; e < head_dim; e++) dot += qg[e] * LOAD(kp, e);                  \
                    s[g][p] = dot * scale;                                                              \
                    if (s[g][p] > block_max) block_max = s[g][p];                                       \
                }                                                                                       \
                const float new_m = block_max > m[g] ? block_max : m[g];                                \
                const float correction = expf(m[g] - new_m);                                            \
                l[g] *= correction;                                                                     \
                for (int64_t e = 0; e < head_dim; e++) acc[g][e] *= correction;                         \
                m[g] = new_m;                                                                           \
                for (int64_t p = 0; p < n; p++) { s[g][p] = expf(s[g][p] - new_m); l[g] += s[g][p]; }   \
            }                                                                                           \
            for (int64_t p = 0; p < n; p++) {                                                           \
                const T *vp = v + base + p * row;                                                       \
                for (int64_t g = 0; g < group; g++) {                                                   \
                    const float w = s[g][p];                                                            \
                    for (int64_t e = 0; e < head_dim; e++) acc[g][e] += w * LOAD(vp, e);                \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        float *od = out + item * group * head_dim;                                                      \
        for (int64_t g = 0; g < group; g++)                                                             \
            for (int64_t e = 0; e < head_dim; e++) od[g * head_dim + e] = acc[g][e] / l[g];             \
    }                                                                                                   \
}

DEFINE_PORTABLE(portable_f32, float, LOAD_F32)
DEFINE_PORTABLE(portable_bf16, uint16_t, LOAD_BF16)

#if defined(__AVX512F__)

#define MAX_GROUP 8
#ifndef PREFETCH
#define PREFETCH 1
#endif
#define LANES 16

/* exp of 16 lanes, x <= 0 (scores minus their running max): x = n ln2 + r with ln2 split in two (Cody and
   Waite) so r is exact, e^r by a degree-6 polynomial on |r| <= ln2/2 (~1 ulp), 2^n by scalef. Lanes below
   -88 underflow to 0, as expf does; -inf gives 0. */
static inline __m512 exp_lanes(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* One (sequence, KV head) item. CHUNKS = head_dim / 16 and G are compile-time constants at every call
   (the switch below), so acc[G][CHUNKS] and the query lives in registers. */
#define DEFINE_ITEM(NAME, T, LOAD16)                                                                    \
static inline __attribute__((always_inline)) void NAME(                                                  \
        const float *qd, const T *k, const T *v, const int64_t *table, int64_t len, float *od,          \
        int64_t row, int64_t block_stride, int64_t head_offset, int64_t block_size, float scale,        \
        const int CHUNKS, const int G) {                                                                 \
    __m512 qv[MAX_GROUP][8], acc[MAX_GROUP][8];                                                          \
    float m[MAX_GROUP], l[MAX_GROUP];                                                                    \
    for (int g = 0; g < G; g++) {                                                                        \
        for (int c = 0; c < CHUNKS; c++) {                                                               \
            qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(qd + (g * CHUNKS + c) * LANES), _mm512_set1_ps(scale)); \
            acc[g][c] = _mm512_setzero_ps();                                                             \
        }                                                                                                \
        m[g] = -INFINITY; l[g] = 0.0f;                                                                   \
    }                                                                                                    \
    const int64_t nblocks = (len + block_size - 1) / block_size;                                         \
    const int64_t row_bytes = CHUNKS * LANES * (int64_t)sizeof(T);                                       \
    for (int64_t j = 0; j < nblocks; j++) {                                                              \
        const int64_t base = table[j] * block_stride + head_offset;                                      \
        const int n = (int)((j == nblocks - 1) ? len - j * block_size : block_size);                     \
        if (PREFETCH && j + 1 < nblocks) {                                                                         \
            const char *nk = (const char *)(k + table[j + 1] * block_stride + head_offset);              \
            const char *nv = (const char *)(v + table[j + 1] * block_stride + head_offset);              \
            for (int64_t p = 0; p < block_size; p++)                                                     \
                for (int64_t b = 0; b < row_bytes; b += 64) {                                            \
                    _mm_prefetch(nk + p * row * (int64_t)sizeof(T) + b, _MM_HINT_T0);                    \
                    _mm_prefetch(nv + p * row * (int64_t)sizeof(T) + b, _MM_HINT_T0);                    \
                }                                                                                        \
        }                                                                                                \
        float s[MAX_GROUP][LANES];                                                                       \
        for (int p = 0; p < n; p++) {                                                                    \
            const T *kp = k + base + p * row;                                                            \
            __m512 kc[8];                                                                                \
            for (int c = 0; c < CHUNKS; c++) kc[c] = LOAD16(kp + c * LANES);                             \
            for (int g = 0; g < G; g++) {                                                                \
                __m512 t = _mm512_mul_ps(qv[g][0], kc[0]);                                               \
                for (int c = 1; c < CHUNKS; c++) t = _mm512_fmadd_ps(qv[g][c], kc[c], t);                \
                s[g][p] = _mm512_reduce_add_ps(t);                                                       \
            }                                                                                            \
        }                                                                                                \
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);                                             \
        float w[MAX_GROUP][LANES];                                                                       \
        for (int g = 0; g < G; g++) {                                                                    \
            const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, s[g]);              \
            const float block_max = _mm512_reduce_max_ps(sv);                                            \
            if (block_max > m[g]) {                                                                      \
                const float correction = expf(m[g] - block_max);                                         \
                l[g] *= correction;                                                                      \
                const __m512 cv = _mm512_set1_ps(correction);                                            \
                for (int c = 0; c < CHUNKS; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], cv);               \
                m[g] = block_max;                                                                        \
            }                                                                                            \
            const __m512 pv = exp_lanes(_mm512_sub_ps(sv, _mm512_set1_ps(m[g])));                        \
            l[g] += _mm512_reduce_add_ps(pv);                                                            \
            _mm512_storeu_ps(w[g], pv);                                                                  \
        }                                                                                                \
        for (int p = 0; p < n; p++) {                                                                    \
            const T *vp = v + base + p * row;                                                            \
            __m512 vc[8];                                                                                \
            for (int c = 0; c < CHUNKS; c++) vc[c] = LOAD16(vp + c * LANES);                             \
            for (int g = 0; g < G; g++) {                                                                \
                const __m512 wv = _mm512_set1_ps(w[g][p]);                                               \
                for (int c = 0; c < CHUNKS; c++) acc[g][c] = _mm512_fmadd_ps(wv, vc[c], acc[g][c]);      \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    for (int g = 0; g < G; g++) {                                                                        \
        const __m512 inv = _mm512_set1_ps(1.0f / l[g]);                                                  \
        for (int c = 0; c < CHUNKS; c++)                                                                 \
            _mm512_storeu_ps(od + (g * CHUNKS + c) * LANES, _mm512_mul_ps(acc[g][c], inv));              \
    }                                                                                                    \
}

DEFINE_ITEM(item_f32, float, load16_f32)
DEFINE_ITEM(item_bf16, uint16_t, load16_bf16)

#define GROUP_CASES(ITEM, CH)                                                                           \
    switch (group) {                                                                                     \
    case 1: ITEM(ARGS, CH, 1); break; case 2: ITEM(ARGS, CH, 2); break;                                 \
    case 3: ITEM(ARGS, CH, 3); break; case 4: ITEM(ARGS, CH, 4); break;                                 \
    case 5: ITEM(ARGS, CH, 5); break; case 6: ITEM(ARGS, CH, 6); break;                                 \
    case 7: ITEM(ARGS, CH, 7); break; default: ITEM(ARGS, CH, 8); break;                                \
    }

#define DEFINE_VECTOR(NAME, T, ITEM)                                                                    \
static void NAME(const float *q, int64_t q_row_stride, const T *k, const T *v, const int64_t *block_tables, \
          const int64_t *lens, float *out, int64_t D, int64_t kv_heads, int64_t group, int64_t head_dim, \
          int64_t block_size, int64_t max_blocks, float scale, int num_threads) {                       \
    const int64_t row = kv_heads * head_dim, block_stride = block_size * row;                          \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                               \
    for (int64_t item = 0; item < D * kv_heads; item++) {                                               \
        const int64_t d = item / kv_heads, h = item % kv_heads;                                         \
        const float *qd = q + d * q_row_stride + h * group * head_dim;                                  \
        float *od = out + item * group * head_dim;                                                      \
        if (head_dim == 64) {                                                                           \
            GROUP_CASES(ITEM, 4)                                                                        \
        } else {                                                                                        \
            GROUP_CASES(ITEM, 8)                                                                        \
        }                                                                                               \
    }                                                                                                   \
}
#define ARGS qd, k, v, block_tables + d * max_blocks, lens[d], od, row, block_stride, h * head_dim, \
             block_size, scale

DEFINE_VECTOR(vector_f32, float, item_f32)
DEFINE_VECTOR(vector_bf16, uint16_t, item_bf16)

static int vector_applies(int64_t group, int64_t head_dim, int64_t block_size) {
    return (head_dim == 64 || head_dim == 128) && group >= 1 && group <= MAX_GROUP && block_size <= LANES;
}
#else
static int vector_applies(int64_t group, int64_t head_dim, int64_t block_size) {
    (void)group; (void)head_dim; (void)block_size;
    return 0;
}
#define vector_f32 portable_f32
#define vector_bf16 portable_bf16
#endif

#define DEFINE_ENTRY(NAME, T, VECTOR, PORTABLE)                                                         \
void NAME(const float *q, int64_t q_row_stride, const T *k, const T *v, const int64_t *block_tables,     \
          const int64_t *lens, float *out, int64_t D, int64_t kv_heads, int64_t group, int64_t head_dim, \
          int64_t block_size, int64_t max_blocks, float scale, int num_threads) {                       \
    (vector_applies(group, head_dim, block_size) ? VECTOR : PORTABLE)(                                  \
        q, q_row_stride, k, v, block_tables, lens, out, D, kv_heads, group, head_dim, block_size,       \
        max_blocks, scale, num_threads);                                                                \
}

DEFINE_ENTRY(paged_decode_attention_f32, float, vector_f32, portable_f32)
DEFINE_ENTRY(paged_decode_attention_bf16, uint16_t, vector_bf16, portable_bf16)
