/* RMSNorm of bf16 rows on the CPU, in one pass per row instead of eight torch ops.
 *
 * Numerics follow transformers' LlamaRMSNorm for a bf16 model: the row is widened to fp32,
 * normalised by rsqrt(mean(x^2) + eps), rounded to bf16, then multiplied by the bf16 weight
 * (an fp32 product rounded to bf16, as torch multiplies bf16 tensors). Only the order of the
 * sum of squares differs from torch's.
 *
 *   x [rows, dim] (rows x_row_stride elements apart), residual, sum, y [rows, dim] and
 *   weight [dim] contiguous
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* With `residual` non-NULL the row normalised is bf16(x + residual), which is also written to
 * `sum` (the residual stream's next value): one pass instead of an add and a norm. */
void rms_norm_bf16(const uint16_t *x, int64_t x_row_stride, const uint16_t *residual,
                   uint16_t *sum, const uint16_t *weight, uint16_t *y, int64_t rows, int64_t dim,
                   float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_row_stride;
        if (residual != NULL) {
            uint16_t *sr = sum + r * dim;
            const uint16_t *rr = residual + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) sr[d] = float_to_bf16(bf16_to_float(xr[d]) + bf16_to_float(rr[d]));
            xr = sr;
        }
        uint16_t *yr = y + r * dim;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < dim; d++) {
            const float v = bf16_to_float(xr[d]);
            squares += v * v;
        }
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) {
            const float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[d]) * inv));
            yr[d] = float_to_bf16(normed * bf16_to_float(weight[d]));
        }
    }
}
