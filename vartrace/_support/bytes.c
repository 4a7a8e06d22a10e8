/* The byte comparison of change detection: vartrace/_support/native.py builds this file
   with the machine's C compiler into a Python extension module, whose one function
   `memcmp(a, b, n)` vartrace/_support/memory.py calls instead of the C library's through
   ctypes (whose argument conversion costs about ten times the call itself).

   `a` and `b` are the addresses of two buffers of `n` bytes each; the result is the C
   library's memcmp's: 0 where the bytes are equal.  Comparisons of at least RELEASE_FROM
   bytes let other Python threads run meanwhile (ctypes always does). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define RELEASE_FROM (1 << 20)

static PyObject *py_memcmp(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "memcmp(a, b, n) takes 3 arguments");
        return NULL;
    }
    void *a = PyLong_AsVoidPtr(args[0]);
    void *b = PyLong_AsVoidPtr(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "memcmp: a negative size");
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

static PyMethodDef methods[] = {
    {"memcmp", (PyCFunction)(void (*)(void))py_memcmp, METH_FASTCALL,
     "memcmp(a, b, n): the C library's memcmp of n bytes at addresses a and b."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "vartrace_bytes", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_vartrace_bytes(void) { return PyModule_Create(&module); }
