/* The byte comparison and copy of change detection: vartrace/_support/native.py builds this
   file with the machine's C compiler into a Python extension module, whose functions
   vartrace/_support/memory.py calls: `memcmp(a, b, n)` instead of the C library's through
   ctypes (whose argument conversion costs about ten times the call itself), and
   `memcpy(destination, source, n)`, with which a record of a plain contiguous tensor is
   copied into a tensor made for it (torch's `clone` costs several times more instructions
   a call than its bytes' copy, for a copy torch needs no help with: the same bytes).

   The arguments are addresses of buffers of `n` bytes each.  memcmp's result is the C
   library's: 0 where the bytes are equal.  Calls on at least RELEASE_FROM bytes let other
   Python threads run meanwhile (ctypes always does). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define RELEASE_FROM (1 << 20)

/* The arguments `(a, b, n)` of both functions, named `call` in errors: two addresses
   (not null where n > 0) and a size; 0 on success, -1 with an error set. */
static int addresses(const char *call, PyObject *const *args, Py_ssize_t nargs, void **a,
                     void **b, Py_ssize_t *n) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s takes 3 arguments", call);
        return -1;
    }
    *a = PyLong_AsVoidPtr(args[0]);
    *b = PyLong_AsVoidPtr(args[1]);
    *n = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) {
        return -1;
    }
    if (*n < 0 || (*n > 0 && (*a == NULL || *b == NULL))) {
        PyErr_Format(PyExc_ValueError, "%s: a negative size or a null address", call);
        return -1;
    }
    return 0;
}

static PyObject *py_memcmp(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *a, *b;
    Py_ssize_t n;
    if (addresses("memcmp(a, b, n)", args, nargs, &a, &b, &n) < 0) {
        return NULL;
    }
    int order;
    if (n < RELEASE_FROM) {
        order = memcmp(a, b, (size_t)n);
    } else {
        Py_BEGIN_ALLOW_THREADS
        order = memcmp(a, b, (size_t)n);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(order);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VECTOR_BLOCK 128 /* the bytes one iteration of copy_vectors copies */

/* The whole blocks of `n` bytes from `source` to `destination`, four 32-byte vectors an
   iteration; returns the bytes copied. */
__attribute__((target("avx2"))) static size_t copy_vectors(char *destination,
                                                           const char *source, size_t n) {
    size_t done = 0;
    for (; done + VECTOR_BLOCK <= n; done += VECTOR_BLOCK) {
        const __m256i *from = (const __m256i *)(source + done);
        __m256i *to = (__m256i *)(destination + done);
        __m256i a = _mm256_loadu_si256(from), b = _mm256_loadu_si256(from + 1);
        __m256i c = _mm256_loadu_si256(from + 2), d = _mm256_loadu_si256(from + 3);
        _mm256_storeu_si256(to, a), _mm256_storeu_si256(to + 1, b);
        _mm256_storeu_si256(to + 2, c), _mm256_storeu_si256(to + 3, d);
    }
    return done;
}

static int has_avx2(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx2");
    return known;
}
#endif

/* memcpy, its whole 128-byte blocks in AVX2 vectors where the CPU has them: glibc copies
   blocks past a few KiB with `rep movsb`, as fast on the CPU, which callgrind counts an
   instruction a byte (the instruction counts of the record path would show its bytes,
   not its work). */
static void copy(char *destination, const char *source, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (n >= VECTOR_BLOCK && has_avx2()) {
        size_t done = copy_vectors(destination, source, n);
        destination += done, source += done, n -= done;
    }
#endif
    memcpy(destination, source, n);
}

static PyObject *py_memcpy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *destination, *source;
    Py_ssize_t n;
    if (addresses("memcpy(destination, source, n)", args, nargs, &destination, &source, &n) < 0) {
        return NULL;
    }
    if (n < RELEASE_FROM) {
        copy(destination, source, (size_t)n);
    } else {
        Py_BEGIN_ALLOW_THREADS
        copy(destination, source, (size_t)n);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"memcmp", (PyCFunction)(void (*)(void))py_memcmp, METH_FASTCALL,
     "memcmp(a, b, n): the C library's memcmp of n bytes at addresses a and b."},
    {"memcpy", (PyCFunction)(void (*)(void))py_memcpy, METH_FASTCALL,
     "memcpy(destination, source, n): copy n bytes between the addresses (not overlapping)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "vartrace_bytes", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_vartrace_bytes(void) { return PyModule_Create(&module); }
