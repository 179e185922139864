/*
 * A decode step's whole layer loop in one call: the loop of ``CompactLlama.run_layers`` (minipaged/model/llama.py),
 * written again in C over the same compiled kernels, for a step whose rows are all decodes (one to seven: one
 * request, or a few, or a speculative verification).
 *
 * Why it exists: at batch 1 a layer's math is a few hundred microseconds of matmul, and around it the Python loop
 * makes about ten calls (norm, q|k|v, RoPE and the K/V write, attention, o, norm, gate|up, SiLU, down), each a
 * few microseconds of Python, ctypes and tensor allocation, 30 layers a step. In a server, each of those calls
 * also hands the GIL to the thread that streams tokens and waits to get it back. vLLM meets the same cost on a GPU
 * with CUDA graphs: it records a decode step's kernel launches once and replays them with one call. This is the
 * CPU's version: the sequence of kernels is fixed in C, and Python makes one call a step.
 *
 * It computes exactly what the Python loop computes with the cpu backend's compiled kernels: the same functions,
 * in the same order, on the same inputs (tests/test_decode_layers.py checks the logits bit for bit). The cpu
 * backend runs it only where every one of those kernels is the one its calibration chose; anything else (a
 * prefill, torch's ops, Qwen's biases and q/k norms, tensor parallelism) runs the Python loop.
 *
 * weights    per layer, 6 pointers: input_norm, qkv, o, post_norm, gate_up, down (float32, or int8 for the four
 *            matrices when int8_loop > 0)
 * scales     per layer, 4 pointers: the int8 scales of qkv, o, gate_up and down (unused for float32)
 * int8_loop  0: float32 weights; 1: int8, the widening one-row loop; 2: int8, the fixed-point one
 * kv_cache   [layers, 2, num_blocks, block_size, num_kv_heads, HEAD_DIM] float32, contiguous
 * h          [rows, hidden] the residual stream in, the layers' output out (in place)
 * cos, sin   [rows, HEAD_DIM] this step's RoPE rows; slots [rows] each token's cache slot
 * block_tables [rows, max_blocks], seq_lens [rows]: checked by the caller (check_decode_inputs)
 * scratch    room for rows * (2 * hidden + qkv_width + num_heads * HEAD_DIM + 3 * inter) floats
 * Returns 0; the number of bad slots (written nowhere; the caller raises); or -1 when attention could not
 * allocate its scratch memory.
 */
#include <stdint.h>

int64_t rope_and_write_kv(float *qkv, const float *cos, const float *sin, const int64_t *slots, float *k_cache,
                          float *v_cache, int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, int num_threads);
void add_rms_norm(float *residual, const float *delta, const float *weight, float *out, int64_t rows,
                  int64_t hidden, float eps, int num_threads);
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads);
int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *block_tables, const int64_t *seq_lens, float *out,
                           int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                           int64_t max_blocks, int64_t q_stride, float scale, int num_threads);
void small_batch_linear(const float *weight, const float *x, float *out, int64_t batch, int64_t rows,
                        int64_t cols, int num_threads);
void tiled_linear(const float *w, const float *x, float *out, int64_t batch, int64_t rows, int64_t cols,
                  int num_threads);
void int8_small_batch_linear(const int8_t *qweight, const float *scale, const float *x, float *out,
                             int64_t batch, int64_t rows, int64_t cols, int num_threads);
void int8_fixed_point_linear(const int8_t *qweight, const float *scale, const float *x, float *out,
                             int64_t batch, int64_t rows, int64_t cols, int num_threads);
void tiled_int8_linear(const int8_t *w, const float *scale, const float *x, float *out, int64_t batch,
                       int64_t rows, int64_t cols, int num_threads);

/* The cpu backend's choice of matmul loop by row count (CpuBackend.linear and Int8Linear): the one-row loop up
 * to per_row_rows token rows, the tiled multiply beyond. */
static void linear(const void *weight, const float *scale, int int8_loop, const float *x, float *out,
                   int64_t rows, int64_t out_features, int64_t in_features, int64_t per_row_rows, int num_threads)
{
    if (int8_loop == 0 && rows <= per_row_rows)
        small_batch_linear(weight, x, out, rows, out_features, in_features, num_threads);
    else if (int8_loop == 0)
        tiled_linear(weight, x, out, rows, out_features, in_features, num_threads);
    else if (rows > per_row_rows)
        tiled_int8_linear(weight, scale, x, out, rows, out_features, in_features, num_threads);
    else if (int8_loop == 2)
        int8_fixed_point_linear(weight, scale, x, out, rows, out_features, in_features, num_threads);
    else
        int8_small_batch_linear(weight, scale, x, out, rows, out_features, in_features, num_threads);
}

int64_t decode_layers(const int64_t *weights, const int64_t *scales, int int8_loop, int64_t per_row_rows,
                      float *kv_cache, int64_t num_layers, int64_t num_blocks, int64_t block_size,
                      float *h, const float *cos, const float *sin, const int64_t *slots,
                      const int64_t *block_tables, const int64_t *seq_lens, int64_t max_blocks, float *scratch,
                      int64_t rows, int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t inter,
                      float eps, float scale, int num_threads)
{
    const int64_t q_width = num_heads * HEAD_DIM, qkv_width = (num_heads + 2 * num_kv_heads) * HEAD_DIM;
    const int64_t cache_floats = num_blocks * block_size * num_kv_heads * HEAD_DIM;   /* one K (or V) cache */
    float *x = scratch;                              /* [rows, hidden]     a norm's output          */
    float *qkv = x + rows * hidden;                  /* [rows, qkv_width]                           */
    float *attn = qkv + rows * qkv_width;            /* [rows, q_width]                             */
    float *delta = attn + rows * q_width;            /* [rows, hidden]     o's, then down's output  */
    float *gate_up = delta + rows * hidden;          /* [rows, 2 * inter]                           */
    float *act = gate_up + rows * 2 * inter;         /* [rows, inter]      silu(gate) * up          */
    const float *mlp_out = 0;             /* each sublayer's output joins the residual stream inside the next norm */
    int64_t bad_slots = 0;
    for (int64_t i = 0; i < num_layers; i++) {
        const int64_t *w = weights + 6 * i;
        const float *const *s = (const float *const *)(scales + 4 * i);
        float *k_cache = kv_cache + (2 * i) * cache_floats, *v_cache = k_cache + cache_floats;
        add_rms_norm(h, mlp_out, (const float *)w[0], x, rows, hidden, eps, num_threads);
        linear((const void *)w[1], s[0], int8_loop, x, qkv, rows, qkv_width, hidden, per_row_rows, num_threads);
        /* Write first, then read: a request may attend to blocks another request fills in this step. */
        bad_slots += rope_and_write_kv(qkv, cos, sin, slots, k_cache, v_cache, rows, num_heads, num_kv_heads,
                                       HEAD_DIM, num_blocks * block_size, num_threads);
        if (paged_decode_attention(qkv, k_cache, v_cache, block_tables, seq_lens, attn, rows, num_heads,
                                   num_kv_heads, block_size, max_blocks, qkv_width, scale, num_threads))
            return -1;
        linear((const void *)w[2], s[1], int8_loop, attn, delta, rows, hidden, q_width, per_row_rows, num_threads);
        add_rms_norm(h, delta, (const float *)w[3], x, rows, hidden, eps, num_threads);
        linear((const void *)w[4], s[2], int8_loop, x, gate_up, rows, 2 * inter, hidden, per_row_rows, num_threads);
        silu_and_mul(gate_up, act, rows, inter, num_threads);
        linear((const void *)w[5], s[3], int8_loop, act, delta, rows, hidden, inter, per_row_rows, num_threads);
        mlp_out = delta;
    }
    if (mlp_out != 0)
        for (int64_t j = 0; j < rows * hidden; j++)
            h[j] += mlp_out[j];
    return bad_slots;
}
