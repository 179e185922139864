/*
 * Greedy sampling's argmax, one row of logits per request: the index of the largest logit, the first one
 * where several tie (as torch.argmax). Why: torch's CPU argmax over the last dimension of several rows runs at
 * about 1 element per nanosecond here; at batch 64 with SmolLM2's 49,152-word vocabulary that was 2.8 ms of
 * every decode step. Two vectorised passes per row (the maximum, then where it first occurs) take 0.6 ms.
 *
 * logits [rows, cols] contiguous float32;  out [rows] int64, written.
 */
#include <stdint.h>

void argmax_rows(const float *logits, int64_t *out, int64_t rows, int64_t cols, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * cols;
        float best = row[0];
#pragma omp simd reduction(max : best)
        for (int64_t i = 0; i < cols; i++)
            best = row[i] > best ? row[i] : best;
        int64_t index = 0;                     /* stays in range even for a row of NaNs */
        for (int64_t i = 0; i < cols; i++) {
            if (row[i] == best) {
                index = i;
                break;
            }
        }
        out[r] = index;
    }
}
