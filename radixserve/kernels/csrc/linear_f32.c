/* fp32 linear layers on the CPU: y = x @ W^T + b with W prepacked into column panels.
 *
 * At decode batch sizes (a few to a few hundred rows) a linear layer is bound by reading its
 * weights, and MKL's sgemm, handed the row-major [N, K] weight of nn.Linear, repacks it on
 * every call and streams it at well under the memory bandwidth. Here the weight is packed
 * once, at load, into panels of PANEL consecutive output columns:
 *
 *   panels [ceil(N / PANEL), K, PANEL]   panels[p, k, c] = W[p * PANEL + c, k] (0 past N)
 *
 * so each panel is one contiguous stream. For each tile of up to TILE_ROWS rows of x a thread
 * keeps TILE_ROWS x PANEL sums in registers while sweeping k once over the panel (from L2
 * after the first tile), and it prefetches its next panel while it works. Rows are taken
 * ROW_CHUNK at a time so the x rows a panel meets stay in cache.
 *
 * Every output is one fp32 dot product summed in k order, the bias added last; MKL sums in
 * another order, so results differ from torch's in the last bits.
 *
 *   x [M, K] (rows x_row_stride elements apart), y [M, N] contiguous, bias [N] or NULL
 */
#include <stdint.h>
#include <string.h>

#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define PANEL 64
#define TILE_ROWS 6
#define ROW_CHUNK 240

int linear_f32_panel_width(void) { return PANEL; }

#ifdef __AVX512F__
/* The m (<= TILE_ROWS, a constant after inlining) rows at x times one panel, into y. */
static inline __attribute__((always_inline)) void tile_avx512(
    const float *x, int64_t x_stride, const float *panel, int64_t K, const float *bias, float *y,
    int64_t N, int64_t columns_left, const char *prefetch, int64_t prefetch_lines, const int m) {
    __m512 acc[TILE_ROWS][4];
    for (int i = 0; i < m; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t due = 0; /* prefetch_lines cache lines spread evenly over the K steps */
    for (int64_t k = 0; k < K; k++) {
        for (due += prefetch_lines; due >= K; due -= K, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1);
        const float *row = panel + k * PANEL;
        const __m512 w0 = _mm512_loadu_ps(row), w1 = _mm512_loadu_ps(row + 16);
        const __m512 w2 = _mm512_loadu_ps(row + 32), w3 = _mm512_loadu_ps(row + 48);
        for (int i = 0; i < m; i++) {
            const __m512 a = _mm512_set1_ps(x[i * x_stride + k]);
            acc[i][0] = _mm512_fmadd_ps(a, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(a, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(a, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(a, w3, acc[i][3]);
        }
    }
    for (int j = 0; j < 4; j++) {
        const int64_t left = columns_left - 16 * j;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < m; i++)
            _mm512_mask_storeu_ps(y + i * N + 16 * j, mask, bias != NULL ? _mm512_add_ps(acc[i][j], b) : acc[i][j]);
    }
}
#else
/* The portable tile: the same sums in the same order, left to the compiler to vectorise. */
static void tile_portable(const float *x, int64_t x_stride, const float *panel, int64_t K,
                          const float *bias, float *y, int64_t N, int64_t columns_left, int m) {
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

static void tile(const float *x, int64_t x_stride, const float *panel, int64_t K, const float *bias,
                 float *y, int64_t N, int64_t columns_left, const char *prefetch, int64_t prefetch_lines,
                 int m) {
#ifdef __AVX512F__
    switch (m) { /* one specialised copy per row count: the tile's loops fully unrolled */
    case 6: tile_avx512(x, x_stride, panel, K, bias, y, N, columns_left, prefetch, prefetch_lines, 6); return;
    case 5: tile_avx512(x, x_stride, panel, K, bias, y, N, columns_left, prefetch, prefetch_lines, 5); return;
    case 4: tile_avx512(x, x_stride, panel, K, bias, y, N, columns_left, prefetch, prefetch_lines, 4); return;
    case 3: tile_avx512(x, x_stride, panel, K, bias, y, N, columns_left, prefetch, prefetch_lines, 3); return;
    case 2: tile_avx512(x, x_stride, panel, K, bias, y, N, columns_left, prefetch, prefetch_lines, 2); return;
    default: tile_avx512(x, x_stride, panel, K, bias, y, N, columns_left, prefetch, prefetch_lines, 1); return;
    }
#else
    (void)prefetch, (void)prefetch_lines;
    tile_portable(x, x_stride, panel, K, bias, y, N, columns_left, m);
#endif
}

void linear_f32(const float *x, int64_t x_row_stride, const float *panels, const float *bias,
                float *y, int64_t M, int64_t K, int64_t N, int num_threads) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    const int64_t panel_lines = K * PANEL * (int64_t)sizeof(float) / 64;
#pragma omp parallel num_threads(num_threads) if (M * K * N >= 1 << 18)
    for (int64_t r0 = 0; r0 < M; r0 += ROW_CHUNK) {
        const int64_t r1 = r0 + ROW_CHUNK < M ? r0 + ROW_CHUNK : M;
        const int64_t tiles = (r1 - r0 + TILE_ROWS - 1) / TILE_ROWS;
        /* Work items are (panel, share of its tiles), panel-major, so each thread streams a
         * run of panels; with few panels each is split into shares so the threads stay
         * evenly loaded (a split panel is read by two threads, the second from L3). */
        const int64_t wanted = 8 * (int64_t)omp_get_num_threads();
        int64_t shares = num_panels >= wanted ? 1 : (wanted + num_panels - 1) / num_panels;
        if (shares > tiles) shares = tiles;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_panels * shares; item++) {
            const int64_t p = item / shares, share = item % shares;
            const int64_t t0 = tiles * share / shares, t1 = tiles * (share + 1) / shares;
            const float *panel = panels + p * K * PANEL;
            /* this item's tiles prefetch the next panel into L2 between them, each its part
             * of the cache lines spread over its k steps */
            const int64_t lines_per_tile = (panel_lines + (t1 - t0) - 1) / (t1 - t0);
            for (int64_t t = t0; t < t1; t++) {
                const int64_t row = r0 + t * TILE_ROWS;
                const int rows = r1 - row < TILE_ROWS ? (int)(r1 - row) : TILE_ROWS;
                const int64_t first = (t - t0) * lines_per_tile;
                const int64_t count = p + 1 == num_panels || first >= panel_lines ? 0
                                      : first + lines_per_tile > panel_lines ? panel_lines - first
                                      : lines_per_tile;
                const char *prefetch = (const char *)(panel + K * PANEL) + 64 * first;
                tile(x + row * x_row_stride, x_row_stride, panel, K, bias == NULL ? NULL : bias + p * PANEL,
                     y + row * N + p * PANEL, N, N - p * PANEL, prefetch, count, rows);
            }
        }
    }
}
