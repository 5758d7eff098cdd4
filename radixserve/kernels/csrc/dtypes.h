/* The element types the CPU kernels store (fp32 and bf16) and their conversions to fp32.
 *
 * Kernels that serve both take the dtype code as an argument and call an always-inlined body
 * once per dtype with a constant code, so each copy's loads, stores and roundings fold to
 * straight-line, vectorisable code. */
#ifndef RADIXSERVE_DTYPES_H
#define RADIXSERVE_DTYPES_H
#include <stdint.h>
#include <string.h>

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, like torch's float -> bfloat16 (inputs here are never NaN). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* Element `index` of a tensor of `dtype`, as fp32. */
static inline float load_element(const void *base, int64_t index, int dtype) {
    return dtype == DTYPE_BFLOAT16 ? bf16_to_float(((const uint16_t *)base)[index])
                                   : ((const float *)base)[index];
}

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

static inline int64_t element_size(int dtype) { return dtype == DTYPE_BFLOAT16 ? 2 : 4; }
#endif
