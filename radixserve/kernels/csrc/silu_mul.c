/* The gated MLP's activation on the CPU: silu(gate) * up in one call instead of two torch ops
 * (and, for fp32, without torch's copy of the strided gate half).
 *
 * Each op's fp32 result is rounded to the storage dtype, as torch does; silu's exp may differ
 * from torch's in the last fp32 bit, which can move a bf16 result by one bf16 step.
 *
 *   gate_up [T, 2 * I] (gate then up), out [T, I], both contiguous, of one dtype
 */
#include <math.h>
#include <stdint.h>

#include "dtypes.h"

/* One token; inlined with a constant dtype, so each copy's loads and stores fold. */
static inline __attribute__((always_inline)) void silu_mul_token(const void *gate, const void *up, void *out,
                                                                 int64_t inter, const int dtype) {
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        const float g = load_element(gate, i, dtype);
        const float activated = round_to(g / (1.0f + expf(-g)), dtype);
        store_element(out, i, activated * load_element(up, i, dtype), dtype);
    }
}

void silu_mul(const void *gate_up, void *out, int64_t tokens, int64_t inter, int dtype, int num_threads) {
    const int64_t size = element_size(dtype);
#pragma omp parallel for num_threads(num_threads) if (tokens * inter >= 8192) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const char *gate = (const char *)gate_up + t * 2 * inter * size, *up = gate + inter * size;
        char *dst = (char *)out + t * inter * size;
        if (dtype == DTYPE_BFLOAT16)
            silu_mul_token(gate, up, dst, inter, DTYPE_BFLOAT16);
        else
            silu_mul_token(gate, up, dst, inter, DTYPE_FLOAT32);
    }
}
