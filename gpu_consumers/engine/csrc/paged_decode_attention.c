/* Decode attention over a paged KV cache, read in place through each sequence's block table.

   One query token per sequence; the `group` query heads that share a KV head are scored together, so
   each K and V row is read from memory once per step. Softmax is online, one rescale per block. Work is
   split over (sequence, KV head) pairs with OpenMP; in a process that has imported torch the runtime is
   torch's own libgomp (same soname), so this adds no second thread pool.

   Layouts (all contiguous, row-major):
     q            [D, kv_heads, group, head_dim] float32
     k, v         [num_blocks, block_size, kv_heads, head_dim] of the cache's element type
     block_tables [D, max_blocks] int64; lens [D] int64 (context length, >= 1)
     out          [D, kv_heads, group, head_dim] float32
   Built by native_decode_attention.py: cc -O3 -march=native -fopenmp -shared. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])

#define DEFINE_KERNEL(NAME, T, LOAD)                                                                    \
void NAME(const float *q, const T *k, const T *v, const int64_t *block_tables, const int64_t *lens,     \
          float *out, int64_t D, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t block_size, \
          int64_t max_blocks, float scale, int num_threads) {                                          \
    const int64_t row = kv_heads * head_dim;        /* one position's K (or V) of every head */        \
    const int64_t block_stride = block_size * row;                                                      \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                               \
    for (int64_t item = 0; item < D * kv_heads; item++) {                                               \
        const int64_t d = item / kv_heads, h = item % kv_heads;                                         \
        const float *qd = q + item * group * head_dim;                                                  \
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

DEFINE_KERNEL(paged_decode_attention_f32, float, LOAD_F32)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, LOAD_BF16)
