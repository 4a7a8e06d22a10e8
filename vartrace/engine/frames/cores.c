/* The frame cores' common case in C: call a function and read the locals of the frame
   of one code object that the call runs, where only that frame is read (no `@every`, no
   callees).  vartrace/_support/native.py builds this file with the machine's C compiler;
   where it cannot, the cores (settrace.py, monitoring.py) do the same in Python.

   Both answer `(result, locals)`: the locals, `names` among them, of the first frame of
   `code` whose caller chain reaches the Python frame that called them (through at most
   MAX_DECORATOR_FRAMES wrapper frames, never through another frame of `code`); None for
   the locals where the call ran none.

   `settrace_run(code, names, function, args, kwargs)` installs a C trace function
   (`PyEval_SetTrace`) and calls `function(*args, **kwargs)`.  It returns None, calling
   nothing, where a trace function is installed already: the caller chains to it.  The
   trace function uninstalls itself as soon as it finds that frame, so the frame's body
   runs untraced; it sees only the `call` events before.  A trace function another tool
   installs meanwhile (a debugger started inside the call) stays installed.  The locals
   are read once the call has returned, from the finished frame.

   `monitoring_run(code, names, function, args, kwargs)` (Python >= 3.12) notes the call
   in a list of pending calls and calls `function(*args, **kwargs)`; the `PY_RETURN`
   callback that `monitoring_callback(fallback, watches)` makes reads the locals of a
   returning frame of a pending call, and hands every other event to `fallback` (the
   core's Python callback), unless `watches` (the Python calls it watches) is empty.

   A Python trace function or callback costs a Python call for each event; these a C
   call, and the `*_run` functions save the Python frames of the cores' `run`. */

#ifdef Py_GIL_DISABLED
#error "the pending calls and the trace function's state rely on the GIL"
#endif

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

#define MAX_DECORATOR_FRAMES 8

static PyObject *f_locals_name; /* "f_locals", interned once */

typedef struct {
    PyObject_HEAD
    PyObject *code;          /* the code object whose frame is sought (borrowed) */
    PyFrameObject *caller;   /* the frame that called settrace_run (borrowed: it outlives the call) */
    PyFrameObject *found;    /* the frame, once found (a reference) */
} Finder;

static void finder_dealloc(Finder *self) {
    Py_XDECREF(self->found);
    PyObject_Free(self);
}

/* Whether `frame`, of `code`, was called from `caller`: its caller, or past at most
   MAX_DECORATOR_FRAMES frames of other code (watch.py's `called_from`). */
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
   for a tool that chains to it (a traced call inside this one: settrace.py's
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
    .tp_name = "vartrace_frames.Finder",
    .tp_basicsize = sizeof(Finder),
    .tp_dealloc = (destructor)finder_dealloc,
    .tp_call = finder_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The state of one settrace_run() call: a trace function that finds one frame.",
};

/* Whether `args` are the 5 arguments of a `*_run` function, `name`; an exception if not. */
static int run_arguments(const char *name, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyCode_Check(args[0]) || !PyTuple_Check(args[1]) ||
        !PyTuple_Check(args[3]) || !PyDict_Check(args[4])) {
        PyErr_Format(PyExc_TypeError,
                     "%s(code, names, function, args, kwargs): a code object, a tuple, a "
                     "callable, a tuple and a dict",
                     name);
        return 0;
    }
    return 1;
}

/* `function(*args, **kwargs)`, of a `*_run` function's arguments: a new reference, or NULL
   with the call's exception. */
static PyObject *call(PyObject *const *args) {
    return PyObject_Call(args[2], args[3], PyDict_GET_SIZE(args[4]) ? args[4] : NULL);
}

/* `(result, snapshot)`, None for a NULL snapshot: a new reference, or NULL. */
static PyObject *answer(PyObject *result, PyObject *snapshot) {
    return PyTuple_Pack(2, result, snapshot == NULL ? Py_None : snapshot);
}

static PyObject *settrace_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!run_arguments("settrace_run", args, nargs)) {
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
    PyObject *result = call(args);
    if (state->c_traceobj == (PyObject *)finder) { /* not found: still installed */
        PyEval_SetTrace(NULL, NULL);
    }
    PyObject *answered = NULL;
    if (result != NULL && finder->found == NULL) {
        answered = answer(result, NULL);
    } else if (result != NULL) {
        PyObject *snapshot = frame_locals(finder->found, args[1]);
        if (snapshot != NULL) {
            answered = answer(result, snapshot);
            Py_DECREF(snapshot);
        }
    }
    Py_XDECREF(result);
    Py_DECREF(finder); /* and the frame: it holds its caller's frame, which must not hold it */
    return answered;
}

#if PY_VERSION_HEX >= 0x030C0000
/* A call of `monitoring_run` under way: what its PY_RETURN callback looks for, and what
   it read.  On the heap, in a list shared by the threads (the GIL guards it): a call's
   C stack may move while it runs (greenlets copy stacks aside). */
typedef struct Pending {
    struct Pending *prev, *next;
    PyObject *code;         /* the code object whose frame is sought (borrowed) */
    PyObject *names;        /* the names to read (borrowed) */
    PyFrameObject *caller;  /* the frame that called monitoring_run (borrowed) */
    PyObject *snapshot;     /* the locals read at return (a reference), or NULL */
} Pending;

static Pending *pending; /* the list's first call, the latest started */

/* The call under way whose caller is `frame` and that seeks a frame of `code`. */
static Pending *pending_of(PyFrameObject *frame, PyObject *code) {
    for (Pending *call = pending; call != NULL; call = call->next) {
        if (call->caller == frame && call->code == code && call->snapshot == NULL) {
            return call;
        }
    }
    return NULL;
}

/* The call under way that `frame`, of `code`, belongs to: one whose caller is `frame`'s
   caller, or is past at most MAX_DECORATOR_FRAMES frames of other code
   (monitoring.py's `_find`). */
static Pending *pending_call(PyFrameObject *frame, PyObject *code) {
    Pending *found = pending;
    while (found != NULL && found->code != code) { /* most frames of code are not sought */
        found = found->next;
    }
    if (found == NULL) {
        return NULL;
    }
    found = NULL;
    PyFrameObject *back = PyFrame_GetBack(frame);
    for (int i = 0; i < MAX_DECORATOR_FRAMES && back != NULL && found == NULL; i++) {
        PyCodeObject *back_code = PyFrame_GetCode(back);
        Py_DECREF(back_code);
        if ((PyObject *)back_code == code) {
            break;
        }
        found = pending_of(back, code);
        PyFrameObject *next = PyFrame_GetBack(back);
        Py_DECREF(back);
        back = next;
    }
    Py_XDECREF(back);
    return found;
}

static PyObject *monitoring_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (!run_arguments("monitoring_run", args, nargs)) {
        return NULL;
    }
    Pending *call_state = PyMem_Malloc(sizeof(Pending));
    if (call_state == NULL) {
        return PyErr_NoMemory();
    }
    *call_state = (Pending){NULL, pending, args[0], args[1], PyEval_GetFrame(), NULL};
    if (pending != NULL) {
        pending->prev = call_state;
    }
    pending = call_state;
    PyObject *result = call(args);
    if (call_state->prev != NULL) {
        call_state->prev->next = call_state->next;
    } else {
        pending = call_state->next;
    }
    if (call_state->next != NULL) {
        call_state->next->prev = call_state->prev;
    }
    PyObject *answered = result == NULL ? NULL : answer(result, call_state->snapshot);
    Py_XDECREF(result);
    Py_XDECREF(call_state->snapshot);
    PyMem_Free(call_state);
    return answered;
}

/* The PY_RETURN callback, `(code, offset, retval)`, bound to `(fallback, watches)`. */
static PyObject *on_return(PyObject *bound, PyObject *const *args, Py_ssize_t nargs) {
    if (pending != NULL && nargs == 3) {
        PyFrameObject *frame = PyEval_GetFrame(); /* the returning frame (a C callee has none) */
        Pending *call_state = frame == NULL ? NULL : pending_call(frame, args[0]);
        if (call_state != NULL) {
            call_state->snapshot = frame_locals(frame, call_state->names);
            if (call_state->snapshot == NULL) {
                return NULL;
            }
            Py_RETURN_NONE;
        }
    }
    if (!PyDict_GET_SIZE(PyTuple_GET_ITEM(bound, 1))) {
        Py_RETURN_NONE; /* no Python watch: the fallback would find nothing */
    }
    return PyObject_Vectorcall(PyTuple_GET_ITEM(bound, 0), args, nargs, NULL);
}

static PyMethodDef on_return_method = {
    "on_return", (PyCFunction)(void (*)(void))on_return, METH_FASTCALL,
    "on_return(code, offset, retval): read the frame of a monitoring_run call, or hand the "
    "event to the fallback."};

static PyObject *monitoring_callback(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyCallable_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "monitoring_callback(fallback, watches): a callable and a dict");
        return NULL;
    }
    PyObject *bound = PyTuple_Pack(2, args[0], args[1]);
    if (bound == NULL) {
        return NULL;
    }
    PyObject *callback = PyCFunction_New(&on_return_method, bound);
    Py_DECREF(bound);
    return callback;
}
#endif

static PyMethodDef methods[] = {
    {"settrace_run", (PyCFunction)(void (*)(void))settrace_run, METH_FASTCALL,
     "settrace_run(code, names, function, args, kwargs) -> (result, the locals of code's "
     "frame, among them names, or None); None where another trace function is installed."},
#if PY_VERSION_HEX >= 0x030C0000
    {"monitoring_run", (PyCFunction)(void (*)(void))monitoring_run, METH_FASTCALL,
     "monitoring_run(code, names, function, args, kwargs) -> (result, the locals of "
     "code's frame, among them names, or None), read by monitoring_callback's callback."},
    {"monitoring_callback", (PyCFunction)(void (*)(void))monitoring_callback, METH_FASTCALL,
     "monitoring_callback(fallback, watches) -> a PY_RETURN callback for sys.monitoring."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "vartrace_frames", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_vartrace_frames(void) {
    f_locals_name = PyUnicode_InternFromString("f_locals");
    if (f_locals_name == NULL || PyType_Ready(&FinderType) < 0) {
        return NULL;
    }
    return PyModule_Create(&module);
}
