/* The gated MLP's activation for bf16 on the CPU: silu(gate) * up in one call instead of two
 * torch ops. Each op's fp32 result is rounded to bf16, as torch does; silu's exp may differ
 * from torch's in the last fp32 bit, which can move a result by one bf16 step.
 *
 *   gate_up [T, 2 * I] (gate then up), out [T, I], both contiguous
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t tokens, int64_t inter,
                   int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (tokens * inter >= 65536) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const uint16_t *gate = gate_up + t * 2 * inter, *up = gate + inter;
        uint16_t *dst = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float g = bf16_to_float(gate[i]);
            const float activated = bf16_to_float(float_to_bf16(g / (1.0f + expf(-g))));
            dst[i] = float_to_bf16(activated * bf16_to_float(up[i]));
        }
    }
}
