/*
 * out = (x @ qweight.T) * scale for a handful of token rows (up to 7), with int8 weights: weight-only int8's
 * decode step (``--quantization int8``, minipaged/kernels/int8.py).
 *
 * Why it exists: a decode step of one request is bound by reading the weights (SmolLM2 in fp32: 540 MB a
 * token). Stored as int8 with one fp32 scale per output row, the same weights are a quarter of the bytes;
 * this loop reads each int8 weight row once, widens it to float in registers (or, for several token rows,
 * into a small buffer in the L1 cache, so that each weight is widened once, not once per token row), takes
 * its dot product with every token row, and multiplies by the row's scale at the end (the scale is common
 * to the row, so it comes out of the sum). Activations stay fp32; nothing is rounded to int8 but the weights.
 *
 * qweight [rows, cols] contiguous int8 (nn.Linear's layout: one output per row)
 * scale   [rows] float32
 * x       [batch, cols] contiguous float32
 * out     [batch, rows] written, never read
 */
#include <stdint.h>

#define INT8_MAX_BATCH 7
#define INT8_CHUNK 256            /* columns widened at a time: 1 KiB of floats, stays in L1 */

static inline float dot_i8_f32(const int8_t *w, const float *x, int64_t n)
{
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < n; j++)
        acc += (float)w[j] * x[j];
    return acc;
}

void int8_small_batch_linear(const int8_t *qweight, const float *scale, const float *x, float *out,
                             int64_t batch, int64_t rows, int64_t cols, int num_threads)
{
    if (batch == 1) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t i = 0; i < rows; i++)
            out[i] = scale[i] * dot_i8_f32(qweight + i * cols, x, cols);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < rows; i++) {
        const int8_t *w_i = qweight + i * cols;
        float wf[INT8_CHUNK];
        float acc[INT8_MAX_BATCH] = {0};
        for (int64_t start = 0; start < cols; start += INT8_CHUNK) {
            int64_t n = cols - start < INT8_CHUNK ? cols - start : INT8_CHUNK;
#pragma omp simd
            for (int64_t j = 0; j < n; j++)
                wf[j] = (float)w_i[start + j];
            for (int64_t b = 0; b < batch; b++) {
                const float *x_b = x + b * cols + start;
                float a = 0.f;
#pragma omp simd reduction(+ : a)
                for (int64_t j = 0; j < n; j++)
                    a += wf[j] * x_b[j];
                acc[b] += a;
            }
        }
        for (int64_t b = 0; b < batch; b++)
            out[b * rows + i] = scale[i] * acc[b];
    }
}
