/* Helpers the kernels' AVX2 paths share (8 fp32 lanes; AVX2 + FMA + F16C, the `avx2` tier of
 * radixserve/kernels/isa.py). Included only inside `#if defined(__AVX2__) && defined(__FMA__)`
 * blocks, so the portable build (and aarch64) never sees an x86 intrinsic.
 *
 * bf16 is a storage format here: AVX2 has no bf16 arithmetic, so values are widened to fp32 in
 * registers (a bf16 is the top half of an fp32) and summed in fp32. */
#ifndef RADIXSERVE_AVX2_H
#define RADIXSERVE_AVX2_H
#include <immintrin.h>
#include <stdint.h>

__m256 _ZGVdN8v_expf(__m256 x); /* glibc's libmvec: expf of 8 lanes */

/* The sum of the 8 lanes. */
static inline __attribute__((always_inline)) float avx2_reduce_add(__m256 v) {
    const __m128 pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

/* The largest of the 8 lanes. */
static inline __attribute__((always_inline)) float avx2_reduce_max(__m256 v) {
    const __m128 pairs = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_max_ps(pairs, _mm_movehl_ps(pairs, pairs));
    return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}

/* 8 bf16 values at p, widened to fp32. */
static inline __attribute__((always_inline)) __m256 avx2_load_bf16(const uint16_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

/* 8 fp32 values (p is float *) or 8 bf16 values (p is uint16_t *) as fp32; `bf16` is a
 * constant after inlining. */
static inline __attribute__((always_inline)) __m256 avx2_load(const void *p, const int bf16) {
    return bf16 ? avx2_load_bf16((const uint16_t *)p) : _mm256_loadu_ps((const float *)p);
}

/* A vector of 32-bit words each holding a bf16 pair (low half first): the first elements of
 * the pairs as fp32, and the second elements as fp32. */
static inline __attribute__((always_inline)) __m256 avx2_pair_low(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
static inline __attribute__((always_inline)) __m256 avx2_pair_high(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 fp32 values rounded to nearest even bf16 (as torch's float -> bfloat16; never NaN here),
 * stored at p. */
static inline __attribute__((always_inline)) void avx2_store_bf16(uint16_t *p, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    /* packus works per 128-bit lane: [a0..a3 b0..b3 | a4..a7 b4..b7] -> reorder the quads */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

/* 8 fp32 values stored at p as fp32 or (bf16 != 0) rounded to bf16. */
static inline __attribute__((always_inline)) void avx2_store(void *p, __m256 v, const int bf16) {
    if (bf16)
        avx2_store_bf16((uint16_t *)p, v);
    else
        _mm256_storeu_ps((float *)p, v);
}

/* 8 fp32 values rounded to nearest even bf16 (as torch's float -> bfloat16; never NaN here),
 * kept as fp32: for arithmetic that takes bf16 operands, as a bf16 matmul would. */
static inline __attribute__((always_inline)) __m256 avx2_round_bf16(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32((int)0xFFFF0000u)));
}
#endif
