/* The prefix cache's per-block inner loop in C: chained block keys (runtime/hashing.py).

Why C: `chain_keys` in Python costs a bytes slice, a concatenation and a call per block (about
0.25 us per 64-token block, as much as the whole cache's work per block without eviction); the
hash itself is a fraction of that. The keys are the same bytes as the Python loop's, which stays
as the reference and the fallback: xxh3-128 of (parent key || block's token bytes), in xxhash's
canonical (big-endian) form, as `xxhash.xxh3_128_digest` returns it. The vendored xxhash.h
(runtime/_xxhash/, BSD-2-Clause) is compiled in, so nothing is needed at run time. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "_xxhash/xxhash.h"

#define KEY_BYTES 16

static PyObject *chain_keys(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t block_size;
    const char *parent;
    Py_ssize_t parent_len;
    if (!PyArg_ParseTuple(args, "y*ny#", &data, &block_size, &parent, &parent_len))
        return NULL;
    if (block_size <= 0 || parent_len != KEY_BYTES) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "chain_keys: need block_size > 0 and a %d-byte parent key",
                     KEY_BYTES);
        return NULL;
    }
    Py_ssize_t step = block_size * 4; /* int32 tokens */
    Py_ssize_t n = data.len / step;
    PyObject *out = PyList_New(n);
    unsigned char *buf = PyMem_Malloc(KEY_BYTES + step);
    if (out == NULL || buf == NULL) {
        Py_XDECREF(out);
        PyMem_Free(buf);
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    memcpy(buf, parent, KEY_BYTES);
    const unsigned char *src = data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(buf + KEY_BYTES, src + i * step, step);
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, XXH3_128bits(buf, KEY_BYTES + step));
        PyObject *key = PyBytes_FromStringAndSize((const char *)c.digest, KEY_BYTES);
        if (key == NULL) {
            Py_DECREF(out);
            out = NULL;
            break;
        }
        PyList_SET_ITEM(out, i, key);
        memcpy(buf, c.digest, KEY_BYTES); /* the next block chains this key */
    }
    PyMem_Free(buf);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(token_bytes, block_size, parent) -> keys of the full blocks, chained from parent"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "runtime._cache_core", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cache_core(void) { return PyModule_Create(&module); }
