/*
 * out = x @ weight.T for a handful of token rows (up to 7): the matrix-vector products of a small decode batch.
 *
 * Why it exists: a decode step with one request (`minipaged generate`, a speculative draft, the verification
 * of a few drafted tokens) multiplies each weight matrix by one to seven token rows. That is memory-bound: the
 * step must read every weight once (SmolLM2: 540 MB), and does two flops per weight it reads. torch's CPU
 * matmul is built for large products and streams the weights here at about half the machine's speed; this
 * loop reads each weight row once, in order, and takes its dot product with every token row while the
 * weight row is in the L1 cache. Measured on the CI machine (2-core AMD EPYC, one thread, SmolLM2's 30 layers
 * of q|k|v, o, gate|up and down, weights far larger than the caches): 1 row 34.9 -> 17.2 ms, 2 rows 57.7
 * -> 20.9 ms, 4 rows 46.0 -> 31.7 ms, 5 rows 54.3 -> 36.5 ms, 6 rows 56.0 -> 41.8 ms, 7 rows 61.9 -> 48.5 ms; at
 * 8 rows torch is as fast or faster (54.2 vs 56.8, 59.6 vs 62.9 ms), so the engine uses this up to 7
 * (minipaged/kernels/cpu_linear.py). That covers checking 3 or 5 drafted tokens of one request.
 *
 * weight [rows, cols] contiguous float32 (nn.Linear's layout: one output per row)
 * x      [batch, cols] contiguous float32
 * out    [batch, rows] written, never read
 */
#include <stdint.h>

void small_batch_linear(const float *weight, const float *x, float *out, int64_t batch, int64_t rows,
                        int64_t cols, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < rows; i++) {
        const float *w_i = weight + i * cols;
        for (int64_t b = 0; b < batch; b++) {
            const float *x_b = x + b * cols;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t j = 0; j < cols; j++)
                acc += w_i[j] * x_b[j];
            out[b * rows + i] = acc;
        }
    }
}
