/*
 * out = (x @ qweight.T) * scale for a handful of token rows (up to 3), with int8 weights: weight-only int8's
 * decode step (``--quantization int8``, minipaged/kernels/int8.py). Two loops; the backend's calibration picks
 * the faster on the machine that runs it (``int8_one_row``).
 *
 * Why they exist: a decode step of one request is bound by reading the weights (SmolLM2 in fp32: 540 MB a
 * token). Stored as int8 with one fp32 scale per output row, the same weights are a quarter of the bytes. Both
 * loops read each int8 weight row once from memory and, while it is in the L1 cache, take its dot product with
 * every token row; the row's scale is common to the whole sum, so it is applied once at the end.
 *
 * int8_small_batch_linear (widening): each weight byte is widened to float in registers and multiplied into a
 * float sum. Three instructions for every 16 weights (widen, convert, multiply-add): with the weights in cache it
 * manages about 35 G weights/s on the CI machine, not much more than memory delivers them, so the loop never
 * gets ahead of the memory it waits on.
 *
 * int8_fixed_point_linear: the activations are turned into integers instead, so the products are integer dot
 * products (vpdpwssd: 32 int16 products summed into int32 lanes by one instruction; vpmaddwd plus an add on
 * AVX2). Each token row x gets its own scale s = max|x| / 32767 and is written as two int16 planes,
 *     x[j] / s = hi[j] + lo[j] / 2^15        (hi = round(x[j] / s), lo = round((x[j] / s - hi) * 2^15)),
 * and sum_j q[j] x[j] = s * (sum_j q[j] hi[j] + sum_j q[j] lo[j] / 2^15): two integer sums, exact. The planes
 * hold x to 2^-31 of its largest element, finer than float32's own rounding of x / s (2^-24 of each element), so
 * this is not the rounding of activations that llama.cpp's Q8_0 does (8 bits per block of 32): the result is as
 * close to the exact product as the widening loop's (float64 checks in tests/test_int8.py). A row that is not
 * finite (inf or NaN) goes to the widening loop, which propagates it as float math does.
 * Measured on the CI machine (2-core AMD EPYC with AVX-512 VNNI, one thread, one token row): with the weights in
 * cache, 44 G weights/s (the widening loop 34); streamed from memory, SmolLM2's 30 layers and LM head end to end,
 * the next rows asked for PREFETCH_BYTES ahead (the widening loop gets the same), 3.9 ms against 4.6 ms, where
 * merely reading the bytes takes 3.8 ms. In the engine, a decode step of one request: 6.75 ms against 7.01 (the
 * widening loop without the prefetch: 7.68); with the layers run as one call (cpu_decode_layers.c), 4.6-5.0 ms
 * against 5.0-5.4. The calibration's race reads a decode step's matrices in the engine's order, LM head
 * included (3.03-3.18 ms against 3.17-3.31 here); without the LM head it had been a tie, either way.
 * A tile's weight rows come from as many equal parts of the matrix (rows i, i + q, ...: long runs of memory side
 * by side, as cpu_matvec.c reads them), where they were once neighbours read with a prefetch ahead. Measured on an
 * AVX2 machine (AMD EPYC, Zen 2, no AVX-512 or VNNI; one thread, SmolLM2's int8 layers and LM head on huge pages,
 * medians of 11 runs taking turns): 1 token row 9.72 -> 9.54 ms (here the loop is bound by its arithmetic, not
 * by memory), 2 rows 19.3 -> 18.9; 3 rows 32.6 -> 24.9, where a tile is one row and the gain is the prefetch's
 * removal (a prefetch for each stream was no faster at any row count). The sums are the same, bit for bit.
 *
 * Overflow: each int32 lane sums at most CHUNK_COLS / 8 products of |q| <= 128 and |plane| <= 32768 (2^30 at
 * most), then the lane sums move to a double; rows wider than CHUNK_COLS are summed chunk by chunk.
 *
 * qweight [rows, cols] contiguous int8 (nn.Linear's layout: one output per row)
 * scale   [rows] float32
 * x       [batch, cols] contiguous float32
 * out     [batch, rows] written, never read
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Ask for the weight bytes this far ahead of the loop: one thread streaming rows of a few hundred bytes keeps
 * too few reads in flight otherwise. Measured (SmolLM2's int8 weights, one row): none 4.8 ms, 1 KB ahead 4.5,
 * 4 KB 3.9, 8 KB and 16 KB 3.9-4.0. */
#define PREFETCH_BYTES 4096
#define CHUNK_COLS 2048

static inline void prefetch_ahead(const int8_t *p, int64_t bytes)
{
    for (int64_t b = 0; b < bytes; b += 64)
        __builtin_prefetch(p + PREFETCH_BYTES + b, 0, 3);
}

void int8_small_batch_linear(const int8_t *qweight, const float *scale, const float *x, float *out,
                             int64_t batch, int64_t rows, int64_t cols, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const int8_t *w_i = qweight + i * cols;
        prefetch_ahead(w_i, cols);
        for (int64_t b = 0; b < batch; b++) {
            const float *x_b = x + b * cols;
            float total = 0.f;
#pragma omp simd reduction(+ : total)
            for (int64_t j = 0; j < cols; j++)
                total += (float)w_i[j] * x_b[j];
            out[b * rows + i] = scale[i] * total;
        }
    }
}

#if defined(__AVX2__)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
typedef __m512i vi;
#define LANES 32                                       /* int16 values a vector holds */
static inline vi widen(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vi load16(const int16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi dot_add(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); }
static inline vi zero(void) { return _mm512_setzero_si512(); }
static inline int64_t lane_sum(vi v)          /* in 64 bits: sixteen lanes near 2^30 overflow 32 */
{
    return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
                                                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}
#else
typedef __m256i vi;
#define LANES 16
static inline vi widen(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vi load16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
#if defined(__AVXVNNI__)
static inline vi dot_add(vi acc, vi a, vi b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#else
static inline vi dot_add(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif
static inline vi zero(void) { return _mm256_setzero_si256(); }
static inline int64_t lane_sum(vi v)
{
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, v);
    int64_t total = 0;
    for (int k = 0; k < 8; k++)
        total += lanes[k];
    return total;
}
#endif

/* NR weight rows i, i + q, ..., i + (NR - 1) q against NB token rows (compile-time constants where it is called,
 * so the accumulators stay in registers). planes: each token row's hi and lo planes, ``cols`` apart; x_scale:
 * their scales. */
static inline void fixed_point_tile(const int8_t *qweight, const float *scale, const int16_t *planes,
                                    const float *x_scale, float *out, int64_t i, int64_t q, int64_t rows,
                                    int64_t cols, const int NR, const int NB)
{
    double total[4][3] = {{0}};
    for (int64_t c0 = 0; c0 < cols; c0 += CHUNK_COLS) {
        const int64_t c1 = c0 + CHUNK_COLS < cols ? c0 + CHUNK_COLS : cols;
        const int64_t vector_end = c0 + (c1 - c0) / LANES * LANES;
        vi hi_sum[4][3], lo_sum[4][3];
        for (int r = 0; r < NR; r++)
            for (int b = 0; b < NB; b++)
                hi_sum[r][b] = lo_sum[r][b] = zero();
        for (int64_t j = c0; j < vector_end; j += LANES) {
            vi x_hi[3], x_lo[3];
            for (int b = 0; b < NB; b++) {
                x_hi[b] = load16(planes + (2 * b) * cols + j);
                x_lo[b] = load16(planes + (2 * b + 1) * cols + j);
            }
            for (int r = 0; r < NR; r++) {
                const vi w = widen(qweight + (i + r * q) * cols + j);
                for (int b = 0; b < NB; b++) {
                    hi_sum[r][b] = dot_add(hi_sum[r][b], w, x_hi[b]);
                    lo_sum[r][b] = dot_add(lo_sum[r][b], w, x_lo[b]);
                }
            }
        }
        for (int r = 0; r < NR; r++)
            for (int b = 0; b < NB; b++) {
                int64_t hi = lane_sum(hi_sum[r][b]), lo = lane_sum(lo_sum[r][b]);
                for (int64_t j = vector_end; j < c1; j++) {          /* a row's last cols % LANES values */
                    hi += (int64_t)qweight[(i + r * q) * cols + j] * planes[(2 * b) * cols + j];
                    lo += (int64_t)qweight[(i + r * q) * cols + j] * planes[(2 * b + 1) * cols + j];
                }
                total[r][b] += (double)hi + (double)lo * (1.0 / 32768.0);
            }
    }
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < NB; b++)
            out[b * rows + i + r * q] = (float)(scale[i + r * q] * x_scale[b] * total[r][b]);
}

/* One token row's planes; its scale, or 0 when the row is not finite (the caller then widens instead). Whether
 * a value is inf or NaN is read from its exponent bits: the library is compiled with -ffast-math, under which
 * isfinite() and comparisons may assume it never is. */
static float split_into_planes(const float *x, int16_t *hi, int16_t *lo, int64_t cols, int *finite)
{
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t any_all_ones_exponent = 0;
    float largest = 0.f;
    for (int64_t j = 0; j < cols; j++) {
        any_all_ones_exponent |= (bits[j] & 0x7f800000u) == 0x7f800000u;
        largest = fmaxf(largest, fabsf(x[j]));
    }
    *finite = !any_all_ones_exponent;
    if (!*finite || largest == 0.f) {
        for (int64_t j = 0; j < cols; j++)
            hi[j] = lo[j] = 0;
        return 0.f;
    }
    const float to_units = 32767.f / largest;
    for (int64_t j = 0; j < cols; j++) {
        const float v = x[j] * to_units, whole = nearbyintf(v);
        hi[j] = (int16_t)whole;
        lo[j] = (int16_t)nearbyintf((v - whole) * 32768.f);
    }
    return largest / 32767.f;
}
#endif

void int8_fixed_point_linear(const int8_t *qweight, const float *scale, const float *x, float *out,
                             int64_t batch, int64_t rows, int64_t cols, int num_threads)
{
#if defined(__AVX2__)
    int16_t *planes = batch <= 3 ? malloc(sizeof(int16_t) * 2 * batch * cols) : NULL;
    float x_scale[3];
    int all_finite = planes != NULL;
    for (int64_t b = 0; all_finite && b < batch; b++)
        x_scale[b] = split_into_planes(x + b * cols, planes + 2 * b * cols, planes + (2 * b + 1) * cols, cols,
                                       &all_finite);
    if (!all_finite) {                  /* inf or NaN (or no memory, or too many rows): float math says what */
        free(planes);
        int8_small_batch_linear(qweight, scale, x, out, batch, rows, cols, num_threads);
        return;
    }
    /* Weight rows a tile takes, one from each of that many equal parts of the matrix (so that it reads as many
     * long runs of memory side by side: cpu_matvec.c says why): four for one token row, fewer for more (their
     * sums share the registers). */
    const int64_t tile = batch == 1 ? 4 : batch == 2 ? 2 : 1;
    const int64_t q = rows / tile;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t i = 0; i < q; i++) {
        if (batch == 1)
            fixed_point_tile(qweight, scale, planes, x_scale, out, i, q, rows, cols, 4, 1);
        else if (batch == 2)
            fixed_point_tile(qweight, scale, planes, x_scale, out, i, q, rows, cols, 2, 2);
        else
            fixed_point_tile(qweight, scale, planes, x_scale, out, i, q, rows, cols, 1, 3);
    }
    /* The rows left over, one at a time: only one and two token rows leave any (three take tiles of one). */
    for (int64_t i = tile * q; i < rows; i++) {
        if (batch == 1)
            fixed_point_tile(qweight, scale, planes, x_scale, out, i, 0, rows, cols, 1, 1);
        else
            fixed_point_tile(qweight, scale, planes, x_scale, out, i, 0, rows, cols, 1, 2);
    }
    free(planes);
#else
    int8_small_batch_linear(qweight, scale, x, out, batch, rows, cols, num_threads);
#endif
}
