/* The neighbour pass's per-pair loops in C (native.py builds and loads this file).
 *
 * pair_dots: the fp32 dot products of listed row pairs, read in place (no gathered copies), in
 * a fixed order that native.py's torch path repeats bit for bit: 16 lanes, lane j summing the
 * products of dimensions j, j + 16, j + 32, ... one by one (each product rounded to fp32, then
 * added: no FMA, hence -ffp-contract=off), then the lanes summed as a tree (8, 4, 2, 1).
 *
 * screen_pairs: the candidate rule on a block's integer sums (q8.rule's, exact int32
 * compares): flat indices of the pairs with (img > tau_i and txt > tau_t) or img > floor_i or
 * txt > floor_t, or an extra mask set. One pass over both sums instead of a bool array per
 * compare.
 *
 * top_columns / route_columns: routing's probe best clusters per query and the certificate's
 * bound (route_columns from int8 sums, forming each row's fp32 scores as torch does).
 *
 * stable_order / row_best: counting sorts (the units' order by cluster; the merged top-k of a
 * chunk's targets, each row's entries then sorted by score, then j).
 *
 * screen_int8: an int8 block's two GEMMs and screen_pairs' rule fused (AVX512-VNNI only). */
#include <stdint.h>
#include <string.h>

#define LANES 16
#define BISECT 12    /* top_columns' bisection steps */
#define AHEAD 4     /* pairs whose rows are prefetched ahead of the one being summed */

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline void fetch(const float *x, int64_t d) {
    for (int64_t k = 0; k < d; k += 16)
        __builtin_prefetch(x + k);
}

static inline float dot(const float *x, const float *y, int64_t d) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= d; k += LANES)
        for (int j = 0; j < LANES; j++)
            acc[j] += x[k + j] * y[k + j];
    for (int j = 0; k + j < d; j++)
        acc[j] += x[k + j] * y[k + j];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++)
            acc[j] += acc[j + w];
    return acc[0];
}

/* out[p] = <a[ia[p]], b[ib[p]]>: rows of d floats, sa and sb floats apart. */
CLONES void pair_dots(const float *a, int64_t sa, const int64_t *ia, const float *b,
                      int64_t sb, const int64_t *ib, int64_t n, int64_t d, float *out) {
    for (int64_t p = 0; p < n; p++) {
        if (p + AHEAD < n) {
            fetch(a + ia[p + AHEAD] * sa, d);
            fetch(b + ib[p + AHEAD] * sb, d);
        }
        out[p] = dot(a + ia[p] * sa, b + ib[p] * sb, d);
    }
}

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

/* top_columns and route_columns: GCC/Clang vector extensions, 16 floats a vector (one AVX-512
 * register; two AVX2 or four SSE ones in the other clones). Helpers are always inlined, so each
 * clone compiles them for its own target. */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
#define INLINE static inline __attribute__((always_inline))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"    /* 64-byte vectors pass only between inlined helpers */
#endif

INLINE vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE vf pick(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }

INLINE vf vmax(vf a, vf b) { return pick(a > b, a, b); }

INLINE float hmax(vf v) {
    float m = v[0];
    for (int l = 1; l < LANES; l++)
        m = v[l] > m ? v[l] : m;
    return m;
}

/* The k-th largest of v[0..n) (1 <= k <= n), reordering v: Hoare's quickselect. */
INLINE float select_kth(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1;
    while (lo < hi) {
        const float p = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > p)
                i++;
            while (v[j] < p)
                j--;
            if (i <= j) {
                const float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return v[want];
    }
    return v[want];
}

/* How many of v[0..n) are at or above t. */
INLINE int64_t count_at_least(const float *v, int64_t n, float t) {
    vi acc = {0};
    int64_t i = 0, m = 0;
    for (; i + LANES <= n; i += LANES)
        acc -= load(v + i) >= t;
    for (int l = 0; l < LANES; l++)
        m += acc[l];
    for (; i < n; i++)
        m += v[i] >= t;
    return m;
}

/* A value with at least k of v[0..n) at or above it (1 <= k <= n; v finite or infinite: a
 * query's own cluster is +inf, empty ones -inf), near the k-th largest: a bisection of the
 * finite values' range by counts, BISECT steps; -inf when the least finite value has fewer
 * than k at or above it. */
INLINE float lower_bound_kth(const float *v, int64_t n, int64_t k) {
    float lo = __builtin_inff(), hi = -__builtin_inff();
    for (int64_t i = 0; i < n; i++) {
        const int finite = v[i] - v[i] == 0.0f;
        lo = (finite & (v[i] < lo)) ? v[i] : lo;
        hi = (finite & (v[i] > hi)) ? v[i] : hi;
    }
    if (lo > hi || count_at_least(v, n, lo) < k)
        return -__builtin_inff();
    for (int step = 0; step < BISECT; step++) {
        const float mid = lo + (hi - lo) * 0.5f;
        if (mid <= lo || mid >= hi)
            break;
        if (count_at_least(v, n, mid) >= k)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* maxima[b] = the largest of group b of x[0..LANES g): x[b], x[b + g], ..., x[b + 15 g]. */
INLINE void group_maxima(const float *x, int64_t g, float *maxima) {
    int64_t b = 0;
    for (; b + LANES <= g; b += LANES) {
        vf m = load(x + b);
        for (int i = 1; i < LANES; i++)
            m = vmax(load(x + i * g + b), m);
        memcpy(maxima + b, &m, sizeof m);
    }
    for (; b < g; b++) {
        float m = x[b];
        for (int i = 1; i < LANES; i++)
            m = x[i * g + b] > m ? x[i * g + b] : m;
        maxima[b] = m;
    }
}

/* The columns of x [c] that may be among its k largest, ascending, into is; returns how many.
 * With g = c / LANES groups (as group_maxima's) and g >= k, a value with k group maxima at or
 * above it (lower_bound_kth) is at most the k-th largest, so only the groups whose maximum
 * reaches it, and the last c - LANES g columns, are listed (~k groups of LANES columns, not c);
 * otherwise every column. Column b + i g is listed before b' + i' g when i < i', or i = i' and
 * b < b': ascending. fs: room for c floats; is: c + c / LANES int64. */
INLINE int64_t candidates(const float *x, int64_t c, int64_t k, float *fs, int64_t *is) {
    const int64_t g = c / LANES;
    int64_t *sel = is + c, ns = 0, n = 0;
    float least = -__builtin_inff();
    if (g >= k) {
        group_maxima(x, g, fs);
        least = lower_bound_kth(fs, g, k);
    }
    for (int64_t b = 0; b < g; b++) {
        sel[ns] = b;
        ns += g < k || fs[b] >= least;
    }
    for (int64_t i = 0; i < LANES; i++)
        for (int64_t s = 0; s < ns; s++) {
            is[n] = sel[s] + i * g;
            n += x[is[n]] >= least;
        }
    for (int64_t j = LANES * g; j < c; j++) {
        is[n] = j;
        n += x[j] >= least;
    }
    return n;
}

/* The k largest of x [c] (no NaN; 1 <= k <= c), equal values by ascending column, as ascending
 * columns into top [k]; returns the largest x + reach over the other columns (-inf when none),
 * or 0 without reach. fs: room for 2 c floats; is: c + c / LANES int64. */
INLINE float row_top(const float *x, int64_t c, int64_t k, const float *reach, int64_t *top,
                     float *fs, int64_t *is) {
    const int64_t n = candidates(x, c, k, fs, is);
    float *kept = fs + c;
    for (int64_t s = 0; s < n; s++)
        kept[s] = x[is[s]];
    const float kth = select_kth(kept, n, k);
    int64_t room = k, t = 0;
    for (int64_t s = 0; s < n; s++)
        room -= x[is[s]] > kth;
    float best = -__builtin_inff();
    for (int64_t s = 0; s < n; s++) {
        const int64_t j = is[s];
        if (x[j] > kth || (x[j] == kth && room-- > 0))
            top[t++] = j;
        else if (reach && x[j] == kth && x[j] + reach[j] > best)
            best = x[j] + reach[j];
    }
    if (!reach)
        return 0.0f;
    vf lane = (vf){0} - __builtin_inff();
    int64_t j = 0;
    for (; j + LANES <= c; j += LANES) {
        const vf v = load(x + j);
        lane = vmax(pick(v < kth, v + load(reach + j), lane), lane);
    }
    for (; j < c; j++)
        best = (x[j] < kth && x[j] + reach[j] > best) ? x[j] + reach[j] : best;
    return hmax(lane) > best ? hmax(lane) : best;
}

/* Whether x[0..c) has a NaN. */
INLINE int has_nan(const float *x, int64_t c) {
    vi acc = {0};
    int64_t j = 0;
    int any = 0;
    for (; j + LANES <= c; j += LANES) {
        const vf v = load(x + j);
        acc |= v != v;
    }
    for (int l = 0; l < LANES; l++)
        any |= acc[l] != 0;
    for (; j < c; j++)
        any |= x[j] != x[j];
    return any;
}

/* Each row of m [n, c]: its k largest (1 <= k <= c; equal values by ascending column) as
 * ascending columns into top [n, k]; with reach [c], out[r] = the largest m + reach over the
 * row's other columns (-inf when none). Returns -1, or the first row with a NaN (stopping
 * there: the caller takes another path). fs: room for 2 c floats; is: c + c / LANES int64. */
CLONES int64_t top_columns(const float *m, int64_t n, int64_t c, int64_t k, const float *reach,
                           int64_t *top, float *out, float *fs, int64_t *is) {
    for (int64_t r = 0; r < n; r++) {
        if (has_nan(m + r * c, c))
            return r;
        const float best = row_top(m + r * c, c, k, reach, top + r * k, fs, is);
        if (reach)
            out[r] = best;
    }
    return -1;
}

/* top_columns of routing's int8 scores, formed row by row as torch forms them: fp32(sums) *
 * scale[r] + bias, each rounded (no FMA), then +inf at column own[r] (a query's own cluster;
 * own NULL: none, the one-space layouts' routing).
 * sums: int32 [n, c]. fs: room for 3 c floats. */
CLONES int64_t route_columns(const int32_t *sums, int64_t n, int64_t c, const float *scale,
                             const float *bias, const int64_t *own, int64_t k,
                             const float *reach, int64_t *top, float *out, float *fs,
                             int64_t *is) {
    float *x = fs + 2 * c;
    for (int64_t r = 0; r < n; r++) {
        const int32_t *s = sums + r * c;
        int64_t j = 0;
        for (; j + LANES <= c; j += LANES) {
            vi v;
            memcpy(&v, s + j, sizeof v);
            const vf y = __builtin_convertvector(v, vf) * scale[r] + load(bias + j);
            memcpy(x + j, &y, sizeof y);
        }
        for (; j < c; j++)
            x[j] = (float)s[j] * scale[r] + bias[j];
        if (own)
            x[own[r]] = __builtin_inff();
        if (has_nan(x, c))
            return r;
        const float best = row_top(x, c, k, reach, top + r * k, fs, is);
        if (reach)
            out[r] = best;
    }
    return -1;
}

/* order: the entries 0..e-1 stably sorted by key (each < n): a counting sort. count: room for
 * n + 1 int64; on return count[x] is the end of key x's run in order (its start count[x - 1],
 * or 0). */
INLINE void by_key(const int64_t *key, int64_t e, int64_t n, int64_t *count, int64_t *order) {
    memset(count, 0, (size_t)(n + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < e; i++)
        count[key[i] + 1]++;
    for (int64_t x = 0; x < n; x++)
        count[x + 1] += count[x];
    for (int64_t i = 0; i < e; i++)
        order[count[key[i]]++] = i;
}

CLONES void stable_order(const int64_t *key, int64_t e, int64_t n, int64_t *count,
                         int64_t *order) {
    by_key(key, e, n, count, order);
}

typedef struct {
    float s;
    int64_t j;
} entry;

/* a ranks before b: the higher score, then the lower j. */
INLINE int before(entry a, entry b) { return a.s > b.s || (a.s == b.s && a.j < b.j); }

/* v[0..n) sorted by ``before``: quicksort, insertion sort below 24. */
static void rank(entry *v, int64_t n) {
    while (n > 24) {
        const entry p = v[n / 2];
        int64_t i = 0, k = n - 1;
        while (i <= k) {
            while (before(v[i], p))
                i++;
            while (before(p, v[k]))
                k--;
            if (i <= k) {
                const entry t = v[i];
                v[i++] = v[k];
                v[k--] = t;
            }
        }
        if (k + 1 < n - i) {         /* recurse into the smaller side */
            rank(v, k + 1);
            v += i;
            n -= i;
        } else {
            rank(v + i, n - i);
            n = k + 1;
        }
    }
    for (int64_t a = 1; a < n; a++) {
        const entry x = v[a];
        int64_t b = a;
        for (; b > 0 && before(x, v[b - 1]); b--)
            v[b] = v[b - 1];
        v[b] = x;
    }
}

/* Each row's k best of e entries (row r[i] < n, global row j[i], score s[i]; (r, j) pairs
 * distinct): best score first, equal scores by ascending j, into idx [n, k] (-1 padded) and
 * score [n, k] (0 padded). Returns -1, or the first entry with a NaN score (nothing written).
 * count: room for n + 1 int64; order: e int64; by_row: e entries (16 bytes each). */
CLONES int64_t row_best(const int64_t *r, const int64_t *j, const float *s, int64_t e,
                        int64_t n, int64_t k, int64_t *idx, float *score, int64_t *count,
                        int64_t *order, entry *by_row) {
    for (int64_t i = 0; i < e; i++)
        if (s[i] != s[i])
            return i;
    by_key(r, e, n, count, order);
    for (int64_t i = 0; i < e; i++)
        by_row[i] = (entry){s[order[i]], j[order[i]]};
    for (int64_t x = 0; x < n; x++) {
        const int64_t a = x ? count[x - 1] : 0, len = count[x] - a;
        rank(by_row + a, len);
        const int64_t m = len < k ? len : k;
        int64_t *ix = idx + x * k;
        float *sx = score + x * k;
        for (int64_t t = 0; t < m; t++) {
            ix[t] = by_row[a + t].j;
            sx[t] = by_row[a + t].s;
        }
        for (int64_t t = m; t < k; t++)          /* the padding: two plain fills */
            ix[t] = -1;
        for (int64_t t = m; t < k; t++)
            sx[t] = 0.0f;
    }
    return -1;
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
