/* Causal prefill attention on the CPU: the new tokens of one request attend over its paged
 * context (cached prefix + themselves), flash-attention style, with tiles of scores held in
 * vector registers.
 *
 * Built and loaded at run time by radixserve/kernels/cpu.py, once per ISA tier. torch's CPU
 * flash attention runs the two matmuls of each block through a gemm call on buffers in memory
 * (on AMX tiles where the CPU has them, for bf16); this kernel keeps a tile of query rows x keys
 * of scores in registers. A build has one of two tiles, chosen by its ISA flags:
 *   - AVX-512 (`attend_tile`): TR query rows x 64 keys of scores and TR x D outputs in zmm
 *     registers; bf16 through the AVX-512 BF16 pair dot product vdpbf16ps, or, in a build
 *     without AVX-512 BF16, widened to fp32.
 *   - AVX2 + FMA (`attend_tile_avx2`): 16 ymm registers hold only 6 rows x 16 keys of scores,
 *     so a block's scores and the tile's outputs live in small L1 buffers; bf16 is widened to
 *     fp32.
 * Which head sizes and dtypes a build serves is `tile_serves`: only where it beats torch's
 * flash attention on a CPU of that tier.
 *
 * Element types: q and out are the compute dtype (`dtype`: fp32 or bf16); the pools are the KV
 * cache's format (`kv`, dtypes.h): fp32, bf16, or an 8-bit one (fp8_e4m3, fp8_e5m2, int8 with
 * an fp16 scale per token and kv head in k/v_scales [slots, Hkv]). The repacking below is
 * where the pools are read, so it is where 8-bit pools are dequantized, exactly, into the
 * fp32 words the non-bf16 tiles read (int8: each element times its row's scale); the tiles
 * themselves never see a format but fp32 words or (AVX-512 BF16, bf16 queries over a bf16
 * pool) bf16 pairs.
 *
 * Layouts (row-major):
 *   q    [E, H, D]        the new tokens' queries, rows q_row_stride elements apart
 *   out  [E, H, D]        contiguous
 *   k_pool/v_pool [slots, Hkv, D]  slot = page * page_size + offset; the new tokens' K/V are
 *                                  already stored (positions prefix_len .. prefix_len + E - 1)
 *   k/v_scales [slots, Hkv]        int8 pools only: each row's fp16 scale (NULL otherwise)
 *   pages                 the request's page ids, in order
 *   positions [E] or NULL the new tokens' positions, ascending (scattered queries: a selective
 *                         recompute); NULL = prefix_len .. prefix_len + E - 1. A new token at
 *                         position p sees positions 0 .. p, every one already stored
 *
 * Numerics follow torch's flash attention: q.k summed in fp32 then scaled, an online softmax
 * in fp32, fp32 accumulators, the output rounded once; for bf16 the probabilities are rounded
 * to bf16 before the product with V, as torch does. Only the summation order differs.
 *
 * Work: for each kv head, K is repacked once as K^T ([S/64][W][64] 32-bit words, where a word
 * is one fp32 element or, for bf16, the pair (d, d+1), W = D or D/2 words per key) and V is
 * gathered into one contiguous block (bf16: key pairs interleaved, [S/2][D] words of
 * (V[j][d], V[j+1][d]), the layout of the bf16 dot product vdpbf16ps). A tile without bf16
 * arithmetic gets bf16 K and V widened to fp32 words instead, and so does any pool whose format
 * is not the queries' (8-bit ones dequantized, an fp32 pool under bf16 queries as it is, a
 * bf16 pool under fp32 queries widened). A task is TR query rows of one
 * kv head (rows are (position, head of the group) pairs); it walks the keys in blocks of 64:
 * scores, online softmax, probabilities to a small buffer, then the outputs gain P.V.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

#define KEY_BLOCK 64

/* A build's tile: AVX-512 where the build has AVX-512F (the AVX2 tile, measured there, beat
 * torch in no case the AVX-512 tile leaves to torch), else AVX2 + FMA; the portable build (and
 * aarch64) has none and serves nothing. */
#if defined(__AVX512F__)
#define AVX512_TILE 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define AVX2_TILE 1
#include "avx2.h"
#endif

/* Whether this build's tile serves the head size, compute dtype and KV format: only where it
 * beats torch's flash attention with torch capped to the build's tier (RADIXSERVE_CPU_ISA);
 * `python -m bench.cpu_kernels --isa TIER` measures it:
 *   - AVX-512 BF16: bf16 at 64 and 128; fp32 at 64 (at 128, with 3 rows per tile to keep
 *     their outputs in registers, torch is faster).
 *   - AVX-512 without BF16: fp32 at 64; bf16 at 64, widened. At 128 neither beats torch (in
 *     the AVX2 tile neither).
 *   - AVX2: fp32 and bf16 at 64 and 128.
 * A pool whose format is not the compute dtype (8-bit, or mixed) is packed into fp32 words:
 * served where the fp32-word tile is, at 64 with AVX-512 and at 64 and 128 with AVX2. */
static int tile_serves(int64_t D, int dtype, int kv) {
    if (dtype != DTYPE_FLOAT32 && dtype != DTYPE_BFLOAT16) return 0;
    if (kv < DTYPE_FLOAT32 || kv > DTYPE_INT8) return 0;
#if defined(AVX512_TILE) && defined(__AVX512BF16__)
    return D == 64 || (D == 128 && dtype == DTYPE_BFLOAT16 && kv == DTYPE_BFLOAT16);
#elif defined(AVX512_TILE)
    return D == 64;
#elif defined(AVX2_TILE)
    return D == 64 || D == 128;
#else
    (void)D;
    return 0;
#endif
}

/* Over a pool of the compute dtype (the call before 8-bit KV formats). */
int prefill_attention_supported(int64_t head_dim, int dtype) { return tile_serves(head_dim, dtype, dtype); }
int prefill_attention_supported_kv(int64_t head_dim, int dtype, int kv) { return tile_serves(head_dim, dtype, kv); }

#if defined(AVX512_TILE) || defined(AVX2_TILE)
typedef struct {
    const void *q;
    int64_t q_row_stride;
    void *out;
    int64_t H, Hkv, D, G;
    int64_t prefix_len;
    const int64_t *positions; /* NULL: new token i sits at prefix_len + i */
    float scale;
    const uint32_t *k_packed, *v_packed; /* per kv head: see pack_keys / pack_values */
    int64_t head_stride;                 /* words of one head's packed K (and of its V) */
} Call;

/* Row (slot, h) of a pool of format KV as D fp32 values, exactly kv_quant.dequantize's (int8:
 * each element times the row's scale, an exact product). Inlined with a constant KV. */
static inline __attribute__((always_inline)) void dequantize_row_kv(const void *pool, const uint16_t *scales,
                                                                    int64_t slot, int64_t Hkv, int64_t h,
                                                                    int64_t D, float *dst, const int KV) {
    const int64_t offset = (slot * Hkv + h) * D;
    const float s = row_scale(scales, KV, slot, Hkv, h);
    for (int64_t d = 0; d < D; d++) dst[d] = KV == DTYPE_INT8 ? load_element(pool, offset + d, KV) * s
                                                               : load_element(pool, offset + d, KV);
}

static void dequantize_row(const void *pool, const uint16_t *scales, int kv, int64_t slot, int64_t Hkv,
                           int64_t h, int64_t D, float *dst) {
    switch (kv) {
    case DTYPE_BFLOAT16: dequantize_row_kv(pool, scales, slot, Hkv, h, D, dst, DTYPE_BFLOAT16); break;
    case DTYPE_FP8_E4M3: dequantize_row_kv(pool, scales, slot, Hkv, h, D, dst, DTYPE_FP8_E4M3); break;
    case DTYPE_FP8_E5M2: dequantize_row_kv(pool, scales, slot, Hkv, h, D, dst, DTYPE_FP8_E5M2); break;
    case DTYPE_INT8: dequantize_row_kv(pool, scales, slot, Hkv, h, D, dst, DTYPE_INT8); break;
    default: dequantize_row_kv(pool, scales, slot, Hkv, h, D, dst, DTYPE_FLOAT32); break;
    }
}

/* K of kv head h as [ceil(S/64)][W][64] words, W = the words of one key row (zero past S).
 * `packed` is the dtype of the words: the pool's format `kv` (fp32, or bf16 pairs), or fp32
 * for any other (bf16 widened, 8-bit dequantized with `scales`). */
static void pack_keys(const void *k_pool, const uint16_t *scales, const int64_t *slots, int64_t S, int64_t Hkv,
                      int64_t h, int64_t D, int kv, int packed, uint32_t *dst) {
    const int64_t words = D * element_size(packed) / 4, blocks = (S + KEY_BLOCK - 1) / KEY_BLOCK;
    memset(dst, 0, blocks * words * KEY_BLOCK * sizeof(uint32_t));
    float row[D];
    for (int64_t j = 0; j < S; j++) {
        uint32_t *col = dst + (j / KEY_BLOCK) * words * KEY_BLOCK + j % KEY_BLOCK;
        if (packed != kv) {
            dequantize_row(k_pool, scales, kv, slots[j], Hkv, h, D, row);
            for (int64_t d = 0; d < D; d++) memcpy(col + d * KEY_BLOCK, row + d, sizeof(float));
        } else {
            const uint32_t *stored = (const uint32_t *)((const char *)k_pool + (slots[j] * Hkv + h) * D * element_size(kv));
            for (int64_t w = 0; w < words; w++) col[w * KEY_BLOCK] = stored[w];
        }
    }
}

/* V of kv head h, contiguous and zero past S: fp32 as [S][D]; bf16 as [S/2][D] words, word
 * (j/2, d) = V[j][d] | V[j+1][d] << 16. `packed` as for pack_keys. */
static void pack_values(const void *v_pool, const uint16_t *scales, const int64_t *slots, int64_t S, int64_t Hkv,
                        int64_t h, int64_t D, int kv, int packed, uint32_t *dst) {
    const int64_t padded = (S + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    memset(dst, 0, padded * D * element_size(packed));
    for (int64_t j = 0; j < S; j++) {
        const char *row = (const char *)v_pool + (slots[j] * Hkv + h) * D * element_size(kv);
        if (packed == DTYPE_BFLOAT16) {
            uint16_t *pairs = (uint16_t *)(dst + (j / 2) * D) + (j % 2);
            for (int64_t d = 0; d < D; d++) pairs[2 * d] = ((const uint16_t *)row)[d];
        } else if (kv != DTYPE_FLOAT32) {
            float values[D];
            dequantize_row(v_pool, scales, kv, slots[j], Hkv, h, D, values);
            memcpy(dst + j * D, values, D * sizeof(float));
        } else {
            memcpy(dst + j * D, row, D * sizeof(float));
        }
    }
}

/* Query row `row` (of kv head h's G * E rows): its token's position among the new ones and
 * its query head. */
static inline int64_t row_position(const Call *c, int64_t row) { return row / c->G; }
static inline int64_t row_head(const Call *c, int64_t h, int64_t row) { return h * c->G + row % c->G; }
/* Keys 0 .. row_limit - 1 are visible to the new token `pos`: those up to its own position. */
static inline int64_t row_limit(const Call *c, int64_t pos) {
    return (c->positions ? c->positions[pos] : c->prefix_len + pos) + 1;
}
#endif

#if defined(AVX512_TILE)
/* A task's query rows: its TR x 4 score vectors and TR x D/16 output vectors stay in
 * registers. TR is 6 for head size 64, 3 for head size 128. */
#define MAX_TILE_ROWS 6
#define MAX_CHUNKS 8 /* D / 16 */

__m512 _ZGVeN16v_expf(__m512 x); /* glibc's libmvec: expf of 16 lanes */

/* acc + a * b for 32-bit words of the packed dtype PT: fp32 elements, or bf16 pairs
 * (acc + a.low * b.low + a.high * b.high, the AVX-512 BF16 dot product). */
static inline __attribute__((always_inline)) __m512 fma_words(__m512 acc, __m512i a, __m512i b, const int PT) {
#if defined(__AVX512BF16__)
    if (PT == DTYPE_BFLOAT16) return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#endif
    (void)PT;
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
}

/* 16 fp32 values rounded to nearest even bf16 (as torch's float -> bfloat16; never NaN here). */
static inline __attribute__((always_inline)) __m256i round_bf16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

/* A row's 64 weights w as the product with V reads them: bf16 pairs (PT bf16); for bf16
 * widened to fp32, fp32 values rounded to bf16, as torch's bf16 P.V takes them; else fp32. */
static inline __attribute__((always_inline)) void store_weights(uint32_t *p, const __m512 *w, const int DT,
                                                                const int PT) {
#if defined(__AVX512BF16__)
    if (PT == DTYPE_BFLOAT16) {
        _mm512_store_si512(p, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
        _mm512_store_si512(p + 16, (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]));
        return;
    }
#endif
    (void)PT;
    for (int i = 0; i < 4; i++) {
        if (DT == DTYPE_BFLOAT16)
            _mm512_store_si512(p + 16 * i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(round_bf16(w[i])), 16));
        else
            _mm512_store_ps(p + 16 * i, w[i]);
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
 * rows. CH = D / 16, TR, DT (the dtype) and PT (the packed K and V's: DT, or fp32 for bf16
 * widened) are constants in each inlined copy. */
static inline __attribute__((always_inline)) void attend_tile(const Call *c, int64_t h, int64_t row0,
                                                              int rows, const int CH, const int TR,
                                                              const int DT, const int PT) {
    const int64_t D = c->D, words = PT == DTYPE_BFLOAT16 ? D / 2 : D;
    const uint32_t *kp = c->k_packed + h * c->head_stride, *vp = c->v_packed + h * c->head_stride;
    const uint32_t *qrow[MAX_TILE_ROWS]; /* a query row as 32-bit words, like the packed K */
    uint32_t wide[MAX_TILE_ROWS][MAX_CHUNKS * 16] __attribute__((aligned(64))); /* bf16 rows widened */
    int64_t limit[MAX_TILE_ROWS];        /* keys 0 .. limit - 1 are visible to the row */
    for (int r = 0; r < TR; r++) {
        const int64_t row = row0 + (r < rows ? r : rows - 1), pos = row_position(c, row);
        qrow[r] = (const uint32_t *)((const char *)c->q + (pos * c->q_row_stride + row_head(c, h, row) * D) * element_size(DT));
        if (PT != DT) {
            for (int ch = 0; ch < CH; ch++) {
                const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)qrow[r] + 16 * ch));
                _mm512_store_si512(wide[r] + 16 * ch, _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
            }
            qrow[r] = wide[r];
        }
        limit[r] = row_limit(c, pos);
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
                for (int i = 0; i < 4; i++) s[r * 4 + i] = fma_words(s[r * 4 + i], qw, kv[i], PT);
            }
        }
        for (int r = 0; r < TR; r++) {
            __m512 w[4];
            softmax_step(s + r * 4, limit[r] - k0, c->scale, row_max + r, row_sum + r, o + r * CH, CH, w);
            store_weights(probs[r], w, DT, PT);
        }

        /* o[r] += P[r] . V[k0 ..]: one step per key pair (bf16) or key (fp32) */
        const int64_t block_keys = end - k0 < KEY_BLOCK ? end - k0 : KEY_BLOCK;
        const int64_t steps = PT == DTYPE_BFLOAT16 ? (block_keys + 1) / 2 : block_keys;
        const uint32_t *vb = vp + (PT == DTYPE_BFLOAT16 ? k0 / 2 : k0) * D;
        for (int64_t j = 0; j < steps; j++) {
            __m512i vv[MAX_CHUNKS];
            for (int ch = 0; ch < CH; ch++) vv[ch] = _mm512_loadu_si512(vb + j * D + 16 * ch);
            for (int r = 0; r < TR; r++) {
                const __m512i pw = _mm512_set1_epi32((int)probs[r][j]);
                for (int ch = 0; ch < CH; ch++) o[r * CH + ch] = fma_words(o[r * CH + ch], pw, vv[ch], PT);
            }
        }
    }

    for (int r = 0; r < rows; r++) {
        const int64_t row = row0 + r, offset = (row_position(c, row) * c->H + row_head(c, h, row)) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / row_sum[r]);
        for (int ch = 0; ch < CH; ch++) {
            const __m512 value = _mm512_mul_ps(o[r * CH + ch], inv);
            if (DT == DTYPE_BFLOAT16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)c->out + offset + 16 * ch), round_bf16(value));
            else
                _mm512_storeu_ps((float *)c->out + offset + 16 * ch, value);
        }
    }
}

/* Query rows per task (the TR of attend_tile) for a head size. */
static int tile_rows(int64_t D) { return D == 64 ? 6 : 3; }

/* bf16 K and V as the tile reads them: pairs for the bf16 pair dot product where the CPU has
 * it (AVX-512 BF16), else widened to fp32 while packing, once, not in every tile. */
#if defined(__AVX512BF16__)
#define BF16_PACKED DTYPE_BFLOAT16
#else
#define BF16_PACKED DTYPE_FLOAT32
#endif

/* The words K and V are packed as, for queries of `dtype` over a pool of format `kv`: bf16
 * pairs (as above) only for bf16 over bf16; fp32 words for everything else. */
static int packed_dtype(int dtype, int kv) {
    return dtype == DTYPE_BFLOAT16 && kv == DTYPE_BFLOAT16 ? BF16_PACKED : DTYPE_FLOAT32;
}

/* The tile of `n` rows from row0 of kv head h, with the constants for the head size, dtype and
 * packed words (bf16 queries take fp32 words where the pool was not bf16). */
static void attend(const Call *c, int64_t h, int64_t row0, int n, int dtype, int packed) {
    const int bf16_pairs = BF16_PACKED == DTYPE_BFLOAT16 && packed == DTYPE_BFLOAT16; /* folds without AVX-512 BF16 */
    if (c->D == 64 && dtype == DTYPE_BFLOAT16 && bf16_pairs)
        attend_tile(c, h, row0, n, 4, 6, DTYPE_BFLOAT16, DTYPE_BFLOAT16);
    else if (c->D == 64 && dtype == DTYPE_BFLOAT16)
        attend_tile(c, h, row0, n, 4, 6, DTYPE_BFLOAT16, DTYPE_FLOAT32);
    else if (c->D == 64)
        attend_tile(c, h, row0, n, 4, 6, DTYPE_FLOAT32, DTYPE_FLOAT32);
    else if (dtype == DTYPE_BFLOAT16 && bf16_pairs)
        attend_tile(c, h, row0, n, 8, 3, DTYPE_BFLOAT16, DTYPE_BFLOAT16);
    else if (dtype == DTYPE_BFLOAT16)
        attend_tile(c, h, row0, n, 8, 3, DTYPE_BFLOAT16, DTYPE_FLOAT32);
    else
        attend_tile(c, h, row0, n, 8, 3, DTYPE_FLOAT32, DTYPE_FLOAT32);
}
#elif defined(AVX2_TILE)
/* Query rows per task of the AVX2 tile: its scores are 6 rows x 16 keys (12 ymm accumulators,
 * 2 for the keys, 1 for a query broadcast), and P.V runs over 6 rows x 16 output columns. Each
 * key and value loaded serves 6 rows (4 rows per task ran slower). */
#define AVX2_TILE_ROWS 6
#define AVX2_SUB_KEYS 16
#define MAX_HEAD_DIM 128

/* One block's online-softmax step for one row, in place: s holds the raw q.k of 64 keys and
 * gets their weights (bf16: rounded to bf16, as the product with V takes them); keys at or
 * past `visible` weigh 0. Updates the row's max and sum and rescales its outputs o. */
static inline __attribute__((always_inline)) void avx2_softmax_step(float *s, int64_t visible, float scale,
                                                                    float *row_max, float *row_sum, float *o,
                                                                    const int64_t D, const int DT) {
    if (visible <= 0) { /* a row of the tile that ends before this block */
        for (int i = 0; i < KEY_BLOCK / 8; i++) _mm256_store_ps(s + 8 * i, _mm256_setzero_ps());
        return;
    }
    const int lanes = visible < KEY_BLOCK ? (int)visible : KEY_BLOCK;
    const __m256 lowest = _mm256_set1_ps(-FLT_MAX), scale_v = _mm256_set1_ps(scale);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 sv[KEY_BLOCK / 8], bm = lowest;
    for (int i = 0; i < KEY_BLOCK / 8; i++) {
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(lanes - 8 * i), iota));
        sv[i] = _mm256_blendv_ps(lowest, _mm256_mul_ps(_mm256_load_ps(s + 8 * i), scale_v), keep);
        bm = _mm256_max_ps(bm, sv[i]);
    }
    const float block_max = avx2_reduce_max(bm);
    const float m = block_max > *row_max ? block_max : *row_max;
    const float alpha = expf(*row_max - m);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps();
    for (int i = 0; i < KEY_BLOCK / 8; i++) {
        const __m256 w = _ZGVdN8v_expf(_mm256_sub_ps(sv[i], mv));
        total = _mm256_add_ps(total, w);
        _mm256_store_ps(s + 8 * i, DT == DTYPE_BFLOAT16 ? avx2_round_bf16(w) : w);
    }
    *row_sum = *row_sum * alpha + avx2_reduce_add(total);
    *row_max = m;
    if (alpha != 1.0f) {
        const __m256 a = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(o + d, _mm256_mul_ps(_mm256_load_ps(o + d), a));
    }
}

/* Both products of the AVX2 tile, TR rows x 16 columns in 12 ymm sums: row r of c (16 floats
 * at c + r * c_stride, 32-byte aligned; zeroed first unless `accumulate`) gains
 * sum over j < steps of a[r * a_stride + j] * b[j * b_stride .. + 15]. Scores: a = the queries,
 * b = 16 keys of the packed K^T, steps = D. P.V: a = the weights, b = 16 columns of V, steps =
 * the block's keys. */
static inline __attribute__((always_inline)) void avx2_rows_times_block(const float *a, int64_t a_stride,
                                                                        const float *b, int64_t b_stride,
                                                                        int64_t steps, float *c, int64_t c_stride,
                                                                        const int accumulate, const int TR) {
    __m256 acc[AVX2_TILE_ROWS * 2];
    for (int r = 0; r < TR; r++) {
        acc[2 * r] = accumulate ? _mm256_load_ps(c + r * c_stride) : _mm256_setzero_ps();
        acc[2 * r + 1] = accumulate ? _mm256_load_ps(c + r * c_stride + 8) : _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < steps; j++) {
        const __m256 lo = _mm256_loadu_ps(b + j * b_stride), hi = _mm256_loadu_ps(b + j * b_stride + 8);
        for (int r = 0; r < TR; r++) {
            const __m256 x = _mm256_broadcast_ss(a + r * a_stride + j);
            acc[2 * r] = _mm256_fmadd_ps(x, lo, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(x, hi, acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < TR; r++) {
        _mm256_store_ps(c + r * c_stride, acc[2 * r]);
        _mm256_store_ps(c + r * c_stride + 8, acc[2 * r + 1]);
    }
}

/* The AVX2 tile: `rows` query rows (<= TR) of kv head h from row `row0`, as attend_tile. Per
 * block of 64 keys: scores 16 keys at a time in registers, to a buffer; the softmax there;
 * then P.V 16 output columns at a time, the outputs loaded from and stored to a buffer once
 * per block (their 2 x 6 x D/8 vectors would not fit in 16 registers). D, TR and DT are
 * constants in each inlined copy. */
static inline __attribute__((always_inline)) void attend_tile_avx2(const Call *c, int64_t h, int64_t row0,
                                                                   int rows, const int64_t D, const int TR,
                                                                   const int DT) {
    const int bf16 = DT == DTYPE_BFLOAT16;
    const float *kp = (const float *)(c->k_packed + h * c->head_stride), *vp = (const float *)(c->v_packed + h * c->head_stride);
    float q[AVX2_TILE_ROWS][MAX_HEAD_DIM] __attribute__((aligned(32))); /* queries as fp32 */
    float o[AVX2_TILE_ROWS][MAX_HEAD_DIM] __attribute__((aligned(32))); /* unnormalised outputs */
    float s[AVX2_TILE_ROWS][KEY_BLOCK] __attribute__((aligned(32)));    /* scores, then weights */
    float row_max[AVX2_TILE_ROWS], row_sum[AVX2_TILE_ROWS];
    int64_t limit[AVX2_TILE_ROWS]; /* keys 0 .. limit - 1 are visible to the row */
    for (int r = 0; r < TR; r++) {
        const int64_t row = row0 + (r < rows ? r : rows - 1), pos = row_position(c, row);
        const char *src = (const char *)c->q + (pos * c->q_row_stride + row_head(c, h, row) * D) * element_size(DT);
        for (int64_t d = 0; d < D; d += 8) {
            _mm256_store_ps(q[r] + d, avx2_load(src + d * element_size(DT), bf16));
            _mm256_store_ps(o[r] + d, _mm256_setzero_ps());
        }
        limit[r] = row_limit(c, pos);
        row_max[r] = -FLT_MAX;
        row_sum[r] = 0.0f;
    }
    const int64_t end = limit[rows - 1]; /* rows are in position order: the last sees most */

    for (int64_t k0 = 0; k0 < end; k0 += KEY_BLOCK) {
        const float *kb = kp + (k0 / KEY_BLOCK) * D * KEY_BLOCK;
        /* keys past every row's limit keep scores 0 (no steps), weighed 0 */
        for (int k = 0; k < KEY_BLOCK; k += AVX2_SUB_KEYS)
            avx2_rows_times_block(q[0], MAX_HEAD_DIM, kb + k, KEY_BLOCK, k0 + k < end ? D : 0, s[0] + k, KEY_BLOCK, 0, TR);
        for (int r = 0; r < TR; r++)
            avx2_softmax_step(s[r], limit[r] - k0, c->scale, row_max + r, row_sum + r, o[r], D, DT);

        /* o[r] += P[r] . V[k0 ..] */
        const int64_t block_keys = end - k0 < KEY_BLOCK ? end - k0 : KEY_BLOCK;
        const float *vb = vp + k0 * D;
        for (int64_t d = 0; d < D; d += 16)
            avx2_rows_times_block(s[0], KEY_BLOCK, vb + d, D, block_keys, o[0] + d, MAX_HEAD_DIM, 1, TR);
    }

    for (int r = 0; r < rows; r++) {
        const int64_t row = row0 + r, offset = (row_position(c, row) * c->H + row_head(c, h, row)) * D;
        const __m256 inv = _mm256_set1_ps(1.0f / row_sum[r]);
        for (int64_t d = 0; d < D; d += 8)
            avx2_store((char *)c->out + (offset + d) * element_size(DT), _mm256_mul_ps(_mm256_load_ps(o[r] + d), inv), bf16);
    }
}

static int tile_rows(int64_t D) {
    (void)D;
    return AVX2_TILE_ROWS;
}

/* bf16 K and V widened to fp32 while packing: AVX2 has no bf16 arithmetic, and widening once
 * costs less than in every tile that reads them; 8-bit pools dequantized likewise. */
static int packed_dtype(int dtype, int kv) {
    (void)dtype, (void)kv;
    return DTYPE_FLOAT32;
}

/* The tile of `n` rows from row0 of kv head h, with the constants for the head size and dtype
 * (the words are always fp32). */
static void attend(const Call *c, int64_t h, int64_t row0, int n, int dtype, int packed) {
    (void)packed;
    if (c->D == 64 && dtype == DTYPE_BFLOAT16)
        attend_tile_avx2(c, h, row0, n, 64, AVX2_TILE_ROWS, DTYPE_BFLOAT16);
    else if (c->D == 64)
        attend_tile_avx2(c, h, row0, n, 64, AVX2_TILE_ROWS, DTYPE_FLOAT32);
    else if (dtype == DTYPE_BFLOAT16)
        attend_tile_avx2(c, h, row0, n, 128, AVX2_TILE_ROWS, DTYPE_BFLOAT16);
    else
        attend_tile_avx2(c, h, row0, n, 128, AVX2_TILE_ROWS, DTYPE_FLOAT32);
}
#endif

#if defined(AVX512_TILE) || defined(AVX2_TILE)
/* Task `task`: the tile of query rows `task % tiles` of kv head `task / tiles`. Tasks go head
 * by head, so the tasks a thread runs in turn read the same head's K and V: one head's fit in
 * L2, all heads' often not (fp32 at 1,536 tokens: 0.8 MB a head at head size 64), and the AVX2
 * tile, whose outputs stream through L1, runs slower from L3. */
static void attend_task(const Call *c, int64_t task, int64_t rows, int dtype, int packed) {
    const int64_t tr = tile_rows(c->D), tiles = (rows + tr - 1) / tr;
    const int64_t h = task / tiles, row0 = (task % tiles) * tr;
    attend(c, h, row0, (int)(rows - row0 < tr ? rows - row0 : tr), dtype, packed);
}
#endif

/* `dtype` is q's and out's (fp32 or bf16), `kv` the pools' format (k/v_scales for int8, else
 * NULL). Returns 0 on success, 1 when memory ran out, 2 for a shape or dtype this build cannot
 * serve. */
int prefill_attention(const void *q, int64_t q_row_stride, const void *k_pool, const void *v_pool,
                      const uint16_t *k_scales, const uint16_t *v_scales, const int64_t *pages,
                      int64_t page_size, int64_t prefix_len, int64_t extend_len, const int64_t *positions,
                      void *out, int64_t H, int64_t Hkv, int64_t D, float scale, int dtype, int kv,
                      int num_threads) {
#if defined(AVX512_TILE) || defined(AVX2_TILE)
    if (!tile_serves(D, dtype, kv) || H % Hkv != 0) return 2;
    if (extend_len <= 0) return 0;
    const int64_t S = (positions ? positions[extend_len - 1] : prefix_len + extend_len - 1) + 1;
    const int64_t blocks = (S + KEY_BLOCK - 1) / KEY_BLOCK;
    const int packed = packed_dtype(dtype, kv);
    const int64_t head_stride = blocks * KEY_BLOCK * D * element_size(packed) / 4;
    int64_t *slots = malloc(S * sizeof(int64_t));
    uint32_t *words = malloc(2 * Hkv * head_stride * sizeof(uint32_t)); /* packed K, then V */
    if (slots == NULL || words == NULL) {
        free(slots);
        free(words);
        return 1;
    }
    for (int64_t j = 0; j < S; j++) slots[j] = pages[j / page_size] * page_size + j % page_size;
    const Call call = {q, q_row_stride, out, H, Hkv, D, H / Hkv, prefix_len, positions, scale,
                       words, words + Hkv * head_stride, head_stride};
    const int64_t rows = call.G * extend_len, tr = tile_rows(D);
    const int64_t tasks = Hkv * ((rows + tr - 1) / tr);

#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < 2 * Hkv; task++) {
            if (task < Hkv)
                pack_keys(k_pool, k_scales, slots, S, Hkv, task, D, kv, packed, words + task * head_stride);
            else
                pack_values(v_pool, v_scales, slots, S, Hkv, task - Hkv, D, kv, packed, words + task * head_stride);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) attend_task(&call, task, rows, dtype, packed);
    }
    free(slots);
    free(words);
    return 0;
#else
    (void)q, (void)q_row_stride, (void)k_pool, (void)v_pool, (void)k_scales, (void)v_scales, (void)pages;
    (void)page_size, (void)prefix_len, (void)extend_len, (void)positions, (void)out, (void)H, (void)Hkv, (void)D;
    (void)scale, (void)dtype, (void)kv, (void)num_threads;
    return 2;
#endif
}
