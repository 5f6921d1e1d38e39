/*
 * kvrt.ipc._atomic: atomic loads, stores and read-modify-writes on memory inside a
 * shared-memory mapping.
 *
 * Why a C extension: Python has no memory-ordering primitives, and the pure-Python
 * alternatives cost microseconds per call (the `atomics` package: 4-15 us). A
 * lock-free ring needs a load-acquire and a store-release per operation, so the
 * primitive has to cost tens of nanoseconds: one METH_FASTCALL method on an object
 * that already holds the buffer, with a bounds and alignment check that turns a bad
 * offset into an exception instead of a crash.
 *
 * A Region pins a writable buffer (an mmap, a bytearray, a numpy array) for its
 * lifetime; offsets are byte offsets from the start of that buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
} Region;

static int
region_init(Region *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    static char *kwlist[] = {"buffer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &obj))
        return -1;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->has_view = 1;
    return 0;
}

static void
region_dealloc(Region *self)
{
    if (self->has_view)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Resolve a byte offset to an aligned address inside the buffer, or raise. */
static void *
region_addr(Region *self, PyObject *off_obj, Py_ssize_t width)
{
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "region is released");
        return NULL;
    }
    Py_ssize_t off = PyLong_AsSsize_t(off_obj);
    if (off == -1 && PyErr_Occurred())
        return NULL;
    if (off < 0 || off > self->view.len - width) {
        PyErr_Format(PyExc_IndexError, "offset %zd (+%zd bytes) outside region of %zd bytes",
                     off, width, self->view.len);
        return NULL;
    }
    char *p = (char *)self->view.buf + off;
    if (((uintptr_t)p) % (uintptr_t)width != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not %zd-byte aligned", off, width);
        return NULL;
    }
    return p;
}

static int
check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

static int
as_i32(PyObject *o, int32_t *out)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "value does not fit in int32");
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static int
as_i64(PyObject *o, int64_t *out)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

#define DEFINE_OPS(BITS, CTYPE, CONV, PYFROM)                                                   \
    static PyObject *region_load##BITS(Region *self, PyObject *const *args, Py_ssize_t nargs) \
    {                                                                                         \
        if (check_nargs(nargs, 1, "load" #BITS) < 0)                                          \
            return NULL;                                                                      \
        CTYPE *p = region_addr(self, args[0], sizeof(CTYPE));                                 \
        if (!p)                                                                               \
            return NULL;                                                                      \
        return PYFROM(__atomic_load_n(p, __ATOMIC_ACQUIRE));                                  \
    }                                                                                         \
    static PyObject *region_store##BITS(Region *self, PyObject *const *args, Py_ssize_t nargs) \
    {                                                                                         \
        CTYPE v;                                                                              \
        if (check_nargs(nargs, 2, "store" #BITS) < 0)                                         \
            return NULL;                                                                      \
        CTYPE *p = region_addr(self, args[0], sizeof(CTYPE));                                 \
        if (!p || CONV(args[1], &v) < 0)                                                      \
            return NULL;                                                                      \
        __atomic_store_n(p, v, __ATOMIC_RELEASE);                                             \
        Py_RETURN_NONE;                                                                       \
    }                                                                                         \
    static PyObject *region_exchange##BITS(Region *self, PyObject *const *args,               \
                                           Py_ssize_t nargs)                                  \
    {                                                                                         \
        CTYPE v;                                                                              \
        if (check_nargs(nargs, 2, "exchange" #BITS) < 0)                                      \
            return NULL;                                                                      \
        CTYPE *p = region_addr(self, args[0], sizeof(CTYPE));                                 \
        if (!p || CONV(args[1], &v) < 0)                                                      \
            return NULL;                                                                      \
        return PYFROM(__atomic_exchange_n(p, v, __ATOMIC_SEQ_CST));                           \
    }                                                                                         \
    static PyObject *region_cas##BITS(Region *self, PyObject *const *args, Py_ssize_t nargs)  \
    {                                                                                         \
        CTYPE expected, desired;                                                              \
        if (check_nargs(nargs, 3, "cas" #BITS) < 0)                                           \
            return NULL;                                                                      \
        CTYPE *p = region_addr(self, args[0], sizeof(CTYPE));                                 \
        if (!p || CONV(args[1], &expected) < 0 || CONV(args[2], &desired) < 0)                \
            return NULL;                                                                      \
        int ok = __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST,      \
                                             __ATOMIC_SEQ_CST);                               \
        return PyBool_FromLong(ok);                                                           \
    }                                                                                         \
    static PyObject *region_fetch_add##BITS(Region *self, PyObject *const *args,              \
                                            Py_ssize_t nargs)                                 \
    {                                                                                         \
        CTYPE v;                                                                              \
        if (check_nargs(nargs, 2, "fetch_add" #BITS) < 0)                                     \
            return NULL;                                                                      \
        CTYPE *p = region_addr(self, args[0], sizeof(CTYPE));                                 \
        if (!p || CONV(args[1], &v) < 0)                                                      \
            return NULL;                                                                      \
        return PYFROM(__atomic_fetch_add(p, v, __ATOMIC_SEQ_CST));                            \
    }

DEFINE_OPS(32, int32_t, as_i32, PyLong_FromLong)
DEFINE_OPS(64, int64_t, as_i64, PyLong_FromLongLong)

/*
 * The publish half of an eventcount: store-release a new index, full fence, then
 * load the peer's "I am going to sleep" word. The fence is what makes it safe: either
 * the sleeper sees the new index on its re-check, or we see its flag and ring its bell.
 */
static PyObject *
region_store_fence_load64(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t v;
    if (check_nargs(nargs, 3, "store_fence_load64") < 0)
        return NULL;
    int64_t *sp = region_addr(self, args[0], 8);
    if (!sp || as_i64(args[1], &v) < 0)
        return NULL;
    int64_t *lp = region_addr(self, args[2], 8);
    if (!lp)
        return NULL;
    __atomic_store_n(sp, v, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return PyLong_FromLongLong(__atomic_load_n(lp, __ATOMIC_SEQ_CST));
}

static PyObject *
region_release(Region *self, PyObject *Py_UNUSED(ignored))
{
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *
region_get_size(Region *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->has_view ? self->view.len : 0);
}

static PyObject *
region_get_address(Region *self, void *Py_UNUSED(closure))
{
    return PyLong_FromVoidPtr(self->has_view ? self->view.buf : NULL);
}

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))region_##name, METH_FASTCALL, doc}

static PyMethodDef region_methods[] = {
    FAST(load32, "load32(off) -> int: load-acquire of an int32."),
    FAST(load64, "load64(off) -> int: load-acquire of an int64."),
    FAST(store32, "store32(off, v): store-release of an int32."),
    FAST(store64, "store64(off, v): store-release of an int64."),
    FAST(exchange32, "exchange32(off, v) -> old: sequentially consistent swap."),
    FAST(exchange64, "exchange64(off, v) -> old: sequentially consistent swap."),
    FAST(cas32, "cas32(off, expected, desired) -> bool: compare-and-swap."),
    FAST(cas64, "cas64(off, expected, desired) -> bool: compare-and-swap."),
    FAST(fetch_add32, "fetch_add32(off, delta) -> old value."),
    FAST(fetch_add64, "fetch_add64(off, delta) -> old value."),
    FAST(store_fence_load64,
         "store_fence_load64(store_off, v, load_off) -> int: store, full fence, load."),
    {"release", (PyCFunction)region_release, METH_NOARGS,
     "Release the pinned buffer (so an mmap can be closed)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef region_getset[] = {
    {"size", (getter)region_get_size, NULL, "bytes in the region", NULL},
    {"address", (getter)region_get_address, NULL, "base address of the region", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvrt.ipc._atomic.Region",
    .tp_basicsize = sizeof(Region),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Region(buffer): atomic operations at byte offsets inside a writable buffer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)region_init,
    .tp_dealloc = (destructor)region_dealloc,
    .tp_methods = region_methods,
    .tp_getset = region_getset,
};

static PyObject *
atomic_fence(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored))
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"fence", atomic_fence, METH_NOARGS, "fence(): full (sequentially consistent) memory fence."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef atomic_module = {
    PyModuleDef_HEAD_INIT, "kvrt.ipc._atomic",
    "Atomic operations on shared-memory buffers (acquire/release, CAS, fetch-add, fence).", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__atomic(void)
{
    if (PyType_Ready(&RegionType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&atomic_module);
    if (!m)
        return NULL;
    Py_INCREF(&RegionType);
    if (PyModule_AddObject(m, "Region", (PyObject *)&RegionType) < 0) {
        Py_DECREF(&RegionType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
