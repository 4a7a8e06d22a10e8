/* The settrace core's common case in C: call a function and find the frame of one code
   object that the call runs, where no other tool traces (vartrace/engine/frames.py,
   `SettraceCore.run`).  vartrace/_support/native.py builds this file with the machine's
   C compiler; where it cannot, frames.py does the same with a Python trace function.

   `find(code, names, function, args, kwargs)` installs a C trace function
   (`PyEval_SetTrace`), calls `function(*args, **kwargs)`, and returns
   `(result, locals)`: the locals, `names` among them, that the finished frame of `code`
   held, the first such frame whose caller chain reaches the Python frame that called
   `find` (through at most MAX_DECORATOR_FRAMES wrapper frames, never through another
   frame of `code`); None where the call ran none.  `find` returns None, calling
   nothing, where a trace function is installed already: the caller chains to it.  The trace
   function uninstalls itself as soon as it finds that frame, so the frame's body runs
   untraced; it sees only the `call` events before.  A trace function another tool
   installs meanwhile (a debugger started inside the call) stays installed.

   A Python trace function costs a Python call for each event; this one a C call, and
   `find` itself saves the closure, `sys._getframe` and the `sys.settrace` and
   `sys.gettrace` calls of the Python version. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

#define MAX_DECORATOR_FRAMES 8

static PyObject *f_locals_name; /* "f_locals", interned once */

typedef struct {
    PyObject_HEAD
    PyObject *code;          /* the code object whose frame is sought (borrowed) */
    PyFrameObject *caller;   /* the frame that called find (borrowed: it outlives the call) */
    PyFrameObject *found;    /* the frame, once found (a reference) */
} Finder;

static void finder_dealloc(Finder *self) {
    Py_XDECREF(self->found);
    PyObject_Free(self);
}

/* Whether `frame`, of `code`, was called from `caller`: its caller, or past at most
   MAX_DECORATOR_FRAMES frames of other code (frames.py's `_called_from`). */
static int called_from(PyFrameObject *frame, PyObject *code, PyFrameObject *caller) {
    PyFrameObject *back = PyFrame_GetBack(frame);
    for (int i = 0; i < MAX_DECORATOR_FRAMES && back != NULL; i++) {
        if (back == caller) {
            Py_DECREF(back);
            return 1;
        }
        PyCodeObject *back_code = PyFrame_GetCode(back);
        Py_DECREF(back_code);
        if ((PyObject *)back_code == code) {
            break;
        }
        PyFrameObject *next = PyFrame_GetBack(back);
        Py_DECREF(back);
        back = next;
    }
    Py_XDECREF(back);
    return 0;
}

static int trace(PyObject *obj, PyFrameObject *frame, int what, PyObject *arg) {
    (void)arg;
    if (what != PyTrace_CALL) {
        return 0;
    }
    Finder *finder = (Finder *)obj;
    PyCodeObject *code = PyFrame_GetCode(frame);
    Py_DECREF(code);
    if ((PyObject *)code != finder->code || !called_from(frame, finder->code, finder->caller)) {
        return 0;
    }
    Py_INCREF(frame);
    finder->found = frame;
    PyEval_SetTrace(NULL, NULL);  /* the caller's reference keeps the finder alive */
    return 0;
}

/* The locals of `frame`, a finished frame, among them `names`: the frame's own dict of
   them before Python 3.13; from 3.13 (PEP 667) its `f_locals` is a proxy that holds the
   frame, so the values of `names` are copied out of it. */
static PyObject *frame_locals(PyFrameObject *frame, PyObject *names) {
    PyObject *f_locals = PyObject_GetAttr((PyObject *)frame, f_locals_name);
#if PY_VERSION_HEX < 0x030D0000
    (void)names;
    return f_locals;
#else
    if (f_locals == NULL) {
        return NULL;
    }
    PyObject *snapshot = PyDict_New();
    for (Py_ssize_t i = 0; snapshot != NULL && i < PyTuple_GET_SIZE(names); i++) {
        PyObject *value;
        int present = PyMapping_GetOptionalItem(f_locals, PyTuple_GET_ITEM(names, i), &value);
        if (present > 0) {
            present = PyDict_SetItem(snapshot, PyTuple_GET_ITEM(names, i), value);
            Py_DECREF(value);
        }
        if (present < 0) {
            Py_CLEAR(snapshot);
        }
    }
    Py_DECREF(f_locals);
    return snapshot;
#endif
}

/* `finder(frame, event, arg)`: the trace function as Python sees it (`sys.gettrace()`),
   for a tool that chains to it (a traced call inside this one: frames.py's
   `_ChainedTracer`). */
static PyObject *finder_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    PyObject *frame, *event, *arg;
    if (!PyArg_UnpackTuple(args, "Finder", 3, 3, &frame, &event, &arg)) {
        return NULL;
    }
    if (!PyFrame_Check(frame) || !PyUnicode_Check(event) ||
        (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Finder(frame, event, arg): a frame and a str");
        return NULL;
    }
    if (PyUnicode_CompareWithASCIIString(event, "call") == 0) {
        trace(self, (PyFrameObject *)frame, PyTrace_CALL, arg);
    }
    Py_RETURN_NONE;
}

static PyTypeObject FinderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "vartrace_settrace.Finder",
    .tp_basicsize = sizeof(Finder),
    .tp_dealloc = (destructor)finder_dealloc,
    .tp_call = finder_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The state of one find() call: a trace function that finds one frame.",
};

static PyObject *find(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "find(code, names, function, args, kwargs) takes 5 arguments");
        return NULL;
    }
    if (!PyCode_Check(args[0]) || !PyTuple_Check(args[1]) || !PyTuple_Check(args[3]) ||
        !PyDict_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "find(code, names, function, args, kwargs): a code "
                                         "object, a tuple, a callable, a tuple and a dict");
        return NULL;
    }
    PyThreadState *state = PyThreadState_Get();
    if (state->c_tracefunc != NULL) {
        Py_RETURN_NONE; /* another tool traces: the caller chains to it */
    }
    Finder *finder = PyObject_New(Finder, &FinderType);
    if (finder == NULL) {
        return NULL;
    }
    finder->code = args[0];
    finder->caller = PyEval_GetFrame();
    finder->found = NULL;
    PyEval_SetTrace(trace, (PyObject *)finder);
    PyObject *result = PyObject_Call(args[2], args[3], PyDict_GET_SIZE(args[4]) ? args[4] : NULL);
    if (state->c_traceobj == (PyObject *)finder) { /* not found: still installed */
        PyEval_SetTrace(NULL, NULL);
    }
    PyObject *answer = NULL;
    if (result != NULL && finder->found == NULL) {
        answer = PyTuple_Pack(2, result, Py_None);
    } else if (result != NULL) {
        PyObject *snapshot = frame_locals(finder->found, args[1]);
        if (snapshot != NULL) {
            answer = PyTuple_Pack(2, result, snapshot);
            Py_DECREF(snapshot);
        }
    }
    Py_XDECREF(result);
    Py_DECREF(finder); /* and the frame: it holds its caller's frame, which must not hold it */
    return answer;
}

static PyMethodDef methods[] = {
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL,
     "find(code, names, function, args, kwargs) -> (result, the locals of code's frame, "
     "among them names, or None); None where another trace function is installed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "vartrace_settrace", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_vartrace_settrace(void) {
    f_locals_name = PyUnicode_InternFromString("f_locals");
    if (f_locals_name == NULL || PyType_Ready(&FinderType) < 0) {
        return NULL;
    }
    return PyModule_Create(&module);
}
