/* llama.cpp's reference quantizers of the K types, for `model.quantization = "q4_k"` and `tierserve quantize
 * --type q4_k_m`: quantize_row_q4_K_ref, quantize_row_q5_K_ref and quantize_row_q6_K_ref (ggml-quants.c) with
 * their searches (make_qkx2_quants, make_qx_quants), ported statement for statement so a matrix quantized here
 * holds the bytes llama-quantize writes for it without an importance matrix (tests/test_k_quantize.py keeps the
 * digests of ggml's own output). ggml compiles these in ggml-base, without FMA; this file is compiled with
 * -ffp-contract=off (cpu_gemm_builds.COMMON_FLAGS): every product and sum is rounded as written, as there.
 *
 * One entry point, ts_quantize_k: rows of a float32 matrix, each a whole number of super-blocks of 256, into the
 * GGUF blocks of one type (Q4_K 144 bytes, Q5_K 176, Q6_K 210 a super-block), rows split across threads.
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK_K 256
#define GROUP_MAX_EPS 1e-15f
#define KMAX(a, b) ((a) > (b) ? (a) : (b))
#define KMIN(a, b) ((a) < (b) ? (a) : (b))

enum { KQ_Q4_K = 4, KQ_Q5_K = 5, KQ_Q6_K = 6 };

typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } block_q4_k;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_k;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } block_q6_k;

_Static_assert(sizeof(block_q4_k) == 144, "Q4_K super-block");
_Static_assert(sizeof(block_q5_k) == 176, "Q5_K super-block");
_Static_assert(sizeof(block_q6_k) == 210, "Q6_K super-block");

/* round to nearest (ties to even) for |fval| < 2^22, by the float's mantissa as ggml does */
static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

static inline uint16_t to_half(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
static inline float from_half(uint16_t h) { return _cvtsh_ss(h); }

static float make_qx_quants(int n, int nmax, const float *x, int8_t *L) { /* rmse_type 1, no weights */
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = KMAX(-nmax, KMIN(nmax - 1, l));
        L[i] = l + nmax;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            l = KMAX(-nmax, KMIN(nmax - 1, l));
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) {
                int l = nearest_int(iscale * x[i]);
                L[i] = nmax + KMAX(-nmax, KMIN(nmax - 1, l));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L, float *the_min,
                              uint8_t *Laux, float rmin, float rdelta, int nstep) { /* use_mad false */
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * (x[i] - min));
        L[i] = KMAX(0, KMIN(nmax, l));
        float diff = scale * L[i] + min - x[i];
        diff = diff * diff;
        best_error += weights[i] * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * (x[i] - min));
            l = KMAX(0, KMIN(nmax, l));
            Laux[i] = l;
            float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                for (int i = 0; i < n; ++i) L[i] = Laux[i];
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/* Q4_K and Q5_K share everything but the levels (15 / 31), the search (-1 + 0.1 * 20 steps / -0.5 + 0.1 * 15)
 * and how the levels are packed; d, dmin and scales sit at the same offsets in both blocks */
static void scales_and_levels(const float *x, int nmax, float rmin, int nstep, uint16_t *d_out, uint16_t *dmin_out,
                              uint8_t *scales_out, uint8_t *L) {
    uint8_t Laux[32];
    float weights[32], mins[QK_K / 32], scales[QK_K / 32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK_K / 32; ++j) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin, 0.1f, nstep);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t ls = nearest_int(inv_scale * scales[j]);
        uint8_t lm = nearest_int(inv_min * mins[j]);
        ls = KMIN(63, ls);
        lm = KMIN(63, lm);
        if (j < 4) {
            scales_out[j] = ls;
            scales_out[j + 4] = lm;
        } else {
            scales_out[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            scales_out[j - 4] |= ((ls >> 4) << 6);
            scales_out[j - 0] |= ((lm >> 4) << 6);
        }
    }
    *d_out = to_half(max_scale / 63.f);
    *dmin_out = to_half(max_min / 63.f);
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t sc, m;
        get_scale_min_k4(j, scales_out, &sc, &m);
        const float d = from_half(*d_out) * sc;
        if (!d) continue;
        const float dm = from_half(*dmin_out) * m;
        for (int ii = 0; ii < 32; ++ii) {
            int l = nearest_int((x[32 * j + ii] + dm) / d);
            L[32 * j + ii] = KMAX(0, KMIN(nmax, l));
        }
    }
}

static void quantize_q4_k(const float *x, block_q4_k *y) {
    uint8_t L[QK_K];
    memset(y, 0, sizeof(*y));
    scales_and_levels(x, 15, -1.f, 20, &y->d, &y->dmin, y->scales, L);
    uint8_t *q = y->qs;
    for (int j = 0; j < QK_K; j += 64) {
        for (int l = 0; l < 32; ++l) q[l] = L[j + l] | (L[j + l + 32] << 4);
        q += 32;
    }
}

static void quantize_q5_k(const float *x, block_q5_k *y) {
    uint8_t L[QK_K];
    memset(y, 0, sizeof(*y));
    scales_and_levels(x, 31, -0.5f, 15, &y->d, &y->dmin, y->scales, L);
    uint8_t *ql = y->qs;
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QK_K; n += 64) {
        for (int j = 0; j < 32; ++j) {
            int l1 = L[n + j];
            if (l1 > 15) { l1 -= 16; y->qh[j] |= m1; }
            int l2 = L[n + j + 32];
            if (l2 > 15) { l2 -= 16; y->qh[j] |= m2; }
            ql[j] = l1 | (l2 << 4);
        }
        m1 <<= 2;
        m2 <<= 2;
        ql += 32;
    }
}

static void quantize_q6_k(const float *x, block_q6_k *y) {
    int8_t L[QK_K];
    float scales[QK_K / 16];
    float max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
        scales[ib] = scale;
        const float abs_scale = fabsf(scale);
        if (abs_scale > max_abs_scale) {
            max_abs_scale = abs_scale;
            max_scale = scale;
        }
    }
    if (max_abs_scale < GROUP_MAX_EPS) {
        memset(y, 0, sizeof(*y));
        y->d = to_half(0.f);
        return;
    }
    float iscale = -128.f / max_scale;
    y->d = to_half(1 / iscale);
    for (int ib = 0; ib < QK_K / 16; ++ib) y->scales[ib] = KMIN(127, nearest_int(iscale * scales[ib]));
    for (int j = 0; j < QK_K / 16; ++j) {
        float d = from_half(y->d) * y->scales[j];
        if (!d) continue;
        for (int ii = 0; ii < 16; ++ii) {
            int l = nearest_int(x[16 * j + ii] / d);
            l = KMAX(-32, KMIN(31, l));
            L[16 * j + ii] = l + 32;
        }
    }
    uint8_t *ql = y->ql, *qh = y->qh;
    for (int j = 0; j < QK_K; j += 128) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t q1 = L[j + l + 0] & 0xF;
            const uint8_t q2 = L[j + l + 32] & 0xF;
            const uint8_t q3 = L[j + l + 64] & 0xF;
            const uint8_t q4 = L[j + l + 96] & 0xF;
            ql[l + 0] = q1 | (q3 << 4);
            ql[l + 32] = q2 | (q4 << 4);
            qh[l] = (L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                    ((L[j + l + 96] >> 4) << 6);
        }
        ql += 64;
        qh += 32;
    }
}

/* x: float32 [rows, cols], cols a multiple of 256; out: rows x cols / 256 super-blocks of `kind` (4, 5 or 6),
 * on `threads` threads. Returns 0, or -1 for an unknown kind or a width that is not whole super-blocks (nothing
 * written). */
int ts_quantize_k(int32_t kind, const float *x, uint8_t *out, int64_t rows, int64_t cols, int32_t threads) {
    if ((kind != KQ_Q4_K && kind != KQ_Q5_K && kind != KQ_Q6_K) || cols % QK_K) return -1;
    const int64_t per_row = cols / QK_K;
    const int64_t bytes = kind == KQ_Q4_K ? 144 : kind == KQ_Q5_K ? 176 : 210;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t b = 0; b < per_row; ++b) {
            const float *src = x + r * cols + b * QK_K;
            uint8_t *dst = out + (r * per_row + b) * bytes;
            if (kind == KQ_Q4_K) quantize_q4_k(src, (block_q4_k *)dst);
            else if (kind == KQ_Q5_K) quantize_q5_k(src, (block_q5_k *)dst);
            else quantize_q6_k(src, (block_q6_k *)dst);
        }
    }
    return 0;
}
