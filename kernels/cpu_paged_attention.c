/*
 * Paged attention for decodes on a CPU: one query token per request, keys and values read in place from
 * the paged KV cache.
 *
 * Why it exists: the torch path (reference.py) first copies every request's blocks into one contiguous,
 * padded [batch, max_len] tensor (index_select), then hands that copy to scaled_dot_product_attention,
 * whose flash kernel is built for many queries, not one. So each layer of a decode step reads the cache,
 * writes a copy, and reads the copy again. Decode attention is memory-bound: what it costs is the bytes it
 * moves. This kernel follows each request's block table and reads every key and value exactly once.
 * vLLM's CPU backend does the same in C++ (csrc/cpu/attention.cpp, paged_attention_v1: scores, softmax,
 * then values, with the head size a template constant). Its cache layout differs: it interleaves the
 * tokens of a block so the dot products vectorise across tokens; ours keeps minipaged's one layout
 * [block, offset, kv_head, dim] for every backend and vectorises along each head instead.
 *
 * The math, for request r and query head h (its KV head is h / group, grouped-query attention; the loops
 * walk each KV head's group of query heads instead of dividing: compiled, h / group was a 64-bit integer
 * division for every head of every token, and taking it out made the kernel 6% faster with the cache warm):
 *     score[t] = scale * dot(q[r, h], K[t])           for t in 0 .. seq_len-1
 *     p        = softmax(score)
 *     out[r,h] = sum_t p[t] * V[t]
 * where token t of request r lives in block block_tables[r, t / block_size] at offset t % block_size.
 *
 * HEAD_DIM is a compile-time constant (the build passes -DHEAD_DIM=64, say): with a fixed length the
 * compiler unrolls the dot products and keeps them in vector registers. Requests run in parallel with
 * OpenMP when the compiler has it (torch's own OpenMP runtime: both name libgomp.so.1, so the loader
 * shares the one torch already loaded); each request's tokens are walked once per step of the math.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<the model's head dimension>"
#endif

static inline float dot(const float *a, const float *b)
{
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < HEAD_DIM; d++)
        acc += a[d] * b[d];
    return acc;
}

/* Ask for a token's row 8 tokens before it is needed: one thread reading a pool far larger than its caches
 * otherwise waits on memory, most of all where a block ends and the next can be anywhere in the pool. The
 * row is fetched into L2 (locality 2: prefetcht1), not L1: asking for L1 ties up the few buffers L1 has for
 * outstanding misses, and the loads that need them now wait. Measured on SmolLM2's shapes (batch 64, 138
 * tokens, 30 layers, one thread, a 2-core AMD EPYC): blocks in order 29.7 -> 23.0 ms, blocks scattered at
 * random 48.5 -> 30.2 ms, against the earlier 4 rows ahead into L1 (no prefetch at all: 25.5 and 56.8 ms). */
#define PREFETCH_DISTANCE 8

static inline void prefetch_row(const float *row, int64_t length)
{
    for (int64_t i = 0; i < length; i += 16)                  /* 16 floats: one 64-byte cache line */
        __builtin_prefetch(row + i, 0 /* read */, 2 /* into L2 */);
}

/* Where token t's row starts in a cache, in floats, for a request with this block table. */
static inline int64_t row_start(const int64_t *table, int64_t t, int64_t block_size, int64_t token_stride)
{
    return (table[t / block_size] * block_size + t % block_size) * token_stride;
}

/*
 * q            [num_reqs, num_heads, HEAD_DIM] float32: each request's heads contiguous, request r's at
 *              q + r * q_stride (q may be a view into a wider tensor, such as the q part of q|k)
 * k_cache      [num_blocks, block_size, num_kv_heads, HEAD_DIM]    contiguous float32 (v_cache the same)
 * block_tables [num_reqs, max_blocks] int64                        the blocks of each request, in order
 * seq_lens     [num_reqs] int64                                    keys to attend to (>= 1), the query's own included
 * out          [num_reqs, num_heads, HEAD_DIM]                     written, never read
 * Returns 0, or 1 if a request's scratch memory could not be allocated.
 */
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                           int64_t max_blocks, int64_t q_stride, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;          /* query heads sharing one KV head */
    const int64_t token_stride = num_kv_heads * HEAD_DIM;    /* floats from one token's K row to the next */
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t n = seq_lens[r];
        const int64_t *table = block_tables + r * max_blocks;
        const float *q_r = q + r * q_stride;
        float *out_r = out + r * num_heads * HEAD_DIM;
        int64_t *row = malloc(sizeof(int64_t) * n);               /* where token t's K (and V) row starts */
        float *p = malloc(sizeof(float) * num_heads * n);         /* p[h * n + t]: scores, then weights */
        if (row == NULL || p == NULL) {
            free(row);
            free(p);
            failed = 1;
            continue;
        }
        /* The block table lookup, once per token instead of once per token and head. */
        for (int64_t t = 0; t < n; t++)
            row[t] = row_start(table, t, block_size, token_stride);

        /* Scores: every head of token t in one pass over its K row (all KV heads sit side by side). Near
         * the end, the rows asked for ahead are the first V rows: the next pass starts with them in L2. */
        for (int64_t t = 0; t < n; t++) {
            const float *k_t = k_cache + row[t];
            const int64_t ahead = t + PREFETCH_DISTANCE;
            if (ahead < n)
                prefetch_row(k_cache + row[ahead], token_stride);
            else if (ahead - n < n)
                prefetch_row(v_cache + row[ahead - n], token_stride);
            for (int64_t g = 0, h = 0; g < num_kv_heads; g++)       /* KV head g, and the query heads */
                for (int64_t j = 0; j < group; j++, h++)               /* h of its group                */
                    p[h * n + t] = scale * dot(q_r + h * HEAD_DIM, k_t + g * HEAD_DIM);
        }

        /* Softmax per head, subtracting the maximum first so exp never overflows. Each head's scores are
         * contiguous, so these loops run on whole vectors (expf included). */
        for (int64_t h = 0; h < num_heads; h++) {
            float *p_h = p + h * n;
            float max = p_h[0], sum = 0.f;
            for (int64_t t = 1; t < n; t++)
                max = fmaxf(max, p_h[t]);
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                p_h[t] = expf(p_h[t] - max);
                sum += p_h[t];
            }
            const float inv_sum = 1.f / sum;
#pragma omp simd
            for (int64_t t = 0; t < n; t++)
                p_h[t] *= inv_sum;
        }

        /* Weighted sum of values: again one pass over the tokens, every head at once, two tokens a step.
         * Each head's running sum lives in out_r, so every token costs a load and a store of all of them;
         * taking two tokens a step halves that, which is what this pass waits on with the cache warm
         * (batch 64, 138 tokens, 30 layers: 18.6 -> 16.6 ms in cache, 24.4 -> 23.0 ms from memory; four a
         * step was slower from memory, 25.2 ms). Near the end, the rows asked for ahead are the next
         * request's first K rows (measured with one thread, where this thread takes request r + 1 next;
         * with several, another core may take it, and the prefetch only costs a few wasted loads: it never
         * reads outside the checked tables). */
        const int64_t next_n = r + 1 < num_reqs ? seq_lens[r + 1] : 0;
        const int64_t *next_table = table + max_blocks;
        memset(out_r, 0, sizeof(float) * num_heads * HEAD_DIM);
        for (int64_t t = 0; t < n; t += 2) {
            for (int64_t ahead = t + PREFETCH_DISTANCE; ahead < t + PREFETCH_DISTANCE + 2; ahead++) {
                if (ahead < n)
                    prefetch_row(v_cache + row[ahead], token_stride);
                else if (ahead - n < next_n)
                    prefetch_row(k_cache + row_start(next_table, ahead - n, block_size, token_stride),
                                 token_stride);
            }
            const int64_t u = t + 1 < n ? t + 1 : t;      /* an odd count: the last token pairs with itself, */
            const float *v_t = v_cache + row[t], *v_u = v_cache + row[u];            /* weighted 0 */
            for (int64_t g = 0, h = 0; g < num_kv_heads; g++) {
                const float *v_tg = v_t + g * HEAD_DIM, *v_ug = v_u + g * HEAD_DIM;
                for (int64_t j = 0; j < group; j++, h++) {
                    const float w_t = p[h * n + t], w_u = u > t ? p[h * n + u] : 0.f;
                    float *o = out_r + h * HEAD_DIM;
#pragma omp simd
                    for (int d = 0; d < HEAD_DIM; d++)
                        o[d] += w_t * v_tg[d] + w_u * v_ug[d];
                }
            }
        }
        free(row);
        free(p);
    }
    return failed;
}
