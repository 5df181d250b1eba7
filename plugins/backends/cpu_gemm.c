/* Small-batch matrix products for x86 CPUs with AVX2 and FMA: out[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * Built with the package by setup.py, one shared object per instruction set (cpu_gemm_builds.py: gcc -O3 -mavx2
 * -mfma -fopenmp -ffp-contract=off, every product and sum rounded as written, so the elementwise code matches
 * torch's to the bit), and called through ctypes by cpu_gemm_abi.py, which checks every tensor it passes.
 * Decode multiplies a few activation rows by every weight, so its speed is the rate at which
 * weights stream from memory. Each kernel reads its weight in a packed layout, one contiguous
 * stream per tile of output rows, and converts it to float32 in registers:
 *
 *   f32   [N/32][K][32]      float32 panels: up to 12 (AVX2: 6) rows' outer products in registers
 *   bf16  [N/4][K/8][4][8]   bfloat16 bits, widened by a 16-bit shift (exact; AVX2 build)
 *         [N/32][K/2][32][2] bfloat16 panels by pairs of k (the AVX-512 build: vdpbf16ps)
 *   q8    [N/4][K/32][4][32] int8; one float scale per row ([N]) or per 32 columns ([N/4][K/32][4])
 *
 * q8 is llama.cpp's Q8_0 dot product: each activation row is rounded to int8 in blocks of 32
 * (scale = max|x| / 127), int8 x int8 products are summed exactly in int32 per block, and the
 * block sums are scaled and added in float32.
 *
 * Every output element is computed by one thread, in a fixed order over K, whatever M, N or the
 * thread count: a row's result does not depend on the other rows of the batch.
 *
 * Decode attention, RMSNorm and SiLU-mul serve decode rows too, and ts_decode_layers (at the end) runs
 * a decode step's whole layer stack with them in one parallel region.
 *
 * On CPUs with AVX-512 VNNI and BF16 (the avx512 build adds -mavx512f -mavx512bw -mavx512vl -mavx512vnni
 * -mavx512bf16 there; TS_AVX512 below), two things change:
 *   q8    a block's int8 products are summed by vpdpbusd instead of maddubs + madd, two output rows' blocks
 *         per 512-bit instruction: the same exact int32 lane sums, scaled and added in the same order, so
 *         the results are the AVX2 build's to the bit;
 *   bf16  vdpbf16ps multiplies the weight panels by the activation rows rounded to bfloat16 (exact for a
 *         bfloat16 model's rows, which are bfloat16 values, but for subnormals, which vcvtneps2bf16 and
 *         vdpbf16ps flush to zero) and adds pairs of products into float32 lanes, with its own fixed
 *         summation order (not the AVX2 build's bits);
 *   attention runs in 16-float vectors (attention_task512), with vdpbf16ps for bfloat16 keys against a
 *         bfloat16 model's queries: another fixed order than the AVX2 build's. Prefill attention (an
 *         AVX-512 kernel only) multiplies a bfloat16 model's queries by bfloat16 keys, and its softmax
 *         weights rounded to bfloat16 by bfloat16 values, with vdpbf16ps as well.
 * Float32 panels are the same bits in both builds.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BF16__)
#define TS_AVX512 1
#else
#define TS_AVX512 0
#endif

#ifndef TS_KERNEL_VERSION
#error "define TS_KERNEL_VERSION: setup.py passes cpu_gemm_builds.KERNEL_VERSION (pip install -e .)"
#endif
#define PANEL 32       /* output columns of a float32 or (AVX-512) bfloat16 panel */
#define TILE 4         /* output rows of a bfloat16 (AVX2) or q8 tile */
#define MAX_GROUP 16   /* query heads per KV head the attention kernels take */

/* The interface cpu_gemm_abi.py binds. A kernel with many arguments takes one struct, each struct declared
 * once below as a list of (type, name) fields; ts_layout() describes it (names, offsets and sizes, in order)
 * and ts_constants() lists the numbers both sides use, so the binding checks its copies when it loads. */

/* out [rows, out_features] = x [rows, in_features] @ W^T (+ bias): ts_f32_gemm, ts_bf16_gemm, ts_q8_gemm */
#define TS_MATMUL(X, S)                                                                                   \
    X(S, const void*, x)       /* float32 rows (ts_bf16_gemm with io bit 0: bfloat16 bits) */           \
    X(S, int64_t, rows)                                                                                   \
    X(S, int64_t, in_features)                                                                            \
    X(S, const void*, weight)  /* packed: float32 panels, bfloat16 bits or int8 tiles (above) */         \
    X(S, const float*, scale)  /* q8: one per row [N], or per 32 columns [N/4][K/32][4] */               \
    X(S, const float*, bias)   /* [out_features] or NULL */                                              \
    X(S, int64_t, out_features)                                                                           \
    X(S, void*, out)           /* float32 rows (ts_bf16_gemm with io bit 1: bfloat16 bits) */            \
    X(S, int32_t, grouped)     /* q8: a scale per 32 columns */                                          \
    X(S, int32_t, io)          /* ts_bf16_gemm, AVX-512 build: bit 0 bfloat16 x, bit 1 bfloat16 out */   \
    X(S, uint16_t*, bf16_rows) /* ts_bf16_gemm, AVX-512 build, float32 x: [rows * in_features] scratch */ \
    X(S, int8_t*, q8_rows)     /* ts_q8_gemm: x rounded to Q8_0 [rows, in_features] (scratch) */         \
    X(S, float*, q8_scales)    /* ts_q8_gemm: their block scales [rows, in_features / 32] (scratch) */   \
    X(S, int32_t, threads)

/* out [rows, out_features] = x [rows, in_features] @ W^T (+ bias) for a GGUF Q4_0 or Q4_1 weight kept at its
 * 4.5 (Q4_0) or 5 (Q4_1) bits a weight: ts_q4_gemm. The file's blocks are repacked by tiles of 4 rows, the same
 * bytes: row r of a tile, block k holds 32 weights as 16 bytes (weight i in byte i % 16, the low nibble for
 * i < 16, as llama.cpp stores them), its float16 scale d and (Q4_1) float16 minimum m;
 * w = d * (nibble - 8) (Q4_0) or d * nibble + m (Q4_1). */
#define TS_Q4_MATMUL(X, S)                                                                                \
    X(S, const float*, x)            /* float32 rows */                                                  \
    X(S, int64_t, rows)                                                                                   \
    X(S, int64_t, in_features)                                                                            \
    X(S, const uint8_t*, nibbles)    /* [N/4][K/32][4][16] */                                            \
    X(S, const void*, scale)         /* float16 [N/4][K/32][4]; Q4_K: super-block scales (below) */      \
    X(S, const void*, mins)          /* Q4_1, Q4_K: [N/4][K/32][4] as scale; Q4_0: NULL */               \
    X(S, int32_t, k_scales)          /* Q4_K, Q5_K: scale, mins [N/4][K/256][48 bytes] (q4_k_scales) */  \
    X(S, int32_t, high_bits)         /* Q5_0, Q5_1, Q5_K: each tile block's 64 nibble bytes then 16 of high bits */ \
    X(S, const float*, bias)         /* [out_features] or NULL */                                        \
    X(S, int64_t, out_features)                                                                           \
    X(S, float*, out)                /* float32 rows */                                                  \
    X(S, int8_t*, q8_rows)           /* scratch: x rounded to Q8_0 [rows, in_features] */                \
    X(S, float*, q8_scales)          /* scratch: their block scales [rows, in_features / 32] */          \
    X(S, int32_t*, q8_sums)          /* scratch: [rows, in_features / 32, 4] the lanes' sums (below) */  \
    X(S, float*, q8_block_sums)      /* scratch: [rows, in_features / 32] d times the block's sum */     \
    X(S, int32_t, threads)

/* Attention read in place from the paged arena: ts_decode_attention (q_len 1) and ts_prefill_attention */
#define TS_ATTENTION(X, S)                                                                                \
    X(S, const float*, q)          /* [batch * q_len, heads, head_dim] float32, sequence by sequence */  \
    X(S, int64_t, batch)                                                                                  \
    X(S, int64_t, q_len)                                                                                  \
    X(S, int64_t, heads)                                                                                  \
    X(S, int64_t, kv_heads)                                                                               \
    X(S, int64_t, head_dim)                                                                               \
    X(S, const void*, k)           /* the arena's keys [slots, kv_heads, head_dim] */                    \
    X(S, const void*, v)           /* and values, float32 or bfloat16 bits */                            \
    X(S, int32_t, flags)           /* bit 0: bfloat16 keys and values, bit 1: the queries are bfloat16 values */ \
    X(S, int32_t, causal)          /* prefill without keep: the queries are the last q_len of ctx positions */ \
    X(S, const int64_t*, blocks)   /* [batch, blocks_per_row] each sequence's arena blocks */            \
    X(S, int64_t, blocks_per_row)                                                                         \
    X(S, int64_t, block_size)                                                                             \
    X(S, int64_t, ctx)                                                                                    \
    X(S, const uint8_t*, keep)     /* [batch * q_len, ctx]: 1 = attend; NULL: every position (prefill: causal) */ \
    X(S, float, scale)                                                                                    \
    X(S, float*, out)              /* [batch * q_len, heads, head_dim] float32 */                        \
    X(S, float*, scores)           /* decode: [batch * heads * ctx] scratch */                           \
    X(S, float*, lse)              /* [batch * q_len, heads] each row's log-sum-exp, or NULL */          \
    X(S, int32_t, threads)

/* One layer of ts_decode_layers: its weights as the single-call kernels take them (NULL where it has none;
 * norm weights float32), its arena, the positions its rows attend, and how each projection computes (K_*) */
#define TS_LAYER(X, S)                                                                                    \
    X(S, const float*, input_norm)                                                                        \
    X(S, const void*, qkv_weight)                                                                         \
    X(S, const float*, qkv_scale)                                                                         \
    X(S, const float*, qkv_bias)                                                                          \
    X(S, const float*, q_norm)                                                                            \
    X(S, const float*, k_norm)                                                                            \
    X(S, const void*, o_weight)                                                                           \
    X(S, const float*, o_scale)                                                                           \
    X(S, const float*, o_bias)                                                                            \
    X(S, const float*, post_norm)                                                                         \
    X(S, const void*, gate_up_weight)                                                                     \
    X(S, const float*, gate_up_scale)                                                                     \
    X(S, const void*, down_weight)                                                                        \
    X(S, const float*, down_scale)                                                                        \
    X(S, const void*, qkv_mins)      /* Q4_1 / Q4_K: minimums (typed as their *_scale); Q6_K: row scales d */ \
    X(S, const void*, o_mins)                                                                             \
    X(S, const void*, gate_up_mins)                                                                       \
    X(S, const void*, down_mins)                                                                          \
    X(S, void*, k_cache)                                                                                  \
    X(S, void*, v_cache)                                                                                  \
    X(S, const uint8_t*, keep)     /* [rows, ctx] (this layer's sliding window) or NULL */               \
    X(S, int32_t, qkv_kind)                                                                               \
    X(S, int32_t, o_kind)                                                                                 \
    X(S, int32_t, gate_up_kind)                                                                           \
    X(S, int32_t, down_kind)                                                                              \
    X(S, const void*, qkv_tail_weight) /* qkv's last rows in another kind (GGUF: v in Q6_K, q and k in Q4_K) */ \
    X(S, const float*, qkv_tail_scale)                                                                    \
    X(S, const void*, qkv_tail_mins)                                                                      \
    X(S, const float*, qkv_tail_bias)                                                                     \
    X(S, int64_t, qkv_tail_rows)   /* 0: qkv is one projection */                                        \
    X(S, int32_t, qkv_tail_kind)
enum { K_Q8_ROW, K_Q8_GROUPED, K_BF16, K_F32, K_Q4_0, K_Q4_1, K_Q4_K, K_Q6_K, K_Q5_0, K_Q5_1, K_Q5_K };

/* A decode step through every layer (ts_decode_layers) */
#define TS_DECODE_STEP(X, S)                                                                              \
    X(S, int64_t, rows)                                                                                   \
    X(S, int64_t, layers)                                                                                 \
    X(S, int64_t, hidden_size)                                                                            \
    X(S, int64_t, heads)                                                                                  \
    X(S, int64_t, kv_heads)                                                                               \
    X(S, int64_t, head_dim)                                                                               \
    X(S, int64_t, intermediate_size)                                                                      \
    X(S, float, eps)                                                                                      \
    X(S, float, scale)                                                                                    \
    X(S, int32_t, act_bf16)        /* the activations are bfloat16 values (a bfloat16 model's) */        \
    X(S, int32_t, kv_bf16)         /* the arena holds bfloat16 bits */                                   \
    X(S, float*, hidden)           /* [rows, hidden_size], updated in place */                           \
    X(S, const float*, cos)        /* [rows, head_dim] RoPE factors */                                   \
    X(S, const float*, sin)        /* [rows, head_dim], signed */                                        \
    X(S, const int64_t*, slots)    /* [rows] the arena rows each new key and value go to */              \
    X(S, const int64_t*, blocks)   /* [rows, blocks_per_row] */                                          \
    X(S, int64_t, blocks_per_row)                                                                         \
    X(S, int64_t, block_size)                                                                             \
    X(S, int64_t, ctx)                                                                                    \
    X(S, const int64_t*, shared_blocks) /* a prefix every row shares, read once (AVX-512 build), or NULL */ \
    X(S, int64_t, shared_tokens)                                                                          \
    X(S, const struct ts_layer*, layer) /* [layers] */                                                    \
    X(S, float*, work)             /* scratch: rows * DecodeShape.work_floats(ctx) floats (cpu_gemm_abi.py) */ \
    X(S, int8_t*, q8_rows)         /* scratch: [rows * max(hidden, heads * head_dim, intermediate)] */   \
    X(S, float*, q8_scales)        /* scratch: that / 32 */                                              \
    X(S, int32_t*, q4_sums)        /* scratch: that * 4 (Q4 projections: lane sums of the rounded rows) */ \
    X(S, float*, q4_block_sums)    /* scratch: that / 32 (Q4_1: d times each block's sum) */             \
    X(S, int32_t, threads)

#define TS_MEMBER(S, T, N) T N;
#define TS_FIELD(S, T, N) {#N, (int64_t)offsetof(struct S, N), (int64_t)sizeof(T)},
typedef struct ts_matmul { TS_MATMUL(TS_MEMBER, ts_matmul) } ts_matmul;
typedef struct ts_q4_matmul { TS_Q4_MATMUL(TS_MEMBER, ts_q4_matmul) } ts_q4_matmul;
typedef struct ts_attention { TS_ATTENTION(TS_MEMBER, ts_attention) } ts_attention;
typedef struct ts_layer { TS_LAYER(TS_MEMBER, ts_layer) } ts_layer;
typedef struct ts_decode_step { TS_DECODE_STEP(TS_MEMBER, ts_decode_step) } ts_decode_step;

typedef struct {
    const char* name;
    int64_t offset, size;
} ts_field;
static const ts_field ts_matmul_fields[] = {TS_MATMUL(TS_FIELD, ts_matmul)};
static const ts_field ts_q4_matmul_fields[] = {TS_Q4_MATMUL(TS_FIELD, ts_q4_matmul)};
static const ts_field ts_attention_fields[] = {TS_ATTENTION(TS_FIELD, ts_attention)};
static const ts_field ts_layer_fields[] = {TS_LAYER(TS_FIELD, ts_layer)};
static const ts_field ts_decode_step_fields[] = {TS_DECODE_STEP(TS_FIELD, ts_decode_step)};

/* The fields of the struct called name, in order (*count of them), and its size; NULL for an unknown name. */
const ts_field* ts_layout(const char* name, int64_t* count, int64_t* size) {
#define TS_DESCRIBE(S)                                                  \
    if (!strcmp(name, #S)) {                                            \
        *count = (int64_t)(sizeof(S##_fields) / sizeof(ts_field));      \
        *size = (int64_t)sizeof(S);                                     \
        return S##_fields;                                              \
    }
    TS_DESCRIBE(ts_matmul) TS_DESCRIBE(ts_q4_matmul) TS_DESCRIBE(ts_attention) TS_DESCRIBE(ts_layer)
    TS_DESCRIBE(ts_decode_step)
#undef TS_DESCRIBE
    return NULL;
}

typedef struct {
    const char* name;
    int64_t value;
} ts_number;

/* The numbers the binding relies on (*count of them): this build's version and instruction set, the
 * weight layouts' block sizes, the attention kernels' limit and the projection kinds of ts_layer. */
const ts_number* ts_constants(int64_t* count) {
    static const ts_number numbers[] = {
        {"version", TS_KERNEL_VERSION}, {"avx512", TS_AVX512}, {"qk", QK}, {"tile", TILE}, {"panel", PANEL},
        {"max_group", MAX_GROUP}, {"q8_row", K_Q8_ROW}, {"q8_grouped", K_Q8_GROUPED}, {"bf16", K_BF16},
        {"f32", K_F32}, {"q4_0", K_Q4_0}, {"q4_1", K_Q4_1}, {"q4_k", K_Q4_K}, {"q6_k", K_Q6_K},
        {"q5_0", K_Q5_0}, {"q5_1", K_Q5_1}, {"q5_k", K_Q5_K},
    };
    *count = (int64_t)(sizeof(numbers) / sizeof(numbers[0]));
    return numbers;
}
#ifndef BF16_PREFETCH
#define BF16_PREFETCH 16 /* AVX-512 panel rows (pairs of k) ahead (128 bytes each: 2 KiB) */
#endif
#ifndef PANEL_PREFETCH
#define PANEL_PREFETCH 16 /* k steps ahead (a 128-byte panel row each: 2 KiB) */
#endif
#ifndef Q8_PREFETCH
#define Q8_PREFETCH 32 /* blocks ahead (128 bytes, two lines, each: 4 KiB) */
#endif

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline void store_tile(float* out, int64_t N, int64_t n0, const __m256* acc, const float* scale,
                              const float* bias) {
    for (int r = 0; r < 4 && n0 + r < N; r++) {
        float y = hsum(acc[r]);
        if (scale) y *= scale[n0 + r];
        if (bias) y += bias[n0 + r];
        out[n0 + r] = y;
    }
}

static inline __m256 widen_bf16(const uint16_t* p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* Float weights, one tile of 4 output rows (t): two activation rows at a time share each weight vector
 * loaded (and widened); an odd last row runs alone. Both loops sum each row in the same order. */
#define FLOAT_TILE(NAME, WTYPE, LOAD)                                                                     \
    static inline void NAME(const float* x, int64_t M, int64_t K, const WTYPE* wt, const float* bias,      \
                            int64_t N, int64_t t, float* out) {                                           \
        const int64_t steps = K / 8;                                                                      \
        int64_t m = 0;                                                                            \
        for (; m + 1 < M; m += 2) {                                                               \
            const float* x0 = x + m * K;                                                          \
            const float* x1 = x0 + K;                                                             \
            __m256 a[4], b[4];                                                                    \
            for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();                        \
            for (int64_t s = 0; s < steps; s++) {                                                 \
                const WTYPE* ws = wt + s * 32;                                                    \
                __m256 u = _mm256_loadu_ps(x0 + s * 8), v = _mm256_loadu_ps(x1 + s * 8);           \
                for (int r = 0; r < 4; r++) {                                                     \
                    __m256 wv = LOAD(ws + 8 * r);                                                 \
                    a[r] = _mm256_fmadd_ps(wv, u, a[r]);                                          \
                    b[r] = _mm256_fmadd_ps(wv, v, b[r]);                                          \
                }                                                                                 \
            }                                                                                     \
            store_tile(out + m * N, N, t * 4, a, 0, bias);                                        \
            store_tile(out + (m + 1) * N, N, t * 4, b, 0, bias);                                  \
        }                                                                                         \
        if (m < M) {                                                                              \
            const float* x0 = x + m * K;                                                          \
            __m256 a[4];                                                                          \
            for (int r = 0; r < 4; r++) a[r] = _mm256_setzero_ps();                               \
            for (int64_t s = 0; s < steps; s++) {                                                 \
                const WTYPE* ws = wt + s * 32;                                                    \
                _mm_prefetch((const char*)(ws + 8 * 32), _MM_HINT_T0);                            \
                __m256 u = _mm256_loadu_ps(x0 + s * 8);                                           \
                for (int r = 0; r < 4; r++) a[r] = _mm256_fmadd_ps(LOAD(ws + 8 * r), u, a[r]);    \
            }                                                                                     \
            store_tile(out + m * N, N, t * 4, a, 0, bias);                                        \
        }                                                                                         \
    }


/* Float32 weights in panels of 32 output columns, [N/32][K][32] (the last panel zero-padded): for each k the
 * panel's 32 weights are one contiguous 128-byte row, multiplied by a broadcast of x[m, k] for each of up to
 * PANEL_ROWS activation rows at once (outer products summed in registers, the weights loaded once per row
 * group). Every output element is one fused multiply-add chain over k = 0..K-1 in order, then the bias added:
 * the same bits whatever M, the row grouping, the thread count or the build (AVX2 or AVX-512). */
#if TS_AVX512
#define PANEL_ROWS 12 /* 12 rows x 2 vectors of 16 = 24 accumulators of the 32 registers */
/* torch's float -> bfloat16 rounding (to nearest even; a NaN becomes 0x7FC0) of 16 lanes, as 16-bit values */
static inline __m256i bf16_round16(__m512 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __m512i nan_fixed = _mm512_mask_mov_epi32(up, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(nan_fixed);
}

/* R rows' sums of one panel (plus the bias) into out, float32 or (out_bf16) bfloat16 bits rounded as torch's
 * .to(torch.bfloat16) rounds; the columns past N left alone */
static inline __attribute__((always_inline)) void store_panel(const int R, __m512 (*a)[2], const float* bias,
                                                              int64_t N, int64_t n0, void* out, int out_bf16) {
    const int64_t left = N - n0;
    const __mmask16 m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + n0 + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        const __m512 s0 = bias ? _mm512_add_ps(a[r][0], b0) : a[r][0], s1 = bias ? _mm512_add_ps(a[r][1], b1) : a[r][1];
        if (out_bf16) {
            uint16_t* o = (uint16_t*)out + r * N + n0;
            _mm256_mask_storeu_epi16(o, m0, bf16_round16(s0));
            _mm256_mask_storeu_epi16(o + 16, m1, bf16_round16(s1));
        } else {
            float* o = (float*)out + r * N + n0;
            _mm512_mask_storeu_ps(o, m0, s0);
            _mm512_mask_storeu_ps(o + 16, m1, s1);
        }
    }
}
static inline __attribute__((always_inline)) void panel_rows(const int R, const float* x, int64_t K,
                                                             const float* wp, const float* bias, int64_t N,
                                                             int64_t n0, float* out) {
    __m512 a[PANEL_ROWS][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float* wk = wp + k * PANEL;
        _mm_prefetch((const char*)(wk + PANEL_PREFETCH * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char*)(wk + PANEL_PREFETCH * PANEL + 16), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * K + k]);
            a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);
        }
    }
    store_panel(R, a, bias, N, n0, out, 0);
}
#else
#define PANEL_ROWS 6 /* per half panel: 6 rows x 2 vectors of 8 = 12 accumulators of the 16 registers */
static inline __attribute__((always_inline)) void panel_rows(const int R, const float* x, int64_t K,
                                                             const float* wp, const float* bias, int64_t N,
                                                             int64_t n0, float* out) {
    for (int64_t half = 0; half < PANEL && n0 + half < N; half += 16) {
        __m256 a[PANEL_ROWS][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k++) {
            const float* wk = wp + k * PANEL + half;
            _mm_prefetch((const char*)(wk + PANEL_PREFETCH * PANEL), _MM_HINT_T0);
            const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
                a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            float lanes[16];
            _mm256_storeu_ps(lanes, a[r][0]);
            _mm256_storeu_ps(lanes + 8, a[r][1]);
            for (int j = 0; j < 16 && n0 + half + j < N; j++)
                out[r * N + n0 + half + j] = bias ? lanes[j] + bias[n0 + half + j] : lanes[j];
        }
    }
}
#endif

/* FN(R, ...) with R as a constant (1..PANEL_ROWS), so the compiler keeps its accumulators in registers */
#if TS_AVX512
#define PANEL_WIDE_CASES(FN, ...)                                                                             \
    case 6: FN(6, __VA_ARGS__); break;                                                                        \
    case 7: FN(7, __VA_ARGS__); break;                                                                        \
    case 8: FN(8, __VA_ARGS__); break;                                                                        \
    case 9: FN(9, __VA_ARGS__); break;                                                                        \
    case 10: FN(10, __VA_ARGS__); break;                                                                      \
    case 11: FN(11, __VA_ARGS__); break;
#else
#define PANEL_WIDE_CASES(FN, ...)
#endif
#define PANEL_CALL(FN, R, ...)                                                                                \
    switch (R) {                                                                                              \
        case 1: FN(1, __VA_ARGS__); break;                                                                    \
        case 2: FN(2, __VA_ARGS__); break;                                                                    \
        case 3: FN(3, __VA_ARGS__); break;                                                                    \
        case 4: FN(4, __VA_ARGS__); break;                                                                    \
        case 5: FN(5, __VA_ARGS__); break;                                                                    \
        PANEL_WIDE_CASES(FN, __VA_ARGS__)                                                                     \
        default: FN(PANEL_ROWS, __VA_ARGS__); break;                                                          \
    }

#if TS_AVX512
/* bfloat16 weights in panels of 32 output columns by pairs of k, [N/32][K/2][32][2] (the last panel
 * zero-padded): for each pair of k the panel's 64 weights are one 128-byte row, and vdpbf16ps multiplies it
 * by a broadcast of the row's (x[k], x[k + 1]) for up to PANEL_ROWS rounded activation rows at once, each
 * float32 lane (an output column) adding the pair's two exact products. Every output element is one chain
 * over the pairs in order, then the bias: the same bits whatever M, the row grouping or the thread count. */
static inline __attribute__((always_inline)) void bf16_panel_sums(const int R, const uint16_t* x, int64_t K,
                                                                  const uint16_t* wp, __m512 (*a)[2]) {
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K / 2; kp++) {
        const uint16_t* wk = wp + kp * 2 * PANEL;
        _mm_prefetch((const char*)(wk + BF16_PREFETCH * 2 * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char*)(wk + BF16_PREFETCH * 2 * PANEL + PANEL), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)wk);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(wk + PANEL));
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * K + 2 * kp, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], xv, w0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], xv, w1);
        }
    }
}
#else
FLOAT_TILE(bf16_tile, uint16_t, widen_bf16)
#endif

/* out [M, N] = x [M, K] @ W^T (+ bias) on panels; (panel, row group) pairs shared among the enclosing parallel
 * region's threads, a panel's row groups consecutive (its weights stay in L2 between them). */
static void ts_f32_gemm_rows(const float* x, int64_t M, int64_t K, const float* w, const float* bias, int64_t N,
                             float* out) {
    if (M <= 0) return; /* every thread alike: no rows, no work (and no division by zero groups) */
    const int64_t groups = (M + PANEL_ROWS - 1) / PANEL_ROWS, rows = (M + groups - 1) / groups; /* balanced */
    const int64_t panels = (N + PANEL - 1) / PANEL;
    _Pragma("omp for schedule(static)")
    for (int64_t task = 0; task < panels * groups; task++) {
        const int64_t p = task / groups, m = task % groups * rows;
        const int R = M - m < rows ? (int)(M - m) : (int)rows;
        const float* xm = x + m * K;
        const float* wp = w + p * K * PANEL;
        float* om = out + m * N;
        PANEL_CALL(panel_rows, R, xm, K, wp, bias, N, p * PANEL, om);
    }
}

#if TS_AVX512
static inline __attribute__((always_inline)) void bf16_panel_task(const int R, const uint16_t* x, int64_t K,
                                                                  const uint16_t* wp, const float* bias, int64_t N,
                                                                  int64_t n0, void* out, int out_bf16) {
    __m512 a[PANEL_ROWS][2];
    bf16_panel_sums(R, x, K, wp, a);
    store_panel(R, a, bias, N, n0, out, out_bf16);
}
#endif

/* Float32 rows x [M, K] rounded to bfloat16 (to nearest even) into xb, the rows shared among the enclosing
 * parallel region's threads (an orphaned omp for: the threads meet at its end). */
#if TS_AVX512
static void bf16_round_rows(const float* x, int64_t M, int64_t K, uint16_t* xb) {
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < M; m++) {
        int64_t i = m * K;
        for (; i + 16 <= (m + 1) * K; i += 16)
            _mm256_storeu_si256((__m256i*)(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
        if (i < (m + 1) * K) { /* the last 1-15 of the row, masked: nothing read or written past it */
            const __mmask16 tail = (__mmask16)((1u << ((m + 1) * K - i)) - 1);
            _mm256_mask_storeu_epi16(xb + i, tail, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, x + i)));
        }
    }
}
#endif

/* out [M, N] = x [M, K] @ W^T (+ bias) for bfloat16 weights, in the enclosing parallel region. AVX-512: x is
 * rounded into xb first (x NULL: xb already holds the rows' bfloat16 bits), out float32 or (out_bf16) bfloat16
 * bits; AVX2: x float32, out float32, xb unused. */
static void ts_bf16_gemm_rows(const float* x, uint16_t* xb, int64_t M, int64_t K, const uint16_t* w,
                              const float* bias, int64_t N, void* out, int out_bf16) {
    if (M <= 0) return;
#if TS_AVX512
    if (x) bf16_round_rows(x, M, K, xb);
    const int64_t groups = (M + PANEL_ROWS - 1) / PANEL_ROWS, rows = (M + groups - 1) / groups;
    _Pragma("omp for schedule(static)")
    for (int64_t task = 0; task < (N + PANEL - 1) / PANEL * groups; task++) {
        const int64_t p = task / groups, m = task % groups * rows;
        const int R = M - m < rows ? (int)(M - m) : (int)rows;
        const uint16_t* xm = xb + m * K;
        const uint16_t* wp = w + p * K * PANEL;
        void* om = out_bf16 ? (void*)((uint16_t*)out + m * N) : (void*)((float*)out + m * N);
        PANEL_CALL(bf16_panel_task, R, xm, K, wp, bias, N, p * PANEL, om, out_bf16);
    }
#else
    (void)xb, (void)out_bf16;
    _Pragma("omp for schedule(static)")
    for (int64_t t = 0; t < (N + 3) / 4; t++) bf16_tile(x, M, K, w + t * 4 * K, bias, N, t, (float*)out);
#endif
}

void ts_f32_gemm(const ts_matmul* a) {
    _Pragma("omp parallel num_threads(a->threads)")
    ts_f32_gemm_rows((const float*)a->x, a->rows, a->in_features, (const float*)a->weight, a->bias, a->out_features,
                     (float*)a->out);
}

/* io (AVX-512 build only): bit 0 = x holds bfloat16 bits [M, K] (else float32 rows, rounded into scratch,
 * M * K 16-bit values), bit 1 = out gets bfloat16 bits (else float32). The AVX2 build takes float32 in and out. */
void ts_bf16_gemm(const ts_matmul* a) {
    const int x_bf16 = TS_AVX512 && (a->io & 1);
    uint16_t* xb = x_bf16 ? (uint16_t*)a->x : a->bf16_rows;
    _Pragma("omp parallel num_threads(a->threads)")
    ts_bf16_gemm_rows(x_bf16 ? 0 : (const float*)a->x, xb, a->rows, a->in_features, (const uint16_t*)a->weight,
                      a->bias, a->out_features, a->out, TS_AVX512 && (a->io >> 1 & 1));
}

/* llama.cpp's quantize_row_q8_0 rule: d = max|x| / 127, q = round(x / d), half away from zero. */
void ts_q8_quantize(const float* x, int64_t K, int8_t* q, float* d) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float* xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int i = 0; i < QK; i++) q[b * QK + i] = (int8_t)roundf(xb[i] * inv);
    }
}

#if TS_AVX512
/* Two output rows' blocks at once: w holds rows r and r + 1 of a tile's block (64 bytes), abs_x the
 * activation block's |x| in both 256-bit halves, negative its sign bits. w's bytes are negated where x is
 * negative (where x is 0, |x| is, so the byte adds nothing): the AVX2 build's sign_epi8 products, and
 * vpdpbusd's exact int32 lane sums, each half the lanes of one row. */
static inline __m512 block_dot2(__m512i abs_x, __mmask64 negative, const int8_t* w) {
    const __m512i wv = _mm512_loadu_si512((const void*)w);
    const __m512i signed_w = _mm512_mask_sub_epi8(wv, negative, _mm512_setzero_si512(), wv);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), abs_x, signed_w));
}

/* Block k's scales for rows (r, r + 1) of a tile, one per 256-bit half: the activation's d times the
 * weight's per-block scale (grouped), or d alone (a per-row weight scale is applied by store_tile). */
static inline __m512 pair_scale(const float* st, int64_t k, int r, float d) {
    if (!st) return _mm512_set1_ps(d);
    const __m256d high = _mm256_castps_pd(_mm256_set1_ps(d * st[k * 4 + r + 1]));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(d * st[k * 4 + r])), high, 1));
}

static inline __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
static inline __m256 high_half(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* The rounded activation rows qx [M, K] as the tiles read them, made once a call by each thread instead of
 * once per tile: |x| [M, K] and, per block of 32, its sign bits twice (the mask of both 256-bit halves).
 * Each thread makes all M rows (its tiles take every row): a long prefill through q8 (GGUF Q8_0 weights)
 * allocates about M * K * 1.25 bytes a thread for the call, a few ms against the call's seconds. A
 * thread's buffer of at most 1 MiB stays with it for its next calls (and is not freed when it exits). */
typedef struct {
    const uint8_t* abs;
    const uint64_t* negative;
    void* owned; /* a large call's buffer, freed by q8_signs_done; small ones stay with the thread */
} q8_signs;

#define Q8_SIGNS_KEPT (1 << 20)

static q8_signs q8_signs_of(const int8_t* qx, int64_t M, int64_t K) {
    static __thread uint8_t* kept = 0;
    static __thread int64_t kept_bytes = 0;
    const int64_t blocks = K / QK, bytes = (M * K + M * blocks * 8 + 64) / 64 * 64; /* never 0 */
    const int keep = bytes <= Q8_SIGNS_KEPT;
    uint8_t* held = keep && bytes <= kept_bytes ? kept : 0;
    if (!held) {
        if (keep) free(kept), kept = 0, kept_bytes = 0;
        held = (uint8_t*)aligned_alloc(64, bytes);
    }
    if (!held) { /* nothing to compute with; the rows' products would be garbage, so stop here */
        fprintf(stderr, "cpu_gemm: out of memory for %lld bytes of q8 activation signs\n", (long long)bytes);
        abort();
    }
    if (keep) kept = held, kept_bytes = bytes;
    uint64_t* negative = (uint64_t*)held;
    uint8_t* abs = held + M * blocks * 8;
    for (int64_t b = 0; b < M * blocks; b++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qx + b * QK));
        const uint64_t bits = (uint32_t)_mm256_movemask_epi8(v);
        negative[b] = bits | bits << 32;
        _mm256_storeu_si256((__m256i*)(abs + b * QK), _mm256_abs_epi8(v));
    }
    return (q8_signs){abs, negative, keep ? 0 : held};
}

static void q8_signs_done(q8_signs signs) { free(signs.owned); }

/* |x| of an activation block in both halves of a 512-bit vector. */
static inline __m512i block_abs2(const uint8_t* abs) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)abs));
}

/* Four output rows x two activation rows per pass, two output rows per 512-bit instruction: each lane
 * gets the AVX2 build's products and sums in its order, so the results are its bits. */
static inline void q8_tile(const int8_t* wt, const float* st, const uint8_t* x0, const uint64_t* n0, const uint8_t* x1,
                           const uint64_t* n1, const float* d0, const float* d1, int64_t blocks, __m256* a, __m256* b) {
    __m512 a01 = _mm512_setzero_ps(), a23 = a01, b01 = a01, b23 = a01;
    for (int64_t k = 0; k < blocks; k++) {
        const int8_t* wb = wt + k * 4 * QK;
        _mm_prefetch((const char*)(wb + Q8_PREFETCH * 4 * QK), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + Q8_PREFETCH * 4 * QK + 64), _MM_HINT_T0);
        const __m512i au = block_abs2(x0 + k * QK), av = block_abs2(x1 + k * QK);
        const __mmask64 nu = _cvtu64_mask64(n0[k]), nv = _cvtu64_mask64(n1[k]);
        a01 = _mm512_fmadd_ps(block_dot2(au, nu, wb), pair_scale(st, k, 0, d0[k]), a01);
        a23 = _mm512_fmadd_ps(block_dot2(au, nu, wb + 2 * QK), pair_scale(st, k, 2, d0[k]), a23);
        b01 = _mm512_fmadd_ps(block_dot2(av, nv, wb), pair_scale(st, k, 0, d1[k]), b01);
        b23 = _mm512_fmadd_ps(block_dot2(av, nv, wb + 2 * QK), pair_scale(st, k, 2, d1[k]), b23);
    }
    a[0] = low_half(a01), a[1] = high_half(a01), a[2] = low_half(a23), a[3] = high_half(a23);
    b[0] = low_half(b01), b[1] = high_half(b01), b[2] = low_half(b23), b[3] = high_half(b23);
}

/* One activation row against a tile: the sums of q8_tile's first row, in the same order. */
static inline void q8_tile_one(const int8_t* wt, const float* st, const uint8_t* x0, const uint64_t* n0,
                               const float* d0, int64_t blocks, __m256* a) {
    __m512 a01 = _mm512_setzero_ps(), a23 = a01;
    for (int64_t k = 0; k < blocks; k++) {
        const int8_t* wb = wt + k * 4 * QK;
        _mm_prefetch((const char*)(wb + Q8_PREFETCH * 4 * QK), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + Q8_PREFETCH * 4 * QK + 64), _MM_HINT_T0);
        const __m512i au = block_abs2(x0 + k * QK);
        const __mmask64 nu = _cvtu64_mask64(n0[k]);
        a01 = _mm512_fmadd_ps(block_dot2(au, nu, wb), pair_scale(st, k, 0, d0[k]), a01);
        a23 = _mm512_fmadd_ps(block_dot2(au, nu, wb + 2 * QK), pair_scale(st, k, 2, d0[k]), a23);
    }
    a[0] = low_half(a01), a[1] = high_half(a01), a[2] = low_half(a23), a[3] = high_half(a23);
}
#else
/* Sum over one block of 32 of |x| * (w with x's sign), in 8 int32 lanes widened to float: maddubs
 * multiplies unsigned by signed bytes, and |x|, |w| <= 127 keeps each pair sum under int16's limit. */
static inline __m256 block_dot(__m256i abs_x, __m256i x, const int8_t* w, __m256i ones) {
    __m256i signed_w = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)w), x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(abs_x, signed_w), ones));
}

/* Four output rows x two activation rows per pass: each weight block loaded once for two rows. */
static inline void q8_tile(const int8_t* wt, const float* st, const int8_t* x0, const int8_t* x1, const float* d0,
                           const float* d1, int64_t blocks, __m256* a, __m256* b) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        const int8_t* wb = wt + k * 4 * QK;
        _mm_prefetch((const char*)(wb + Q8_PREFETCH * 4 * QK), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + Q8_PREFETCH * 4 * QK + 64), _MM_HINT_T0);
        const __m256i u = _mm256_loadu_si256((const __m256i*)(x0 + k * QK));
        const __m256i v = _mm256_loadu_si256((const __m256i*)(x1 + k * QK));
        const __m256i au = _mm256_sign_epi8(u, u), av = _mm256_sign_epi8(v, v);
        for (int r = 0; r < 4; r++) {
            const float ws = st ? st[k * 4 + r] : 1.0f;
            const __m256 pu = block_dot(au, u, wb + r * QK, ones), pv = block_dot(av, v, wb + r * QK, ones);
            a[r] = _mm256_fmadd_ps(pu, _mm256_set1_ps(d0[k] * ws), a[r]);
            b[r] = _mm256_fmadd_ps(pv, _mm256_set1_ps(d1[k] * ws), b[r]);
        }
    }
}

/* One activation row against a tile: the sums of q8_tile's first row, in the same order. */
static inline void q8_tile_one(const int8_t* wt, const float* st, const int8_t* x0, const float* d0, int64_t blocks,
                               __m256* a) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < 4; r++) a[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        const int8_t* wb = wt + k * 4 * QK;
        _mm_prefetch((const char*)(wb + Q8_PREFETCH * 4 * QK), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + Q8_PREFETCH * 4 * QK + 64), _MM_HINT_T0);
        const __m256i u = _mm256_loadu_si256((const __m256i*)(x0 + k * QK));
        const __m256i au = _mm256_sign_epi8(u, u);
        for (int r = 0; r < 4; r++) {
            const float ws = st ? st[k * 4 + r] : 1.0f;
            const __m256 pu = block_dot(au, u, wb + r * QK, ones);
            a[r] = _mm256_fmadd_ps(pu, _mm256_set1_ps(d0[k] * ws), a[r]);
        }
    }
}

#endif

/* The products of already-rounded activation rows qx [M, K] (block scales dx [M, K/32]) with a packed
 * weight; grouped = 0: ws holds one scale per row [N]; grouped = 1: one per 32 columns, packed
 * [N/4][K/32][4]. The tiles are shared among the enclosing parallel region's threads (an orphaned
 * omp for). Rows run in pairs; a lone (odd) last row runs alone, with the same sums in the same order. */
static void q8_rows(const int8_t* qx, const float* dx, int64_t M, int64_t K, const int8_t* w, const float* ws,
                    int grouped, const float* bias, int64_t N, float* out) {
    if (M <= 0) return; /* every thread alike, so none waits at the omp for */
    const int64_t blocks = K / QK, tiles = (N + 3) / 4;
#if TS_AVX512
    const q8_signs signs = q8_signs_of(qx, M, K);
#define Q8_ROW(m) signs.abs + (m) * K, signs.negative + (m) * blocks
#else
#define Q8_ROW(m) qx + (m) * K
#endif
    _Pragma("omp for schedule(static)")
    for (int64_t t = 0; t < tiles; t++) {
        const int8_t* wt = w + t * 4 * K;
        const float* st = grouped ? ws + t * 4 * blocks : 0;
        const float* row_scale = grouped ? 0 : ws;
        int64_t m = 0;
        for (; m + 1 < M; m += 2) {
            __m256 a[4], b[4];
            q8_tile(wt, st, Q8_ROW(m), Q8_ROW(m + 1), dx + m * blocks, dx + (m + 1) * blocks, blocks, a, b);
            store_tile(out + m * N, N, t * 4, a, row_scale, bias);
            store_tile(out + (m + 1) * N, N, t * 4, b, row_scale, bias);
        }
        if (m < M) {
            __m256 a[4];
            q8_tile_one(wt, st, Q8_ROW(m), dx + m * blocks, blocks, a);
            store_tile(out + m * N, N, t * 4, a, row_scale, bias);
        }
    }
#undef Q8_ROW
#if TS_AVX512
    /* each thread read only the signs it made */
    q8_signs_done(signs);
#endif
}

/* out [M, N] = x [M, K] @ W^T (+ bias), x rounded to Q8_0 blocks into the scratch qx [M, K], dx [M, K/32]. */
void ts_q8_gemm(const ts_matmul* a) {
    const float* x = (const float*)a->x;
    const int64_t M = a->rows, K = a->in_features;
    int8_t* qx = a->q8_rows;
    float* dx = a->q8_scales;
    for (int64_t m = 0; m < M; m++) ts_q8_quantize(x + m * K, K, qx + m * K, dx + m * (K / QK));
    _Pragma("omp parallel num_threads(a->threads)")
    q8_rows(qx, dx, M, K, (const int8_t*)a->weight, a->scale, a->grouped, a->bias, a->out_features, (float*)a->out);
}

/* Q4_0 / Q4_1 (ts_q4_gemm). A row's 32 weights of block k are multiplied by the activation block rounded to
 * Q8_0 (q, d) as llama.cpp's vec_dot_q4_0_q8_0 / q4_1_q8_1 do: the nibble x q products summed exactly in int32,
 * in four lanes per row (lane j: weights 4j..4j+3 and 16+4j..16+4j+3, the bytes vpdpbusd and maddubs + madd
 * both sum into lane j), each lane scaled by d_w * d and added in float32 (four running sums per row), then
 * the lanes added ((0 + 1) + (2 + 3)); Q4_0 takes 8 x the lane's activation sum off each lane first (exact),
 * Q4_1 adds m * d * sum(q) per block in a fifth sum. Both builds do these operations in this order: their
 * results are the same bits, at every batch size (each row of x is computed alone). */
/* A rounded activation block's sums: lane j's (weights 4j..4j+3 and 16+4j..16+4j+3) and d times the total. */
static inline void q4_block_sums(const int8_t* q, float d, int32_t* lane, float* bsum) {
    int32_t total = 0;
    for (int j = 0; j < 4; j++) {
        int32_t t = 0;
        for (int i = 0; i < 4; i++) t += q[4 * j + i] + q[16 + 4 * j + i];
        lane[j] = t;
        total += t;
    }
    *bsum = d * (float)total;
}

/* Row m of x rounded to Q8_0 blocks, with the sums the Q4 products read. */
static inline void q4_round_row(const float* x, int64_t m, int64_t K, int8_t* qx, float* dx, int32_t* sums,
                                float* bsum) {
    const int64_t blocks = K / QK;
    ts_q8_quantize(x + m * K, K, qx + m * K, dx + m * blocks);
    for (int64_t b = 0; b < blocks; b++)
        q4_block_sums(qx + m * K + b * QK, dx[m * blocks + b], sums + (m * blocks + b) * 4, bsum + m * blocks + b);
}

static void q4_round_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, int32_t* sums, float* bsum) {
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < M; m++) q4_round_row(x, m, K, qx, dx, sums, bsum);
}

static inline void q4_finish(const float* lanes, const float* mins4, const float* bias, int64_t n0, int64_t N,
                             float* out) {
    for (int r = 0; r < 4 && n0 + r < N; r++) {
        float y = (lanes[4 * r] + lanes[4 * r + 1]) + (lanes[4 * r + 2] + lanes[4 * r + 3]);
        if (mins4) y = y + mins4[r];
        if (bias) y += bias[n0 + r];
        out[n0 + r] = y;
    }
}

/* Q4_K's scales and minimums as the file holds them, by tiles: per super-block of 256 columns, 48 bytes: the 4
 * rows' 6-bit scale (or minimum) of each of its 8 blocks of 32 (32 bytes, block-major), then the 4 rows' d (or
 * -dmin) as float32. A block's scale is d * scale (minimum: -dmin * min), exact in float32: 4.75 bits a weight
 * in all, against the file's 4.5. */
#define Q4K_SUPER 48
/* Q5_0, Q5_1, Q5_K: the Q4 layout plus each weight's fifth bit, per tile block after its 64 bytes of nibbles: 16
 * bytes, the 64 bits of lo (row r's weights 0-15 at bits 16r..16r+15) then the 64 of hi (weights 16-31). A Q5_0
 * weight is d * (q - 16), Q5_1's d * q + m, Q5_K's as Q4_K's with q of 5 bits. */
#define Q5_BLOCK 80
static inline __m128 q4_k_scales(const void* p, int64_t k) {
    const uint8_t* base = (const uint8_t*)p + (k / 8) * Q4K_SUPER;
    int32_t packed;
    memcpy(&packed, base + (k % 8) * 4, sizeof packed);
    return _mm_mul_ps(_mm_loadu_ps((const float*)(base + 32)), _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(packed))));
}

/* Block k's four rows' scales (or minimums): float16 widened, or Q4_K's (q4_k_scales). */
static inline __m128 q4_scales(const void* p, int64_t k, int k_scales) {
    return k_scales ? q4_k_scales(p, k)
                    : _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)((const uint16_t*)p + k * 4)));
}

/* R activation rows (R <= Q4_ROWS) against one tile: the tile's nibbles and scales are decoded once per block
 * for all R rows; each row's sums are the single-row sums, in the same order. */
#if TS_AVX512
#define Q4_ROWS 4
static inline __attribute__((always_inline)) void q4_tile_rows(
    const int R, const int hb, const uint8_t* wt, const void* dt, const void* mt, int ks, const int8_t* x,
    const float* dx, const int32_t* sums, const float* bsum, int64_t K, int64_t blocks, float (*lanes)[16],
    float (*mins4)[4]) {
    const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(0x10);
    const int64_t stride = hb ? Q5_BLOCK : 64;
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[Q4_ROWS];
    __m128 macc[Q4_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), macc[r] = _mm_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        _mm_prefetch((const char*)(wt + (k + 8) * stride), _MM_HINT_T0);
        if (hb) _mm_prefetch((const char*)(wt + (k + 8) * stride + 64), _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512((const void*)(wt + k * stride));
        __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        if (hb) { /* the fifth bits: one mask bit per byte of lo, then of hi */
            uint64_t bits[2];
            memcpy(bits, wt + k * stride + 64, sizeof bits);
            lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_cvtu64_mask64(bits[0]), sixteen));
            hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_cvtu64_mask64(bits[1]), sixteen));
        }
        const __m512 d16 = _mm512_permutexvar_ps(
            spread, _mm512_castps128_ps512(q4_scales(dt, k, ks)));
        const __m128 m4 = mt ? q4_scales(mt, k, ks) : _mm_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int8_t* xr = x + r * K + k * QK;
            const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)xr));
            const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xr + 16)));
            __m512i isum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
            if (!mt) {
                const __m128i s = _mm_slli_epi32(_mm_loadu_si128((const __m128i*)(sums + (r * blocks + k) * 4)), hb ? 4 : 3);
                isum = _mm512_sub_epi32(isum, _mm512_broadcast_i32x4(s));
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d16, _mm512_set1_ps(dx[r * blocks + k])),
                                     acc[r]);
            if (mt) macc[r] = _mm_fmadd_ps(m4, _mm_set1_ps(bsum[r * blocks + k]), macc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(lanes[r], acc[r]), _mm_storeu_ps(mins4[r], macc[r]);
}
#else
#define Q4_ROWS 2
/* 32 mask bits as bytes: 16 where the bit is set, 0 elsewhere (byte j: bit j). */
static inline __m256i fifth_bits(const uint8_t* p) {
    int32_t m;
    memcpy(&m, p, sizeof m);
    const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                           3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(m), which), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

static inline __attribute__((always_inline)) void q4_tile_rows(
    const int R, const int hb, const uint8_t* wt, const void* dt, const void* mt, int ks, const int8_t* x,
    const float* dx, const int32_t* sums, const float* bsum, int64_t K, int64_t blocks, float (*lanes)[16],
    float (*mins4)[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int64_t stride = hb ? Q5_BLOCK : 64;
    const __m256i first = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), second = _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
    __m256 acc01[Q4_ROWS], acc23[Q4_ROWS];
    __m128 macc[Q4_ROWS];
    for (int r = 0; r < R; r++) acc01[r] = acc23[r] = _mm256_setzero_ps(), macc[r] = _mm_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        _mm_prefetch((const char*)(wt + (k + 8) * stride), _MM_HINT_T0);
        if (hb) _mm_prefetch((const char*)(wt + (k + 8) * stride + 64), _MM_HINT_T0);
        const uint8_t* wb = wt + k * stride;
        const __m256i w01 = _mm256_loadu_si256((const __m256i*)wb);
        const __m256i w23 = _mm256_loadu_si256((const __m256i*)(wb + 32));
        __m256i lo01 = _mm256_and_si256(w01, low), hi01 = _mm256_and_si256(_mm256_srli_epi16(w01, 4), low);
        __m256i lo23 = _mm256_and_si256(w23, low), hi23 = _mm256_and_si256(_mm256_srli_epi16(w23, 4), low);
        if (hb) { /* the fifth bits: lo's rows 0-1, 2-3, then hi's */
            lo01 = _mm256_or_si256(lo01, fifth_bits(wb + 64)), lo23 = _mm256_or_si256(lo23, fifth_bits(wb + 68));
            hi01 = _mm256_or_si256(hi01, fifth_bits(wb + 72)), hi23 = _mm256_or_si256(hi23, fifth_bits(wb + 76));
        }
        const __m256 d8 = _mm256_castps128_ps256(q4_scales(dt, k, ks));
        const __m256 d01 = _mm256_permutevar8x32_ps(d8, first), d23 = _mm256_permutevar8x32_ps(d8, second);
        const __m128 m4 = mt ? q4_scales(mt, k, ks) : _mm_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int8_t* xr = x + r * K + k * QK;
            const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)xr));
            const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xr + 16)));
            __m256i i01 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo01, xl), ones),
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(hi01, xh), ones));
            __m256i i23 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo23, xl), ones),
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(hi23, xh), ones));
            if (!mt) {
                const __m256i s = _mm256_broadcastsi128_si256(
                    _mm_slli_epi32(_mm_loadu_si128((const __m128i*)(sums + (r * blocks + k) * 4)), hb ? 4 : 3));
                i01 = _mm256_sub_epi32(i01, s), i23 = _mm256_sub_epi32(i23, s);
            }
            const __m256 dxv = _mm256_set1_ps(dx[r * blocks + k]);
            acc01[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i01), _mm256_mul_ps(d01, dxv), acc01[r]);
            acc23[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i23), _mm256_mul_ps(d23, dxv), acc23[r]);
            if (mt) macc[r] = _mm_fmadd_ps(m4, _mm_set1_ps(bsum[r * blocks + k]), macc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(lanes[r], acc01[r]);
        _mm256_storeu_ps(lanes[r] + 8, acc23[r]);
        _mm_storeu_ps(mins4[r], macc[r]);
    }
}
#endif

/* Long prefills (more than BLOCK_ROWS rows; fewer run tile by tile): the rows run in blocks of BLOCK_ROWS against
 * panels of PANEL_TILES tiles, so a block's rounded
 * rows (BLOCK_ROWS x K bytes) stay in L2 while a panel's weights (its tiles' blocks) are read for each block,
 * instead of every row being read again from L3 for each tile. Each row's sums are the same whatever the order. */
#define PANEL_TILES 16
#define BLOCK_ROWS 64 /* a multiple of Q4_ROWS: rows group as they would unblocked */
/* The loop over (tile t, rows [m0, m_end)) of an [M, N] product: panels shared among the enclosing parallel
 * region's threads (an orphaned omp for), M <= BLOCK_ROWS tile by tile. The statement after it is the body. */
#define FOR_TILE_ROWS(M, N)                                                                                  \
    const int64_t tiles = ((N) + 3) / 4, per = (M) > BLOCK_ROWS ? PANEL_TILES : 1;                           \
    _Pragma("omp for schedule(static)")                                                                      \
    for (int64_t p = 0; p < (tiles + per - 1) / per; p++)                                                    \
        for (int64_t m0 = 0; m0 < (M); m0 += BLOCK_ROWS)                                                     \
            for (int64_t t = p * per, m_end = m0 + BLOCK_ROWS < (M) ? m0 + BLOCK_ROWS : (M);                 \
                 t < ((p + 1) * per < tiles ? (p + 1) * per : tiles); t++)

/* The products of rounded rows (qx, dx and their sums) with a Q4 weight; the panels are shared among the
 * enclosing parallel region's threads (an orphaned omp for). */
static void q4_rows(const int8_t* qx, const float* dx_all, const int32_t* sums_all, const float* bsum_all, int64_t M,
                    int64_t K, const uint8_t* nibbles, const void* scale, const void* mins, int ks, int hb,
                    const float* bias, int64_t N, float* out) {
    const int64_t blocks = K / QK;
    if (M <= 0) return;
    FOR_TILE_ROWS(M, N) {
        const uint8_t* wt = nibbles + t * blocks * (hb ? Q5_BLOCK : 64);
        const int64_t skip = ks ? t * (blocks / 8) * Q4K_SUPER : t * blocks * 4 * 2; /* earlier tiles' scales */
        const void* dt = (const char*)scale + skip;
        const void* mt = mins ? (const char*)mins + skip : 0;
        for (int64_t m = m0; m < m_end; m += Q4_ROWS) {
            const int R = m_end - m < Q4_ROWS ? (int)(m_end - m) : Q4_ROWS;
            float lanes[Q4_ROWS][16], mins4[Q4_ROWS][4];
            const int8_t* x = qx + m * K;
            const float *dx = dx_all + m * blocks, *bsum = bsum_all + m * blocks;
            const int32_t* sums = sums_all + m * blocks * 4;
#define Q4_TILE(ROWS, HB) q4_tile_rows(ROWS, HB, wt, dt, mt, ks, x, dx, sums, bsum, K, blocks, lanes, mins4)
            switch (R + 8 * hb) { /* constant row counts and planes: the row loops unroll */
                case 1: Q4_TILE(1, 0); break;
                case 2: Q4_TILE(2, 0); break;
                case 9: Q4_TILE(1, 1); break;
                case 10: Q4_TILE(2, 1); break;
#if Q4_ROWS > 2
                case 3: Q4_TILE(3, 0); break;
                case 4: Q4_TILE(4, 0); break;
                case 11: Q4_TILE(3, 1); break;
                default: Q4_TILE(4, 1); break;
#endif
            }
#undef Q4_TILE
            for (int r = 0; r < R; r++)
                q4_finish(lanes[r], mt ? mins4[r] : 0, bias, t * 4, N, out + (m + r) * N);
        }
    }
}

void ts_q4_gemm(const ts_q4_matmul* a) {
    _Pragma("omp parallel num_threads(a->threads)") {
        q4_round_rows(a->x, a->rows, a->in_features, a->q8_rows, a->q8_scales, a->q8_sums, a->q8_block_sums);
        q4_rows(a->q8_rows, a->q8_scales, a->q8_sums, a->q8_block_sums, a->rows, a->in_features, a->nibbles,
                a->scale, a->mins, a->k_scales, a->high_bits, a->bias, a->out_features, a->out);
    }
}

/* Q6_K (ts_q6k_gemm; K_Q6_K in ts_decode_layers). llama.cpp's block_q6_K (256 weights: 6-bit q as 128 bytes of
 * low nibbles and 64 of high bit pairs, 16 int8 scales, a float16 d; w = d * scale * (q - 32), a scale per 16)
 * repacked by tiles of 4 rows at 26.5 bytes per 32 weights (the file: 26.25). Per block of 32, 96 bytes: the
 * 4 rows' 16 bytes of nibbles in Q4_0's order (weight i: byte i % 16, the low nibble for i < 16), then their 8
 * bytes of high pairs (byte b: weights b, 8 + b, 16 + b, 24 + b in bits 0-1, 2-3, 4-5, 6-7); the 4 rows' int8
 * scales of weights 0-15, then of 16-31 ([N/4][K/32][2][4]); each row's d as float32 per 256 ([N/4][K/256][4]).
 * A row's products with an activation block rounded to Q8_0 (q, dx): q x x summed exactly in int32 per lane
 * (lane j: weights 4j..4j+3 of each half of 16), 32 x the half's activation lane sums taken off, each half
 * times its scale and the halves added (exact: every value stays under 2^23), widened to float32 and scaled
 * by d * dx into four running sums per row, added at the end as Q4's are. Both builds do these operations in
 * this order: their results are the same bits, at every batch size. */
#define Q6_BLOCK 96 /* bytes of one tile's block of 32: 4 rows x (16 of nibbles + 8 of high pairs) */
#if TS_AVX512
static inline __attribute__((always_inline)) void q6_tile_rows(const int R, const uint8_t* wt, const int8_t* st,
                                                               const float* dt, const int8_t* x, const float* dx,
                                                               int64_t K, int64_t blocks, float (*lanes)[16]) {
    const __m512i low = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x30), c32 = _mm512_set1_epi8(32);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i twice = _mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0); /* each row's 8 high bytes in both halves */
    const __m512i up = _mm512_set_epi64(2, 4, 2, 4, 2, 4, 2, 4), down = _mm512_set_epi64(2, 0, 2, 0, 2, 0, 2, 0);
    __m512 acc[Q4_ROWS], d16 = _mm512_setzero_ps();
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t* wb = wt + k * Q6_BLOCK;
        _mm_prefetch((const char*)(wb + 8 * Q6_BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + 8 * Q6_BLOCK + 64), _MM_HINT_T0);
        if (k % 8 == 0) d16 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(dt + k / 8 * 4)));
        const __m512i w = _mm512_loadu_si512((const void*)wb);
        const __m512i hb = _mm512_permutexvar_epi64(twice, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(wb + 64))));
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(w, low), _mm512_and_si512(_mm512_sllv_epi64(hb, up), pair));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), low),
                                           _mm512_and_si512(_mm512_srlv_epi64(hb, down), pair));
        const __m128i s8 = _mm_loadl_epi64((const __m128i*)(st + k * 8));
        const __m512i sl = _mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(_mm_cvtepi8_epi32(s8)));
        const __m512i sh = _mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(_mm_cvtepi8_epi32(_mm_srli_si128(s8, 4))));
        for (int r = 0; r < R; r++) {
            const int8_t* xr = x + r * K + k * QK;
            const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)xr));
            const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xr + 16)));
            const __m512i zero = _mm512_setzero_si512();
            const __m512i il = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, lo, xl), _mm512_dpbusd_epi32(zero, c32, xl));
            const __m512i ih = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, hi, xh), _mm512_dpbusd_epi32(zero, c32, xh));
            const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(il, sl), _mm512_mullo_epi32(ih, sh));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d16, _mm512_set1_ps(dx[r * blocks + k])),
                                     acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(lanes[r], acc[r]);
}
#else
static inline __attribute__((always_inline)) void q6_tile_rows(const int R, const uint8_t* wt, const int8_t* st,
                                                               const float* dt, const int8_t* x, const float* dx,
                                                               int64_t K, int64_t blocks, float (*lanes)[16]) {
    const __m256i low = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i first = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), second = _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
    const __m256i up = _mm256_set_epi64x(2, 4, 2, 4), down = _mm256_set_epi64x(2, 0, 2, 0);
    __m256 acc01[Q4_ROWS], acc23[Q4_ROWS], d01 = _mm256_setzero_ps(), d23 = d01;
    for (int r = 0; r < R; r++) acc01[r] = acc23[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t* wb = wt + k * Q6_BLOCK;
        _mm_prefetch((const char*)(wb + 8 * Q6_BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char*)(wb + 8 * Q6_BLOCK + 64), _MM_HINT_T0);
        if (k % 8 == 0) {
            const __m256 d8 = _mm256_castps128_ps256(_mm_loadu_ps(dt + k / 8 * 4));
            d01 = _mm256_permutevar8x32_ps(d8, first), d23 = _mm256_permutevar8x32_ps(d8, second);
        }
        const __m256i w01 = _mm256_loadu_si256((const __m256i*)wb), w23 = _mm256_loadu_si256((const __m256i*)(wb + 32));
        const __m256i h01 = _mm256_permute4x64_epi64(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(wb + 64))), 0x50);
        const __m256i h23 = _mm256_permute4x64_epi64(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(wb + 80))), 0x50);
        const __m256i lo01 = _mm256_or_si256(_mm256_and_si256(w01, low), _mm256_and_si256(_mm256_sllv_epi64(h01, up), pair));
        const __m256i hi01 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w01, 4), low),
                                             _mm256_and_si256(_mm256_srlv_epi64(h01, down), pair));
        const __m256i lo23 = _mm256_or_si256(_mm256_and_si256(w23, low), _mm256_and_si256(_mm256_sllv_epi64(h23, up), pair));
        const __m256i hi23 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w23, 4), low),
                                             _mm256_and_si256(_mm256_srlv_epi64(h23, down), pair));
        const __m128i s8 = _mm_loadl_epi64((const __m128i*)(st + k * 8));
        const __m256i sl = _mm256_castsi128_si256(_mm_cvtepi8_epi32(s8));
        const __m256i sh = _mm256_castsi128_si256(_mm_cvtepi8_epi32(_mm_srli_si128(s8, 4)));
        const __m256i sl01 = _mm256_permutevar8x32_epi32(sl, first), sl23 = _mm256_permutevar8x32_epi32(sl, second);
        const __m256i sh01 = _mm256_permutevar8x32_epi32(sh, first), sh23 = _mm256_permutevar8x32_epi32(sh, second);
        for (int r = 0; r < R; r++) {
            const int8_t* xr = x + r * K + k * QK;
            const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)xr));
            const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xr + 16)));
            const __m256i ol = _mm256_madd_epi16(_mm256_maddubs_epi16(c32, xl), ones);
            const __m256i oh = _mm256_madd_epi16(_mm256_maddubs_epi16(c32, xh), ones);
#define Q6_HALF(W, X, O) _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(W, X), ones), O)
            const __m256i i01 = _mm256_add_epi32(_mm256_mullo_epi32(Q6_HALF(lo01, xl, ol), sl01),
                                                 _mm256_mullo_epi32(Q6_HALF(hi01, xh, oh), sh01));
            const __m256i i23 = _mm256_add_epi32(_mm256_mullo_epi32(Q6_HALF(lo23, xl, ol), sl23),
                                                 _mm256_mullo_epi32(Q6_HALF(hi23, xh, oh), sh23));
#undef Q6_HALF
            const __m256 dxv = _mm256_set1_ps(dx[r * blocks + k]);
            acc01[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i01), _mm256_mul_ps(d01, dxv), acc01[r]);
            acc23[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i23), _mm256_mul_ps(d23, dxv), acc23[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(lanes[r], acc01[r]), _mm256_storeu_ps(lanes[r] + 8, acc23[r]);
}
#endif

/* The products of rounded rows (qx, dx) with a Q6_K weight, in panels and row blocks as q4_rows; the panels
 * are shared among the enclosing parallel region's threads (an orphaned omp for). */
static void q6_rows(const int8_t* qx, const float* dx_all, int64_t M, int64_t K, const uint8_t* bits,
                    const int8_t* scales, const float* d, const float* bias, int64_t N, float* out) {
    const int64_t blocks = K / QK;
    if (M <= 0) return;
    FOR_TILE_ROWS(M, N) {
        const uint8_t* wt = bits + t * blocks * Q6_BLOCK;
        const int8_t* st = scales + t * blocks * 8;
        const float* dt = d + t * (blocks / 8) * 4;
        for (int64_t m = m0; m < m_end; m += Q4_ROWS) {
            const int R = m_end - m < Q4_ROWS ? (int)(m_end - m) : Q4_ROWS;
            float lanes[Q4_ROWS][16];
            const int8_t* x = qx + m * K;
            const float* dx = dx_all + m * blocks;
            switch (R) { /* a constant row count each: the row loops unroll */
                case 1: q6_tile_rows(1, wt, st, dt, x, dx, K, blocks, lanes); break;
                case 2: q6_tile_rows(2, wt, st, dt, x, dx, K, blocks, lanes); break;
#if Q4_ROWS > 2
                case 3: q6_tile_rows(3, wt, st, dt, x, dx, K, blocks, lanes); break;
                default: q6_tile_rows(4, wt, st, dt, x, dx, K, blocks, lanes); break;
#endif
            }
            for (int r = 0; r < R; r++) q4_finish(lanes[r], 0, bias, t * 4, N, out + (m + r) * N);
        }
    }
}

/* ts_q4_matmul's fields for a Q6_K weight: nibbles -> the 96-byte blocks, scale -> the int8 scales, mins -> d. */
void ts_q6k_gemm(const ts_q4_matmul* a) {
    const int64_t K = a->in_features, blocks = K / QK;
    _Pragma("omp parallel num_threads(a->threads)") {
        _Pragma("omp for schedule(static)")
        for (int64_t m = 0; m < a->rows; m++) ts_q8_quantize(a->x + m * K, K, a->q8_rows + m * K, a->q8_scales + m * blocks);
        q6_rows(a->q8_rows, a->q8_scales, a->rows, K, a->nibbles, (const int8_t*)a->scale, (const float*)a->mins,
                a->bias, a->out_features, a->out);
    }
}

/* The lane sums of eight vectors, as one vector (element j: the sum of a[j]'s lanes). */
static inline __m256 hsum8(const __m256* a) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo4 = _mm256_hadd_ps(h01, h23), hi4 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20), _mm256_permute2f128_ps(lo4, hi4, 0x31));
}

static inline __m256 load_kv(const void* base, int64_t offset, int bf16) {
    return bf16 ? widen_bf16((const uint16_t*)base + offset) : _mm256_loadu_ps((const float*)base + offset);
}

/* e^x for eight floats (Cephes' expf: x = n ln2 + r, a degree-5 polynomial in r, times 2^n), within 2 ulp of
 * expf. Above 88 the argument is lowered by ln 2 and the result doubled, so 2^n stays a normal float and
 * results past FLT_MAX become +inf as expf's do; below -87 it is clamped (e^-87 ~ 1.6e-38 stands in for the
 * smaller results); a NaN stays NaN (the clamps take their second operand when either is NaN). */
static inline __m256 exp8(__m256 x) {
    const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
    x = _mm256_sub_ps(x, _mm256_and_ps(big, _mm256_set1_ps(0.693147180559945f)));
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 doubled = _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(2.0f), big);
    return _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(power)), doubled);
}

/* Eight positions' dot products (the first `left` of them in the block) scaled into scores, a masked one
 * -inf; the head's running maximum *top updated. */
static inline void store_scores(__m256 dots8, float scale, int64_t left, const uint8_t* keep, float* out8, float* top) {
    float dots[8];
    _mm256_storeu_ps(dots, _mm256_mul_ps(dots8, _mm256_set1_ps(scale)));
    for (int j = 0; j < 8 && j < left; j++) {
        out8[j] = keep && !keep[j] ? -INFINITY : dots[j];
        if (out8[j] > *top) *top = out8[j];
    }
}

/* Each of a task's heads' scores [group, ctx] (max top[g]) become softmax weights: e^(s - top) eight at a
 * time, the total summed in position order; a masked position weighs exactly nothing. lse, where not NULL,
 * gets each head's log-sum-exp of its scaled scores, top + log(total) (-inf where nothing was kept). */
static void softmax_rows(float* scores, int64_t group, int64_t ctx, const float* top, const uint8_t* keep,
                         float* lse) {
    for (int64_t g = 0; g < group; g++) {
        float* sg = scores + g * ctx;
        const __m256 mx = _mm256_set1_ps(top[g]);
        int64_t p = 0;
        for (; p + 8 <= ctx; p += 8) _mm256_storeu_ps(sg + p, exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + p), mx)));
        if (p < ctx) {
            float lane[8] = {0};
            for (int64_t j = p; j < ctx; j++) lane[j - p] = sg[j] - top[g];
            _mm256_storeu_ps(lane, exp8(_mm256_loadu_ps(lane)));
            for (int64_t j = p; j < ctx; j++) sg[j] = lane[j - p];
        }
        float total = 0.0f;
        for (p = 0; p < ctx; p++) {
            if (keep && !keep[p]) sg[p] = 0.0f; /* e^-87 from the clamp: exactly nothing instead */
            total += sg[p];
        }
        const float inv = 1.0f / total;
        for (p = 0; p < ctx; p++) sg[p] *= inv;
        if (lse) lse[g] = total > 0.0f ? top[g] + logf(total) : -INFINITY;
    }
}

#define ATTN_CHUNK 8 /* output vectors (of 8 floats) one pass over the values accumulates in registers */

#if !TS_AVX512
/* Decode attention straight from the paged arena: one query token per sequence, q [B, H, D] float32,
 * keys/values [slots, KVH, D] (float32 or bfloat16) addressed through blocks [B, nb] of bs slots;
 * mask [B, ctx] (1 = attend) or NULL for every position < ctx. Softmax in float32 (max-subtracted),
 * one (sequence, KV head) pair per task; its H / KVH query heads share each key and value read. Positions
 * are walked block by block; each head's output is summed in registers, ATTN_CHUNK vectors per pass. */
static void attention_task(int64_t task, const float* q, int64_t H, int64_t KVH, int64_t D, const void* k,
                           const void* v, int kv_bf16, const int64_t* blocks, int64_t nb, int64_t bs, int64_t ctx,
                           const uint8_t* mask, float scale, float* out, float* scratch, float* lse) {
    const int64_t group = H / KVH, vecs = D / 8;
    const int64_t b = task / KVH, h = task % KVH;
    const int64_t* table = blocks + b * nb;
    float* scores = scratch + task * group * ctx;
    const uint8_t* keep = mask ? mask + b * ctx : 0;
    const float* qg = q + (b * H + h * group) * D;  /* the group's heads are consecutive */
    float top[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) top[g] = -INFINITY;
    /* Positions go eight at a time where blocks hold whole groups of eight: each one's dot product is summed in
     * the same order whatever the context (a group reaching past it reads slots of its own block, whose
     * results are dropped), so a row's result does not depend on the longest context of its batch. */
    const int wide = bs % 8 == 0;
    for (int64_t p0 = 0; p0 < ctx; p0 += bs) {
        const int64_t base = table[p0 / bs] * bs, n = ctx - p0 < bs ? ctx - p0 : bs;
        int64_t t = 0;
        for (; wide && t < n; t += 8) {  /* eight positions' dot products at once, summed across lanes together */
            const int64_t row = ((base + t) * KVH + h) * D, stride = KVH * D;
            for (int64_t g = 0; g < group; g++) {
                const float* qh = qg + g * D;
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int64_t i = 0; i < vecs; i++) {
                    const __m256 qv = _mm256_loadu_ps(qh + 8 * i);
                    for (int j = 0; j < 8; j++)
                        acc[j] = _mm256_fmadd_ps(qv, load_kv(k, row + j * stride + 8 * i, kv_bf16), acc[j]);
                }
                store_scores(hsum8(acc), scale, n - t, keep ? keep + p0 + t : 0, scores + g * ctx + p0 + t, &top[g]);
            }
        }
        for (; t < n; t++) {
            const int64_t p = p0 + t;
            if (keep && !keep[p]) {
                for (int64_t g = 0; g < group; g++) scores[g * ctx + p] = -INFINITY;
                continue;
            }
            const int64_t row = ((base + t) * KVH + h) * D;
            for (int64_t g = 0; g < group; g++) {
                const float* qh = qg + g * D;
                __m256 acc = _mm256_setzero_ps();
                for (int64_t i = 0; i < vecs; i++)
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), load_kv(k, row + 8 * i, kv_bf16), acc);
                const float sc = hsum(acc) * scale;
                scores[g * ctx + p] = sc;
                if (sc > top[g]) top[g] = sc;
            }
        }
    }
    softmax_rows(scores, group, ctx, top, keep, lse ? lse + b * H + h * group : 0);
    for (int64_t g = 0; g < group; g++) {
        const float* sg = scores + g * ctx;
        for (int64_t c0 = 0; c0 < vecs; c0 += ATTN_CHUNK) {
            const int64_t width = vecs - c0 < ATTN_CHUNK ? vecs - c0 : ATTN_CHUNK;
            __m256 acc[ATTN_CHUNK];
            for (int64_t i = 0; i < width; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t p0 = 0; p0 < ctx; p0 += bs) {
                const int64_t base = table[p0 / bs] * bs, n = ctx - p0 < bs ? ctx - p0 : bs;
                for (int64_t t = 0; t < n; t++) {
                    if (keep && !keep[p0 + t]) continue;
                    const __m256 weight = _mm256_set1_ps(sg[p0 + t]);
                    const int64_t row = ((base + t) * KVH + h) * D + 8 * c0;
                    for (int64_t i = 0; i < width; i++)
                        acc[i] = _mm256_fmadd_ps(weight, load_kv(v, row + 8 * i, kv_bf16), acc[i]);
                }
            }
            float* o = out + (b * H + h * group + g) * D + 8 * c0;
            for (int64_t i = 0; i < width; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);
        }
    }
}
#endif


#if TS_AVX512
#define ATTN_AHEAD 2 /* blocks ahead whose keys and values are prefetched */

/* mask of the lanes of vector i (16 floats) that lie inside a row of D */
static inline __mmask16 row_lanes(int64_t i, int64_t D) {
    const int64_t left = D - 16 * i;
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

static inline __m512 load_kv16(const void* base, int64_t offset, int bf16, __mmask16 lanes) {
    if (bf16) {
        const __m256i raw = _mm256_maskz_loadu_epi16(lanes, (const uint16_t*)base + offset);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_maskz_loadu_ps(lanes, (const float*)base + offset);
}

static inline __m256 fold(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static inline void prefetch_rows(const void* base, int64_t first, int64_t n, int64_t KVH, int64_t h, int64_t D,
                                 int bf16, int hint_t0) {
    const int64_t bytes = D << (bf16 ? 1 : 2);
    for (int64_t u = 0; u < n; u++) {
        const char* r = (const char*)base + ((first + u) * KVH + h) * bytes;
        for (int64_t c = 0; c < bytes; c += 64) {
            if (hint_t0) _mm_prefetch(r + c, _MM_HINT_T0);
            else _mm_prefetch(r + c, _MM_HINT_T1);
        }
    }
}

/* The values pass for NG query heads of one KV head and one chunk of 64 columns (four vectors, masked at
 * the row's end): each value vector loaded is multiplied into every head's sum (NG x 4 accumulators). */
static inline __attribute__((always_inline)) void value_chunk(
    const int NG, const float* sg, int64_t ctx, const void* v, int bf16, const int64_t* table, int64_t bs,
    int64_t KVH, int64_t h, int64_t D, int64_t c, const uint8_t* keep, float* o) {
    __m512 acc[4][4];
    __mmask16 lanes[4];
    for (int i = 0; i < 4; i++) lanes[i] = row_lanes(4 * c + i, D);
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < ctx; p0 += bs) {
        const int64_t base = table[p0 / bs] * bs, n = ctx - p0 < bs ? ctx - p0 : bs;
        for (int64_t t = 0; t < n; t++) {
            if (keep && !keep[p0 + t]) continue;
            const int64_t row = ((base + t) * KVH + h) * D + 64 * c;
            __m512 val[4];
            for (int i = 0; i < 4; i++) val[i] = load_kv16(v, row + 16 * i, bf16, lanes[i]);
            for (int g = 0; g < NG; g++) {
                const __m512 weight = _mm512_set1_ps(sg[g * ctx + p0 + t]);
                for (int i = 0; i < 4; i++) acc[g][i] = _mm512_fmadd_ps(weight, val[i], acc[g][i]);
            }
        }
    }
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < 4; i++) _mm512_mask_storeu_ps(o + g * D + 64 * c + 16 * i, lanes[i], acc[g][i]);
}

/* attention_task's AVX-512 form: 16-float vectors (the last of a row masked), blocks ATTN_AHEAD ahead
 * prefetched, and the values pass shared by up to four query heads. With bfloat16 keys and q_bf16 (queries
 * that are bfloat16 values: a bfloat16 model's) a key row's dot product is vdpbf16ps's exact products
 * summed in pairs. Its sums run in another fixed order than the AVX2 build's (not its bits); like it, a
 * row's result depends on nothing but its own query and context. */
static void attention_task512(int64_t task, const float* q, int64_t H, int64_t KVH, int64_t D, const void* k,
                              const void* v, int kv_bf16, int q_bf16, const int64_t* blocks, int64_t nb,
                              int64_t bs, int64_t ctx, const uint8_t* mask, float scale, float* out,
                              float* scratch, float* lse) {
    const int64_t group = H / KVH, v16 = (D + 15) / 16, stride = KVH * D;
    const int64_t b = task / KVH, h = task % KVH;
    const int64_t* table = blocks + b * nb;
    float* scores = scratch + task * group * ctx;
    const uint8_t* keep = mask ? mask + b * ctx : 0;
    const float* qg = q + (b * H + h * group) * D;
    const int dot_bf16 = kv_bf16 && q_bf16 && group * D <= 16 * 256; /* the queries fit qb */
    uint16_t qb[MAX_GROUP * 256]; /* D <= 256: the queries as bfloat16 (exact: they are bfloat16 values) */
    if (dot_bf16)
        for (int64_t i = 0; i < group * D; i++) qb[i] = (uint16_t)(*(const uint32_t*)&qg[i] >> 16);
    float top[16];
    for (int64_t g = 0; g < group; g++) top[g] = -INFINITY;
    const int wide = bs % 8 == 0;
    if (ctx > 0) prefetch_rows(k, table[0] * bs, ctx < bs ? ctx : bs, KVH, h, D, kv_bf16, 1);
    for (int64_t p0 = 0; p0 < ctx; p0 += bs) {
        const int64_t base = table[p0 / bs] * bs, n = ctx - p0 < bs ? ctx - p0 : bs;
        for (int64_t a = p0 == 0 ? 1 : ATTN_AHEAD; a <= ATTN_AHEAD; a++) {
            const int64_t at = p0 + a * bs;
            if (at < ctx) prefetch_rows(k, table[at / bs] * bs, ctx - at < bs ? ctx - at : bs, KVH, h, D, kv_bf16, 1);
        }
        prefetch_rows(v, base, n, KVH, h, D, kv_bf16, 0);
        int64_t t = 0;
        for (; wide && t < n; t += 8) {
            const int64_t row = (base + t) * stride + h * D;
            for (int64_t g = 0; g < group; g++) {
                __m512 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
                if (dot_bf16) {
                    for (int64_t i = 0; i < D; i += 32) {
                        const __mmask32 lanes = D - i >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (D - i)) - 1);
                        const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(lanes, qb + g * D + i);
                        for (int j = 0; j < 8; j++)
                            acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(
                                lanes, (const uint16_t*)k + row + j * stride + i));
                    }
                } else {
                    const float* qh = qg + g * D;
                    for (int64_t i = 0; i < v16; i++) {
                        const __mmask16 lanes = row_lanes(i, D);
                        const __m512 qv = _mm512_maskz_loadu_ps(lanes, qh + 16 * i);
                        for (int j = 0; j < 8; j++)
                            acc[j] = _mm512_fmadd_ps(qv, load_kv16(k, row + j * stride + 16 * i, kv_bf16, lanes), acc[j]);
                    }
                }
                __m256 half[8];
                for (int j = 0; j < 8; j++) half[j] = fold(acc[j]);
                store_scores(hsum8(half), scale, n - t, keep ? keep + p0 + t : 0, scores + g * ctx + p0 + t, &top[g]);
            }
        }
        for (; t < n; t++) {
            const int64_t p = p0 + t;
            if (keep && !keep[p]) {
                for (int64_t g = 0; g < group; g++) scores[g * ctx + p] = -INFINITY;
                continue;
            }
            const int64_t row = (base + t) * stride + h * D;
            for (int64_t g = 0; g < group; g++) {
                const float* qh = qg + g * D;
                __m512 acc = _mm512_setzero_ps();
                for (int64_t i = 0; i < v16; i++) {
                    const __mmask16 lanes = row_lanes(i, D);
                    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, qh + 16 * i), load_kv16(k, row + 16 * i, kv_bf16, lanes), acc);
                }
                const float sc = _mm512_reduce_add_ps(acc) * scale;
                scores[g * ctx + p] = sc;
                if (sc > top[g]) top[g] = sc;
            }
        }
    }
    softmax_rows(scores, group, ctx, top, keep, lse ? lse + b * H + h * group : 0);
    float* o = out + (b * H + h * group) * D;
    for (int64_t g = 0; g < group; g += 4) {
        const int64_t ng = group - g < 4 ? group - g : 4;
        for (int64_t c = 0; c < (D + 63) / 64; c++) {
            const float* sg = scores + g * ctx;
            float* og = o + g * D;
            switch (ng) {
                case 1: value_chunk(1, sg, ctx, v, kv_bf16, table, bs, KVH, h, D, c, keep, og); break;
                case 2: value_chunk(2, sg, ctx, v, kv_bf16, table, bs, KVH, h, D, c, keep, og); break;
                case 3: value_chunk(3, sg, ctx, v, kv_bf16, table, bs, KVH, h, D, c, keep, og); break;
                default: value_chunk(4, sg, ctx, v, kv_bf16, table, bs, KVH, h, D, c, keep, og); break;
            }
        }
    }
}
#endif

/* One (sequence, KV head) task with this build's kernel. kv_flags: bit 0 = bfloat16 keys and values, bit 1 =
 * the queries are bfloat16 values (a bfloat16 model's), which the AVX-512 kernel's vdpbf16ps takes exactly. */
static inline void attend(int64_t task, const float* q, int64_t H, int64_t KVH, int64_t D, const void* k,
                          const void* v, int kv_flags, const int64_t* blocks, int64_t nb, int64_t bs, int64_t ctx,
                          const uint8_t* mask, float scale, float* out, float* scratch, float* lse) {
#if TS_AVX512
    attention_task512(task, q, H, KVH, D, k, v, kv_flags & 1, kv_flags >> 1 & 1, blocks, nb, bs, ctx, mask, scale,
                      out, scratch, lse);
#else
    attention_task(task, q, H, KVH, D, k, v, kv_flags & 1, blocks, nb, bs, ctx, mask, scale, out, scratch, lse);
#endif
}

/* lse [B, H], where not NULL: each row's log-sum-exp of its scaled scores, to merge partial results */
void ts_decode_attention(const ts_attention* a) {
    _Pragma("omp parallel for schedule(static) num_threads(a->threads)")
    for (int64_t task = 0; task < a->batch * a->kv_heads; task++)
        attend(task, a->q, a->heads, a->kv_heads, a->head_dim, a->k, a->v, a->flags, a->blocks, a->blocks_per_row,
               a->block_size, a->ctx, a->keep, a->scale, a->out, a->scores, a->lse);
}

#if TS_AVX512
/* e^x for sixteen floats: exp8's Cephes polynomial and clamps, one 512-bit vector at a time */
static inline __m512 exp16(__m512 x) {
    const __mmask16 big = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.0f), _CMP_GT_OQ);
    x = _mm512_mask_sub_ps(x, big, x, _mm512_set1_ps(0.693147180559945f));
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i power = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(power));
    return _mm512_mask_add_ps(y, big, y, y);
}

/* exp16 of softmax exponents (a score less the running max: x <= 0, or -inf for a dropped position), the same
 * polynomial: for x in [-87, 0] the same bits, since y * 2^n is exact either way. Below, x is floored at -110,
 * whose 2^n factor (scalef) underflows to an exact 0, so -inf needs no mask and no NaN is made. */
static inline __m512 exp16_softmax(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

#define PA_VECS 3  /* row vectors a prefill attention task takes: 48 query rows (tokens x query heads) */
#define PA_KEYS 64 /* key positions per block of the online softmax */

/* scores of NK keys (rows krow[k], D floats) against NV vectors of query rows, qt [D][NV * 16] (scaled):
 * st [NK][NV * 16], each a sum over d in order */
static inline __attribute__((always_inline)) void pa_scores(const int NK, const int NV, const float* const* krow,
                                                             int64_t D, const float* qt, float* st) {
    __m512 acc[8][PA_VECS];
    for (int k = 0; k < NK; k++)
        for (int v = 0; v < NV; v++) acc[k][v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 qv[PA_VECS];
        for (int v = 0; v < NV; v++) qv[v] = _mm512_load_ps(qt + (d * NV + v) * 16);
        for (int k = 0; k < NK; k++) {
            const __m512 kd = _mm512_set1_ps(krow[k][d]);
            for (int v = 0; v < NV; v++) acc[k][v] = _mm512_fmadd_ps(kd, qv[v], acc[k][v]);
        }
    }
    for (int k = 0; k < NK; k++)
        for (int v = 0; v < NV; v++) _mm512_store_ps(st + (k * NV + v) * 16, acc[k][v]);
}

/* ot [D][NV * 16] rows d0..d0+ND-1 += sum over the nk keys of values (rows vrow[k]) times weights pt [nk][NV * 16] */
static inline __attribute__((always_inline)) void pa_values(const int ND, const int NV, const float* const* vrow,
                                                             int64_t d0, const float* pt, int64_t nk, float* ot) {
    __m512 acc[8][PA_VECS];
    for (int i = 0; i < ND; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = _mm512_load_ps(ot + ((d0 + i) * NV + v) * 16);
    for (int64_t k = 0; k < nk; k++) {
        __m512 pv[PA_VECS];
        for (int v = 0; v < NV; v++) pv[v] = _mm512_load_ps(pt + (k * NV + v) * 16);
        const float* vr = vrow[k] + d0;
        for (int i = 0; i < ND; i++) {
            const __m512 vd = _mm512_set1_ps(vr[i]);
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_fmadd_ps(vd, pv[v], acc[i][v]);
        }
    }
    for (int i = 0; i < ND; i++)
        for (int v = 0; v < NV; v++) _mm512_store_ps(ot + ((d0 + i) * NV + v) * 16, acc[i][v]);
}

/* The bf16 form (bfloat16 keys and values against a bfloat16 model's queries): products by vdpbf16ps, pairs
 * of float32 products added into each lane. Scores: qt2 [D/2][NV * 16] pairs of a row's query (d, d + 1),
 * each key row's pair broadcast; st [NK][NV * 16] = the sums times scale. */
static inline __attribute__((always_inline)) void pa_scores_bf16(const int NK, const int NV,
                                                                  const uint32_t* const* krow, int64_t pairs,
                                                                  const uint32_t* qt2, float scale, float* st) {
    __m512 acc[8][PA_VECS];
    for (int k = 0; k < NK; k++)
        for (int v = 0; v < NV; v++) acc[k][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh qv[PA_VECS];
        for (int v = 0; v < NV; v++) qv[v] = (__m512bh)_mm512_load_si512((const void*)(qt2 + (p * NV + v) * 16));
        for (int k = 0; k < NK; k++) {
            const __m512bh kd = (__m512bh)_mm512_set1_epi32((int)krow[k][p]);
            for (int v = 0; v < NV; v++) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], qv[v], kd);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    for (int k = 0; k < NK; k++)
        for (int v = 0; v < NV; v++) _mm512_store_ps(st + (k * NV + v) * 16, _mm512_mul_ps(acc[k][v], s));
}

/* ot [D][NV * 16] rows d0..d0+ND-1 += the weights (pt2 [nk/2][NV * 16]: pairs of keys 2i, 2i + 1 of a row,
 * rounded to bfloat16) times the values (vp2 [nk/2][D]: the two keys' values at d as one pair) */
static inline __attribute__((always_inline)) void pa_values_bf16(const int ND, const int NV, const uint32_t* vp2,
                                                                  int64_t D, int64_t d0, const uint32_t* pt2,
                                                                  int64_t npairs, float* ot) {
    __m512 acc[8][PA_VECS];
    for (int i = 0; i < ND; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = _mm512_load_ps(ot + ((d0 + i) * NV + v) * 16);
    for (int64_t k = 0; k < npairs; k++) {
        __m512bh pv[PA_VECS];
        for (int v = 0; v < NV; v++) pv[v] = (__m512bh)_mm512_load_si512((const void*)(pt2 + (k * NV + v) * 16));
        const uint32_t* vr = vp2 + k * D + d0;
        for (int i = 0; i < ND; i++) {
            const __m512bh vd = (__m512bh)_mm512_set1_epi32((int)vr[i]);
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], pv[v], vd);
        }
    }
    for (int i = 0; i < ND; i++)
        for (int v = 0; v < NV; v++) _mm512_store_ps(ot + ((d0 + i) * NV + v) * 16, acc[i][v]);
}

#define PA_CASES8(FN, N, ...)                  \
    switch (N) {                               \
        case 1: FN(1, __VA_ARGS__); break;     \
        case 2: FN(2, __VA_ARGS__); break;     \
        case 3: FN(3, __VA_ARGS__); break;     \
        case 4: FN(4, __VA_ARGS__); break;     \
        case 5: FN(5, __VA_ARGS__); break;     \
        case 6: FN(6, __VA_ARGS__); break;     \
        case 7: FN(7, __VA_ARGS__); break;     \
        default: FN(8, __VA_ARGS__); break;    \
    }
#define PA_SCORES_NV(NK, NV, ...) pa_scores(NK, NV, __VA_ARGS__)
#define PA_VALUES_NV(ND, NV, ...) pa_values(ND, NV, __VA_ARGS__)
#define PA_SCORES_BF16(NK, NV, ...) pa_scores_bf16(NK, NV, __VA_ARGS__)
#define PA_VALUES_BF16(ND, NV, ...) pa_values_bf16(ND, NV, __VA_ARGS__)

/* One task: rows r0..r0+n-1 of KV head h's query rows of sequence b (row r = token r / G, query head
 * h * G + r % G), NV vectors of 16 lanes, against key positions lo..hi-1 in blocks of PA_KEYS with an
 * online softmax: per block, scores, a running max per row, weights e^(s - max), earlier sums rescaled. */
static inline __attribute__((always_inline)) void prefill_task(
    const int NV, const float* q, int64_t b, int64_t h, int64_t r0, int64_t n, int64_t Q, int64_t H, int64_t KVH,
    int64_t D, const void* k, const void* v, int kv_bf16, int q_bf16, const int64_t* table, int64_t bs, int64_t ctx,
    const uint8_t* mask, int causal, float scale, float* out, float* lse, float* qt, float* st, float* ot,
    float* kbuf, float* vbuf) {
    const int64_t G = H / KVH, RP = NV * 16;
    /* the bf16 form: bfloat16 keys and values against queries that are bfloat16 values, products by vdpbf16ps */
    const int pairs = kv_bf16 && q_bf16 && D % 2 == 0;
    uint32_t* qt2 = (uint32_t*)qt;   /* pairs: [D/2][RP] query pairs (exact), in qt's room */
    uint32_t* pt2 = (uint32_t*)kbuf; /* pairs: [PA_KEYS/2][RP] weight pairs, rounded to bfloat16 */
    uint32_t* vp2 = (uint32_t*)vbuf; /* pairs: [PA_KEYS/2][D] value pairs of two keys */
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i weave = _mm512_loadu_si512((const void*)interleave);
    int32_t last[PA_VECS * 16];
    int64_t lo = ctx, hi = 0, seen_by_all = ctx; /* positions below seen_by_all are kept for every row */
    memset(qt, 0, (size_t)(D * RP) * sizeof(float));
    for (int64_t r = 0; r < RP; r++) last[r] = 0;
    for (int64_t r = 0; r < n; r++) {
        const int64_t token = (r0 + r) / G, head = h * G + (r0 + r) % G;
        const float* src = q + ((b * Q + token) * H + head) * D;
        if (pairs) /* a bfloat16 value's bits are the top half of its float32 bits */
            for (int64_t d = 0; d < D; d += 2)
                qt2[(d / 2) * RP + r] = (*(const uint32_t*)&src[d] >> 16) | (*(const uint32_t*)&src[d + 1] & 0xFFFF0000u);
        else
            for (int64_t d = 0; d < D; d++) qt[d * RP + r] = src[d] * scale;
        int64_t first = 0, end = causal ? ctx - Q + token + 1 : ctx;
        if (mask) {
            const uint8_t* m = mask + (b * Q + token) * ctx;
            end = ctx;
            while (end > 0 && !m[end - 1]) end--;
            while (first < end && !m[first]) first++;
            seen_by_all = 0; /* every block is masked row by row */
        } else if (end < seen_by_all) {
            seen_by_all = end;
        }
        last[r] = (int32_t)end;
        if (first < lo) lo = first;
        if (end > hi) hi = end;
    }
    lo = lo / PA_KEYS * PA_KEYS;
    __m512 top[PA_VECS], total[PA_VECS], lastv[PA_VECS];
    for (int u = 0; u < NV; u++) {
        top[u] = _mm512_set1_ps(-INFINITY);
        total[u] = _mm512_setzero_ps();
        lastv[u] = _mm512_castsi512_ps(_mm512_loadu_si512(last + 16 * u));
    }
    memset(ot, 0, (size_t)(D * RP) * sizeof(float));
    const float* krow[PA_KEYS];
    const float* vrow[PA_KEYS];
    const uint32_t* krow2[PA_KEYS];
    const uint16_t* vrow16[PA_KEYS];
    for (int64_t p0 = lo; p0 < hi; p0 += PA_KEYS) {
        const int64_t nk = hi - p0 < PA_KEYS ? hi - p0 : PA_KEYS;
        for (int64_t j = 0; j < nk; j++) {
            const int64_t t = p0 + j, row = ((table[t / bs] * bs + t % bs) * KVH + h) * D;
            if (pairs) {
                krow2[j] = (const uint32_t*)((const uint16_t*)k + row), vrow16[j] = (const uint16_t*)v + row;
            } else if (kv_bf16) { /* widened once into the task's buffers: exact */
                const uint16_t* kr = (const uint16_t*)k + row;
                const uint16_t* vr = (const uint16_t*)v + row;
                for (int64_t i = 0; i < (D + 15) / 16; i++) {
                    const __mmask16 lanes = row_lanes(i, D);
                    _mm512_mask_storeu_ps(kbuf + j * D + 16 * i, lanes, load_kv16(kr, 16 * i, 1, lanes));
                    _mm512_mask_storeu_ps(vbuf + j * D + 16 * i, lanes, load_kv16(vr, 16 * i, 1, lanes));
                }
                krow[j] = kbuf + j * D, vrow[j] = vbuf + j * D;
            } else {
                krow[j] = (const float*)k + row, vrow[j] = (const float*)v + row;
            }
        }
        for (int64_t t = p0 + PA_KEYS; t < p0 + 2 * PA_KEYS && t < hi; t++) { /* the next block's rows, ahead */
            const int64_t row = ((table[t / bs] * bs + t % bs) * KVH + h) * D * (kv_bf16 ? 2 : 4);
            for (int64_t line = 0; line < D * (kv_bf16 ? 2 : 4); line += 64) {
                _mm_prefetch((const char*)k + row + line, _MM_HINT_T0);
                _mm_prefetch((const char*)v + row + line, _MM_HINT_T0);
            }
        }
        if (pairs) { /* keys 2i and 2i + 1's values at d as one pair (a missing second key: 0) */
            for (int64_t j2 = 0; j2 < (nk + 1) / 2; j2++) {
                const uint16_t* va = vrow16[2 * j2];
                const uint16_t* vb = 2 * j2 + 1 < nk ? vrow16[2 * j2 + 1] : NULL;
                for (int64_t i = 0; i < (D + 15) / 16; i++) {
                    const __mmask16 lanes = row_lanes(i, D);
                    const __m512i first = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, va + 16 * i));
                    const __m512i second =
                        vb ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, vb + 16 * i)), 16)
                           : _mm512_setzero_si512();
                    _mm512_mask_storeu_epi32(vp2 + j2 * D + 16 * i, lanes, _mm512_or_si512(first, second));
                }
            }
            for (int64_t j = nk; j < (nk + 7) / 8 * 8; j++) krow2[j] = krow2[0]; /* scores past nk are dropped */
            for (int64_t j = 0; j < nk; j += 8) {
                const int64_t nj = nk - j < 8 ? nk - j : 8;
                if (NV == 1) {
                    PA_CASES8(PA_SCORES_BF16, nj, 1, krow2 + j, D / 2, qt2, scale, st + j * RP)
                } else if (NV == 2) {
                    PA_CASES8(PA_SCORES_BF16, nj, 2, krow2 + j, D / 2, qt2, scale, st + j * RP)
                } else {
                    PA_CASES8(PA_SCORES_BF16, nj, 3, krow2 + j, D / 2, qt2, scale, st + j * RP)
                }
            }
        } else {
            for (int64_t j = nk; j < (nk + 7) / 8 * 8; j++) krow[j] = krow[0]; /* scores past nk are dropped */
            for (int64_t j = 0; j < nk; j += 8) {
                const int64_t nj = nk - j < 8 ? nk - j : 8;
                if (NV == 1) {
                    PA_CASES8(PA_SCORES_NV, nj, 1, krow + j, D, qt, st + j * RP)
                } else if (NV == 2) {
                    PA_CASES8(PA_SCORES_NV, nj, 2, krow + j, D, qt, st + j * RP)
                } else {
                    PA_CASES8(PA_SCORES_NV, nj, 3, krow + j, D, qt, st + j * RP)
                }
            }
        }
        if (mask) { /* a dropped position scores -inf */
            for (int64_t r = 0; r < n; r++) {
                const uint8_t* m = mask + (b * Q + (r0 + r) / G) * ctx + p0;
                for (int64_t j = 0; j < nk; j++)
                    if (!m[j]) st[j * RP + r] = -INFINITY;
            }
        } else if (p0 + nk > seen_by_all) { /* causal: row r sees positions below last[r] */
            for (int64_t j = 0; j < nk; j++)
                for (int u = 0; u < NV; u++) {
                    const __mmask16 keep = _mm512_cmpgt_epi32_mask(_mm512_castps_si512(lastv[u]),
                                                                   _mm512_set1_epi32((int32_t)(p0 + j)));
                    float* s = st + (j * NV + u) * 16;
                    _mm512_store_ps(s, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, _mm512_load_ps(s)));
                }
        }
        for (int u = 0; u < NV; u++) {
            __m512 mx = top[u];
            for (int64_t j = 0; j < nk; j++) mx = _mm512_max_ps(mx, _mm512_load_ps(st + (j * NV + u) * 16));
            /* a row with nothing kept yet keeps weights 0 (e^-inf), not NaN */
            const __mmask16 none = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
            const __m512 base = _mm512_mask_mov_ps(mx, none, _mm512_setzero_ps());
            const __m512 rescale = exp16(_mm512_sub_ps(top[u], base));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < nk; j++) {
                float* s = st + (j * NV + u) * 16;
                const __m512 e = exp16_softmax(_mm512_sub_ps(_mm512_load_ps(s), base));
                _mm512_store_ps(s, e);
                sum = _mm512_add_ps(sum, e);
            }
            total[u] = _mm512_fmadd_ps(total[u], rescale, sum);
            for (int64_t j2 = 0; pairs && j2 < (nk + 1) / 2; j2++) { /* weights of keys 2i, 2i + 1 as pairs */
                const __m512 e0 = _mm512_load_ps(st + (2 * j2 * NV + u) * 16);
                const __m512 e1 = 2 * j2 + 1 < nk ? _mm512_load_ps(st + ((2 * j2 + 1) * NV + u) * 16) : _mm512_setzero_ps();
                const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(e1, e0); /* words 0-15: e0, 16-31: e1 */
                _mm512_store_si512((void*)(pt2 + (j2 * NV + u) * 16), _mm512_permutexvar_epi16(weave, halves));
            }
            top[u] = mx;
            if (p0 > lo)
                for (int64_t d = 0; d < D; d++) {
                    float* o = ot + (d * NV + u) * 16;
                    _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), rescale));
                }
        }
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            const int64_t nd = D - d0 < 8 ? D - d0 : 8, np = (nk + 1) / 2;
            if (pairs) {
                if (NV == 1) {
                    PA_CASES8(PA_VALUES_BF16, nd, 1, vp2, D, d0, pt2, np, ot)
                } else if (NV == 2) {
                    PA_CASES8(PA_VALUES_BF16, nd, 2, vp2, D, d0, pt2, np, ot)
                } else {
                    PA_CASES8(PA_VALUES_BF16, nd, 3, vp2, D, d0, pt2, np, ot)
                }
            } else if (NV == 1) {
                PA_CASES8(PA_VALUES_NV, nd, 1, vrow, d0, st, nk, ot)
            } else if (NV == 2) {
                PA_CASES8(PA_VALUES_NV, nd, 2, vrow, d0, st, nk, ot)
            } else {
                PA_CASES8(PA_VALUES_NV, nd, 3, vrow, d0, st, nk, ot)
            }
        }
    }
    float inv[PA_VECS * 16];
    for (int u = 0; u < NV; u++) {
        const __m512 t = total[u];
        const __mmask16 some = _mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_GT_OQ);
        _mm512_storeu_ps(inv + 16 * u, _mm512_maskz_div_ps(some, _mm512_set1_ps(1.0f), t)); /* nothing kept: 0 */
    }
    float mx[PA_VECS * 16], sum[PA_VECS * 16];
    for (int u = 0; u < NV; u++) _mm512_storeu_ps(mx + 16 * u, top[u]), _mm512_storeu_ps(sum + 16 * u, total[u]);
    for (int64_t r = 0; r < n; r++) {
        const int64_t token = (r0 + r) / G, head = h * G + (r0 + r) % G;
        float* dst = out + ((b * Q + token) * H + head) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = ot[d * RP + r] * inv[r];
        if (lse) lse[(b * Q + token) * H + head] = sum[r] > 0.0f ? mx[r] + logf(sum[r]) : -INFINITY;
    }
}

/* Prefill attention straight from the paged arena: Q query tokens per sequence, q [B * Q, H, D] float32 (row
 * b * Q + i is sequence b's token i), keys/values [slots, KVH, D] (float32 or bfloat16: kv_flags bit 0; bit 1:
 * the queries are bfloat16 values, which with bfloat16 keys and an even D selects the bf16 form) through blocks
 * [B, nb] of bs slots; mask [B, Q, ctx] (1 = attend), or NULL: causal attention with token i at position
 * ctx - Q + i, or (causal 0) every row sees all ctx positions. lse [B * Q, H], where not NULL, gets each
 * row's log-sum-exp of its scaled scores (-inf where nothing was kept), to merge partial results. A task is up to 48 query rows of one KV head (its query heads for consecutive tokens of one
 * sequence), held as the lanes of three vectors: every key and value read serves them all, and the softmax
 * (float32, an online max per row, blocks of 64 positions) runs across rows in whole vectors. A row's result
 * depends on nothing but its own query, mask row and the keys and values it reads, not on the batch, the
 * other rows of its task or the split among threads. */
/* A task's buffers (one set per thread): the transposed queries, outputs and scores of up to PA_VECS * 16
 * rows, and for bfloat16 keys the widened keys and values, or (the bf16 form) their weight and value pairs */
typedef struct {
    float *qt, *ot, *st, *kbuf, *vbuf;
} pa_buffers;

static pa_buffers pa_alloc(int64_t D, int kv_bf16) {
    const int64_t cap = PA_VECS * 16;
    const int64_t kv_floats = (PA_KEYS * D > PA_KEYS / 2 * cap ? PA_KEYS * D : PA_KEYS / 2 * cap) + 16;
    pa_buffers buf;
    buf.qt = aligned_alloc(64, (size_t)(D * cap) * sizeof(float));
    buf.ot = aligned_alloc(64, (size_t)(D * cap) * sizeof(float));
    buf.st = aligned_alloc(64, (size_t)(PA_KEYS * cap) * sizeof(float));
    buf.kbuf = kv_bf16 ? aligned_alloc(64, (size_t)(kv_floats / 16 * 16) * sizeof(float)) : NULL;
    buf.vbuf = kv_bf16 ? aligned_alloc(64, (size_t)(kv_floats / 16 * 16) * sizeof(float)) : NULL;
    return buf;
}

static void pa_free(pa_buffers* buf) { free(buf->qt), free(buf->ot), free(buf->st), free(buf->kbuf), free(buf->vbuf); }

/* How ts_prefill_attention splits Q tokens x G query heads of one KV head into tasks of at most PA_VECS * 16
 * rows: *tiles tasks of *per rows (the last may have fewer) */
static inline void pa_tiles(int64_t rows, int64_t* tiles, int64_t* per) {
    const int64_t cap = PA_VECS * 16;
    *tiles = (rows + cap - 1) / cap;
    *per = (rows + *tiles - 1) / *tiles;
}

/* rows r0 .. r0 + n - 1 of sequence b's query rows for KV head h (prefill_task with its vector count) */
static void pa_rows(const float* q, int64_t b, int64_t h, int64_t r0, int64_t n, int64_t Q, int64_t H, int64_t KVH,
                    int64_t D, const void* k, const void* v, int kv_bf16, int q_bf16, const int64_t* table,
                    int64_t bs, int64_t ctx, const uint8_t* mask, int causal, float scale, float* out, float* lse,
                    const pa_buffers* buf) {
    const int NV = (int)((n + 15) / 16);
    if (NV == 1)
        prefill_task(1, q, b, h, r0, n, Q, H, KVH, D, k, v, kv_bf16, q_bf16, table, bs, ctx, mask, causal, scale, out,
                     lse, buf->qt, buf->st, buf->ot, buf->kbuf, buf->vbuf);
    else if (NV == 2)
        prefill_task(2, q, b, h, r0, n, Q, H, KVH, D, k, v, kv_bf16, q_bf16, table, bs, ctx, mask, causal, scale, out,
                     lse, buf->qt, buf->st, buf->ot, buf->kbuf, buf->vbuf);
    else
        prefill_task(3, q, b, h, r0, n, Q, H, KVH, D, k, v, kv_bf16, q_bf16, table, bs, ctx, mask, causal, scale, out,
                     lse, buf->qt, buf->st, buf->ot, buf->kbuf, buf->vbuf);
}

void ts_prefill_attention(const ts_attention* a) {
    const float* q = a->q;
    const int64_t B = a->batch, Q = a->q_len, H = a->heads, KVH = a->kv_heads, D = a->head_dim;
    const void *k = a->k, *v = a->v;
    const int kv_flags = a->flags, causal = a->causal, threads = a->threads;
    const int64_t *blocks = a->blocks, nb = a->blocks_per_row, bs = a->block_size, ctx = a->ctx;
    const uint8_t* mask = a->keep;
    const float scale = a->scale;
    float *out = a->out, *lse = a->lse;
    const int64_t G = H / KVH, rows = Q * G;
    const int kv_bf16 = kv_flags & 1, q_bf16 = (kv_flags >> 1) & 1;
    int64_t tiles, per;
    pa_tiles(rows, &tiles, &per);
    _Pragma("omp parallel num_threads(threads)")
    {
        pa_buffers buf = pa_alloc(D, kv_bf16);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t task = 0; task < B * KVH * tiles; task++) {
            const int64_t b = task / (KVH * tiles), h = task / tiles % KVH, tile = task % tiles;
            const int64_t r0 = tile * per, n = rows - r0 < per ? rows - r0 : per;
            pa_rows(q, b, h, r0, n, Q, H, KVH, D, k, v, kv_bf16, q_bf16, blocks + b * nb, bs, ctx, mask, causal, scale,
                    out, lse, &buf);
        }
        pa_free(&buf);
    }
}
#endif

/* torch's float -> bfloat16 conversion (round to nearest even; a NaN becomes a quiet NaN), widened back */
static inline float round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits = f != f ? 0x7FC00000u : ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float rounded(float f, int bf16) { return bf16 ? round_bf16(f) : f; }

static inline uint16_t bf16_bits(float f) { /* f already a bfloat16 value */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)(bits >> 16);
}

/* Attention over two disjoint key sets from each set's result and log-sum-exp, one row of D values:
 * (a e^(la - top) + b e^(lb - top)) / (e^(la - top) + e^(lb - top)), top the larger log-sum-exp, in float32
 * (merge_attention in paged_attention.py's order); bf16: a and b rounded to bfloat16 first (as the layer
 * loop's bfloat16 results of the two parts are) */
static inline void merge_row(const float* a, float la, const float* b, float lb, int64_t D, int bf16, float* out) {
    const float top = la > lb ? la : lb;
    const float wa = expf(la - top), wb = expf(lb - top), total = wa + wb;
    for (int64_t d = 0; d < D; d++) out[d] = (rounded(a[d], bf16) * wa + rounded(b[d], bf16) * wb) / total;
}

void ts_merge_attention(const float* a, const float* la, const float* b, const float* lb, int64_t n, int64_t D,
                        float* out, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t i = 0; i < n; i++) merge_row(a + i * D, la[i], b + i * D, lb[i], D, 0, out + i * D);
}

/* 1 / sqrt(mean(x^2) + eps) of one row, summed in float32 eight lanes at a time. */
static inline float norm_scale(const float* xr, int64_t H, float eps) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) {
        const __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float total = hsum(acc);
    for (; i < H; i++) total += xr[i] * xr[i];
    return 1.0f / sqrtf(total / (float)H + eps);
}

/* Hugging Face's LlamaRMSNorm in float32 for a few rows: out = weight * x / sqrt(mean(x^2) + eps). */
void ts_rms_norm(const float* x, int64_t M, int64_t H, const float* weight, float eps, float* out) {
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * H;
        float* o = out + m * H;
        const float inv = norm_scale(xr, H, eps);
        const __m256 s = _mm256_set1_ps(inv);
        int64_t i = 0;
        for (; i + 8 <= H; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), s)));
        for (; i < H; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* The same for bfloat16 rows (held as float32 values): normalised in float32, rounded to bfloat16, then
 * multiplied by the (bfloat16) weight and rounded again, as llama.py's rms_norm does in that dtype. */
void ts_rms_norm_bf16(const float* x, int64_t M, int64_t H, const float* weight, float eps, float* out) {
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * H;
        const float inv = norm_scale(xr, H, eps);
        for (int64_t i = 0; i < H; i++) out[m * H + i] = round_bf16(weight[i] * round_bf16(xr[i] * inv));
    }
}

static inline __m256 silu8(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

/* silu(g) * u, eight at a time (a last partial vector through the same lanes, so every element is computed
 * alike wherever it lies); bf16: silu rounded to bfloat16, then the product. */
/* round_bf16 of eight floats */
static inline __m256 round_bf16_8(__m256 f) {
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32((int)0xFFFF0000u)));
    return _mm256_blendv_ps(rounded, _mm256_set1_ps(NAN), _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
}

static inline void silu_mul8(const float* g, const float* u, int bf16, float* o) {
    const __m256 silu = silu8(_mm256_loadu_ps(g));
    if (!bf16) {
        _mm256_storeu_ps(o, _mm256_mul_ps(silu, _mm256_loadu_ps(u)));
        return;
    }
    _mm256_storeu_ps(o, round_bf16_8(_mm256_mul_ps(round_bf16_8(silu), _mm256_loadu_ps(u))));
}

static inline void silu_mul_span(const float* g, const float* u, int64_t n, int bf16, float* o) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) silu_mul8(g + i, u + i, bf16, o + i);
    const int rest = (int)(n - i);  /* 0-7 */
    if (rest > 0) {
        float gl[8] = {0}, ul[8] = {0}, ol[8];
        for (int j = 0; j < rest && j < 8; j++) gl[j] = g[i + j], ul[j] = u[i + j];
        silu_mul8(gl, ul, bf16, ol);
        for (int j = 0; j < rest && j < 8; j++) o[i + j] = ol[j];
    }
}

/* fbgemm's input as linear.py builds it: each row of x [M, K] divided by its largest |x| (at least 1e-12; a
 * NaN stays NaN) into out [M + 1, K], whose last row is (1, -1, 0, ...), and the divisors into norms [M]. The
 * same max, clamp and correctly rounded division as torch's abs().amax().clamp_min_() and rows / norms, so
 * the same bits, in one pass instead of five ops. */
void ts_unit_rows(const float* x, int64_t M, int64_t K, float* out, float* norms, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(M * K >= 65536)")
    for (int64_t m = 0; m < M; m++) {
        const float* row = x + m * K;
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 top8 = _mm256_setzero_ps(), nan8 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 v = _mm256_loadu_ps(row + k);
            top8 = _mm256_max_ps(_mm256_and_ps(v, magnitude), top8); /* a NaN lane keeps top8's */
            nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8], top = 0.0f;
        _mm256_storeu_ps(lanes, top8);
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
        int nan = _mm256_movemask_ps(nan8) != 0;
        for (; k < K; k++) {
            const float a = fabsf(row[k]);
            nan |= a != a;
            top = a > top ? a : top;
        }
        if (nan) top = NAN;
        else if (top < 1e-12f) top = 1e-12f;
        norms[m] = top;
        float* o = out + m * K;
        const __m256 d = _mm256_set1_ps(top);
        for (k = 0; k + 8 <= K; k += 8) _mm256_storeu_ps(o + k, _mm256_div_ps(_mm256_loadu_ps(row + k), d));
        for (; k < K; k++) o[k] = row[k] / top;
    }
    float* span = out + M * K;
    for (int64_t k = 0; k < K; k++) span[k] = 0.0f;
    if (K > 0) span[0] = 1.0f;
    if (K > 1) span[1] = -1.0f;
}

/* SwiGLU: gate_up [M, 2I] (gate, then up) -> out [M, I] = silu(gate) * up in float32. Rows are shared among
 * the threads. */
void ts_silu_mul(const float* gate_up, int64_t M, int64_t I, float* out, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(M > 4)")
    for (int64_t m = 0; m < M; m++) silu_mul_span(gate_up + m * 2 * I, gate_up + m * 2 * I + I, I, 0, out + m * I);
}

/* The same for bfloat16 rows held as bfloat16 bits, in and out: each span of 64 columns widened (exactly),
 * through silu_mul_span with bf16 = 1, and its (already rounded) results narrowed back. */
void ts_silu_mul_bf16(const uint16_t* gate_up, int64_t M, int64_t I, uint16_t* out, int threads) {
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(M > 4)")
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* row = gate_up + m * 2 * I;
        for (int64_t at = 0; at < I; at += 64) {
            const int64_t n = I - at < 64 ? I - at : 64;
            float g[64], u[64], o[64];
            for (int64_t i = 0; i < n; i++) {
                const uint32_t gb = (uint32_t)row[at + i] << 16, ub = (uint32_t)row[I + at + i] << 16;
                memcpy(g + i, &gb, 4), memcpy(u + i, &ub, 4);
            }
            silu_mul_span(g, u, n, 1, o);
            for (int64_t i = 0; i < n; i++) out[m * I + at + i] = bf16_bits(o[i]);
        }
    }
}

/* Decode rows through every layer of a Llama-family decoder, in one parallel region: the per-layer
 * work of the Python path (llama.py) with no return to Python between operations. Each operation is
 * computed by the same code in the same order as its single-call kernel above (RMSNorm, q8, bfloat16 or
 * float32 panel products, decode attention, SiLU-mul), and RoPE, the arena store and the residual adds as torch
 * computes them, so the result is the same to the bit. With act_bf16 the activations are bfloat16 values
 * held in float32, rounded wherever the Python path's bfloat16 tensors round them.
 *
 * The arguments are ts_decode_step's (the interface, above), each layer a ts_layer. */

/* One head's RoPE as llama.py computes it: x * cos + roll(x, D/2) * sin_signed, each product rounded. */
static inline void rope_head(const float* x, const float* cos, const float* sin, int64_t D, int bf16, float* out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) {
        const float a = rounded(x[i] * cos[i], bf16), b = rounded(x[(i + half) % D] * sin[i], bf16);
        out[i] = rounded(a + b, bf16);
    }
}

/* Row m of x [M, K] rounded to Q8_0 blocks where the projection is q8 (its products read qx, dx). */
static inline int is_q8(int64_t kind) { return kind == K_Q8_ROW || kind == K_Q8_GROUPED; }
static inline int is_q5(int64_t kind) { return kind == K_Q5_0 || kind == K_Q5_1 || kind == K_Q5_K; }
static inline int is_q4(int64_t kind) { return kind == K_Q4_0 || kind == K_Q4_1 || kind == K_Q4_K || is_q5(kind); }
static inline int rounds_rows(int64_t kind) { return is_q8(kind) || kind == K_Q6_K; } /* Q8_0 rows, no sums */

/* The rounded rows (and, Q4, their sums) the integer products read: q8 and Q4 projections' scratch. */
typedef struct {
    int8_t* qx;
    float* dx;
    int32_t* sums;
    float* bsum;
} rounded_rows;

static void prepare_row(int kind, const float* x, int64_t m, int64_t K, rounded_rows r) {
    if (rounds_rows(kind)) ts_q8_quantize(x + m * K, K, r.qx + m * K, r.dx + m * (K / QK));
    if (is_q4(kind)) q4_round_row(x, m, K, r.qx, r.dx, r.sums, r.bsum);
}

static void project(int kind, const float* x, rounded_rows r, uint16_t* xb, int64_t M, int64_t K, const void* w,
                    const float* ws, const void* mins, const float* bias, int64_t N, float* out) {
    if (kind == K_BF16)
        ts_bf16_gemm_rows(x, xb, M, K, (const uint16_t*)w, bias, N, out, 0);
    else if (kind == K_F32)
        ts_f32_gemm_rows(x, M, K, (const float*)w, bias, N, out);
    else if (is_q4(kind))
        q4_rows(r.qx, r.dx, r.sums, r.bsum, M, K, (const uint8_t*)w, ws, kind == K_Q4_0 || kind == K_Q5_0 ? 0 : mins,
                kind == K_Q4_K || kind == K_Q5_K, is_q5(kind), bias, N, out);
    else if (kind == K_Q6_K)
        q6_rows(r.qx, r.dx, M, K, (const uint8_t*)w, (const int8_t*)ws, (const float*)mins, bias, N, out);
    else
        q8_rows(r.qx, r.dx, M, K, (const int8_t*)w, ws, kind == K_Q8_GROUPED, bias, N, out);
}

static void add_rows(float* hidden, const float* delta, int64_t n, int bf16) {
    for (int64_t i = 0; i < n; i++) hidden[i] = rounded(hidden[i] + rounded(delta[i], bf16), bf16);
}

/* Per-row work (norms, RoPE, the arena store, residual adds, roundings) is split by rows among the threads:
 * each row is computed by the same code whichever thread takes it, so the bits do not depend on the split. */
void ts_decode_layers(const ts_decode_step* step) {
    const int64_t M = step->rows, layers = step->layers, H = step->hidden_size, NH = step->heads;
    const int64_t KVH = step->kv_heads, D = step->head_dim, I = step->intermediate_size;
    const float eps = step->eps, scale = step->scale;
    const int act_bf16 = step->act_bf16, kv_bf16 = step->kv_bf16, threads = step->threads;
    float* hidden = step->hidden;
    const float *cos = step->cos, *sin = step->sin;
    const int64_t *slots = step->slots, *blocks = step->blocks;
    const int64_t nb = step->blocks_per_row, bs = step->block_size, ctx = step->ctx;
    float *work = step->work, *dx = step->q8_scales;
    int8_t* qx = step->q8_rows;
    const rounded_rows rr = {qx, dx, step->q4_sums, step->q4_block_sums};
    const int64_t qkv_n = (NH + 2 * KVH) * D, qsize = NH * D, kvsize = KVH * D;
    const int64_t wide = H > I ? H : I, widest = wide > qsize ? wide : qsize;
    void (*norm)(const float*, int64_t, int64_t, const float*, float, float*) = act_bf16 ? ts_rms_norm_bf16 : ts_rms_norm;
    float* x = work;                      /* [M, max(H, I)] a projection's input rows */
    float* qkv = x + M * wide;            /* [M, qkv_n] */
    float* qh = qkv + M * qkv_n;          /* [M, NH * D] roped queries */
    float* attn = qh + M * qsize;         /* [M, NH * D] */
    float* delta = attn + M * qsize;      /* [M, H] a projection's output before the residual add */
    float* gu = delta + M * H;            /* [M, 2I] */
    uint16_t* xb = (uint16_t*)(gu + M * 2 * I);            /* [M, widest] bfloat16 rows of a bf16 projection */
    float* common = gu + M * 2 * I + M * ((widest + 15) / 16 * 8); /* [M, NH * D] the shared prefix's part */
    float* own_lse = common + M * qsize;  /* [M, NH] */
    float* common_lse = own_lse + M * NH; /* [M, NH] */
    float* scores = common_lse + M * NH;  /* [M * NH * ctx] */
#if TS_AVX512
    const int64_t G = NH / KVH;
    int64_t common_tiles, common_per;
    pa_tiles(M * G, &common_tiles, &common_per);
#endif
    _Pragma("omp parallel num_threads(threads)")
    {
#if TS_AVX512
    pa_buffers buf = {0};
    if (step->shared_tokens) buf = pa_alloc(D, kv_bf16);
#endif
    for (int64_t l = 0; l < layers; l++) {
        const ts_layer* p = step->layer + l;
        _Pragma("omp for schedule(static)")
        for (int64_t m = 0; m < M; m++) {
            if (l > 0) add_rows(hidden + m * H, delta + m * H, H, act_bf16);
            norm(hidden + m * H, 1, H, p->input_norm, eps, x + m * H);
            prepare_row(p->qkv_kind, x, m, H, rr);
            if (p->qkv_tail_rows) prepare_row(p->qkv_tail_kind, x, m, H, rr); /* the same rounded rows (and sums) */
        }
        if (p->qkv_tail_rows) { /* each part into the gate/up area (not yet in use), then the rows joined */
            const int64_t tail = p->qkv_tail_rows, head = qkv_n - tail;
            float *first = gu, *second = gu + M * head;
            project(p->qkv_kind, x, rr, xb, M, H, p->qkv_weight, p->qkv_scale, p->qkv_mins, p->qkv_bias, head, first);
            project(p->qkv_tail_kind, x, rr, xb, M, H, p->qkv_tail_weight, p->qkv_tail_scale, p->qkv_tail_mins,
                    p->qkv_tail_bias, tail, second);
            _Pragma("omp for schedule(static)")
            for (int64_t m = 0; m < M; m++) {
                memcpy(qkv + m * qkv_n, first + m * head, head * sizeof(float));
                memcpy(qkv + m * qkv_n + head, second + m * tail, tail * sizeof(float));
            }
        } else
            project(p->qkv_kind, x, rr, xb, M, H, p->qkv_weight, p->qkv_scale, p->qkv_mins, p->qkv_bias, qkv_n, qkv);
        _Pragma("omp for schedule(static)")
        for (int64_t m = 0; m < M; m++) {
            float* row = qkv + m * qkv_n;
            const float *c = cos + m * D, *s = sin + m * D;
            if (act_bf16)
                for (int64_t i = 0; i < qkv_n; i++) row[i] = round_bf16(row[i]);
            float normed[D], roped[D];
            for (int64_t h = 0; h < NH + KVH; h++) {
                const float* head = row + h * D;
                const float* weight = h < NH ? p->q_norm : p->k_norm;
                if (weight) {
                    norm(head, 1, D, weight, eps, normed);
                    head = normed;
                }
                if (h < NH) {
                    rope_head(head, c, s, D, act_bf16, qh + m * qsize + h * D);
                    continue;
                }
                rope_head(head, c, s, D, act_bf16, roped);
                const int64_t at = (slots[m] * KVH + (h - NH)) * D;
                const float* value = row + qsize + kvsize + (h - NH) * D;
                if (kv_bf16) {
                    uint16_t *kc = (uint16_t*)p->k_cache + at, *vc = (uint16_t*)p->v_cache + at;
                    for (int64_t i = 0; i < D; i++)
                        kc[i] = bf16_bits(round_bf16(roped[i])), vc[i] = bf16_bits(round_bf16(value[i]));
                } else {
                    memcpy((float*)p->k_cache + at, roped, D * sizeof(float));
                    memcpy((float*)p->v_cache + at, value, D * sizeof(float));
                }
            }
        }
#if TS_AVX512
        if (step->shared_tokens) {
            /* a prefix every row shares, read once: all rows' queries against it as the tokens of one sequence
             * (the prefill kernel), each row's own blocks by the decode kernel (ctx and the mask are the own
             * part's), merged by log-sum-exp; the same kernels, tiles and merge as the layer loop's */
            _Pragma("omp for schedule(dynamic, 1)")
            for (int64_t task = 0; task < KVH * common_tiles + M * KVH; task++) { /* the long prefix tasks first */
                if (task < KVH * common_tiles) {
                    const int64_t h = task / common_tiles, r0 = task % common_tiles * common_per;
                    const int64_t n = M * G - r0 < common_per ? M * G - r0 : common_per;
                    pa_rows(qh, 0, h, r0, n, M, NH, KVH, D, p->k_cache, p->v_cache, kv_bf16, act_bf16,
                            step->shared_blocks, bs, step->shared_tokens, NULL, 0, scale, common, common_lse, &buf);
                } else {
                    attend(task - KVH * common_tiles, qh, NH, KVH, D, p->k_cache, p->v_cache,
                           kv_bf16 | act_bf16 << 1, blocks, nb, bs, ctx, p->keep, scale, attn,
                           scores, own_lse);
                }
            }
            _Pragma("omp for schedule(static)")
            for (int64_t i = 0; i < M * NH; i++)
                merge_row(attn + i * D, own_lse[i], common + i * D, common_lse[i], D, act_bf16, attn + i * D);
        } else
#endif
        {
            _Pragma("omp for schedule(static)")
            for (int64_t task = 0; task < M * KVH; task++)
                attend(task, qh, NH, KVH, D, p->k_cache, p->v_cache, kv_bf16 | act_bf16 << 1, blocks, nb, bs,
                       ctx, p->keep, scale, attn, scores, 0);
        }
        _Pragma("omp for schedule(static)")
        for (int64_t m = 0; m < M; m++) {
            if (act_bf16)
                for (int64_t i = m * qsize; i < (m + 1) * qsize; i++) attn[i] = round_bf16(attn[i]);
            prepare_row(p->o_kind, attn, m, qsize, rr);
        }
        project(p->o_kind, attn, rr, xb, M, qsize, p->o_weight, p->o_scale, p->o_mins, p->o_bias, H, delta);
        _Pragma("omp for schedule(static)")
        for (int64_t m = 0; m < M; m++) {
            add_rows(hidden + m * H, delta + m * H, H, act_bf16);
            norm(hidden + m * H, 1, H, p->post_norm, eps, x + m * H);
            prepare_row(p->gate_up_kind, x, m, H, rr);
        }
        project(p->gate_up_kind, x, rr, xb, M, H, p->gate_up_weight, p->gate_up_scale, p->gate_up_mins, 0, 2 * I,
                gu);
        const int q8_down = rounds_rows(p->down_kind) || is_q4(p->down_kind), q4_down = is_q4(p->down_kind);
        _Pragma("omp for schedule(static)")
        for (int64_t j = 0; j < M * (I / QK); j++) { /* SiLU-mul of 32 columns, then their Q8_0 block rounded */
            const int64_t m = j / (I / QK), at = (j % (I / QK)) * QK;
            float* g = gu + m * 2 * I + at;
            float* u = g + I;
            if (act_bf16)
                for (int i = 0; i < QK; i++) g[i] = round_bf16(g[i]), u[i] = round_bf16(u[i]);
            silu_mul_span(g, u, QK, act_bf16, x + m * I + at);
            if (q8_down) ts_q8_quantize(x + m * I + at, QK, qx + m * I + at, dx + m * (I / QK) + at / QK);
            if (q4_down) q4_block_sums(qx + m * I + at, dx[j], rr.sums + j * 4, rr.bsum + j);
        }
        project(p->down_kind, x, rr, xb, M, I, p->down_weight, p->down_scale, p->down_mins, 0, H, delta);
    }
#if TS_AVX512
    if (step->shared_tokens) pa_free(&buf);
#endif
    }
    add_rows(hidden, delta, M * H, act_bf16);
}
