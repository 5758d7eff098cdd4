/* Linear layers over GGUF-quantized weights kept in their blocks: y = x @ W^T + b, the weights
 * dequantized inside the dot products, as llama.cpp's CPU backend computes them.
 *
 * A GGUF model of Q4_0 or Q4_K holds a quarter to a third of the bytes of its bf16 weights, and
 * decode is bound by reading the weights: dequantizing them at load gives that back. Here the
 * weight stays the GGUF tensor's bytes, row-major, N rows of K / block_size blocks each, in the
 * file's block layout (GGML type ids):
 *
 *   Q4_0 (2)   32 values in 18 bytes: fp16 d, 16 bytes of nibbles; value = d * (q - 8)
 *   Q4_1 (3)   32 values in 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; value = d * q + m
 *   Q8_0 (8)   32 values in 34 bytes: fp16 d, 32 int8; value = d * q
 *   Q4_K (12)  256 values in 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins
 *              for 8 sub-blocks of 32, 128 bytes of nibbles; value = d * sc * q - dmin * m
 *   Q6_K (14)  256 values in 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
 *              int8 scales for 16 sub-blocks of 16, fp16 d; value = d * sc * (q - 32)
 *
 * (nibble i of a 32-block's byte j: value j for the low nibble, j + 16 for the high one; the
 * K-quants' orders are in the portable decoders below). Each activation row is quantized once
 * per call to int8 blocks with an fp32 scale d = max|x| / 127 (values rounded to nearest even;
 * Q8_0's to int16, see below):
 * blocks of 32 with the scaled block sum d * sum(q) (for Q4_1's min) for the 32-blocks, blocks
 * of 256 with 16 sums of 16 values (for Q4_K's mins and Q6_K's offset of 32) for the K-quants.
 * Then, per weight block (K-quants: per 256 values) and row, the integer dot product is exact
 * (int32), and the block's contribution is fp32: (d_w * d_x) * dot (Q4_1: + m_w * d_x * sum(q);
 * Q4_K: - (dmin_w * d_x) * sum_s(m_s * sum_s(q))), summed over the blocks in fp32. The vector
 * paths split each block's dot into per-lane integer parts scaled the same way, so paths and
 * tiers differ only in the order of the fp32 sums.
 *
 * Q8_0's activations: its weights are near-lossless, and int8 activations alone would move a
 * layer's output by up to about 1% (a block holding an outlier channel rounds its other values
 * coarsely), far more than the weights do. So Q8_0's activations are int16 blocks of 32, d =
 * max|x| / 32767, dotted with the int8 weights by int16 multiplies (vpmaddwd, vpdpwssd) whose
 * sums are exact in int32 (|sum| <= 32 x 32767 x 255 per block): on AVX2 two vpmaddwd per 32
 * products, as many multiplies as int8 activations take there (vpmaddubsw with the sign trick,
 * then a vpmaddwd to widen). Each block's 32 values
 * are stored in the order 0, 2, 1, 3 of every 4 (see `wide_slot`), the order in which the group
 * kernels pair them with a chunk's bytes.
 *
 * Two weight layouts (`interleaved`): the file's, above, and `quant_pack`'s (once at load, the
 * same bytes), where groups of 16 rows have their blocks interleaved so that a 64-byte load
 * holds four values of each of 16 columns (see "the interleaved layout" below); rows past the
 * last whole group keep the file's layout. Over groups, the "group kernels" accumulate 16
 * columns in the lanes of one vector (vpdpbusd of the weights against 4 activation values
 * broadcast), with no horizontal sums; over the file's layout (and a group layout's tail), the
 * "tiles" below.
 *
 * Tile paths per ISA tier, chosen at compile time: portable C (the reference arithmetic); AVX2
 * (one 32-block per 256-bit vector, maddubs/madd integer dots, F16C scales); AVX-512 (two
 * 32-blocks or 64 K-quant values per 512-bit vector), with vpdpbusd / vpdpwssd where the build
 * has AVX512-VNNI (the avx512_bf16 tier). The group kernels are written once over a 16-lane
 * vector type each tier defines (one zmm; two ymm; 16 scalar lanes).
 *
 * Work: the groups (or, in the file's layout, chunks of CHUNK columns) spread over the threads,
 * each thread streaming a contiguous run of weight rows, once at decode. A group's activation
 * rows are done four at a time, their sums in registers, each block's weights decoded once for
 * the four; a file-layout chunk in tiles of up to TILE_ROWS rows by TILE_COLS columns. A row's
 * outputs are computed by the same operations in the same order whatever M, the tile it falls
 * in and the thread count: a row alone gives bit-identical results to the same row in a batch.
 * `quant_dequantize` gives the weight itself (either layout), fp32 or bf16, for callers that
 * widen it for a dense matmul.
 *
 *   x [M, K] (rows x_row_stride elements apart), fp32 or bf16; bias [N] fp32 or NULL;
 *   y [M, N] (rows y_row_stride elements apart), fp32 or bf16 (rounded to nearest even once,
 *   after the bias).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "dtypes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QL_AVX512 1
#define TILE_COLS 4
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "avx2.h"
#define QL_AVX2 1
#define TILE_COLS 2
#else
#define TILE_COLS 4
#endif
#define TILE_ROWS 4
#define CHUNK 16 /* columns per work item, a multiple of TILE_COLS */

#define ALWAYS_INLINE inline __attribute__((always_inline))

enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q6_K = 14 };

static int64_t block_values(int qtype) { return qtype == QT_Q4_K || qtype == QT_Q6_K ? 256 : 32; }

static int64_t block_bytes(int qtype) {
    switch (qtype) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q8_0: return 34;
    case QT_Q4_K: return 144;
    case QT_Q6_K: return 210;
    default: return 0;
    }
}

int quant_linear_serves(int qtype) { return block_bytes(qtype) != 0; }

/* ---------------------------------------------------------------- activations, quantized
 *
 * One row of the scratch: int8 q[K] (Q8_0: int16 q16[K], see `wide_slot`), then float
 * d[blocks], then
 *   32-blocks: float s[blocks] = d * sum(q) (not for Q8_0), int32 isum[blocks] = sum(q);
 *   K-quants:  int16 sums[16 * blocks] of 16 values each, int16 sums32[8 * blocks] of 32 each;
 * rows padded to 64 bytes, at least 64 past the values (the AVX-512 path reads a 32-block
 * pair's second half past an odd row's last block: it lands in the row's scales, its products
 * multiplied by zero). */
static int64_t act_value_bytes(int qtype) { return qtype == QT_Q8_0 ? 2 : 1; }

static int64_t act_row_bytes(int qtype, int64_t K) {
    const int64_t blocks = K / block_values(qtype);
    const int64_t tail = block_values(qtype) == 256 ? blocks * (4 + 32 + 16) : blocks * 12;
    return (K * act_value_bytes(qtype) + tail + 63) / 64 * 64;
}

static int64_t scratch_bytes(int qtype, int64_t M, int64_t K) { return M * act_row_bytes(qtype, K) + 64; }

/* Where value e of a Q8_0 activation block is stored: 0, 2, 1, 3 in every 4. A group chunk
 * holds 4 values of a column in a 32-bit lane; its even bytes (0, 2) and odd bytes (1, 3) each
 * widen to a pair of int16 in the lane with two operations, and the pairs of activations they
 * multiply are then adjacent words (see q32_dots). */
static ALWAYS_INLINE int wide_slot(int e) { return (e & ~3) | (e & 1) << 1 | (e >> 1 & 1); }

typedef struct {
    const int8_t *q;
    const int16_t *q16;    /* Q8_0 */
    const float *d;
    const float *s;       /* 32-blocks */
    const int32_t *isum;  /* 32-blocks */
    const int16_t *sums;  /* K-quants, 16 a block */
    const int16_t *sums32; /* K-quants, 8 a block */
} act_row;

static ALWAYS_INLINE act_row act_at(const uint8_t *scratch, int64_t row_bytes, int64_t values_bytes, int64_t blocks,
                                     int64_t r) {
    const uint8_t *base = scratch + r * row_bytes;
    act_row a;
    a.q = (const int8_t *)base;
    a.q16 = (const int16_t *)base;
    a.d = (const float *)(base + values_bytes);
    a.s = a.d + blocks;
    a.isum = (const int32_t *)(a.s + blocks);
    a.sums = (const int16_t *)(a.d + blocks);
    a.sums32 = a.sums + 16 * blocks;
    return a;
}

/* Blocks b0..b1-1 of one row x (fp32 or bf16) into its scratch row: blocks of `bs` (32 or 256)
 * values, int8, or int16 for Q8_0 (`wide`). */
static void quantize_blocks(const void *x, int dtype, int64_t K, int64_t bs, int64_t b0, int64_t b1, uint8_t *dst,
                            const int wide) {
    const int64_t blocks = K / bs;
    int8_t *q = (int8_t *)dst;
    int16_t *q16 = (int16_t *)dst;
    float *d = (float *)(dst + K * (wide ? 2 : 1));
    float *s = d + blocks;
    int32_t *isum = (int32_t *)(s + blocks);
    int16_t *sums = (int16_t *)(d + blocks);
    int16_t *sums32 = sums + 16 * blocks;
    float v[256];
    for (int64_t b = b0; b < b1; b++) {
        for (int64_t e = 0; e < bs; e++) {
            const int64_t k = b * bs + e;
            v[e] = dtype == DTYPE_BFLOAT16 ? bf16_to_float(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        }
        float amax = 0.0f;
        for (int64_t e = 0; e < bs; e++) {
            const float a = fabsf(v[e]);
            amax = a > amax ? a : amax;
        }
        float scale = amax * (wide ? 1.0f / 32767.0f : 1.0f / 127.0f);
        /* the rounded scale, as stored: -ffast-math would otherwise fold 1 / scale into
         * 127 / amax, one rounding fewer than the scale the dot products use */
        __asm__ volatile("" : "+m"(scale));
        const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        d[b] = scale;
        if (wide) {
            int32_t total = 0;
            for (int e = 0; e < 32; e++) {
                const int32_t value = (int32_t)rintf(v[e] * inverse);
                q16[b * 32 + wide_slot(e)] = (int16_t)value;
                total += value;
            }
            isum[b] = total;
            continue;
        }
        int8_t *qb = q + b * bs;
        for (int64_t e = 0; e < bs; e++) qb[e] = (int8_t)(int32_t)rintf(v[e] * inverse);
        if (bs == 32) {
            int32_t total = 0;
            for (int e = 0; e < 32; e++) total += qb[e];
            s[b] = scale * (float)total;
            isum[b] = total;
        } else {
            for (int t = 0; t < 16; t++) {
                int32_t total = 0;
                for (int e = 0; e < 16; e++) total += qb[16 * t + e];
                sums[16 * b + t] = (int16_t)total;
            }
            for (int t = 0; t < 8; t++)
                sums32[8 * b + t] = (int16_t)(sums[16 * b + 2 * t] + sums[16 * b + 2 * t + 1]);
        }
    }
}

static ALWAYS_INLINE float fp16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return fp16_to_float(h);
}

/* Q4_K's 6-bit scale and min of sub-block j (0..7) from the block's 12 bytes. */
static ALWAYS_INLINE void q4k_scale_min(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K's 8 scales (bytes 0..7) and mins (bytes 8..15) from the block's 12 bytes (llama.cpp's
 * unpacking in four words, for the vector paths). */
static ALWAYS_INLINE void q4k_unpack(const uint8_t *scales, uint32_t out[4]) {
    uint32_t u[3];
    memcpy(u, scales, 12);
    out[0] = u[0] & 0x3f3f3f3fu;
    out[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    out[2] = u[1] & 0x3f3f3f3fu;
    out[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
}

/* v as computed, hidden from the optimiser: -ffast-math may otherwise reassociate a block's
 * scale products differently in each tile height's copy, and a row's outputs would depend on
 * the tile it is in */
#if defined(__x86_64__) || defined(__i386__)
#define OPAQUE(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define OPAQUE(v) __asm__("" : "+w"(v))
#else
#define OPAQUE(v) __asm__ volatile("" : "+m"(v))
#endif

/* ---------------------------------------------------------------- portable tiles
 *
 * The reference arithmetic: out[i][j] = the sum over weight blocks of column j of the block's
 * fp32 contribution for row i (see the top of the file). */
#if !defined(QL_AVX512) && !defined(QL_AVX2)
static ALWAYS_INLINE void tile_q32(const uint8_t *const *w, const act_row *x, int64_t blocks, const int m, const int QT,
                                   float out[TILE_ROWS][TILE_COLS]) {
    const int64_t bb = block_bytes(QT);
    float acc[TILE_ROWS][TILE_COLS] = {{0}};
    for (int64_t b = 0; b < blocks; b++) {
        for (int j = 0; j < TILE_COLS; j++) {
            const uint8_t *blk = w[j] + b * bb;
            const float dw = fp16_at(blk), mw = QT == QT_Q4_1 ? fp16_at(blk + 2) : 0.0f;
            int8_t q[32];
            if (QT == QT_Q8_0) {
                memcpy(q, blk + 2, 32);
            } else {
                const uint8_t *nib = blk + (QT == QT_Q4_1 ? 4 : 2);
                const int offset = QT == QT_Q4_0 ? 8 : 0;
                for (int e = 0; e < 16; e++) {
                    q[e] = (int8_t)((nib[e] & 0xF) - offset);
                    q[e + 16] = (int8_t)((nib[e] >> 4) - offset);
                }
            }
            for (int i = 0; i < m; i++) {
                const int8_t *xq = x[i].q + 32 * b;
                const int16_t *xw = x[i].q16 + 32 * b;
                int32_t dot = 0;
                for (int e = 0; e < 32; e++) dot += q[e] * (QT == QT_Q8_0 ? xw[wide_slot(e)] : xq[e]);
                float scale = dw * x[i].d[b];
                OPAQUE(scale);
                float term = scale * (float)dot;
                if (QT == QT_Q4_1) {
                    float min_term = mw * x[i].s[b];
                    OPAQUE(min_term);
                    term += min_term;
                }
                OPAQUE(term);
                acc[i][j] += term;
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) out[i][j] = acc[i][j];
}

static ALWAYS_INLINE void tile_q4k(const uint8_t *const *w, const act_row *x, int64_t blocks, const int m,
                                   float out[TILE_ROWS][TILE_COLS]) {
    float acc[TILE_ROWS][TILE_COLS] = {{0}};
    for (int64_t b = 0; b < blocks; b++) {
        for (int j = 0; j < TILE_COLS; j++) {
            const uint8_t *blk = w[j] + b * 144;
            const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
            int sc[8], mn[8];
            for (int s = 0; s < 8; s++) q4k_scale_min(s, blk + 4, &sc[s], &mn[s]);
            uint8_t q[256];
            for (int p = 0; p < 4; p++)
                for (int l = 0; l < 32; l++) {
                    q[64 * p + l] = blk[16 + 32 * p + l] & 0xF;
                    q[64 * p + 32 + l] = blk[16 + 32 * p + l] >> 4;
                }
            for (int i = 0; i < m; i++) {
                const int8_t *xq = x[i].q + 256 * b;
                const int16_t *sums = x[i].sums + 16 * b;
                int32_t dot = 0, mins = 0;
                for (int s = 0; s < 8; s++) {
                    int32_t part = 0;
                    for (int e = 0; e < 32; e++) part += q[32 * s + e] * xq[32 * s + e];
                    dot += sc[s] * part;
                    mins += mn[s] * (sums[2 * s] + sums[2 * s + 1]);
                }
                float scale = d * x[i].d[b], min_scale = dmin * x[i].d[b];
                OPAQUE(scale);
                OPAQUE(min_scale);
                float term = scale * (float)dot - min_scale * (float)mins;
                OPAQUE(term);
                acc[i][j] += term;
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) out[i][j] = acc[i][j];
}

static ALWAYS_INLINE void tile_q6k(const uint8_t *const *w, const act_row *x, int64_t blocks, const int m,
                                   float out[TILE_ROWS][TILE_COLS]) {
    float acc[TILE_ROWS][TILE_COLS] = {{0}};
    for (int64_t b = 0; b < blocks; b++) {
        for (int j = 0; j < TILE_COLS; j++) {
            const uint8_t *blk = w[j] + b * 210;
            const uint8_t *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = fp16_at(blk + 208);
            uint8_t q[256]; /* 0..63, the offset of 32 applied through the sums */
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + 32 + l], bits = qh[32 * h + l];
                    q[128 * h + l] = (lo & 0xF) | (bits & 3) << 4;
                    q[128 * h + 32 + l] = (hi & 0xF) | ((bits >> 2) & 3) << 4;
                    q[128 * h + 64 + l] = (lo >> 4) | ((bits >> 4) & 3) << 4;
                    q[128 * h + 96 + l] = (hi >> 4) | ((bits >> 6) & 3) << 4;
                }
            for (int i = 0; i < m; i++) {
                const int8_t *xq = x[i].q + 256 * b;
                const int16_t *sums = x[i].sums + 16 * b;
                int32_t dot = 0;
                for (int t = 0; t < 16; t++) {
                    int32_t part = 0;
                    for (int e = 0; e < 16; e++) part += q[16 * t + e] * xq[16 * t + e];
                    dot += sc[t] * (part - 32 * sums[t]);
                }
                float scale = d * x[i].d[b];
                OPAQUE(scale);
                float term = scale * (float)dot;
                OPAQUE(term);
                acc[i][j] += term;
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) out[i][j] = acc[i][j];
}
#endif

/* ---------------------------------------------------------------- AVX2 tiles */
#if defined(QL_AVX2)
/* Sum over 4-byte groups of unsigned a times signed b, as 8 int32 (no saturation: |a| <= 128
 * times |b| <= 127, or a <= 63). */
static ALWAYS_INLINE __m256i dot_u8i8(__m256i a, __m256i b) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

static ALWAYS_INLINE __m256i nibbles_32(const uint8_t *p) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

static ALWAYS_INLINE void tile_q32(const uint8_t *const *w, const act_row *x, int64_t blocks, const int m, const int QT,
                                   float out[TILE_ROWS][TILE_COLS]) {
    const int64_t bb = block_bytes(QT);
    __m256 acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) acc[i][j] = _mm256_setzero_ps();
    /* Q8_0's int8 weights reordered as its activations are stored (see wide_slot) */
    const __m256i slot_order = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15, 0, 2, 1, 3, 4, 6,
                                                5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i xv[TILE_ROWS], xw[TILE_ROWS][2];
        __m256 dx[TILE_ROWS], sx[TILE_ROWS];
        for (int i = 0; i < m; i++) {
            if (QT == QT_Q8_0) {
                xw[i][0] = _mm256_loadu_si256((const __m256i *)(x[i].q16 + 32 * b));
                xw[i][1] = _mm256_loadu_si256((const __m256i *)(x[i].q16 + 32 * b + 16));
            } else {
                xv[i] = _mm256_loadu_si256((const __m256i *)(x[i].q + 32 * b));
            }
            dx[i] = _mm256_broadcast_ss(x[i].d + b);
            if (QT == QT_Q4_1) sx[i] = _mm256_broadcast_ss(x[i].s + b);
        }
        for (int j = 0; j < TILE_COLS; j++) {
            const uint8_t *blk = w[j] + b * bb;
            const __m256 dw = _mm256_set1_ps(fp16_at(blk));
            __m256i wq;
            if (QT == QT_Q8_0) {
                wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
            } else {
                wq = nibbles_32(blk + (QT == QT_Q4_1 ? 4 : 2));
                if (QT == QT_Q4_0) wq = _mm256_sub_epi8(wq, _mm256_set1_epi8(8));
            }
            if (QT == QT_Q4_1) {
                const __m256 mw = _mm256_setr_ps(fp16_at(blk + 2), 0, 0, 0, 0, 0, 0, 0);
                for (int i = 0; i < m; i++) {
                    const __m256i p = dot_u8i8(wq, xv[i]);
                    acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx[i]), _mm256_cvtepi32_ps(p), acc[i][j]);
                    acc[i][j] = _mm256_fmadd_ps(mw, sx[i], acc[i][j]);
                }
            } else if (QT == QT_Q8_0) {
                const __m256i ordered = _mm256_shuffle_epi8(wq, slot_order);
                const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(ordered));
                const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(ordered, 1));
                for (int i = 0; i < m; i++) {
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, xw[i][0]), _mm256_madd_epi16(w1, xw[i][1]));
                    acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx[i]), _mm256_cvtepi32_ps(p), acc[i][j]);
                }
            } else {
                /* Q4_0's signed weights: |w| times x with w's sign */
                const __m256i wa = _mm256_sign_epi8(wq, wq);
                for (int i = 0; i < m; i++) {
                    const __m256i p = dot_u8i8(wa, _mm256_sign_epi8(xv[i], wq));
                    acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx[i]), _mm256_cvtepi32_ps(p), acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) out[i][j] = avx2_reduce_add(acc[i][j]);
}

static ALWAYS_INLINE void tile_q4k(const uint8_t *const *w, const act_row *x, int64_t blocks, const int m,
                                   float out[TILE_ROWS][TILE_COLS]) {
    __m256 acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        for (int j = 0; j < TILE_COLS; j++) {
            const uint8_t *blk = w[j] + b * 144;
            const __m256 d = _mm256_set1_ps(fp16_at(blk)), dmin = _mm256_set1_ps(fp16_at(blk + 2));
            uint32_t sm[4];
            q4k_unpack(blk + 4, sm);
            const uint8_t *sc = (const uint8_t *)sm;
            const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8)));
            __m256i wq[8], scv[8];
            for (int p = 0; p < 4; p++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * p));
                wq[2 * p] = _mm256_and_si256(q, low);
                wq[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            }
            for (int s = 0; s < 8; s++) scv[s] = _mm256_set1_epi16(sc[s]);
            for (int i = 0; i < m; i++) {
                const int8_t *xq = x[i].q + 256 * b;
                __m256i dot = _mm256_setzero_si256();
                for (int s = 0; s < 8; s++) {
                    const __m256i t = _mm256_maddubs_epi16(wq[s], _mm256_loadu_si256((const __m256i *)(xq + 32 * s)));
                    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(t, scv[s]));
                }
                const int16_t *sums = x[i].sums + 16 * b;
                const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)sums),
                                                     _mm_loadu_si128((const __m128i *)(sums + 8)));
                const __m256i mn = _mm256_zextsi128_si256(_mm_madd_epi16(mins, pairs));
                const __m256 dx = _mm256_broadcast_ss(x[i].d + b);
                acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(dot), acc[i][j]);
                acc[i][j] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mn), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) out[i][j] = avx2_reduce_add(acc[i][j]);
}

static ALWAYS_INLINE void tile_q6k(const uint8_t *const *w, const act_row *x, int64_t blocks, const int m,
                                   float out[TILE_ROWS][TILE_COLS]) {
    __m256 acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
    for (int64_t b = 0; b < blocks; b++) {
        for (int j = 0; j < TILE_COLS; j++) {
            const uint8_t *blk = w[j] + b * 210;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const __m256 d = _mm256_set1_ps(fp16_at(blk + 208));
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
            __m256i wq[8], scv[8];
            for (int h = 0; h < 2; h++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                wq[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high));
                wq[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), high));
                wq[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, high));
                wq[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                                                _mm256_and_si256(_mm256_srli_epi16(qh, 2), high));
            }
            for (int g = 0; g < 8; g++)
                scv[g] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * g + 1]), _mm_set1_epi16(sc[2 * g]));
            for (int i = 0; i < m; i++) {
                const int8_t *xq = x[i].q + 256 * b;
                __m256i dot = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    const __m256i t = _mm256_maddubs_epi16(wq[g], _mm256_loadu_si256((const __m256i *)(xq + 32 * g)));
                    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(t, scv[g]));
                }
                const __m256i offset = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(x[i].sums + 16 * b)));
                dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(offset, 5));
                acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(x[i].d + b)), _mm256_cvtepi32_ps(dot), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) out[i][j] = avx2_reduce_add(acc[i][j]);
}
#endif

/* ---------------------------------------------------------------- AVX-512 tiles */
#if defined(QL_AVX512)
/* Sum over 4-byte groups of unsigned a times signed b, as 16 int32 (as dot_u8i8). */
static ALWAYS_INLINE __m512i dot_u8i8(__m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1));
#endif
}

/* acc + the pairwise products of int16 a and b, as 16 int32. */
static ALWAYS_INLINE __m512i add_madd16(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* [v0 x 8, v1 x 8] from the low two lanes of v */
static ALWAYS_INLINE __m512 spread_pair(__m128 v, int first, int second) {
    const __m512i idx = _mm512_set_epi32(second, second, second, second, second, second, second, second,
                                         first, first, first, first, first, first, first, first);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

/* The 32-block weights of blocks b0, b1 of one column (b1 == b0 for a last, odd block), 64
 * bytes: Q8_0's int8, Q4_0's nibbles - 8, Q4_1's nibbles. */
static ALWAYS_INLINE __m512i weights_pair(const uint8_t *b0, const uint8_t *b1, const int QT) {
    if (QT == QT_Q8_0)
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                  _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
    const int off = QT == QT_Q4_1 ? 4 : 2;
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + off))),
                                                 _mm_loadu_si128((const __m128i *)(b1 + off)), 1);
    /* 128-bit lanes [q0, q0, q1, q1], the second and fourth shifted to their high nibbles */
    __m512i z = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), _mm512_castsi256_si512(both));
    z = _mm512_mask_srli_epi16(z, (__mmask32)0xFF00FF00u, z, 4);
    z = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
    if (QT == QT_Q4_0) z = _mm512_sub_epi8(z, _mm512_set1_epi8(8));
    return z;
}

static ALWAYS_INLINE void tile_q32(const uint8_t *const *w, const act_row *x, int64_t blocks, const int m, const int QT,
                                   float out[TILE_ROWS][TILE_COLS]) {
    const int64_t bb = block_bytes(QT);
    __m512 acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        /* blocks b and b + 1 in the low and high halves; a last, odd block reads itself twice
         * and its high half gets an activation scale of zero */
        const int odd = b + 1 == blocks;
        const int64_t b1 = odd ? b : b + 1;
        __m512i xv[TILE_ROWS], xw[TILE_ROWS][2];
        __m512 dx[TILE_ROWS], sx[TILE_ROWS];
        for (int i = 0; i < m; i++) {
            if (QT == QT_Q8_0) {
                xw[i][0] = _mm512_loadu_si512((const void *)(x[i].q16 + 32 * b));
                xw[i][1] = _mm512_loadu_si512((const void *)(x[i].q16 + 32 * b + 32));
            } else {
                xv[i] = _mm512_loadu_si512((const void *)(x[i].q + 32 * b));
            }
            const __m128 dpair = odd ? _mm_load_ss(x[i].d + b) : _mm_castpd_ps(_mm_load_sd((const double *)(x[i].d + b)));
            dx[i] = spread_pair(dpair, 0, 1);
            if (QT == QT_Q4_1) {
                const __m128 spair = odd ? _mm_load_ss(x[i].s + b) : _mm_castpd_ps(_mm_load_sd((const double *)(x[i].s + b)));
                sx[i] = spread_pair(spair, 0, 1);
            }
        }
        for (int j = 0; j < TILE_COLS; j++) {
            const uint8_t *blk0 = w[j] + b * bb, *blk1 = w[j] + b1 * bb;
            const __m512i wq = weights_pair(blk0, blk1, QT);
            if (QT == QT_Q4_1) {
                uint32_t h0, h1; /* d, m of each block */
                memcpy(&h0, blk0, 4);
                memcpy(&h1, blk1, 4);
                const __m128 dm = _mm_cvtph_ps(_mm_setr_epi32((int)h0, (int)h1, 0, 0));
                const __m512 dw = spread_pair(dm, 0, 2);
                const __m512 mw = _mm512_maskz_mov_ps(0x0101, spread_pair(dm, 1, 3));
                for (int i = 0; i < m; i++) {
                    const __m512i p = dot_u8i8(wq, xv[i]);
                    acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx[i]), _mm512_cvtepi32_ps(p), acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(mw, sx[i], acc[i][j]);
                }
            } else {
                uint16_t h0, h1;
                memcpy(&h0, blk0, 2);
                memcpy(&h1, blk1, 2);
                const __m512 dw = spread_pair(_mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)h0 | (uint32_t)h1 << 16))), 0, 1);
                if (QT == QT_Q8_0) {
                    /* int8 weights reordered as the activations are stored (see wide_slot), widened
                     * to int16: block b's products in p0, b1's in p1, each block's pairs of lanes
                     * then added into lanes 0-7 and 8-15 */
                    const __m512i ordered = _mm512_shuffle_epi8(wq, _mm512_set4_epi32(0x0F0D0E0C, 0x0B090A08, 0x07050604, 0x03010200));
                    const __m512i w0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(ordered));
                    const __m512i w1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(ordered, 1));
                    const __m512i even_lanes = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                    const __m512i odd_lanes = _mm512_add_epi32(even_lanes, _mm512_set1_epi32(1));
                    for (int i = 0; i < m; i++) {
                        const __m512i p0 = _mm512_madd_epi16(w0, xw[i][0]), p1 = _mm512_madd_epi16(w1, xw[i][1]);
                        const __m512i p = _mm512_add_epi32(_mm512_permutex2var_epi32(p0, even_lanes, p1),
                                                           _mm512_permutex2var_epi32(p0, odd_lanes, p1));
                        acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx[i]), _mm512_cvtepi32_ps(p), acc[i][j]);
                    }
                } else {
                    /* Q4_0's signed weights: |w| times x with w's sign (no 512-bit vpsignb) */
                    const __m512i wa = _mm512_abs_epi8(wq);
                    const __mmask64 negative = _mm512_movepi8_mask(wq);
                    for (int i = 0; i < m; i++) {
                        const __m512i xs = _mm512_mask_sub_epi8(xv[i], negative, _mm512_setzero_si512(), xv[i]);
                        const __m512i p = dot_u8i8(wa, xs);
                        acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx[i]), _mm512_cvtepi32_ps(p), acc[i][j]);
                    }
                }
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* int16 lanes: lane L of the result is lane (4 * group + L / 8) of v: 4 scales of 8 lanes. */
static ALWAYS_INLINE __m512i spread_scales(__m512i v, int first, int per) {
    /* per = 8: 4 scales of 8 lanes from `first`; per = 16: 2 scales of 16 lanes */
    uint16_t idx[32];
    for (int l = 0; l < 32; l++) idx[l] = (uint16_t)(first + l / per);
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(idx), v);
}

static ALWAYS_INLINE void tile_q4k(const uint8_t *const *w, const act_row *x, int64_t blocks, const int m,
                                   float out[TILE_ROWS][TILE_COLS]) {
    __m512 acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) acc[i][j] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; b++) {
        __m128i pairs[TILE_ROWS];
        __m512 dx[TILE_ROWS];
        for (int i = 0; i < m; i++) {
            const int16_t *sums = x[i].sums + 16 * b;
            pairs[i] = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)sums), _mm_loadu_si128((const __m128i *)(sums + 8)));
            dx[i] = _mm512_set1_ps(x[i].d[b]);
        }
        for (int j = 0; j < TILE_COLS; j++) {
            const uint8_t *blk = w[j] + b * 144;
            const __m512 d = _mm512_set1_ps(fp16_at(blk)), dmin = _mm512_set1_ps(fp16_at(blk + 2));
            uint32_t sm[4];
            q4k_unpack(blk + 4, sm);
            const __m128i scales_mins = _mm_loadu_si128((const __m128i *)sm);
            const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(scales_mins));
            const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(scales_mins, 8));
            __m512i wq[4], scv[4];
            for (int p = 0; p < 4; p++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * p));
                wq[p] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), low);
                scv[p] = spread_scales(sc16, 2 * p, 16);
            }
            for (int i = 0; i < m; i++) {
                const int8_t *xq = x[i].q + 256 * b;
                __m512i dot = _mm512_setzero_si512();
                for (int p = 0; p < 4; p++)
                    dot = add_madd16(dot, _mm512_maddubs_epi16(wq[p], _mm512_loadu_si512((const void *)(xq + 64 * p))), scv[p]);
                const __m512i mn = _mm512_zextsi128_si512(_mm_madd_epi16(mins, pairs[i]));
                acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx[i]), _mm512_cvtepi32_ps(dot), acc[i][j]);
                acc[i][j] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx[i]), _mm512_cvtepi32_ps(mn), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

static ALWAYS_INLINE void tile_q6k(const uint8_t *const *w, const act_row *x, int64_t blocks, const int m,
                                   float out[TILE_ROWS][TILE_COLS]) {
    __m512 acc[TILE_ROWS][TILE_COLS];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) acc[i][j] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i sums[TILE_ROWS];
        __m512 dx[TILE_ROWS];
        for (int i = 0; i < m; i++) {
            sums[i] = _mm256_loadu_si256((const __m256i *)(x[i].sums + 16 * b));
            dx[i] = _mm512_set1_ps(x[i].d[b]);
        }
        for (int j = 0; j < TILE_COLS; j++) {
            const uint8_t *blk = w[j] + b * 210;
            const __m512 d = _mm512_set1_ps(fp16_at(blk + 208));
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            __m512i wq[4], scv[4];
            for (int h = 0; h < 2; h++) {
                const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                const __m512i qhz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                wq[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_and_si512(_mm512_slli_epi16(qhz, 4), high));
                wq[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low), _mm512_and_si512(qhz, high));
            }
            for (int g = 0; g < 4; g++) scv[g] = spread_scales(_mm512_castsi256_si512(sc16), 4 * g, 8);
            for (int i = 0; i < m; i++) {
                const int8_t *xq = x[i].q + 256 * b;
                __m512i dot = _mm512_setzero_si512();
                for (int g = 0; g < 4; g++)
                    dot = add_madd16(dot, _mm512_maddubs_epi16(wq[g], _mm512_loadu_si512((const void *)(xq + 64 * g))), scv[g]);
                const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums[i]), 5);
                dot = _mm512_sub_epi32(dot, _mm512_zextsi256_si512(offset));
                acc[i][j] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx[i]), _mm512_cvtepi32_ps(dot), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < TILE_COLS; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif

/* ---------------------------------------------------------------- the interleaved layout
 *
 * `quant_pack` rearranges a weight once (at load) into groups of GROUP = 16 rows (output
 * columns) whose blocks are interleaved, in the same number of bytes; rows past the last whole
 * group stay in the file's layout, at the same offsets (row n at n * row_bytes). Group g holds,
 * for each block position b in turn, GROUP * block_bytes bytes (a "group block"):
 *
 *   Q4_0  d[16] fp16 | nibbles: 4 x 16 words, word (p, j) = bytes 4p..4p+3 of column j's 16
 *   Q4_1  d[16] | m[16] | nibbles as Q4_0
 *   Q8_0  d[16] | 8 x 16 words, word (p, j) = bytes 4p..4p+3 of column j's 32, each byte
 *         XOR 0x80 (the value + 128, unsigned: a byte widens to int16 by a mask or a shift)
 *   Q4_K  d[16] | dmin[16] | 3 x 16 words of the 6-bit scales and mins, word (u, j) = bytes
 *         4u..4u+3 of column j's 12 | 32 x 16 words of nibbles, word (c, j) = bytes 4c..4c+3
 *         of column j's 128
 *   Q6_K  d[16] | 8 x 16 pairs of int8 scales, pair (t, j) = scales 2t, 2t+1 of column j |
 *         for h = 0, 1 and i = 0..7: three runs of 16 words, word j of each = column j's
 *         ql[64h + 4i ..], ql[64h + 32 + 4i ..], qh[32h + 4i ..]
 *
 * so that one 64-byte load holds four consecutive values of each of the 16 columns, the lanes
 * of a vpdpbusd whose other operand is four activation values broadcast, and one load of the
 * group's scales converts to 16 fp32 lanes: the kernels accumulate 16 columns in the lanes of
 * one vector, with no horizontal sums. */
#define GROUP 16

/* Move block b of row n (of N rows, nb blocks each) between the interleaved layout at w and
 * the file's block at blk: to_file 1 copies the layout's bytes into blk, 0 the other way. */
static void move_block(uint8_t *w, int64_t N, int64_t nb, int qtype, int64_t n, int64_t b, uint8_t *blk, int to_file) {
    const int64_t bb = block_bytes(qtype), rb = nb * bb;
    if (n >= N / GROUP * GROUP) {
        if (to_file)
            memcpy(blk, w + n * rb + b * bb, (size_t)bb);
        else
            memcpy(w + n * rb + b * bb, blk, (size_t)bb);
        return;
    }
    uint8_t *g = w + (n / GROUP) * GROUP * rb + b * GROUP * bb;
    const int64_t j = n % GROUP;
#define PIECE(file_off, group_off, size)                                                                           \
    do {                                                                                                           \
        if (to_file)                                                                                               \
            memcpy(blk + (file_off), g + (group_off), (size));                                                     \
        else                                                                                                       \
            memcpy(g + (group_off), blk + (file_off), (size));                                                     \
    } while (0)
    switch (qtype) {
    case QT_Q4_0:
        PIECE(0, 2 * j, 2);
        for (int p = 0; p < 4; p++) PIECE(2 + 4 * p, 32 + (p * GROUP + j) * 4, 4);
        break;
    case QT_Q4_1:
        PIECE(0, 2 * j, 2);
        PIECE(2, 32 + 2 * j, 2);
        for (int p = 0; p < 4; p++) PIECE(4 + 4 * p, 64 + (p * GROUP + j) * 4, 4);
        break;
    case QT_Q8_0:
        PIECE(0, 2 * j, 2);
        for (int p = 0; p < 8; p++) {
            uint8_t *at = to_file ? blk + 2 + 4 * p : g + 32 + (p * GROUP + j) * 4;
            PIECE(2 + 4 * p, 32 + (p * GROUP + j) * 4, 4);
            for (int e = 0; e < 4; e++) at[e] ^= 0x80;
        }
        break;
    case QT_Q4_K:
        PIECE(0, 2 * j, 2);
        PIECE(2, 32 + 2 * j, 2);
        for (int u = 0; u < 3; u++) PIECE(4 + 4 * u, 64 + (u * GROUP + j) * 4, 4);
        for (int c = 0; c < 32; c++) PIECE(16 + 4 * c, 256 + (c * GROUP + j) * 4, 4);
        break;
    default: /* Q6_K */
        PIECE(208, 2 * j, 2);
        for (int t = 0; t < 8; t++) PIECE(192 + 2 * t, 32 + (t * GROUP + j) * 2, 2);
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 8; i++) {
                const int64_t run = 288 + (h * 8 + i) * 3 * GROUP * 4;
                PIECE(64 * h + 4 * i, run + j * 4, 4);
                PIECE(64 * h + 32 + 4 * i, run + (GROUP + j) * 4, 4);
                PIECE(128 + 32 * h + 4 * i, run + (2 * GROUP + j) * 4, 4);
            }
        break;
    }
#undef PIECE
}

/* Between the file's layout (src, N rows of K values) and the interleaved one (dst):
 * to_file 0 packs, 1 unpacks. Returns 2 for an unserved type or K. */
int quant_pack(const uint8_t *src, int64_t N, int64_t K, int qtype, uint8_t *dst, int to_file, int num_threads) {
    if (!quant_linear_serves(qtype) || K % block_values(qtype) != 0) return 2;
    const int64_t nb = K / block_values(qtype), bb = block_bytes(qtype);
    if (num_threads <= 0) num_threads = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K >= (int64_t)1 << 20)
    for (int64_t n = 0; n < N; n++) {
        uint8_t blk[256];
        for (int64_t b = 0; b < nb; b++) {
            if (to_file) {
                move_block((uint8_t *)src, N, nb, qtype, n, b, blk, 1);
                memcpy(dst + (n * nb + b) * bb, blk, (size_t)bb);
            } else {
                memcpy(blk, src + (n * nb + b) * bb, (size_t)bb);
                move_block(dst, N, nb, qtype, n, b, blk, 0);
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- dequantizing
 *
 * The values of one file-layout block, as gguf's numpy dequantization computes them (every
 * product here is exact in fp32 but Q6_K's d * sc * q, rounded once as gguf rounds it, and
 * Q4_1's and Q4_K's one addition: the results are bit-identical to gguf's). */
static ALWAYS_INLINE void dequantize_block(const uint8_t *blk, int qtype, float *out) {
    switch (qtype) {
    case QT_Q4_0: {
        const float d = fp16_at(blk);
        for (int e = 0; e < 16; e++) {
            out[e] = d * (float)((blk[2 + e] & 0xF) - 8);
            out[e + 16] = d * (float)((blk[2 + e] >> 4) - 8);
        }
        break;
    }
    case QT_Q4_1: {
        const float d = fp16_at(blk), m = fp16_at(blk + 2);
        for (int e = 0; e < 16; e++) {
            out[e] = d * (float)(blk[4 + e] & 0xF) + m;
            out[e + 16] = d * (float)(blk[4 + e] >> 4) + m;
        }
        break;
    }
    case QT_Q8_0: {
        const float d = fp16_at(blk);
        for (int e = 0; e < 32; e++) out[e] = d * (float)(int8_t)blk[2 + e];
        break;
    }
    case QT_Q4_K: {
        const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
        for (int s = 0; s < 8; s++) {
            int sc, mn;
            q4k_scale_min(s, blk + 4, &sc, &mn);
            float ds = d * (float)sc, dm = dmin * (float)mn;
            OPAQUE(ds);
            OPAQUE(dm);
            const uint8_t *qs = blk + 16 + 32 * (s / 2);
            const int shift = 4 * (s % 2);
            for (int l = 0; l < 32; l++) out[32 * s + l] = ds * (float)((qs[l] >> shift) & 0xF) - dm;
        }
        break;
    }
    default: { /* Q6_K */
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_at(blk + 208);
        float ds[16];
        for (int t = 0; t < 16; t++) {
            ds[t] = d * (float)sc[t];
            OPAQUE(ds[t]);
        }
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + 32 + l], bits = qh[32 * h + l];
                const int v0 = ((lo & 0xF) | (bits & 3) << 4) - 32, v1 = ((hi & 0xF) | ((bits >> 2) & 3) << 4) - 32;
                const int v2 = ((lo >> 4) | ((bits >> 4) & 3) << 4) - 32, v3 = ((hi >> 4) | ((bits >> 6) & 3) << 4) - 32;
                const int base = 128 * h + l;
                out[base] = ds[base / 16] * (float)v0;
                out[base + 32] = ds[(base + 32) / 16] * (float)v1;
                out[base + 64] = ds[(base + 64) / 16] * (float)v2;
                out[base + 96] = ds[(base + 96) / 16] * (float)v3;
            }
        break;
    }
    }
}

/* One row's blocks, dequantized into out (fp32 or bf16): the type and dtype constant, so the
 * decoding and the rounding vectorise. */
static ALWAYS_INLINE void dequantize_row(const uint8_t *w, int64_t N, int64_t nb, const int QT, int interleaved, int64_t n,
                                         void *out, const int BF16) {
    const int64_t bs = block_values(QT), bb = block_bytes(QT);
    uint8_t blk[256];
    float values[256];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *src = w + (n * nb + b) * bb;
        if (interleaved) {
            move_block((uint8_t *)w, N, nb, QT, n, b, blk, 1);
            src = blk;
        }
        if (BF16) {
            dequantize_block(src, QT, values);
            uint16_t *o = (uint16_t *)out + b * bs;
            for (int64_t e = 0; e < bs; e++) o[e] = float_to_bf16(values[e]);
        } else {
            dequantize_block(src, QT, (float *)out + b * bs);
        }
    }
}

#define DEQ_ROW(QT, BF16) dequantize_row(w, N, nb, QT, interleaved, n, o, BF16)
#define DEQ_TYPES(BF16)                                                                                            \
    switch (qtype) {                                                                                               \
    case QT_Q4_0: DEQ_ROW(QT_Q4_0, BF16); break;                                                                   \
    case QT_Q4_1: DEQ_ROW(QT_Q4_1, BF16); break;                                                                   \
    case QT_Q8_0: DEQ_ROW(QT_Q8_0, BF16); break;                                                                   \
    case QT_Q4_K: DEQ_ROW(QT_Q4_K, BF16); break;                                                                   \
    default: DEQ_ROW(QT_Q6_K, BF16); break;                                                                        \
    }

/* Rows of the weight w (N rows of K values; interleaved: `quant_pack`'s layout, else the
 * file's) into out, fp32 or bf16 (rounded to nearest even) rows out_row_stride elements apart:
 * `count` rows, rows[i] for out row i, or rows 0..count-1 where rows is NULL. Parallel over
 * rows. Returns 2 for an unserved type or K, 3 for a row out of range. */
int quant_dequantize(const uint8_t *w, int64_t N, int64_t K, int qtype, int interleaved, const int64_t *rows,
                     int64_t count, void *out, int64_t out_row_stride, int out_dtype, int num_threads) {
    if (!quant_linear_serves(qtype) || K % block_values(qtype) != 0) return 2;
    if (rows != NULL)
        for (int64_t i = 0; i < count; i++)
            if (rows[i] < 0 || rows[i] >= N) return 3;
    const int64_t nb = K / block_values(qtype);
    if (num_threads <= 0) num_threads = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count * K >= (int64_t)1 << 16)
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = rows != NULL ? rows[i] : i;
        if (out_dtype == DTYPE_BFLOAT16) {
            void *o = (uint16_t *)out + i * out_row_stride;
            DEQ_TYPES(1)
        } else {
            void *o = (float *)out + i * out_row_stride;
            DEQ_TYPES(0)
        }
    }
    return 0;
}
#undef DEQ_TYPES
#undef DEQ_ROW

/* ---------------------------------------------------------------- group kernels
 *
 * Over the interleaved layout: the 16 columns of a group in the lanes of one vector. `V` is 64
 * bytes seen as 16 int32 lanes (lane j: column j), `F` 16 fp32 lanes; each tier gives the few
 * operations the kernels need. The weights of a group block are "chunks" c of 64 bytes, each
 * four values of every column, the values 4c..4c+3 of the block (so its activations are the 4
 * int8 at x + 4c, broadcast; Q8_0's, two pairs of int16): 8 chunks for the 32-blocks, 64 for
 * the K-quants. A chunk's dot product with the activations is exact in int32; per sub-block
 * (K-quants) it is multiplied by the sub-block's integer scale; per block, the integer sum is
 * scaled in fp32, per column:
 *
 *   acc += (d_w * d_x) * dot                       (Q4_1: then acc += m_w * (d_x * sum(q_x)))
 *   Q4_K: acc += (d * d_x) * dot, then acc -= (dmin * d_x) * sum_s(m_s * sum_s(q_x))
 *
 * the same operations, in the same order, for a row alone or in a batch of any size. */
/* unrolled where the chunk index must fold to constants (vector tiers); the portable lanes are
 * loops already, and unrolling them all makes the build take minutes */
#if defined(QL_AVX512) || defined(QL_AVX2)
#define UNROLL_(n) _Pragma(#n)
#define UNROLL(n) UNROLL_(GCC unroll n)
#else
#define UNROLL(n)
#endif
#if defined(QL_AVX512)
typedef __m512i V;
typedef __m512 F;
static ALWAYS_INLINE V v_load(const void *p) { return _mm512_loadu_si512(p); }
static ALWAYS_INLINE V v_and(V a, V b) { return _mm512_and_si512(a, b); }
static ALWAYS_INLINE V v_or(V a, V b) { return _mm512_or_si512(a, b); }
static ALWAYS_INLINE V v_srl(V a, const unsigned n) { return _mm512_srli_epi32(a, n); }
static ALWAYS_INLINE V v_sll(V a, const unsigned n) { return _mm512_slli_epi32(a, n); }
static ALWAYS_INLINE V v_sra(V a, const unsigned n) { return _mm512_srai_epi32(a, n); }
static ALWAYS_INLINE V v_i32(int32_t c) { return _mm512_set1_epi32(c); }
static ALWAYS_INLINE V v_add(V a, V b) { return _mm512_add_epi32(a, b); }
static ALWAYS_INLINE V v_sub(V a, V b) { return _mm512_sub_epi32(a, b); }
static ALWAYS_INLINE V v_mul(V a, V b) { return _mm512_mullo_epi32(a, b); }
static ALWAYS_INLINE V v_s8_to_s16(const void *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static ALWAYS_INLINE int32_t word_at(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
/* acc + per lane the sum of its 4 bytes of w (unsigned, <= 63) times the 4 int8 at x */
static ALWAYS_INLINE V v_dot(V acc, V w, const int8_t *x) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(word_at(x)));
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, _mm512_set1_epi32(word_at(x))), _mm512_set1_epi16(1)));
#endif
}
/* acc + per lane the int16 pair of a times the int16 pair at x */
static ALWAYS_INLINE V v_dot16(V acc, V a, const int16_t *x) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, _mm512_set1_epi32(word_at(x)));
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, _mm512_set1_epi32(word_at(x))));
#endif
}
static ALWAYS_INLINE F f_half(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static ALWAYS_INLINE F f_cvt(V a) { return _mm512_cvtepi32_ps(a); }
static ALWAYS_INLINE F f_set1(float v) { return _mm512_set1_ps(v); }
static ALWAYS_INLINE F f_zero(void) { return _mm512_setzero_ps(); }
static ALWAYS_INLINE F f_mul(F a, F b) {
    F r = _mm512_mul_ps(a, b);
    OPAQUE(r);
    return r;
}
static ALWAYS_INLINE F f_fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
static ALWAYS_INLINE F f_fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
static ALWAYS_INLINE void f_store(float *p, F v) { _mm512_storeu_ps(p, v); }
#elif defined(QL_AVX2)
/* (the integer dot products are k_dots' and q32_dots' own, over one half of V at a time) */
typedef struct { __m256i a, b; } V;
typedef struct { __m256 a, b; } F;
#define V2(expr_a, expr_b) ((V){(expr_a), (expr_b)})
#define F2(expr_a, expr_b) ((F){(expr_a), (expr_b)})
static ALWAYS_INLINE V v_load(const void *p) {
    return V2(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)((const char *)p + 32)));
}
static ALWAYS_INLINE V v_and(V x, V y) { return V2(_mm256_and_si256(x.a, y.a), _mm256_and_si256(x.b, y.b)); }
static ALWAYS_INLINE V v_or(V x, V y) { return V2(_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)); }
static ALWAYS_INLINE V v_srl(V x, const int n) { return V2(_mm256_srli_epi32(x.a, n), _mm256_srli_epi32(x.b, n)); }
static ALWAYS_INLINE V v_sll(V x, const int n) { return V2(_mm256_slli_epi32(x.a, n), _mm256_slli_epi32(x.b, n)); }
static ALWAYS_INLINE V v_sra(V x, const int n) { return V2(_mm256_srai_epi32(x.a, n), _mm256_srai_epi32(x.b, n)); }
static ALWAYS_INLINE V v_i32(int32_t c) { return V2(_mm256_set1_epi32(c), _mm256_set1_epi32(c)); }
static ALWAYS_INLINE V v_add(V x, V y) { return V2(_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)); }
static ALWAYS_INLINE V v_sub(V x, V y) { return V2(_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)); }
static ALWAYS_INLINE V v_s8_to_s16(const void *p) {
    return V2(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)),
              _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((const char *)p + 16))));
}
static ALWAYS_INLINE int32_t word_at(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
static ALWAYS_INLINE V v_dot16(V acc, V y, const int16_t *x) {
    const __m256i xb = _mm256_set1_epi32(word_at(x));
    return V2(_mm256_add_epi32(acc.a, _mm256_madd_epi16(y.a, xb)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(y.b, xb)));
}
static ALWAYS_INLINE F f_half(const void *p) {
    return F2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const char *)p + 16))));
}
static ALWAYS_INLINE F f_cvt(V x) { return F2(_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)); }
static ALWAYS_INLINE F f_set1(float v) { return F2(_mm256_set1_ps(v), _mm256_set1_ps(v)); }
static ALWAYS_INLINE F f_zero(void) { return F2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static ALWAYS_INLINE F f_mul(F x, F y) {
    F r = F2(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b));
    OPAQUE(r.a);
    OPAQUE(r.b);
    return r;
}
static ALWAYS_INLINE F f_fma(F x, F y, F z) { return F2(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
static ALWAYS_INLINE F f_fnma(F x, F y, F z) { return F2(_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)); }
static ALWAYS_INLINE void f_store(float *p, F v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
}
#else
typedef struct { uint32_t l[16]; } V;
typedef struct { float l[16]; } F;
#define V_MAP(expr)                                                                                                \
    V r;                                                                                                           \
    for (int j = 0; j < 16; j++) r.l[j] = (expr);                                                                  \
    return r
static ALWAYS_INLINE V v_load(const void *p) {
    V r;
    memcpy(r.l, p, 64);
    return r;
}
static ALWAYS_INLINE V v_and(V x, V y) { V_MAP(x.l[j] & y.l[j]); }
static ALWAYS_INLINE V v_or(V x, V y) { V_MAP(x.l[j] | y.l[j]); }
static ALWAYS_INLINE V v_srl(V x, const int n) { V_MAP(x.l[j] >> n); }
static ALWAYS_INLINE V v_sll(V x, const int n) { V_MAP(x.l[j] << n); }
static ALWAYS_INLINE V v_sra(V x, const int n) { V_MAP((uint32_t)((int32_t)x.l[j] >> n)); }
static ALWAYS_INLINE V v_i32(int32_t c) { V_MAP((uint32_t)c); }
static ALWAYS_INLINE V v_add(V x, V y) { V_MAP(x.l[j] + y.l[j]); }
static ALWAYS_INLINE V v_sub(V x, V y) { V_MAP(x.l[j] - y.l[j]); }
static ALWAYS_INLINE V v_mul(V x, V y) { V_MAP((uint32_t)((int32_t)x.l[j] * (int32_t)y.l[j])); }
static ALWAYS_INLINE V v_s8_to_s16(const void *p) {
    const int8_t *s = (const int8_t *)p;
    V_MAP((uint32_t)(uint16_t)(int16_t)s[2 * j] | (uint32_t)(uint16_t)(int16_t)s[2 * j + 1] << 16);
}
static ALWAYS_INLINE V v_dot(V acc, V w, const int8_t *x) {
    V_MAP(acc.l[j] + (uint32_t)((int32_t)(w.l[j] & 0xFF) * x[0] + (int32_t)((w.l[j] >> 8) & 0xFF) * x[1] +
                                (int32_t)((w.l[j] >> 16) & 0xFF) * x[2] + (int32_t)(w.l[j] >> 24) * x[3]));
}
static ALWAYS_INLINE V v_dot16(V acc, V y, const int16_t *x) {
    V_MAP(acc.l[j] + (uint32_t)((int16_t)(y.l[j] & 0xFFFF) * x[0] + (int16_t)(y.l[j] >> 16) * x[1]));
}
#undef V_MAP
#define F_MAP(expr)                                                                                                \
    F r;                                                                                                           \
    for (int j = 0; j < 16; j++) {                                                                                 \
        r.l[j] = (expr);                                                                                           \
        OPAQUE(r.l[j]);                                                                                            \
    }                                                                                                              \
    return r
static ALWAYS_INLINE F f_half(const void *p) { F_MAP(fp16_at((const uint8_t *)p + 2 * j)); }
static ALWAYS_INLINE F f_cvt(V x) { F_MAP((float)(int32_t)x.l[j]); }
static ALWAYS_INLINE F f_set1(float v) { F_MAP(v); }
static ALWAYS_INLINE F f_zero(void) { F_MAP(0.0f); }
static ALWAYS_INLINE F f_mul(F x, F y) { F_MAP(x.l[j] * y.l[j]); }
static ALWAYS_INLINE F f_fma(F x, F y, F z) { F_MAP(fmaf(x.l[j], y.l[j], z.l[j])); }
static ALWAYS_INLINE F f_fnma(F x, F y, F z) { F_MAP(fmaf(-x.l[j], y.l[j], z.l[j])); }
static ALWAYS_INLINE void f_store(float *p, F v) { memcpy(p, v.l, 64); }
#undef F_MAP
#endif

static ALWAYS_INLINE V v_bytes(uint8_t c) { return v_i32((int32_t)(0x01010101u * c)); }

/* Chunk c of a group block (see the group kernels' comment): the weights, unsigned. */
static ALWAYS_INLINE V chunk_of(const uint8_t *g, const int QT, const int c) {
    switch (QT) {
    case QT_Q4_0:
    case QT_Q4_1: {
        const V raw = v_load(g + (QT == QT_Q4_0 ? 32 : 64) + 64 * (c & 3));
        return v_and(c < 4 ? raw : v_srl(raw, 4), v_bytes(0x0F));
    }
    case QT_Q8_0: return v_load(g + 32 + 64 * c);
    case QT_Q4_K: {
        const int s = c / 8, i = c % 8;
        const V raw = v_load(g + 256 + 64 * (8 * (s / 2) + i));
        return v_and(s % 2 ? v_srl(raw, 4) : raw, v_bytes(0x0F));
    }
    default: { /* Q6_K: values 128h + 32k + 4i.. = chunk 32h + 8k + i */
        const int h = c / 32, k = (c % 32) / 8, i = c % 8;
        const uint8_t *run = g + 288 + (h * 8 + i) * 3 * 64;
        const V low = v_load(run + (k % 2 ? 64 : 0)), high = v_load(run + 128);
        const V nib = v_and(k < 2 ? low : v_srl(low, 4), v_bytes(0x0F));
        const V top = k == 0 ? v_sll(high, 4) : k == 1 ? v_sll(high, 2) : k == 2 ? high : v_srl(high, 2);
        return v_or(nib, v_and(top, v_bytes(0x30)));
    }
    }
}

/* What a group block's columns share across rows, decoded once. */
typedef struct {
    F d, m;      /* d (K-quants: d); Q4_1: m; Q4_K: dmin */
    V sc[16];    /* K-quants: the sub-block scales, int32 */
    V pairs[8];  /* Q4_K: the mins in int16 pairs (4); Q6_K: the scales in int16 pairs (8) */
} group_head;

static ALWAYS_INLINE void head_of(const uint8_t *g, const int QT, group_head *h) {
    h->d = f_half(g);
    if (QT == QT_Q4_1 || QT == QT_Q4_K) h->m = f_half(g + 32);
    if (QT == QT_Q4_K) {
        const V u0 = v_load(g + 64), u1 = v_load(g + 128), u2 = v_load(g + 192);
        const V s03 = v_and(u0, v_bytes(0x3F)), m03 = v_and(u1, v_bytes(0x3F));
        const V s47 = v_or(v_and(u2, v_bytes(0x0F)), v_sll(v_and(v_srl(u0, 6), v_bytes(0x03)), 4));
        const V m47 = v_or(v_and(v_srl(u2, 4), v_bytes(0x0F)), v_sll(v_and(v_srl(u1, 6), v_bytes(0x03)), 4));
UNROLL(4)
        for (int s = 0; s < 4; s++) {
            h->sc[s] = v_and(v_srl(s03, 8 * s), v_i32(0xFF));
            h->sc[s + 4] = v_and(v_srl(s47, 8 * s), v_i32(0xFF));
        }
        /* bytes (0, 1) and (2, 3) of m03, m47 as int16 pairs */
        h->pairs[0] = v_or(v_and(m03, v_i32(0xFF)), v_and(v_sll(m03, 8), v_i32(0xFF0000)));
        h->pairs[1] = v_or(v_and(v_srl(m03, 16), v_i32(0xFF)), v_and(v_srl(m03, 8), v_i32(0xFF0000)));
        h->pairs[2] = v_or(v_and(m47, v_i32(0xFF)), v_and(v_sll(m47, 8), v_i32(0xFF0000)));
        h->pairs[3] = v_or(v_and(v_srl(m47, 16), v_i32(0xFF)), v_and(v_srl(m47, 8), v_i32(0xFF0000)));
    }
    if (QT == QT_Q6_K)
UNROLL(8)
        for (int t = 0; t < 8; t++) {
            h->pairs[t] = v_s8_to_s16(g + 32 + 32 * t);
            h->sc[2 * t] = v_sra(v_sll(h->pairs[t], 16), 16);
            h->sc[2 * t + 1] = v_sra(h->pairs[t], 16);
        }
}

/* The sub-block dot products of one K-quant group block for M rows (1..4), each sub-block's
 * chunks decoded once for all of them: dot[i] = sum over sub-blocks s of s's integer scale
 * times the dot of its chunks with row i's activations (exact in int32, so any order of the
 * integer sums gives the same dot). */
#if defined(QL_AVX2)
/* AVX2 has 16 vector registers, and a 16-lane V takes two: four rows' sums, a sub-block's
 * chunks and its scales do not fit at once. So one half of the group's columns (8 lanes) at a
 * time, and the chunks' byte products summed in int16 (vpmaddubsw, vpaddw) over K_RUN chunks,
 * then widened against the sub-block's scale by one vpmaddwd: one multiply per 32 products,
 * where v_dot and v_mul take two and a 32-bit multiply per sub-block. K_RUN is as many chunks
 * as an int16 lane can sum without overflow, the activations being within +-127: Q4_K
 * 8 x 2 x 15 x 127 = 30480, Q6_K 2 x 2 x 63 x 127 = 32004. */
/* Two ways the AVX2 paths below steer GCC. A row's activations behind `opaque_row` are new to
 * the compiler in each half's pass: else it computes their broadcasts once for both halves,
 * before the loop, and keeps all of them on the stack. Each running sum goes through OPAQUE,
 * so it is summed in the order written: else the compiler makes a tree of the sums, computing
 * every product first, and spills them. */
static ALWAYS_INLINE const int8_t *opaque_row(const int8_t *p) {
    __asm__("" : "+r"(p));
    return p;
}
#define K_RUN(QT) ((QT) == QT_Q4_K ? 8 : 2)
static ALWAYS_INLINE void k_dots(const uint8_t *blk, const group_head *h, const act_row *x, int64_t b, const int M,
                                 const int QT, V dot[4]) {
    const int subs = QT == QT_Q4_K ? 8 : 16, per = 64 / subs, run = K_RUN(QT);
#pragma GCC unroll 1
    for (int hi = 0; hi < 2; hi++) {
        const uint8_t *half = blk + 32 * hi; /* a chunk's half: the first 32 of its 64 bytes here */
        __m256i sum[4];
        const int8_t *xq[4];
UNROLL(4)
        for (int i = 0; i < M; i++) {
            sum[i] = _mm256_setzero_si256();
            xq[i] = opaque_row(x[i].q + 256 * b);
        }
UNROLL(16)
        for (int s = 0; s < subs; s++) {
            /* the scale as an int16 pair in each lane (Q6_K's are signed) */
            const __m256i sc = ((const __m256i *)&h->sc[s])[hi];
            const __m256i sc16 = _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16));
UNROLL(4)
            for (int c0 = 0; c0 < per; c0 += run) {
                __m256i part[4];
UNROLL(8)
                for (int c = c0; c < c0 + run; c++) {
                    const __m256i w = chunk_of(half, QT, per * s + c).a;
UNROLL(4)
                    for (int i = 0; i < M; i++) {
                        const __m256i xb = _mm256_set1_epi32(word_at(xq[i] + 4 * (per * s + c)));
                        const __m256i products = _mm256_maddubs_epi16(w, xb);
                        part[i] = c == c0 ? products : _mm256_add_epi16(part[i], products);
                        OPAQUE(part[i]);
                    }
                }
UNROLL(4)
                for (int i = 0; i < M; i++) {
                    sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(part[i], sc16));
                    OPAQUE(sum[i]);
                }
            }
        }
UNROLL(4)
        for (int i = 0; i < M; i++) ((__m256i *)&dot[i])[hi] = sum[i];
    }
}
#else
static ALWAYS_INLINE void k_dots(const uint8_t *blk, const group_head *h, const act_row *x, int64_t b, const int M,
                                 const int QT, V dot[4]) {
    const int subs = QT == QT_Q4_K ? 8 : 16, per = 64 / subs; /* sub-blocks, chunks in each */
UNROLL(4)
    for (int i = 0; i < M; i++) dot[i] = v_i32(0);
UNROLL(16)
    for (int s = 0; s < subs; s++) {
        V chunk[8];
UNROLL(8)
        for (int c = 0; c < per; c++) chunk[c] = chunk_of(blk, QT, per * s + c);
UNROLL(4)
        for (int i = 0; i < M; i++) {
            const int8_t *xq = x[i].q + 256 * b + 4 * per * s;
            V part = v_i32(0);
UNROLL(8)
            for (int c = 0; c < per; c++) part = v_dot(part, chunk[c], xq + 4 * c);
            dot[i] = v_add(dot[i], v_mul(part, h->sc[s]));
        }
    }
}
#endif

/* One row's contribution of one K-quant group block, from its sub-block dot product: acc
 * updated (Q4_K: less the mins' term; Q6_K: less the offset of 32). */
static ALWAYS_INLINE F k_block(V dot, const group_head *h, const act_row *x, int64_t b, const int QT, F acc) {
    const F dx = f_set1(x->d[b]);
    if (QT == QT_Q4_K) {
        V mins = v_i32(0);
        for (int t = 0; t < 4; t++) mins = v_dot16(mins, h->pairs[t], x->sums32 + 8 * b + 2 * t);
        acc = f_fma(f_mul(h->d, dx), f_cvt(dot), acc);
        return f_fnma(f_mul(h->m, dx), f_cvt(mins), acc);
    }
    V offset = v_i32(0); /* sum_t sc_t * sum_t(q_x): the 32 of q - 32 */
    for (int t = 0; t < 8; t++) offset = v_dot16(offset, h->pairs[t], x->sums + 16 * b + 2 * t);
    dot = v_sub(dot, v_sll(offset, 5));
    return f_fma(f_mul(h->d, dx), f_cvt(dot), acc);
}

/* The dot products of one 32-value group block (Q4_0, Q4_1, Q8_0) for M rows (1..4), its
 * chunks decoded once for all of them, exact in int32 (less the activations' sum times Q4_0's 8
 * of q - 8, or times the 128 Q8_0's layout adds to q). */
#if defined(QL_AVX2)
/* As k_dots: one half of the columns at a time, each sum in a register. Q4_0 and Q4_1 sum a
 * block's byte products in int16 (8 x 2 x 15 x 127 = 30480) and widen them once. Q8_0's bytes
 * (q + 128) widen to int16 pairs, the even ones by a mask and the odd ones by a shift, each
 * multiplied by a pair of int16 activations (vpmaddwd) and summed in int32, less 128 x the
 * activations' sum. */
static ALWAYS_INLINE void q32_dots(const uint8_t *blk, const act_row *x, int64_t b, const int M, const int QT, V dot[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 1
    for (int hi = 0; hi < 2; hi++) {
        const uint8_t *half = blk + 32 * hi;
        __m256i sum[4];
        const int8_t *xq[4]; /* Q8_0: its int16 activations, as bytes */
UNROLL(4)
        for (int i = 0; i < M; i++) {
            const int32_t offset = QT == QT_Q4_0 ? -8 : QT == QT_Q8_0 ? -128 : 0;
            sum[i] = _mm256_set1_epi32(offset * x[i].isum[b]);
            xq[i] = opaque_row(QT == QT_Q8_0 ? (const int8_t *)(x[i].q16 + 32 * b) : x[i].q + 32 * b);
        }
        __m256i part[4];
UNROLL(8)
        for (int c = 0; c < 8; c++) {
            const __m256i w = chunk_of(half, QT, c).a;
            /* Q8_0's bytes as int16 pairs */
            const __m256i even = _mm256_and_si256(w, _mm256_set1_epi16(0xFF)), odd = _mm256_srli_epi16(w, 8);
UNROLL(4)
            for (int i = 0; i < M; i++) {
                if (QT == QT_Q8_0) {
                    const __m256i x02 = _mm256_set1_epi32(word_at(xq[i] + 8 * c)), x13 = _mm256_set1_epi32(word_at(xq[i] + 8 * c + 4));
                    sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(even, x02));
                    sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(odd, x13));
                    OPAQUE(sum[i]);
                } else {
                    const __m256i xb = _mm256_set1_epi32(word_at(xq[i] + 4 * c));
                    const __m256i products = _mm256_maddubs_epi16(w, xb);
                    part[i] = c == 0 ? products : _mm256_add_epi16(part[i], products);
                    OPAQUE(part[i]);
                }
            }
        }
UNROLL(4)
        for (int i = 0; i < M; i++) {
            if (QT != QT_Q8_0) sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(part[i], ones));
            ((__m256i *)&dot[i])[hi] = sum[i];
        }
    }
}
#else
static ALWAYS_INLINE void q32_dots(const uint8_t *blk, const act_row *x, int64_t b, const int M, const int QT, V dot[4]) {
    V chunk[8], odd[8]; /* Q8_0: chunk's even bytes, then its odd ones, as int16 pairs */
UNROLL(8)
    for (int c = 0; c < 8; c++) {
        chunk[c] = chunk_of(blk, QT, c);
        if (QT == QT_Q8_0) {
            odd[c] = v_and(v_srl(chunk[c], 8), v_i32(0x00FF00FF));
            chunk[c] = v_and(chunk[c], v_i32(0x00FF00FF));
        }
    }
UNROLL(4)
    for (int i = 0; i < M; i++) {
        const int8_t *xq = x[i].q + 32 * b;
        const int16_t *xw = x[i].q16 + 32 * b;
        V d = QT == QT_Q4_0 ? v_i32(-8 * x[i].isum[b]) : QT == QT_Q8_0 ? v_i32(-128 * x[i].isum[b]) : v_i32(0);
UNROLL(8)
        for (int c = 0; c < 8; c++)
            d = QT == QT_Q8_0 ? v_dot16(v_dot16(d, chunk[c], xw + 4 * c), odd[c], xw + 4 * c + 2) : v_dot(d, chunk[c], xq + 4 * c);
        dot[i] = d;
    }
}
#endif

/* One row's contribution of one 32-value group block, from its dot product: acc updated. */
static ALWAYS_INLINE F q32_block(V dot, const group_head *h, const act_row *x, int64_t b, const int QT, F acc) {
    acc = f_fma(f_mul(h->d, f_set1(x->d[b])), f_cvt(dot), acc);
    if (QT == QT_Q4_1) acc = f_fma(h->m, f_set1(x->s[b]), acc);
    return acc;
}

/* M rows (1..4) of one group, their sums kept in registers across the blocks, each block's
 * chunks decoded once for all of them. (Summing in memory would store and reload every row's
 * sums at each block: for the 32-value formats, blocks of only 8 dot products, that round trip,
 * not the arithmetic, would set the pace; a decode row of Q8_0 is two such rows.) The weights
 * are prefetched PREFETCH_BYTES ahead: one core's hardware prefetcher alone leaves the K-quants'
 * long blocks waiting on memory. */
#define PREFETCH_BYTES 4096
static ALWAYS_INLINE void group_rows_m(const uint8_t *g, const act_row *x, int64_t blocks, const int M, const int QT,
                                       float out[][GROUP]) {
    const int64_t gb = GROUP * block_bytes(QT);
    F acc[4];
UNROLL(4)
    for (int i = 0; i < M; i++) acc[i] = f_zero();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = g + b * gb;
        for (int64_t o = 0; o < gb; o += 64) __builtin_prefetch(blk + PREFETCH_BYTES + o);
        group_head h;
        head_of(blk, QT, &h);
        const int k_quant = QT == QT_Q4_K || QT == QT_Q6_K;
        V dot[4];
        if (k_quant)
            k_dots(blk, &h, x, b, M, QT, dot);
        else
            q32_dots(blk, x, b, M, QT, dot);
UNROLL(4)
        for (int i = 0; i < M; i++)
            acc[i] = k_quant ? k_block(dot[i], &h, x + i, b, QT, acc[i]) : q32_block(dot[i], &h, x + i, b, QT, acc[i]);
    }
UNROLL(4)
    for (int i = 0; i < M; i++) f_store(out[i], acc[i]);
}

/* m rows (1..GROUP_ROWS) of one group: out[i][j] = row i's sum for column j. */
#define GROUP_ROWS 16
static ALWAYS_INLINE void group_rows(const uint8_t *g, const act_row *x, int64_t blocks, int m, const int QT,
                                     float out[GROUP_ROWS][GROUP]) {
    for (int r0 = 0; r0 < m; r0 += 4) {
        switch (m - r0 < 4 ? m - r0 : 4) {
        case 1: group_rows_m(g, x + r0, blocks, 1, QT, out + r0); break;
        case 2: group_rows_m(g, x + r0, blocks, 2, QT, out + r0); break;
        case 3: group_rows_m(g, x + r0, blocks, 3, QT, out + r0); break;
        default: group_rows_m(g, x + r0, blocks, 4, QT, out + r0); break;
        }
    }
}

static __attribute__((noinline)) void group_kernel(int qtype, const uint8_t *g, const act_row *x, int64_t blocks, int m,
                                                   float out[GROUP_ROWS][GROUP]) {
    switch (qtype) {
    case QT_Q4_0: group_rows(g, x, blocks, m, QT_Q4_0, out); break;
    case QT_Q4_1: group_rows(g, x, blocks, m, QT_Q4_1, out); break;
    case QT_Q8_0: group_rows(g, x, blocks, m, QT_Q8_0, out); break;
    case QT_Q4_K: group_rows(g, x, blocks, m, QT_Q4_K, out); break;
    default: group_rows(g, x, blocks, m, QT_Q6_K, out); break;
    }
}

/* ---------------------------------------------------------------- the driver */

/* One tile: m rows (1..TILE_ROWS) by the TILE_COLS columns at w (each a weight row). */
static ALWAYS_INLINE void tile_of(int qtype, const uint8_t *const *w, const act_row *x, int64_t blocks, const int m,
                                  float out[TILE_ROWS][TILE_COLS]) {
    switch (qtype) {
    case QT_Q4_0: tile_q32(w, x, blocks, m, QT_Q4_0, out); break;
    case QT_Q4_1: tile_q32(w, x, blocks, m, QT_Q4_1, out); break;
    case QT_Q8_0: tile_q32(w, x, blocks, m, QT_Q8_0, out); break;
    case QT_Q4_K: tile_q4k(w, x, blocks, m, out); break;
    default: tile_q6k(w, x, blocks, m, out); break;
    }
}

/* out of line per row count, so each copy has its constant m */
#define TILE_M(M)                                                                                                  \
    static __attribute__((noinline)) void tile_##M(int qtype, const uint8_t *const *w, const act_row *x,            \
                                                   int64_t blocks, float out[TILE_ROWS][TILE_COLS]) {              \
        tile_of(qtype, w, x, blocks, M, out);                                                                      \
    }
TILE_M(1) TILE_M(2) TILE_M(3) TILE_M(4)
#undef TILE_M

static void tile(int qtype, const uint8_t *const *w, const act_row *x, int64_t blocks, int m,
                 float out[TILE_ROWS][TILE_COLS]) {
    switch (m) {
    case 1: tile_1(qtype, w, x, blocks, out); break;
    case 2: tile_2(qtype, w, x, blocks, out); break;
    case 3: tile_3(qtype, w, x, blocks, out); break;
    default: tile_4(qtype, w, x, blocks, out); break;
    }
}

/* y = x @ W^T + bias (see the top of the file). w: the file's layout, or (interleaved 1)
 * `quant_pack`'s. Returns 0, 1 when the scratch could not be allocated, 2 for an unserved type
 * or a K that is not a multiple of its block. */
int quant_linear(const void *x, int64_t x_row_stride, int64_t M, int64_t K, const uint8_t *w, int64_t N, int qtype,
                 int interleaved, const float *bias, void *y, int64_t y_row_stride, int x_dtype, int y_dtype,
                 int num_threads) {
    if (!quant_linear_serves(qtype) || K % block_values(qtype) != 0) return 2;
    if (M <= 0 || N <= 0) return 0;
    const int64_t bs = block_values(qtype), blocks = K / bs, row_bytes = blocks * block_bytes(qtype);
    const int64_t act_bytes = act_row_bytes(qtype, K), values_bytes = K * act_value_bytes(qtype);
    uint8_t *scratch = aligned_alloc(64, (size_t)scratch_bytes(qtype, M, K) / 64 * 64 + 64);
    if (scratch == NULL) return 1;
    if (num_threads <= 0) num_threads = omp_get_max_threads();
    const int64_t x_elem = element_size(x_dtype);
    /* work items: the groups of the interleaved layout (GROUP columns each), then chunks of
     * CHUNK columns of the rest (all of N in the file's layout) */
    const int64_t groups = interleaved ? N / GROUP : 0, rest = groups * GROUP;
    const int64_t slices = M < num_threads ? (num_threads + M - 1) / M : 1;
    const int64_t items = groups + (N - rest + CHUNK - 1) / CHUNK;
#pragma omp parallel num_threads(num_threads) if (M * N * K >= (int64_t)1 << 18)
    {
        /* each row's blocks in `slices` runs (fewer rows than threads: a row split between them) */
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < M * slices; unit++) {
            const int64_t r = unit / slices, slice = unit % slices;
            const int64_t b0 = blocks * slice / slices, b1 = blocks * (slice + 1) / slices;
            const void *row = (const char *)x + r * x_row_stride * x_elem;
            quantize_blocks(row, x_dtype, K, bs, b0, b1, scratch + r * act_bytes, qtype == QT_Q8_0);
        }
        /* implicit barrier: every row quantized */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            if (item < groups) {
                const int64_t n0 = item * GROUP;
                for (int64_t r0 = 0; r0 < M; r0 += GROUP_ROWS) {
                    const int m = M - r0 < GROUP_ROWS ? (int)(M - r0) : GROUP_ROWS;
                    act_row rows[GROUP_ROWS];
                    for (int i = 0; i < m; i++) rows[i] = act_at(scratch, act_bytes, values_bytes, blocks, r0 + i);
                    _Alignas(64) float sums[GROUP_ROWS][GROUP];
                    group_kernel(qtype, w + n0 * row_bytes, rows, blocks, m, sums);
                    for (int i = 0; i < m; i++)
                        for (int j = 0; j < GROUP; j++) {
                            float v = sums[i][j];
                            if (bias != NULL) v += bias[n0 + j];
                            store_element(y, (r0 + i) * y_row_stride + n0 + j, v, y_dtype);
                        }
                }
                continue;
            }
            const int64_t n0 = rest + (item - groups) * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
            for (int64_t r0 = 0; r0 < M; r0 += TILE_ROWS) {
                const int m = M - r0 < TILE_ROWS ? (int)(M - r0) : TILE_ROWS;
                act_row rows[TILE_ROWS];
                for (int i = 0; i < m; i++) rows[i] = act_at(scratch, act_bytes, values_bytes, blocks, r0 + i);
                for (int64_t c0 = n0; c0 < n1; c0 += TILE_COLS) {
                    /* columns past N repeat the last one; their sums are dropped */
                    const uint8_t *cols[TILE_COLS];
                    for (int j = 0; j < TILE_COLS; j++) cols[j] = w + (c0 + j < N ? c0 + j : N - 1) * row_bytes;
                    float sums[TILE_ROWS][TILE_COLS];
                    tile(qtype, cols, rows, blocks, m, sums);
                    for (int i = 0; i < m; i++)
                        for (int j = 0; j < TILE_COLS && c0 + j < n1; j++) {
                            float v = sums[i][j];
                            if (bias != NULL) v += bias[c0 + j];
                            store_element(y, (r0 + i) * y_row_stride + c0 + j, v, y_dtype);
                        }
                }
            }
        }
    }
    free(scratch);
    return 0;
}
