/*
 * The small operations of a Llama layer, fused, for the CPU: what vLLM's CPU backend does with
 * `fused_add_rms_norm`, `rotary_embedding` + `reshape_and_cache` and `silu_and_mul` (csrc/cpu/).
 *
 * Why: between its four matmuls and its attention a layer runs about 35 torch operators (the norms alone are
 * pow, mean, add, rsqrt, mul, mul), each a few microseconds of Python and dispatch whatever its size, and each
 * reading and writing the whole activation again. Three functions here do the same work in one pass each.
 * The math is the torch path's (minipaged/model/llama.py: `rms_norm`, `apply_rope`, `write_kv_cache`,
 * F.silu(gate) * up), which is transformers' own; the sums run in another order, so results agree to float
 * rounding, as any other kernel's would.
 *
 * Every array is contiguous float32 (int64 for slots); the Python side (cpu_layer_ops.py) checks that.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/*
 * residual [rows, hidden]   the residual stream; when delta is not NULL, residual += delta first (in place)
 * weight   [hidden]         the norm's weight
 * out      [rows, hidden]   weight * residual / sqrt(mean(residual^2) + eps), row by row
 */
void add_rms_norm(float *residual, const float *delta, const float *weight, float *out, int64_t rows,
                  int64_t hidden, float eps, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        float *x = residual + r * hidden;
        float sum_sq = 0.f;
        if (delta != NULL) {
            const float *d = delta + r * hidden;
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t i = 0; i < hidden; i++) {
                x[i] += d[i];
                sum_sq += x[i] * x[i];
            }
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t i = 0; i < hidden; i++)
                sum_sq += x[i] * x[i];
        }
        const float inv_rms = 1.f / sqrtf(sum_sq / (float)hidden + eps);
        float *y = out + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            y[i] = weight[i] * (x[i] * inv_rms);
    }
}

/*
 * Rotary embedding on the queries and keys of the fused q|k|v projection, in place, then each token's key and
 * value written to its cache slot (slot -1: the token's K/V is already cached; leave it).
 *
 * qkv        [tokens, (num_heads + 2 * num_kv_heads) * head_dim]   q heads, then k heads, then v heads
 * cos, sin   [tokens, head_dim]        this step's rows of the tables; sin is signed: [-sin1, sin2], so that
 *                                      rotated = x * cos + roll(x, head_dim / 2) * sin (llama.py's apply_rope)
 * slots      [tokens] int64            slot = block * block_size + offset, or -1
 * k_cache, v_cache  [num_slots, num_kv_heads, head_dim]
 * Returns the number of tokens whose slot was outside 0 .. num_slots - 1 (and not -1): those are not written,
 * and the caller raises. C would otherwise write wherever a bad slot points.
 */
int64_t rope_and_write_kv(float *qkv, const float *cos, const float *sin, const int64_t *slots, float *k_cache,
                          float *v_cache, int64_t tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, int num_threads)
{
    int64_t bad = 0;
    const int64_t half = head_dim / 2;
    const int64_t kv_width = num_kv_heads * head_dim;
    const int64_t row_width = (num_heads + 2 * num_kv_heads) * head_dim;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(+ : bad)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * row_width;
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {      /* every query head, then every key head */
            float *x = row + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float first = x[i], second = x[i + half];
                x[i] = first * c[i] + second * s[i];
                x[i + half] = second * c[i + half] + first * s[i + half];
            }
        }
        if (slots[t] >= num_slots || slots[t] < -1) {
            bad++;
        } else if (slots[t] >= 0) {
            memcpy(k_cache + slots[t] * kv_width, row + num_heads * head_dim, sizeof(float) * kv_width);
            memcpy(v_cache + slots[t] * kv_width, row + (num_heads + num_kv_heads) * head_dim,
                   sizeof(float) * kv_width);
        }
    }
    return bad;
}

/*
 * gate_up [rows, 2 * inter]   the fused gate|up projection
 * out     [rows, inter]       silu(gate) * up, where silu(x) = x / (1 + exp(-x))
 */
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *y = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++)
            y[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}
