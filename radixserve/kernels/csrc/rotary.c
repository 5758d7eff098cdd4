/* Rotary position embedding (rotate_half style) of bf16 heads on the CPU, in one call instead
 * of six torch ops.
 *
 * Bit-identical to transformers' `x * cos + rotate_half(x) * sin` on bf16 tensors: torch rounds
 * each elementwise bf16 op's fp32 result to bf16, and so does this loop, op by op.
 *
 *   x [T, heads, D] (tokens x_row_stride elements apart, heads contiguous), cos/sin [T, D],
 *   out [T, heads, D] contiguous
 */
#include <stdint.h>

#include "bf16.h"

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

void rotary_bf16(const uint16_t *x, int64_t x_row_stride, const uint16_t *cos, const uint16_t *sin,
                 uint16_t *out, int64_t tokens, int64_t heads, int64_t dim, int num_threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * dim >= 65536) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xr = x + t * x_row_stride + h * dim;
            uint16_t *yr = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) {
                /* rotate_half: (-x2, x1) */
                const float rotated = d < half ? -bf16_to_float(xr[d + half]) : bf16_to_float(xr[d - half]);
                const float a = round_bf16(bf16_to_float(xr[d]) * bf16_to_float(c[d]));
                const float b = round_bf16(rotated * bf16_to_float(s[d]));
                yr[d] = float_to_bf16(a + b);
            }
        }
    }
}
