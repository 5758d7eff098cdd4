/* The intrinsics the kernels use that SIMDe 0.8.2 does not provide, lane by lane with Intel's
 * semantics, for the emulated AVX-512 builds of tests/emulated_avx512.py (included after
 * simde/x86/avx512.h, whose simde__m512* types they take). Not part of any real build. */
#ifndef RADIXSERVE_EMULATED_AVX512_SHIMS_H
#define RADIXSERVE_EMULATED_AVX512_SHIMS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define EMU_BITS(dst, src) memcpy(&(dst), &(src), sizeof(dst))

/* vpmovdw: 16 int32 truncated to int16 */
static inline simde__m256i simde_mm512_cvtepi32_epi16(simde__m512i a) {
    int32_t in[16];
    int16_t out[16];
    EMU_BITS(in, a);
    for (int i = 0; i < 16; i++) out[i] = (int16_t)in[i];
    simde__m256i r;
    EMU_BITS(r, out);
    return r;
}

/* vpmovsxbd: 16 int8 sign-extended to int32 */
static inline simde__m512i simde_mm512_cvtepi8_epi32(__m128i a) {
    int8_t in[16];
    int32_t out[16];
    EMU_BITS(in, a);
    for (int i = 0; i < 16; i++) out[i] = in[i];
    simde__m512i r;
    EMU_BITS(r, out);
    return r;
}

/* fp32 -> bf16, round to nearest even (no NaN inputs here) */
static inline uint16_t emu_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* vcvtneps2bf16: 16 fp32 -> 16 bf16 */
static inline simde__m256bh simde_mm512_cvtneps_pbh(simde__m512 a) {
    float in[16];
    uint16_t out[16];
    EMU_BITS(in, a);
    for (int i = 0; i < 16; i++) out[i] = emu_bf16(in[i]);
    simde__m256bh r;
    EMU_BITS(r, out);
    return r;
}

/* vcvtne2ps2bf16: b's 16 values in the low half, a's in the high half */
static inline simde__m512bh simde_mm512_cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
    float fa[16], fb[16];
    uint16_t out[32];
    EMU_BITS(fa, a);
    EMU_BITS(fb, b);
    for (int i = 0; i < 16; i++) {
        out[i] = emu_bf16(fb[i]);
        out[16 + i] = emu_bf16(fa[i]);
    }
    simde__m512bh r;
    EMU_BITS(r, out);
    return r;
}

/* vpsrlw with a merge mask: words whose bit of k is set are a >> imm, the rest src's */
static inline simde__m512i simde_mm512_mask_srli_epi16(simde__m512i src, simde__mmask32 k, simde__m512i a,
                                                      unsigned imm) {
    uint16_t out[32], in[32];
    EMU_BITS(out, src);
    EMU_BITS(in, a);
    for (int i = 0; i < 32; i++)
        if (k >> i & 1) out[i] = imm > 15 ? 0 : (uint16_t)(in[i] >> imm);
    simde__m512i r;
    EMU_BITS(r, out);
    return r;
}

/* the sum of the 16 lanes, as a tree */
static inline float simde_mm512_reduce_add_ps(simde__m512 a) {
    float x[16];
    EMU_BITS(x, a);
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) x[i] += x[i + width];
    return x[0];
}

/* `bytes` bytes from `low`, then zeros: the zero-extending casts */
static inline simde__m512i emu_zext_si512(const void *low, size_t bytes) {
    uint8_t out[64] = {0};
    memcpy(out, low, bytes);
    simde__m512i r;
    EMU_BITS(r, out);
    return r;
}

static inline simde__m512i simde_mm512_zextsi128_si512(__m128i a) { return emu_zext_si512(&a, sizeof a); }

static inline simde__m512i simde_mm512_zextsi256_si512(__m256i a) { return emu_zext_si512(&a, sizeof a); }

/* libmvec's 16-lane expf (_ZGVeN16v_expf) runs on zmm registers: lane by lane instead */
static inline simde__m512 emu_expf16(simde__m512 x) {
    float v[16];
    EMU_BITS(v, x);
    for (int i = 0; i < 16; i++) v[i] = expf(v[i]);
    simde__m512 r;
    EMU_BITS(r, v);
    return r;
}

/* Masked loads and stores. SIMDe 0.8.2's write the whole vector, zeros in the masked-off lanes,
 * and read the whole vector: past the end of a row or a tensor. Here only the lanes in k are
 * touched, as on the hardware. */
static inline void emu_masked_copy(void *dst, const void *src, uint32_t k, int lanes, size_t lane_bytes) {
    for (int i = 0; i < lanes; i++)
        if (k >> i & 1) memcpy((char *)dst + lane_bytes * i, (const char *)src + lane_bytes * i, lane_bytes);
}

static inline void emu_mm512_mask_storeu_ps(void *p, simde__mmask16 k, simde__m512 a) { emu_masked_copy(p, &a, k, 16, 4); }

static inline void emu_mm256_mask_storeu_epi16(void *p, simde__mmask16 k, simde__m256i a) {
    emu_masked_copy(p, &a, k, 16, 2);
}

static inline simde__m512 emu_mm512_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    simde__m512 r = simde_mm512_setzero_ps();
    emu_masked_copy(&r, p, k, 16, 4);
    return r;
}

static inline simde__m256i emu_mm256_maskz_loadu_epi16(simde__mmask16 k, const void *p) {
    simde__m256i r = _mm256_setzero_si256();
    emu_masked_copy(&r, p, k, 16, 2);
    return r;
}
#endif
