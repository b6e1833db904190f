/* Fused layer ops for the CPU: residual add + RMSNorm and rotary embedding in place, W8A8's
 * activation quantization and int32 rescale in one pass each.
 *
 * Each replaces several torch calls that, at small batches, cost more than their arithmetic.
 * Rounding follows the torch path step by step (bfloat16 results rounded to nearest even
 * where torch rounds), so the two agree to the last bit but for summation order.
 * Single-threaded: the caller sends only small batches here. Every kernel is written once
 * and instantiated per storage type (bf16, f32) by DEFINE_KERNELS at the end.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIM 1024

static inline float bf16_load(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);  /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

static inline float f32_load(float v) { return v; }
static inline float f32_store(float v) { return v; }

int64_t max_rotary_dim(void) { return MAX_DIM; }

#define DEFINE_KERNELS(SUFFIX, T, LOAD, STORE)                                                   \
/* residual += x; x = residual / rms(residual) * weight, for rows of `hidden` values. */        \
void add_rms_norm_##SUFFIX(T *x, T *residual, const T *weight, int64_t rows, int64_t hidden,    \
                           float eps) {                                                         \
    for (int64_t r = 0; r < rows; r++) {                                                        \
        T *xr = x + r * hidden, *rr = residual + r * hidden;                                    \
        float sum_sq = 0.f;                                                                     \
        for (int64_t i = 0; i < hidden; i++) {                                                  \
            rr[i] = STORE(LOAD(xr[i]) + LOAD(rr[i]));                                           \
            float s = LOAD(rr[i]);                                                              \
            sum_sq += s * s;                                                                    \
        }                                                                                       \
        float inv = 1.f / sqrtf(sum_sq / (float)hidden + eps);                                  \
        for (int64_t i = 0; i < hidden; i++)                                                    \
            xr[i] = STORE(LOAD(rr[i]) * inv * LOAD(weight[i]));                                 \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* Rotate-half RoPE in place on the first `heads` heads of each row of `qkv` (row stride       \
 * `stride`); cos, sin: [tokens, dim] as [c, c] and [-s, s]: out = x·cos + roll(x, dim/2)·sin, \
 * x·cos rounded to the storage type first, as torch's addcmul path does. */                   \
void rotary_##SUFFIX(T *qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t dim,        \
                     const T *cos, const T *sin) {                                              \
    float x[MAX_DIM];                                                                           \
    int64_t half = dim / 2;                                                                     \
    for (int64_t t = 0; t < tokens; t++) {                                                      \
        const T *c = cos + t * dim, *s = sin + t * dim;                                         \
        for (int64_t h = 0; h < heads; h++) {                                                   \
            T *head = qkv + t * stride + h * dim;                                               \
            for (int64_t i = 0; i < dim; i++) x[i] = LOAD(head[i]);                             \
            for (int64_t i = 0; i < dim; i++) {                                                 \
                float scaled = LOAD(STORE(x[i] * LOAD(c[i])));                                  \
                head[i] = STORE(scaled + x[i < half ? i + half : i - half] * LOAD(s[i]));       \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
                                                                                                \
/* W8A8 activations: per-row int8 of x [rows, cols]. Columns where some |x| > threshold are    \
 * flagged in `outlier` and left out (0 in xq, not in a row's abs-max). scale[r] =             \
 * max(abs-max, 1e-12) / 127; xq = x / scale rounded half to even. Returns the flagged count. */\
int64_t quantize_rows_int8_##SUFFIX(const T *x, int64_t rows, int64_t cols, float threshold,   \
                                    int8_t *xq, float *scale, uint8_t *outlier) {               \
    int64_t flagged = 0;                                                                        \
    memset(outlier, 0, cols);                                                                   \
    for (int64_t r = 0; r < rows; r++)                                                          \
        for (int64_t k = 0; k < cols; k++)                                                      \
            outlier[k] |= fabsf(LOAD(x[r * cols + k])) > threshold;                             \
    for (int64_t k = 0; k < cols; k++) flagged += outlier[k];                                   \
    for (int64_t r = 0; r < rows; r++) {                                                        \
        const T *xr = x + r * cols;                                                             \
        float top = 0.f;                                                                        \
        for (int64_t k = 0; k < cols; k++) {                                                    \
            float a = outlier[k] ? 0.f : fabsf(LOAD(xr[k]));                                    \
            top = a > top ? a : top;                                                            \
        }                                                                                       \
        float s = (top > 1e-12f ? top : 1e-12f) / 127.f;                                        \
        scale[r] = s;                                                                           \
        for (int64_t k = 0; k < cols; k++)                                                      \
            xq[r * cols + k] = outlier[k] ? 0 : (int8_t)nearbyintf(LOAD(xr[k]) / s);            \
    }                                                                                           \
    return flagged;                                                                             \
}                                                                                               \
                                                                                                \
/* out[m, n] = acc[m, n] · row_scale[m] · col_scale[n] in the storage type. */                  \
void rescale_int32_##SUFFIX(const int32_t *acc, int64_t rows, int64_t cols,                     \
                            const float *row_scale, const float *col_scale, T *out) {           \
    for (int64_t m = 0; m < rows; m++)                                                          \
        for (int64_t n = 0; n < cols; n++)                                                      \
            out[m * cols + n] = STORE((float)acc[m * cols + n] * row_scale[m] * col_scale[n]);  \
}

DEFINE_KERNELS(bf16, uint16_t, bf16_load, bf16_store)
DEFINE_KERNELS(f32, float, f32_load, f32_store)
