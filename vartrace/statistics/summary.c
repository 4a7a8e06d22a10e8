/* The statistics row of a record in one pass over its values: vartrace/statistics/compiled.py
   builds this file with the machine's C compiler into a Python extension module, whose
   one function `summary` it calls.

   A block of values (at most `width`) is read once: its sum and its sum of squares in 8
   float64 lanes (squares of float32 and bfloat16 values are exact in float64), its min,
   max and zeros from the values as they are.  Where the sums are not finite (NaN or
   infinities among the values), the values are read with masks: the non-finite ones
   counted and left out (float32 and bfloat16: from the chunk of 512 values where they
   first appear, that chunk read again; elsewhere the whole block again).  A block whose plain sums would cancel (its mean**2 more than
   15x its variance) is read again centred on its mean (the two-pass sum, corrected by
   the centred values' sum).  Blocks are merged by Chan, Golub and LeVeque's formula,
   their means relative to a shift (the first value, when finite).  The same steps as
   vartrace/statistics/kernels.py's numpy kernel.

   x86-64 with AVX2 and FMA runs 8 values an instruction (chosen at run time: the build
   targets any x86-64); elsewhere the same lanes in plain C, giving the same numbers (an
   FMA of an exact square is its product's sum, each lane's values in the same order). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CANCELLATION 16.0 /* plain sums while they cancel at most 4 bits */
#define LANES 8

typedef struct {
    double s[LANES], q[LANES], lo[LANES], hi[LANES];
    int64_t zeros, nan, posinf, neginf, finite;
} lanes_t;

typedef struct {
    double n, total, squares, mean, low, high;
} block_t;

static float bf16(uint16_t code) {
    uint32_t bits = (uint32_t)code << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The kinds of values: float32, float64, bfloat16 (read 8 at a time where AVX2 is), then
   int64, int32, int16, int8, uint8 and bool (one at a time), and their sizes. */
enum { F32, F64, BF16, I64, I32, I16, I8, U8, BOOL };
static const int sizes[] = {4, 8, 2, 8, 4, 2, 1, 1, 1};

static double value(const void *x, int kind, int64_t i) {
    switch (kind) {
    case F32: return ((const float *)x)[i];
    case F64: return ((const double *)x)[i];
    case BF16: return bf16(((const uint16_t *)x)[i]);
    case I64: return (double)((const int64_t *)x)[i];
    case I32: return ((const int32_t *)x)[i];
    case I16: return ((const int16_t *)x)[i];
    case I8: return ((const int8_t *)x)[i];
    default: return ((const uint8_t *)x)[i];
    }
}

static void clear(lanes_t *a) {
    memset(a, 0, sizeof *a);
    for (int k = 0; k < LANES; k++) a->lo[k] = INFINITY, a->hi[k] = -INFINITY;
}

/* Values [i, n) into lane k = i % 8, one at a time (what the vector loops leave, and
   every value where there are none); `masked`: non-finite values counted, not summed. */
static void scalar(const void *x, int kind, int64_t i, int64_t n, int masked, lanes_t *a) {
    for (; i < n; i++) {
        double v = value(x, kind, i);
        int k = i % LANES;
        if (masked && !isfinite(v)) {
            if (v != v) a->nan++;
            else if (v > 0) a->posinf++;
            else a->neginf++;
            continue;
        }
        a->finite++;
        a->s[k] += v, a->q[k] += v * v;
        a->lo[k] = v < a->lo[k] ? v : a->lo[k];
        a->hi[k] = v > a->hi[k] ? v : a->hi[k];
        a->zeros += v == 0;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VECTORS __attribute__((target("avx2,fma")))
#define CHUNK 512 /* values a plain pass reads before it checks that its sums are finite */

/* Whether the 4 lanes are finite (a NaN or an infinity makes x * 0 NaN). */
VECTORS static inline int all_finite(__m256d x) {
    __m256d zeroed = _mm256_mul_pd(x, _mm256_setzero_pd());
    return !_mm256_movemask_pd(_mm256_cmp_pd(zeroed, zeroed, _CMP_UNORD_Q));
}

/* 8 float32 (or bfloat16) values v as they are (no NaN nor infinity among them, or the
   chunk is read again masked): their float64 halves (HIGH: the upper 4 as float32) summed
   into the lanes, their extremes and zeros. */
#define NARROW_PLAIN(LOAD, HIGH)                                                              \
    {                                                                                         \
        __m256 v = LOAD;                                                                      \
        __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), d1 = _mm256_cvtps_pd(HIGH);  \
        s0 = _mm256_add_pd(s0, d0), s1 = _mm256_add_pd(s1, d1);                               \
        q0 = _mm256_fmadd_pd(d0, d0, q0), q1 = _mm256_fmadd_pd(d1, d1, q1);                   \
        lo = _mm256_min_ps(v, lo), hi = _mm256_max_ps(v, hi);                                 \
        z = _mm256_sub_epi32(z, _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_EQ_OQ)));     \
    }

/* 8 values v, NaN and infinities among them counted and left out: v - (v - v) is v
   itself where finite (signed zeros too), else NaN, which min and max pass over (they
   return their second operand, the extreme so far); the sums take 0 in their place. */
#define NARROW_MASKED(LOAD)                                                                   \
    {                                                                                         \
        __m256 v = LOAD, low = _mm256_sub_ps(v, _mm256_sub_ps(v, v));                         \
        __m256 finite = _mm256_cmp_ps(low, low, _CMP_ORD_Q), kept = _mm256_and_ps(v, finite); \
        fin = _mm256_sub_epi32(fin, _mm256_castps_si256(finite));                             \
        nan = _mm256_sub_epi32(nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));  \
        pinf = _mm256_sub_epi32(pinf, _mm256_castps_si256(_mm256_cmp_ps(v, inf, _CMP_EQ_OQ))); \
        __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(kept));                           \
        __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1));                         \
        s0 = _mm256_add_pd(s0, d0), s1 = _mm256_add_pd(s1, d1);                               \
        q0 = _mm256_fmadd_pd(d0, d0, q0), q1 = _mm256_fmadd_pd(d1, d1, q1);                   \
        lo = _mm256_min_ps(low, lo), hi = _mm256_max_ps(low, hi);                             \
        z = _mm256_sub_epi32(z, _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_EQ_OQ)));     \
    }

/* The vector part of a pass over n float32 (or bfloat16) values, 8 lanes of each.  Plain
   chunks of CHUNK values while their sums stay finite; from the first chunk whose sums do
   not (`masked`: from the start), the lanes as that chunk found them, and the chunk and
   the rest masked.  A masked read of finite values makes the same sums, extremes and zeros
   as a plain one: the lanes are those of a pass masked throughout. */
#define NARROW_LOOP(LOAD, HIGH)                                                               \
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, q0 = s0, q1 = s0;                              \
    __m256 lo = _mm256_set1_ps(INFINITY), hi = _mm256_set1_ps(-INFINITY);                     \
    __m256 zero = _mm256_setzero_ps(), inf = _mm256_set1_ps(INFINITY);                        \
    __m256i z = _mm256_setzero_si256(), nan = z, pinf = z, fin = z;                           \
    int64_t i = 0, whole = n - n % LANES, from = masked ? 0 : whole;                          \
    while (i < from) {                                                                        \
        int64_t start = i, end = i + CHUNK < whole ? i + CHUNK : whole;                       \
        __m256d ks0 = s0, ks1 = s1, kq0 = q0, kq1 = q1;                                       \
        __m256 klo = lo, khi = hi;                                                            \
        __m256i kz = z;                                                                       \
        _Pragma("GCC unroll 4") for (; i < end; i += LANES) NARROW_PLAIN(LOAD, HIGH)         \
        if (!all_finite(_mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(q0, q1)))) {       \
            s0 = ks0, s1 = ks1, q0 = kq0, q1 = kq1, lo = klo, hi = khi, z = kz;               \
            from = i = start;                                                                 \
        }                                                                                     \
    }                                                                                         \
    _Pragma("GCC unroll 2") for (; i < whole; i += LANES) NARROW_MASKED(LOAD)                \
    _mm256_storeu_pd(a->s, s0), _mm256_storeu_pd(a->s + 4, s1);                               \
    _mm256_storeu_pd(a->q, q0), _mm256_storeu_pd(a->q + 4, q1);                               \
    float l[LANES], h[LANES];                                                                 \
    int32_t counts[4][LANES];                                                                 \
    _mm256_storeu_ps(l, lo), _mm256_storeu_ps(h, hi);                                         \
    _mm256_storeu_si256((__m256i *)counts[0], z);                                             \
    _mm256_storeu_si256((__m256i *)counts[1], nan);                                           \
    _mm256_storeu_si256((__m256i *)counts[2], pinf);                                          \
    _mm256_storeu_si256((__m256i *)counts[3], fin);                                           \
    a->finite += from;                                                                        \
    for (int k = 0; k < LANES; k++) {                                                         \
        int64_t finite = counts[3][k], bad = (whole - from) / LANES - finite;                 \
        a->lo[k] = l[k], a->hi[k] = h[k], a->zeros += counts[0][k];                           \
        a->finite += finite, a->nan += counts[1][k], a->posinf += counts[2][k];               \
        a->neginf += bad - counts[1][k] - counts[2][k];                                       \
    }                                                                                         \
    return whole;

VECTORS static int64_t f32_lanes(const float *x, int64_t n, int masked, lanes_t *a) {
    NARROW_LOOP(_mm256_loadu_ps(x + i), _mm_loadu_ps(x + i + 4))
}

#define BF16(p)                                                                               \
    _mm256_castsi256_ps(_mm256_slli_epi32(                                                    \
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

VECTORS static int64_t bf16_lanes(const uint16_t *x, int64_t n, int masked, lanes_t *a) {
    NARROW_LOOP(BF16(x + i), _mm256_extractf128_ps(v, 1))
}

/* float64: 4 values at a time, twice (no FMA: a float64 square is rounded). */
#define WIDE_LOOP(MASKED)                                                                     \
    __m256d s[2], q[2], lo[2], hi[2], zero = _mm256_setzero_pd();                             \
    __m256d inf = _mm256_set1_pd(INFINITY), ninf = _mm256_set1_pd(-INFINITY);                 \
    __m256i z[2], nan[2], pinf[2], fin[2];                                                    \
    for (int h = 0; h < 2; h++) {                                                             \
        s[h] = q[h] = zero, lo[h] = inf, hi[h] = ninf;                                        \
        z[h] = nan[h] = pinf[h] = fin[h] = _mm256_setzero_si256();                            \
    }                                                                                         \
    int64_t i = 0, whole = n - n % LANES;                                                     \
    while (i < whole) {                                                                       \
    for (int64_t end = i + CHUNK < whole ? i + CHUNK : whole; i < end; i += LANES)            \
        for (int h = 0; h < 2; h++) {                                                         \
            __m256d v = _mm256_loadu_pd(x + i + 4 * h), kept = v, low = v, high = v;          \
            if (MASKED) { /* v - (v - v): as in NARROW_LOOP */                                \
                low = high = _mm256_sub_pd(v, _mm256_sub_pd(v, v));                           \
                __m256d finite = _mm256_cmp_pd(low, low, _CMP_ORD_Q);                         \
                kept = _mm256_and_pd(v, finite);                                              \
                fin[h] = _mm256_sub_epi64(fin[h], _mm256_castpd_si256(finite));               \
                nan[h] = _mm256_sub_epi64(                                                    \
                    nan[h], _mm256_castpd_si256(_mm256_cmp_pd(v, v, _CMP_UNORD_Q)));          \
                pinf[h] = _mm256_sub_epi64(                                                   \
                    pinf[h], _mm256_castpd_si256(_mm256_cmp_pd(v, inf, _CMP_EQ_OQ)));         \
            }                                                                                 \
            s[h] = _mm256_add_pd(s[h], kept);                                                 \
            q[h] = _mm256_add_pd(q[h], _mm256_mul_pd(kept, kept));                            \
            lo[h] = _mm256_min_pd(low, lo[h]), hi[h] = _mm256_max_pd(high, hi[h]);            \
            z[h] = _mm256_sub_epi64(z[h], _mm256_castpd_si256(_mm256_cmp_pd(v, zero, _CMP_EQ_OQ))); \
        }                                                                                     \
    if (!(MASKED) && !all_finite(_mm256_add_pd(_mm256_add_pd(s[0], s[1]), _mm256_add_pd(q[0], q[1])))) \
        return -1;                                                                            \
    }                                                                                         \
    int64_t counts[4][LANES];                                                                 \
    for (int h = 0; h < 2; h++) {                                                             \
        _mm256_storeu_pd(a->s + 4 * h, s[h]), _mm256_storeu_pd(a->q + 4 * h, q[h]);           \
        _mm256_storeu_pd(a->lo + 4 * h, lo[h]), _mm256_storeu_pd(a->hi + 4 * h, hi[h]);       \
        _mm256_storeu_si256((__m256i *)(counts[0] + 4 * h), z[h]);                            \
        _mm256_storeu_si256((__m256i *)(counts[1] + 4 * h), nan[h]);                          \
        _mm256_storeu_si256((__m256i *)(counts[2] + 4 * h), pinf[h]);                         \
        _mm256_storeu_si256((__m256i *)(counts[3] + 4 * h), fin[h]);                          \
    }                                                                                         \
    for (int k = 0; k < LANES; k++) {                                                         \
        a->zeros += counts[0][k];                                                             \
        if (MASKED) {                                                                         \
            int64_t bad = whole / LANES - counts[3][k];                                       \
            a->finite += counts[3][k], a->nan += counts[1][k], a->posinf += counts[2][k];     \
            a->neginf += bad - counts[1][k] - counts[2][k];                                   \
        }                                                                                     \
    }                                                                                         \
    if (!(MASKED)) a->finite += whole;                                                        \
    return whole;

VECTORS static int64_t f64_plain(const double *x, int64_t n, lanes_t *a) { WIDE_LOOP(0) }

VECTORS static int64_t f64_masked(const double *x, int64_t n, lanes_t *a) { WIDE_LOOP(1) }

static int vectors(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return known;
}

/* The values the vector loops take (a multiple of 8), into fresh lanes; -1 when a plain
   pass met a NaN or an infinity (or a square past float64) and gave up. */
static int64_t vector_pass(const void *x, int kind, int64_t n, int masked, lanes_t *a) {
    if (kind > BF16 || !vectors()) return 0;
    if (kind == F32) return f32_lanes(x, n, masked, a);
    if (kind == F64) return masked ? f64_masked(x, n, a) : f64_plain(x, n, a);
    return bf16_lanes(x, n, masked, a);
}
#else
static int64_t vector_pass(const void *x, int kind, int64_t n, int masked, lanes_t *a) {
    (void)x, (void)kind, (void)n, (void)masked, (void)a;
    return 0;
}
#endif

/* One pass over a block into `a`: the vector loops, then the rest in plain C; 0 when a
   plain pass gave up. */
static int pass(const void *x, int kind, int64_t n, int masked, lanes_t *a) {
    clear(a);
    int64_t done = vector_pass(x, kind, n, masked, a);
    if (done < 0) return 0;
    scalar(x, kind, done, n, masked, a);
    return 1;
}

static void block(const void *x, int kind, int64_t n, block_t *b, int64_t counts[4]) {
    lanes_t a;
    int masked = 0;
    double total, plain;
    for (;;) {
        int whole = pass(x, kind, n, masked, &a);
        total = plain = 0;
        for (int k = 0; k < LANES; k++) total += a.s[k], plain += a.q[k];
        if (masked || (whole && isfinite(total) && isfinite(plain))) break;
        masked = 1; /* NaN or infinities (or a square past float64): counted, left out */
    }
    double low = INFINITY, high = -INFINITY;
    for (int k = 0; k < LANES; k++) {
        low = a.lo[k] < low ? a.lo[k] : low;
        high = a.hi[k] > high ? a.hi[k] : high;
    }
    counts[0] += a.nan, counts[1] += a.posinf, counts[2] += a.neginf, counts[3] += a.zeros;
    b->n = (double)a.finite, b->total = total, b->low = low, b->high = high;
    if (!a.finite) return;
    double count = b->n, mean = total / count, squares = plain - total * mean;
    if (!(isfinite(plain) && plain <= CANCELLATION * squares)) {
        double c = 0, cc = 0;
        for (int64_t i = 0; i < n; i++) {
            double v = value(x, kind, i);
            if (isfinite(v)) c += v - mean, cc += (v - mean) * (v - mean);
        }
        squares = cc - c * c / count;
        squares = squares > 0 ? squares : 0.0;
        mean += c / count;
    }
    b->squares = squares, b->mean = mean;
}

/* The 11 summary fields of the n values at x of `kind` into out: count, mean, std, min,
   max, absmax, norm, nan, posinf, neginf, zeros.  Blocks of `width` values. */
static void summary(const void *x, int64_t n, int kind, int64_t width, double *out) {
    double count = 0, total = 0, squares = 0, offset = 0, shift = 0;
    double low = INFINITY, high = -INFINITY;
    int64_t counts[4] = {0, 0, 0, 0};
    if (n > width && isfinite(value(x, kind, 0))) shift = value(x, kind, 0);
    for (int64_t start = 0; start < n; start += width) {
        int64_t size = n - start < width ? n - start : width;
        block_t b = {0};
        block((const char *)x + start * sizes[kind], kind, size, &b, counts);
        if (b.n) {
            double delta = (b.mean - shift) - offset, merged = count + b.n;
            squares += b.squares + delta * delta * (count * b.n / merged);
            offset += delta * (b.n / merged);
            count = merged, total += b.total;
            low = b.low < low ? b.low : low, high = b.high > high ? b.high : high;
        }
    }
    out[0] = (double)n;
    for (int k = 0; k < 4; k++) out[7 + k] = (double)counts[k];
    if (!count) {
        for (int k = 1; k < 6; k++) out[k] = NAN;
        out[6] = 0.0;
        return;
    }
    double mean = total / count, var = squares / count;
    out[1] = mean, out[2] = sqrt(var), out[3] = low, out[4] = high;
    out[5] = -low > high ? -low : high;
    out[6] = sqrt(count * (var + mean * mean));
}

/* summary(values, count, kind, width, out, header[, last]): the fields of `count` values at
   address `values` into `out` (a writable buffer of float64), after `header` unless it is
   None; with `last` (a buffer, or None), whether the fields written equal its first ones
   bit for bit (False without it).  The GIL is released while a large record is read. */
static PyObject *py_summary(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "summary(values, count, kind, width, out, header[, last])");
        return NULL;
    }
    void *x = PyLong_AsVoidPtr(args[0]);
    long long n = PyLong_AsLongLong(args[1]), width = PyLong_AsLongLong(args[3]);
    long kind = PyLong_AsLong(args[2]);
    int headed = args[5] != Py_None;
    double header = headed ? PyFloat_AsDouble(args[5]) : 0.0;
    if (PyErr_Occurred()) return NULL;
    if (n < 0 || width < 1 || kind < F32 || kind > BOOL) {
        PyErr_SetString(PyExc_ValueError, "summary: a negative count, a width below 1 or an unknown kind");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[4], &view, PyBUF_WRITABLE) < 0) return NULL;
    if (view.len < (Py_ssize_t)((11 + headed) * sizeof(double))) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "summary: the out buffer is too small");
        return NULL;
    }
    double *out = view.buf, *start = out;
    Py_ssize_t written = (11 + headed) * (Py_ssize_t)sizeof(double);
    if (headed) *out++ = header;
    if (n >= 65536) {
        Py_BEGIN_ALLOW_THREADS summary(x, n, (int)kind, width, out);
        Py_END_ALLOW_THREADS
    } else {
        summary(x, n, (int)kind, width, out);
    }
    int same = 0;
    if (nargs == 7 && args[6] != Py_None) {
        Py_buffer last;
        if (PyObject_GetBuffer(args[6], &last, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        same = last.len >= written && memcmp(last.buf, start, written) == 0;
        PyBuffer_Release(&last);
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(same);
}

static PyMethodDef methods[] = {
    {"summary", (PyCFunction)(void (*)(void))py_summary, METH_FASTCALL, "The summary fields."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "vartrace_summary", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_vartrace_summary(void) { return PyModule_Create(&module); }
