/* int8's count screen with AMX (int8/kernels.py builds and loads this file): the exact noise
 * count's one-space screen (engine/count.py) over a whole range of sorted members in one call.
 *
 * count_hits: queries q [nq, d] x members m[a:b] (int8, rows d bytes apart, d % 64 == 0), each
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
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++)
        cfg.colsb[t] = 64, cfg.rows[t] = 16;
    pack(q, nq, nqp, d, (uint32_t *)P);
    _tile_loadconfig(&cfg);
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

#pragma GCC pop_options
#endif

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
