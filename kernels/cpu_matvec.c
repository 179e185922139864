/*
 * out = x @ weight.T for a handful of token rows (up to 7): the matrix-vector products of a small decode batch.
 *
 * Why it exists: a decode step with one request (`minipaged generate`, a speculative draft, the verification
 * of a few drafted tokens) multiplies each weight matrix by one to seven token rows. That is memory-bound: the
 * step must read every weight once (SmolLM2: 540 MB), and does two flops per weight it reads. torch's CPU
 * matmul is built for large products and streams the weights here at about half the machine's speed; this
 * loop reads each weight once from memory, and every token row meets it while it is in the L1 cache.
 *
 * Four streams of weights: the loop reads four weight rows at a time, one from each quarter of the matrix (rows
 * i, i + q, i + 2q, i + 3q with q = rows / 4), so that over the whole matrix it reads four long runs of memory side
 * by side. One core asks memory for more bytes at once from four sequential runs than from one: this machine's
 * hardware prefetchers follow a few runs each, and one run leaves most of the memory system idle. Rows read
 * four at a time from one place (i .. i + 3) do not give it: each group's runs are a few KB long, and the
 * prefetchers start again at every group. Measured here (AMD EPYC, Zen 2, AVX2, no AVX-512; one thread; SmolLM2's
 * 30 layers of q|k|v, o, gate|up and down and its LM head, 540 MB on huge pages; medians of 9 runs, the loops
 * taking turns, bench/decode_floor.py's shapes): reading the bytes alone, as one run 28.7 ms, as four 19.6 ms;
 * one token row, the earlier loop (a row at a time) 29.6-30.4 ms, this one 21.7-22.9 ms. Each further token row
 * is read against the same four weight rows while they are in the L1 cache: 2 rows 36.0 -> 25.9 ms, 3 rows 35.4
 * -> 29.7, 4 rows 37.4 -> 34.1, 7 rows 47.0 -> 46.7 (the earlier loop took up to four token rows a weight vector,
 * with a prefetch; on that loop's AVX-512 machine, a Zen 5, this one has not been measured).
 *
 * Exact by construction: a token row's sum is the same sequence of operations whichever rows come with it (its
 * own two accumulators, the same vectors in the same order, the same tail), so a row's result does not depend
 * on the batch or on the stream it was read in: the verification of a draft gives, bit for bit, the logits a
 * plain decode of that token gives (tests/test_decode_layers.py), and speculation cannot change a greedy token
 * through rounding. (It also gives, bit for bit, what the earlier loop gave.)
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
#define STREAMS 4            /* weight rows read at once, each from its own quarter of the matrix */

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

/* Weight rows i, i + q, i + 2q and i + 3q (``ns`` of them, a constant once inlined) against token row b: two
 * accumulators a pair, the even and the odd vectors, so that the multiply-adds do not wait on each other. Each
 * (weight row, token row) pair has its own two accumulators and the same operations in the same order whatever
 * the rows beside it: the streams change no sum. */
static inline __attribute__((always_inline)) void dot_rows(const float *weight, const float *x, float *out,
                                                           int64_t rows, int64_t cols, int64_t i, int64_t q,
                                                           const int ns, int64_t b)
{
    const float *x_b = x + b * cols;
    vf even[STREAMS], odd[STREAMS];
    for (int s = 0; s < ns; s++)
        even[s] = odd[s] = (vf){0};
    int64_t j = 0;
    for (; j + 2 * VW <= cols; j += 2 * VW) {
        const vf x0 = load_f32(x_b + j), x1 = load_f32(x_b + j + VW);
        for (int s = 0; s < ns; s++) {
            const float *w = weight + (i + s * q) * cols;
            even[s] += load_f32(w + j) * x0;
            odd[s] += load_f32(w + j + VW) * x1;
        }
    }
    for (int s = 0; s < ns; s++) {
        const float *w = weight + (i + s * q) * cols;
        vf e = even[s];
        int64_t k = j;
        if (k + VW <= cols) {                        /* one vector left over */
            e += load_f32(w + k) * load_f32(x_b + k);
            k += VW;
        }
        float sum = lanes_sum(e + odd[s]);
        for (; k < cols; k++)                        /* and a tail shorter than a vector */
            sum += w[k] * x_b[k];
        out[b * rows + i + s * q] = sum;
    }
}

void small_batch_linear(const float *weight, const float *x, float *out, int64_t batch, int64_t rows,
                        int64_t cols, int num_threads)
{
    const int64_t q = rows / STREAMS;        /* stream s reads rows s * q .. (s + 1) * q - 1, in order */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < q; i++)
        for (int64_t b = 0; b < batch; b++)  /* the first token row reads the weights from memory, the rest from L1 */
            dot_rows(weight, x, out, rows, cols, i, q, STREAMS, b);
    for (int64_t i = STREAMS * q; i < rows; i++)     /* the last rows % STREAMS rows, one at a time */
        for (int64_t b = 0; b < batch; b++)
            dot_rows(weight, x, out, rows, cols, i, 0, 1, b);
}
