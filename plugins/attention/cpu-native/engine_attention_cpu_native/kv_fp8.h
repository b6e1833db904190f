/* 8-bit float KV cache values (torch's float8_e4m3fn and float8_e5m2), and float16 ones, <-> float32, for
 * attention.c: scalar conversions by bit manipulation (the portable path and the cache write)
 * and, where the compiler targets AVX-512, 16 lanes at a time through the half-precision
 * converter (8 lanes on AVX2 with F16C): an e5m2 byte is the top byte of its float16, and an e4m3 byte's magnitude shifted
 * into a float16's exponent and mantissa is its value times 2^-8 (both biases are powers of two
 * apart: 7 against 15, subnormals included). Stores saturate to the largest finite value and
 * round to nearest, ties to even, as torch's cast of a clamped value does. */
#ifndef ENGINE_KV_FP8_H
#define ENGINE_KV_FP8_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

static inline float f32_of_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e4m3fn: s eeee mmm, bias 7, no infinities (0x7F is NaN, never stored here) */
static inline float e4m3_load(uint8_t x) {
    uint32_t exponent = (x >> 3) & 15u, mantissa = x & 7u;
    float v = exponent ? f32_of_bits(((exponent + 120u) << 23) | (mantissa << 20)) : (float)mantissa * 0x1p-9f;
    return x & 0x80 ? -v : v;
}

/* e5m2: s eeeee mm, bias 15 (float16's top byte) */
static inline float e5m2_load(uint8_t x) {
    uint32_t exponent = (x >> 2) & 31u, mantissa = x & 3u;
    float v = exponent == 31u  ? f32_of_bits(0x7F800000u | (mantissa << 21))
              : exponent       ? f32_of_bits(((exponent + 112u) << 23) | (mantissa << 21))
                               : (float)mantissa * 0x1p-16f;
    return x & 0x80 ? -v : v;
}

static inline uint8_t e4m3_store(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    bits &= 0x7FFFFFFFu;
    if (bits >= 0x43E00000u) return sign | 0x7E;  /* 448 and over: the largest finite */
    if (bits < 0x3C800000u)                       /* under 2^-6: steps of 2^-9 (8 is 2^-6's code) */
        return sign | (uint8_t)lrintf(f32_of_bits(bits) * 512.f);
    bits += 0x7FFFFu + ((bits >> 20) & 1u);       /* the mantissa to 3 bits, ties to even */
    return sign | (uint8_t)((bits >> 20) - (120u << 3));
}

static inline uint8_t e5m2_store(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    bits &= 0x7FFFFFFFu;
    if (bits >= 0x47600000u) return sign | 0x7B;  /* 57344 and over: the largest finite */
    if (bits < 0x38800000u)                       /* under 2^-14: steps of 2^-16 */
        return sign | (uint8_t)lrintf(f32_of_bits(bits) * 65536.f);
    bits += 0xFFFFFu + ((bits >> 21) & 1u);       /* the mantissa to 2 bits, ties to even */
    return sign | (uint8_t)((bits >> 21) - (112u << 2));
}

/* float16 (an f16 cache: 2 bytes a value like bf16, 3 more mantissa bits) */
static inline float f16_load(uint16_t x) {
    uint32_t exponent = (x >> 10) & 31u, mantissa = x & 1023u;
    float v = exponent == 31u  ? f32_of_bits(0x7F800000u | (mantissa << 13))
              : exponent       ? f32_of_bits(((exponent + 112u) << 23) | (mantissa << 13))
                               : (float)mantissa * 0x1p-24f;
    return x & 0x8000 ? -v : v;
}

static inline uint16_t f16_store(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    bits &= 0x7FFFFFFFu;
    if (bits >= 0x477FE000u) return sign | 0x7BFF;  /* 65504 and over: the largest finite */
    if (bits < 0x38800000u)                         /* under 2^-14: steps of 2^-24 */
        return sign | (uint16_t)lrintf(f32_of_bits(bits) * 0x1p24f);
    bits += 0xFFFu + ((bits >> 13) & 1u);           /* the mantissa to 10 bits, ties to even */
    return sign | (uint16_t)((bits >> 13) - (112u << 10));
}

#ifdef __AVX512F__
static inline __m512 f16x16_load_over1(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m512 e5m2x16_load(const uint8_t *p) {
    __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
}

/* 16 e4m3 values times 2^-8 (exact): the caller folds the 256 into its scales (E4M3_SIMD_UNIT) */
static inline __m512 e4m3x16_load_over256(const uint8_t *p) {
    __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7);
    __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));
}
#define E4M3_SIMD_UNIT 256.f

static inline __m512 e5m2x16_load_over1(const uint8_t *p) { return e5m2x16_load(p); }
#elif defined(__AVX2__) && defined(__F16C__)
/* the same on 8 lanes (AVX2 + F16C), for attention_avx2.h */
static inline __m256 f16x8_load_over1(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline __m256 e5m2x8_load_over1(const uint8_t *p) {
    __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
}

/* The byte sign-extended to 16 bits and shifted left by 7 is the float16 wanted but for bit 14,
 * a copy of the sign, which the mask clears: three integer instructions where separating
 * magnitude and sign takes five. */
static inline __m256 e4m3x8_load_over256(const uint8_t *p) {
    __m128i shifted = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7);
    return _mm256_cvtph_ps(_mm_and_si128(shifted, _mm_set1_epi16((short)0xBFFF)));
}
#define E4M3_SIMD_UNIT 256.f
#endif

#endif
