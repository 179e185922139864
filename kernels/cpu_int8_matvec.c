/*
 * out = (x @ qweight.T) * scale for a handful of token rows (up to 7), with int8 weights: weight-only int8's
 * decode step (``--quantization int8``, minipaged/kernels/int8.py).
 *
 * Why it exists: a decode step of one request is bound by reading the weights (SmolLM2 in fp32: 540 MB a
 * token). Stored as int8 with one fp32 scale per output row, the same weights are a quarter of the bytes.
 * This loop reads each int8 weight row once from memory and, while it is in the L1 cache, takes its dot
 * product with every token row, widening the bytes to float in registers (the compiler vectorises the plain
 * loop with -O3 -march=native: AVX-512 or AVX2, whatever the machine has); the row's scale is common to the
 * whole sum, so it is applied once at the end. Activations stay fp32: only the weights were rounded.
 *
 * Measured on the CI machine (busy 2-core AMD EPYC with AVX-512, one thread, SmolLM2's 30 layers of q|k|v, o,
 * gate|up and down, weights far larger than the caches), fp32 compiled loop (cpu_matvec.c) -> this: 1 row
 * 33.9 -> 12.4 ms, 2 rows 40.9 -> 17.1, 4 rows 50.5 -> 38.8, 7 rows 73.7 -> 66.7 ms (the LM head, 1 row: 5.3 -> 2.2 ms). Two variants were slower and
 * dropped: widening each chunk of a row once into an L1 buffer shared by the token rows (2 rows: 37 ms), and
 * GCC vector extensions with one register accumulator per token row (1 row: 85 ms).
 *
 * qweight [rows, cols] contiguous int8 (nn.Linear's layout: one output per row)
 * scale   [rows] float32
 * x       [batch, cols] contiguous float32
 * out     [batch, rows] written, never read
 */
#include <stdint.h>

void int8_small_batch_linear(const int8_t *qweight, const float *scale, const float *x, float *out,
                             int64_t batch, int64_t rows, int64_t cols, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < rows; i++) {
        const int8_t *w_i = qweight + i * cols;
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
