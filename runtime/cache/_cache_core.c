/* The prefix cache's per-block inner loops in C: chained block keys (runtime/cache/keys.py), the
use-count sketch's updates (runtime/cache/use_sketch.py), the node matrix work of matching,
recording, releasing and evicting (runtime/cache/match.py, eviction.py, tasks.py), the `reuse`
family of policies' per-node bookkeeping and heap (runtime/cache/policies/reuse.py, gaps.py) and
the `adaptive` policy's segments and ledger (runtime/cache/policies/adaptive.py, adapt_*: no
Python reference; tests/runtime/cache/test_adaptive_bound.py and the cache's property and
batched-against-one-at-a-time tests check it).

Why C: in Python each costs a call or a few numpy operations per block or per request of a
couple of hundred blocks (a key slice, concatenation and hash call per block; a join, a view
and six gathers and scatters on the sketch per request), as much together as the whole cache's
own work per block. Each function gives exactly what the Python code it replaces gives, which
lives on in tests/runtime/cache/cache_reference.py as the reference (tests compare them):
- chain_keys: xxh3-128 of (parent key || block's token bytes), in xxhash's canonical
  (big-endian) form, as `xxhash.xxh3_128_digest` returns it. The hash function is the one the
  `xxhash` package (a dependency) already loaded: its extension module exports XXH3_128bits, so
  the module looks it up there at init (dlsym) and builds with nothing but Python's headers,
  the same function computing the same bytes as the package does (checked at init).
- sketch_add / sketch_count: a 16-byte key's two slots are its first 8 bytes (native byte order,
  as numpy reads them) masked, and the same shifted right by 32, masked; adding is numpy's
  gather-then-scatter `row[slots] = minimum(row[slots], 254) + 1` (a slot that two keys share
  gains one, not two). Either returns False, changing nothing, if a key is not 16 bytes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#define KEY_BYTES 16

/* Ask for the cache line at p ahead of its use (rw: 1 to be written). An empty asm that takes
   the address keeps the hint: GCC (12, -O2) drops a __builtin_prefetch whose address comes from
   a load as dead code, which left several of the hints below unemitted. */
#define AHEAD(p, rw) do { \
        const void *ahead_ = (const void *)(p); \
        __asm__ volatile("" : : "r"(ahead_)); \
        __builtin_prefetch(ahead_, rw); \
    } while (0)

/* XXH3_128bits as xxhash.h declares it (XXH128_hash_t: low64, then high64) */
typedef struct { uint64_t low64, high64; } kv_h128;
typedef kv_h128 (*kv_xxh3_128)(const void *, size_t);
static kv_xxh3_128 xxh3_128; /* set once, at module init */

/* xxhash's canonical form of a 128-bit hash: high64 then low64, each big-endian */
static void canonical128(kv_h128 h, unsigned char *out) {
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t hi = __builtin_bswap64(h.high64), lo = __builtin_bswap64(h.low64); /* (two stores, not 16) */
    memcpy(out, &hi, 8);
    memcpy(out + 8, &lo, 8);
#else
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)h.high64;
        out[8 + i] = (unsigned char)h.low64;
        h.high64 >>= 8;
        h.low64 >>= 8;
    }
#endif
}

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
        canonical128(xxh3_128(buf, KEY_BYTES + step), buf); /* the next block chains this key */
        PyObject *key = PyBytes_FromStringAndSize((const char *)buf, KEY_BYTES);
        if (key == NULL) {
            Py_DECREF(out);
            out = NULL;
            break;
        }
        PyList_SET_ITEM(out, i, key);
    }
    PyMem_Free(buf);
    PyBuffer_Release(&data);
    return out;
}

static int is_int32(const Py_buffer *b) {
    size_t n = b->format ? strlen(b->format) : 0;
    return b->itemsize == 4 && n && b->format[n - 1] == 'i' && (n == 1 || strchr("@=<", b->format[0]));
}

/* ---- arguments: the buffers a function reads and writes, taken, checked and released together

take_bufs(&v, what, spec, obj...): one buffer per letter of `spec`, from the objects that
follow it: 'm' the node matrix (int32, 2-D, C order), 'n' node ids (int32, each a column of the
matrix, the first buffer, or where there is none below the length of the buffer before them),
'i' an int32 vector, 'b',
'u', 'q' vectors of 1-, 4- and 8-byte items; upper case: written too. '=' before a letter: as
long as the buffer before it; '~': its items may be any number of bytes apart (strides[0]),
not only next to each other. 0, or -1 with an exception set and nothing held; `drop_bufs`
releases them. */
#define MAX_BUFS 16
typedef struct {
    Py_buffer b[MAX_BUFS];
    int n;
} bufs;

static void drop_bufs(bufs *v) {
    for (int i = 0; i < v->n; i++)
        PyBuffer_Release(&v->b[i]);
    v->n = 0;
}

/* Does buffer `b` fit letter `c` (lower case) of a take_bufs spec? */
static int fits(const Py_buffer *b, char c) {
    if (c == 'm')
        return b->ndim == 2 && is_int32(b);
    if (b->ndim != 1)
        return 0;
    if (c == 'i' || c == 'n')
        return is_int32(b);
    return b->itemsize == (c == 'b' ? 1 : c == 'u' ? 4 : 8);
}

static int vtake_bufs(bufs *v, const char *what, const char *spec, va_list ap) {
    static const char *kinds = "m: an int32 matrix; n, i: an int32 vector; b, u, q: a vector of 1-, 4-, 8-byte items";
    v->n = 0;
    int same = 0, strided = 0;
    for (const char *c = spec; *c; c++) {
        if (*c == '=') {
            same = 1;
            continue;
        }
        if (*c == '~') {
            strided = 1;
            continue;
        }
        char lower = (char)(*c | 0x20);
        Py_buffer *b = &v->b[v->n];
        if (v->n == MAX_BUFS || strchr("mnibuq", lower) == NULL) {
            PyErr_Format(PyExc_SystemError, "%s: bad buffer spec %s", what, spec);
            goto fail;
        }
        /* (the format only where it is checked: numpy builds it for each new array asked) */
        int format = strchr("mni", lower) ? PyBUF_FORMAT : 0;
        if (PyObject_GetBuffer(va_arg(ap, PyObject *), b,
                               (*c != lower ? PyBUF_WRITABLE : 0) | (strided ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS) |
                                   format) < 0)
            goto fail;
        strided = 0;
        v->n++;
        if (!fits(b, lower)) {
            PyErr_Format(PyExc_ValueError, "%s: argument %d is not %c (%s)", what, v->n, lower, kinds);
            goto fail;
        }
        if (same && b->shape[0] != b[-1].shape[0]) {
            PyErr_Format(PyExc_ValueError, "%s: argument %d must be as long as the one before it", what, v->n);
            goto fail;
        }
        same = 0;
        if (lower == 'n') {
            const int32_t *id = b->buf;
            Py_ssize_t cap = v->b[0].ndim == 2 ? v->b[0].shape[1] : v->n < 2 ? 0 : b[-1].shape[0];
            for (Py_ssize_t i = 0; i < b->shape[0]; i++)
                if (id[i] < 0 || id[i] >= cap) {
                    PyErr_Format(PyExc_IndexError, "%s: node id out of range", what);
                    goto fail;
                }
        }
    }
    return 0;
fail:
    drop_bufs(v);
    return -1;
}

static int take_bufs(bufs *v, const char *what, const char *spec, ...) {
    va_list ap;
    va_start(ap, spec);
    int r = vtake_bufs(v, what, spec, ap);
    va_end(ap);
    return r;
}

/* The row indices of `rows` (a tuple of `n` ints, each a row of `f`) into r[]; -1 with an
   exception if not. */
static int row_tuple(PyObject *rows, Py_ssize_t n, const Py_buffer *f, long *r, const char *what) {
    if (!PyTuple_Check(rows) || PyTuple_GET_SIZE(rows) != n) {
        PyErr_Format(PyExc_ValueError, "%s: rows must be a tuple of %zd", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        r[i] = PyLong_AsLong(PyTuple_GET_ITEM(rows, i));
        if (r[i] < 0 || r[i] >= f->shape[0]) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: row out of range", what);
            return -1;
        }
    }
    return 0;
}

/* The int `item` as an index below `n` into *out; -1 with an exception (IndexError if out of range). */
static int index_below(PyObject *item, Py_ssize_t n, Py_ssize_t *out, const char *what) {
    *out = PyLong_AsSsize_t(item);
    if (*out >= 0 && *out < n)
        return 0;
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_IndexError, "%s: index out of range", what);
    return -1;
}

/* Append the new object `x` (NULL: its creation failed) to `list`, taking it over; -1 on failure. */
static int append_new(PyObject *list, PyObject *x) {
    int r = x == NULL ? -1 : PyList_Append(list, x);
    Py_XDECREF(x);
    return r;
}

/* The values a freed node's column is reset to: the tuple `reset`, one int per row of `f`, into
v[] (room for MAX_ROWS); -1 with an exception if not. */
#define MAX_ROWS 32
static int reset_column(PyObject *reset, const Py_buffer *f, int32_t *v, const char *what) {
    Py_ssize_t nrows = f->shape[0];
    if (!PyTuple_Check(reset) || PyTuple_GET_SIZE(reset) != nrows || nrows > MAX_ROWS) {
        PyErr_Format(PyExc_ValueError, "%s: reset must be a tuple of one int per row", what);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nrows; i++) {
        long x = PyLong_AsLong(PyTuple_GET_ITEM(reset, i));
        if (x == -1 && PyErr_Occurred())
            return -1;
        v[i] = (int32_t)x;
    }
    return 0;
}

/* ---- node surgery shared by the eviction functions (the rows of one node matrix) */

/* `_detach_sibling`: node v leaves its parent p's child list (and continuation). */
static void detach(int32_t *CHILD, int32_t *NEXT, int32_t *PREV, int32_t *CONT, int32_t p, int32_t v) {
    int32_t b = PREV[v], a = NEXT[v];
    if (CONT[p] == v)
        CONT[p] = -1;
    if (b >= 0)
        NEXT[b] = a;
    else
        CHILD[p] = a;
    if (a >= 0)
        PREV[a] = b;
}

/* Node v's column freed: its key slot cleared, its fields reset to reset_v, its id on the free-id
   stack. */
static void free_column(int32_t *M, Py_ssize_t nrows, Py_ssize_t ncols, const int32_t *reset_v, PyObject *node_keys,
                        int32_t *stack, int32_t v) {
    PyObject *old = PyList_GET_ITEM(node_keys, v);
    Py_INCREF(Py_None);
    PyList_SET_ITEM(node_keys, v, Py_None);
    Py_XDECREF(old);
    for (Py_ssize_t k = 0; k < nrows; k++)
        M[k * ncols + v] = reset_v[k];
    *stack = v;
}

/* Ask for the key object of node ids[i + KEY_AHEAD] (of n) ahead of its use: a run's keys were
   made long ago and are scattered in memory, and reading (or freeing) each in turn waits for
   memory once per node; asked for a few nodes ahead, the waits overlap. */
#define KEY_AHEAD 8
static inline void key_ahead(PyObject *node_keys, const int32_t *ids, Py_ssize_t i, Py_ssize_t n) {
    if (i + KEY_AHEAD < n)
        AHEAD(PyList_GET_ITEM(node_keys, ids[i + KEY_AHEAD]), 1);
}

/* Ask for the column of node ids[i + KEY_AHEAD] (of n) in each of the nrows rows of the node
   matrix M, ahead of freeing it (every field is reset: a line per row, each a wait for memory
   when the run's nodes are scattered). */
static inline void column_ahead(int32_t *M, Py_ssize_t nrows, Py_ssize_t ncols, const int32_t *ids, Py_ssize_t i,
                                Py_ssize_t n) {
    if (i + KEY_AHEAD >= n)
        return;
    int32_t v = ids[i + KEY_AHEAD];
    if (v < 0 || v >= ncols)
        return;
    for (Py_ssize_t k = 0; k < nrows; k++)
        AHEAD(&M[k * ncols + v], 1);
}

/* Is node p queued in the eviction policy (`p in policy`)? 1, 0, or -1 with an exception. */
static int queued(PyObject *policy, long p) {
    PyObject *x = PyLong_FromLong(p);
    int r = x ? PySequence_Contains(policy, x) : -1;
    Py_XDECREF(x);
    return r;
}

/* The two slots of each of `n` 16-byte keys; 0 if one is not 16 bytes (or `keys` is no sequence). */
static int key_slots(PyObject *fast, uint64_t mask, uint64_t *a, uint64_t *b) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i];
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) != KEY_BYTES)
            return 0;
        uint64_t h;
        memcpy(&h, PyBytes_AS_STRING(k), sizeof h);
        a[i] = h & mask;
        b[i] = (h >> 32) & mask;
    }
    return 1;
}

/* The keys' slots (a[] then b[], 2n) in new memory, or NULL with an exception set; *ok is 0 where
   a key is not 16 bytes (the memory is still returned, to be freed). */
static uint64_t *new_key_slots(PyObject *fast, uint64_t mask, int *ok) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint64_t *slots = PyMem_Malloc(2 * (n ? n : 1) * sizeof(uint64_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    *ok = key_slots(fast, mask, slots, slots + n);
    return slots;
}

/* The sketch functions' arguments: the buffers `spec` names (take_bufs; the first `rows` are rows,
each longer than the mask), the keys and the slots of the keys (a[] then b[], 2n); ok is 0 where a
key is not 16 bytes. */
typedef struct {
    bufs v;
    PyObject *fast;
    uint64_t *slots;
    Py_ssize_t n;
    int ok;
} sketch_args;

static int sketch_begin(sketch_args *s, const char *what, PyObject *keys, unsigned long long mask, int rows,
                        const char *spec, ...) {
    memset(s, 0, sizeof *s);
    va_list ap;
    va_start(ap, spec);
    int got = vtake_bufs(&s->v, what, spec, ap);
    va_end(ap);
    if (got < 0)
        return -1;
    s->fast = PySequence_Fast(keys, "keys must be a sequence");
    if (s->fast == NULL)
        return -1;
    s->n = PySequence_Fast_GET_SIZE(s->fast);
    for (int i = 0; i < rows; i++)
        if ((Py_ssize_t)mask >= s->v.b[i].shape[0]) {
            PyErr_Format(PyExc_ValueError, "%s: sketch rows shorter than the mask", what);
            return -1;
        }
    s->slots = new_key_slots(s->fast, mask, &s->ok);
    return s->slots == NULL ? -1 : 0;
}

/* Is buffer `i` of the sketch arguments at least `n` items long? Else a ValueError. */
static int sketch_room(sketch_args *s, int i, Py_ssize_t n, const char *what) {
    if (s->v.b[i].shape[0] >= n)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: argument %d shorter than the keys", what, i + 1);
    return -1;
}

/* Release the arguments; returns `res` (a new reference; NULL stays NULL, an error). */
static PyObject *sketch_end(sketch_args *s, PyObject *res) {
    PyMem_Free(s->slots);
    Py_XDECREF(s->fast);
    drop_bufs(&s->v);
    Py_XINCREF(res);
    return res;
}

/* A row of the sketch: its items `stride` bytes apart (a timed sketch keeps each slot's stamp and
   count side by side, so that a key costs one cache miss per row, not two). */
typedef struct {
    char *p;
    Py_ssize_t stride;
} srow;

static srow sketch_row(const Py_buffer *b) {
    srow r = {b->buf, b->strides[0]};
    return r;
}

static inline uint8_t *count_at(srow r, uint64_t slot) {
    return (uint8_t *)(r.p + (Py_ssize_t)slot * r.stride);
}

static inline uint32_t stamp_at(srow r, uint64_t slot) {
    uint32_t x;
    memcpy(&x, r.p + (Py_ssize_t)slot * r.stride, sizeof x);  /* (may be unaligned) */
    return x;
}

static inline void set_stamp(srow r, uint64_t slot, uint32_t x) {
    memcpy(r.p + (Py_ssize_t)slot * r.stride, &x, sizeof x);
}

static void add_row(srow row, const uint64_t *slot, Py_ssize_t n, uint8_t *tmp) {
    for (Py_ssize_t i = 0; i < n; i++) { /* gather first: a shared slot gains one */
        uint8_t c = *count_at(row, slot[i]);
        tmp[i] = (uint8_t)((c < 254 ? c : 254) + 1);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        *count_at(row, slot[i]) = tmp[i];
}

/* sketch_add(row0, row1, keys, mask[, stamps0, stamps1, now, ages]) -> False if a key is not 16
   bytes (nothing changed). Rows may be strided (a timed sketch's count and stamp of a slot are
   side by side). With the stamps (the timed sketch's last uses, uint32 rows), first
   ages[i] (int64) = now - the older of key i's two stamps, or -1 where that is 0 (never
   stamped), then both stamps of every key become `now`, all reads before the writes as numpy's
   gather-then-scatter does; then the counts are added. One pass over the keys' slots for both. */
static PyObject *sketch_add(PyObject *self, PyObject *args) {
    PyObject *r0, *r1, *keys, *s0 = NULL, *s1 = NULL, *ages = NULL, *res = NULL;
    unsigned long long mask;
    unsigned long now = 0;
    sketch_args s;
    if (!PyArg_ParseTuple(args, "OOOK|OOkO", &r0, &r1, &keys, &mask, &s0, &s1, &now, &ages))
        return NULL;
    int timed = ages != NULL;
    if (sketch_begin(&s, "sketch_add", keys, mask, timed ? 4 : 2, timed ? "~B~B~U~UQ" : "~B~B", r0, r1, s0, s1,
                     ages) < 0 ||
        (timed && sketch_room(&s, 4, s.n, "sketch_add") < 0))
        goto done;
    uint8_t *tmp = PyMem_Malloc(s.n ? s.n : 1);
    if (tmp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const uint64_t *a = s.slots, *b = s.slots + s.n;
    if (s.ok && timed) {
        srow t0 = sketch_row(&s.v.b[2]), t1 = sketch_row(&s.v.b[3]);
        int64_t *out = s.v.b[4].buf;
        for (Py_ssize_t i = 0; i < s.n; i++) {
            uint32_t x = stamp_at(t0, a[i]), y = stamp_at(t1, b[i]);
            uint32_t last = x < y ? x : y;
            out[i] = last ? (int64_t)now - (int64_t)last : -1;
        }
        for (Py_ssize_t i = 0; i < s.n; i++) {
            set_stamp(t0, a[i], (uint32_t)now);
            set_stamp(t1, b[i], (uint32_t)now);
        }
    }
    if (s.ok) {
        add_row(sketch_row(&s.v.b[0]), a, s.n, tmp);
        add_row(sketch_row(&s.v.b[1]), b, s.n, tmp);
    }
    PyMem_Free(tmp);
    res = s.ok ? Py_True : Py_False;
done:
    return sketch_end(&s, res);
}

static PyObject *sketch_count(PyObject *self, PyObject *args) {
    PyObject *r0, *r1, *keys, *out, *res = NULL;
    unsigned long long mask;
    sketch_args s;
    if (!PyArg_ParseTuple(args, "OOOKO", &r0, &r1, &keys, &mask, &out))
        return NULL;
    if (sketch_begin(&s, "sketch_count", keys, mask, 2, "~b~bI", r0, r1, out) < 0 ||
        sketch_room(&s, 2, s.n, "sketch_count") < 0)
        goto done;
    srow a0 = sketch_row(&s.v.b[0]), a1 = sketch_row(&s.v.b[1]);
    int32_t *o = s.v.b[2].buf;
    const uint64_t *a = s.slots, *b = s.slots + s.n;
    for (Py_ssize_t i = 0; s.ok && i < s.n; i++) {
        uint8_t c0 = *count_at(a0, a[i]), c1 = *count_at(a1, b[i]);
        o[i] = c0 < c1 ? c0 : c1;
    }
    res = s.ok ? Py_True : Py_False;
done:
    return sketch_end(&s, res);
}

/* record_chain(f, path, stack, top, keys, blocks, n_full, rows, gpu, detached, node_keys, kmap, out) -> k:
   a request's blocks [len(path), n_full) become a new chain of the tree under the last node of
   its `path` (int32; the root, node 0, if empty), as `MatchRecord._record` records them when none
   of their keys is in the tree: -1 (nothing written) if that parent is in state `detached`; 0
   (nothing written) if keys[len(path)] is a child of it already (its continuation, whose key in
   `node_keys` equals it, or a node of `kmap` whose parent it is: the caller adopts nodes one at
   a time); else k = n_full - len(path) nodes, the ids stack[top - k:top] (int32) in that order,
   get the chain's columns of the node matrix `f` (int32, C order, one row per field): rows[0]
   (PARENT) the node before (the parent for the first), rows[1] (CHILD) and rows[6] (CONT) the
   node after (-1 for the last), rows[2] (DEV) blocks[i], rows[3] (REF) 1, rows[4] (NDEV) 1 (0 for
   the last), rows[5] (STATE) `gpu`, node_keys[id] = keys[i]; the first is linked as the parent's
   first child (rows[7] NEXT the old first child, whose rows[8] PREV it becomes; its own PREV
   -1), its continuation if it has none, else kmap[key] = id; the parent gains a device child
   (NDEV); and out (int32, n_full long) is path then the new ids, the request's new path. The
   slices, stack copy, child lookup, chain write, link and concatenation `_record` made in Python
   and numpy, in one call. Everything is checked before anything is written. */
static PyObject *record_chain(PyObject *self, PyObject *args) {
    bufs bv;
    long gpu, detached;
    Py_ssize_t top, n_full;
    PyObject *fobj, *pobj, *sobj, *keys, *blocks, *rows, *node_keys, *kmap, *oobj, *res = NULL;
    PyObject *fb = NULL, *fk = NULL;
    if (!PyArg_ParseTuple(args, "OOOnOOnOllO!O!O", &fobj, &pobj, &sobj, &top, &keys, &blocks, &n_full, &rows, &gpu,
                          &detached, &PyList_Type, &node_keys, &PyDict_Type, &kmap, &oobj))
        return NULL;
    if (take_bufs(&bv, "record_chain", "MnII", fobj, pobj, sobj, oobj) < 0)
        return NULL;
    const Py_buffer *f = &bv.b[0];
    Py_ssize_t ncols = f->shape[1], nkeys = PyList_GET_SIZE(node_keys), i0 = bv.b[1].shape[0];
    Py_ssize_t k = n_full - i0;
    long r[9];
    if (row_tuple(rows, 9, f, r, "record_chain") < 0)
        goto done;
    fk = PySequence_Fast(keys, "keys must be a sequence");
    fb = fk ? PySequence_Fast(blocks, "blocks must be a sequence") : NULL;
    if (fb == NULL)
        goto done;
    if (k <= 0 || n_full > PySequence_Fast_GET_SIZE(fk) || n_full > PySequence_Fast_GET_SIZE(fb) ||
        bv.b[3].shape[0] != n_full || top < k || top > bv.b[2].shape[0]) {
        PyErr_SetString(PyExc_ValueError, "record_chain: need len(path) < n_full <= len(keys), len(blocks); "
                                          "k <= top <= len(stack); len(out) == n_full");
        goto done;
    }
    int32_t *M = f->buf;
    int32_t *PARENT = M + r[0] * ncols, *CHILD = M + r[1] * ncols, *DEV = M + r[2] * ncols, *REF = M + r[3] * ncols,
            *NDEV = M + r[4] * ncols, *STATE = M + r[5] * ncols, *CONT = M + r[6] * ncols, *NEXT = M + r[7] * ncols,
            *PREV = M + r[8] * ncols;
    const int32_t *path = bv.b[1].buf, *id = (const int32_t *)bv.b[2].buf + (top - k);
    int32_t parent = i0 ? path[i0 - 1] : 0;
    if (STATE[parent] == detached) {
        res = PyLong_FromLong(-1);
        goto done;
    }
    PyObject **kv = PySequence_Fast_ITEMS(fk), **bl = PySequence_Fast_ITEMS(fb);
    PyObject *key0 = kv[i0];
    int32_t c = CONT[parent];
    if (c >= 0 && c < nkeys) { /* (MatchRecord._child) */
        int same = PyObject_RichCompareBool(PyList_GET_ITEM(node_keys, c), key0, Py_EQ);
        if (same < 0)
            goto done;
        if (same) {
            res = PyLong_FromLong(0);
            goto done;
        }
    }
    PyObject *hit = PyDict_GetItemWithError(kmap, key0);
    if (hit == NULL && PyErr_Occurred())
        goto done;
    if (hit != NULL) {
        long x = PyLong_AsLong(hit);
        if (x == -1 && PyErr_Occurred())
            goto done;
        if (x >= 0 && x < ncols && PARENT[x] == parent) {
            res = PyLong_FromLong(0);
            goto done;
        }
    }
    for (Py_ssize_t j = 0; j < k; j++) { /* check everything before writing anything */
        if (id[j] < 0 || id[j] >= ncols || id[j] >= nkeys) {
            PyErr_SetString(PyExc_IndexError, "record_chain: node id out of range");
            goto done;
        }
        long b = PyLong_AsLong(bl[i0 + j]);
        if (b == -1 && PyErr_Occurred())
            goto done;
        if (b < INT32_MIN || b > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "record_chain: block id does not fit int32");
            goto done;
        }
    }
    int32_t first = id[0];
    if (CONT[parent] >= 0) { /* (the one write that can fail, first) */
        PyObject *v = PyLong_FromLong(first);
        if (v == NULL || PyDict_SetItem(kmap, key0, v) < 0) {
            Py_XDECREF(v);
            goto done;
        }
        Py_DECREF(v);
    } else {
        CONT[parent] = first;
    }
    int32_t *o = bv.b[3].buf;
    memcpy(o, path, (size_t)i0 * sizeof(int32_t));
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t n = id[j];
        int32_t next = j + 1 < k ? id[j + 1] : -1;
        o[i0 + j] = (int32_t)n;
        PARENT[n] = j ? id[j - 1] : parent;
        CHILD[n] = next;
        DEV[n] = (int32_t)PyLong_AsLong(bl[i0 + j]);
        REF[n] = 1;
        NDEV[n] = j + 1 < k;
        STATE[n] = (int32_t)gpu;
        CONT[n] = next;
        PyObject *key = kv[i0 + j];
        Py_INCREF(key);
        PyObject *old = PyList_GET_ITEM(node_keys, n);
        PyList_SET_ITEM(node_keys, n, key);
        Py_XDECREF(old);
    }
    int32_t head = CHILD[parent]; /* (NodeStore._link) */
    PREV[first] = -1;
    NEXT[first] = head;
    if (head >= 0)
        PREV[head] = first;
    CHILD[parent] = first;
    NDEV[parent] += 1;
    res = PyLong_FromSsize_t(k);
done:
    Py_XDECREF(fb);
    Py_XDECREF(fk);
    drop_bufs(&bv);
    return res;
}

/* drop_run(f, drop, par, top, rows, reset, node_keys, kmap, devs, stack, at) -> freed parents:
   free the eviction run `drop` (int32 node ids, children before parents; `par` their parents;
   `top` the indices of those whose parent stays), as `Eviction._drop_run` does in Python:
   delete from the key map `kmap` the keys of nodes that are not their parent's continuation
   (all decided before any unlinking), unlink each top from its parent's child list and
   continuation and take one device child from the parent (the parents left with none are
   returned, in order), clear their keys, append their device blocks to `devs`, reset their
   columns to `reset` and put their ids on the free-id stack `stack` from index `at`.
   rows = (PARENT, CHILD, NEXT, PREV, CONT, NDEV, DEV). Everything is checked before any write
   but the key map deletes (a missing key raises KeyError, as in Python). `ids` (optional, a list
   whose item b is the int b: the device pool's, runtime/cache/pool.py) gives the device blocks'
   int objects, so that a freed block is not a new int made here and freed again when the request
   it is handed to ends (one allocation and one free per evicted block). */
/* drop_run's work once its arguments are checked (r: the 7 rows, tix: the tops' indices into
   drop); the freed parents, or NULL with an exception. */
static PyObject *drop_run_core(int32_t *M, Py_ssize_t nrows, Py_ssize_t ncols, const long *r, const int32_t *reset_v,
                               const int32_t *drop, const int32_t *par, Py_ssize_t m, const Py_ssize_t *tix,
                               Py_ssize_t ntop, PyObject *node_keys, PyObject *kmap, PyObject *devs, int32_t *stack,
                               PyObject *ids) {
    int32_t *CHILD = M + r[1] * ncols, *NEXT = M + r[2] * ncols, *PREV = M + r[3] * ncols, *CONT = M + r[4] * ncols,
            *NDEV = M + r[5] * ncols, *DEV = M + r[6] * ncols, *PARENT = M + r[0] * ncols;
    PyObject *freed = PyList_New(0);
    if (freed == NULL)
        return NULL;
    /* key map entries first, as found before any unlinking (each parent's continuation, and
       each node's device block for the loop below, asked for KEY_AHEAD nodes ahead: scattered
       columns, a wait for memory each) */
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + KEY_AHEAD < m) {
            AHEAD(&CONT[par[i + KEY_AHEAD]], 0);
            AHEAD(&DEV[drop[i + KEY_AHEAD]], 0);
        }
        if (CONT[par[i]] != drop[i] && PyDict_DelItem(kmap, PyList_GET_ITEM(node_keys, drop[i])) < 0)
            goto fail;
    }
    for (Py_ssize_t j = 0; j < ntop; j++) { /* `_detach_sibling`, then one device child fewer */
        int32_t v = drop[tix[j]], q = PARENT[v];
        detach(CHILD, NEXT, PREV, CONT, q, v);
        if (--NDEV[q] == 0) {
            if (append_new(freed, PyLong_FromLong(q)) < 0)
                goto fail;
        }
    }
    /* the device blocks first, each as the pool's int object: the run's blocks read in a loop
       of their own (independent loads, many waits for memory at once), and each int object
       asked for a few blocks ahead of the count written in it */
    Py_ssize_t nids = ids == Py_None ? 0 : PyList_GET_SIZE(ids);
    int32_t *blk = PyMem_New(int32_t, m ? m : 1);
    if (blk == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        blk[i] = DEV[drop[i]];
    for (Py_ssize_t i = 0; i < m; i++) {
        if (i + KEY_AHEAD < m && blk[i + KEY_AHEAD] >= 0 && blk[i + KEY_AHEAD] < nids)
            AHEAD(PyList_GET_ITEM(ids, blk[i + KEY_AHEAD]), 1);
        int32_t b = blk[i];
        if (b >= 0 && b < nids) {
            if (PyList_Append(devs, PyList_GET_ITEM(ids, b)) < 0)
                goto fail_blk;
        } else if (append_new(devs, PyLong_FromLong(b)) < 0)
            goto fail_blk;
    }
    PyMem_Free(blk);
    for (Py_ssize_t i = 0; i < m; i++) {
        key_ahead(node_keys, drop, i, m);
        column_ahead(M, nrows, ncols, drop, i, m);
        free_column(M, nrows, ncols, reset_v, node_keys, stack + i, drop[i]);
    }
    return freed;
fail_blk:
    PyMem_Free(blk);
fail:
    Py_DECREF(freed);
    return NULL;
}

/* Are the tops tix[0..ntop) (indices into drop, of m) linked within range? 0, or -1 with an
   exception. */
static int tops_in_range(const int32_t *M, Py_ssize_t ncols, const long *r, const int32_t *drop, const Py_ssize_t *tix,
                         Py_ssize_t ntop, const char *what) {
    const int32_t *PARENT = M + r[0] * ncols, *NEXT = M + r[2] * ncols, *PREV = M + r[3] * ncols;
    for (Py_ssize_t j = 0; j < ntop; j++) {
        int32_t v = drop[tix[j]], q = PARENT[v], b = PREV[v], a = NEXT[v];
        if (q < 0 || q >= ncols || b >= ncols || a >= ncols) {
            PyErr_Format(PyExc_ValueError, "%s: a top's links are out of range", what);
            return -1;
        }
    }
    return 0;
}

static PyObject *drop_run(PyObject *self, PyObject *args) {
    PyObject *fobj, *dobj, *pobj, *sobj, *top, *rows, *reset, *node_keys, *kmap, *devs, *ids = Py_None;
    Py_ssize_t at;
    bufs bv;
    PyObject *res = NULL, *ft = NULL;
    Py_ssize_t *tix = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOO!O!O!On|O", &fobj, &dobj, &pobj, &top, &rows, &reset,
                          &PyList_Type, &node_keys, &PyDict_Type, &kmap, &PyList_Type, &devs, &sobj, &at, &ids))
        return NULL;
    if (ids != Py_None && !PyList_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "drop_run: ids must be a list or None");
        return NULL;
    }
    if (take_bufs(&bv, "drop_run", "Mn=nI", fobj, dobj, pobj, sobj) < 0)
        return NULL;
    const Py_buffer *f = &bv.b[0];
    Py_ssize_t nrows = f->shape[0], ncols = f->shape[1], m = bv.b[1].shape[0];
    long r[7];
    int32_t reset_v[MAX_ROWS];
    if (row_tuple(rows, 7, f, r, "drop_run") < 0 || reset_column(reset, f, reset_v, "drop_run") < 0)
        goto done;
    if (PyList_GET_SIZE(node_keys) < ncols) {
        PyErr_SetString(PyExc_ValueError, "drop_run: a key slot per node");
        goto done;
    }
    int32_t *M = f->buf;
    const int32_t *drop = bv.b[1].buf, *par = bv.b[2].buf;
    if (at < 0 || at + m > bv.b[3].shape[0]) {
        PyErr_SetString(PyExc_IndexError, "drop_run: the free-id stack overflows");
        goto done;
    }
    ft = PySequence_Fast(top, "top must be a sequence");
    if (ft == NULL)
        goto done;
    Py_ssize_t ntop = PySequence_Fast_GET_SIZE(ft);
    tix = PyMem_New(Py_ssize_t, ntop ? ntop : 1);
    if (tix == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < ntop; j++)
        if (index_below(PySequence_Fast_GET_ITEM(ft, j), m, &tix[j], "drop_run") < 0)
            goto done;
    if (tops_in_range(M, ncols, r, drop, tix, ntop, "drop_run") < 0)
        goto done;
    res = drop_run_core(M, nrows, ncols, r, reset_v, drop, par, m, tix, ntop, node_keys, kmap, devs,
                        (int32_t *)bv.b[3].buf + at, ids);
done:
    PyMem_Free(tix);
    Py_XDECREF(ft);
    drop_bufs(&bv);
    return res;
}

/* sketch_raise(row0, row1, keys, mask, hits, nodes, cap) -> False if a key is not 16 bytes
   (nothing changed): `PrefixCache._remember_uses` in one call. Each of `nodes` (int32) gets
   hits[node] = max(hits[node], e) where e is its key's count minus one, capped by `cap` (None:
   no cap) and by every earlier key's (a running minimum), and at least 0. `hits` is an int32
   row of the node matrix. */
static PyObject *sketch_raise(PyObject *self, PyObject *args) {
    PyObject *r0, *r1, *keys, *hobj, *nobj, *capo, *res = NULL;
    unsigned long long mask;
    sketch_args s;
    if (!PyArg_ParseTuple(args, "OOOKOOO", &r0, &r1, &keys, &mask, &hobj, &nobj, &capo))
        return NULL;
    if (sketch_begin(&s, "sketch_raise", keys, mask, 2, "~b~bIn", r0, r1, hobj, nobj) < 0)
        goto done;
    if (s.v.b[3].shape[0] != s.n) {
        PyErr_SetString(PyExc_ValueError, "sketch_raise: one node per key");
        goto done;
    }
    long cap = 0;
    int capped = capo != Py_None;
    if (capped && (cap = PyLong_AsLong(capo)) == -1 && PyErr_Occurred())
        goto done;
    srow a0 = sketch_row(&s.v.b[0]), a1 = sketch_row(&s.v.b[1]);
    int32_t *hits = s.v.b[2].buf;
    const int32_t *nodes = s.v.b[3].buf;
    const uint64_t *slots = s.slots;
    Py_ssize_t n = s.n;
    long run = 0;
    for (Py_ssize_t i = 0; s.ok && i < n; i++) {
        long c0 = *count_at(a0, slots[i]), c1 = *count_at(a1, slots[n + i]);
        long e = (c0 < c1 ? c0 : c1) - 1;
        if (i == 0)
            run = capped && cap < e ? cap : e;
        else if (e < run)
            run = e;
        long v = run > 0 ? run : 0;
        if (hits[nodes[i]] < v)
            hits[nodes[i]] = (int32_t)v;
    }
    res = s.ok ? Py_True : Py_False;
done:
    return sketch_end(&s, res);
}

static int row_index(long r, const Py_buffer *f) {
    if (r < 0 || r >= f->shape[0]) {
        PyErr_SetString(PyExc_ValueError, "row out of range");
        return -1;
    }
    return 0;
}

/* touch_device(f, path, ref_row, hits_row, state_row, dev_row, gpu[, ids]) -> (unused, blocks) or None:
   when every node of `path` is in state `gpu`, take a reference on each and count a hit (what
   `MatchRecord._touch` does for an all-device match) and return how many were unreferenced
   and their device blocks, in path order; otherwise change nothing and return None. `ids`
   (optional, a list whose item b is the int b: the device pool's, runtime/cache/pool.py) gives
   the blocks' int objects, rather than a new int per block that the request frees again when it
   ends. */
static PyObject *touch_device(PyObject *self, PyObject *args) {
    PyObject *fobj, *pobj, *ids = Py_None;
    long rr, rh, rs, rd, gpu;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OOlllll|O", &fobj, &pobj, &rr, &rh, &rs, &rd, &gpu, &ids))
        return NULL;
    if (ids != Py_None && !PyList_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "touch_device: ids must be a list or None");
        return NULL;
    }
    if (take_bufs(&bv, "touch_device", "Mn", fobj, pobj) < 0)
        return NULL;
    PyObject *res = NULL, *blocks = NULL;
    if (row_index(rr, &bv.b[0]) < 0 || row_index(rh, &bv.b[0]) < 0 || row_index(rs, &bv.b[0]) < 0 ||
        row_index(rd, &bv.b[0]) < 0)
        goto done;
    Py_ssize_t ncols = bv.b[0].shape[1], n = bv.b[1].shape[0];
    int32_t *M = bv.b[0].buf;
    int32_t *REF = M + rr * ncols, *HITS = M + rh * ncols, *STATE = M + rs * ncols, *DEV = M + rd * ncols;
    const int32_t *path = bv.b[1].buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (STATE[path[i]] != gpu) {
            res = Py_None;
            Py_INCREF(res);
            goto done;
        }
    blocks = PyList_New(n);
    if (blocks == NULL)
        goto done;
    long unused = 0;
    Py_ssize_t nids = ids == Py_None ? 0 : PyList_GET_SIZE(ids);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t d = DEV[path[i]];
        PyObject *b;
        if (d >= 0 && d < nids) {
            b = PyList_GET_ITEM(ids, d);
            Py_INCREF(b);
        } else if ((b = PyLong_FromLong(d)) == NULL) {
            goto done;
        }
        PyList_SET_ITEM(blocks, i, b);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t v = path[i];
        unused += REF[v] == 0;
        REF[v] += 1;
        HITS[v] += 1;
    }
    res = Py_BuildValue("lO", unused, blocks);
done:
    Py_XDECREF(blocks);
    drop_bufs(&bv);
    return res;
}

/* deref(f, path, ref_row, state_row, gpu, out) -> (k, all_gpu): drop one reference on each node
   of `path`, tail first, writing the nodes left unreferenced to out[:k] (int32) in that order;
   all_gpu: all of them are in state `gpu` (what `MatchRecord._deref` computes first). */
static PyObject *deref(PyObject *self, PyObject *args) {
    PyObject *fobj, *pobj, *oobj;
    long rr, rs, gpu;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OOlllO", &fobj, &pobj, &rr, &rs, &gpu, &oobj))
        return NULL;
    if (take_bufs(&bv, "deref", "MnI", fobj, pobj, oobj) < 0)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t ncols = bv.b[0].shape[1], n = bv.b[1].shape[0];
    if (row_index(rr, &bv.b[0]) < 0 || row_index(rs, &bv.b[0]) < 0)
        goto done;
    if (bv.b[2].shape[0] < n) {
        PyErr_SetString(PyExc_ValueError, "deref: out must be as long as the path");
        goto done;
    }
    int32_t *M = bv.b[0].buf, *o = bv.b[2].buf;
    int32_t *REF = M + rr * ncols, *STATE = M + rs * ncols;
    const int32_t *path = bv.b[1].buf;
    Py_ssize_t k = 0;
    int all_gpu = 1;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        int32_t v = path[i];
        if (--REF[v] == 0) {
            o[k++] = v;
            all_gpu &= STATE[v] == gpu;
        }
    }
    res = Py_BuildValue("nO", k, all_gpu ? Py_True : Py_False);
done:
    drop_bufs(&bv);
    return res;
}

/* chain_tops(f, cand, par, ndev_row) -> tops or None: is the eviction run `cand` (int32; `par`
   its parents) whole chains released deepest first, each node's only device child right before
   it (NDEV of the first 0, of each later one 1 exactly when the node before is its child)? If
   so, the indices of the nodes whose parent is not the next node (each chain's top; the last
   node always), else None. What `Eviction._drop_batched` checks with half a dozen numpy calls. */
static PyObject *chain_tops(PyObject *self, PyObject *args) {
    PyObject *fobj, *cobj, *pobj;
    long rn;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OOOl", &fobj, &cobj, &pobj, &rn))
        return NULL;
    if (take_bufs(&bv, "chain_tops", "mn=i", fobj, cobj, pobj) < 0)
        return NULL;
    PyObject *res = NULL, *tops = NULL;
    Py_ssize_t m = bv.b[1].shape[0];
    if (row_index(rn, &bv.b[0]) < 0)
        goto done;
    const int32_t *cand = bv.b[1].buf, *par = bv.b[2].buf, *NDEV = (int32_t *)bv.b[0].buf + rn * bv.b[0].shape[1];
    if (m && NDEV[cand[0]] != 0) {
        res = Py_None;
        Py_INCREF(res);
        goto done;
    }
    for (Py_ssize_t i = 1; i < m; i++)
        if (NDEV[cand[i]] != (par[i - 1] == cand[i])) {
            res = Py_None;
            Py_INCREF(res);
            goto done;
        }
    tops = PyList_New(0);
    if (tops == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < m; i++)
        if (i == m - 1 || par[i] != cand[i + 1]) {
            if (append_new(tops, PyLong_FromSsize_t(i)) < 0)
                goto done;
        }
    res = tops;
    tops = NULL;
done:
    Py_XDECREF(tops);
    drop_bufs(&bv);
    return res;
}

/* stamp_runs(stamp, nodes, level, serial) -> starts: split `nodes` (int32) into runs of equal
   `level` (int64, one per node), stamp (int64) the nodes of the j-th run with serial + j, and
   return where each run starts (0 first): the bookkeeping of one heap entry per run in
   runtime/cache/policies/reuse.py, without a numpy call per run. */
static PyObject *stamp_runs(PyObject *self, PyObject *args) {
    PyObject *sobj, *nobj, *lobj;
    long long serial;
    bufs bv;
    PyObject *res = NULL, *starts = NULL;
    if (!PyArg_ParseTuple(args, "OOOL", &sobj, &nobj, &lobj, &serial))
        return NULL;
    if (take_bufs(&bv, "stamp_runs", "Qn=q", sobj, nobj, lobj) < 0)
        return NULL;
    int64_t *stamp = bv.b[0].buf;
    const int64_t *lv = bv.b[2].buf;
    const int32_t *nodes = bv.b[1].buf;
    Py_ssize_t n = bv.b[1].shape[0];
    starts = PyList_New(0);
    if (starts == NULL)
        goto done;
    long long s = serial - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i == 0 || lv[i] != lv[i - 1]) {
            if (append_new(starts, PyLong_FromSsize_t(i)) < 0)
                goto done;
            s++;
        }
        stamp[nodes[i]] = s;
    }
    res = starts;
    starts = NULL;
done:
    Py_XDECREF(starts);
    drop_bufs(&bv);
    return res;
}

/* walk(f, cont_row, parent_row, node_keys, kmap, keys, limit, out) -> matched: the longest
   cached prefix of keys[:limit], as `MatchRecord._walk` finds it: from the root (node 0)
   follow each node's continuation while its key equals the next key, else look the key up in
   `kmap` (a node found there must be a child of the current node); the nodes go to out[:matched]. */
static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *fobj, *node_keys, *kmap, *keys, *oobj;
    long rc, rp;
    Py_ssize_t limit;
    bufs bv;
    PyObject *fast = NULL, *res = NULL;
    if (!PyArg_ParseTuple(args, "OllO!O!OnO", &fobj, &rc, &rp, &PyList_Type, &node_keys, &PyDict_Type,
                          &kmap, &keys, &limit, &oobj))
        return NULL;
    if (take_bufs(&bv, "walk", "mI", fobj, oobj) < 0)
        return NULL;
    const Py_buffer *f = &bv.b[0], *out = &bv.b[1];
    fast = PySequence_Fast(keys, "keys must be a sequence");
    if (fast == NULL)
        goto done;
    if (row_index(rc, f) < 0 || row_index(rp, f) < 0 || limit < 0 || limit > out->shape[0] ||
        limit > PySequence_Fast_GET_SIZE(fast)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "walk: bad matrix, rows, limit or output");
        goto done;
    }
    Py_ssize_t ncols = f->shape[1], nkeys = PyList_GET_SIZE(node_keys);
    const int32_t *CONT = (int32_t *)f->buf + rc * ncols, *PARENT = (int32_t *)f->buf + rp * ncols;
    int32_t *o = out->buf;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int32_t n = 0;
    Py_ssize_t i = 0;
    for (; i < limit; i++) {
        PyObject *key = items[i];
        int32_t c = CONT[n];
        int same = 0;
        if (c >= 0 && c < nkeys) {
            same = PyObject_RichCompareBool(PyList_GET_ITEM(node_keys, c), key, Py_EQ);
            if (same < 0)
                goto done;
        }
        if (!same) {
            PyObject *hit = PyDict_GetItemWithError(kmap, key);
            if (hit == NULL) {
                if (PyErr_Occurred())
                    goto done;
                break;
            }
            long x = PyLong_AsLong(hit);
            if (x == -1 && PyErr_Occurred())
                goto done;
            if (x < 0 || x >= ncols || PARENT[x] != n)
                break;  /* (a key that was not chained: another branch) */
            c = (int32_t)x;
        }
        o[i] = n = c;
    }
    res = PyLong_FromSsize_t(i);
done:
    Py_XDECREF(fast);
    drop_bufs(&bv);
    return res;
}

/* ---- the `reuse` queue's heap (runtime/cache/policies/reuse.py): entries are lists
   [priority, level, order, serial, nodes, cursor], ordered as heapq orders them, by their first
   three items (ints; `order` is unique, so no two entries compare equal). */

/* The first three items of heap entry `e`, or -1 with an exception if it is no such entry. */
static int entry_key(PyObject *e, long long *key) {
    if (!PyList_Check(e) || PyList_GET_SIZE(e) < 6) {
        PyErr_SetString(PyExc_TypeError, "pop_live: a heap entry must be a list of 6 items");
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        key[i] = PyLong_AsLongLong(PyList_GET_ITEM(e, i));
        if (key[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* Is entry a before entry b (a < b, as heapq compares them)? 1, 0, or -1 with an exception. */
static int entry_less(PyObject *a, PyObject *b) {
    long long ka[3], kb[3];
    if (entry_key(a, ka) < 0 || entry_key(b, kb) < 0)
        return -1;
    for (int i = 0; i < 3; i++)
        if (ka[i] != kb[i])
            return ka[i] < kb[i];
    return 0;
}

/* Put `item` at heap slot `pos` or above, where it belongs, moving the entries it passes down
   (heapq's _siftdown from the top); 0, or -1 with an exception (item left at pos). */
static int rise(PyObject **h, Py_ssize_t pos, PyObject *item) {
    while (pos > 0) {
        Py_ssize_t parent = (pos - 1) >> 1;
        int lt = entry_less(item, h[parent]);
        if (lt < 0)
            break;
        if (!lt) {
            h[pos] = item;
            return 0;
        }
        h[pos] = h[parent];
        pos = parent;
    }
    h[pos] = item;
    return PyErr_Occurred() ? -1 : 0;
}

/* heapq.heappop(heap) for a non-empty heap, the popped entry released: the last entry moves to
   the top, sinks to a leaf along the smaller children, then rises to its place (heapq's
   _siftup and _siftdown), so the list is left exactly as heapq leaves it. */
static int heap_pop(PyObject *heap) {
    Py_ssize_t n = PyList_GET_SIZE(heap) - 1;
    PyObject *item = PyList_GET_ITEM(heap, n);
    Py_INCREF(item);
    if (PyList_SetSlice(heap, n, n + 1, NULL) < 0) {
        Py_DECREF(item);
        return -1;
    }
    if (n == 0) {
        Py_DECREF(item);  /* (it was the top) */
        return 0;
    }
    PyObject **h = ((PyListObject *)heap)->ob_item;
    Py_DECREF(h[0]);  /* the top leaves; `item` takes a slot instead, with the reference taken above */
    Py_ssize_t pos = 0, child = 1;
    while (child < n) {
        if (child + 1 < n) {
            int lt = entry_less(h[child], h[child + 1]);
            if (lt < 0)
                goto fail;
            if (!lt)
                child++;
        }
        h[pos] = h[child];
        pos = child;
        child = 2 * pos + 1;
    }
    return rise(h, pos, item);
fail:  /* (only with a malformed entry: the list is no longer a heap) */
    h[pos] = item;
    return -1;
}

/* heapq.heappush(heap, [prio, level, serial, serial, nodes[a:b], -1]): the `gaps` policy's entry
   for a run of released nodes. */
static int push_run(PyObject *heap, PyObject *nodes, Py_ssize_t a, Py_ssize_t b, long long prio, long long level,
                    long long serial) {
    PyObject *e = Py_BuildValue("[LLLLNi]", prio, level, serial, serial, PySequence_GetSlice(nodes, a, b), -1);
    if (e == NULL || PyList_Append(heap, e) < 0) {
        Py_XDECREF(e);
        return -1;
    }
    Py_DECREF(e);  /* (the heap holds it) */
    Py_ssize_t n = PyList_GET_SIZE(heap);
    return rise(((PyListObject *)heap)->ob_item, n - 1, e);
}

/* pop_live(heap, stamp, k, out) -> (taken, dropped): `ReuseLevels.pop_many`'s walk of its heap:
   up to `k` nodes into out[:taken] (int32), as `k` pops would hand them out. The top entry's
   nodes (an int32 array or a list of ints) are scanned from its cursor (at least 0), taking
   each whose stamp (int64) is still the entry's serial (the stamp becomes -1); an entry used up
   before `k` are taken leaves the heap (`dropped` counts its nodes), else its cursor is left
   after the last node taken. */
static PyObject *pop_live(PyObject *self, PyObject *args) {
    PyObject *heap, *sobj, *oobj;
    Py_ssize_t k;
    bufs bv;
    PyObject *res = NULL;
    if (!PyArg_ParseTuple(args, "O!OnO", &PyList_Type, &heap, &sobj, &k, &oobj))
        return NULL;
    if (take_bufs(&bv, "pop_live", "QI", sobj, oobj) < 0)
        return NULL;
    if (k < 0 || k > bv.b[1].shape[0]) {
        PyErr_SetString(PyExc_ValueError, "pop_live: need int32 room for k nodes in out");
        goto done;
    }
    int64_t *stamp = bv.b[0].buf;
    int32_t *o = bv.b[1].buf;
    Py_ssize_t cap = bv.b[0].shape[0], taken = 0, dropped = 0;
    while (PyList_GET_SIZE(heap) && taken < k) {
        PyObject *e = PyList_GET_ITEM(heap, 0);
        if (!PyList_Check(e) || PyList_GET_SIZE(e) < 6) {
            PyErr_SetString(PyExc_TypeError, "pop_live: a heap entry must be a list of 6 items");
            goto done;
        }
        long long serial = PyLong_AsLongLong(PyList_GET_ITEM(e, 3));
        Py_ssize_t start = PyLong_AsSsize_t(PyList_GET_ITEM(e, 5));
        if (PyErr_Occurred())
            goto done;
        start = start < 0 ? 0 : start;
        PyObject *nobj = PyList_GET_ITEM(e, 4);
        bufs nb = {.n = 0};  /* nodes in an array, or none for a list */
        Py_ssize_t n;
        if (PyList_Check(nobj)) {
            n = PyList_GET_SIZE(nobj);
        } else {
            if (take_bufs(&nb, "pop_live", "i", nobj) < 0)
                goto done;
            n = nb.b[0].shape[0];
        }
        Py_ssize_t i = start;
        int bad = 0;
        for (; i < n && taken < k; i++) {
            long v = nb.n ? ((const int32_t *)nb.b[0].buf)[i] : PyLong_AsLong(PyList_GET_ITEM(nobj, i));
            if (v < 0 || v >= cap) {
                bad = 1;
                break;
            }
            if (stamp[v] == serial) {
                stamp[v] = -1;
                o[taken++] = (int32_t)v;
            }
        }
        drop_bufs(&nb);
        if (bad) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "pop_live: node id out of range");
            goto done;
        }
        if (taken == k) {
            PyObject *cursor = PyLong_FromSsize_t(i);
            if (cursor == NULL || PyList_SetItem(e, 5, cursor) < 0)
                goto done;
            break;
        }
        dropped += n;
        if (heap_pop(heap) < 0)
            goto done;
    }
    res = Py_BuildValue("nn", taken, dropped);
done:
    drop_bufs(&bv);
    return res;
}

/* ---- the `reuse` and `gaps` policies' per-node bookkeeping (runtime/cache/policies/reuse.py, gaps.py) */

/* policy_release(hits, matched, released, nodes, now) -> lost: what a push of released `nodes`
   (int32, distinct) records per node in the `reuse` family of policies: how many have earlier uses
   (hits, int32) but were not matched since their last push (matched, bool: the reuse the cache
   had lost), then matched[v] = False and released[v] (int64) = now. */
static PyObject *policy_release(PyObject *self, PyObject *args) {
    PyObject *hobj, *mobj, *robj, *nobj;
    long long now;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OOOOL", &hobj, &mobj, &robj, &nobj, &now))
        return NULL;
    if (take_bufs(&bv, "policy_release", "i=B=Qn", hobj, mobj, robj, nobj) < 0)
        return NULL;
    const int32_t *hits = bv.b[0].buf, *nodes = bv.b[3].buf;
    unsigned char *matched = bv.b[1].buf;
    int64_t *released = bv.b[2].buf;
    Py_ssize_t lost = 0;
    for (Py_ssize_t i = 0; i < bv.b[3].shape[0]; i++) {
        int32_t v = nodes[i];
        lost += !matched[v] && hits[v] != 0;
        matched[v] = 0;
        released[v] = now;
    }
    drop_bufs(&bv);
    return PyLong_FromSsize_t(lost);
}

/* policy_discard(stamp, released, matched, nodes, clock, turnover) -> (queued, long): `nodes`
   (int32, distinct) are matched: of those queued (stamp, int64, >= 0), how many, and how many
   were released (int64 clock) more than `turnover` releases ago; then matched[v] (bool) = True
   and stamp[v] = -1 for all. */
static PyObject *policy_discard(PyObject *self, PyObject *args) {
    PyObject *sobj, *robj, *mobj, *nobj;
    long long clock;
    double turnover;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OOOOLd", &sobj, &robj, &mobj, &nobj, &clock, &turnover))
        return NULL;
    if (take_bufs(&bv, "policy_discard", "Q=q=Bn", sobj, robj, mobj, nobj) < 0)
        return NULL;
    int64_t *stamp = bv.b[0].buf;
    const int64_t *released = bv.b[1].buf;
    unsigned char *matched = bv.b[2].buf;
    const int32_t *nodes = bv.b[3].buf;
    Py_ssize_t queued = 0, lng = 0;
    for (Py_ssize_t i = 0; i < bv.b[3].shape[0]; i++) {
        int32_t v = nodes[i];
        if (stamp[v] >= 0) {
            queued++;
            lng += (double)(clock - released[v]) > turnover;
        }
        matched[v] = 1;
        stamp[v] = -1;
    }
    drop_bufs(&bv);
    return Py_BuildValue("nn", queued, lng);
}

/* ghost_ages(ghost, nodes, ages): ghost[nodes[i]] = the largest of ages[0..i] (int64; nodes int32,
   one age each): `ReuseGaps.recorded`, a running maximum scattered to the nodes. */
static PyObject *ghost_ages(PyObject *self, PyObject *args) {
    PyObject *g, *n, *a;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OOO", &g, &n, &a) || take_bufs(&bv, "ghost_ages", "Qn=q", g, n, a) < 0)
        return NULL;
    const int32_t *nodes = bv.b[1].buf;
    const int64_t *ages = bv.b[2].buf;
    int64_t *ghost = bv.b[0].buf, run = INT64_MIN;
    for (Py_ssize_t i = 0; i < bv.b[1].shape[0]; i++) {
        run = ages[i] > run ? ages[i] : run;
        ghost[nodes[i]] = run;
    }
    drop_bufs(&bv);
    Py_RETURN_NONE;
}

/* give_uses(f, hits_row, nodes, uses, lo, capped, cap): f[hits_row, nodes[i]] = the smallest of
   u[0..i], u[j] = uses[lo + j] (int32; 0 past its end), each at most `cap` if `capped`: the uses a
   policy recalled for the keys of a request's just recorded nodes (`PrefixCache._give_recalled`),
   never more than their parent's (every request that used a block used its prefix). */
static PyObject *give_uses(PyObject *self, PyObject *args) {
    PyObject *fobj, *nobj, *uobj;
    long row;
    Py_ssize_t lo;
    int capped;
    long long cap;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OlOOnpL", &fobj, &row, &nobj, &uobj, &lo, &capped, &cap))
        return NULL;
    if (take_bufs(&bv, "give_uses", "Mni", fobj, nobj, uobj) < 0)
        return NULL;
    if (row_index(row, &bv.b[0]) < 0 || lo < 0) {
        drop_bufs(&bv);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "give_uses: lo must be >= 0");
        return NULL;
    }
    int32_t *hits = (int32_t *)bv.b[0].buf + row * bv.b[0].shape[1];
    const int32_t *nodes = bv.b[1].buf, *uses = bv.b[2].buf;
    Py_ssize_t n = bv.b[1].shape[0], have = bv.b[2].shape[0];
    int64_t run = capped ? cap : INT64_MAX;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t u = lo + i < have ? uses[lo + i] : 0;
        run = u < run ? u : run;
        hits[nodes[i]] = (int32_t)run;
    }
    drop_bufs(&bv);
    Py_RETURN_NONE;
}

/* gaps_rank(hits, ghost, prio, stamp, nodes, levels, hold, now, unit, far1, far2, span, serial, heap)
   -> runs: the `gaps` policy's priorities for released `nodes` (int32, distinct), as
   `ReuseGaps.push` ranks them: a node of h earlier uses (hits, int32) has level
   levels[min(h, len - 1)] (int64) and, when `unit` > 0, priority
   (now + int64(unit * hold')) * span + level, where hold' is hold[min(h, len - 1)]
   (float64) but 0 for h == 1 with a last gap (ghost, int64) above `far1` or h == 2 above `far2`;
   with unit <= 0, now * span + level. Writes prio (int64) and ghost = -1 per node, splits `nodes`
   into runs of equal priority, stamps (int64) the j-th run's nodes with serial + j, pushes its
   entry [priority, level, serial + j, serial + j, nodes[start:end], -1] on `heap` (as heapq
   does) and returns how many runs there were. */
static PyObject *gaps_rank(PyObject *self, PyObject *args) {
    PyObject *hobj, *gobj, *pobj, *sobj, *nobj, *lobj, *dobj, *heap;
    long long now, span, serial;
    double unit, far1, far2;
    bufs bv;
    PyObject *res = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOOLdddLLO!", &hobj, &gobj, &pobj, &sobj, &nobj, &lobj, &dobj, &now,
                          &unit, &far1, &far2, &span, &serial, &PyList_Type, &heap))
        return NULL;
    if (take_bufs(&bv, "gaps_rank", "i=Q=Q=Qnqq", hobj, gobj, pobj, sobj, nobj, lobj, dobj) < 0)
        return NULL;
    Py_ssize_t nlev = bv.b[5].shape[0], nhold = bv.b[6].shape[0], n = bv.b[4].shape[0];
    if (nlev < 1 || nhold < 1) {
        PyErr_SetString(PyExc_ValueError, "gaps_rank: no levels");
        goto done;
    }
    const int32_t *hits = bv.b[0].buf, *nodes = bv.b[4].buf;
    int64_t *ghost = bv.b[1].buf, *prio = bv.b[2].buf, *stamp = bv.b[3].buf;
    const int64_t *levels = bv.b[5].buf;
    const double *hold = bv.b[6].buf;
    long long s = serial - 1, run_prio = 0, run_lv = 0;
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t v = nodes[i];
        int32_t h = hits[v] < 0 ? 0 : hits[v];
        int64_t gap = ghost[v];
        ghost[v] = -1;
        int64_t lv = levels[h < nlev ? h : nlev - 1];
        int64_t due = now;
        if (unit > 0) {
            int32_t u = h < nhold ? h : (int32_t)(nhold - 1);
            double hd = hold[u];
            if ((u == 1 && (double)gap > far1) || (u == 2 && (double)gap > far2))
                hd = 0.0;
            due = now + (int64_t)(unit * hd);
        }
        int64_t p = due * span + lv;
        prio[v] = p;
        if (i == 0 || p != run_prio) {
            if (i > 0) {
                if (push_run(heap, nobj, start, i, run_prio, run_lv, s) < 0)
                    goto done;
            }
            start = i;
            run_prio = p;
            run_lv = lv;
            s++;
        }
        stamp[v] = s;
    }
    if (n) {
        if (push_run(heap, nobj, start, n, run_prio, run_lv, s) < 0)
            goto done;
    }
    res = PyLong_FromLongLong(s - serial + 1);
done:
    drop_bufs(&bv);
    return res;
}

/* ---- the host tier's eviction bookkeeping (runtime/cache/eviction.py, tasks.py) */

/* Where an eviction run remembers the keys it drops (a policy's `remember_into`: (M, table,
   mark), adapt_forget's records, table and the uint8 set once anything is remembered): see
   take_remember and forget_core, by the `adaptive` policy's own loops below. */
typedef struct {
    const int64_t *m;
    uint64_t *table;
    uint8_t *mark;
    Py_ssize_t slots;
} remember_to;

static int take_remember(bufs *rv, PyObject *remember, Py_ssize_t ncols, remember_to *to, const char *what);
static void forget_core(const int64_t *m, Py_ssize_t n, const int32_t *hits, uint64_t *table, Py_ssize_t slots,
                        PyObject *fast, const int32_t *nodes, Py_ssize_t k, int aligned);

/* drop_host_run(f, cand, rows, cpu, reset, node_keys, kmap, hosts, h_at, stack, at, policy, gone, remember)
   -> (cut, leaf) or None: drop the host leaves of the popped run `cand` (int32) as
   `Eviction._drop_host_run` does when the run is whole chains of host-only (`cpu`) nodes, each
   node a leaf once the nodes before it are gone (its only child is the node right before it);
   None, nothing written, for a run of any other shape. Each chain's top (whose parent is not
   the next node; the last node always) is unlinked from its parent's child list and
   continuation, in order, until one leaves its parent an unreferenced host-only leaf that is
   not queued (`parent in policy` is asked of the policy then): the run is cut after that top,
   `leaf` is that parent (-1 if none) and `cut` the length of the part dropped. Of that part,
   keys that were not their parent's continuation (as found before any unlinking) leave the key
   map, with `remember` = (M, table, mark) (a remembering policy's, as drop_chains takes it) their
   keys, releases and uses are remembered, keys are cleared (appended to the list `gone` first, in
   order, unless it is None: for an observer, or a policy that remembers only through `forget`,
   with no Python loop over the run), host blocks written to `hosts` (int32) from index `h_at`,
   columns reset to `reset` and ids put on the free-id stack from index `at`. rows = (PARENT,
   CHILD, NEXT, PREV, CONT, STATE, REF, HOST, HITS). */
static PyObject *drop_host_run(PyObject *self, PyObject *args) {
    PyObject *fobj, *cobj, *rows, *reset, *node_keys, *kmap, *hobj, *sobj, *policy, *gone, *remember;
    long cpu;
    Py_ssize_t at, h_at;
    bufs bv, rv;
    rv.n = 0;
    PyObject *res = NULL;
    unsigned char *mapped = NULL;
    remember_to to;
    if (!PyArg_ParseTuple(args, "OOOlOO!O!OnOnOOO", &fobj, &cobj, &rows, &cpu, &reset, &PyList_Type, &node_keys,
                          &PyDict_Type, &kmap, &hobj, &h_at, &sobj, &at, &policy, &gone, &remember))
        return NULL;
    if (gone != Py_None && !PyList_Check(gone)) {
        PyErr_SetString(PyExc_TypeError, "drop_host_run: gone must be a list or None");
        return NULL;
    }
    if (take_bufs(&bv, "drop_host_run", "MnII", fobj, cobj, hobj, sobj) < 0)
        return NULL;
    Py_buffer *f = &bv.b[0], *cb = &bv.b[1], *hb = &bv.b[2], *st = &bv.b[3];
    long r[9];
    int32_t reset_v[MAX_ROWS];
    if (row_tuple(rows, 9, f, r, "drop_host_run") < 0 || reset_column(reset, f, reset_v, "drop_host_run") < 0)
        goto done;
    Py_ssize_t nrows = f->shape[0], ncols = f->shape[1], m = cb->shape[0];
    if (take_remember(&rv, remember, ncols, &to, "drop_host_run") < 0)
        goto done;
    if (at < 0 || at + m > st->shape[0] || h_at < 0 || h_at + m > hb->shape[0] || PyList_GET_SIZE(node_keys) < ncols) {
        PyErr_SetString(PyExc_ValueError, "drop_host_run: bad stack, host buffer or keys");
        goto done;
    }
    int32_t *M = f->buf;
    int32_t *PARENT = M + r[0] * ncols, *CHILD = M + r[1] * ncols, *NEXT = M + r[2] * ncols,
            *PREV = M + r[3] * ncols, *CONT = M + r[4] * ncols, *STATE = M + r[5] * ncols,
            *REF = M + r[6] * ncols, *HOST = M + r[7] * ncols, *HITS = M + r[8] * ncols;
    const int32_t *cand = cb->buf;
    if (m == 0) {
        res = Py_BuildValue("(nl)", (Py_ssize_t)0, -1L);
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t v = cand[i];
        if (PARENT[v] < 0 || PARENT[v] >= ncols || PREV[v] >= ncols || NEXT[v] >= ncols) {
            PyErr_SetString(PyExc_ValueError, "drop_host_run: a node's links are out of range");
            goto done;
        }
    }
    /* the usual shape, or nothing done */
    int usual = CHILD[cand[0]] < 0;
    for (Py_ssize_t i = 0; usual && i < m; i++)
        usual = STATE[cand[i]] == cpu;
    for (Py_ssize_t j = 0; usual && j + 1 < m; j++) {
        int32_t v = cand[j], c = CHILD[cand[j + 1]];
        int link = PARENT[v] == cand[j + 1], only = link && PREV[v] < 0 && NEXT[v] < 0;
        usual = !(link && !only) && (c < 0 || (only && c == v));
    }
    if (!usual) {
        res = Py_None;
        Py_INCREF(res);
        goto done;
    }
    mapped = PyMem_Malloc(m);
    if (mapped == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        mapped[i] = CONT[PARENT[cand[i]]] != cand[i];
    Py_ssize_t cut = m;
    long leaf = -1;
    for (Py_ssize_t t = 0; t < m; t++) {
        int32_t v = cand[t];
        if (t + 1 < m && PARENT[v] == cand[t + 1])
            continue;  /* not a top: its parent goes right after it */
        int32_t p = PARENT[v];
        detach(CHILD, NEXT, PREV, CONT, p, v);
        if (CHILD[p] < 0 && STATE[p] == cpu && REF[p] == 0) {
            int q = queued(policy, p);
            if (q < 0)
                goto done;
            if (!q) {
                cut = t + 1;
                leaf = p;
                break;
            }
        }
    }
    if (to.table != NULL) {
        forget_core(to.m, ncols, HITS, to.table, to.slots, node_keys, cand, cut, 0);
        to.mark[0] = 1;
    }
    for (Py_ssize_t i = 0; i < cut; i++)
        if (mapped[i] && PyDict_DelItem(kmap, PyList_GET_ITEM(node_keys, cand[i])) < 0)
            goto done;
    int32_t *stack = st->buf, *hosts = (int32_t *)hb->buf + h_at;
    for (Py_ssize_t i = 0; i < cut; i++) {
        int32_t v = cand[i];
        key_ahead(node_keys, cand, i, cut);
        hosts[i] = HOST[v];
        if (gone != Py_None && PyList_Append(gone, PyList_GET_ITEM(node_keys, v)) < 0)
            goto done;
        free_column(M, nrows, ncols, reset_v, node_keys, stack + at + i, v);
    }
    res = Py_BuildValue("(nl)", cut, leaf);
done:
    PyMem_Free(mapped);
    drop_bufs(&rv);
    drop_bufs(&bv);
    return res;
}

/* The marking both swap-out calls share: the i-th of victims `vs` (e of them) takes host block
   hosts[i], its id goes to victims[i] and its device block to devs[i], its key is appended to
   `victim_keys`; it becomes SWAP2CPU in task `task_id` with no device children. 0, or -1 with
   an exception. */
static int mark_victims(const int32_t *vs, Py_ssize_t e, const int32_t *hosts, int32_t *victims, int32_t *devs,
                        int32_t *HOST, int32_t *DEV, int32_t *STATE, int32_t *NDEV, int64_t *task, long swap2cpu,
                        long long task_id, PyObject *node_keys, PyObject *victim_keys) {
    for (Py_ssize_t i = 0; i < e; i++) {
        int32_t v = vs[i];
        key_ahead(node_keys, vs, i, e);
        if (PyList_Append(victim_keys, PyList_GET_ITEM(node_keys, v)) < 0)
            return -1;
        HOST[v] = hosts[i];
        victims[i] = v;
        devs[i] = DEV[v];
        STATE[v] = (int32_t)swap2cpu;
        task[v] = task_id;
        NDEV[v] = 0;
    }
    return 0;
}

/* mark_swap_out(f, vs, task, hosts, victims, devs, at, rows, swap2cpu, task_id, node_keys, victim_keys):
   make the nodes `vs` (int32, in eviction order) SWAP2CPU in task `task_id` as
   `Eviction._mark_swap_out` does: the i-th takes host block hosts[at + i], its id goes to
   victims[at + i] and its device block to devs[at + i] (int32 arrays), its key is appended to
   the list `victim_keys`, its task (int64) is set and its device children count cleared.
   rows = (HOST, DEV, STATE, NDEV). No Python object is made per victim. */
static PyObject *mark_swap_out(PyObject *self, PyObject *args) {
    PyObject *fobj, *vobj, *tobj, *hobj, *iobj, *dobj, *rows, *node_keys, *victim_keys;
    Py_ssize_t at;
    long swap2cpu;
    long long task_id;
    bufs bv;
    PyObject *res = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOnOlLO!O!", &fobj, &vobj, &tobj, &hobj, &iobj, &dobj, &at, &rows, &swap2cpu,
                          &task_id, &PyList_Type, &node_keys, &PyList_Type, &victim_keys))
        return NULL;
    if (take_bufs(&bv, "mark_swap_out", "MnQiII", fobj, vobj, tobj, hobj, iobj, dobj) < 0)
        return NULL;
    Py_buffer *f = &bv.b[0], *vb = &bv.b[1], *tb = &bv.b[2], *hb = &bv.b[3], *ib = &bv.b[4], *db = &bv.b[5];
    long r[4];
    if (row_tuple(rows, 4, f, r, "mark_swap_out") < 0)
        goto done;
    Py_ssize_t ncols = f->shape[1], e = vb->shape[0];
    if (at < 0 || at + e > hb->shape[0] || at + e > ib->shape[0] || at + e > db->shape[0] || tb->shape[0] != ncols ||
        PyList_GET_SIZE(node_keys) < ncols) {
        PyErr_SetString(PyExc_ValueError, "mark_swap_out: fewer host blocks or room than victims, or bad task row or keys");
        goto done;
    }
    int32_t *M = f->buf;
    int32_t *HOST = M + r[0] * ncols, *DEV = M + r[1] * ncols, *STATE = M + r[2] * ncols, *NDEV = M + r[3] * ncols;
    int64_t *task = tb->buf;
    const int32_t *vs = vb->buf, *hosts = (const int32_t *)hb->buf + at;
    int32_t *victims = (int32_t *)ib->buf + at, *devs = (int32_t *)db->buf + at;
    if (mark_victims(vs, e, hosts, victims, devs, HOST, DEV, STATE, NDEV, task, swap2cpu, task_id, node_keys,
                     victim_keys) < 0)
        goto done;
    res = Py_None;
    Py_INCREF(res);
done:
    drop_bufs(&bv);
    return res;
}

/* swap_chains(f, cand, rows, gpu, policy, pos) -> cut or None: with a host tier, the choice of
   an eviction run's victims where it is the usual run (`Eviction._swap_batched`: chain_tops and
   `_first_trigger`, nothing parked, a C call and Python glue each). If the run `cand` (int32,
   as popped) is whole chains released deepest first (each node's only device child right before
   it, every parent a node), how many of it go: all, or up to and including the first node whose
   drop leaves its parent an unreferenced GPU node without device children that is not queued in
   `policy` (`p in policy`; one-at-a-time eviction takes that parent next); None otherwise,
   for the general path. Nothing is changed; rows = (PARENT, NDEV, STATE, REF); `pos` (int32,
   one per node, all -1) counts the tops per parent and is left as it was. */
static PyObject *swap_chains(PyObject *self, PyObject *args) {
    PyObject *fobj, *cobj, *rows, *policy, *pobj;
    long gpu;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OOOlOO", &fobj, &cobj, &rows, &gpu, &policy, &pobj))
        return NULL;
    if (take_bufs(&bv, "swap_chains", "mnI", fobj, cobj, pobj) < 0)
        return NULL;
    PyObject *res = NULL;
    Py_ssize_t *tix = NULL;
    const Py_buffer *f = &bv.b[0];
    Py_ssize_t ncols = f->shape[1], m = bv.b[1].shape[0], ntop = 0;
    long r[4];
    if (row_tuple(rows, 4, f, r, "swap_chains") < 0)
        goto done;
    if (bv.b[2].shape[0] != ncols) {
        PyErr_SetString(PyExc_ValueError, "swap_chains: a pos slot per node");
        goto done;
    }
    const int32_t *M = f->buf, *cand = bv.b[1].buf, *PARENT = M + r[0] * ncols, *NDEV = M + r[1] * ncols,
                  *STATE = M + r[2] * ncols, *REF = M + r[3] * ncols;
    int32_t *pos = bv.b[2].buf;
    tix = PyMem_New(Py_ssize_t, m ? m : 1);
    if (tix == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t p = PARENT[cand[i]];
        if (p < 0 || p >= ncols || NDEV[cand[i]] != (i && PARENT[cand[i - 1]] == cand[i])) {
            res = Py_None;
            Py_INCREF(res);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < m; i++)
        if (i == m - 1 || PARENT[cand[i]] != cand[i + 1])
            tix[ntop++] = i;
    Py_ssize_t cut = m;
    int err = 0;
    if (ntop && !(ntop == 1 && (NDEV[PARENT[cand[tix[0]]]] > 1 || STATE[PARENT[cand[tix[0]]]] != gpu ||
                                REF[PARENT[cand[tix[0]]]]))) {
        for (Py_ssize_t j = 0; j < ntop; j++) {
            int32_t p = PARENT[cand[tix[j]]];
            pos[p] = pos[p] < 0 ? 1 : pos[p] + 1;
        }
        /* each parent once, at its last top; the earliest such top that leaves its parent next
           in line cuts the run */
        for (Py_ssize_t j = ntop; j-- > 0 && !err;) {
            int32_t p = PARENT[cand[tix[j]]], c = pos[p];
            if (c < 0)
                continue;
            pos[p] = -2;
            if (NDEV[p] == c && STATE[p] == gpu && REF[p] == 0 && tix[j] + 1 < cut) {
                int q = queued(policy, p);
                if (q < 0)
                    err = 1;
                else if (!q)
                    cut = tix[j] + 1;
            }
        }
        for (Py_ssize_t j = 0; j < ntop; j++)
            pos[PARENT[cand[tix[j]]]] = -1;
    }
    if (!err)
        res = PyLong_FromSsize_t(cut);
done:
    PyMem_Free(tix);
    drop_bufs(&bv);
    return res;
}

/* mark_chains(f, vs, task, hosts, victims, devs, at, rows, swap2cpu, task_id, node_keys, victim_keys, gpu)
   -> parents: mark_swap_out for victims `vs` that are whole chains released deepest first, or
   the start of such a run (swap_chains), and what `Eviction._mark_swap_out` does after it: each
   victim whose parent is not the next victim (a chain's top) takes a device child from that
   parent, and the parents so left unreferenced GPU nodes without device children are returned,
   in the victims' order (one per top; the caller queues those not queued yet). rows = (HOST,
   DEV, STATE, NDEV, PARENT, REF). */
static PyObject *mark_chains(PyObject *self, PyObject *args) {
    PyObject *fobj, *vobj, *tobj, *hobj, *iobj, *dobj, *rows, *node_keys, *victim_keys;
    Py_ssize_t at;
    long swap2cpu, gpu;
    long long task_id;
    bufs bv;
    PyObject *res = NULL, *left = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOnOlLO!O!l", &fobj, &vobj, &tobj, &hobj, &iobj, &dobj, &at, &rows, &swap2cpu,
                          &task_id, &PyList_Type, &node_keys, &PyList_Type, &victim_keys, &gpu))
        return NULL;
    if (take_bufs(&bv, "mark_chains", "MnQiII", fobj, vobj, tobj, hobj, iobj, dobj) < 0)
        return NULL;
    Py_buffer *f = &bv.b[0], *vb = &bv.b[1], *tb = &bv.b[2], *hb = &bv.b[3], *ib = &bv.b[4], *db = &bv.b[5];
    long r[6];
    if (row_tuple(rows, 6, f, r, "mark_chains") < 0)
        goto done;
    Py_ssize_t ncols = f->shape[1], e = vb->shape[0];
    if (at < 0 || at + e > hb->shape[0] || at + e > ib->shape[0] || at + e > db->shape[0] || tb->shape[0] != ncols ||
        PyList_GET_SIZE(node_keys) < ncols) {
        PyErr_SetString(PyExc_ValueError, "mark_chains: fewer host blocks or room than victims, or bad task row or keys");
        goto done;
    }
    int32_t *M = f->buf;
    int32_t *HOST = M + r[0] * ncols, *DEV = M + r[1] * ncols, *STATE = M + r[2] * ncols, *NDEV = M + r[3] * ncols,
            *PARENT = M + r[4] * ncols, *REF = M + r[5] * ncols;
    int64_t *task = tb->buf;
    const int32_t *vs = vb->buf, *hosts = (const int32_t *)hb->buf + at;
    int32_t *victims = (int32_t *)ib->buf + at, *devs = (int32_t *)db->buf + at;
    for (Py_ssize_t i = 0; i < e; i++) {
        int32_t p = PARENT[vs[i]];
        if (p < 0 || p >= ncols) {
            PyErr_SetString(PyExc_ValueError, "mark_chains: a victim's parent is out of range");
            goto done;
        }
    }
    left = PyList_New(0);
    if (left == NULL)
        goto done;
    if (mark_victims(vs, e, hosts, victims, devs, HOST, DEV, STATE, NDEV, task, swap2cpu, task_id, node_keys,
                     victim_keys) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < e; i++)
        if (i == e - 1 || PARENT[vs[i]] != vs[i + 1])
            NDEV[PARENT[vs[i]]]--;
    for (Py_ssize_t i = 0; i < e; i++)
        if (i == e - 1 || PARENT[vs[i]] != vs[i + 1]) {
            int32_t p = PARENT[vs[i]];
            if (NDEV[p] == 0 && STATE[p] == gpu && REF[p] == 0 && append_new(left, PyLong_FromLong(p)) < 0)
                goto done;
        }
    res = left;
    left = NULL;
done:
    Py_XDECREF(left);
    drop_bufs(&bv);
    return res;
}

/* drop_host_nodes(f, cand, rows, cpu, node_keys, kmap, pos, policy, freed) -> (count, last, leaf): the
   node-by-node unlinking of `Eviction._drop_host_slow`, for a popped run `cand` (int32) of
   host-only (`cpu`) nodes of any shape (RuntimeError, nothing done, if one is not): in order,
   a node with children is skipped (parked); any other leaves the key map (if it is not its
   parent's continuation) and its parent's child list, and goes to `freed` (int32, as long as
   `cand`: the first `count`); when its parent
   became an unreferenced host-only leaf that is neither queued (`parent in policy`, asked of
   the policy then) nor later in the run, the walk ends there: `last` is that node's index and
   `leaf` the parent (-1, -1 if none). `pos` (int32, -1 everywhere) is scratch, left as found.
   rows = (PARENT, CHILD, NEXT, PREV, CONT, STATE, REF). */
static PyObject *drop_host_nodes(PyObject *self, PyObject *args) {
    PyObject *fobj, *cobj, *rows, *node_keys, *kmap, *pobj, *policy, *oobj;
    long cpu;
    bufs bv;
    PyObject *res = NULL;
    int pos_set = 0;
    if (!PyArg_ParseTuple(args, "OOOlO!O!OOO", &fobj, &cobj, &rows, &cpu, &PyList_Type, &node_keys, &PyDict_Type,
                          &kmap, &pobj, &policy, &oobj))
        return NULL;
    if (take_bufs(&bv, "drop_host_nodes", "MnII", fobj, cobj, pobj, oobj) < 0)
        return NULL;
    Py_buffer *f = &bv.b[0], *cb = &bv.b[1], *pb = &bv.b[2], *ob = &bv.b[3];
    long r[7];
    if (row_tuple(rows, 7, f, r, "drop_host_nodes") < 0)
        goto done;
    Py_ssize_t ncols = f->shape[1], m = cb->shape[0];
    if (pb->shape[0] != ncols || ob->shape[0] < m || PyList_GET_SIZE(node_keys) < ncols) {
        PyErr_SetString(PyExc_ValueError, "drop_host_nodes: bad scratch, room or keys");
        goto done;
    }
    int32_t *M = f->buf, *pos = pb->buf;
    int32_t *PARENT = M + r[0] * ncols, *CHILD = M + r[1] * ncols, *NEXT = M + r[2] * ncols,
            *PREV = M + r[3] * ncols, *CONT = M + r[4] * ncols, *STATE = M + r[5] * ncols, *REF = M + r[6] * ncols;
    const int32_t *cand = cb->buf;
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t v = cand[i];
        if (STATE[v] != cpu) {
            PyErr_SetString(PyExc_RuntimeError, "the host eviction queue holds a node that is not on the host only");
            goto done;
        }
        if (PARENT[v] < 0 || PARENT[v] >= ncols || PREV[v] >= ncols || NEXT[v] >= ncols) {
            PyErr_SetString(PyExc_ValueError, "drop_host_nodes: a node's links are out of range");
            goto done;
        }
    }
    int32_t *freed = ob->buf;
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < m; i++)
        pos[cand[i]] = (int32_t)i;
    pos_set = 1;
    Py_ssize_t last = -1;
    long leaf = -1;
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t v = cand[i];
        if (CHILD[v] >= 0)
            continue;  /* parked: requeued when its last child leaves */
        int32_t p = PARENT[v], b = PREV[v], a = NEXT[v];
        int ends = pos[p] <= i && CHILD[p] == v && a < 0 && b < 0 && STATE[p] == cpu && REF[p] == 0;
        if (ends) {
            int q = queued(policy, p);
            if (q < 0)
                goto done;
            ends = !q;
        }
        if (CONT[p] != v && PyDict_DelItem(kmap, PyList_GET_ITEM(node_keys, v)) < 0)
            goto done;
        detach(CHILD, NEXT, PREV, CONT, p, v);
        freed[count++] = v;
        if (ends) {
            last = i;
            leaf = p;
            break;
        }
    }
    res = Py_BuildValue("(nnl)", count, last, leaf);
done:
    if (pos_set)
        for (Py_ssize_t i = 0; i < m; i++)
            pos[cand[i]] = -1;
    drop_bufs(&bv);
    return res;
}

/* free_host_nodes(f, nodes, task, stack, hosts, at, h_at, host_row, reset, node_keys): free the
   unlinked host-only `nodes` (int32) as `Eviction._drop_host_slow` does after drop_host_nodes:
   each one's host block goes to hosts[h_at + i] (int32), its task (int64) becomes -1, its key
   slot None, its column `reset`, and its id goes on the free-id stack at stack[at + i]. */
static PyObject *free_host_nodes(PyObject *self, PyObject *args) {
    PyObject *fobj, *nobj, *tobj, *sobj, *hobj, *reset, *node_keys;
    Py_ssize_t at, h_at;
    long host_row;
    bufs bv;
    PyObject *res = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOnnlOO!", &fobj, &nobj, &tobj, &sobj, &hobj, &at, &h_at, &host_row, &reset,
                          &PyList_Type, &node_keys))
        return NULL;
    if (take_bufs(&bv, "free_host_nodes", "MnQII", fobj, nobj, tobj, sobj, hobj) < 0)
        return NULL;
    Py_buffer *f = &bv.b[0], *nb = &bv.b[1], *tb = &bv.b[2], *sb = &bv.b[3], *hb = &bv.b[4];
    int32_t reset_v[MAX_ROWS];
    if (row_index(host_row, f) < 0 || reset_column(reset, f, reset_v, "free_host_nodes") < 0)
        goto done;
    Py_ssize_t nrows = f->shape[0], ncols = f->shape[1], m = nb->shape[0];
    if (tb->shape[0] != ncols || at < 0 || at + m > sb->shape[0] || h_at < 0 || h_at + m > hb->shape[0] ||
        PyList_GET_SIZE(node_keys) < ncols) {
        PyErr_SetString(PyExc_ValueError, "free_host_nodes: bad task row, stack, host buffer or keys");
        goto done;
    }
    int32_t *M = f->buf, *HOST = M + host_row * ncols, *stack = (int32_t *)sb->buf + at;
    int32_t *hosts = (int32_t *)hb->buf + h_at;
    int64_t *task = tb->buf;
    const int32_t *nodes = nb->buf;
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t v = nodes[i];
        key_ahead(node_keys, nodes, i, m);
        hosts[i] = HOST[v];
        task[v] = -1;
        free_column(M, nrows, ncols, reset_v, node_keys, stack + i, v);
    }
    res = Py_None;
    Py_INCREF(res);
done:
    drop_bufs(&bv);
    return res;
}

/* finish_swap_out(f, nodes, task, task_id, rows, swap2cpu, cpu) -> devs or None: the usual answer to a
   swap-out, as `TaskBook._finish_swap_out` applies it. If every node of `nodes` (int32) is still
   SWAP2CPU in task `task_id` (task, int64), each becomes `cpu` without a task or a device block,
   and their device blocks are returned in order (a list: they go back to the pool as ints);
   else None, nothing written. rows = (DEV, STATE). */
static PyObject *finish_swap_out(PyObject *self, PyObject *args) {
    PyObject *fobj, *nobj, *tobj, *rows;
    long long task_id;
    long swap2cpu, cpu;
    bufs bv;
    PyObject *res = NULL, *devs = NULL;
    if (!PyArg_ParseTuple(args, "OOOLOll", &fobj, &nobj, &tobj, &task_id, &rows, &swap2cpu, &cpu))
        return NULL;
    if (take_bufs(&bv, "finish_swap_out", "MnQ", fobj, nobj, tobj) < 0)
        return NULL;
    Py_buffer *f = &bv.b[0], *nb = &bv.b[1], *tb = &bv.b[2];
    long r[2];
    if (row_tuple(rows, 2, f, r, "finish_swap_out") < 0)
        goto done;
    Py_ssize_t ncols = f->shape[1], m = nb->shape[0];
    if (tb->shape[0] != ncols) {
        PyErr_SetString(PyExc_ValueError, "finish_swap_out: the task row must have a node's length");
        goto done;
    }
    int32_t *M = f->buf, *DEV = M + r[0] * ncols, *STATE = M + r[1] * ncols;
    const int32_t *nodes = nb->buf;
    int64_t *task = tb->buf;
    for (Py_ssize_t i = 0; i < m; i++)
        if (task[nodes[i]] != task_id || STATE[nodes[i]] != swap2cpu) {
            res = Py_None;
            Py_INCREF(res);
            goto done;
        }
    devs = PyList_New(m);
    if (devs == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t v = nodes[i];
        PyObject *x = PyLong_FromLong(DEV[v]);
        if (x == NULL)
            goto done;
        PyList_SET_ITEM(devs, i, x);
        DEV[v] = -1;
        STATE[v] = (int32_t)cpu;
        task[v] = -1;
    }
    res = devs;
    devs = NULL;
done:
    Py_XDECREF(devs);
    drop_bufs(&bv);
    return res;
}

/* ---- the `adaptive` policy (runtime/cache/policies/adaptive.py): a recency segment R (LRU over
   released nodes, a ring of [node, stamp] entries, lazily invalidated), a protected segment P
   (a binary heap of [priority, order, node, serial] entries, lazily invalidated) whose size is
   held under a budget, and the ledger that says how P's hits compare with LRU's, block by block.

   State, as the policy's arrays (all flat, C order): M (int64, M_ROWS per node, side by side:
   R stamp, P serial, block serial, release, priority, the due release it is counted at while
   queued or -1), F (uint8, 3 per node: counted as a live exit, spare, parked), R (int64, RQ
   pairs [node, stamp]), H (int64, HC entries of 4: priority, order, node, serial), T (int64, 5
   rows of RT: per release modulo RT its first block serial, its length, its live exits; per due
   release modulo RT the queued nodes and the evicted live exits with a bonus due then), bits
   (uint8, RS: a block serial's live exit (1), evicted with a bonus and counted by its due (2),
   modulo RS), st (int64 scalars, the A_ indices below), hits (int32, the node matrix's row). A
   live exit is a node that left R (to P, or evicted from R or later from P) and has not been
   used since: the blocks an LRU cache of the same size holds are R, the nodes in use, and the
   newest |P| live exits, newest by (release, block serial).

   `gaps`' order with no budget (every block kept until its due release, the release plus its
   bonus, is the lowest) would hold the nodes in use and the blocks of the highest due releases
   among the queued nodes and the evicted live exits: those due at its frontier F or later, F the
   lowest due release at which as many evicted live exits are due at F or later (XA) as queued
   nodes before F (QB). Due releases are counted from L = clock - RT/2 (older ones at L; a
   count older than L is gone) to L + RT - 1 (later ones there). */
enum { A_CLOCK, A_SERIAL, A_RHEAD, A_RTAIL, A_HSIZE, A_NP, A_TB, A_ABOVE, A_LASTEX, A_PSER, A_ORDER, A_FSTAMP,
       A_NPARK, A_PMAX, A_F, A_XA, A_QB, A_NSTATE };
enum { M_RSTAMP, M_PSER, M_BSER, M_REL, M_PRIO, M_QDUE, M_ROWS };
enum { A_HOLD_MAX = 1028 };  /* adapt_pop: nodes kept back for a device child, per victim */

typedef struct {
    int64_t *m;
    uint8_t *exited, *parked;
    int64_t *rq, *h, *tstart, *tlen, *talive, *qdue, *xdue, *st;
    uint8_t *bits;
    const int32_t *hits;
    int64_t *due;  /* per block serial modulo RS: the due release it is counted at (bits & 2) */
    int64_t low;   /* L, and its column (a_set_low) */
    Py_ssize_t n, rq_cap, hcap, rt, rs, jlow;
} adapt_t;

static inline Py_ssize_t amod(int64_t x, Py_ssize_t m);

/* L = clock - RT/2 (0 at least), the oldest due release counted, and its column: set whenever
   the clock moves, so that a due release's column is found without a division. */
static void a_set_low(adapt_t *a) {
    int64_t low = a->st[A_CLOCK] - a->rt / 2;
    a->low = low < 0 ? 0 : low;
    a->jlow = amod(a->low, a->rt);
}

/* The state's buffers (M, F, R, H, T, bits, st, hits, then `more` per the letters of spec
   after the first 8) into *a; 0, or -1 with an exception. */
static int adapt_take(bufs *v, adapt_t *a, const char *what, const char *spec, ...) {
    va_list ap;
    va_start(ap, spec);
    int r = vtake_bufs(v, what, spec, ap);
    va_end(ap);
    if (r < 0)
        return -1;
    Py_ssize_t n = v->b[7].shape[0];
    if (n < 1 || v->b[0].shape[0] != M_ROWS * n || v->b[1].shape[0] != 3 * n || v->b[2].shape[0] % 2 ||
        v->b[3].shape[0] % 4 || v->b[4].shape[0] % 5 || v->b[6].shape[0] < A_NSTATE || v->b[2].shape[0] < 4 ||
        v->b[4].shape[0] < 10 || v->b[5].shape[0] < 1 || v->b[3].shape[0] < 4) {
        PyErr_Format(PyExc_ValueError, "%s: the adaptive policy's arrays do not fit together", what);
        drop_bufs(v);
        return -1;
    }
    a->n = n;
    a->m = v->b[0].buf;
    a->exited = v->b[1].buf;
    a->parked = (uint8_t *)v->b[1].buf + 2;
    a->rq = v->b[2].buf;
    a->rq_cap = v->b[2].shape[0] / 2;
    a->hcap = v->b[3].shape[0] / 4;
    a->h = v->b[3].buf;
    a->rt = v->b[4].shape[0] / 5;
    a->tstart = v->b[4].buf;
    a->tlen = a->tstart + a->rt;
    a->talive = a->tlen + a->rt;
    a->qdue = a->talive + a->rt;
    a->xdue = a->qdue + a->rt;
    a->bits = v->b[5].buf;
    a->rs = v->b[5].shape[0];
    a->st = v->b[6].buf;
    a->hits = v->b[7].buf;
    a->due = NULL;
    a_set_low(a);
    return 0;
}

static inline Py_ssize_t amod(int64_t x, Py_ssize_t m) {
    Py_ssize_t r = (Py_ssize_t)(x % m);
    return r < 0 ? r + m : r;
}

/* Is release t still in the ring of releases (and its blocks in the ring of bits)? */
static inline int a_tracked(const adapt_t *a, int64_t t) {
    int64_t clock = a->st[A_CLOCK];
    if (t < 0 || t >= clock || clock - t >= a->rt - 1)
        return 0;
    Py_ssize_t j = amod(t, a->rt);
    return a->st[A_SERIAL] - a->tstart[j] <= a->rs - a->tlen[j];
}

static inline int64_t a_alive(const adapt_t *a, int64_t t) {
    return a_tracked(a, t) ? a->talive[amod(t, a->rt)] : 0;
}

/* Due release d as counted now: within [L, L + RT - 1]. */
static inline int64_t a_due(const adapt_t *a, int64_t d) {
    int64_t high = a->low + a->rt - 1;
    return d < a->low ? a->low : d > high ? high : d;
}

/* The column of due release d, L <= d < L + RT. */
static inline Py_ssize_t a_col(const adapt_t *a, int64_t d) {
    Py_ssize_t j = a->jlow + (Py_ssize_t)(d - a->low);
    return j >= a->rt ? j - a->rt : j;
}

/* Count (+1) or uncount (-1) a queued node (q) or an evicted live exit (!q) due at d (as
   counted: a count older than L is gone already). */
static inline void a_count(adapt_t *a, int q, int64_t d, int sign) {
    if (d < a->low)
        return;
    int64_t *row = q ? a->qdue : a->xdue;
    row[a_col(a, d)] += sign;
    if (q && d < a->st[A_F])
        a->st[A_QB] += sign;
    else if (!q && d >= a->st[A_F])
        a->st[A_XA] += sign;
}

/* Node v joins the queues (its priority set) / leaves them. */
static inline void a_qin(adapt_t *a, int32_t v, int64_t span) {
    int64_t d = a_due(a, a->m[(v) * M_ROWS + M_PRIO] / span);
    a->m[(v) * M_ROWS + M_QDUE] = d;
    a_count(a, 1, d, 1);
}

static inline void a_qout(adapt_t *a, int32_t v) {
    int64_t d = a->m[(v) * M_ROWS + M_QDUE];
    if (d < 0)
        return;
    a->m[(v) * M_ROWS + M_QDUE] = -1;
    a_count(a, 1, d, -1);
}

/* Block serial s (a live exit) is no longer counted as evicted with a bonus (used again, or
   its serial taken by a new block). */
static inline void a_xout(adapt_t *a, int64_t s) {
    uint8_t *b = &a->bits[amod(s, a->rs)];
    if (*b & 2) {
        *b &= (uint8_t)~2;
        a_count(a, 0, a->due[amod(s, a->rs)], -1);
    }
}

/* Node v, a live exit with a bonus, leaves the cache: counted at its due release (as `gaps`'
   order would still hold it until then). */
static inline void a_evicted(adapt_t *a, int32_t v, int64_t span) {
    int64_t pr = a->m[(v) * M_ROWS + M_PRIO], t = a->m[(v) * M_ROWS + M_REL];
    Py_ssize_t s = amod(a->m[(v) * M_ROWS + M_BSER], a->rs);
    if (pr <= t * span + amod(pr, span) || !a->exited[3 * (v)] || !(a->bits[s] & 1) || !a_tracked(a, t))
        return;
    a->due[s] = a_due(a, pr / span);
    a->bits[s] |= 2;
    a_count(a, 0, a->due[s], 1);
}

/* The clock moved on from a release whose L was `low`: the due releases older than L now are
   counted no more (F at L at least), and their columns are the newest ones'. */
static void a_advance(adapt_t *a, int64_t low) {
    a_set_low(a);
    int64_t *st = a->st, now = a->low;
    for (; low < now; low++) {
        Py_ssize_t j = amod(low, a->rt);
        if (st[A_F] <= low) {
            st[A_F] = low + 1;
            st[A_XA] -= a->xdue[j];
        } else {
            st[A_QB] -= a->qdue[j];
        }
        a->qdue[j] = a->xdue[j] = 0;
    }
}

/* Move F to the lowest due release (from L on) at which XA <= QB. */
static void a_frontier(adapt_t *a) {
    int64_t *st = a->st, low = a->low, high = low + a->rt - 1;
    while (st[A_XA] > st[A_QB] && st[A_F] < high) {
        Py_ssize_t j = a_col(a, st[A_F]++);
        st[A_XA] -= a->xdue[j];
        st[A_QB] += a->qdue[j];
    }
    for (;;) {
        if (st[A_F] <= low)
            break;
        Py_ssize_t j = a_col(a, st[A_F] - 1);
        if (st[A_XA] + a->xdue[j] > st[A_QB] - a->qdue[j])
            break;
        st[A_F]--;
        st[A_XA] += a->xdue[j];
        st[A_QB] -= a->qdue[j];
    }
}

/* Move the boundary release TB so that the live exits of releases TB and newer are the first to
   reach |P|: LRU holds the newest |P| live exits. */
static void a_fix(adapt_t *a) {
    int64_t *st = a->st, held = st[A_NP] + st[A_NPARK];
    while (st[A_TB] <= st[A_LASTEX] && st[A_ABOVE] - a_alive(a, st[A_TB]) >= held) {
        st[A_ABOVE] -= a_alive(a, st[A_TB]);
        st[A_TB]++;
    }
    int64_t low = st[A_CLOCK] - a->rt + 2;
    while (st[A_ABOVE] < held && st[A_TB] > low && st[A_TB] > 0) {
        st[A_TB]--;
        st[A_ABOVE] += a_alive(a, st[A_TB]);
    }
}

/* What an LRU cache of the same size holds beyond R, as it stands when a request is matched: the
   newest (|P| + parked) live exits, i.e. every live exit of releases after TB and those of
   release TB from block serial `from` on. Taken once per matched or missed run, before any of
   its blocks is counted again: an LRU cache's content is what it was when the request came. */
typedef struct {
    int64_t tb, from;
    int any;
} a_window_t;

static a_window_t a_window(const adapt_t *a) {
    const int64_t *st = a->st, held = st[A_NP] + st[A_NPARK];
    a_window_t w = {st[A_TB], INT64_MAX, held > 0};
    if (!w.any || !a_tracked(a, w.tb))
        return w;
    int64_t need = held - (st[A_ABOVE] - a_alive(a, w.tb));
    Py_ssize_t j = amod(w.tb, a->rt);
    for (int64_t x = a->tstart[j] + a->tlen[j]; need > 0 && x-- > a->tstart[j];)
        if (a->bits[amod(x, a->rs)]) {
            need--;
            w.from = x;
        }
    return w;
}

/* Would an LRU cache of the same size hold the live exit of release t, block serial s? */
static inline int a_in_lru(const a_window_t *w, int64_t t, int64_t s) {
    return w->any && (t > w->tb || (t == w->tb && s >= w->from));
}

/* Node v becomes a live exit (it leaves R) unless it is one already. */
static void a_exit(adapt_t *a, int32_t v) {
    int64_t t = a->m[(v) * M_ROWS + M_REL], s = a->m[(v) * M_ROWS + M_BSER];
    if (t > a->st[A_LASTEX])
        a->st[A_LASTEX] = t;
    if (a->exited[3 * (v)] || !a_tracked(a, t))
        return;
    a->exited[3 * (v)] = 1;
    a->bits[amod(s, a->rs)] = 1;
    a->talive[amod(t, a->rt)]++;
    if (t >= a->st[A_TB])
        a->st[A_ABOVE]++;
}

/* The live exit of release t, serial s, is used again (or gone): no longer counted. */
static void a_dies(adapt_t *a, int64_t t, int64_t s) {
    if (!a_tracked(a, t))
        return;
    uint8_t *b = &a->bits[amod(s, a->rs)];
    if (!*b)
        return;
    a_xout(a, s);
    *b = 0;
    a->talive[amod(t, a->rt)]--;
    if (t >= a->st[A_TB])
        a->st[A_ABOVE]--;
}

static void a_reenter(adapt_t *a, int32_t v) {
    if (a->parked[3 * (v)]) {
        a->parked[3 * (v)] = 0;
        a->st[A_NPARK]--;
    }
    if (a->exited[3 * (v)]) {
        a->exited[3 * (v)] = 0;
        a_dies(a, a->m[(v) * M_ROWS + M_REL], a->m[(v) * M_ROWS + M_BSER]);
    }
}

/* P's heap: entry i is h[4i .. 4i+3] = [priority, order, node, serial], its key (priority, then
   order) side by side, so that comparing and moving an entry touches one or two cache lines, not
   one per field (a heap of a capacity's nodes is far larger than the CPU's first caches). */
#define HK(a, i) ((a)->h[4 * (i)])
#define HO(a, i) ((a)->h[4 * (i) + 1])
#define HN(a, i) ((a)->h[4 * (i) + 2])
#define HS(a, i) ((a)->h[4 * (i) + 3])

/* entry e (4 fields) before heap entry j? (priority, then order) */
static inline int a_before(const adapt_t *a, const int64_t *e, Py_ssize_t j) {
    return e[0] < HK(a, j) || (e[0] == HK(a, j) && e[1] < HO(a, j));
}

/* Put entry e (4 fields, not in the heap) at position i and sift it down: the same moves as
   swapping it with its lower child while that child is lower (each child moved up once, e
   written once at the end). */
static void a_down_put(adapt_t *a, Py_ssize_t i, Py_ssize_t size, const int64_t *e) {
    int64_t x[4] = {e[0], e[1], e[2], e[3]};
    for (;;) {
        Py_ssize_t l = 2 * i + 1, m = -1;
        if (2 * l + 4 < size) {  /* (the grandchildren: the next step's entries) */
            AHEAD(&a->h[4 * (2 * l + 1)], 0);
            AHEAD(&a->h[4 * (2 * l + 3)], 0);
        }
        if (l < size && !a_before(a, x, l))
            m = l;
        if (l + 1 < size && (m < 0 ? !a_before(a, x, l + 1) : (HK(a, l + 1) < HK(a, m) ||
                             (HK(a, l + 1) == HK(a, m) && HO(a, l + 1) < HO(a, m)))))
            m = l + 1;
        if (m < 0)
            break;
        memcpy(&a->h[4 * i], &a->h[4 * m], 4 * sizeof(int64_t));
        i = m;
    }
    memcpy(&a->h[4 * i], x, sizeof x);
}

static void a_down(adapt_t *a, Py_ssize_t i, Py_ssize_t size) {
    int64_t e[4];
    memcpy(e, &a->h[4 * i], sizeof e);
    a_down_put(a, i, size, e);
}

static void a_heap_remove_top(adapt_t *a) {
    Py_ssize_t size = --a->st[A_HSIZE];
    if (size) {
        int64_t e[4];
        memcpy(e, &a->h[4 * size], sizeof e);
        a_down_put(a, 0, size, e);
    }
}

/* The live top of P's heap (stale entries dropped), or -1. */
static Py_ssize_t a_ptop(adapt_t *a) {
    while (a->st[A_HSIZE]) {
        int64_t v = HN(a, 0);
        if (a->m[(v) * M_ROWS + M_PSER] == HS(a, 0))
            return 0;
        a_heap_remove_top(a);
    }
    return -1;
}

/* how far ahead a loop over a run of nodes, or over R's entries, asks for what it reads of them */
#define R_AHEAD 8

/* Node v (out of R, a live exit) joins P with its priority. */
static void a_protect(adapt_t *a, int32_t v) {
    if (a->st[A_HSIZE] == a->hcap) {  /* full of stale entries: keep the live ones */
        /* (each entry's node record asked for R_AHEAD entries ahead: the heap's nodes are
           scattered, and one wait for memory per entry was most of this loop) */
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < a->hcap; i++) {
            if (i + R_AHEAD < a->hcap) {
                int64_t w = HN(a, i + R_AHEAD);
                if (w >= 0 && w < a->n)
                    AHEAD(&a->m[w * M_ROWS + M_PSER], 0);
            }
            if (a->m[HN(a, i) * M_ROWS + M_PSER] == HS(a, i)) {
                if (k != i)
                    memcpy(&a->h[4 * k], &a->h[4 * i], 4 * sizeof(int64_t));
                k++;
            }
        }
        a->st[A_HSIZE] = k;
        for (Py_ssize_t i = k / 2; i-- > 0;)
            a_down(a, i, k);
    }
    Py_ssize_t i = a->st[A_HSIZE]++;
    int64_t ser = a->st[A_PSER]++;
    if (a->m[(v) * M_ROWS + M_PRIO] > a->st[A_PMAX])
        a->st[A_PMAX] = a->m[(v) * M_ROWS + M_PRIO];
    int64_t e[4] = {a->m[(v) * M_ROWS + M_PRIO], a->st[A_ORDER]++, v, ser};
    a->m[(v) * M_ROWS + M_PSER] = ser;
    /* sift up: the same moves as swapping with the parent while below it */
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (!a_before(a, e, p))
            break;
        memcpy(&a->h[4 * i], &a->h[4 * p], 4 * sizeof(int64_t));
        i = p;
    }
    memcpy(&a->h[4 * i], e, sizeof e);
    a->st[A_NP]++;
}

/* P's top node leaves P (an eviction; it stays a live exit). */
static int32_t a_unprotect_top(adapt_t *a) {
    int32_t v = (int32_t)HN(a, 0);
    a->m[(v) * M_ROWS + M_PSER] = -1;
    a_heap_remove_top(a);
    a->st[A_NP]--;
    return v;
}

/* R's oldest live node, or -1 (stale entries skipped). */
static int32_t a_rhead(adapt_t *a) {
    int64_t *st = a->st;
    while (st[A_RHEAD] < st[A_RTAIL]) {
        Py_ssize_t j = amod(st[A_RHEAD], a->rq_cap);
        int64_t v = a->rq[2 * j];
        if (v >= 0 && v < a->n && a->m[(v) * M_ROWS + M_RSTAMP] == a->rq[2 * j + 1])
            return (int32_t)v;
        st[A_RHEAD]++;
    }
    return -1;
}

/* Room for one more entry in R's ring: when full, keep only the live entries, in order. */
static void a_rroom(adapt_t *a) {
    int64_t *st = a->st;
    if (st[A_RTAIL] - st[A_RHEAD] < a->rq_cap)
        return;
    int64_t w = st[A_RHEAD];
    for (int64_t x = st[A_RHEAD]; x < st[A_RTAIL]; x++) {
        if (x + R_AHEAD < st[A_RTAIL]) {  /* (as in a_protect's compaction) */
            int64_t u = a->rq[2 * amod(x + R_AHEAD, a->rq_cap)];
            if (u >= 0 && u < a->n)
                AHEAD(&a->m[u * M_ROWS + M_RSTAMP], 0);
        }
        Py_ssize_t j = amod(x, a->rq_cap);
        int64_t v = a->rq[2 * j], s = a->rq[2 * j + 1];
        if (v >= 0 && v < a->n && a->m[(v) * M_ROWS + M_RSTAMP] == s) {
            Py_ssize_t k = amod(w++, a->rq_cap);
            a->rq[2 * k] = v;
            a->rq[2 * k + 1] = s;
        }
    }
    st[A_RTAIL] = w;
}

/* adapt_push(M, F, R, H, T, bits, st, hits, nodes, levels, hold, unit, far1, far2, span, ghost, due):
   a release of `nodes` (int32, deepest first) joins R at its newest end, each with its block
   serial, its release, and its priority for P: (release + bonus) * span + level, the bonus
   being `gaps`' (unit * hold[uses], none for one earlier use whose last gap exceeds far1, or two
   beyond far2; runtime/cache/policies/gaps.py). A node queued in P is taken out first. */
static PyObject *adapt_push(PyObject *self, PyObject *args) {
    PyObject *o[13];
    double unit, far1, far2;
    long long span;
    bufs bv;
    adapt_t a;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOdddLOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                          &o[9], &o[10], &unit, &far1, &far2, &span, &o[11], &o[12]))
        return NULL;
    if (adapt_take(&bv, &a, "adapt_push", "QBQQQBQiiqqQQ", o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8],
                   o[9], o[10], o[11], o[12]) < 0)
        return NULL;
    if (bv.b[11].shape[0] != a.n || bv.b[12].shape[0] != a.rs) {
        PyErr_SetString(PyExc_ValueError, "adapt_push: one last gap per node, one due release per block serial");
        drop_bufs(&bv);
        return NULL;
    }
    a.due = bv.b[12].buf;
    int64_t *ghost = bv.b[11].buf;
    const int32_t *nodes = bv.b[8].buf;
    Py_ssize_t k = bv.b[8].shape[0], nlev = bv.b[9].shape[0], nhold = bv.b[10].shape[0];
    const int64_t *levels = bv.b[9].buf;
    const double *hold = bv.b[10].buf;
    int64_t *st = a.st;
    PyObject *res = NULL;
    for (Py_ssize_t i = 0; i < k; i++)
        if (nodes[i] < 0 || nodes[i] >= a.n) {
            PyErr_SetString(PyExc_IndexError, "adapt_push: node id out of range");
            goto done;
        }
    if (nlev < 1 || nhold < 1 || span < 1 || k >= a.rs / 2) {
        PyErr_SetString(PyExc_ValueError, "adapt_push: no levels, or a release larger than the ring of serials");
        goto done;
    }
    int64_t now = st[A_CLOCK], s0 = st[A_SERIAL];
    Py_ssize_t j = amod(now, a.rt);
    a.tstart[j] = s0;
    a.tlen[j] = k;
    a.talive[j] = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        a_xout(&a, s0 + i);
        a.bits[amod(s0 + i, a.rs)] = 0;
    }
    int64_t low = a.low;
    st[A_CLOCK] = now + 1;
    st[A_SERIAL] = s0 + k;
    a_advance(&a, low);
    /* the boundary release about to leave the rings: start counting from a later one */
    if (st[A_TB] < now + 2 - a.rt || (st[A_TB] < now && !a_tracked(&a, st[A_TB]))) {
        int64_t tb = st[A_TB];
        while (tb < now && !a_tracked(&a, tb))
            tb++;
        st[A_TB] = tb;
        st[A_ABOVE] = 0;
        for (int64_t t = tb; t <= now; t++)
            st[A_ABOVE] += a_alive(&a, t);
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        int32_t v = nodes[i];
        if (i + R_AHEAD < k) {  /* (what is read and written of a node a few on: a host tier's are scattered) */
            int32_t w = nodes[i + R_AHEAD];
            AHEAD(&a.m[w * M_ROWS], 1);
            AHEAD(&a.m[w * M_ROWS + M_ROWS - 1], 1);
            AHEAD(&a.exited[3 * w], 1);
            AHEAD(&a.hits[w], 0);
            AHEAD(&ghost[w], 1);
        }
        a_qout(&a, v);
        if (a.m[(v) * M_ROWS + M_PSER] >= 0) {  /* queued in P: out of it, used again */
            a.m[(v) * M_ROWS + M_PSER] = -1;
            st[A_NP]--;
            a_reenter(&a, v);
        }
        a.exited[3 * (v)] = 0;  /* (a node id freed and used again: its old exit stays counted) */
        if (a.parked[3 * (v)]) {
            a.parked[3 * (v)] = 0;
            st[A_NPARK]--;
        }
        int32_t h = a.hits[v] < 0 ? 0 : a.hits[v];
        int64_t lv = levels[h < nlev ? h : nlev - 1];
        int32_t u = h < nhold ? h : (int32_t)(nhold - 1);
        double hd = hold[u];
        int64_t gap = ghost[v];
        if ((u == 1 && (double)gap > far1) || (u == 2 && (double)gap > far2))
            hd = 0.0;
        int64_t due = now + (unit > 0 ? (int64_t)(unit * hd) : 0);
        a.m[(v) * M_ROWS + M_PRIO] = due * span + lv;
        a_qin(&a, v, span);
        ghost[v] = -1;
        a.m[(v) * M_ROWS + M_REL] = now;
        a.m[(v) * M_ROWS + M_BSER] = s0 + i;
        a.m[(v) * M_ROWS + M_RSTAMP] = s0 + i;
        a_rroom(&a);
        Py_ssize_t q = amod(st[A_RTAIL]++, a.rq_cap);
        a.rq[2 * q] = v;
        a.rq[2 * q + 1] = s0 + i;
    }
    a_fix(&a);
    a_frontier(&a);
    res = Py_None;
    Py_INCREF(res);
done:
    drop_bufs(&bv);
    return res;
}

/* adapt_front(M, F, R, H, T, bits, st, hits, nodes, span, due): `nodes` (int32, none queued)
   become the next ones R hands out, in this order (the last one queued first); a node that was
   a live exit (popped, then parked) is one no longer. */
static PyObject *adapt_front(PyObject *self, PyObject *args) {
    PyObject *o[10];
    long long span;
    bufs bv;
    adapt_t a;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOLO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &span,
                          &o[9]))
        return NULL;
    if (adapt_take(&bv, &a, "adapt_front", "QBQQQBQinQ", o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8],
                   o[9]) < 0)
        return NULL;
    if (bv.b[9].shape[0] != a.rs || span < 1) {
        drop_bufs(&bv);
        PyErr_SetString(PyExc_ValueError, "adapt_front: one due release per block serial of the ring, span >= 1");
        return NULL;
    }
    a.due = bv.b[9].buf;
    const int32_t *nodes = bv.b[8].buf;
    int64_t *st = a.st;
    for (Py_ssize_t i = bv.b[8].shape[0]; i-- > 0;) {
        int32_t v = nodes[i];
        a_reenter(&a, v);
        a_rroom(&a);
        int64_t s = st[A_FSTAMP]++;
        Py_ssize_t q = amod(--st[A_RHEAD], a.rq_cap);
        a.rq[2 * q] = v;
        a.rq[2 * q + 1] = s;
        a.m[(v) * M_ROWS + M_RSTAMP] = s;
        a_qout(&a, v);
        a_qin(&a, v, span);
    }
    a_fix(&a);
    a_frontier(&a);
    drop_bufs(&bv);
    Py_RETURN_NONE;
}

/* adapt_discard(M, F, R, H, T, bits, st, hits, nodes, turnover, due) -> (queued, long, gains, lead):
   `nodes` (int32) are matched: out of R and P. Of those queued, how many, and how many were
   released more than `turnover` releases ago; of those that were live exits (in P, or parked),
   how many LRU would not have held: blocks served that LRU would have missed; and of those
   queued, how many more `gaps`' order with no budget would have held (due at F or later) than
   LRU (in R, or a live exit LRU holds). */
static PyObject *adapt_discard(PyObject *self, PyObject *args) {
    PyObject *o[10];
    double turnover;
    bufs bv;
    adapt_t a;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOdO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                          &turnover, &o[9]))
        return NULL;
    if (adapt_take(&bv, &a, "adapt_discard", "QBQQQBQinQ", o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8],
                   o[9]) < 0)
        return NULL;
    if (bv.b[9].shape[0] != a.rs) {
        drop_bufs(&bv);
        PyErr_SetString(PyExc_ValueError, "adapt_discard: one due release per block serial of the ring");
        return NULL;
    }
    a.due = bv.b[9].buf;
    const int32_t *nodes = bv.b[8].buf;
    int64_t *st = a.st;
    Py_ssize_t queued = 0, lng = 0, gains = 0, lead = 0, k = bv.b[8].shape[0];
    a_window_t w = a_window(&a);
    for (Py_ssize_t i = 0; i < k; i++) {
        int32_t v = nodes[i];
        int lru = a.exited[3 * (v)] && a_in_lru(&w, a.m[(v) * M_ROWS + M_REL], a.m[(v) * M_ROWS + M_BSER]);
        gains += a.exited[3 * (v)] && !lru;
        if (a.m[(v) * M_ROWS + M_QDUE] >= 0)
            lead += (a.m[(v) * M_ROWS + M_QDUE] >= st[A_F]) - (lru || a.m[(v) * M_ROWS + M_RSTAMP] >= 0);
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        int32_t v = nodes[i];
        int in_p = a.m[(v) * M_ROWS + M_PSER] >= 0;
        if (in_p || a.m[(v) * M_ROWS + M_RSTAMP] >= 0) {
            queued++;
            lng += (double)(st[A_CLOCK] - a.m[(v) * M_ROWS + M_REL]) > turnover;
        }
        a_qout(&a, v);
        a_reenter(&a, v);
        if (in_p) {
            a.m[(v) * M_ROWS + M_PSER] = -1;
            st[A_NP]--;
        }
        a.m[(v) * M_ROWS + M_RSTAMP] = -1;
    }
    a_fix(&a);
    a_frontier(&a);
    drop_bufs(&bv);
    return Py_BuildValue("nnnn", queued, lng, gains, lead);
}

/* adapt_missed(M, F, R, H, T, bits, st, hits, ages, depth, due) -> (losses, lead, reused): a
   request missed its blocks from `depth` on, whose keys were last used ages[j] releases ago
   (int64; -1: never, as far as is known); `reused` is how many of them up to the last one whose
   key is remembered (a prefix is used whenever a deeper block is): reuse the cache lost, whatever
   order it follows. Each that is a live exit is one no longer (it is computed again); those LRU
   would have held are counted (blocks LRU would have served that this cache did not), and
   `lead` is how many more of them `gaps`' order with no budget would have held (evicted with a
   bonus due at F or later: due, int64 per block serial modulo its length, the release it is
   counted at) than LRU. */
static PyObject *adapt_missed(PyObject *self, PyObject *args) {
    PyObject *o[10];
    Py_ssize_t depth;
    bufs bv;
    adapt_t a;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &depth,
                          &o[9]))
        return NULL;
    if (adapt_take(&bv, &a, "adapt_missed", "QBQQQBQiqq", o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8],
                   o[9]) < 0)
        return NULL;
    if (bv.b[9].shape[0] != a.rs) {
        drop_bufs(&bv);
        PyErr_SetString(PyExc_ValueError, "adapt_missed: one due release per block serial of the ring");
        return NULL;
    }
    const int64_t *ages = bv.b[8].buf;
    a.due = bv.b[9].buf;
    int64_t clock = a.st[A_CLOCK], f = a.st[A_F];
    Py_ssize_t losses = 0, lead = 0, reused = 0, k = bv.b[8].shape[0];
    a_window_t w = a_window(&a);
    for (Py_ssize_t j = k; j-- > 0;)
        if (ages[j] >= 0) {
            reused = j + 1;
            break;
        }
    for (int pass = 0; pass < 2; pass++) {  /* counted against the window as it was, then gone */
        for (Py_ssize_t j = 0; j < k; j++) {
            int64_t age = ages[j], d = depth + j;
            if (age < 0)
                continue;
            int64_t t = clock - age;
            if (!a_tracked(&a, t))
                continue;
            Py_ssize_t r = amod(t, a.rt);
            if (d >= a.tlen[r])
                continue;
            int64_t s = a.tstart[r] + a.tlen[r] - 1 - d;  /* released deepest first */
            uint8_t b = a.bits[amod(s, a.rs)];
            if (!b)
                continue;
            if (pass) {
                a_dies(&a, t, s);
            } else {
                int lru = a_in_lru(&w, t, s);
                losses += lru;
                lead += ((b & 2) && a.due[amod(s, a.rs)] >= f) - lru;
            }
        }
    }
    a_fix(&a);
    a_frontier(&a);
    drop_bufs(&bv);
    return Py_BuildValue("nnn", losses, lead, reused);
}

/* Has node p no more than `taken` children (those taken so far, all of them, as the walk stops
   past `taken`)? */
static int a_all_taken(const int32_t *child, const int32_t *next, int32_t p, int32_t taken, Py_ssize_t n) {
    int32_t seen = 0;
    for (int32_t c = child[p]; c >= 0 && c < n; c = next[c])
        if (++seen > taken)
            return 0;
    return 1;
}

/* Ask for what a pop reads of the node R's entry x holds (its records, parent, device children,
   children taken, exit mark), R_AHEAD entries before it is R's oldest: most victims are R's, in
   R's order, their nodes scattered in memory, and each victim's reads waited for memory in turn
   (an entry gone stale meanwhile asks for nothing it uses: harmless). */
static inline void r_ahead(const adapt_t *a, int64_t x, const int32_t *parent, const int32_t *ndev,
                           const int32_t *taken_children) {
    int64_t v = a->rq[2 * amod(x, a->rq_cap)];
    if (v < 0 || v >= a->n)
        return;
    AHEAD(&a->m[v * M_ROWS], 1);
    AHEAD(&a->m[v * M_ROWS + M_ROWS - 1], 1);
    AHEAD(&parent[v], 0);
    AHEAD(&ndev[v], 0);
    AHEAD(&taken_children[v], 1);
    AHEAD(&a->exited[3 * v], 1);
}

/* adapt_pop(M, F, R, H, T, bits, st, hits, out, k, budget, span, f, parent_row, ndev_row, child_row, next_row,
   scratch, due) -> taken: up to k victims into out (int32), as k single pops would take them; it stops after
   a victim whose parent, not queued, is left without device children, or (child_row >= 0: a host
   tier's queue, whose nodes are dropped) without any children once the victims so far are gone,
   per the child and sibling links of f's rows child_row and next_row: the cache may queue that
   parent at the front, to go next, and a pop cannot be undone. While P holds more than `budget` nodes its
   lowest goes; otherwise R's oldest node, if it has a bonus, joins P when P has room (or when
   P's lowest ranks below it, that one goes first), and the victim is the lower of R's oldest
   (ranked by its release alone: release * span + level) and P's lowest (ranked with its bonus):
   `gaps`' order, with P capped at `budget` nodes. A victim the cache will park (a device child
   of its, per the node matrix f's rows, is not among the victims before it) stays a block this
   cache holds: counted with P's (`scratch`, int32 zeros, one per node, counts children taken
   in the run; left zero). */
static PyObject *adapt_pop(PyObject *self, PyObject *args) {
    PyObject *o[12];
    Py_ssize_t k;
    long long budget, span;
    long prow, nrow, crow, xrow;
    bufs bv;
    adapt_t a;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnLLOllllOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &o[8],
                          &k, &budget, &span, &o[9], &prow, &nrow, &crow, &xrow, &o[10], &o[11]))
        return NULL;
    if (adapt_take(&bv, &a, "adapt_pop", "QBQQQBQiImIQ", o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9],
                   o[10], o[11]) < 0)
        return NULL;
    if (bv.b[11].shape[0] != a.rs) {
        drop_bufs(&bv);
        PyErr_SetString(PyExc_ValueError, "adapt_pop: one due release per block serial of the ring");
        return NULL;
    }
    a.due = bv.b[11].buf;
    if (k < 0 || k > bv.b[8].shape[0] || span < 1 || bv.b[9].shape[1] != a.n || bv.b[10].shape[0] != a.n ||
        row_index(prow, &bv.b[9]) < 0 || row_index(nrow, &bv.b[9]) < 0 ||
        (crow >= 0 && (row_index(crow, &bv.b[9]) < 0 || row_index(xrow, &bv.b[9]) < 0))) {
        drop_bufs(&bv);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "adapt_pop: need int32 room for k nodes in out, span >= 1, and a node "
                                              "matrix and scratch of n columns");
        return NULL;
    }
    const int32_t *parent = (const int32_t *)bv.b[9].buf + prow * a.n, *ndev = (const int32_t *)bv.b[9].buf + nrow * a.n;
    const int32_t *child = crow >= 0 ? (const int32_t *)bv.b[9].buf + crow * a.n : NULL,
                  *next = crow >= 0 ? (const int32_t *)bv.b[9].buf + xrow * a.n : NULL;
    int32_t *taken_children = bv.b[10].buf;
    int32_t *out = bv.b[8].buf;
    int64_t *st = a.st;
    Py_ssize_t taken = 0;
    Py_ssize_t held = 0;
    /* a victim that still has a device child (not among the victims before it) would be parked
       by the cache: P keeps it instead, ranked last, until its children are gone; at most
       A_HOLD_MAX of them between two victims (as many as one single pop keeps), so that a P of
       nothing else still gives up a victim, the same one a single pop would */
#define VICTIM(x) do { \
        int32_t v_ = (x); \
        a_qout(&a, v_); \
        if (ndev[v_] > taken_children[v_] && held++ < A_HOLD_MAX) { \
            a.m[(v_) * M_ROWS + M_PRIO] = st[A_PMAX]; \
            a_protect(&a, v_); \
            a_qin(&a, v_, span); \
        } else { \
            held = 0; \
            out[taken++] = v_; \
            if (ndev[v_] > taken_children[v_]) { a.parked[3 * (v_)] = 1; st[A_NPARK]++; } \
            else { \
                a_evicted(&a, v_, span); \
                if (parent[v_] >= 0 && parent[v_] < a.n) { \
                    int32_t p_ = parent[v_]; \
                    int32_t c_ = ++taken_children[p_]; \
                    stop = a.m[p_ * M_ROWS + M_RSTAMP] < 0 && a.m[p_ * M_ROWS + M_PSER] < 0 && \
                           (c_ == ndev[p_] || (child && a_all_taken(child, next, p_, c_, a.n))); \
                } \
            } \
        } \
    } while (0)
    int stop = 0;  /* the last victim left its parent, not queued, without device children */
    while (taken < k && !stop) {
        if (st[A_RHEAD] + R_AHEAD < st[A_RTAIL])
            r_ahead(&a, st[A_RHEAD] + R_AHEAD, parent, ndev, taken_children);
        Py_ssize_t p = a_ptop(&a);
        if (p >= 0 && st[A_NP] > budget) {
            VICTIM(a_unprotect_top(&a));
            a_fix(&a);
            continue;
        }
        int32_t r = a_rhead(&a);
        if (r < 0) {
            if (p < 0)
                break;
            VICTIM(a_unprotect_top(&a));
            a_fix(&a);
            continue;
        }
        int64_t pr = a.m[(r) * M_ROWS + M_PRIO];
        int64_t base = a.m[(r) * M_ROWS + M_REL] * span + amod(pr, span);
        if (pr > base) {  /* a bonus: P keeps it if it has room, or once its lowest is gone */
            if (st[A_NP] < budget) {
                st[A_RHEAD]++;
                a.m[(r) * M_ROWS + M_RSTAMP] = -1;
                a_exit(&a, r);
                a_protect(&a, r);
                a_fix(&a);
                continue;
            }
            if (p >= 0 && HK(&a, 0) < pr) {
                VICTIM(a_unprotect_top(&a));
                a_fix(&a);
                continue;
            }
        } else if (p >= 0 && HK(&a, 0) < base) {
            VICTIM(a_unprotect_top(&a));
            a_fix(&a);
            continue;
        }
        st[A_RHEAD]++;
        a.m[(r) * M_ROWS + M_RSTAMP] = -1;
        a_exit(&a, r);
        VICTIM(r);
        a_fix(&a);
    }
#undef VICTIM
    for (Py_ssize_t i = 0; i < taken; i++) {
        int32_t v = out[i];
        taken_children[v] = 0;
        if (parent[v] >= 0 && parent[v] < a.n)
            taken_children[parent[v]] = 0;
    }
    a_fix(&a);
    a_frontier(&a);
    drop_bufs(&bv);
    return PyLong_FromSsize_t(taken);
}

/* ---- the `adaptive` policy's memory of blocks gone from the cache: per 16-byte block key, two
   slots (its first 8 bytes masked, and the same shifted right by 32, masked), each a uint64
   record: bits 0-31 the release the block was last used at, 32-39 its uses (saturating), 40-47
   a tag (the key's 9th byte), bit 48 set when written. A key's record is the newer of its two
   slots whose tag matches: a slot shared with another key loses one of them, and a tag that
   matches by chance can only make a block look used more recently. */
static inline uint64_t g_slot0(const unsigned char *k) {
    uint64_t x;
    memcpy(&x, k, 8);
    return x;
}

/* Ask for the two table slots `key` (if a 16-byte key) will read or write, ahead of the access:
   the table is far larger than the CPU's caches and each slot is a wait for memory; asked for
   G_AHEAD keys ahead, the waits of a run of keys overlap (adapt_forget: ~0.8x the time per key;
   adapt_recall: its reads wait less too, measured in docs/benchmarks.md). */
#define G_AHEAD 8
static inline void g_slots_ahead(PyObject *key, const uint64_t *table, Py_ssize_t slots, uint64_t mask, int write) {
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != 16)
        return;
    uint64_t h = g_slot0((const unsigned char *)PyBytes_AS_STRING(key));
    if (write) {
        AHEAD(&table[h & mask], 1);
        AHEAD(&table[slots + ((h >> 32) & mask)], 1);
    } else {
        AHEAD(&table[h & mask], 0);
        AHEAD(&table[slots + ((h >> 32) & mask)], 0);
    }
}

/* adapt_forget's work once its arguments are checked: m (n nodes' records), hits, the table of
   2 rows of `slots`, the keys (a list or tuple: keys[i] if aligned, else keys[node]). */
static void forget_core(const int64_t *m, Py_ssize_t n, const int32_t *hits, uint64_t *table, Py_ssize_t slots,
                        PyObject *fast, const int32_t *nodes, Py_ssize_t k, int aligned) {
    uint64_t mask = (uint64_t)slots - 1;
    for (Py_ssize_t i = 0; i < k; i++) {
        /* (the key object, release and uses of the node 2 * G_AHEAD on, the slots of the one G_AHEAD on) */
        if (i + 2 * G_AHEAD < k) {
            int32_t w = nodes[i + 2 * G_AHEAD];
            if (w >= 0 && w < n) {
                AHEAD(PySequence_Fast_GET_ITEM(fast, aligned ? i + 2 * G_AHEAD : w), 0);
                AHEAD(&m[(Py_ssize_t)w * M_ROWS + M_REL], 0);
                if (!aligned)
                    AHEAD(&hits[w], 0);
            }
        }
        if (i + G_AHEAD < k) {
            int32_t w = nodes[i + G_AHEAD];
            if (w >= 0 && w < n)
                g_slots_ahead(PySequence_Fast_GET_ITEM(fast, aligned ? i + G_AHEAD : w), table, slots, mask, 1);
        }
        int32_t v = nodes[i];
        if (v < 0 || v >= n)
            continue;
        PyObject *key = PySequence_Fast_GET_ITEM(fast, aligned ? i : v);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != 16)
            continue;  /* (not a block key: nothing to remember) */
        const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(key);
        int32_t hv = hits[aligned ? i : v];
        uint64_t h = g_slot0(b), uses = hv < 0 ? 1 : (uint64_t)hv + 1;
        uint64_t rec = ((uint64_t)m[(Py_ssize_t)v * M_ROWS + M_REL] & 0xffffffffu) | ((uses > 255 ? 255 : uses) << 32) |
                       ((uint64_t)b[8] << 40) | ((uint64_t)1 << 48);
        table[h & mask] = rec;
        table[slots + ((h >> 32) & mask)] = rec;
    }
}

/* adapt_forget(M, hits, table, keys, nodes, aligned): nodes (int32) leave the cache; remember for
   each its key (bytes, 16), its release (M's M_REL) and its uses (hits + 1): keys[i] and hits[i]
   if `aligned` (taken before the nodes were freed), else keys[node] and hits[node] (the node
   keys and the node matrix's row). */
static PyObject *adapt_forget(PyObject *self, PyObject *args) {
    PyObject *mobj, *hobj, *tobj, *keys, *nobj;
    int aligned;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OOOOOp", &mobj, &hobj, &tobj, &keys, &nobj, &aligned))
        return NULL;
    if (take_bufs(&bv, "adapt_forget", "qiQi", mobj, hobj, tobj, nobj) < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(keys, "adapt_forget: keys must be a sequence");
    PyObject *res = NULL;
    if (fast == NULL)
        goto done;
    Py_ssize_t k = bv.b[3].shape[0], n = bv.b[0].shape[0] / M_ROWS, slots = bv.b[2].shape[0] / 2;
    if (PySequence_Fast_GET_SIZE(fast) != (aligned ? k : n) || bv.b[1].shape[0] != (aligned ? k : n) || slots < 1 ||
        (slots & (slots - 1))) {
        PyErr_SetString(PyExc_ValueError, "adapt_forget: a key per node (or per node id), and a table of 2 rows of 2**k slots");
        goto done;
    }
    const int64_t *m = bv.b[0].buf;
    const int32_t *hits = bv.b[1].buf, *nodes = bv.b[3].buf;
    uint64_t *table = bv.b[2].buf;
    forget_core(m, n, hits, table, slots, fast, nodes, k, aligned);
    res = Py_None;
    Py_INCREF(res);
done:
    Py_XDECREF(fast);
    drop_bufs(&bv);
    return res;
}

/* (M, table, mark) of a remembering policy (or None) into `rv` and `to`, for `ncols` nodes; 0, or
   -1 with an exception. */
static int take_remember(bufs *rv, PyObject *remember, Py_ssize_t ncols, remember_to *to, const char *what) {
    to->m = NULL;
    to->table = NULL;
    to->mark = NULL;
    to->slots = 0;
    if (remember == Py_None)
        return 0;
    if (!PyTuple_Check(remember) || PyTuple_GET_SIZE(remember) != 3) {
        PyErr_Format(PyExc_TypeError, "%s: remember must be None or (M, table, mark)", what);
        return -1;
    }
    if (take_bufs(rv, what, "qQB", PyTuple_GET_ITEM(remember, 0), PyTuple_GET_ITEM(remember, 1),
                  PyTuple_GET_ITEM(remember, 2)) < 0)
        return -1;
    Py_ssize_t slots = rv->b[1].shape[0] / 2;
    if (rv->b[0].shape[0] != M_ROWS * ncols || slots < 1 || (slots & (slots - 1)) || rv->b[2].shape[0] < 1) {
        PyErr_Format(PyExc_ValueError, "%s: M_ROWS records per node and a table of 2 rows of 2**k slots", what);
        return -1;
    }
    to->m = rv->b[0].buf;
    to->table = rv->b[1].buf;
    to->mark = rv->b[2].buf;
    to->slots = slots;
    return 0;
}

/* drop_chains(f, cand, rows, reset, node_keys, kmap, devs, stack, at, ids, policy, gpu, pos, remember)
   -> freed parents, or None: an eviction run without a host tier in one call, where it is the
   usual run (`Eviction._drop_batched`: chain_tops, `_first_trigger`, the policy's forget and
   drop_run, a C call and Python glue each). The run `cand` (int32 node ids, as popped) goes whole
   if it is whole chains released deepest first (each node's only device child right before it,
   chain_tops) and no chain's top leaves its parent, not queued in `policy` (`p in policy`), an
   unreferenced GPU node without device children before the run's last node (one-at-a-time
   eviction would take that parent next: `_first_trigger` cuts the run there); otherwise nothing
   is changed and None is returned, for the general path. Going: with `remember` = (M, table,
   mark) (a remembering policy's records and table, adapt_forget, and a uint8 it finds set once
   anything is remembered) their keys, releases and uses are remembered first; then drop_run frees them (ids, devs, stack from `at`). rows = (PARENT,
   CHILD, NEXT, PREV, CONT, NDEV, DEV, STATE, REF, HITS); `pos` (int32, one per node, all -1)
   counts the tops per parent and is left as it was. */
static PyObject *drop_chains(PyObject *self, PyObject *args) {
    PyObject *fobj, *cobj, *rows, *reset, *node_keys, *kmap, *devs, *sobj, *ids, *policy, *pobj, *remember;
    Py_ssize_t at;
    long gpu;
    bufs bv, rv;
    rv.n = 0;
    if (!PyArg_ParseTuple(args, "OOOOO!O!O!OnOOlOO", &fobj, &cobj, &rows, &reset, &PyList_Type, &node_keys,
                          &PyDict_Type, &kmap, &PyList_Type, &devs, &sobj, &at, &ids, &policy, &gpu, &pobj, &remember))
        return NULL;
    if (ids != Py_None && !PyList_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "drop_chains: ids must be a list or None");
        return NULL;
    }
    if (take_bufs(&bv, "drop_chains", "MnII", fobj, cobj, sobj, pobj) < 0)
        return NULL;
    PyObject *res = NULL;
    int32_t *par = NULL;
    Py_ssize_t *tix = NULL;
    const Py_buffer *f = &bv.b[0];
    Py_ssize_t nrows = f->shape[0], ncols = f->shape[1], m = bv.b[1].shape[0], ntop = 0;
    long r[10];
    int32_t reset_v[MAX_ROWS];
    if (row_tuple(rows, 10, f, r, "drop_chains") < 0 || reset_column(reset, f, reset_v, "drop_chains") < 0)
        goto done;
    if (PyList_GET_SIZE(node_keys) < ncols || bv.b[3].shape[0] != ncols) {
        PyErr_SetString(PyExc_ValueError, "drop_chains: a key slot and a pos slot per node");
        goto done;
    }
    if (at < 0 || at + m > bv.b[2].shape[0]) {
        PyErr_SetString(PyExc_IndexError, "drop_chains: the free-id stack overflows");
        goto done;
    }
    remember_to to;
    if (take_remember(&rv, remember, ncols, &to, "drop_chains") < 0)
        goto done;
    int32_t *M = f->buf, *pos = bv.b[3].buf;
    const int32_t *cand = bv.b[1].buf, *PARENT = M + r[0] * ncols, *NDEV = M + r[5] * ncols,
                  *STATE = M + r[7] * ncols, *REF = M + r[8] * ncols, *HITS = M + r[9] * ncols;
    if (!m) {
        res = PyList_New(0);
        goto done;
    }
    par = PyMem_New(int32_t, m);
    tix = PyMem_New(Py_ssize_t, m);
    if (par == NULL || tix == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* whole chains released deepest first (chain_tops), every parent a node */
    for (Py_ssize_t i = 0; i < m; i++) {
        par[i] = PARENT[cand[i]];
        if (par[i] < 0 || par[i] >= ncols || NDEV[cand[i]] != (i && par[i - 1] == cand[i]))
            goto general;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        if (i == m - 1 || par[i] != cand[i + 1])
            tix[ntop++] = i;
    if (tops_in_range(M, ncols, r, cand, tix, ntop, "drop_chains") < 0)
        goto done;
    /* `_first_trigger`: a top's parent left without device children before the run's end */
    if (!(ntop == 1 && (NDEV[par[tix[0]]] > 1 || STATE[par[tix[0]]] != gpu || REF[par[tix[0]]]))) {
        int cut = 0, err = 0;
        for (Py_ssize_t j = 0; j < ntop; j++) {
            int32_t p = par[tix[j]];
            pos[p] = pos[p] < 0 ? 1 : pos[p] + 1;
        }
        for (Py_ssize_t j = ntop; j-- > 0 && !cut && !err;) {  /* each parent once, at its last top */
            int32_t p = par[tix[j]], c = pos[p];
            if (c < 0)
                continue;
            pos[p] = -2;
            if (NDEV[p] == c && STATE[p] == gpu && REF[p] == 0 && tix[j] + 1 < m) {
                int q = queued(policy, p);
                if (q < 0)
                    err = 1;
                else if (!q)
                    cut = 1;
            }
        }
        for (Py_ssize_t j = 0; j < ntop; j++)
            pos[par[tix[j]]] = -1;
        if (err)
            goto done;
        if (cut)
            goto general;
    }
    if (to.table != NULL) {
        forget_core(to.m, ncols, HITS, to.table, to.slots, node_keys, cand, m, 0);
        to.mark[0] = 1;
    }
    res = drop_run_core(M, nrows, ncols, r, reset_v, cand, par, m, tix, ntop, node_keys, kmap, devs,
                        (int32_t *)bv.b[2].buf + at, ids);
    goto done;
general:
    res = Py_None;
    Py_INCREF(res);
done:
    PyMem_Free(par);
    PyMem_Free(tix);
    drop_bufs(&rv);
    drop_bufs(&bv);
    return res;
}

/* adapt_recall(table, keys, start, clock, ages, uses): for keys[start:], how many releases before
   `clock` each was last used (ages, int64; -1: not remembered) and by how many requests (uses,
   int32; 0 if not remembered). */
static PyObject *adapt_recall(PyObject *self, PyObject *args) {
    PyObject *tobj, *keys, *aobj, *uobj;
    Py_ssize_t start;
    long long clock;
    bufs bv;
    if (!PyArg_ParseTuple(args, "OOnLOO", &tobj, &keys, &start, &clock, &aobj, &uobj))
        return NULL;
    if (take_bufs(&bv, "adapt_recall", "qQ=I", tobj, aobj, uobj) < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(keys, "adapt_recall: keys must be a sequence");
    PyObject *res = NULL;
    if (fast == NULL)
        goto done;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast) - start, slots = bv.b[0].shape[0] / 2;
    if (start < 0 || k < 0 || bv.b[1].shape[0] < k || slots < 1 || (slots & (slots - 1))) {
        PyErr_SetString(PyExc_ValueError, "adapt_recall: room for every key from start, a table of 2 rows of 2**k slots");
        goto done;
    }
    const uint64_t *table = bv.b[0].buf, mask = (uint64_t)slots - 1;
    int64_t *ages = bv.b[1].buf;
    int32_t *uses = bv.b[2].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (i + G_AHEAD < k)
            g_slots_ahead(PySequence_Fast_GET_ITEM(fast, start + i + G_AHEAD), table, slots, mask, 0);
        PyObject *key = PySequence_Fast_GET_ITEM(fast, start + i);
        ages[i] = -1;
        uses[i] = 0;
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != 16)
            continue;
        const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(key);
        uint64_t h = g_slot0(b), best = 0;
        uint64_t r[2] = {table[h & mask], table[slots + ((h >> 32) & mask)]};
        int64_t newest = -1;
        for (int j = 0; j < 2; j++) {
            if (!(r[j] >> 48 & 1) || ((r[j] >> 40) & 0xff) != b[8])
                continue;
            /* the release, back to 64 bits: the latest one at or before clock with these low bits */
            int64_t t = (int64_t)(((uint64_t)clock & ~(uint64_t)0xffffffffu) | (r[j] & 0xffffffffu));
            if (t > clock)
                t -= (int64_t)1 << 32;
            if (t > newest) {
                newest = t;
                best = r[j];
            }
        }
        if (newest >= 0) {
            ages[i] = clock - newest;
            uses[i] = (int32_t)((best >> 32) & 0xff);
        }
    }
    res = Py_None;
    Py_INCREF(res);
done:
    Py_XDECREF(fast);
    drop_bufs(&bv);
    return res;
}

static PyMethodDef methods[] = {
    {"drop_chains", drop_chains, METH_VARARGS, "drop_chains(f, cand, rows, reset, node_keys, kmap, devs, stack, at, ids, policy, gpu, pos, remember)"},
    {"adapt_forget", adapt_forget, METH_VARARGS, "adapt_forget(M, hits, table, keys, nodes, aligned)"},
    {"adapt_recall", adapt_recall, METH_VARARGS, "adapt_recall(table, keys, start, clock, ages, uses)"},
    {"adapt_push", adapt_push, METH_VARARGS,
     "adapt_push(M, F, R, H, T, bits, st, hits, nodes, levels, hold, unit, far1, far2, span, ghost, due)"},
    {"adapt_front", adapt_front, METH_VARARGS, "adapt_front(M, F, R, H, T, bits, st, hits, nodes, span, due)"},
    {"adapt_discard", adapt_discard, METH_VARARGS,
     "adapt_discard(M, F, R, H, T, bits, st, hits, nodes, turnover, due) -> (queued, long, gains, lead)"},
    {"adapt_missed", adapt_missed, METH_VARARGS, "adapt_missed(M, F, R, H, T, bits, st, hits, ages, depth, due) -> (losses, lead, reused)"},
    {"adapt_pop", adapt_pop, METH_VARARGS, "adapt_pop(M, F, R, H, T, bits, st, hits, out, k, budget, span, f, parent_row, ndev_row, scratch, due) -> taken"},
    {"drop_host_nodes", drop_host_nodes, METH_VARARGS,
     "drop_host_nodes(f, cand, rows, cpu, node_keys, kmap, pos, policy, freed) -> (count, last, leaf)"},
    {"free_host_nodes", free_host_nodes, METH_VARARGS,
     "free_host_nodes(f, nodes, task, stack, hosts, at, h_at, host_row, reset, node_keys)"},
    {"finish_swap_out", finish_swap_out, METH_VARARGS,
     "finish_swap_out(f, nodes, task, task_id, rows, swap2cpu, cpu) -> devs or None"},
    {"drop_host_run", drop_host_run, METH_VARARGS,
     "drop_host_run(f, cand, rows, cpu, reset, node_keys, kmap, hosts, h_at, stack, at, policy, gone, remember) -> (cut, leaf) or None"},
    {"mark_swap_out", mark_swap_out, METH_VARARGS,
     "mark_swap_out(f, vs, task, hosts, victims, devs, at, rows, swap2cpu, task_id, node_keys, victim_keys)"},
    {"swap_chains", swap_chains, METH_VARARGS, "swap_chains(f, cand, rows, gpu, policy, pos) -> cut or None"},
    {"mark_chains", mark_chains, METH_VARARGS,
     "mark_chains(f, vs, task, hosts, victims, devs, at, rows, swap2cpu, task_id, node_keys, victim_keys, gpu) -> parents"},
    {"policy_release", policy_release, METH_VARARGS, "policy_release(hits, matched, released, nodes, now) -> lost"},
    {"policy_discard", policy_discard, METH_VARARGS,
     "policy_discard(stamp, released, matched, nodes, clock, turnover) -> (queued, long)"},
    {"give_uses", give_uses, METH_VARARGS,
     "give_uses(f, hits_row, nodes, uses, lo, capped, cap): a running minimum of the capped uses"},
    {"ghost_ages", ghost_ages, METH_VARARGS, "ghost_ages(ghost, nodes, ages): ghost[nodes] = running maximum of ages"},
    {"gaps_rank", gaps_rank, METH_VARARGS,
     "gaps_rank(hits, ghost, prio, stamp, nodes, levels, hold, now, unit, far1, far2, span, serial, heap) -> runs"},
    {"walk", walk, METH_VARARGS, "walk(f, cont_row, parent_row, node_keys, kmap, keys, limit, out) -> matched"},
    {"stamp_runs", stamp_runs, METH_VARARGS, "stamp_runs(stamp, nodes, level, serial) -> run starts"},
    {"pop_live", pop_live, METH_VARARGS, "pop_live(heap, stamp, k, out) -> (taken, dropped)"},
    {"chain_tops", chain_tops, METH_VARARGS, "chain_tops(f, cand, par, ndev_row) -> tops of a run of whole chains, or None"},
    {"sketch_raise", sketch_raise, METH_VARARGS,
     "sketch_raise(row0, row1, keys, mask, hits, nodes, cap) -> False if a key is not 16 bytes"},
    {"touch_device", touch_device, METH_VARARGS,
     "touch_device(f, path, ref_row, hits_row, state_row, dev_row, gpu[, ids]) -> (unused, blocks) or None"},
    {"deref", deref, METH_VARARGS, "deref(f, path, ref_row, state_row, gpu, out) -> (k, all_gpu)"},
    {"drop_run", drop_run, METH_VARARGS,
     "drop_run(f, drop, par, top, rows, reset, node_keys, kmap, devs, stack, at) -> parents left without device children"},
    {"record_chain", record_chain, METH_VARARGS,
     "record_chain(f, path, stack, top, keys, blocks, n_full, rows, gpu, detached, node_keys, kmap, out) -> "
     "k, 0 (a key in the tree already) or -1 (the parent detached)"},
    {"sketch_add", sketch_add, METH_VARARGS,
     "sketch_add(row0, row1, keys, mask[, stamps0, stamps1, now, ages]) -> False if a key is not 16 bytes "
     "(nothing added); with the stamps, ages (int64) before now"},
    {"sketch_count", sketch_count, METH_VARARGS,
     "sketch_count(row0, row1, keys, mask, out) -> False if a key is not 16 bytes; counts in out (int32)"},
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(token_bytes, block_size, parent) -> keys of the full blocks, chained from parent"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvrt.runtime.cache._cache_core", NULL, -1, methods};

#define XXH_FIX "reinstall the xxhash package from a wheel: pip install --force-reinstall --only-binary=:all: 'xxhash>=3.0'"

/* XXH3_128bits from the xxhash package's extension module (already loaded by the import: dlopen
   returns that image), checked against the package's own xxh3_128_digest; 0, or -1 with an
   ImportError that says what is missing. */
static int load_xxh3_128(void) {
    PyObject *ext = PyImport_ImportModule("xxhash._xxhash");
    if (ext == NULL) {
        PyErr_SetString(PyExc_ImportError,
                        "kvrt.runtime.cache._cache_core: cannot import xxhash._xxhash, the extension module of the xxhash "
                        "package, whose XXH3_128bits computes block keys: pip install 'xxhash>=3.0'");
        return -1;
    }
    PyObject *file = PyObject_GetAttrString(ext, "__file__");
    PyObject *path = file ? PyUnicode_EncodeFSDefault(file) : NULL;
    Py_XDECREF(file);
    if (path == NULL) {
        Py_DECREF(ext);
        PyErr_SetString(PyExc_ImportError, "kvrt.runtime.cache._cache_core: xxhash._xxhash has no file to look XXH3_128bits "
                                           "up in; " XXH_FIX);
        return -1;
    }
    void *image = dlopen(PyBytes_AS_STRING(path), RTLD_NOW | RTLD_LOCAL);
    void *sym = image ? dlsym(image, "XXH3_128bits") : NULL;
    if (sym == NULL) {
        const char *why = dlerror();
        PyErr_Format(PyExc_ImportError, "kvrt.runtime.cache._cache_core: %s does not export XXH3_128bits (%s); " XXH_FIX,
                     PyBytes_AS_STRING(path), why ? why : "not found");
        Py_DECREF(path);
        Py_DECREF(ext);
        return -1;
    }
    Py_DECREF(path);
    xxh3_128 = (kv_xxh3_128)sym;
    /* the same bytes as the package's own digest, or no module: a key must never differ */
    static const char probe[] = "kvrt.prefix-cache.root.v1";
    unsigned char mine[KEY_BYTES];
    canonical128(xxh3_128(probe, sizeof probe - 1), mine);
    PyObject *pkg = PyImport_ImportModule("xxhash");
    PyObject *want = pkg ? PyObject_CallMethod(pkg, "xxh3_128_digest", "y#", probe, (Py_ssize_t)(sizeof probe - 1))
                         : NULL;
    Py_XDECREF(pkg);
    Py_DECREF(ext);
    if (want == NULL)
        return -1;
    int same = PyBytes_Check(want) && PyBytes_GET_SIZE(want) == KEY_BYTES &&
               memcmp(PyBytes_AS_STRING(want), mine, KEY_BYTES) == 0;
    Py_DECREF(want);
    if (!same) {
        PyErr_SetString(PyExc_ImportError, "kvrt.runtime.cache._cache_core: the XXH3_128bits exported by xxhash._xxhash "
                                           "does not give xxhash.xxh3_128_digest's bytes; " XXH_FIX);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__cache_core(void) {
    if (xxh3_128 == NULL && load_xxh3_128() < 0)
        return NULL;
    return PyModule_Create(&module);
}
