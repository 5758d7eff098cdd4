/* RMSNorm of fp32 or bf16 rows on the CPU, in one pass per row instead of eight torch ops.
 *
 * Numerics follow transformers' LlamaRMSNorm: the row is widened to fp32, normalised by
 * rsqrt(mean(x^2) + eps), rounded to the storage dtype, then multiplied by the weight (a
 * product rounded to the storage dtype, as torch multiplies two such tensors). Only the order
 * of the sum of squares differs from torch's.
 *
 *   x [rows, dim] (rows x_row_stride elements apart), residual, sum, y [rows, dim] and
 *   weight [dim] contiguous, all of one dtype
 */
#include <math.h>
#include <stdint.h>

#include "dtypes.h"

/* One row; inlined with a constant dtype, so each copy's loads and stores fold. */
static inline __attribute__((always_inline)) void rms_norm_row(
    const void *xr, const void *rr, void *sr, const void *weight, void *yr, int64_t dim, float eps,
    const int dtype) {
    if (rr != NULL) {
#pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            store_element(sr, d, load_element(xr, d, dtype) + load_element(rr, d, dtype), dtype);
        xr = sr;
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < dim; d++) {
        const float v = load_element(xr, d, dtype);
        squares += v * v;
    }
    const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) {
        const float normed = round_to(load_element(xr, d, dtype) * inv, dtype);
        store_element(yr, d, normed * load_element(weight, d, dtype), dtype);
    }
}

/* With `residual` non-NULL the row normalised is x + residual (rounded to the dtype), which is
 * also written to `sum` (the residual stream's next value): one pass instead of an add and a
 * norm. */
void rms_norm(const void *x, int64_t x_row_stride, const void *residual, void *sum, const void *weight,
              void *y, int64_t rows, int64_t dim, float eps, int dtype, int num_threads) {
    const int64_t size = element_size(dtype);
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_row_stride * size;
        const char *rr = residual == NULL ? NULL : (const char *)residual + r * dim * size;
        char *sr = sum == NULL ? NULL : (char *)sum + r * dim * size, *yr = (char *)y + r * dim * size;
        if (dtype == DTYPE_BFLOAT16)
            rms_norm_row(xr, rr, sr, weight, yr, dim, eps, DTYPE_BFLOAT16);
        else
            rms_norm_row(xr, rr, sr, weight, yr, dim, eps, DTYPE_FLOAT32);
    }
}
