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
 * A few rows also ask for the weights ahead of the loop (PREFETCH_AHEAD): with one row the loop keeps pace with
 * memory, and the processor's own prefetcher keeps the weights coming; with four, each weight row also costs its
 * arithmetic (five loads and four multiply-adds a vector), and while the loop computes, nothing asks memory for
 * the next rows, so the two costs added up instead of overlapping. Measured the same way (2-core AMD EPYC, Zen 5,
 * AVX-512, one thread, the machine shared, medians of 15 runs interleaved; SmolLM2's 30 layers and LM head, 540
 * MB): reading the weights alone 13.0 ms; the loop with the weights in cache (arithmetic alone) 3.6 ms at one
 * row, 7.7 at four; from memory, without -> with the prefetch: 1 row 15.1 (none asked: it cost one row 4%),
 * 2 rows 16.4 -> 15.8, 3 rows 17.8 -> 15.9, 4 rows 19.6 -> 16.9, 5 rows 23.6 -> 17.8, 7 rows 35.3 -> 22.6.
 * So a verification of three drafts costs 1.14x a decode's matmuls instead of 1.30x.
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
/* How far ahead of the loop (in floats: 6 KB, a little over two and a half SmolLM2 weight rows) a few-row product
 * asks for the weights, into L1: 1024 floats was too close (4 rows 16.3 ms above), 2048 and 3072 no better. */
#define PREFETCH_AHEAD 1536

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

/* Weight row ``w`` (output i) against token rows b0 .. b0 + nc - 1 (nc a constant once inlined); ``ahead``
 * (a constant too): ask for the weights PREFETCH_AHEAD floats on, one cache line (16 floats) at a time. A prefetch
 * changes no arithmetic: the sums are the same with or without it. */
static inline __attribute__((always_inline)) void dot_rows(const float *w, const float *x, float *out, int64_t rows,
                                                           int64_t cols, int64_t i, int64_t b0, const int nc,
                                                           const int ahead)
{
    vf even[GROUP], odd[GROUP];
    for (int c = 0; c < nc; c++)
        even[c] = odd[c] = (vf){0};
    int64_t j = 0;
    for (; j + 2 * VW <= cols; j += 2 * VW) {
        for (int line = 0; ahead && line < 2 * VW; line += 16)     /* (a prefetch never faults, even past */
            __builtin_prefetch(w + j + PREFETCH_AHEAD + line, 0, 3);  /*  the weight's end) */
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
        /* The first group of two rows or more asks for the weights ahead (a later group finds them in cache). */
        for (int64_t b0 = 0; b0 < batch; b0 += GROUP) {
            const int first = b0 == 0;
#define DOT(nc, ahead) dot_rows(w_i, x, out, rows, cols, i, b0, nc, ahead)
            switch (batch - b0) {
            case 1: DOT(1, 0); break;
            case 2: first ? DOT(2, 1) : DOT(2, 0); break;
            case 3: first ? DOT(3, 1) : DOT(3, 0); break;
            default: first ? DOT(GROUP, 1) : DOT(GROUP, 0); break;
#undef DOT
            }
        }
    }
}
