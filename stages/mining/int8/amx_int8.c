/* int8's screens with AMX tiles (int8/kernels.py builds and loads this file).
 *
 * screen_amx: screen_int8.c's screen_int8 (a block's S_ii and S_tt GEMMs and the candidate rule,
 * or S_ii above a floor alone) with AMX tiles (TDPBSSD) instead of VNNI: the same exact integer
 * sums, so the same pairs, in the same order.
 *
 * int_mm: an int8 GEMM's exact int32 sums (torch._int_mm's): ~5x its rate on one core here
 * for a block's shape (4,096 x 256 x 384), ~1.5x for routing's (32,768 x 3,906 x 768: bound by
 * writing the sums). int_argmax: each row's first column of the largest sum (the layout's
 * assignment), reduced in the tiles' output: the sums are never written.
 *
 * count_hits: the exact noise count's one-space screen (engine/count.py) over a whole range of
 * sorted members in one call: queries q [nq, d] x members m[a:b] (int8, rows d bytes apart, d % 64 == 0), each
 * pair's exact integer sum against its query's threshold for the member's cluster (lim: int32
 * [clusters from c0][nqp], nqp = nq rounded up to 32; INT32_MAX: never). AMX tiles (TDPBSSD:
 * s8 x s8, summed exactly in int32; 32 members x 32 queries a step), so the same pairs as
 * screen_int8 or torch's GEMMs against the same thresholds. Writes each kept pair's query
 * index and member row (out_q, out_j) and stops before a 32-member group that might not fit in
 * cap; *stop: the member row it stopped at (b: done). Returns the number of pairs, or -1 where
 * this CPU or OS has no AMX or d % 64 != 0 (the caller screens another way). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx = -1;

/* AMX-TILE, AMX-INT8, AVX512-F and -BW in CPUID, and the kernel's leave to use the tiles. */
static int has_amx(void) {
    if (amx < 0) {
        unsigned a, b, c, d;
        amx = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
              (b >> 16 & 1) && (b >> 30 & 1) &&
              syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw")

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every kernel's tiles: palette 1, tiles 0-7 of 16 rows x 64 bytes. */
static void tiles_on(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++)
        cfg.colsb[t] = 64, cfg.rows[t] = 16;
    __asm__ volatile("" : : "r"(&cfg) : "memory");   /* GCC 12 may sink the stores past it */
    _tile_loadconfig(&cfg);
}

/* queries [nq, d] -> panels of 16 queries, each [d / 4][16][4] bytes (AMX's B layout); queries
 * past nq are zeros. */
static void pack(const int8_t *q, int64_t nq, int64_t nqp, int64_t d, uint32_t *out) {
    const int64_t d4 = d / 4;
    memset(out, 0, (size_t)(nqp * d));
    for (int64_t j = 0; j < nq; j++) {
        uint32_t *p = out + (j / 16) * d4 * 16 + (j % 16);
        for (int64_t k = 0; k < d4; k++)
            memcpy(p + k * 16, q + j * d + 4 * k, 4);
    }
}

/* sums [32 members][32 queries] int32 of member rows mp (32, d apart) x query panels P, P + 1. */
static void sums(const int8_t *mp, int64_t d, const uint8_t *P, int32_t *out) {
    const uint8_t *P1 = P + 16 * d;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < d / 64; k++) {
        _tile_loadd(4, mp + 64 * k, d);
        _tile_loadd(5, mp + 16 * d + 64 * k, d);
        _tile_loadd(6, P + 1024 * k, 64);
        _tile_loadd(7, P1 + 1024 * k, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, out, 128);
    _tile_stored(1, out + 16, 128);
    _tile_stored(2, out + 16 * 32, 128);
    _tile_stored(3, out + 16 * 32 + 16, 128);
}

static int64_t count_amx(const int8_t *q, int64_t nq, int64_t d, const int8_t *m, int64_t a,
                         int64_t b, const int64_t *bounds, int64_t c0, const int32_t *lim,
                         int64_t *out_q, int64_t *out_j, int64_t cap, int64_t *stop) {
    const int64_t nqp = (nq + 31) / 32 * 32;
    uint8_t *P = aligned_alloc(64, (size_t)(nqp * d));
    int8_t *tail = aligned_alloc(64, (size_t)(32 * d));
    int32_t *s = aligned_alloc(64, 32 * 32 * sizeof(int32_t));
    const int32_t *L[32];
    pack(q, nq, nqp, d, (uint32_t *)P);
    tiles_on();
    int64_t n = 0, c = c0, mg = a;
    for (; mg < b && n + 32 * nqp <= cap; mg += 32) {
        const int rows = b - mg < 32 ? (int)(b - mg) : 32;
        const int8_t *mp = m + mg * d;
        if (rows < 32) {                       /* the range's last rows, zero-padded */
            memset(tail, 0, (size_t)(32 * d));
            memcpy(tail, mp, (size_t)(rows * d));
            mp = tail;
        }
        for (int i = 0; i < rows; i++) {       /* each member's cluster's thresholds */
            while (bounds[c + 1] <= mg + i)
                c++;
            L[i] = lim + (c - c0) * nqp;
        }
        for (int64_t p = 0; p < nqp; p += 32) {
            sums(mp, d, P + p * d, s);
            for (int i = 0; i < rows; i++)
                for (int h = 0; h < 2; h++) {
                    const __m512i x = _mm512_load_si512(s + 32 * i + 16 * h);
                    const __m512i t = _mm512_loadu_si512(L[i] + p + 16 * h);
                    for (uint32_t k = _mm512_cmpgt_epi32_mask(x, t); k; k &= k - 1) {
                        out_q[n] = p + 16 * h + __builtin_ctz(k);
                        out_j[n++] = mg + i;
                    }
                }
        }
    }
    _tile_release();
    free(P);
    free(tail);
    free(s);
    *stop = mg < b ? mg : b;
    return n;
}

/* The 16 x 16 matrix of 4-byte groups at m (16 rows ld bytes apart, 64 bytes each) transposed
 * into out (16 rows of 64 bytes, 64-aligned): out's row c holds each row's group c. */
static void transpose16(const int8_t *m, int64_t ld, uint32_t *out) {
    __m512i a[16], t[16];
    for (int r = 0; r < 16; r++)
        a[r] = _mm512_loadu_si512(m + r * ld);
    for (int r = 0; r < 16; r += 2) {             /* pairs of rows, groups interleaved */
        t[r] = _mm512_unpacklo_epi32(a[r], a[r + 1]);
        t[r + 1] = _mm512_unpackhi_epi32(a[r], a[r + 1]);
    }
    for (int r = 0; r < 16; r += 4) {             /* a lane's 4 rows of one group: a[r + i] */
        a[r] = _mm512_unpacklo_epi64(t[r], t[r + 2]);
        a[r + 1] = _mm512_unpackhi_epi64(t[r], t[r + 2]);
        a[r + 2] = _mm512_unpacklo_epi64(t[r + 1], t[r + 3]);
        a[r + 3] = _mm512_unpackhi_epi64(t[r + 1], t[r + 3]);
    }
    for (int h = 0; h < 8; h += 4)                /* lanes 0, 2 | 1, 3 of rows 0-3 with 4-7 */
        for (int i = 0; i < 4; i++) {
            t[h * 2 + i] = _mm512_shuffle_i32x4(a[h * 2 + i], a[h * 2 + 4 + i], 0x88);
            t[h * 2 + 4 + i] = _mm512_shuffle_i32x4(a[h * 2 + i], a[h * 2 + 4 + i], 0xdd);
        }
    for (int i = 0; i < 4; i++) {                 /* rows 0-7 with 8-15: whole groups */
        _mm512_store_si512(out + 16 * i, _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88));
        _mm512_store_si512(out + 16 * (8 + i), _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd));
        _mm512_store_si512(out + 16 * (4 + i), _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88));
        _mm512_store_si512(out + 16 * (12 + i), _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd));
    }
}

/* members [nm, d] (rows ld bytes apart) -> panels of 16 members in AMX's B layout at out, as
 * pack() lays out queries, plus one zero panel (a pair's second panel past the last): only
 * the last panels' padding is cleared, every other byte is written. */
static void fill_panels(const int8_t *m, int64_t ld, int64_t nm, int64_t d, uint32_t *out) {
    const int64_t np = (nm + 15) / 16 + 1, d4 = d / 4;
    memset(out + (nm / 16) * 16 * d4, 0, (size_t)((np - nm / 16) * 16 * d));
    for (int64_t j = 0; j + 16 <= nm; j += 16)       /* whole panels: 16 x 16 transposes */
        for (int64_t k = 0; k < d4; k += 16)
            transpose16(m + j * ld + 4 * k, ld, out + j * d4 + 16 * k);
    for (int64_t j = nm / 16 * 16; j < nm; j++) {
        uint32_t *p = out + (j / 16) * d4 * 16 + (j % 16);
        for (int64_t k = 0; k < d4; k++)
            memcpy(p + k * 16, m + j * ld + 4 * k, 4);
    }
}

/* fill_panels into memory of their own (freed by the caller). */
static uint8_t *panels(const int8_t *m, int64_t ld, int64_t nm, int64_t d) {
    const int64_t np = (nm + 15) / 16 + 1;
    uint32_t *out = aligned_alloc(64, (size_t)(np * 16 * d));
    fill_panels(m, ld, nm, d, out);
    return (uint8_t *)out;
}

/* This thread's scratch memory for screen_amx_, at least ``need`` bytes, 64-aligned: kept
 * from call to call (a block's panels are ~0.4 MB: fresh memory each block cost more page
 * faults than its GEMMs), grown when a block needs more. */
static __thread uint8_t *room_at;
static __thread size_t room_size;

static uint8_t *room(size_t need) {
    need = (need + 63) / 64 * 64;
    if (need > room_size) {
        free(room_at);
        room_at = aligned_alloc(64, need);
        room_size = room_at ? need : 0;
    }
    return room_at;
}

/* sums [16 queries][32 members] int32 (rows 32 apart) of query rows q (16, ld apart) x member
 * panels P, P + 1; tiles 0 and 1. */
static void row_sums(const int8_t *q, int64_t ld, int64_t d, const uint8_t *P, int32_t *out) {
    const uint8_t *P1 = P + 16 * d;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < d / 64; k++) {
        _tile_loadd(4, q + 64 * k, ld);
        _tile_loadd(6, P + 1024 * k, 64);
        _tile_loadd(7, P1 + 1024 * k, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
    }
    _tile_stored(0, out, 128);
    _tile_stored(1, out + 16, 128);
}

/* Query rows r0 .. r0 + 15 (q*: their first rows) against member panels p, p + 1: the rule's
 * masks into masks[r * np + p + h] (screen_int8.c's tile_masks). */
static void amx_masks(const int8_t *qi, int64_t ldi, int64_t di, const int8_t *qt, int64_t ldt,
                      int64_t dt, const uint8_t *pi, const uint8_t *pt, int64_t p, int64_t np,
                      int64_t nm, const int32_t *fi, const int32_t *ti, const int32_t *ft,
                      const int32_t *tt, int32_t *s, uint16_t *masks) {
    row_sums(qi, ldi, di, pi + p * 16 * di, s);
    if (qt)
        row_sums(qt, ldt, dt, pt + p * 16 * dt, s + 16 * 32);
    for (int r = 0; r < 16; r++)
        for (int h = 0; h < 2 && p + h < np; h++) {
            const __m512i x = _mm512_load_si512(s + 32 * r + 16 * h);
            uint32_t m = _mm512_cmpgt_epi32_mask(x, _mm512_set1_epi32(fi[r]));
            if (qt) {
                const __m512i y = _mm512_load_si512(s + 16 * 32 + 32 * r + 16 * h);
                m |= _mm512_cmpgt_epi32_mask(y, _mm512_set1_epi32(ft[r])) |
                     (_mm512_cmpgt_epi32_mask(x, _mm512_set1_epi32(ti[r])) &
                      _mm512_cmpgt_epi32_mask(y, _mm512_set1_epi32(tt[r])));
            }
            const int64_t left = nm - (p + h) * 16;
            if (left < 16)
                m &= (1u << left) - 1;
            masks[r * np + p + h] = (uint16_t)m;
        }
}

static int64_t screen_amx_(const int8_t *qi, int64_t ldi, int64_t di, const int8_t *qt,
                           int64_t ldt, int64_t dt, int64_t nq, const int8_t *mi, int64_t lmi,
                           const int8_t *mt, int64_t lmt, int64_t nm, const int32_t *fi,
                           const int32_t *ti, const int32_t *ft, const int32_t *tt,
                           int64_t first, int64_t *out) {
    const int64_t np = (nm + 15) / 16, rows = nq < 16 ? 16 : nq;
    const size_t at_pt = (size_t)((np + 1) * 16 * di), at_s = at_pt + (size_t)((np + 1) * 16 * dt),
                 at_pad = at_s + 2 * 16 * 32 * sizeof(int32_t),
                 at_mk = at_pad + (size_t)(16 * (di + dt) + 63) / 64 * 64;
    uint8_t *mem = room(at_mk + (size_t)(rows * np + 1) * sizeof(uint16_t));
    if (!mem)
        return -1;
    uint8_t *pi = mem, *pt = qt ? mem + at_pt : NULL;
    int32_t *s = (int32_t *)(mem + at_s);
    uint16_t *mk = (uint16_t *)(mem + at_mk);
    fill_panels(mi, lmi, nm, di, (uint32_t *)pi);
    if (qt)
        fill_panels(mt, lmt, nm, dt, (uint32_t *)pt);
    int32_t lim[4][16] = {{0}};
    if (nq < 16) {                 /* under 16 rows: a zero-padded copy, its limits unread */
        int8_t *pad = (int8_t *)(mem + at_pad);
        memset(pad, 0, (size_t)(16 * (di + dt)));
        for (int64_t r = 0; r < nq; r++) {
            memcpy(pad + r * di, qi + r * ldi, (size_t)di);
            if (qt)
                memcpy(pad + 16 * di + r * dt, qt + r * ldt, (size_t)dt);
            lim[0][r] = fi[r], lim[1][r] = qt ? ti[r] : 0;
            lim[2][r] = qt ? ft[r] : 0, lim[3][r] = qt ? tt[r] : 0;
        }
        qi = pad, ldi = di, qt = qt ? pad + 16 * di : NULL, ldt = dt;
        fi = lim[0], ti = lim[1], ft = lim[2], tt = lim[3];
    }
    tiles_on();
    for (int64_t b = 0; b < rows; b += 16) {
        const int64_t r = b + 16 <= rows ? b : rows - 16;    /* the tail: the last 16 again */
        for (int64_t p = 0; p < np; p += 2)
            amx_masks(qi + r * ldi, ldi, di, qt ? qt + r * ldt : NULL, ldt, dt, pi, pt, p, np,
                      nm, fi + r, qt ? ti + r : NULL, qt ? ft + r : NULL, qt ? tt + r : NULL, s,
                      mk + r * np);
    }
    _tile_release();
    int64_t n = 0;
    for (int64_t r = 0; r < nq; r++)
        for (int64_t p = 0; p < np; p++)
            for (uint32_t m = mk[r * np + p]; m; m &= m - 1)
                out[n++] = first + r * nm + p * 16 + __builtin_ctz(m);
    return n;
}

/* Under 16 rows of a [n, d]: *a pointed at a zero-padded copy of 16 rows, returned to be freed
 * (else NULL: *a as it is). */
static int8_t *sixteen_rows(const int8_t **a, int64_t n, int64_t d) {
    if (n >= 16)
        return NULL;
    int8_t *pad = aligned_alloc(64, (size_t)(16 * d));
    memset(pad, 0, (size_t)(16 * d));
    memcpy(pad, *a, (size_t)(n * d));
    *a = pad;
    return pad;
}

static void int_mm_(const int8_t *a, int64_t n, const int8_t *b, int64_t m, int64_t d,
                    int32_t *out) {
    const int64_t np = (m + 15) / 16;
    uint8_t *P = panels(b, d, m, d);
    int32_t *s = aligned_alloc(64, 16 * 32 * sizeof(int32_t));
    int8_t *pad = sixteen_rows(&a, n, d);
    const int64_t rows = n < 16 ? 16 : n;
    tiles_on();
    for (int64_t g = 0; g < rows; g += 16) {
        const int64_t r = g + 16 <= rows ? g : rows - 16;    /* the tail: the last 16 again */
        for (int64_t p = 0; p < np; p += 2) {
            row_sums(a + r * d, d, d, P + p * 16 * d, s);
            const int64_t w = m - p * 16 < 32 ? m - p * 16 : 32;
            for (int64_t i = 0; i < 16 && r + i < n; i++)
                memcpy(out + (r + i) * m + p * 16, s + 32 * i, (size_t)w * sizeof(int32_t));
        }
    }
    _tile_release();
    free(P);
    free(s);
    free(pad);
}

/* int_mm_'s sums, reduced as they are made to each row's first column of the largest sum. */
static void int_argmax_(const int8_t *a, int64_t n, const int8_t *b, int64_t m, int64_t d,
                        int64_t *out) {
    const int64_t np = (m + 15) / 16;
    uint8_t *P = panels(b, d, m, d);
    int32_t *s = aligned_alloc(64, 16 * 32 * sizeof(int32_t));
    int8_t *pad = sixteen_rows(&a, n, d);
    const int64_t rows = n < 16 ? 16 : n;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    tiles_on();
    for (int64_t g = 0; g < rows; g += 16) {
        const int64_t r = g + 16 <= rows ? g : rows - 16;
        __m512i best[16], at[16];                /* per row, lane l: columns = l mod 16 */
        for (int i = 0; i < 16; i++)
            best[i] = _mm512_set1_epi32(INT32_MIN), at[i] = _mm512_setzero_si512();
        for (int64_t p = 0; p < np; p += 2) {       /* columns ascending: the first max wins */
            row_sums(a + r * d, d, d, P + p * 16 * d, s);
            for (int64_t h = 0; h < 2 && (p + h) * 16 < m; h++) {
                const int64_t c0 = (p + h) * 16, left = m - c0;
                const __mmask16 ok = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
                const __m512i col = _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)c0));
                for (int i = 0; i < 16; i++) {
                    const __m512i v = _mm512_loadu_si512(s + 32 * i + 16 * h);
                    const __mmask16 up = _mm512_mask_cmpgt_epi32_mask(ok, v, best[i]);
                    best[i] = _mm512_mask_mov_epi32(best[i], up, v);
                    at[i] = _mm512_mask_mov_epi32(at[i], up, col);
                }
            }
        }
        int64_t first[16];
        for (int i = 0; i < 16; i++) {              /* the lowest column among the lanes' max */
            const int32_t top = _mm512_reduce_max_epi32(best[i]);
            const __mmask16 eq = _mm512_cmpeq_epi32_mask(best[i], _mm512_set1_epi32(top));
            first[i] = _mm512_mask_reduce_min_epi32(eq, at[i]);
        }
        for (int64_t i = 0; i < 16 && r + i < n; i++)
            out[r + i] = first[i];
    }
    _tile_release();
    free(P);
    free(s);
    free(pad);
}

#pragma GCC pop_options
#endif

/* a [n, d] x b [m, d] (int8, rows d bytes apart) -> out [n, m] int32, the exact integer sums,
 * with AMX tiles; -1 (nothing written) where this CPU or OS has no AMX or d % 64 != 0. */
int64_t int_mm(const int8_t *a, int64_t n, const int8_t *b, int64_t m, int64_t d, int32_t *out) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
    if (d % 64 == 0 && d > 0 && n > 0 && m > 0 && has_amx()) {
        int_mm_(a, n, b, m, d, out);
        return 0;
    }
#endif
    (void)a, (void)n, (void)b, (void)m, (void)d, (void)out;
    return -1;
}

/* out[i] = the first j of the largest sum <a[i], b[j]> (torch.argmax of int_mm's sums), the sums
 * never stored; -1 (nothing written) where int_mm returns -1. */
int64_t int_argmax(const int8_t *a, int64_t n, const int8_t *b, int64_t m, int64_t d,
                   int64_t *out) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
    if (d % 64 == 0 && d > 0 && n > 0 && m > 0 && has_amx()) {
        int_argmax_(a, n, b, m, d, out);
        return 0;
    }
#endif
    (void)a, (void)n, (void)b, (void)m, (void)d, (void)out;
    return -1;
}

/* screen_int8.c's screen_int8 with AMX (its arguments but scratch): -1 where this CPU or OS has
 * no AMX or a dimension is not a multiple of 64 (the caller screens with VNNI or torch). */
int64_t screen_amx(const int8_t *qi, int64_t ldi, int64_t di, const int8_t *qt, int64_t ldt,
                   int64_t dt, int64_t nq, const int8_t *mi, int64_t lmi, const int8_t *mt,
                   int64_t lmt, int64_t nm, const int32_t *fi, const int32_t *ti,
                   const int32_t *ft, const int32_t *tt, int64_t first, int64_t *out) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
    if (di % 64 == 0 && di > 0 && (qt == NULL || (dt % 64 == 0 && dt > 0)) && nq > 0 &&
        nm > 0 && has_amx())
        return screen_amx_(qi, ldi, di, qt, ldt, dt, nq, mi, lmi, mt, lmt, nm, fi, ti, ft, tt,
                           first, out);
#endif
    (void)qi, (void)ldi, (void)di, (void)qt, (void)ldt, (void)dt, (void)nq, (void)mi;
    (void)lmi, (void)mt, (void)lmt, (void)nm, (void)fi, (void)ti, (void)ft, (void)tt;
    (void)first, (void)out;
    return -1;
}

/* screen_amx over a stack's blocks in one call (q8.candidates): block u is query rows
 * q0[u] .. q1[u] of qi, qt (rows di, dt bytes apart) against the nm[u] member rows at
 * addresses mi[u], mt[u] (rows di, dt apart), with the thresholds from row lim0[u] of fi, ti,
 * ft, tt, and flat indices from first[u]; blocks without queries or members list nothing.
 * Each block's pairs follow the last's in out (ascending where first is), without the flat
 * indices own[0..no) (ascending: the targets' own pairs). Returns their number, or -1 where
 * screen_amx would not run (the caller screens block by block). */
int64_t screen_amx_blocks(const int8_t *qi, int64_t di, const int8_t *qt, int64_t dt,
                          int64_t nb, const int64_t *q0, const int64_t *q1, const int64_t *mi,
                          const int64_t *mt, const int64_t *nm, const int64_t *lim0,
                          const int64_t *first, const int32_t *fi, const int32_t *ti,
                          const int32_t *ft, const int32_t *tt, const int64_t *own, int64_t no,
                          int64_t *out) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
    if (di % 64 || di <= 0 || dt % 64 || dt <= 0 || !has_amx())
        return -1;
    int64_t n = 0, o = 0;
    for (int64_t u = 0; u < nb; u++) {
        const int64_t l = lim0[u];
        if (q1[u] > q0[u] && nm[u] > 0) {
            const int64_t got = screen_amx_(qi + q0[u] * di, di, di, qt + q0[u] * dt, dt, dt, q1[u] - q0[u],
                             (const int8_t *)mi[u], di, (const int8_t *)mt[u], dt, nm[u],
                             fi + l, ti + l, ft + l, tt + l, first[u], out + n);
            if (got < 0)
                return -1;
            int64_t w = n;
            for (int64_t i = n; i < n + got; i++) {      /* the block's own pairs left out */
                while (o < no && own[o] < out[i])
                    o++;
                if (o == no || own[o] != out[i])
                    out[w++] = out[i];
            }
            n = w;
        }
    }
    return n;
#else
    (void)qi, (void)di, (void)qt, (void)dt, (void)nb, (void)q0, (void)q1, (void)mi, (void)mt;
    (void)nm, (void)lim0, (void)first, (void)fi, (void)ti, (void)ft, (void)tt, (void)own;
    (void)no, (void)out;
    return -1;
#endif
}

/* Whether count_hits runs here (x86-64 Linux, GCC, AMX-INT8 and leave to use it). */
int amx_ready(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
    return has_amx();
#else
    return 0;
#endif
}

int64_t count_hits(const int8_t *q, int64_t nq, int64_t d, const int8_t *m, int64_t a,
                   int64_t b, const int64_t *bounds, int64_t c0, const int32_t *lim,
                   int64_t *out_q, int64_t *out_j, int64_t cap, int64_t *stop) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
    if (d % 64 == 0 && d > 0 && has_amx())
        return count_amx(q, nq, d, m, a, b, bounds, c0, lim, out_q, out_j, cap, stop);
#endif
    (void)q, (void)nq, (void)d, (void)m, (void)a, (void)b, (void)bounds, (void)c0, (void)lim;
    (void)out_q, (void)out_j, (void)cap, (void)stop;
    return -1;
}
