/* Fused layer ops for the CPU: residual add + RMSNorm and rotary embedding, in place.
 *
 * Each replaces a handful of torch calls that, at batch 1, cost more than their arithmetic.
 * Rounding follows the torch path step by step (bfloat16 results rounded to nearest even
 * where torch rounds), so the two agree to the last bit but for summation order.
 * Single-threaded: the caller sends only small batches here.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);  /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

/* residual += x; x = residual / rms(residual) * weight — rows of `hidden` values. */
void add_rms_norm_bf16(uint16_t *x, uint16_t *residual, const uint16_t *weight,
                       int64_t rows, int64_t hidden, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * hidden, *rr = residual + r * hidden;
        float sum_sq = 0.f;
        for (int64_t i = 0; i < hidden; i++) {
            uint16_t s = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]));
            float sf = bf16_to_f32(s);
            rr[i] = s;
            sum_sq += sf * sf;
        }
        float inv = 1.f / sqrtf(sum_sq / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++)
            xr[i] = f32_to_bf16(bf16_to_f32(rr[i]) * inv * bf16_to_f32(weight[i]));
    }
}

void add_rms_norm_f32(float *x, float *residual, const float *weight, int64_t rows, int64_t hidden,
                      float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * hidden, *rr = residual + r * hidden;
        float sum_sq = 0.f;
        for (int64_t i = 0; i < hidden; i++) {
            rr[i] += xr[i];
            sum_sq += rr[i] * rr[i];
        }
        float inv = 1.f / sqrtf(sum_sq / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++)
            xr[i] = rr[i] * inv * weight[i];
    }
}

/* Rotate-half RoPE in place on the first `heads` heads of each row of `qkv` (row stride
 * `stride` elements); cos, sin: [tokens, dim] as [c, c] and [-s, s]. out = x·cos + roll(x)·sin. */
#define MAX_DIM 1024

void rotary_bf16(uint16_t *qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t dim,
                 const uint16_t *cos, const uint16_t *sin) {
    float x[MAX_DIM];
    int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *head = qkv + t * stride + h * dim;
            for (int64_t i = 0; i < dim; i++) x[i] = bf16_to_f32(head[i]);
            for (int64_t i = 0; i < dim; i++) {
                float scaled = bf16_to_f32(f32_to_bf16(x[i] * bf16_to_f32(c[i])));
                float rolled = x[i < half ? i + half : i - half];
                head[i] = f32_to_bf16(scaled + rolled * bf16_to_f32(s[i]));
            }
        }
    }
}

void rotary_f32(float *qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t dim,
                const float *cos, const float *sin) {
    float x[MAX_DIM];
    int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *head = qkv + t * stride + h * dim;
            memcpy(x, head, dim * sizeof(float));
            for (int64_t i = 0; i < dim; i++)
                head[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * s[i];
        }
    }
}

int64_t max_rotary_dim(void) { return MAX_DIM; }

/* W8A8 activations: per-row int8 of x [rows, cols]. Columns where some |x| > threshold are
 * flagged in `outlier` and left out (0 in xq, not in a row's abs-max). scale[r] =
 * max(abs-max, 1e-12) / 127; xq = x / scale rounded half to even. Returns the flagged count. */
#define QUANTIZE_ROWS(NAME, T, LOAD)                                                          \
int64_t NAME(const T *x, int64_t rows, int64_t cols, float threshold, int8_t *xq, float *scale, \
             uint8_t *outlier) {                                                              \
    int64_t flagged = 0;                                                                      \
    memset(outlier, 0, cols);                                                                 \
    for (int64_t r = 0; r < rows; r++)                                                        \
        for (int64_t k = 0; k < cols; k++)                                                    \
            outlier[k] |= fabsf(LOAD(x[r * cols + k])) > threshold;                           \
    for (int64_t k = 0; k < cols; k++) flagged += outlier[k];                                 \
    for (int64_t r = 0; r < rows; r++) {                                                      \
        const T *xr = x + r * cols;                                                           \
        float top = 0.f;                                                                      \
        for (int64_t k = 0; k < cols; k++) {                                                  \
            float a = outlier[k] ? 0.f : fabsf(LOAD(xr[k]));                                  \
            top = a > top ? a : top;                                                          \
        }                                                                                     \
        float s = (top > 1e-12f ? top : 1e-12f) / 127.f;                                      \
        scale[r] = s;                                                                         \
        for (int64_t k = 0; k < cols; k++)                                                    \
            xq[r * cols + k] = outlier[k] ? 0 : (int8_t)nearbyintf(LOAD(xr[k]) / s);          \
    }                                                                                         \
    return flagged;                                                                           \
}

static inline float load_f32(float v) { return v; }
QUANTIZE_ROWS(quantize_rows_int8_bf16, uint16_t, bf16_to_f32)
QUANTIZE_ROWS(quantize_rows_int8_f32, float, load_f32)

/* out[m, n] = acc[m, n] · row_scale[m] · col_scale[n], as torch's float passes round it. */
void rescale_int32_bf16(const int32_t *acc, int64_t rows, int64_t cols, const float *row_scale,
                        const float *col_scale, uint16_t *out) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t n = 0; n < cols; n++)
            out[m * cols + n] = f32_to_bf16((float)acc[m * cols + n] * row_scale[m] * col_scale[n]);
}

void rescale_int32_f32(const int32_t *acc, int64_t rows, int64_t cols, const float *row_scale,
                       const float *col_scale, float *out) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t n = 0; n < cols; n++)
            out[m * cols + n] = (float)acc[m * cols + n] * row_scale[m] * col_scale[n];
}
