/*
 * out = x @ weight.T for eight token rows or more (a decode batch, a prefill chunk), fp32 and int8 weights:
 * a register-tiled matrix multiply that reads each weight once from memory and never repacks it.
 *
 * Why it exists: torch's CPU matmul (MKL here) packs the weight into its own layout on every call. For an LLM's
 * linear layers with a few dozen token rows, that packing and the weights' trip from memory cost as much as the
 * arithmetic. This loop takes TILE_R weight rows and TILE_C token rows at a time and keeps their TILE_R x
 * TILE_C partial sums in vector registers while it walks the shared inner dimension: each weight vector loaded
 * feeds TILE_C multiply-adds, each token vector TILE_R. The TILE_R weight rows (at most 4 x 1536 floats: 24 KB)
 * stay in the L1 cache while every group of token rows passes over them, so the weights stream from memory
 * once per call, in order.
 *
 * Int8 weights (``--quantization int8``) take the same tiles: each int8 vector is widened to float once and
 * used TILE_C times, so the widening that bounds the one-row int8 loop (cpu_int8_matvec.c) is shared by the
 * token rows; the row's scale multiplies the finished sum.
 *
 * Measured on the CI machine (2-core AMD EPYC with AVX-512, quiet, one thread; SmolLM2's 30 layers of q|k|v,
 * o, gate|up and down plus the LM head, every matrix read cold from memory), torch's best layout -> this:
 * fp32 8 rows 53.9 -> 39.8 ms, 16 rows 75.3 -> 50.2, 64 rows 199.5 -> 117.6, 256 rows 706.7 -> 412.4 ms;
 * int8 16 rows 44.3 ms, 64 rows 127.5 (torch on the widened weights: 74 and 199). Up to 7 fp32 rows (3
 * int8 rows) the one-row loops are faster: the backend's calibration races this against torch on the machine
 * that runs it, since another CPU (AVX2 only, another BLAS) may decide otherwise.
 *
 * The empty asm statements pin the loaded vectors in registers: without them GCC re-read the token vectors
 * from memory for every multiply-add (one memory operand per FMA) and the loop ran 1.5x slower.
 *
 * weight  [rows, cols] contiguous float32 or int8 (nn.Linear's layout: one output per row); scale [rows]
 * x       [batch, cols] contiguous float32
 * out     [batch, rows] written, never read
 */
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16                /* floats a vector holds */
#define TILE_R 4             /* 16 accumulators + 4 weight + 4 token vectors: 24 of the 32 registers */
#else
#define VW 8
#define TILE_R 2             /* 8 accumulators + 2 + 4: 14 of the 16 registers */
#endif
#define TILE_C 4

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4)));

#define IN_REGISTER(v) __asm__("" : "+v"(v))

static inline vf load_f32(const float *p) { return *(const vf_unaligned *)p; }

static inline vf load_int8(const int8_t *p)
{
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vf v;
    for (int lane = 0; lane < VW; lane++)
        v[lane] = (float)p[lane];
    return v;
#endif
}

static inline float lanes_sum(vf v)
{
    float s = 0.f;
    for (int lane = 0; lane < VW; lane++)
        s += v[lane];
    return s;
}

/* One tile: nr weight rows from i0, nc token rows from b0 (nr <= TILE_R, nc <= TILE_C, constants once
 * inlined). ``scale`` is NULL for fp32 weights. */
#define DEFINE_TILE(NAME, WTYPE, LOAD_W)                                                                        \
    static inline __attribute__((always_inline)) void NAME(const WTYPE *w, const float *scale, const float *x, \
                                                            float *out, int64_t rows, int64_t cols,            \
                                                            int64_t i0, int64_t b0, const int nr, const int nc) \
    {                                                                                                            \
        vf acc[TILE_R][TILE_C];                                                                                  \
        for (int r = 0; r < nr; r++)                                                                             \
            for (int c = 0; c < nc; c++)                                                                         \
                acc[r][c] = (vf){0};                                                                             \
        int64_t k = 0;                                                                                           \
        for (; k + VW <= cols; k += VW) {                                                                        \
            vf wv[TILE_R], xv[TILE_C];                                                                           \
            for (int r = 0; r < nr; r++) {                                                                       \
                wv[r] = LOAD_W(w + (i0 + r) * cols + k);                                                         \
                IN_REGISTER(wv[r]);                                                                              \
            }                                                                                                    \
            for (int c = 0; c < nc; c++) {                                                                       \
                xv[c] = load_f32(x + (b0 + c) * cols + k);                                                       \
                IN_REGISTER(xv[c]);                                                                              \
            }                                                                                                    \
            for (int r = 0; r < nr; r++)                                                                         \
                for (int c = 0; c < nc; c++)                                                                     \
                    acc[r][c] += wv[r] * xv[c];                                                                  \
        }                                                                                                        \
        for (int r = 0; r < nr; r++)                                                                             \
            for (int c = 0; c < nc; c++) {                                                                       \
                float s = lanes_sum(acc[r][c]);                                                                  \
                for (int64_t j = k; j < cols; j++)                                                               \
                    s += (float)w[(i0 + r) * cols + j] * x[(b0 + c) * cols + j];                                 \
                out[(b0 + c) * rows + i0 + r] = scale ? scale[i0 + r] * s : s;                                   \
            }                                                                                                    \
    }

DEFINE_TILE(tile_f32, float, load_f32)
DEFINE_TILE(tile_int8, int8_t, load_int8)

/* The tile loops, with the tile's sizes as constants in every branch so the compiler keeps it in registers. */
#define TILED_LOOP(TILE)                                                                                         \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                                       \
    for (int64_t i0 = 0; i0 < rows; i0 += TILE_R) {                                                             \
        const int nr = rows - i0 < TILE_R ? (int)(rows - i0) : TILE_R;                                           \
        for (int64_t b0 = 0; b0 < batch; b0 += TILE_C) {                                                         \
            const int nc = batch - b0 < TILE_C ? (int)(batch - b0) : TILE_C;                                     \
            if (nr == TILE_R && nc == TILE_C)                                                                    \
                TILE(w, scale, x, out, rows, cols, i0, b0, TILE_R, TILE_C);                                      \
            else if (nr == TILE_R)                /* the last 1-3 token rows: still every weight row at once */  \
                switch (nc) {                                                                                    \
                case 1: TILE(w, scale, x, out, rows, cols, i0, b0, TILE_R, 1); break;                            \
                case 2: TILE(w, scale, x, out, rows, cols, i0, b0, TILE_R, 2); break;                            \
                default: TILE(w, scale, x, out, rows, cols, i0, b0, TILE_R, 3); break;                           \
                }                                                                                                \
            else                                                                                                 \
                for (int r = 0; r < nr; r++)      /* the last weight rows: one at a time, 1-4 token rows */      \
                    switch (nc) {                                                                                \
                    case 1: TILE(w, scale, x, out, rows, cols, i0 + r, b0, 1, 1); break;                         \
                    case 2: TILE(w, scale, x, out, rows, cols, i0 + r, b0, 1, 2); break;                         \
                    case 3: TILE(w, scale, x, out, rows, cols, i0 + r, b0, 1, 3); break;                         \
                    default: TILE(w, scale, x, out, rows, cols, i0 + r, b0, 1, TILE_C); break;                   \
                    }                                                                                            \
        }                                                                                                        \
    }

void tiled_linear(const float *w, const float *x, float *out, int64_t batch, int64_t rows, int64_t cols,
                  int num_threads)
{
    const float *scale = 0;
    TILED_LOOP(tile_f32)
}

void tiled_int8_linear(const int8_t *w, const float *scale, const float *x, float *out, int64_t batch,
                       int64_t rows, int64_t cols, int num_threads)
{
    TILED_LOOP(tile_int8)
}
