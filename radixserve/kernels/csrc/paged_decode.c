/* Paged decode attention on the CPU: one new query token per request, keys and values read in
 * place from their pages (no gathered copy of the context).
 *
 * Built and loaded at run time by radixserve/kernels/cpu.py with the system C
 * compiler; torch_native falls back to gather + scaled_dot_product_attention without it.
 *
 * Layouts (all row-major, contiguous in the last two dims):
 *   q, out        [B, H, D]        q rows q_row_stride elements apart
 *   k_new, v_new  [B, Hkv, D]      the new token's K/V (rows k/v_row_stride apart), stored in
 *                                  its slot, every row's before any row attends (a row may be
 *                                  in another's context: the tokens of a checked draft are rows
 *                                  of one request); NULL when already stored
 *   k_pool/v_pool [slots, Hkv, D]  slot = page * page_size + offset
 *   k/v_scales    [slots, Hkv]     int8 pools only: each row's fp16 scale (NULL otherwise)
 *   page_table    [B, pt_stride]   page ids of each request, in order
 *   seq_lens      [B]              context length of each request (the new token included)
 *
 * Element types: q and out are the compute dtype (`dtype`: fp32 or bf16); the pools are the KV
 * cache's format (`kv`, dtypes.h): fp32, bf16, fp8_e4m3, fp8_e5m2 or int8. Quantized rows are
 * dequantized as they are read, inside the dot products (never into a copy of the context),
 * and every product and sum is fp32 as for bf16 pools: fp8 is converted exactly (through fp16
 * bits: F16C or AVX-512 converts 8 or 16 lanes at once; e4m3's factor 2^8 is folded into the
 * queries for q.k, exactly, and into the weights for P.V); int8 is widened to fp32 and its
 * row's scale applied once per row, to the q.k sum and to the row's softmax weight for P.V
 * (s * (q.k) instead of q.(s * k): equal but for fp32 rounding order). 8-bit rows halve the
 * bytes a bf16 pool reads, which is what decode is bound by.
 *
 * Work is split into tasks of one request and a range of its kv heads. For each kv head, its
 * G = H / Hkv query heads share every K/V row read: two passes over the context, scores (then
 * an exact softmax with the true max), then the weighted sum of V. Accumulation is in fp32
 * whatever the storage dtype. With AVX-512 or AVX2 + FMA and a head size of 64 or 128 the work
 * runs in vector registers (head_group_simd, one body for both and for every KV format: 16 or
 * 8 fp32 lanes, bf16 widened, 8-bit formats converted; for bf16 queries over a bf16 pool with
 * AVX-512 BF16, head_group_bf16, which multiplies bf16 pairs without widening them); other
 * shapes, and builds without those ISA flags, take the portable loop, which serves every
 * format too. On x86 the first kv head's pass prefetches the task's whole rows into L2 ahead
 * of itself (prefetch_context), and the last one the next request's (prefetch_next): pages are
 * scattered, and the hardware prefetcher alone reads them at half the memory's bandwidth.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

/* Everything one task needs to know about the call and its request. */
typedef struct {
    const void *q, *k_new, *v_new;
    int64_t q_row_stride, k_row_stride, v_row_stride;
    void *k_pool, *v_pool, *out;
    int64_t H, Hkv, D;
    float scale;
    int dtype;                         /* q and out: fp32 or bf16 */
    int kv;                            /* the pools' format (dtypes.h) */
    const uint16_t *k_scales, *v_scales; /* int8: [slots, Hkv] fp16; else NULL */
    /* per request */
    int64_t b, seq_len;
    int64_t kv0, kv1;          /* the task's kv heads */
    const int64_t *slots;      /* [seq_len] flat slot of each position */
    const int64_t *next_pages; /* page ids of the request this thread likely takes next, or NULL */
    int64_t next_len, page_size;
} Task;

/* Pre-scaled fp32 queries of kv head `kvh`: qf[g * D + d]. */
static void load_queries(const Task *t, int64_t kvh, float *qf) {
    const int64_t G = t->H / t->Hkv;
    for (int64_t g = 0; g < G; g++) {
        const int64_t offset = t->b * t->q_row_stride + (kvh * G + g) * t->D;
        for (int64_t d = 0; d < t->D; d++) qf[g * t->D + d] = load_element(t->q, offset + d, t->dtype) * t->scale;
    }
}

/* scores[g * L + i] = exp(scores - max_g) in place; returns sums[g]. */
static void softmax_weights(float *scores, const float *maxes, float *sums, int64_t G, int64_t L) {
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * L;
        const float m = maxes[g];
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < L; i++) {
            sg[i] = expf(sg[i] - m);
            total += sg[i];
        }
        sums[g] = total;
    }
}

static void store_output(const Task *t, int64_t kvh, const float *acc, const float *sums) {
    const int64_t G = t->H / t->Hkv, D = t->D;
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.0f / sums[g];
        const int64_t offset = (t->b * t->H + kvh * G + g) * D;
        if (t->dtype == DTYPE_BFLOAT16) {
            uint16_t *dst = (uint16_t *)t->out + offset;
            for (int64_t d = 0; d < D; d++) dst[d] = float_to_bf16(acc[g * D + d] * inv);
        } else {
            float *dst = (float *)t->out + offset;
            for (int64_t d = 0; d < D; d++) dst[d] = acc[g * D + d] * inv;
        }
    }
}

/* After the softmax: each weight times `factor` and its V row's scale (int8), so the product
 * with V reads the stored row as it is. The sums stay those of the unscaled weights. */
static void scale_weights(const Task *t, int64_t kvh, float *scores, int64_t G, int64_t L, float factor) {
    if (t->kv != DTYPE_INT8 && factor == 1.0f) return;
    for (int64_t i = 0; i < L; i++) {
        const float f = factor * row_scale(t->v_scales, t->kv, t->slots[i], t->Hkv, kvh);
        for (int64_t g = 0; g < G; g++) scores[g * L + i] *= f;
    }
}

/* Portable path: any head size, any CPU; inlined once per KV format (a constant KV), so the
 * element loads fold. scratch holds [G*D] q, [G*D] acc, [G*L] scores. */
static inline __attribute__((always_inline)) void head_group_portable_kv(const Task *t, int64_t kvh,
                                                                         float *scratch, const int KV) {
    const int64_t G = t->H / t->Hkv, D = t->D, L = t->seq_len;
    float *qf = scratch, *acc = qf + G * D, *scores = acc + G * D;
    float maxes[G], sums[G];
    load_queries(t, kvh, qf);
    for (int64_t g = 0; g < G; g++) maxes[g] = -FLT_MAX; /* not -INFINITY: built with -ffast-math */
    for (int64_t i = 0; i < L; i++) {
        const int64_t row = (t->slots[i] * t->Hkv + kvh) * D;
        const float ks = row_scale(t->k_scales, KV, t->slots[i], t->Hkv, kvh);
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t d = 0; d < D; d++) s += qf[g * D + d] * load_element(t->k_pool, row + d, KV);
            s *= ks;
            scores[g * L + i] = s;
            if (s > maxes[g]) maxes[g] = s;
        }
    }
    softmax_weights(scores, maxes, sums, G, L);
    scale_weights(t, kvh, scores, G, L, 1.0f);
    memset(acc, 0, G * D * sizeof(float));
    for (int64_t i = 0; i < L; i++) {
        const int64_t row = (t->slots[i] * t->Hkv + kvh) * D;
        for (int64_t d = 0; d < D; d++) {
            const float v = load_element(t->v_pool, row + d, KV);
            for (int64_t g = 0; g < G; g++) acc[g * D + d] += scores[g * L + i] * v;
        }
    }
    store_output(t, kvh, acc, sums);
}

static void head_group_portable(const Task *t, int64_t kvh, float *scratch) {
    switch (t->kv) {
    case DTYPE_BFLOAT16: head_group_portable_kv(t, kvh, scratch, DTYPE_BFLOAT16); break;
    case DTYPE_FP8_E4M3: head_group_portable_kv(t, kvh, scratch, DTYPE_FP8_E4M3); break;
    case DTYPE_FP8_E5M2: head_group_portable_kv(t, kvh, scratch, DTYPE_FP8_E5M2); break;
    case DTYPE_INT8: head_group_portable_kv(t, kvh, scratch, DTYPE_INT8); break;
    default: head_group_portable_kv(t, kvh, scratch, DTYPE_FLOAT32); break;
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* Prefetching, for both x86 register paths (_mm_prefetch is SSE: any x86-64 has it). */
#include <immintrin.h>

#define PREFETCH_AHEAD 48 /* positions ahead: this head's row into L1 */
#define CONTEXT_AHEAD 96  /* positions ahead: all the task's rows into L2 */

/* Pages are scattered, so the hardware prefetcher loses the stream at every page boundary:
 * ask for the row PREFETCH_AHEAD positions on. */
static inline __attribute__((always_inline)) void prefetch_row(const void *pool, int dtype,
                                                               int64_t offset, int64_t D) {
    const char *p = (const char *)pool + offset * element_size(dtype);
    for (int64_t off = 0; off < D * element_size(dtype); off += 64)
        _mm_prefetch(p + off, _MM_HINT_T0);
}

/* `count` elements of both pools from element `offset` on, into L2. */
static inline __attribute__((always_inline)) void prefetch_pools_l2(const Task *t, int64_t offset, int64_t count) {
    const int64_t elem = element_size(t->kv);
    for (int64_t byte = offset * elem; byte < (offset + count) * elem; byte += 64) {
        _mm_prefetch((const char *)t->k_pool + byte, _MM_HINT_T1);
        _mm_prefetch((const char *)t->v_pool + byte, _MM_HINT_T1);
    }
}

/* int8: the scales of a slot's rows (kv heads [kv0, kv0 + count)) into L2, with its rows. */
static inline __attribute__((always_inline)) void prefetch_scales_l2(const Task *t, int64_t slot, int64_t kv0) {
    if (t->kv != DTYPE_INT8) return;
    _mm_prefetch((const char *)(t->k_scales + slot * t->Hkv + kv0), _MM_HINT_T1);
    _mm_prefetch((const char *)(t->v_scales + slot * t->Hkv + kv0), _MM_HINT_T1);
}

/* The task's K and V rows of position i (all its kv heads: one contiguous run per slot) into
 * L2. The first kv head's pass walks the context CONTEXT_AHEAD positions ahead of itself, so
 * the later heads' passes find their rows in L2; it keeps many more lines in flight than the
 * hardware prefetcher does, which loses the stream at every scattered page. */
static inline __attribute__((always_inline)) void prefetch_position(const Task *t, int64_t i) {
    prefetch_pools_l2(t, (t->slots[i] * t->Hkv + t->kv0) * t->D, (t->kv1 - t->kv0) * t->D);
    prefetch_scales_l2(t, t->slots[i], t->kv0);
}

/* The rows of position i of the request this thread will likely take next into L2, from the
 * last kv head's pass over K (the data of the current request is in L2 by then), so the next
 * request's first pass does not start by waiting for memory. */
static inline __attribute__((always_inline)) void prefetch_next(const Task *t, int64_t kvh, int64_t i) {
    if (kvh != t->kv1 - 1 || kvh == t->kv0 || t->next_pages == NULL || i >= t->next_len) return;
    const int64_t slot = t->next_pages[i / t->page_size] * t->page_size + i % t->page_size;
    prefetch_pools_l2(t, slot * t->Hkv * t->D, t->Hkv * t->D);
    prefetch_scales_l2(t, slot, 0);
}

/* Called by every kv head's pass over K at position i; only the first head's pass prefetches
 * (its first call asks for the first CONTEXT_AHEAD positions at once). */
static inline __attribute__((always_inline)) void prefetch_context(const Task *t, int64_t kvh, int64_t i) {
    if (kvh != t->kv0) return;
    if (i == 0)
        for (int64_t ahead = 0; ahead < CONTEXT_AHEAD && ahead < t->seq_len; ahead++) prefetch_position(t, ahead);
    if (i + CONTEXT_AHEAD < t->seq_len) prefetch_position(t, i + CONTEXT_AHEAD);
}
#endif

/* The register path's fp32 vector per ISA: LANES lanes, the few operations head_group_simd
 * needs, and how many P.V accumulators it keeps in registers at once (ACC_REGS: the rest of the
 * register file holds a V chunk and the G weights). */
#ifdef __AVX512F__
#define LANES 16
#define ACC_REGS 24 /* of 32 zmm */
typedef __m512 vfloat;
static inline __attribute__((always_inline)) vfloat vec_set1(float x) { return _mm512_set1_ps(x); }
static inline __attribute__((always_inline)) vfloat vec_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) void vec_storef(float *p, vfloat v) { _mm512_storeu_ps(p, v); }
static inline __attribute__((always_inline)) vfloat vec_mul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
static inline __attribute__((always_inline)) vfloat vec_fmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
/* sums[g] = the sum of the lanes of s[g], for g < G */
static inline __attribute__((always_inline)) void vec_reduce_group(const vfloat *s, const int G, float *sums) {
    for (int g = 0; g < G; g++) sums[g] = _mm512_reduce_add_ps(s[g]);
}
/* LANES elements of a pool of format KV from element `offset` on, as fp32: bf16 widened; fp8
 * as fp16 bits (e4m3: its value times 2^-8, see dtypes.h), converted by vcvtph2ps; int8 the
 * integers (scales are applied per row) */
static inline __attribute__((always_inline)) vfloat vec_load(const void *base, const int KV, int64_t offset) {
    if (KV == DTYPE_BFLOAT16) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    if (KV == DTYPE_FP8_E4M3 || KV == DTYPE_FP8_E5M2) {
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + offset)));
        if (KV == DTYPE_FP8_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
        const __m256i shifted = _mm256_slli_epi16(bytes, 7); /* the sign at bit 14 ... */
        const __m256i halves = _mm256_add_epi16(shifted, _mm256_and_si256(shifted, _mm256_set1_epi16(0x4000)));
        return _mm512_cvtph_ps(halves); /* ... carried to bit 15 */
    }
    if (KV == DTYPE_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + offset))));
    return _mm512_loadu_ps((const float *)base + offset);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2.h"
#define LANES 8
#define ACC_REGS 12 /* of 16 ymm */
typedef __m256 vfloat;
static inline __attribute__((always_inline)) vfloat vec_set1(float x) { return _mm256_set1_ps(x); }
static inline __attribute__((always_inline)) vfloat vec_loadf(const float *p) { return _mm256_loadu_ps(p); }
static inline __attribute__((always_inline)) void vec_storef(float *p, vfloat v) { _mm256_storeu_ps(p, v); }
static inline __attribute__((always_inline)) vfloat vec_mul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
static inline __attribute__((always_inline)) vfloat vec_fmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
/* sums[g] = the sum of the lanes of s[g], for g < G <= 8: one transposing tree of hadds for all
 * G heads, fewer shuffles than G separate reductions (it shows at G = 8, head size 128) */
static inline __attribute__((always_inline)) void vec_reduce_group(const vfloat *s, const int G, float *sums) {
    __m256 x[8];
    for (int g = 0; g < 8; g++) x[g] = g < G ? s[g] : _mm256_setzero_ps();
    /* two hadds leave, per 128-bit half, the sums of that half's 4 lanes of x0 .. x3 */
    const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    float out[8];
    if (G <= 4) {
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(low), _mm256_extractf128_ps(low, 1)));
    } else {
        const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                            _mm256_permute2f128_ps(low, high, 0x31)));
    }
    for (int g = 0; g < G; g++) sums[g] = out[g];
}
/* as the AVX-512 vec_load, 8 lanes (F16C's vcvtph2ps) */
static inline __attribute__((always_inline)) vfloat vec_load(const void *base, const int KV, int64_t offset) {
    if (KV == DTYPE_BFLOAT16) return avx2_load_bf16((const uint16_t *)base + offset);
    if (KV == DTYPE_FP8_E4M3 || KV == DTYPE_FP8_E5M2) {
        const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)base + offset)));
        if (KV == DTYPE_FP8_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(bytes, 8));
        const __m128i shifted = _mm_slli_epi16(bytes, 7); /* the sign at bit 14 ... */
        return _mm256_cvtph_ps(_mm_add_epi16(shifted, _mm_and_si128(shifted, _mm_set1_epi16(0x4000)))); /* ... to 15 */
    }
    if (KV == DTYPE_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + offset))));
    return _mm256_loadu_ps((const float *)base + offset);
}
#endif

#ifdef LANES
#define MAX_GROUP 8              /* query heads per kv head served by the register path */
#define MAX_HEAD 128             /* the largest head size served by the register path */
#define MAX_CHUNKS (MAX_HEAD / LANES)
#define PV_BLOCK 16 /* positions per P.V block: its V rows stay in L1 across the tiles */

/* Chunks per P.V tile: the most (halving from CH) whose accumulators for G heads fit ACC_REGS.
 * A constant once inlined. */
static inline __attribute__((always_inline)) int tile_chunks(const int G, const int CH) {
    int chunks = CH;
    while (chunks > 1 && G * chunks > ACC_REGS) chunks /= 2;
    return chunks;
}

/* The scores of rows i .. i + R - 1 for G query heads (q in qv, CH chunks each) into
 * scores[g * L + row], and the running maxes. R * G <= MAX_GROUP: one reduction for all. */
static inline __attribute__((always_inline)) void score_rows(const Task *t, int64_t kvh, const vfloat *qv,
                                                             int64_t i, const int R, const int G,
                                                             const int CH, const int KV, float *scores,
                                                             float *maxes) {
    const int64_t D = t->D, L = t->seq_len, Hkv = t->Hkv;
    int64_t rows[2];
    for (int r = 0; r < R; r++) {
        rows[r] = (t->slots[i + r] * Hkv + kvh) * D;
        prefetch_context(t, kvh, i + r);
        prefetch_next(t, kvh, i + r);
        if (i + r + PREFETCH_AHEAD < L)
            prefetch_row(t->k_pool, KV, (t->slots[i + r + PREFETCH_AHEAD] * Hkv + kvh) * D, D);
    }
    vfloat s[MAX_GROUP];
    /* unrolled whole (gcc stops short at 16 chunks), else the sums live on the stack */
#pragma GCC unroll 16
    for (int c = 0; c < CH; c++) {
        vfloat k[2];
        for (int r = 0; r < R; r++) k[r] = vec_load(t->k_pool, KV, rows[r] + LANES * c);
        for (int g = 0; g < G; g++)
            for (int r = 0; r < R; r++)
                s[r * G + g] = c == 0 ? vec_mul(qv[g * CH], k[r]) : vec_fmadd(qv[g * CH + c], k[r], s[r * G + g]);
    }
    float dots[MAX_GROUP];
    vec_reduce_group(s, R * G, dots);
    for (int r = 0; r < R; r++) {
        const float ks = row_scale(t->k_scales, KV, t->slots[i + r], Hkv, kvh);
        for (int g = 0; g < G; g++) {
            const float score = KV == DTYPE_INT8 ? dots[r * G + g] * ks : dots[r * G + g];
            scores[g * L + i + r] = score;
            maxes[g] = score > maxes[g] ? score : maxes[g];
        }
    }
}

/* One kv head with G query heads of CH LANES-float chunks each, over a pool of format KV (fp32;
 * bf16 widened to fp32; fp8 or int8 converted, see vec_load). Always inlined with constant G,
 * CH and KV, so the loops unroll into registers and the loads fold.
 *
 * Scores (score_rows): each K chunk is loaded once and multiplied into G running sums, so the
 * K row is read once for all G heads and only G + 1 vectors are live besides q (which stays in
 * registers where they suffice, else in L1: an FMA takes it as a memory operand). Where 2G
 * sums fit, two rows go together: each q chunk serves both, and one reduction tree sums all
 * 2G (the per-row overhead is what bounds 8-bit rows, which convert instead of waiting).
 * P.V: G * CH accumulators fit the registers only for small shapes (12 of 16 ymm with AVX2),
 * so the chunks are split into tiles of CT that do, and the context into blocks of PV_BLOCK
 * positions: each tile sweeps the block's V rows, which stay in L1 for the next tile.
 * Scales: vec_load gives e4m3 times 2^-8, so the queries are multiplied by 2^8 (exact: the
 * products are those of the dequantized keys) and the weights too; int8 rows' scales multiply
 * their score and (scale_weights) their weight. */
static inline __attribute__((always_inline)) void head_group_simd(const Task *t, int64_t kvh,
                                                                  float *scores, const int G,
                                                                  const int CH, const int KV) {
    const int64_t D = t->D, L = t->seq_len, Hkv = t->Hkv;
    const int CT = tile_chunks(G, CH);
    const float fp8_factor = KV == DTYPE_FP8_E4M3 ? 256.0f : 1.0f;
    vfloat qv[MAX_GROUP * MAX_CHUNKS];
    float maxes[MAX_GROUP], sums[MAX_GROUP], qf[MAX_GROUP * MAX_HEAD];
    load_queries(t, kvh, qf);
    for (int g = 0; g < G; g++) {
        maxes[g] = -FLT_MAX;
        for (int c = 0; c < CH; c++) {
            const vfloat q = vec_loadf(qf + g * D + LANES * c);
            qv[g * CH + c] = KV == DTYPE_FP8_E4M3 ? vec_mul(q, vec_set1(fp8_factor)) : q;
        }
    }

    /* two rows at a time where their 2G sums fit one reduction tree: each q chunk loaded once
     * for both, and one tree for both rows' sums */
    int64_t i = 0;
    if (2 * G <= MAX_GROUP)
        for (; i + 2 <= L; i += 2) score_rows(t, kvh, qv, i, 2, G, CH, KV, scores, maxes);
    for (; i < L; i++) score_rows(t, kvh, qv, i, 1, G, CH, KV, scores, maxes);

    softmax_weights(scores, maxes, sums, G, L);
    scale_weights(t, kvh, scores, G, L, fp8_factor);

    float *acc = qf; /* q is in qv now */
    memset(acc, 0, G * D * sizeof(float));
    for (int64_t i0 = 0; i0 < L; i0 += PV_BLOCK) {
        const int64_t i1 = i0 + PV_BLOCK < L ? i0 + PV_BLOCK : L;
        for (int64_t i = i0 + PREFETCH_AHEAD; i < i1 + PREFETCH_AHEAD && i < L; i++)
            prefetch_row(t->v_pool, KV, (t->slots[i] * Hkv + kvh) * D, D);
        for (int c0 = 0; c0 < CH; c0 += CT) {
            vfloat a[MAX_GROUP * MAX_CHUNKS];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < CT; c++) a[g * CT + c] = vec_loadf(acc + g * D + LANES * (c0 + c));
            for (int64_t i = i0; i < i1; i++) {
                const int64_t row = (t->slots[i] * Hkv + kvh) * D + LANES * c0;
                vfloat w[MAX_GROUP];
                for (int g = 0; g < G; g++) w[g] = vec_set1(scores[g * L + i]);
#pragma GCC unroll 16
                for (int c = 0; c < CT; c++) {
                    const vfloat v = vec_load(t->v_pool, KV, row + LANES * c);
                    for (int g = 0; g < G; g++) a[g * CT + c] = vec_fmadd(w[g], v, a[g * CT + c]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < CT; c++) vec_storef(acc + g * D + LANES * (c0 + c), a[g * CT + c]);
        }
    }
    store_output(t, kvh, acc, sums);
}

#ifdef __AVX512BF16__
/* bf16 with the AVX-512 BF16 dot product (vdpbf16ps: 16 lanes, each the sum of a pair of bf16
 * products): q.k reads K rows as they are stored (no widening to fp32) and scales in fp32
 * afterwards; P.V takes two positions per step, the weights rounded to bf16 as torch's bf16
 * attention does, V rows interleaved in pairs. Halves the arithmetic of the fp32 path. CH32 is
 * the number of 32-element chunks of a row. */
static inline __attribute__((always_inline)) void head_group_bf16(const Task *t, int64_t kvh,
                                                                  float *scores, const int G,
                                                                  const int CH32) {
    const int64_t D = t->D, L = t->seq_len, Hkv = t->Hkv;
    const uint16_t *k_pool = t->k_pool, *v_pool = t->v_pool;
    __m512i qv[MAX_GROUP * MAX_CHUNKS / 2];
    __m512 acc[MAX_GROUP * MAX_CHUNKS];
    float maxes[MAX_GROUP], sums[MAX_GROUP], unscaled[MAX_GROUP * MAX_CHUNKS * 16];
    for (int g = 0; g < G; g++) {
        maxes[g] = -FLT_MAX;
        const uint16_t *q = (const uint16_t *)t->q + t->b * t->q_row_stride + (kvh * G + g) * D;
        for (int c = 0; c < CH32; c++) qv[g * CH32 + c] = _mm512_loadu_si512(q + 32 * c);
    }

    for (int64_t i = 0; i < L; i++) {
        const uint16_t *row = k_pool + (t->slots[i] * Hkv + kvh) * D;
        prefetch_context(t, kvh, i);
        prefetch_next(t, kvh, i);
        if (i + PREFETCH_AHEAD < L) prefetch_row(k_pool, DTYPE_BFLOAT16, (t->slots[i + PREFETCH_AHEAD] * Hkv + kvh) * D, D);
        __m512i k[MAX_CHUNKS / 2];
        for (int c = 0; c < CH32; c++) k[c] = _mm512_loadu_si512(row + 32 * c);
        for (int g = 0; g < G; g++) {
            __m512 s = _mm512_setzero_ps();
            for (int c = 0; c < CH32; c++) s = _mm512_dpbf16_ps(s, (__m512bh)qv[g * CH32 + c], (__m512bh)k[c]);
            const float score = _mm512_reduce_add_ps(s) * t->scale;
            scores[g * L + i] = score;
            maxes[g] = score > maxes[g] ? score : maxes[g];
        }
    }

    softmax_weights(scores, maxes, sums, G, L);
    /* the weights as bf16 pairs (position 2j, 2j + 1), a zero after an odd last position */
    const int64_t pairs = (L + 1) / 2;
    uint32_t *weights = (uint32_t *)(scores + G * L);
    for (int g = 0; g < G; g++) {
        uint16_t *w = (uint16_t *)(weights + g * pairs);
        for (int64_t i = 0; i < L; i++) w[i] = float_to_bf16(scores[g * L + i]);
        if (L % 2) w[L] = 0;
    }

    for (int j = 0; j < G * 2 * CH32; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) {
        const int64_t i = 2 * j;
        const uint16_t *a = v_pool + (t->slots[i] * Hkv + kvh) * D;
        const uint16_t *b = i + 1 < L ? v_pool + (t->slots[i + 1] * Hkv + kvh) * D : NULL;
        for (int64_t ahead = i + PREFETCH_AHEAD; ahead < i + PREFETCH_AHEAD + 2 && ahead < L; ahead++)
            prefetch_row(v_pool, DTYPE_BFLOAT16, (t->slots[ahead] * Hkv + kvh) * D, D);
        __m512i lo[MAX_CHUNKS / 2], hi[MAX_CHUNKS / 2];
        for (int c = 0; c < CH32; c++) {
            const __m512i va = _mm512_loadu_si512(a + 32 * c);
            const __m512i vb = b != NULL ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
            /* per 128-bit lane l: lo holds elements 8l .. 8l+3 of a and b interleaved, hi 8l+4 .. 8l+7 */
            lo[c] = _mm512_unpacklo_epi16(va, vb);
            hi[c] = _mm512_unpackhi_epi16(va, vb);
        }
        for (int g = 0; g < G; g++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)weights[g * pairs + j]);
            for (int c = 0; c < CH32; c++) {
                acc[(g * CH32 + c) * 2] = _mm512_dpbf16_ps(acc[(g * CH32 + c) * 2], w, (__m512bh)lo[c]);
                acc[(g * CH32 + c) * 2 + 1] = _mm512_dpbf16_ps(acc[(g * CH32 + c) * 2 + 1], w, (__m512bh)hi[c]);
            }
        }
    }
    /* back to element order: 128-bit lane l of lo holds elements 8l .. 8l+3 of its chunk */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < CH32; c++) {
            float lanes[2][16];
            _mm512_storeu_ps(lanes[0], acc[(g * CH32 + c) * 2]);
            _mm512_storeu_ps(lanes[1], acc[(g * CH32 + c) * 2 + 1]);
            float *dst = unscaled + g * D + 32 * c;
            for (int l = 0; l < 4; l++)
                for (int e = 0; e < 4; e++) {
                    dst[8 * l + e] = lanes[0][4 * l + e];
                    dst[8 * l + 4 + e] = lanes[1][4 * l + e];
                }
        }
    store_output(t, kvh, unscaled, sums);
}
#endif

/* The register path of a (G, D) shape: bf16 pairs where the CPU multiplies them (bf16 queries
 * over a bf16 pool), else fp32 vectors, one copy per KV format. */
static inline __attribute__((always_inline)) void head_group_registers(const Task *t, int64_t kvh, float *scores,
                                                                       const int G, const int D) {
#ifdef __AVX512BF16__
    if (t->dtype == DTYPE_BFLOAT16 && t->kv == DTYPE_BFLOAT16) {
        head_group_bf16(t, kvh, scores, G, D / 32);
        return;
    }
#endif
    switch (t->kv) {
    case DTYPE_BFLOAT16: head_group_simd(t, kvh, scores, G, D / LANES, DTYPE_BFLOAT16); break;
    case DTYPE_FP8_E4M3: head_group_simd(t, kvh, scores, G, D / LANES, DTYPE_FP8_E4M3); break;
    case DTYPE_FP8_E5M2: head_group_simd(t, kvh, scores, G, D / LANES, DTYPE_FP8_E5M2); break;
    case DTYPE_INT8: head_group_simd(t, kvh, scores, G, D / LANES, DTYPE_INT8); break;
    default: head_group_simd(t, kvh, scores, G, D / LANES, DTYPE_FLOAT32); break;
    }
}

/* The register path for this shape, instantiated for head sizes 64 and 128 and G <= 8;
 * returns 0 when the shape is not one of them. */
static int head_group_fast(const Task *t, int64_t kvh, float *scores) {
    const int64_t G = t->H / t->Hkv, D = t->D;
#define SHAPE(g, d)                                  \
    if (G == g && D == d) {                          \
        head_group_registers(t, kvh, scores, g, d);  \
        return 1;                                    \
    }
    SHAPE(1, 64) SHAPE(2, 64) SHAPE(3, 64) SHAPE(4, 64) SHAPE(5, 64) SHAPE(6, 64) SHAPE(7, 64) SHAPE(8, 64)
    SHAPE(1, 128) SHAPE(2, 128) SHAPE(3, 128) SHAPE(4, 128) SHAPE(5, 128) SHAPE(6, 128) SHAPE(7, 128) SHAPE(8, 128)
#undef SHAPE
    return 0;
}
#else
static int head_group_fast(const Task *t, int64_t kvh, float *scores) {
    (void)t, (void)kvh, (void)scores;
    return 0;
}
#endif

/* Row b's new K and V (all kv heads) into the slot of its last position: already in the pool's
 * format (only unquantized pools take new rows here; the caller quantizes and stores 8-bit
 * ones itself). */
static void store_new(const Task *call, const int64_t *pages, int64_t page_size, int64_t seq_len, int64_t b) {
    const size_t elem = element_size(call->kv), bytes = call->Hkv * call->D * elem;
    const int64_t slot = pages[(seq_len - 1) / page_size] * page_size + (seq_len - 1) % page_size;
    const int64_t dst = slot * call->Hkv * call->D * elem;
    memcpy((char *)call->k_pool + dst, (const char *)call->k_new + b * call->k_row_stride * elem, bytes);
    memcpy((char *)call->v_pool + dst, (const char *)call->v_new + b * call->v_row_stride * elem, bytes);
}

/* Request `task.b`, kv heads [kv0, kv1): attend (its new K/V already stored). */
static void attend(Task *task, const int64_t *pages, int64_t page_size, int64_t kv0, int64_t kv1,
                   int64_t *slots, float *scratch) {
    const int64_t L = task->seq_len, D = task->D, Hkv = task->Hkv;
    /* page by page: a 64-bit division per position took an eighth of a short request's time */
    for (int64_t start = 0, page = 0; start < L; start += page_size, page++)
        for (int64_t i = start; i < start + page_size && i < L; i++) slots[i] = pages[page] * page_size + i - start;
    task->slots = slots;
    task->kv0 = kv0, task->kv1 = kv1;
    const int64_t G = task->H / Hkv;
    for (int64_t kvh = kv0; kvh < kv1; kvh++) {
        if (!head_group_fast(task, kvh, scratch + 2 * G * D)) head_group_portable(task, kvh, scratch);
    }
}

/* `dtype` is q's and out's (fp32 or bf16), `kv` the pools' format (k/v_scales for int8, else
 * NULL). Returns 0 on success, 1 when a thread could not get its scratch memory. */
int paged_decode_attention(const void *q, int64_t q_row_stride, const void *k_new,
                           int64_t k_row_stride, const void *v_new, int64_t v_row_stride,
                           void *k_pool, void *v_pool, const int64_t *page_table,
                           int64_t pt_stride, const int64_t *seq_lens, void *out, int64_t B,
                           int64_t H, int64_t Hkv, int64_t D, int64_t page_size, float scale,
                           int dtype, int kv, const uint16_t *k_scales, const uint16_t *v_scales,
                           int num_threads) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    /* A task is a whole request (its rows of all kv heads are neighbours in memory) when there
     * are enough requests to keep every thread busy, else one kv head of a request. */
    const int64_t heads_per_task = B >= 4 * num_threads ? Hkv : 1;
    const int64_t tasks_per_request = Hkv / heads_per_task;
    const int64_t G = H / Hkv;
    /* q and accumulators, scores, and (bf16) the weights rounded in pairs */
    const size_t scratch_floats = (size_t)(2 * G * D + 2 * G * (max_len + 1));
    const Task call = {q, k_new, v_new, q_row_stride, k_row_stride, v_row_stride, k_pool, v_pool,
                       out, H, Hkv, D, scale, dtype, kv, k_scales, v_scales, 0, 0, 0, 0, NULL, NULL, 0, 0};
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(scratch_floats * sizeof(float));
        int64_t *slots = malloc(max_len * sizeof(int64_t));
        failed = scratch == NULL || slots == NULL;
        if (k_new != NULL) {
#pragma omp for
            for (int64_t b = 0; b < B; b++) store_new(&call, page_table + b * pt_stride, page_size, seq_lens[b], b);
        } /* the loop's barrier: every row's K/V is in place before any row attends */
#pragma omp for schedule(dynamic, 1)
        for (int64_t index = 0; index < B * tasks_per_request; index++) {
            if (failed) continue;
            Task task = call;
            task.b = index / tasks_per_request;
            /* tasks are handed out in order: a thread's next request is about num_threads on */
            const int64_t next = task.b + num_threads;
            if (heads_per_task == Hkv && next < B) {
                task.next_pages = page_table + next * pt_stride;
                task.next_len = seq_lens[next];
                task.page_size = page_size;
            }
            task.seq_len = seq_lens[task.b];
            const int64_t kv0 = (index % tasks_per_request) * heads_per_task;
            attend(&task, page_table + task.b * pt_stride, page_size, kv0, kv0 + heads_per_task,
                   slots, scratch);
        }
        free(scratch);
        free(slots);
    }
    return failed;
}
