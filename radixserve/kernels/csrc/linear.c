/* Linear layers on the CPU: y = x @ W^T + b with W prepacked into column panels, fp32 or bf16.
 *
 * At decode batch sizes (a few to a few hundred rows) a linear layer is bound by reading its
 * weights, and MKL's sgemm, handed the row-major [N, K] weight of nn.Linear, repacks it on
 * every call and streams it at well under the memory bandwidth. Here the weight is packed
 * once, at load, into panels of PANEL consecutive output columns, as 32-bit words:
 *
 *   panels [ceil(N / PANEL), W, PANEL]   fp32: W = K, word (k, c) = W[p * PANEL + c, k]
 *                                        bf16: W = K / 2, word (k, c) = the bf16 pair
 *                                              W[p * PANEL + c, 2k], W[.., 2k + 1]
 *   (zero past N)
 *
 * so each panel is one contiguous stream. For each tile of up to TILE_ROWS rows of x a thread
 * keeps TILE_ROWS x PANEL fp32 sums in registers while sweeping the panel's words once (from
 * L2 after the first tile), and it prefetches its next panel while it works. Rows are taken
 * ROW_CHUNK at a time so the x rows a panel meets stay in cache. PANEL, TILE_ROWS and ROW_CHUNK
 * are per build (ISA tier): the tile is sized to the registers, and `pack_linear` asks
 * `linear_panel_width` so the packed layout follows the build.
 *
 * bf16 multiplies pairs: with AVX-512 BF16 by its dot product (vdpbf16ps), the layout oneDNN
 * uses on CPUs without AMX, whose kernels spend more of their time on each small decode matmul
 * than this streaming loop; with AVX-512F or AVX2 alone by widening both halves of each pair
 * to fp32 (a bf16 is the top half of an fp32) and two FMAs, first element first, in the tile
 * or, for many rows, once per panel (WIDENS_BF16 below); on AVX2, 4 to 11 rows (a checked
 * draft, a small decode batch) take taller tiles over the rows widened once (tall_sums_avx2).
 * The portable build serves fp32 only.
 *
 * Every output is one fp32 dot product summed in k order (bf16: in pairs), the bias added
 * last, bf16 rounded once; MKL and oneDNN sum in other orders, so results differ from
 * torch's in the last bits. bf16 inputs may also give fp32 outputs, the sums unrounded: an LM
 * head's logits, where rounding to bf16 makes near-ties exact ties and greedy decoding then
 * takes the lower token id, not the likelier one.
 *
 *   x [M, K] (rows x_row_stride elements apart), bias [N] or NULL, both of the input dtype;
 *   y [M, N] contiguous, of the output dtype (the input's, or fp32)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "dtypes.h"

#if defined(__AVX512F__)
#include <immintrin.h>
/* 4 zmm per tile row, 24 sums of the 32 registers */
#define PANEL 64
#define TILE_ROWS 6
#define ROW_CHUNK 240
#define SERVES_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2.h"
/* 16 ymm: 4 per tile row, 12 sums, plus a row's x broadcast for each of the 3 rows and one
 * panel vector (x stays in registers; the weights are read once per step). AVX2-only CPUs
 * have smaller L2s than the AVX-512 servers (256 KiB to 1 MiB), so a chunk takes fewer rows. */
#define PANEL 32
#define TILE_ROWS 3
#define ROW_CHUNK 120
#define SERVES_BF16 1
#else
#define PANEL 64
#define TILE_ROWS 6
#define ROW_CHUNK 240
#define SERVES_BF16 0
#endif

int linear_panel_width(void) { return PANEL; }

/* Whether this build serves the dtype: fp32 always, bf16 with AVX2 or AVX-512. */
int linear_serves(int dtype) {
    return dtype == DTYPE_FLOAT32 || (SERVES_BF16 && dtype == DTYPE_BFLOAT16);
}

#if defined(__AVX512F__)
/* The m (<= TILE_ROWS) rows at x times one panel of `words` words, into y. m and DT are
 * constants after inlining. */
static inline __attribute__((always_inline)) void tile_avx512(
    const void *x, int64_t x_stride, const uint32_t *panel, int64_t words, const void *bias, void *y,
    int64_t N, int64_t columns_left, const char *prefetch, int64_t prefetch_lines, const int m, const int DT,
    const int OT) {
    __m512 acc[TILE_ROWS][4];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t due = 0; /* prefetch_lines cache lines spread evenly over the steps */
    for (int64_t k = 0; k < words; k++) {
        for (due += prefetch_lines; due >= words; due -= words, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1);
        const uint32_t *row = panel + k * PANEL;
#ifndef __AVX512BF16__
        if (DT == DTYPE_BFLOAT16) {
            /* no pair dot product: the pairs' first elements times x[2k] into every sum, then
             * their second elements times x[2k + 1], all widened to fp32 (24 sums, 4 panel
             * vectors and a broadcast fit the 32 registers) */
            for (int half = 0; half < 2; half++) {
                __m512 w[4];
                for (int j = 0; j < 4; j++) {
                    const __m512i pairs = _mm512_loadu_si512(row + 16 * j);
                    w[j] = _mm512_castsi512_ps(half ? _mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u))
                                                    : _mm512_slli_epi32(pairs, 16));
                }
                for (int i = 0; i < m; i++) {
                    const uint32_t pair = ((const uint32_t *)((const char *)x + i * x_stride * 2))[k];
                    const __m512 a = _mm512_castsi512_ps(_mm512_set1_epi32((int)(half ? pair & 0xFFFF0000u : pair << 16)));
                    for (int j = 0; j < 4; j++) acc[i][j] = _mm512_fmadd_ps(a, w[j], acc[i][j]);
                }
            }
            continue;
        }
#endif
        __m512i w[4];
        for (int j = 0; j < 4; j++) w[j] = _mm512_loadu_si512(row + 16 * j);
        for (int i = 0; i < m; i++) {
            /* word k of x's row i: one fp32, or a bf16 pair */
            const __m512i a = _mm512_set1_epi32(((const int32_t *)((const char *)x + i * x_stride * element_size(DT)))[k]);
            for (int j = 0; j < 4; j++) {
#ifdef __AVX512BF16__
                if (DT == DTYPE_BFLOAT16) {
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)a, (__m512bh)w[j]);
                    continue;
                }
#endif
                acc[i][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(w[j]), acc[i][j]);
            }
        }
    }
    for (int j = 0; j < 4; j++) {
        const int64_t left = columns_left - 16 * j;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        const __m512 b = bias == NULL ? _mm512_setzero_ps()
            : DT == DTYPE_BFLOAT16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + 16 * j)), 16))
            : _mm512_maskz_loadu_ps(mask, (const float *)bias + 16 * j);
        if (OT == DTYPE_BFLOAT16) {
            for (int i = 0; i < m; i++) {
                const __m512 sum = _mm512_add_ps(acc[i][j], b);
                /* round to nearest even, as torch's float -> bf16 */
                const __m512i bits = _mm512_castps_si512(sum);
                const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
                const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
                _mm256_mask_storeu_epi16((uint16_t *)y + i * N + 16 * j, mask, _mm512_cvtepi32_epi16(rounded));
            }
        } else {
            for (int i = 0; i < m; i++)
                _mm512_mask_storeu_ps((float *)y + i * N + 16 * j, mask, bias != NULL ? _mm512_add_ps(acc[i][j], b) : acc[i][j]);
        }
    }
}
#define SIMD_TILE tile_avx512
#elif defined(__AVX2__) && defined(__FMA__)
/* Column vector j of a tile's bias (8 values from bias + 8j, bf16 or fp32 as bf16 says), of
 * which `left` (< 8: the last panel's tail) lie before N; zero without a bias. */
static inline __attribute__((always_inline)) __m256 tile_bias_avx2(const void *bias, int j, int64_t left, const int bf16) {
    if (bias == NULL) return _mm256_setzero_ps();
    const int64_t elem = bf16 ? 2 : 4;
    const char *src = (const char *)bias + 8 * j * elem;
    /* past N through a buffer: AVX2 has no masked 16-bit loads or stores */
    char part[32] = {0};
    if (left < 8) src = memcpy(part, src, left * elem);
    return avx2_load(src, bf16);
}

/* A tile's sum plus its bias, stored at dst in dtype OT, `left` values of it if under 8. */
static inline __attribute__((always_inline)) void tile_store_avx2(char *dst, __m256 sum, int64_t left, const int OT) {
    if (left >= 8) {
        avx2_store(dst, sum, OT == DTYPE_BFLOAT16);
    } else {
        char part[32];
        avx2_store(part, sum, OT == DTYPE_BFLOAT16);
        memcpy(dst, part, left * element_size(OT));
    }
}

/* As tile_avx512, in 8-lane vectors. */
static inline __attribute__((always_inline)) void tile_avx2(
    const void *x, int64_t x_stride, const uint32_t *panel, int64_t words, const void *bias, void *y,
    int64_t N, int64_t columns_left, const char *prefetch, int64_t prefetch_lines, const int m, const int DT,
    const int OT) {
    enum { VECS = PANEL / 8 };
    const int bf16 = DT == DTYPE_BFLOAT16;
    const int64_t elem = element_size(DT);
    __m256 acc[TILE_ROWS][VECS];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < VECS; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t due = 0; /* prefetch_lines cache lines spread evenly over the steps */
    for (int64_t k = 0; k < words; k++) {
        for (due += prefetch_lines; due >= words; due -= words, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1);
        const uint32_t *row = panel + k * PANEL;
        /* word k of each x row: one fp32, or a bf16 pair taken in two halves (no bf16
         * arithmetic in AVX2): the pairs' first elements times x[2k] into every sum, then their
         * second elements times x[2k + 1], all widened to fp32. Per half the rows' broadcasts
         * stay in registers while each panel vector is read once. */
        for (int half = 0; half < 1 + bf16; half++) {
            __m256 a[TILE_ROWS];
            for (int i = 0; i < m; i++) {
                /* widened in a general register, then broadcast: the vector registers are
                 * all taken */
                const uint32_t word = ((const uint32_t *)((const char *)x + i * x_stride * elem))[k];
                a[i] = _mm256_castsi256_ps(_mm256_set1_epi32((int)(!bf16 ? word : half ? word & 0xFFFF0000u : word << 16)));
            }
            for (int j = 0; j < VECS; j++) {
                const __m256i pairs = _mm256_loadu_si256((const __m256i *)(row + 8 * j));
                /* second elements: the words with their low halves cleared, blended in from
                 * a[0], whose low halves are zero in this half (an AND would keep its mask in a
                 * 17th register and spill sums) */
                const __m256 w = !bf16 ? _mm256_castsi256_ps(pairs)
                                 : half ? _mm256_castsi256_ps(_mm256_blend_epi16(pairs, _mm256_castps_si256(a[0]), 0x55))
                                        : avx2_pair_low(pairs);
                for (int i = 0; i < m; i++) acc[i][j] = _mm256_fmadd_ps(a[i], w, acc[i][j]);
            }
        }
    }
    for (int j = 0; j < VECS; j++) {
        const int64_t left = columns_left - 8 * j;
        if (left <= 0) break;
        const __m256 b = tile_bias_avx2(bias, j, left, bf16);
        for (int i = 0; i < m; i++)
            tile_store_avx2((char *)y + (i * N + 8 * j) * element_size(OT), _mm256_add_ps(acc[i][j], b), left, OT);
    }
}
#define SIMD_TILE tile_avx2

/* A tall bf16 tile for AVX2: up to TALL_ROWS rows times half a panel (TALL_COLUMNS columns, two
 * vectors), x given widened to fp32 (widened_rows). tile_avx2's 3 rows broadcast each x word
 * through a general register and widen 4 panel vectors per 12 FMAs; here each broadcast is one
 * load and 2 widened vectors feed 12 FMAs, so the FMA units, not the shuffles, set the pace.
 * The sums are tile_avx2's: pair element 2k, then 2k + 1, for every k in order, so a row's
 * outputs do not depend on the tile it is in. Registers: 12 sums, 2 panel vectors, a broadcast
 * and (under 6 rows) the high half's mask. */
#define TALL_ROWS 6
#define TALL_COLUMNS 16
#define TALL_MIN_ROWS 4
static inline __attribute__((always_inline)) void tall_sums_avx2(
    const float *x, int64_t x_stride, const uint32_t *panel, int64_t words, const char *prefetch,
    int64_t prefetch_lines, const int m, float sums[][TALL_COLUMNS]) {
    /* the sums as named variables, not an array: gcc keeps an array of 12 vectors in memory as
     * well, storing it at every step */
#define TALL_ROW(i) __m256 s##i##0 = _mm256_setzero_ps(), s##i##1 = _mm256_setzero_ps();
    TALL_ROW(0) TALL_ROW(1) TALL_ROW(2) TALL_ROW(3) TALL_ROW(4) TALL_ROW(5)
#undef TALL_ROW
    int64_t due = 0;
    for (int64_t k = 0; k < words; k++) {
        for (due += prefetch_lines; due >= words; due -= words, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1);
        const __m256i *row = (const __m256i *)(panel + k * PANEL);
        const float *xk = x + 2 * k;
        for (int half = 0; half < 2; half++) {
            const __m256i p0 = _mm256_loadu_si256(row), p1 = _mm256_loadu_si256(row + 1);
            /* second elements: masked, or at 6 rows, where the mask would take the 16th
             * register and spill sums, cleared by two shifts */
#define HIGH(p) (m < 6 ? avx2_pair_high(p) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(p, 16), 16)))
            const __m256 w0 = half ? HIGH(p0) : avx2_pair_low(p0);
            const __m256 w1 = half ? HIGH(p1) : avx2_pair_low(p1);
#undef HIGH
#define TALL_ROW(i)                                                           \
            if (i < m) {                                                      \
                const __m256 a = _mm256_broadcast_ss(xk + i * x_stride + half); \
                s##i##0 = _mm256_fmadd_ps(a, w0, s##i##0);                    \
                s##i##1 = _mm256_fmadd_ps(a, w1, s##i##1);                    \
            }
            TALL_ROW(0) TALL_ROW(1) TALL_ROW(2) TALL_ROW(3) TALL_ROW(4) TALL_ROW(5)
#undef TALL_ROW
        }
    }
#define TALL_ROW(i)                                      \
    if (i < m) {                                         \
        _mm256_storeu_ps(sums[i], s##i##0);              \
        _mm256_storeu_ps(sums[i] + 8, s##i##1);          \
    }
    TALL_ROW(0) TALL_ROW(1) TALL_ROW(2) TALL_ROW(3) TALL_ROW(4) TALL_ROW(5)
#undef TALL_ROW
}

/* tall_sums_avx2 for M rows, out of line: inlined into a function with memcpy calls (the
 * epilogue's tails), which clobber every vector register, gcc saves the sums at every step */
#define TALL_SUMS(M) \
    static __attribute__((noinline)) void tall_sums_##M(const float *x, int64_t x_stride, const uint32_t *panel, \
                                                        int64_t words, const char *prefetch, int64_t lines, \
                                                        float sums[][TALL_COLUMNS]) { \
        tall_sums_avx2(x, x_stride, panel, words, prefetch, lines, M, sums); \
    }
TALL_SUMS(3) TALL_SUMS(4) TALL_SUMS(5) TALL_SUMS(6)
#undef TALL_SUMS

/* m (3 to 6: TALL_MIN_ROWS or more rows spread evenly over tiles) rows of x, widened, times
 * half a panel, into y: the sums, then the bias and the stores. */
static void tall_tile(const float *x, int64_t x_stride, const uint32_t *panel, int64_t words, const uint16_t *bias,
                      void *y, int64_t N, int64_t columns_left, const char *prefetch, int64_t lines, int m,
                      int out_dtype) {
    float sums[TALL_ROWS][TALL_COLUMNS];
    switch (m) {
    case 6: tall_sums_6(x, x_stride, panel, words, prefetch, lines, sums); break;
    case 5: tall_sums_5(x, x_stride, panel, words, prefetch, lines, sums); break;
    case 4: tall_sums_4(x, x_stride, panel, words, prefetch, lines, sums); break;
    default: tall_sums_3(x, x_stride, panel, words, prefetch, lines, sums); break;
    }
    for (int j = 0; j < TALL_COLUMNS / 8; j++) {
        const int64_t left = columns_left - 8 * j;
        if (left <= 0) break;
        const __m256 b = tile_bias_avx2(bias, j, left, 1);
        for (int i = 0; i < m; i++)
            tile_store_avx2((char *)y + (i * N + 8 * j) * element_size(out_dtype),
                            _mm256_add_ps(_mm256_loadu_ps(sums[i] + 8 * j), b), left, out_dtype);
    }
}
#endif

/* Without a bf16 pair dot product (AVX2, AVX-512F) a bf16 tile widens each panel word it
 * reads, and a panel met by several tiles (many rows: a prefill chunk) is widened once per
 * tile. There the panel is widened once into an fp32 copy in L2
 * (widened_panel) and the rows once into fp32 (widened_rows), and the fp32 tile runs over both:
 * the same FMAs in the same order (pair element 2k, then 2k + 1), so the same sums, with
 * fewer instructions per FMA. A copy larger than WIDEN_MAX_BYTES would not stay in L2; a panel
 * met by fewer than WIDEN_MIN_TILES tiles (a decode step, a short draft) is read as it is, in
 * tall tiles on AVX2 from TALL_MIN_ROWS rows. */
#if defined(SIMD_TILE) && !defined(__AVX512BF16__)
#define WIDENS_BF16 1
#else
#define WIDENS_BF16 0
#endif
#define WIDEN_MAX_BYTES (1 << 20)
#define WIDEN_MIN_TILES 4

#ifdef SIMD_TILE
/* One specialised copy per row count, dtype and output dtype: the tile's loops fully unrolled. */
static inline __attribute__((always_inline)) void tile_for(
    const void *x, int64_t x_stride, const uint32_t *panel, int64_t words, const void *bias, void *y,
    int64_t N, int64_t columns_left, const char *prefetch, int64_t lines, int m, const int DT, const int OT) {
#define TILE_CASE(M) case M: SIMD_TILE(x, x_stride, panel, words, bias, y, N, columns_left, prefetch, lines, M, DT, OT); return;
    switch (m) {
#if TILE_ROWS >= 6
    TILE_CASE(6)
    TILE_CASE(5)
    TILE_CASE(4)
#endif
    TILE_CASE(3)
    TILE_CASE(2)
    default: SIMD_TILE(x, x_stride, panel, words, bias, y, N, columns_left, prefetch, lines, 1, DT, OT); return;
    }
#undef TILE_CASE
}

static void tile(const void *x, int64_t x_stride, const uint32_t *panel, int64_t words, const void *bias,
                 void *y, int64_t N, int64_t columns_left, const char *prefetch, int64_t lines, int m, int dtype,
                 int out_dtype) {
    if (dtype == DTYPE_BFLOAT16 && out_dtype == DTYPE_BFLOAT16)
        tile_for(x, x_stride, panel, words, bias, y, N, columns_left, prefetch, lines, m, DTYPE_BFLOAT16, DTYPE_BFLOAT16);
    else if (dtype == DTYPE_BFLOAT16)
        tile_for(x, x_stride, panel, words, bias, y, N, columns_left, prefetch, lines, m, DTYPE_BFLOAT16, DTYPE_FLOAT32);
#if WIDENS_BF16
    else if (out_dtype == DTYPE_BFLOAT16) /* a widened bf16 layer's tiles (widened_panel) */
        tile_for(x, x_stride, panel, words, bias, y, N, columns_left, prefetch, lines, m, DTYPE_FLOAT32, DTYPE_BFLOAT16);
#endif
    else
        tile_for(x, x_stride, panel, words, bias, y, N, columns_left, prefetch, lines, m, DTYPE_FLOAT32, DTYPE_FLOAT32);
}
#else
/* The portable tile (fp32 only): the same sums in the same order, left to the compiler to
 * vectorise. */
static void tile(const void *x_, int64_t x_stride, const uint32_t *panel_, int64_t K, const void *bias_,
                 void *y_, int64_t N, int64_t columns_left, const char *prefetch, int64_t lines, int m, int dtype,
                 int out_dtype) {
    (void)prefetch, (void)lines, (void)dtype, (void)out_dtype;
    const float *x = x_, *panel = (const float *)panel_, *bias = bias_;
    float *y = y_;
    float acc[TILE_ROWS][PANEL];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < K; k++) {
        const float *row = panel + k * PANEL;
        for (int i = 0; i < m; i++) {
            const float a = x[i * x_stride + k];
#pragma omp simd
            for (int c = 0; c < PANEL; c++) acc[i][c] += a * row[c];
        }
    }
    const int64_t width = columns_left < PANEL ? columns_left : PANEL;
    for (int i = 0; i < m; i++)
        for (int64_t c = 0; c < width; c++) y[i * N + c] = acc[i][c] + (bias != NULL ? bias[c] : 0.0f);
}
#endif

#if WIDENS_BF16
/* The calling thread's buffer of at least `bytes` (64-byte aligned), kept between calls: a
 * fresh multi-hundred-KB block per layer would be mmapped and page-faulted each time. */
static uint32_t *thread_buffer(size_t bytes) {
    static _Thread_local uint32_t *buffer = NULL;
    static _Thread_local size_t capacity = 0;
    if (bytes > capacity) {
        free(buffer);
        capacity = (bytes + 63) / 64 * 64;
        buffer = aligned_alloc(64, capacity);
        if (buffer == NULL) capacity = 0;
    }
    return buffer;
}

/* A bf16 panel [words, PANEL] of pairs as an fp32 panel [2 * words, PANEL]: row 2k holds the
 * pairs' first elements, row 2k + 1 their second (a bf16 is the top half of an fp32). */
static void widened_panel(const uint32_t *panel, int64_t words, uint32_t *wide) {
    for (int64_t k = 0; k < words; k++) {
        const uint32_t *src = panel + k * PANEL;
        uint32_t *lo = wide + 2 * k * PANEL, *hi = lo + PANEL;
#pragma omp simd
        for (int c = 0; c < PANEL; c++) {
            lo[c] = src[c] << 16;
            hi[c] = src[c] & 0xFFFF0000u;
        }
    }
}

/* Rows [r0, r1) of bf16 x as fp32 rows of K, into wide (row r at (r - r0) * K). */
static void widened_rows(const uint16_t *x, int64_t x_stride, int64_t r0, int64_t r1, int64_t K, uint32_t *wide) {
#pragma omp for schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *src = x + r * x_stride;
        uint32_t *dst = wide + (r - r0) * K;
#pragma omp simd
        for (int64_t k = 0; k < K; k++) dst[k] = (uint32_t)src[k] << 16;
    }
}
#endif

/* How many lines of the next panel (`total` lines) a tile call prefetches when its share starts
 * at line `first` and is `per` lines long: none past the end, nor after the last panel. */
static inline int64_t prefetch_count(int64_t first, int64_t per, int64_t total, int last_panel) {
    return last_panel || first >= total ? 0 : first + per > total ? total - first : per;
}

/* Only call for a dtype `linear_serves`; bf16 needs an even K. out_dtype is dtype or fp32. */
void linear(const void *x, int64_t x_row_stride, const uint32_t *panels, const void *bias, void *y,
            int64_t M, int64_t K, int64_t N, int dtype, int out_dtype, int num_threads) {
    const int64_t elem = element_size(dtype), out_elem = element_size(out_dtype), words = K * elem / 4;
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_lines = words * PANEL * 4 / 64;
#if WIDENS_BF16
    /* the widened rows of a row chunk, shared by the threads (widened_rows) */
    const int may_widen = dtype == DTYPE_BFLOAT16 && M >= WIDEN_MIN_TILES * TILE_ROWS &&
                          (int64_t)sizeof(float) * K * PANEL <= WIDEN_MAX_BYTES;
#if defined(TALL_ROWS)
    const int may_tall = dtype == DTYPE_BFLOAT16 && M >= TALL_MIN_ROWS;
#else
    const int may_tall = 0;
#endif
    uint32_t *wide_rows = may_widen || may_tall ? malloc(sizeof(float) * K * (M < ROW_CHUNK ? M : ROW_CHUNK)) : NULL;
#endif
#pragma omp parallel num_threads(num_threads) if (M * K * N >= 1 << 18)
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int64_t r1 = r0 + ROW_CHUNK < M ? r0 + ROW_CHUNK : M;
        int64_t tiles = (r1 - r0 + TILE_ROWS - 1) / TILE_ROWS;
        /* Work items are (panel, share of its tiles), panel-major, so each thread streams a
         * run of panels; with few panels each is split into shares so the threads stay
         * evenly loaded (a split panel is read by two threads, the second from L3). */
        const int64_t wanted = 8 * (int64_t)omp_get_num_threads();
        int64_t shares = num_panels >= wanted ? 1 : (wanted + num_panels - 1) / num_panels;
        if (shares > tiles) shares = tiles;
#if WIDENS_BF16
        /* widened where every item's panel meets at least WIDEN_MIN_TILES full tiles (the same
         * for all threads): with fewer, the copy costs about what it saves */
        uint32_t *wide_panel = NULL;
        const int widen = may_widen && wide_rows != NULL && (r1 - r0) / shares >= WIDEN_MIN_TILES * TILE_ROWS;
#if defined(TALL_ROWS)
        /* otherwise, from TALL_MIN_ROWS rows, tall tiles over the rows widened */
        const int tall = may_tall && wide_rows != NULL && !widen && r1 - r0 >= TALL_MIN_ROWS;
#else
        const int tall = 0;
#endif
        if (widen || tall)
            widened_rows((const uint16_t *)x, x_row_stride, r0, r1, K, wide_rows); /* ends in a barrier */
        if (widen) wide_panel = thread_buffer(sizeof(float) * K * PANEL);
#if defined(TALL_ROWS)
        if (tall) {
            tiles = (r1 - r0 + TALL_ROWS - 1) / TALL_ROWS;
            if (shares > tiles) shares = tiles;
        }
#endif
#endif
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_panels * shares; item++) {
            const int64_t p = item / shares, share = item % shares;
            const int64_t t0 = tiles * share / shares, t1 = tiles * (share + 1) / shares;
            const uint32_t *panel = panels + p * words * PANEL;
            /* this item's tiles prefetch the next panel into L2 between them, each its part
             * of the cache lines spread over its steps */
            const int64_t lines_per_tile = (panel_lines + (t1 - t0) - 1) / (t1 - t0);
            /* the tiles' operands: x and the panel as given, or widened to fp32 */
            const void *rows_x = (const char *)x + r0 * x_row_stride * elem;
            const void *panel_bias = bias == NULL ? NULL : (const char *)bias + p * PANEL * elem;
            const uint32_t *tile_panel = panel;
            int64_t rows_stride = x_row_stride, tile_words = words;
            int tile_dtype = dtype;
#if WIDENS_BF16
            float wide_bias[PANEL];
            if (widen && wide_panel != NULL) {
                widened_panel(panel, words, wide_panel);
                if (bias != NULL) {
                    const int64_t width = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
                    for (int64_t c = 0; c < PANEL; c++)
                        wide_bias[c] = c < width ? bf16_to_float(((const uint16_t *)panel_bias)[c]) : 0.0f;
                    panel_bias = wide_bias;
                }
                rows_x = wide_rows, rows_stride = K, tile_panel = wide_panel, tile_words = K, tile_dtype = DTYPE_FLOAT32;
            }
#endif
#if defined(TALL_ROWS)
            if (tall) {
                /* each tall tile in two calls, a half panel each, which share the prefetching */
                const int64_t calls = 2 * (t1 - t0), lines_per_call = (panel_lines + calls - 1) / calls;
                for (int64_t call = 0; call < calls; call++) {
                    /* the chunk's rows spread evenly over its tiles (9 rows: 4 + 5, not 6 + 3) */
                    const int64_t t = t0 + call / 2, half = call % 2, row = (r1 - r0) * t / tiles;
                    const int rows = (int)((r1 - r0) * (t + 1) / tiles - row);
                    const int64_t first = call * lines_per_call;
                    const int64_t count = prefetch_count(first, lines_per_call, panel_lines, p + 1 == num_panels);
                    const int64_t column = p * PANEL + half * TALL_COLUMNS;
                    if (column >= N) continue;
                    tall_tile((const float *)wide_rows + row * K, K, panel + half * TALL_COLUMNS, words,
                              bias == NULL ? NULL : (const uint16_t *)bias + column,
                              (char *)y + ((r0 + row) * N + column) * out_elem, N, N - column,
                              (const char *)(panel + words * PANEL) + 64 * first, count, rows, out_dtype);
                }
                continue;
            }
#endif
            const int64_t tile_elem = element_size(tile_dtype);
            for (int64_t t = t0; t < t1; t++) {
                const int64_t row = t * TILE_ROWS; /* in the chunk */
                const int rows = r1 - r0 - row < TILE_ROWS ? (int)(r1 - r0 - row) : TILE_ROWS;
                const int64_t first = (t - t0) * lines_per_tile;
                const int64_t count = prefetch_count(first, lines_per_tile, panel_lines, p + 1 == num_panels);
                const char *prefetch = (const char *)(panel + words * PANEL) + 64 * first;
                tile((const char *)rows_x + row * rows_stride * tile_elem, rows_stride, tile_panel, tile_words, panel_bias,
                     (char *)y + ((r0 + row) * N + p * PANEL) * out_elem, N, N - p * PANEL, prefetch, count, rows,
                     tile_dtype, out_dtype);
            }
        }
    }
#if WIDENS_BF16
    free(wide_rows);
#endif
}
