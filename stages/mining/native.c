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

static inline void sift_down(float *h, int64_t k, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, s = i;
        if (l < k && h[l] < h[s])
            s = l;
        if (l + 1 < k && h[l + 1] < h[s])
            s = l + 1;
        if (s == i)
            return;
        float t = h[i];
        h[i] = h[s];
        h[s] = t;
        i = s;
    }
}

/* The k-th largest of x[0..c) (k <= c): a min-heap of the k largest values in heap[k]. */
static float kth_largest(const float *x, int64_t c, int64_t k, float *heap) {
    memcpy(heap, x, (size_t)k * sizeof(float));
    for (int64_t i = k / 2 - 1; i >= 0; i--)
        sift_down(heap, k, i);
    for (int64_t j = k; j < c; j++)
        if (x[j] > heap[0]) {
            heap[0] = x[j];
            sift_down(heap, k, 0);
        }
    return heap[0];
}

/* Each row of m [n, c] (finite or infinite floats): its k largest (1 <= k <= c; equal values
 * by ascending column) as ascending columns into top [n, k]; with reach [c], out[r] = the
 * largest m + reach over the row's other columns (-inf when none). heap: room for k floats. */
void top_columns(const float *m, int64_t n, int64_t c, int64_t k, const float *reach,
                 int64_t *top, float *out, float *heap) {
    for (int64_t r = 0; r < n; r++) {
        const float *x = m + r * c;
        const float kth = kth_largest(x, c, k, heap);
        int64_t room = k, t = 0;
        for (int64_t j = 0; j < c; j++)
            room -= x[j] > kth;
        float best = -__builtin_inff();
        int64_t *row = top + r * k;
        for (int64_t j = 0; j < c; j++) {
            if (x[j] > kth || (x[j] == kth && room-- > 0))
                row[t++] = j;
            else if (reach && x[j] + reach[j] > best)
                best = x[j] + reach[j];
        }
        if (reach)
            out[r] = best;
    }
}
