/* Causal prefill attention on the CPU: the new tokens of one request attend over its paged
 * context (cached prefix + themselves), flash-attention style, with tiles of scores and outputs
 * held in AVX-512 registers.
 *
 * Built and loaded at run time by radixserve/kernels/cpu.py. torch's CPU flash attention runs
 * the two matmuls of each block through a gemm call on buffers in memory (on AMX tiles where
 * the CPU has them, for bf16); this kernel keeps a tile of TR query rows x 64 keys of scores,
 * and TR x D outputs, in registers.
 *
 * Layouts (row-major):
 *   q    [E, H, D]        the new tokens' queries, rows q_row_stride elements apart
 *   out  [E, H, D]        contiguous
 *   k_pool/v_pool [slots, Hkv, D]  slot = page * page_size + offset; the new tokens' K/V are
 *                                  already stored (positions prefix_len .. prefix_len + E - 1)
 *   pages                 the request's page ids, in order
 *
 * Numerics follow torch's flash attention: q.k summed in fp32 then scaled, an online softmax
 * in fp32, fp32 accumulators, the output rounded once; for bf16 the probabilities are rounded
 * to bf16 before the product with V, as torch does. Only the summation order differs.
 *
 * Work: for each kv head, K is repacked once as K^T ([S/64][W][64] 32-bit words, where a word
 * is one fp32 element or, for bf16, the pair (d, d+1), W = D or D/2 words per key) and V is
 * gathered into one contiguous block (bf16: key pairs interleaved, [S/2][D] words of
 * (V[j][d], V[j+1][d]), the layout of the bf16 dot product vdpbf16ps). A task is TR query
 * rows of one kv head (rows are (position, head of the group) pairs); it walks the keys in
 * blocks of 64: scores in registers, online softmax, probabilities to a small buffer, then
 * the output tile gains P.V.
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
    const void *q;
    int64_t q_row_stride;
    void *out;
    int64_t H, Hkv, D, G;
    int64_t prefix_len;
    float scale;
    const uint32_t *k_packed, *v_packed; /* per kv head: see pack_keys / pack_values */
    int64_t head_stride;                 /* words of one head's packed K (and of its V) */
} Call;

/* K of kv head h as [ceil(S/64)][W][64] words, W = the words of one key row (zero past S). */
static void pack_keys(const void *k_pool, const int64_t *slots, int64_t S, int64_t Hkv, int64_t h,
                      int64_t D, int dtype, uint32_t *dst) {
    const int64_t words = D * element_size(dtype) / 4, blocks = (S + KEY_BLOCK - 1) / KEY_BLOCK;
    memset(dst, 0, blocks * words * KEY_BLOCK * sizeof(uint32_t));
    for (int64_t j = 0; j < S; j++) {
        const uint32_t *row = (const uint32_t *)((const char *)k_pool + (slots[j] * Hkv + h) * D * element_size(dtype));
        uint32_t *col = dst + (j / KEY_BLOCK) * words * KEY_BLOCK + j % KEY_BLOCK;
        for (int64_t w = 0; w < words; w++) col[w * KEY_BLOCK] = row[w];
    }
}

/* V of kv head h, contiguous and zero past S: fp32 as [S][D]; bf16 as [S/2][D] words, word
 * (j/2, d) = V[j][d] | V[j+1][d] << 16. */
static void pack_values(const void *v_pool, const int64_t *slots, int64_t S, int64_t Hkv, int64_t h,
                        int64_t D, int dtype, uint32_t *dst) {
    const int64_t padded = (S + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    memset(dst, 0, padded * D * element_size(dtype));
    for (int64_t j = 0; j < S; j++) {
        if (dtype == DTYPE_BFLOAT16) {
            const uint16_t *row = (const uint16_t *)v_pool + (slots[j] * Hkv + h) * D;
            uint16_t *pairs = (uint16_t *)(dst + (j / 2) * D) + (j % 2);
            for (int64_t d = 0; d < D; d++) pairs[2 * d] = row[d];
        } else {
            memcpy(dst + j * D, (const float *)v_pool + (slots[j] * Hkv + h) * D, D * sizeof(float));
        }
    }
}

/* One block's online-softmax step for one row: s (raw q.k of 64 keys) scaled, keys at or past
 * `visible` dropped; updates the row's max and sum, rescales its outputs, returns the weights. */
static inline __attribute__((always_inline)) void softmax_step(const __m512 *s, int64_t visible, float scale,
                                                               float *row_max, float *row_sum, __m512 *o,
                                                               const int CH, __m512 *w) {
    const __m512 lowest = _mm512_set1_ps(-FLT_MAX), scale_v = _mm512_set1_ps(scale);
    __m512 sv[4], bm = lowest;
    for (int i = 0; i < 4; i++) {
        const int64_t lanes = visible - 16 * i;
        const __mmask16 keep = lanes >= 16 ? 0xFFFF : lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
        sv[i] = _mm512_mask_mul_ps(lowest, keep, s[i], scale_v);
        bm = _mm512_max_ps(bm, sv[i]);
    }
    const float block_max = _mm512_reduce_max_ps(bm);
    const float m = block_max > *row_max ? block_max : *row_max;
    const float alpha = expf(*row_max - m);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 total = _mm512_setzero_ps();
    for (int i = 0; i < 4; i++) {
        w[i] = _ZGVeN16v_expf(_mm512_sub_ps(sv[i], mv));
        total = _mm512_add_ps(total, w[i]);
    }
    *row_sum = *row_sum * alpha + _mm512_reduce_add_ps(total);
    *row_max = m;
    if (alpha != 1.0f) {
        const __m512 a = _mm512_set1_ps(alpha);
        for (int ch = 0; ch < CH; ch++) o[ch] = _mm512_mul_ps(o[ch], a);
    }
}

/* One tile of `rows` query rows (<= TR) of kv head h, first row `row0` of the head's G * E
 * rows. CH = D / 16, TR and DT (the dtype) are constants in each inlined copy. */
static inline __attribute__((always_inline)) void attend_tile(const Call *c, int64_t h, int64_t row0,
                                                              int rows, const int CH, const int TR,
                                                              const int DT) {
    const int64_t D = c->D, G = c->G, words = DT == DTYPE_BFLOAT16 ? D / 2 : D;
    const uint32_t *kp = c->k_packed + h * c->head_stride, *vp = c->v_packed + h * c->head_stride;
    const uint32_t *qrow[MAX_TILE_ROWS]; /* a query row as 32-bit words, like the packed K */
    int64_t limit[MAX_TILE_ROWS];        /* keys 0 .. limit - 1 are visible to the row */
    for (int r = 0; r < TR; r++) {
        const int64_t row = row0 + (r < rows ? r : rows - 1), pos = row / G, head = h * G + row % G;
        qrow[r] = (const uint32_t *)((const char *)c->q + (pos * c->q_row_stride + head * D) * element_size(DT));
        limit[r] = c->prefix_len + pos + 1;
    }
    const int64_t end = limit[rows - 1]; /* rows are in position order: the last sees most */
    float row_max[MAX_TILE_ROWS], row_sum[MAX_TILE_ROWS];
    /* this block's probabilities: bf16 pairs or fp32, as the product with V reads them */
    uint32_t probs[MAX_TILE_ROWS][KEY_BLOCK] __attribute__((aligned(64)));
    __m512 o[MAX_TILE_ROWS * MAX_CHUNKS];
    for (int r = 0; r < TR; r++) {
        row_max[r] = -FLT_MAX;
        row_sum[r] = 0.0f;
        for (int ch = 0; ch < CH; ch++) o[r * CH + ch] = _mm512_setzero_ps();
    }

    for (int64_t k0 = 0; k0 < end; k0 += KEY_BLOCK) {
        /* s[r][i] = q_r . K[k0 + 16 i .. k0 + 16 i + 15] */
        const uint32_t *kb = kp + (k0 / KEY_BLOCK) * words * KEY_BLOCK;
        __m512 s[MAX_TILE_ROWS * 4];
        for (int i = 0; i < TR * 4; i++) s[i] = _mm512_setzero_ps();
        for (int64_t w = 0; w < words; w++) {
            __m512i kv[4];
            for (int i = 0; i < 4; i++) kv[i] = _mm512_loadu_si512(kb + w * KEY_BLOCK + 16 * i);
            for (int r = 0; r < TR; r++) {
                const __m512i qw = _mm512_set1_epi32((int)qrow[r][w]);
                for (int i = 0; i < 4; i++) {
                    if (DT == DTYPE_BFLOAT16)
                        s[r * 4 + i] = _mm512_dpbf16_ps(s[r * 4 + i], (__m512bh)qw, (__m512bh)kv[i]);
                    else
                        s[r * 4 + i] = _mm512_fmadd_ps(_mm512_castsi512_ps(qw), _mm512_castsi512_ps(kv[i]), s[r * 4 + i]);
                }
            }
        }
        for (int r = 0; r < TR; r++) {
            __m512 w[4];
            softmax_step(s + r * 4, limit[r] - k0, c->scale, row_max + r, row_sum + r, o + r * CH, CH, w);
            if (DT == DTYPE_BFLOAT16) {
                _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
                _mm512_store_si512(probs[r] + 16, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]));
            } else {
                for (int i = 0; i < 4; i++) _mm512_store_ps(probs[r] + 16 * i, w[i]);
            }
        }

        /* o[r] += P[r] . V[k0 ..]: one step per key pair (bf16) or key (fp32) */
        const int64_t block_keys = end - k0 < KEY_BLOCK ? end - k0 : KEY_BLOCK;
        const int64_t steps = DT == DTYPE_BFLOAT16 ? (block_keys + 1) / 2 : block_keys;
        const uint32_t *vb = vp + (DT == DTYPE_BFLOAT16 ? k0 / 2 : k0) * D;
        for (int64_t j = 0; j < steps; j++) {
            __m512i vv[MAX_CHUNKS];
            for (int ch = 0; ch < CH; ch++) vv[ch] = _mm512_loadu_si512(vb + j * D + 16 * ch);
            for (int r = 0; r < TR; r++) {
                const __m512i pw = _mm512_set1_epi32((int)probs[r][j]);
                for (int ch = 0; ch < CH; ch++) {
                    if (DT == DTYPE_BFLOAT16)
                        o[r * CH + ch] = _mm512_dpbf16_ps(o[r * CH + ch], (__m512bh)pw, (__m512bh)vv[ch]);
                    else
                        o[r * CH + ch] = _mm512_fmadd_ps(_mm512_castsi512_ps(pw), _mm512_castsi512_ps(vv[ch]), o[r * CH + ch]);
                }
            }
        }
    }

    for (int r = 0; r < rows; r++) {
        const int64_t row = row0 + r, pos = row / G, head = h * G + row % G;
        const int64_t offset = (pos * c->H + head) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / row_sum[r]);
        for (int ch = 0; ch < CH; ch++) {
            const __m512 value = _mm512_mul_ps(o[r * CH + ch], inv);
            if (DT == DTYPE_BFLOAT16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)c->out + offset + 16 * ch), (__m256i)_mm512_cvtneps_pbh(value));
            else
                _mm512_storeu_ps((float *)c->out + offset + 16 * ch, value);
        }
    }
}

/* Query rows per task for a head size (the TR of attend_tile). */
static int tile_rows_for(int64_t D) { return D == 64 ? 6 : 3; }

/* The tile of `task` with this build's constants for the call's head size and dtype. */
static void attend_task(const Call *c, int64_t task, int64_t rows, int dtype) {
    const int tile_rows = tile_rows_for(c->D);
    const int64_t h = task % c->Hkv, row0 = (task / c->Hkv) * tile_rows;
    const int n = rows - row0 < tile_rows ? (int)(rows - row0) : tile_rows;
    if (c->D == 64 && dtype == DTYPE_BFLOAT16)
        attend_tile(c, h, row0, n, 4, 6, DTYPE_BFLOAT16);
    else if (c->D == 64)
        attend_tile(c, h, row0, n, 4, 6, DTYPE_FLOAT32);
    else if (dtype == DTYPE_BFLOAT16)
        attend_tile(c, h, row0, n, 8, 3, DTYPE_BFLOAT16);
    else
        attend_tile(c, h, row0, n, 8, 3, DTYPE_FLOAT32);
}

/* bf16 with head size 64 or 128; fp32 with head size 64 (at 128, with fewer query rows per
 * tile, torch's flash attention is as fast in fp32). */
int prefill_attention_supported(int64_t head_dim, int dtype) {
    return head_dim == 64 ? dtype == DTYPE_BFLOAT16 || dtype == DTYPE_FLOAT32
                          : head_dim == 128 && dtype == DTYPE_BFLOAT16;
}

/* Returns 0 on success, 1 when memory ran out, 2 for a shape or dtype this build cannot serve. */
int prefill_attention(const void *q, int64_t q_row_stride, const void *k_pool, const void *v_pool,
                      const int64_t *pages, int64_t page_size, int64_t prefix_len,
                      int64_t extend_len, void *out, int64_t H, int64_t Hkv, int64_t D,
                      float scale, int dtype, int num_threads) {
    if (!prefill_attention_supported(D, dtype) || H % Hkv != 0) return 2;
    const int64_t S = prefix_len + extend_len, blocks = (S + KEY_BLOCK - 1) / KEY_BLOCK;
    const int64_t head_stride = blocks * KEY_BLOCK * D * element_size(dtype) / 4;
    int64_t *slots = malloc(S * sizeof(int64_t));
    uint32_t *packed = malloc(2 * Hkv * head_stride * sizeof(uint32_t));
    if (slots == NULL || packed == NULL) {
        free(slots);
        free(packed);
        return 1;
    }
    for (int64_t j = 0; j < S; j++) slots[j] = pages[j / page_size] * page_size + j % page_size;
    const Call call = {q, q_row_stride, out, H, Hkv, D, H / Hkv, prefix_len, scale,
                       packed, packed + Hkv * head_stride, head_stride};
    const int64_t rows = call.G * extend_len, tile_rows = tile_rows_for(D);
    const int64_t tasks = Hkv * ((rows + tile_rows - 1) / tile_rows);

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < 2 * Hkv; task++) {
            if (task < Hkv)
                pack_keys(k_pool, slots, S, Hkv, task, D, dtype, packed + task * head_stride);
            else
                pack_values(v_pool, slots, S, Hkv, task - Hkv, D, dtype, packed + task * head_stride);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) attend_task(&call, task, rows, dtype);
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
