/* The neighbour pass's per-pair loops in C (native.py builds and loads this file).
 *
 * pair_dots: the fp32 dot products of listed row pairs, read in place (no gathered copies), in
 * a fixed order that native.py's torch path repeats bit for bit: 16 lanes, lane j summing the
 * products of dimensions j, j + 16, j + 32, ... one by one (each product rounded to fp32, then
 * added: no FMA, hence -ffp-contract=off), then the lanes summed as a tree (8, 4, 2, 1).
 *
 * top_columns / route_columns: routing's probe best clusters per query and the certificate's
 * bound (route_columns from int8 sums, forming each row's fp32 scores as torch does).
 *
 * stable_order / row_best: counting sorts (the units' order by cluster; the merged top-k of a
 * chunk's targets, each row's entries then sorted by score, then j).
 *
 * The int8 package's own kernels live in that package (stages/mining/int8). */
#include <math.h>
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
/* Hoare's partition of v[0..n) around its middle entry p: on return v[0..*lo] rank before or
 * as p, v[*hi..n) after or as p, and v(*lo..*hi) are p. */
static void partition(entry *v, int64_t n, int64_t *lo, int64_t *hi) {
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
    *lo = k, *hi = i;
}

static void rank(entry *v, int64_t n) {
    while (n > 24) {
        int64_t i, k;
        partition(v, n, &k, &i);
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

/* v[0..n)'s first k sorted by ``before``, the others after them in no order: rank's partitions,
 * each side searched only where it holds some of the first k (a row's best k of ~200: ~1/2 of
 * sorting them all). */
static void rank_top(entry *v, int64_t n, int64_t k) {
    while (n > 24 && k < n) {
        int64_t i, j;
        partition(v, n, &j, &i);
        if (k <= j + 1) {            /* the first k all within v[0..j] */
            n = j + 1;
            continue;
        }
        rank(v, j + 1);              /* v[j + 1..i) are p, in place */
        if (k <= i)
            return;
        v += i;
        n -= i;
        k -= i;
    }
    rank(v, n);
}

/* Each row's k best of e entries (row r[i] < n, global row j[i], score s[i]; (r, j) pairs
 * distinct): best score first, equal scores by ascending j, into idx [n, k] (-1 padded) and
 * score [n, k] (0 padded). Returns -1, or the first entry with a NaN score (nothing written).
 * count: room for n + 1 int64; by_row: e entries (16 bytes each). */
CLONES int64_t row_best(const int64_t *r, const int64_t *j, const float *s, int64_t e,
                        int64_t n, int64_t k, int64_t *idx, float *score, int64_t *count,
                        entry *by_row) {
    for (int64_t i = 0; i < e; i++)
        if (s[i] != s[i])
            return i;
    memset(count, 0, (size_t)(n + 1) * sizeof(int64_t));      /* by_key's counting sort, */
    for (int64_t i = 0; i < e; i++)                           /* the entries moved at once */
        count[r[i] + 1]++;
    for (int64_t x = 0; x < n; x++)
        count[x + 1] += count[x];
    for (int64_t i = 0; i < e; i++)
        by_row[count[r[i]]++] = (entry){s[i], j[i]};
    for (int64_t x = 0; x < n; x++) {
        const int64_t a = x ? count[x - 1] : 0, len = count[x] - a;
        rank_top(by_row + a, len, k);
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

/* The k-th largest (k counted from 0) of v[0..n), k < n, no NaN; v reordered: quickselect
 * with a three-way partition (runs of equal values end it at once). */
static float kth_largest(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi];
        const float p = a < b ? (b < c ? b : a < c ? c : a) : (a < c ? a : b < c ? c : b);
        int64_t lt = lo, i = lo, gt = hi;
        while (i <= gt) {                      /* v: > p | == p | < p */
            const float x = v[i];
            if (x > p) {
                v[i++] = v[lt];
                v[lt++] = x;
            } else if (x < p) {
                v[i] = v[gt];
                v[gt--] = x;
            } else {
                i++;
            }
        }
        if (k < lt)
            hi = lt - 1;
        else if (k > gt)
            lo = gt + 1;
        else
            return p;
    }
    return v[lo];
}

#define SAMPLE 128

/* kth_largest of v[0..n) (k < n, no NaN) with v unchanged, scratch: room for n floats. Where n
 * is well over k, a sample's value first keeps ~2 (k + 1) of them (branch-free), which hold
 * the k-th largest when at least k + 1 are kept; else all are searched. The same value either
 * way (an order statistic), in ~1/3 of the time for runs of ~1,400 and k = 100. */
static float kth_of(const float *v, int64_t n, int64_t k, float *scratch) {
    if (n >= 8 * (k + 1) && n >= 4 * SAMPLE) {
        const int64_t step = n / SAMPLE, j = 2 * (k + 1) * SAMPLE / n;
        for (int64_t i = 0; i < SAMPLE; i++)
            scratch[i] = v[i * step];
        const float t = kth_largest(scratch, SAMPLE, j);
        int64_t c = 0;
        for (int64_t i = 0; i < n; i++) {
            scratch[c] = v[i];
            c += v[i] >= t;
        }
        if (c > k)
            return kth_largest(scratch, c, k);
    }
    memcpy(scratch, v, (size_t)n * sizeof(float));
    return kth_largest(scratch, n, k);
}

/* keep[i] = 1 where v[i] is at least the k-th largest value of its run (a run: consecutive
 * entries of equal r; every entry of a run of at most k), NaN as -inf: topk.at_or_above_kth's
 * mask (k >= 1). scratch: room for the longest run's values. */
CLONES void at_or_above_kth(const int64_t *r, const float *v, int64_t e, int64_t k,
                            uint8_t *keep, float *scratch) {
    for (int64_t a = 0, b; a < e; a = b) {
        for (b = a + 1; b < e && r[b] == r[a]; b++)
            ;
        if (b - a <= k) {
            memset(keep + a, 1, (size_t)(b - a));
            continue;
        }
        for (int64_t i = a; i < b; i++)
            scratch[i - a] = v[i] != v[i] ? -INFINITY : v[i];
        const float t = kth_largest(scratch, b - a, k - 1);
        for (int64_t i = a; i < b; i++)
            keep[i] = (v[i] != v[i] ? -INFINITY : v[i]) >= t;
    }
}

/* Findings.add's selection of a block's candidate pairs in one pass (units.py; runs of equal r,
 * r ascending), the torch path's results:
 * - kept: the pairs above a floor (s[f][i] > floor[f] for a present similarity f), with
 *   max_pairs > 0 only those whose best similarity (NaN as -inf) is at least their run's
 *   max_pairs-th largest; cut[r] counts the others;
 * - top, v: Alg. 1's positives (v = s_ii * s_tt > 0, s_ii > tau_i, s_tt > tau_t, both at most
 *   dup where has_dup), with v at least their run's k-th largest; support[r] counts every
 *   positive.
 * Every compare in fp32, as torch's with a Python scalar. out[0], out[1]: kept's and top's
 * lengths. Returns -1; where r descends or leaves 0..n-1, where it does so (nothing written:
 * the caller checks, then runs torch's). scratch, held: room for e floats each. */
CLONES int64_t block_findings(const int64_t *r, int64_t e, int64_t n, const float *const *s,
                              const float *floor, int64_t max_pairs, float tau_i, float tau_t,
                              float dup, int64_t has_dup, int64_t k, int64_t *support,
                              int64_t *cut, int64_t *kept, int64_t *top, float *v,
                              float *scratch, float *held, int64_t *out) {
    for (int64_t i = 1; i < e; i++)
        if (r[i] < r[i - 1])
            return i;
    if (e && (r[0] < 0 || r[e - 1] >= n))
        return r[0] < 0 ? 0 : e - 1;
    const float *ps[5];
    float pf[5];
    int nf = 0;
    for (int f = 0; f < 5; f++)
        if (s[f]) {
            ps[nf] = s[f];
            pf[nf++] = floor[f];
        }
    const float *si = s[0], *st = s[1];
    int64_t nk = 0, nt = 0;
    for (int64_t a = 0, b; a < e; a = b) {
        for (b = a + 1; b < e && r[b] == r[a]; b++)
            ;
        const int64_t k0 = nk, t0 = nt;
        for (int64_t i = a; i < b; i++) {          /* branch-free: written, then counted */
            int any = 0;
            float best = -INFINITY;
            for (int f = 0; f < nf; f++) {
                const float x = ps[f][i];
                any |= x > pf[f];
                best = x > best ? x : best;         /* NaN never is: as -inf */
            }
            held[nk - k0] = best;
            kept[nk] = i;
            nk += any;
            const float x = si[i], y = st[i], p = x * y;
            v[nt] = p;
            top[nt] = i;
            nt += (x > tau_i) & (y > tau_t) & (p > 0) & (!has_dup | ((x <= dup) & (y <= dup)));
        }
        support[r[a]] += nt - t0;
        if (max_pairs > 0 && nk - k0 > max_pairs) {
            const float t = kth_of(held, nk - k0, max_pairs - 1, scratch);
            int64_t w = k0;
            for (int64_t i = k0; i < nk; i++) {
                kept[w] = kept[i];
                w += held[i - k0] >= t;
            }
            cut[r[a]] += nk - w;
            nk = w;
        }
        if (nt - t0 > k) {
            const float t = kth_of(v + t0, nt - t0, k - 1, scratch);
            int64_t w = t0;
            for (int64_t i = t0; i < nt; i++) {
                const float x = v[i];
                v[w] = x;
                top[w] = top[i];
                w += x >= t;
            }
            nt = w;
        }
    }
    out[0] = nk;
    out[1] = nt;
    return -1;
}

/* sums[lab[i]] += (double)x[i] for i = 0 .. n - 1 in order (x: n rows of d floats, ld apart;
 * sums: rows of d doubles): the layout's member sums, each element's additions in row order,
 * as torch's index_add_ of the rows in float64 makes them. */
CLONES void add_rows(const float *x, int64_t ld, const int64_t *lab, int64_t n, int64_t d,
                     double *sums) {
    for (int64_t i = 0; i < n; i++) {
        double *s = sums + lab[i] * d;
        const float *xi = x + i * ld;
        for (int64_t k = 0; k < d; k++)
            s[k] += (double)xi[k];
    }
}

/* One dense block's candidates read off its fp32 similarities (screen.dense_pairs): flat[i]
 * (ascending, row-major over the stack, the block's pairs from at on, nq x nm of them) gives
 * the pair's row a + flat[i] / nm and column first + flat[i] % nm (rows counted up as flat
 * rises: no division) and each of the nx similarities x[s][flat[i] - at] (row-major [nq, nm])
 * into out[s][i]. Returns -1, or the first i outside the block (nothing after it written). */
CLONES int64_t dense_read(const int64_t *flat, int64_t n, int64_t at, int64_t nq, int64_t nm,
                          int64_t a, int64_t first, const float *const *x, float *const *out,
                          int64_t nx, int64_t *rows, int64_t *cols) {
    int64_t r = 0, end = nm;
    for (int64_t i = 0; i < n; i++) {
        const int64_t l = flat[i] - at;
        if (l < 0 || l >= nq * nm || (i && flat[i] <= flat[i - 1]))
            return i;
        while (l >= end)
            r++, end += nm;
        rows[i] = a + r;
        cols[i] = first + l - (end - nm);
        for (int64_t s = 0; s < nx; s++)
            out[s][i] = x[s][l];
    }
    return -1;
}
