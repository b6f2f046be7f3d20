/* The small operations between a decoder layer's matrix products, for CPUs, each one call instead of the
   several torch operations it replaces: at a decode step's few rows these operations cost less in
   arithmetic than in being dispatched one by one (30 layers x ~25 calls a step), so one call each pays.

     add_rms_norm_f32   h += delta (when given), then out = h * rsqrt(mean(h^2) + eps) * w, row by row
     rope_store_kv_f32  rotates the q and k heads of each qkv row in place (rotate-half rope, the
                        position's cos/sin rows read from the tables), then writes the row's k and v heads
                        into the float32 KV cache at the row's slot
     silu_mul_f32       out = silu(gate) * up, gate and up the two halves of each row

   Plain loops that the compiler vectorizes for whatever the machine has (-O3 -march=native); the
   exponential is written out so that it vectorizes too (libm's expf does not, without -ffast-math).
   Built without contracting a*b + c into one fused multiply-add (-ffp-contract=off), so that rope rounds
   as torch's x*cos + rot(x)*sin does: bitwise the same. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_ELEMENTS 65536  /* below this many elements a parallel region costs more than it saves */

void add_rms_norm_f32(float *h, const float *delta, const float *w, float *out, int64_t rows, int64_t n,
                      float eps, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * n;
        if (delta) {
            const float *dr = delta + r * n;
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) hr[i] += dr[i];
        }
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < n; i++) ss += hr[i] * hr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        float *orow = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) orow[i] = (hr[i] * inv) * w[i];
    }
}

void rope_store_kv_f32(float *qkv, int64_t rows, int64_t row_stride, const float *cos_table,
                       const float *sin_table, const int64_t *positions, int64_t q_heads, int64_t kv_heads,
                       int64_t head_dim, float *k_cache, float *v_cache, const int64_t *slots, int num_threads) {
    const int64_t half = head_dim / 2, kv_row = kv_heads * head_dim;
    #pragma omp parallel for num_threads(num_threads) if (rows * row_stride >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * row_stride;
        const float *c = cos_table + positions[r] * head_dim, *s = sin_table + positions[r] * head_dim;
        for (int64_t head = 0; head < q_heads + kv_heads; head++) {
            float *x = row + head * head_dim;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] + (-b) * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
        const int64_t slot = slots[r];
        memcpy(k_cache + slot * kv_row, row + q_heads * head_dim, (size_t)kv_row * sizeof(float));
        memcpy(v_cache + slot * kv_row, row + (q_heads + kv_heads) * head_dim, (size_t)kv_row * sizeof(float));
    }
}

/* e^x for |x| <= 88: x = n ln2 + r (ln2 in two parts, so r is exact), e^r by a degree-6 polynomial on
   |r| <= ln2/2, 2^n put in the exponent bits. Within a few ulp of expf. */
static inline float exp_vectorizable(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const union { int32_t bits; float value; } scale = {((int32_t)n + 127) << 23};
    return p * scale.value;
}

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_vectorizable(-g[i])) * u[i];
    }
}
