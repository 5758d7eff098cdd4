/* bfloat16 <-> float conversions shared by the CPU kernels. */
#ifndef RADIXSERVE_BF16_H
#define RADIXSERVE_BF16_H
#include <stdint.h>
#include <string.h>

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
#endif
