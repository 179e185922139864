/*
 * out = x @ weight.T for a handful of token rows (up to 7): the matrix-vector products of a small decode batch.
 *
 * Why it exists: a decode step with one request (`minipaged generate`, a speculative draft, the verification
 * of a few drafted tokens) multiplies each weight matrix by one to seven token rows. That is memory-bound: the
 * step must read every weight once (SmolLM2: 540 MB), and does two flops per weight it reads. torch's CPU
 * matmul is built for large products and streams the weights here at about half the machine's speed; this
 * loop reads each weight row once, in order, while the weight row is in the L1 cache.
 *
 * Each vector of the weight row, loaded once, is multiplied into every token row of a group of up to four
 * (two accumulators a token row, the even and the odd vectors, so that the multiply-adds do not wait on each
 * other): four token rows cost little more than one, so a speculative verification of three drafts (four rows)
 * costs about what a decode does. Measured with the thread's CPU time (clock_gettime(CLOCK_THREAD_CPUTIME_ID),
 * one thread, on the CI machine while other jobs shared it, so only the ratios mean much; SmolLM2's 30 layers of
 * q|k|v, o, gate|up and down), the earlier loop (one dot product per token row) -> this one: 1 row 13.1 -> 12.9
 * ms, 2 rows 18.5 -> 14.2, 4 rows 23.3 -> 16.8, 5 rows 35.4 -> 23.0, 7 rows 40.7 -> 28.0 (the tiled multiply,
 * cpu_tiled_linear.c: 13.2, 14.0, 24.3, 24.6, 27.6).
 *
 * Exact by construction: a token row's sum is the same sequence of operations whichever rows come with it (its
 * own two accumulators, the same vectors in the same order, the same tail), so a row's result does not depend
 * on the batch: the verification of a draft gives, bit for bit, the logits a plain decode of that token gives
 * (tests/test_decode_layers.py), and speculation cannot change a greedy token through rounding.
 *
 * weight [rows, cols] contiguous float32 (nn.Linear's layout: one output per row)
 * x      [batch, cols] contiguous float32
 * out    [batch, rows] written, never read
 */
#include <stdint.h>

#if defined(__AVX512F__)
#define VW 16                /* floats a vector holds */
#else
#define VW 8
#endif
#define GROUP 4              /* token rows a weight vector meets while it is in a register: 8 accumulators */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4)));

static inline vf load_f32(const float *p) { return *(const vf_unaligned *)p; }

static inline float lanes_sum(vf v)
{
    float s = 0.f;
    for (int lane = 0; lane < VW; lane++)
        s += v[lane];
    return s;
}

/* Weight row ``w`` (output i) against token rows b0 .. b0 + nc - 1 (nc a constant once inlined). */
static inline __attribute__((always_inline)) void dot_rows(const float *w, const float *x, float *out, int64_t rows,
                                                           int64_t cols, int64_t i, int64_t b0, const int nc)
{
    vf even[GROUP], odd[GROUP];
    for (int c = 0; c < nc; c++)
        even[c] = odd[c] = (vf){0};
    int64_t j = 0;
    for (; j + 2 * VW <= cols; j += 2 * VW) {
        const vf w0 = load_f32(w + j), w1 = load_f32(w + j + VW);
        for (int c = 0; c < nc; c++) {
            even[c] += w0 * load_f32(x + (b0 + c) * cols + j);
            odd[c] += w1 * load_f32(x + (b0 + c) * cols + j + VW);
        }
    }
    for (int c = 0; c < nc; c++) {
        const float *x_c = x + (b0 + c) * cols;
        vf e = even[c];
        int64_t k = j;
        if (k + VW <= cols) {                        /* one vector left over */
            e += load_f32(w + k) * load_f32(x_c + k);
            k += VW;
        }
        float s = lanes_sum(e + odd[c]);
        for (; k < cols; k++)                        /* and a tail shorter than a vector */
            s += w[k] * x_c[k];
        out[(b0 + c) * rows + i] = s;
    }
}

void small_batch_linear(const float *weight, const float *x, float *out, int64_t batch, int64_t rows,
                        int64_t cols, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < rows; i++) {
        const float *w_i = weight + i * cols;
        for (int64_t b0 = 0; b0 < batch; b0 += GROUP) {
            switch (batch - b0) {
            case 1: dot_rows(w_i, x, out, rows, cols, i, b0, 1); break;
            case 2: dot_rows(w_i, x, out, rows, cols, i, b0, 2); break;
            case 3: dot_rows(w_i, x, out, rows, cols, i, b0, 3); break;
            default: dot_rows(w_i, x, out, rows, cols, i, b0, GROUP); break;
            }
        }
    }
}
