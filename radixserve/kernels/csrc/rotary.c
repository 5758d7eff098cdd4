/* Rotary position embedding (rotate_half style) of fp32 or bf16 heads on the CPU, in one call
 * instead of six torch ops.
 *
 * `x * cos + rotate_half(x) * sin` op by op as torch computes it: for bf16 each op's fp32
 * result is rounded to bf16, which makes the result bit-identical to the torch ops; fp32 may
 * differ in the last bit where the compiler fuses a multiply and an add.
 *
 *   x [T, heads, D] (tokens x_row_stride elements apart, heads contiguous), cos/sin [T, D],
 *   out [T, heads, D] contiguous, all of one dtype
 */
#include <stdint.h>

#include "dtypes.h"

/* One token's heads; inlined with a constant dtype, so each copy's loads and stores fold. */
static inline __attribute__((always_inline)) void rotary_token(
    const void *x, const void *cos, const void *sin, void *out, int64_t heads, int64_t dim,
    const int dtype) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) {
            const int64_t i = h * dim + d;
            /* rotate_half: (-x2, x1) */
            const float rotated = d < half ? -load_element(x, i + half, dtype) : load_element(x, i - half, dtype);
            const float a = round_to(load_element(x, i, dtype) * load_element(cos, d, dtype), dtype);
            const float b = round_to(rotated * load_element(sin, d, dtype), dtype);
            store_element(out, i, a + b, dtype);
        }
    }
}

void rotary(const void *x, int64_t x_row_stride, const void *cos, const void *sin, void *out,
            int64_t tokens, int64_t heads, int64_t dim, int dtype, int num_threads) {
    const int64_t size = element_size(dtype);
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * dim >= 65536) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const char *xt = (const char *)x + t * x_row_stride * size;
        const char *ct = (const char *)cos + t * dim * size, *st = (const char *)sin + t * dim * size;
        char *ot = (char *)out + t * heads * dim * size;
        if (dtype == DTYPE_BFLOAT16)
            rotary_token(xt, ct, st, ot, heads, dim, DTYPE_BFLOAT16);
        else
            rotary_token(xt, ct, st, ot, heads, dim, DTYPE_FLOAT32);
    }
}
