/* The element types the CPU kernels read and store, and their conversions to fp32.
 *
 * Compute dtypes (activations, queries, outputs): fp32 and bf16. The KV cache may also hold
 * the 8-bit formats of radixserve/kernels/kv_quant.py (`KVFormat.code` is the code here):
 *   - fp8_e4m3 (torch.float8_e4m3fn) and fp8_e5m2 (torch.float8_e5m2): one byte, no scale.
 *     Both are exact in fp16, and the conversion goes through fp16 bits, the way the F16C /
 *     AVX-512 paths convert 8 or 16 at once: e5m2 is the top byte of an fp16; e4m3fn as fp16
 *     bits is ((b & 0x80) << 8) | ((b & 0x7f) << 7), which is its value times 2^-8, subnormals
 *     included (an e4m3 subnormal lands on an fp16 subnormal with the same mantissa). The NaN
 *     codes never occur: the quantizer saturates.
 *   - int8: one byte, and one fp16 scale per token and KV head beside the pages; the value is
 *     the integer times its scale. `load_element` gives the integer: the scale is the
 *     caller's, applied once per row.
 * Every conversion is exact: a kernel's dequantized element equals kv_quant.dequantize's.
 *
 * Kernels that serve several take the dtype code as an argument and call an always-inlined
 * body once per dtype with a constant code, so each copy's loads, stores and roundings fold to
 * straight-line, vectorisable code. */
#ifndef RADIXSERVE_DTYPES_H
#define RADIXSERVE_DTYPES_H
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1, DTYPE_FP8_E4M3 = 2, DTYPE_FP8_E5M2 = 3, DTYPE_INT8 = 4 };

static inline float bits_to_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

/* An fp16 (never infinite or NaN here: scales are clamped to fp16's range), exactly, subnormals
 * included: F16C's one instruction where the build has it (the decode kernel converts a scale
 * per row), else without any subnormal arithmetic (which a process with denormals-are-zero set
 * would flush). */
static inline float fp16_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0) {
        const float magnitude = (float)mantissa * 0x1p-24f; /* a normal fp32, exact */
        return sign ? -magnitude : magnitude;
    }
    return bits_to_float(sign | (exponent + 112) << 23 | mantissa << 13);
#endif
}

/* fp8 bytes as fp32 (see the top of the file: through fp16 bits, as the vector paths do). */
static inline float fp8_e5m2_to_float(uint8_t b) { return fp16_to_float((uint16_t)(b << 8)); }
static inline float fp8_e4m3_to_float(uint8_t b) {
    return fp16_to_float((uint16_t)((b & 0x80) << 8 | (b & 0x7F) << 7)) * 256.0f;
}

/* Round to nearest even, like torch's float -> bfloat16 (inputs here are never NaN). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* Element `index` of a tensor of `dtype`, as fp32 (int8: the integer, its scale not applied). */
static inline float load_element(const void *base, int64_t index, int dtype) {
    switch (dtype) {
    case DTYPE_BFLOAT16: return bf16_to_float(((const uint16_t *)base)[index]);
    case DTYPE_FP8_E4M3: return fp8_e4m3_to_float(((const uint8_t *)base)[index]);
    case DTYPE_FP8_E5M2: return fp8_e5m2_to_float(((const uint8_t *)base)[index]);
    case DTYPE_INT8: return (float)((const int8_t *)base)[index];
    default: return ((const float *)base)[index];
    }
}

/* Stores and roundings are of the compute dtypes, fp32 and bf16. */
static inline void store_element(void *base, int64_t index, float value, int dtype) {
    if (dtype == DTYPE_BFLOAT16)
        ((uint16_t *)base)[index] = float_to_bf16(value);
    else
        ((float *)base)[index] = value;
}

/* `value` as a torch op producing `dtype` leaves it: bf16 ops round each fp32 result. */
static inline float round_to(float value, int dtype) {
    return dtype == DTYPE_BFLOAT16 ? bf16_to_float(float_to_bf16(value)) : value;
}

static inline int64_t element_size(int dtype) {
    return dtype == DTYPE_FLOAT32 ? 4 : dtype == DTYPE_BFLOAT16 ? 2 : 1;
}

/* The factor a stored row of a KV pool is multiplied by: its int8 scale (scales [slots, Hkv],
 * fp16), 1 for every other format. */
static inline float row_scale(const uint16_t *scales, int dtype, int64_t slot, int64_t Hkv, int64_t head) {
    return dtype == DTYPE_INT8 ? fp16_to_float(scales[slot * Hkv + head]) : 1.0f;
}
#endif
