/* Causal prefill attention on the CPU for bf16: the new tokens of one request attend over its
 * paged context (cached prefix + themselves), flash-attention style, with the AVX-512 BF16 dot
 * product (vdpbf16ps: pairs of bf16 products summed into fp32 lanes).
 *
 * Built and loaded at run time by radixserve/kernels/cpu.py. torch's CPU flash attention runs
 * its two matmuls of each block through a generic bf16 gemm when the CPU has no AMX; this
 * kernel keeps a whole tile of scores and outputs in registers instead.
 *
 * Layouts (row-major):
 *   q    [E, H, D]        the new tokens' queries, rows q_row_stride elements apart
 *   out  [E, H, D]        contiguous
 *   k_pool/v_pool [slots, Hkv, D]  slot = page * page_size + offset; the new tokens' K/V are
 *                                  already stored (positions prefix_len .. prefix_len + E - 1)
 *   pages                 the request's page ids, in order
 *
 * Numerics follow torch's flash attention for bf16: q.k summed in fp32 then scaled, an online
 * softmax in fp32, probabilities rounded to bf16 for the product with V, fp32 accumulators,
 * the output rounded once. Only the summation order differs.
 *
 * Work: for each kv head, K is repacked once as K^T in pairs ([S/64][D/2][64] dwords, one
 * dword = the bf16 pair (d, d+1) of one key) and V as key pairs ([S/2][D] dwords = (V[j][d],
 * V[j+1][d])), the layouts vdpbf16ps wants. A task is a few query rows of one kv head
 * (rows are (position, head of the group) pairs); it walks the keys in blocks of 64: scores
 * tile in registers, online softmax, probabilities to a small buffer, then the output tile
 * (in registers for the block) gains P.V.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

#define KEY_BLOCK 64

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* A task's query rows: its TR x 4 score vectors and TR x D/16 output vectors stay in
 * registers. TR is 6 for head size 64, 3 for head size 128. */
#define MAX_TILE_ROWS 6
#define MAX_CHUNKS 8 /* D / 16 */

__m512 _ZGVeN16v_expf(__m512 x); /* glibc's libmvec: expf of 16 lanes */

typedef struct {
    const uint16_t *q;
    int64_t q_row_stride;
    uint16_t *out;
    int64_t H, Hkv, D, G;
    int64_t prefix_len, extend_len, keys; /* keys = prefix_len + extend_len */
    float scale;
    const uint32_t *k_packed, *v_packed; /* per kv head: see pack_keys / pack_values */
    int64_t k_head_stride, v_head_stride; /* dwords */
} Call;

/* K of kv head h as [ceil(S/64)][D/2][64] dwords (zero past S). */
static void pack_keys(const uint16_t *k_pool, const int64_t *slots, int64_t S, int64_t Hkv,
                      int64_t h, int64_t D, uint32_t *dst) {
    const int64_t pairs = D / 2, blocks = (S + KEY_BLOCK - 1) / KEY_BLOCK;
    memset(dst, 0, blocks * pairs * KEY_BLOCK * sizeof(uint32_t));
    for (int64_t j = 0; j < S; j++) {
        const uint32_t *row = (const uint32_t *)(k_pool + (slots[j] * Hkv + h) * D);
        uint32_t *col = dst + (j / KEY_BLOCK) * pairs * KEY_BLOCK + j % KEY_BLOCK;
        for (int64_t p = 0; p < pairs; p++) col[p * KEY_BLOCK] = row[p];
    }
}

/* V of kv head h as [ceil(S/64) * 32][D] dwords: dword (j/2, d) = V[j][d] | V[j+1][d] << 16. */
static void pack_values(const uint16_t *v_pool, const int64_t *slots, int64_t S, int64_t Hkv,
                        int64_t h, int64_t D, uint32_t *dst) {
    const int64_t pair_rows = (S + KEY_BLOCK - 1) / KEY_BLOCK * (KEY_BLOCK / 2);
    memset(dst, 0, pair_rows * D * sizeof(uint32_t));
    for (int64_t j = 0; j < S; j++) {
        const uint16_t *row = v_pool + (slots[j] * Hkv + h) * D;
        uint16_t *pairs = (uint16_t *)(dst + (j / 2) * D) + (j % 2);
        for (int64_t d = 0; d < D; d++) pairs[2 * d] = row[d];
    }
}

/* One tile of `rows` query rows (<= TR) of kv head h, first row `row0` of the head's G * E
 * rows. CH = D / 16 and TR are constants in each inlined copy. */
static inline __attribute__((always_inline)) void attend_tile(const Call *c, int64_t h, int64_t row0,
                                                              int rows, const int CH, const int TR) {
    const int64_t D = c->D, G = c->G, pairs = D / 2;
    const uint32_t *kp = c->k_packed + h * c->k_head_stride, *vp = c->v_packed + h * c->v_head_stride;
    const uint32_t *qrow[MAX_TILE_ROWS];
    int64_t limit[MAX_TILE_ROWS]; /* keys 0 .. limit - 1 are visible to the row */
    for (int r = 0; r < TR; r++) {
        const int64_t row = row0 + (r < rows ? r : rows - 1), pos = row / G, head = h * G + row % G;
        qrow[r] = (const uint32_t *)(c->q + pos * c->q_row_stride + head * D);
        limit[r] = c->prefix_len + pos + 1;
    }
    const int64_t end = limit[rows - 1]; /* rows are in position order: the last sees most */
    float row_max[MAX_TILE_ROWS], row_sum[MAX_TILE_ROWS];
    uint16_t probs[MAX_TILE_ROWS][KEY_BLOCK] __attribute__((aligned(64)));
    __m512 o[MAX_TILE_ROWS * MAX_CHUNKS];
    for (int r = 0; r < TR; r++) {
        row_max[r] = -FLT_MAX;
        row_sum[r] = 0.0f;
        for (int ch = 0; ch < CH; ch++) o[r * CH + ch] = _mm512_setzero_ps();
    }

    for (int64_t k0 = 0; k0 < end; k0 += KEY_BLOCK) {
        /* scores[r][k] = q_r . K[k0 + k] */
        const uint32_t *kb = kp + (k0 / KEY_BLOCK) * pairs * KEY_BLOCK;
        __m512 s[MAX_TILE_ROWS * 4];
        for (int i = 0; i < TR * 4; i++) s[i] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh kv[4];
            for (int i = 0; i < 4; i++) kv[i] = (__m512bh)_mm512_loadu_si512(kb + p * KEY_BLOCK + 16 * i);
            for (int r = 0; r < TR; r++) {
                const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qrow[r][p]);
                for (int i = 0; i < 4; i++) s[r * 4 + i] = _mm512_dpbf16_ps(s[r * 4 + i], qb, kv[i]);
            }
        }
        /* online softmax: keys past a row's limit get probability 0 */
        const __m512 scale = _mm512_set1_ps(c->scale), lowest = _mm512_set1_ps(-FLT_MAX);
        for (int r = 0; r < TR; r++) {
            __m512 sv[4], bm = lowest;
            for (int i = 0; i < 4; i++) {
                const int64_t visible = limit[r] - (k0 + 16 * i);
                const __mmask16 keep = visible >= 16 ? 0xFFFF : visible <= 0 ? 0 : (__mmask16)((1u << visible) - 1);
                sv[i] = _mm512_mask_mul_ps(lowest, keep, s[r * 4 + i], scale);
                bm = _mm512_max_ps(bm, sv[i]);
            }
            const float block_max = _mm512_reduce_max_ps(bm);
            const float m = block_max > row_max[r] ? block_max : row_max[r];
            const float alpha = expf(row_max[r] - m);
            const __m512 mv = _mm512_set1_ps(m);
            __m512 total = _mm512_setzero_ps(), w[4];
            for (int i = 0; i < 4; i++) {
                w[i] = _ZGVeN16v_expf(_mm512_sub_ps(sv[i], mv));
                total = _mm512_add_ps(total, w[i]);
            }
            _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
            _mm512_store_si512(probs[r] + 32, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]));
            row_sum[r] = row_sum[r] * alpha + _mm512_reduce_add_ps(total);
            row_max[r] = m;
            if (alpha != 1.0f) {
                const __m512 a = _mm512_set1_ps(alpha);
                for (int ch = 0; ch < CH; ch++) o[r * CH + ch] = _mm512_mul_ps(o[r * CH + ch], a);
            }
        }

        /* o[r] += P[r] . V[k0 ..] */
        const uint32_t *vb = vp + (k0 / 2) * D;
        const int64_t block_keys = end - k0 < KEY_BLOCK ? end - k0 : KEY_BLOCK;
        for (int64_t jp = 0; jp < (block_keys + 1) / 2; jp++) {
            __m512bh vv[MAX_CHUNKS];
            for (int ch = 0; ch < CH; ch++) vv[ch] = (__m512bh)_mm512_loadu_si512(vb + jp * D + 16 * ch);
            for (int r = 0; r < TR; r++) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)probs[r])[jp]);
                for (int ch = 0; ch < CH; ch++) o[r * CH + ch] = _mm512_dpbf16_ps(o[r * CH + ch], pb, vv[ch]);
            }
        }
    }

    for (int r = 0; r < rows; r++) {
        const int64_t row = row0 + r, pos = row / G, head = h * G + row % G;
        uint16_t *dst = c->out + (pos * c->H + head) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / row_sum[r]);
        for (int ch = 0; ch < CH; ch++) {
            const __m512 value = _mm512_mul_ps(o[r * CH + ch], inv);
            _mm256_storeu_si256((__m256i *)(dst + 16 * ch), (__m256i)_mm512_cvtneps_pbh(value));
        }
    }
}

int prefill_attention_supported(int64_t head_dim, int dtype) {
    return dtype == DTYPE_BFLOAT16 && (head_dim == 64 || head_dim == 128);
}

/* Returns 0 on success, 1 when memory ran out, 2 for a shape or dtype this build cannot serve. */
int prefill_attention(const void *q, int64_t q_row_stride, const void *k_pool, const void *v_pool,
                      const int64_t *pages, int64_t page_size, int64_t prefix_len,
                      int64_t extend_len, void *out, int64_t H, int64_t Hkv, int64_t D,
                      float scale, int dtype, int num_threads) {
    if (!prefill_attention_supported(D, dtype) || H % Hkv != 0) return 2;
    const int64_t S = prefix_len + extend_len, blocks = (S + KEY_BLOCK - 1) / KEY_BLOCK;
    const int64_t head_stride = blocks * KEY_BLOCK * D / 2; /* dwords of one packed K or V */
    int64_t *slots = malloc(S * sizeof(int64_t));
    uint32_t *packed = malloc(2 * Hkv * head_stride * sizeof(uint32_t));
    if (slots == NULL || packed == NULL) {
        free(slots);
        free(packed);
        return 1;
    }
    for (int64_t j = 0; j < S; j++) slots[j] = pages[j / page_size] * page_size + j % page_size;
    const Call call = {q, q_row_stride, out, H, Hkv, D, H / Hkv, prefix_len, extend_len, S, scale,
                       packed, packed + Hkv * head_stride, head_stride, head_stride};
    const int tile_rows = D == 64 ? 6 : 3;
    const int64_t rows = call.G * extend_len, tiles = (rows + tile_rows - 1) / tile_rows;

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < 2 * Hkv; task++) {
            if (task < Hkv)
                pack_keys(k_pool, slots, S, Hkv, task, D, packed + task * head_stride);
            else
                pack_values(v_pool, slots, S, Hkv, task - Hkv, D, packed + task * head_stride);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < Hkv * tiles; task++) {
            const int64_t h = task % Hkv, row0 = (task / Hkv) * tile_rows;
            const int n = rows - row0 < tile_rows ? (int)(rows - row0) : tile_rows;
            if (D == 64)
                attend_tile(&call, h, row0, n, 4, 6);
            else
                attend_tile(&call, h, row0, n, 8, 3);
        }
    }
    free(slots);
    free(packed);
    return 0;
}
#else
int prefill_attention_supported(int64_t head_dim, int dtype) {
    (void)head_dim, (void)dtype;
    return 0;
}

int prefill_attention(const void *q, int64_t q_row_stride, const void *k_pool, const void *v_pool,
                      const int64_t *pages, int64_t page_size, int64_t prefix_len,
                      int64_t extend_len, void *out, int64_t H, int64_t Hkv, int64_t D,
                      float scale, int dtype, int num_threads) {
    (void)q, (void)q_row_stride, (void)k_pool, (void)v_pool, (void)pages, (void)page_size;
    (void)prefix_len, (void)extend_len, (void)out, (void)H, (void)Hkv, (void)D, (void)scale;
    (void)dtype, (void)num_threads;
    return 2;
}
#endif
