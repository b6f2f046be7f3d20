/* y = w x + b for one float32 row x (a decode step of one sequence): w [N, K] row-major, y [N].

   At one row a projection is a stream of its weights past a vector that stays in L1, and what matters is
   reading the weights at the machine's memory bandwidth. Four output rows at a time (four weight streams
   and four accumulators in flight, reduced once at the end), the next four rows prefetched while these
   are read, the rows split over the threads of torch's OpenMP pool. With AVX-512 this is written in its
   intrinsics (gcc's own vectorization of the same loop ran no faster than oneDNN); elsewhere a plain loop. */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ROWS 4

static inline float row_dot(const float *w, const float *x, int64_t K) {
    float a = 0.0f;
    #pragma omp simd reduction(+:a)
    for (int64_t k = 0; k < K; k++) a += w[k] * x[k];
    return a;
}

void gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t N, int64_t K,
              int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += ROWS) {
        const float *w0 = w + n0 * K;
        float out[ROWS];
#if defined(__AVX512F__)
        if (n0 + ROWS <= N && K % 16 == 0) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const float *next = w0 + ROWS * K;
            for (int64_t k = 0; k < K; k += 16) {
                const __m512 xv = _mm512_loadu_ps(x + k);
                for (int r = 0; r < ROWS; r++) _mm_prefetch((const char *)(next + r * K + k), _MM_HINT_T0);
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + k), xv, a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + K + k), xv, a1);
                a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + 2 * K + k), xv, a2);
                a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + 3 * K + k), xv, a3);
            }
            out[0] = _mm512_reduce_add_ps(a0);
            out[1] = _mm512_reduce_add_ps(a1);
            out[2] = _mm512_reduce_add_ps(a2);
            out[3] = _mm512_reduce_add_ps(a3);
        } else
#endif
        {
            for (int64_t r = 0; r < ROWS && n0 + r < N; r++) out[r] = row_dot(w0 + r * K, x, K);
        }
        for (int64_t r = 0; r < ROWS && n0 + r < N; r++) y[n0 + r] = bias ? out[r] + bias[n0 + r] : out[r];
    }
}
