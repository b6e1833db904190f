/* bfloat16 <-> float32 for C kernels built with engine.native.load_source
 * (#include "engine_bf16.h"): the scalar pair every kernel's portable path uses, and
 * 16-lane AVX-512 loads and stores where the compiler targets them (8-lane AVX2 ones
 * without AVX-512). Stores round to nearest, ties to even, as torch does. */
#ifndef ENGINE_BF16_H
#define ENGINE_BF16_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float bf16_load(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* the float32 counterparts, so one macro body serves both storage types */
static inline float f32_load(float v) { return v; }
static inline float f32_store(float v) { return v; }

#ifdef __AVX512F__
/* each lane's bits plus the rounding increment: its bfloat16 (nearest, ties to even) in the top half */
static inline __m512i bf16x16_rounded_bits(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}

/* float32 lanes rounded to bfloat16 precision (still float32): a bf16 store and load in one */
static inline __m512 bf16x16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16x16_rounded_bits(v), _mm512_set1_epi32((int)0xFFFF0000)));
}

/* 16 bf16 values at p as float32 lanes */
static inline __m512 bf16x16_load(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* the lanes of `mask` only: reads and writes nothing past the last set lane */
static inline __m512 bf16x16_load_masked(const uint16_t *p, __mmask16 mask) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline void bf16x16_store_masked(uint16_t *p, __m512 v, __mmask16 mask) {
    _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16x16_rounded_bits(v), 16)));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* 8 bf16 values at p as float32 lanes */
static inline __m256 bf16x8_load(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
}

/* each lane's bits plus the rounding increment: its bfloat16 (nearest, ties to even) in the top half */
static inline __m256i bf16x8_rounded_bits(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}

/* float32 lanes rounded to bfloat16 precision (still float32) */
static inline __m256 bf16x8_round(__m256 v) {
    return _mm256_castsi256_ps(_mm256_and_si256(bf16x8_rounded_bits(v), _mm256_set1_epi32((int)0xFFFF0000)));
}

/* 8 float32 lanes stored as bf16 at p */
static inline void bf16x8_store(uint16_t *p, __m256 v) {
    __m256i high = _mm256_srli_epi32(bf16x8_rounded_bits(v), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    _mm_storeu_si128((void *)p, packed);
}
#endif

#endif
