/* hpm.engine.precision int8's screen in C (int8/kernels.py builds and loads this file).
 *
 * screen_pairs: the candidate rule on a block's integer sums (q8.rule's, exact int32
 * compares): flat indices of the pairs with (img > tau_i and txt > tau_t) or img > floor_i or
 * txt > floor_t, or an extra mask set. One pass over both sums instead of a bool array per
 * compare.
 *
 * screen_int8: an int8 block's two GEMMs and screen_pairs' rule fused (AVX512-VNNI only). */
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* Rows r < nq of di and dt (int32 [nq, nm], row-major) against each row's thresholds fi, ti
 * (img: floor, tau) and ft, tt (txt); extra (uint8 [nq, nm]) or NULL. Writes first + the flat
 * index of each kept pair to out (room for nq * nm), ascending; returns how many. keep: room
 * for nm bytes. */
CLONES int64_t screen_pairs(const int32_t *di, const int32_t *dt, int64_t nq, int64_t nm,
                            const int32_t *fi, const int32_t *ti, const int32_t *ft,
                            const int32_t *tt, const uint8_t *extra, int64_t first,
                            int64_t *out, uint8_t *keep) {
    int64_t n = 0;
    for (int64_t r = 0; r < nq; r++) {
        const int32_t *x = di + r * nm, *y = dt + r * nm;
        const int32_t a = fi[r], b = ti[r], c = ft[r], e = tt[r];
        for (int64_t j = 0; j < nm; j++)
            keep[j] = (uint8_t)(((x[j] > b) & (y[j] > e)) | (x[j] > a) | (y[j] > c));
        if (extra)
            for (int64_t j = 0; j < nm; j++)
                keep[j] |= extra[r * nm + j];
        int64_t j = 0;
        for (; j + 8 <= nm; j += 8) {
            uint64_t w;
            memcpy(&w, keep + j, 8);
            if (!w)
                continue;
            for (int k = 0; k < 8; k++)
                if (keep[j + k])
                    out[n++] = first + r * nm + j + k;
        }
        for (; j < nm; j++)
            if (keep[j])
                out[n++] = first + r * nm + j;
    }
    return n;
}


/* screen_int8: a block's int8 GEMMs (S_ii and S_tt) and the candidate rule in one pass, with
 * AVX512-VNNI (vpdpbusd: u8 x s8 products, 4 a lane, summed into int32): no [nq, nm] int32
 * sums written and read again, and no GEMM call per similarity. The sums are exact integers, so
 * the kept pairs are screen_pairs' on torch's GEMMs, bit for bit. Members are packed per block
 * as u8 (m + 128) panels of 16 rows; a query row's sum then carries 128 x its values' sum, which
 * its thresholds are shifted by (in int64, clamped to int32: every biased sum lies well inside
 * int32, |sum| <= d 255 127, so the clamp keeps each compare). Returns -1 where the CPU lacks
 * AVX512-VNNI or a dimension is not a multiple of 4 (the caller runs torch's GEMMs). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

static int vnni = -1;

static int has_vnni(void) {
    if (vnni < 0) {
        __builtin_cpu_init();
        vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    }
    return vnni;
}

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vnni"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
#endif

#define MR 8              /* query rows of a tile */
#define CHUNK_PANELS 16   /* member panels (16 rows each) a row block runs through at once */

/* acc += a (u8) . b (s8), 4 bytes a lane. Inline asm: GCC 12 copies the intrinsic's
 * accumulator to a fresh register and back at every use (two moves per product here). */
#define DPBUSD(acc, a, b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))

/* members int8 [nm, d] (rows ld bytes apart, d % 4 == 0) -> panels of 16 members, each
 * [d / 4][16][4] bytes of m + 128; members past nm are zeros. */
static void pack(const int8_t *m, int64_t ld, int64_t nm, int64_t d, uint32_t *out) {
    const int64_t d4 = d / 4, np = (nm + 15) / 16;
    memset(out, 0, (size_t)(np * d4 * 64));
    for (int64_t j = 0; j < nm; j++) {
        uint32_t *p = out + (j / 16) * d4 * 16 + (j % 16);
        const int8_t *row = m + j * ld;
        for (int64_t k = 0; k < d4; k++) {
            uint32_t w;
            memcpy(&w, row + 4 * k, 4);
            p[k * 16] = w ^ 0x80808080u;
        }
    }
}

static int64_t row_sum(const int8_t *q, int64_t d) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= d; k += 64) {
        const __m512i x = _mm512_loadu_si512(q + k);
        DPBUSD(acc, ones, x);
    }
    int64_t s = _mm512_reduce_add_epi32(acc);
    for (; k < d; k++)
        s += q[k];
    return s;
}

/* One query row (r) against the tile's panels: its accumulators a<r>0 and (two) a<r>1. */
#define DOT(r)                                                                              \
    do {                                                                                    \
        int32_t w;                                                                          \
        memcpy(&w, q + (r) * ld + 4 * k, 4);                                                \
        const __m512i x = _mm512_set1_epi32(w);                                             \
        DPBUSD(a##r##0, m0, x);                                                             \
        if (two)                                                                            \
            DPBUSD(a##r##1, m1, x);                                                         \
    } while (0)

/* acc[r][h]: the biased sums of query rows r < rows (1 or MR) with panels p + h (h < 1 + two)
 * of one similarity. Inlined with constant rows and two: named accumulators, no selects. */
INLINE void tile(const int8_t *q, int64_t ld, int64_t d4, const uint32_t *panels, int64_t p,
                 int rows, int two, __m512i acc[MR][2]) {
    const __m512i z = _mm512_setzero_si512();
    __m512i a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
    __m512i a40 = z, a41 = z, a50 = z, a51 = z, a60 = z, a61 = z, a70 = z, a71 = z;
    const uint32_t *b0 = panels + p * d4 * 16, *b1 = b0 + d4 * 16;
    for (int64_t k = 0; k < d4; k++) {
        const __m512i m0 = _mm512_loadu_si512(b0 + k * 16);
        const __m512i m1 = two ? _mm512_loadu_si512(b1 + k * 16) : z;
        DOT(0);
        if (rows > 1) {
            DOT(1); DOT(2); DOT(3); DOT(4); DOT(5); DOT(6); DOT(7);
        }
    }
    acc[0][0] = a00, acc[0][1] = a01, acc[1][0] = a10, acc[1][1] = a11;
    acc[2][0] = a20, acc[2][1] = a21, acc[3][0] = a30, acc[3][1] = a31;
    acc[4][0] = a40, acc[4][1] = a41, acc[5][0] = a50, acc[5][1] = a51;
    acc[6][0] = a60, acc[6][1] = a61, acc[7][0] = a70, acc[7][1] = a71;
}

/* The rule's mask of rows r < rows against panels p + h, into masks[r * np + p + h]; lim: per
 * row the biased thresholds img floor, img tau, txt floor, txt tau. one: S_ii > floor alone
 * (no txt operands; q8.hits' one-space blocks). */
INLINE void tile_masks(const int8_t *qi, int64_t ldi, int64_t d4i, const int8_t *qt,
                       int64_t ldt, int64_t d4t, const uint32_t *pi, const uint32_t *pt,
                       int64_t p, int64_t np, int64_t nm, const int32_t *lim, int rows,
                       int two, int one, uint16_t *masks) {
    __m512i acc[MR][2];
    __mmask16 fi[MR][2], ti[MR][2], ft[MR][2], tt[MR][2];
    tile(qi, ldi, d4i, pi, p, rows, two, acc);
    for (int r = 0; r < rows; r++)
        for (int h = 0; h <= two; h++) {
            fi[r][h] = _mm512_cmpgt_epi32_mask(acc[r][h], _mm512_set1_epi32(lim[4 * r]));
            ti[r][h] = _mm512_cmpgt_epi32_mask(acc[r][h], _mm512_set1_epi32(lim[4 * r + 1]));
            ft[r][h] = tt[r][h] = 0;
        }
    if (!one) {
        tile(qt, ldt, d4t, pt, p, rows, two, acc);
        for (int r = 0; r < rows; r++)
            for (int h = 0; h <= two; h++) {
                ft[r][h] = _mm512_cmpgt_epi32_mask(acc[r][h], _mm512_set1_epi32(lim[4 * r + 2]));
                tt[r][h] = _mm512_cmpgt_epi32_mask(acc[r][h], _mm512_set1_epi32(lim[4 * r + 3]));
            }
    }
    for (int r = 0; r < rows; r++)
        for (int h = 0; h <= two; h++) {
            uint32_t m = one ? fi[r][h] : (ti[r][h] & tt[r][h]) | fi[r][h] | ft[r][h];
            const int64_t left = nm - (p + h) * 16;          /* members in this panel */
            if (left < 16)
                m &= (1u << left) - 1;
            masks[r * np + p + h] = (uint16_t)m;
        }
}

/* Rows r0 .. r0 + rows - 1 (rows 1 or MR) against panels c .. e - 1. */
INLINE void row_block(const int8_t *qi, int64_t ldi, int64_t d4i, const int8_t *qt,
                      int64_t ldt, int64_t d4t, const uint32_t *pi, const uint32_t *pt,
                      int64_t c, int64_t e, int64_t np, int64_t nm, const int32_t *lim,
                      int rows, int one, uint16_t *masks) {
    int64_t p = c;
    for (; p + 2 <= e; p += 2)
        tile_masks(qi, ldi, d4i, qt, ldt, d4t, pi, pt, p, np, nm, lim, rows, 1, one, masks);
    if (p < e)
        tile_masks(qi, ldi, d4i, qt, ldt, d4t, pi, pt, p, np, nm, lim, rows, 0, one, masks);
}

/* Every row block against every panel, a cache-sized chunk of panels at a time. */
INLINE void all_masks(const int8_t *qi, int64_t ldi, int64_t d4i, const int8_t *qt,
                      int64_t ldt, int64_t d4t, const uint32_t *pi, const uint32_t *pt,
                      int64_t nq, int64_t np, int64_t nm, const int32_t *lim, int one,
                      uint16_t *masks) {
    for (int64_t c = 0; c < np; c += CHUNK_PANELS) {
        const int64_t e = c + CHUNK_PANELS < np ? c + CHUNK_PANELS : np;
        for (int64_t b = 0; nq >= MR && b < nq; b += MR) {
            const int64_t r = b + MR <= nq ? b : nq - MR;   /* the tail: the last MR rows */
            row_block(qi + r * ldi, ldi, d4i, qt + r * ldt, ldt, d4t, pi, pt, c, e, np, nm,
                      lim + 4 * r, MR, one, masks + r * np);   /* (again: the same masks) */
        }
        for (int64_t r = 0; nq < MR && r < nq; r++)          /* under MR rows: one a tile */
            row_block(qi + r * ldi, ldi, d4i, qt + r * ldt, ldt, d4t, pi, pt, c, e, np, nm,
                      lim + 4 * r, 1, one, masks + r * np);
    }
}

static int64_t clamp32(int64_t x) {
    return x > INT32_MAX ? INT32_MAX : x < INT32_MIN ? INT32_MIN : x;
}

static int64_t screen_vnni(const int8_t *qi, int64_t ldi, int64_t di, const int8_t *qt,
                           int64_t ldt, int64_t dt, int64_t nq, const int8_t *mi, int64_t lmi,
                           const int8_t *mt, int64_t lmt, int64_t nm, const int32_t *fi,
                           const int32_t *ti, const int32_t *ft, const int32_t *tt,
                           int64_t first, int64_t *out, uint8_t *scratch) {
    const int64_t np = (nm + 15) / 16, d4i = di / 4, d4t = dt / 4;
    uint32_t *pi = (uint32_t *)scratch, *pt = pi + np * d4i * 16;
    int32_t *lim = (int32_t *)(pt + np * d4t * 16);
    uint16_t *masks = (uint16_t *)(lim + 4 * nq);
    const int one = qt == NULL;
    pack(mi, lmi, nm, di, pi);
    if (!one)
        pack(mt, lmt, nm, dt, pt);
    for (int64_t r = 0; r < nq; r++) {
        const int64_t si = 128 * row_sum(qi + r * ldi, di);
        const int64_t st = one ? 0 : 128 * row_sum(qt + r * ldt, dt);
        lim[4 * r] = (int32_t)clamp32((int64_t)fi[r] + si);
        lim[4 * r + 1] = one ? 0 : (int32_t)clamp32((int64_t)ti[r] + si);
        lim[4 * r + 2] = one ? 0 : (int32_t)clamp32((int64_t)ft[r] + st);
        lim[4 * r + 3] = one ? 0 : (int32_t)clamp32((int64_t)tt[r] + st);
    }
    if (one)
        all_masks(qi, ldi, d4i, qi, ldi, 0, pi, pi, nq, np, nm, lim, 1, masks);
    else
        all_masks(qi, ldi, d4i, qt, ldt, d4t, pi, pt, nq, np, nm, lim, 0, masks);
    int64_t n = 0;
    for (int64_t r = 0; r < nq; r++)
        for (int64_t p = 0; p < np; p++)
            for (uint32_t m = masks[r * np + p]; m; m &= m - 1)
                out[n++] = first + r * nm + p * 16 + __builtin_ctz(m);
    return n;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

/* Whether screen_int8 runs here (an x86-64 CPU with AVX512-VNNI and AVX512-BW). */
int vnni_ready(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    return has_vnni();
#else
    return 0;
#endif
}

/* queries qi [nq, di], qt [nq, dt] and members mi [nm, di], mt [nm, dt] (int8, rows ldi, ldt,
 * lmi, lmt bytes apart); thresholds fi, ti, ft, tt (int32 per query, on the exact sums). Writes
 * first + r * nm + j of each kept pair to out (ascending); returns how many, or -1 (see above).
 * qt NULL: one similarity, the pairs with S_ii > fi (mt, ti, ft, tt unread).
 * scratch: 16 ((nm + 15) / 16) (di + dt) + 16 nq + 2 nq ((nm + 15) / 16) bytes. */
int64_t screen_int8(const int8_t *qi, int64_t ldi, int64_t di, const int8_t *qt, int64_t ldt,
                    int64_t dt, int64_t nq, const int8_t *mi, int64_t lmi, const int8_t *mt,
                    int64_t lmt, int64_t nm, const int32_t *fi, const int32_t *ti,
                    const int32_t *ft, const int32_t *tt, int64_t first, int64_t *out,
                    uint8_t *scratch) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (di % 4 == 0 && (qt == NULL || dt % 4 == 0) && has_vnni())
        return screen_vnni(qi, ldi, di, qt, ldt, dt, nq, mi, lmi, mt, lmt, nm, fi, ti, ft, tt,
                           first, out, scratch);
#endif
    (void)qi, (void)ldi, (void)di, (void)qt, (void)ldt, (void)dt, (void)nq, (void)mi;
    (void)lmi, (void)mt, (void)lmt, (void)nm, (void)fi, (void)ti, (void)ft, (void)tt;
    (void)first, (void)out, (void)scratch;
    return -1;
}
