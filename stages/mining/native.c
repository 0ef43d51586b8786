/* The neighbour pass's two per-pair loops in C (native.py builds and loads this file; issue 15).
 *
 * pair_dots: the fp32 dot products of listed row pairs, read in place (no gathered copies), in
 * a fixed order that native.py's torch path repeats bit for bit: 16 lanes, lane j summing the
 * products of dimensions j, j + 16, j + 32, ... one by one (each product rounded to fp32, then
 * added: no FMA, hence -ffp-contract=off), then the lanes summed as a tree (8, 4, 2, 1).
 *
 * screen_pairs: the candidate rule on a block's integer sums (q8.rule's, exact int32
 * compares): flat indices of the pairs with (img > tau_i and txt > tau_t) or img > floor_i or
 * txt > floor_t, or an extra mask set. One pass over both sums instead of a bool array per
 * compare. */
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

/* Whether any of x[0..n) is at or above t (n <= LANES): compares the compiler vectorizes. */
static inline int any_at_least(const float *x, int64_t n, float t) {
    int any = 0;
    for (int64_t i = 0; i < n; i++)
        any |= x[i] >= t;
    return any;
}

/* The k-th largest of v[0..n) (1 <= k <= n), reordering v: Hoare's quickselect. */
static float select_kth(float *v, int64_t n, int64_t k) {
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

/* How many of v[0..n) are at or above t (vector compares). */
static inline int64_t count_at_least(const float *v, int64_t n, float t) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        m += v[i] >= t;
    return m;
}

/* A value with at least k of v[0..n) at or above it (1 <= k <= n; v finite or infinite: a
 * query's own cluster is +inf, empty ones -inf), near the k-th largest: a bisection of the
 * finite values' range by counts, BISECT steps; -inf when the least finite value has fewer
 * than k at or above it. */
static float lower_bound_kth(const float *v, int64_t n, int64_t k) {
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

/* The k-th largest of x[0..c) (k <= c). Split x into g = c / LANES groups (group b: the values
 * b, b + g, b + 2 g, ...): k of the groups' maxima are k distinct values, so a value with k
 * maxima at or above it (lower_bound_kth) is at most the k-th largest, and only the values at
 * or above it (~k + a few) are selected from. scratch: room for c / LANES + c floats. */
static float kth_largest(const float *x, int64_t c, int64_t k, float *scratch) {
    const int64_t g = c / LANES;
    float *maxima = scratch, *kept = scratch + g;
    float least = -__builtin_inff();
    if (g >= k) {
        memcpy(maxima, x, (size_t)g * sizeof(float));
        for (int64_t i = g; i < c; i += g) {
            const int64_t e = c - i < g ? c - i : g;
            for (int64_t b = 0; b < e; b++)
                maxima[b] = x[i + b] > maxima[b] ? x[i + b] : maxima[b];
        }
        least = lower_bound_kth(maxima, g, k);
    }
    int64_t n = 0;
    for (int64_t j = 0; j < c; j += LANES) {
        const int64_t e = c - j < LANES ? c : j + LANES;
        if (any_at_least(x + j, e - j, least))
            for (int64_t i = j; i < e; i++)
                if (x[i] >= least)
                    kept[n++] = x[i];
    }
    return select_kth(kept, n, k);
}

/* The largest x + reach over the columns below kth (-inf when none), LANES at a time. */
static float best_below(const float *x, const float *reach, int64_t c, float kth) {
    float lane[LANES];
    for (int l = 0; l < LANES; l++)
        lane[l] = -__builtin_inff();
    int64_t j = 0;
    for (; j + LANES <= c; j += LANES)
        for (int l = 0; l < LANES; l++) {
            const float v = x[j + l] + reach[j + l];
            lane[l] = ((x[j + l] < kth) & (v > lane[l])) ? v : lane[l];
        }
    for (int l = 0; j + l < c; l++) {
        const float v = x[j + l] + reach[j + l];
        lane[l] = ((x[j + l] < kth) & (v > lane[l])) ? v : lane[l];
    }
    float best = lane[0];
    for (int l = 1; l < LANES; l++)
        best = lane[l] > best ? lane[l] : best;
    return best;
}

/* Each row of m [n, c] (finite or infinite floats, no NaN): its k largest (1 <= k <= c; equal
 * values by ascending column) as ascending columns into top [n, k]; with reach [c], out[r] =
 * the largest m + reach over the row's other columns (-inf when none). scratch: room
 * for c / LANES + c floats. */
CLONES void top_columns(const float *m, int64_t n, int64_t c, int64_t k, const float *reach,
                        int64_t *top, float *out, float *scratch) {
    for (int64_t r = 0; r < n; r++) {
        const float *x = m + r * c;
        const float kth = kth_largest(x, c, k, scratch);
        int64_t room = k, t = 0;
        for (int64_t j = 0; j < c; j++)
            room -= x[j] > kth;
        float best = reach ? best_below(x, reach, c, kth) : 0.0f;
        int64_t *row = top + r * k;
        for (int64_t j = 0; j < c; j += LANES) {
            const int64_t e = c - j < LANES ? c : j + LANES;
            if (!any_at_least(x + j, e - j, kth))
                continue;
            for (int64_t i = j; i < e; i++) {
                if (x[i] > kth || (x[i] == kth && room-- > 0))
                    row[t++] = i;
                else if (reach && x[i] == kth && x[i] + reach[i] > best)
                    best = x[i] + reach[i];
            }
        }
        if (reach)
            out[r] = best;
    }
}
