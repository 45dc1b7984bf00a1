/* The router's block keys and its match, in C (framework/kv_events/hashing.py says when it is used).

   keys(data, block_size, parent) -> array('Q'): block k's key is SipHash-1-3 (the hash CPython gives bytes) of
   (key k-1 as 8 little-endian bytes, block k's bytes), keyed per process (``seed``), cut to 62 bits; the keys stay
   64-bit words until read, so a prompt of n blocks makes no n int objects.
   match(keys, held_by, candidates, bounds=None) -> {candidate: n}: the leading blocks of ``keys`` each candidate holds,
   by a binary search, for holdings prefix-closed along the keys up to ``bounds[candidate]`` blocks (its first gap on
   the path, kv_view.py's; else all of them).
   deepest(keys, table) -> the deepest of ``keys`` that is a key of the dict ``table``, or None.
   Counts(): a worker's block counts (KvView._held) as a flat table of 64-bit words, key -> count > 0, read like a
   Counter (a missing key counts 0, setting 0 removes it); ``add(keys)`` counts each key of an array('Q') once more.
   match probes it without making an int per probe, and a decision's credit adds its keys without making an int per
   block: an entry is 16 bytes in one array, where a dict probe reads its index, its entry and the key's int object
   (three places in memory, cold after the router's event loop). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define CHAIN_API 4  /* hashing.py refuses another (a build older than this source): bump on any change */

static uint64_t K0, K1;
static PyObject *array_type;  /* array.array */

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND do { \
    v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32); \
    v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2; \
    v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0; \
    v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32); } while (0)

static inline uint64_t le64(const unsigned char *p) {  /* the little-endian word SipHash reads, on any host */
    uint64_t m = 0;
    for (int i = 7; i >= 0; i--)
        m = (m << 8) | p[i];
    return m;
}

static uint64_t block_key(uint64_t parent, const unsigned char *p, Py_ssize_t n) {
    uint64_t v0 = K0 ^ 0x736f6d6570736575ULL, v1 = K1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = K0 ^ 0x6c7967656e657261ULL, v3 = K1 ^ 0x7465646279746573ULL;
    uint64_t total = (uint64_t)n + 8, m, t = 0;
    v3 ^= parent; SIPROUND; v0 ^= parent;
    for (; n >= 8; p += 8, n -= 8) {
        m = le64(p);
        v3 ^= m; SIPROUND; v0 ^= m;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        t |= ((uint64_t)p[i]) << (8 * i);
    t |= total << 56;
    v3 ^= t; SIPROUND; v0 ^= t;
    v2 ^= 0xff; SIPROUND; SIPROUND; SIPROUND;
    return (v0 ^ v1 ^ v2 ^ v3) >> 2;
}

static PyObject *keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "keys(data, block_size, parent) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t b = PyLong_AsSsize_t(args[1]);
    if (b == -1 && PyErr_Occurred())
        return NULL;
    uint64_t h = PyLong_AsUnsignedLongLongMask(args[2]);
    if (h == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    if (b < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", b);
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t n = buf.len / b;  /* full blocks only */
    PyObject *words = PyBytes_FromStringAndSize(NULL, n * 8);
    if (words) {
        uint64_t *out = (uint64_t *)PyBytes_AS_STRING(words);
        const unsigned char *p = buf.buf;
        for (Py_ssize_t i = 0; i < n; i++)
            out[i] = h = block_key(h, p + i * b, b);
    }
    PyBuffer_Release(&buf);
    if (!words)
        return NULL;
    PyObject *arr = PyObject_CallFunction(array_type, "sO", "Q", words);
    Py_DECREF(words);
    return arr;
}


/* Keys given as an array('Q') (keys() makes them), else a TypeError; fills ``kb`` (release it). */
static int keys_buffer(PyObject *obj, Py_buffer *kb, const char *who) {
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: keys must be an array('Q'), as keys() makes them, not %.100s", who,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, kb, PyBUF_FORMAT) < 0)
        return -1;
    if (kb->itemsize != 8 || !kb->format || strcmp(kb->format, "Q") != 0) {
        PyBuffer_Release(kb);
        PyErr_Format(PyExc_TypeError, "%s: keys must be an array('Q'), as keys() makes them", who);
        return -1;
    }
    return 0;
}

/* ---- Counts: open addressing, linear probing, deletion by backward shift (no tombstones); count 0 = an empty slot */
typedef struct {
    uint64_t key;
    int64_t count;
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    Py_ssize_t used;
    int bits;  /* 2**bits slots, at most half used */
} Counts;

static PyTypeObject CountsType;

static inline size_t home(const Counts *t, uint64_t key) {  /* Fibonacci hashing: the top bits of key * 2**64/phi */
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> (64 - t->bits));
}

static Slot *find(const Counts *t, uint64_t key) {  /* the key's slot, or the empty slot where it would go */
    size_t mask = ((size_t)1 << t->bits) - 1, i = home(t, key);
    while (t->slots[i].count && t->slots[i].key != key)
        i = (i + 1) & mask;
    return &t->slots[i];
}

static int resize(Counts *t, int bits) {
    Slot *old = t->slots;
    size_t n = (size_t)1 << t->bits;
    Slot *slots = PyMem_Calloc((size_t)1 << bits, sizeof(Slot));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    t->slots = slots;
    t->bits = bits;
    for (size_t i = 0; i < n; i++)
        if (old[i].count)
            *find(t, old[i].key) = old[i];
    PyMem_Free(old);
    return 0;
}

static int bump(Counts *t, uint64_t key, int64_t by) {  /* count += by, the key new or not (by > 0) */
    Slot *s = find(t, key);
    if (s->count) {
        if (s->count > INT64_MAX - by) {
            PyErr_SetString(PyExc_OverflowError, "Counts: a count past 2**63 - 1");
            return -1;
        }
        s->count += by;
        return 0;
    }
    if ((t->used + 1) * 2 > ((Py_ssize_t)1 << t->bits)) {  /* grow first: a failed grow leaves the table as it was */
        if (resize(t, t->bits + 1) < 0)
            return -1;
        s = find(t, key);
    }
    s->key = key;
    s->count = by;
    t->used++;
    return 0;
}

static void unslot(Counts *t, Slot *s) {  /* empty ``s``, shifting back the entries its own would have blocked */
    size_t mask = ((size_t)1 << t->bits) - 1, i = (size_t)(s - t->slots), j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->slots[j].count)
            break;
        size_t k = home(t, t->slots[j].key);
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j))
            continue;  /* its home is after the hole: it stays */
        t->slots[i] = t->slots[j];
        i = j;
    }
    t->slots[i].count = 0;
    t->used--;
}

static void shrink(Counts *t) {  /* an eighth full: down to a quarter full at most (memory follows what is held) */
    if (t->bits <= 4 || t->used * 8 >= ((Py_ssize_t)1 << t->bits))
        return;
    int bits = 4;
    while (((Py_ssize_t)1 << bits) < t->used * 4)
        bits++;
    if (resize(t, bits) < 0)  /* optional: the larger table stays, consistent, and the deletion done stands */
        PyErr_Clear();
}

static int as_key(PyObject *o, uint64_t *key) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "Counts: a key is an int, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *key = PyLong_AsUnsignedLongLong(o);
    if (*key == (uint64_t)-1 && PyErr_Occurred()) {  /* negative, or past 64 bits: no such block key */
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static PyObject *Counts_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "Counts() takes no arguments");
        return NULL;
    }
    Counts *t = (Counts *)type->tp_alloc(type, 0);
    if (!t)
        return NULL;
    t->bits = 4;
    t->slots = PyMem_Calloc(16, sizeof(Slot));
    if (!t->slots) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void Counts_dealloc(Counts *t) {
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t Counts_len(Counts *t) {
    return t->used;
}

static int Counts_contains(Counts *t, PyObject *o) {
    uint64_t key;
    int r = as_key(o, &key);
    return r <= 0 ? r : find(t, key)->count != 0;
}

static PyObject *Counts_get(Counts *t, PyObject *o) {  /* a missing key counts 0, as in a Counter */
    uint64_t key;
    int r = as_key(o, &key);
    if (r < 0)
        return NULL;
    return PyLong_FromLongLong(r ? find(t, key)->count : 0);
}

static int Counts_set(Counts *t, PyObject *o, PyObject *v) {
    long long n = 0;
    if (v) {  /* the count first, an int only: nothing after this runs Python code that could resize the table */
        if (!PyLong_Check(v)) {
            PyErr_Format(PyExc_TypeError, "Counts: a count is an int, not %.100s", Py_TYPE(v)->tp_name);
            return -1;
        }
        if ((n = PyLong_AsLongLong(v)) == -1 && PyErr_Occurred())
            return -1;
    }
    uint64_t key;
    int r = as_key(o, &key);
    if (r < 0)
        return -1;
    Slot *s = r ? find(t, key) : NULL;
    if (!v) {  /* del */
        if (!s || !s->count) {
            PyErr_SetObject(PyExc_KeyError, o);
            return -1;
        }
        unslot(t, s);
        shrink(t);
        return 0;
    }
    if (n < 0 || !r) {
        PyErr_Format(PyExc_ValueError, "Counts: a count is >= 0 and a key a 64-bit unsigned int, got %R: %R", o, v);
        return -1;
    }
    if (!n) {
        if (s->count) {
            unslot(t, s);
            shrink(t);
        }
        return 0;
    }
    if (s->count) {
        s->count = n;
        return 0;
    }
    return bump(t, key, n);
}

static PyObject *Counts_add(Counts *t, PyObject *keys) {
    Py_buffer kb;
    if (keys_buffer(keys, &kb, "Counts.add") < 0)
        return NULL;
    const uint64_t *ks = kb.buf;
    Py_ssize_t n = kb.len / 8;
    int r = 0;
    for (Py_ssize_t i = 0; i < n && r == 0; i++)
        r = bump(t, ks[i], 1);
    PyBuffer_Release(&kb);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Counts_repr(Counts *t) {
    return PyUnicode_FromFormat("<Counts: %zd keys>", t->used);
}

static PyMappingMethods Counts_mapping = {(lenfunc)Counts_len, (binaryfunc)Counts_get, (objobjargproc)Counts_set};
static PySequenceMethods Counts_sequence = {.sq_contains = (objobjproc)Counts_contains};
static PyObject *Counts_sizeof(Counts *t, PyObject *unused) {
    return PyLong_FromSize_t(sizeof(Counts) + ((size_t)1 << t->bits) * sizeof(Slot));
}

static PyObject *Counts_slots(Counts *t, void *unused) {
    return PyLong_FromSsize_t((Py_ssize_t)1 << t->bits);
}

static PyGetSetDef Counts_getset[] = {
    {"slots", (getter)Counts_slots, NULL, "the table's slots: at most twice its keys once grown, at least 16", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef Counts_methods[] = {
    {"add", (PyCFunction)Counts_add, METH_O, "add(keys: array('Q')): count each key once more"},
    {"__sizeof__", (PyCFunction)Counts_sizeof, METH_NOARGS, "the table's bytes, its slots included"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject CountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "framework.kv_events.native_keys.Counts",
    .tp_basicsize = sizeof(Counts),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A worker's block counts: key -> count > 0, read like a Counter (a missing key counts 0)",
    .tp_new = Counts_new,
    .tp_dealloc = (destructor)Counts_dealloc,
    .tp_repr = (reprfunc)Counts_repr,
    .tp_as_mapping = &Counts_mapping,
    .tp_as_sequence = &Counts_sequence,
    .tp_methods = Counts_methods,
    .tp_getset = Counts_getset,
};

/* Whether ``held`` (a Counts or a dict) holds key ``i`` of ``ks``: 1, 0, or -1 on an error. */
static inline int holds(PyObject *held, const uint64_t *ks, Py_ssize_t i) {
    if (Py_IS_TYPE(held, &CountsType))
        return find((Counts *)held, ks[i])->count != 0;
    PyObject *k = PyLong_FromUnsignedLongLong(ks[i]);
    if (!k)
        return -1;
    int r = PyDict_Contains(held, k);
    Py_DECREF(k);
    return r;
}

static PyObject *deepest(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "deepest(keys: array('Q'), table: dict)");
        return NULL;
    }
    Py_buffer kb;
    if (keys_buffer(args[0], &kb, "deepest") < 0)
        return NULL;
    const uint64_t *ks = kb.buf;
    for (Py_ssize_t i = kb.len / 8 - 1; i >= 0; i--) {
        PyObject *k = PyLong_FromUnsignedLongLong(ks[i]);
        if (!k)
            break;
        int r = PyDict_Contains(args[1], k);
        if (r) {  /* found (1), or an error (-1) */
            PyBuffer_Release(&kb);
            if (r > 0)
                return k;
            Py_DECREF(k);
            return NULL;
        }
        Py_DECREF(k);
    }
    PyBuffer_Release(&kb);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *bounds = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    if (nargs < 3 || nargs > 4 || !PyDict_Check(args[1]) || !PyList_Check(args[2]) ||
            (bounds && !PyDict_Check(bounds))) {
        PyErr_SetString(PyExc_TypeError,
                        "match(keys: array('Q'), held_by: dict, candidates: list, bounds: dict | None = None)");
        return NULL;
    }
    Py_buffer kb;
    if (keys_buffer(args[0], &kb, "match") < 0)
        return NULL;
    const uint64_t *ks = kb.buf;
    Py_ssize_t n = kb.len / 8;
    PyObject *out = PyDict_New(), *owned = NULL;  /* owned: the candidate's holdings, while it is searched */
    if (!out)
        goto fail;
    for (Py_ssize_t c = 0; c < PyList_GET_SIZE(args[2]); c++) {
        PyObject *w = PyList_GET_ITEM(args[2], c);  /* borrowed: a str runs no Python code in a lookup */
        if (!PyUnicode_CheckExact(w)) {
            PyErr_Format(PyExc_TypeError, "match: a candidate is a worker's name (str), not %.100s", Py_TYPE(w)->tp_name);
            goto fail;
        }
        PyObject *held = PyDict_GetItemWithError(args[1], w);  /* borrowed: owned below, as other lookups run code */
        Py_ssize_t lo = 0, hi = n;
        int r;
        if (!held && PyErr_Occurred())
            goto fail;
        if (held && !PyDict_Check(held) && !Py_IS_TYPE(held, &CountsType)) {
            PyErr_Format(PyExc_TypeError, "match: held_by[%R] must be a dict of keys or a Counts, not %.100s", w,
                         Py_TYPE(held)->tp_name);
            goto fail;
        }
        Py_XINCREF(held);
        Py_XSETREF(owned, held);
        if (bounds) {  /* the first gap on the path: at most that many (within the keys) */
            PyObject *bound = PyDict_GetItemWithError(bounds, w);
            if (bound) {
                if ((hi = PyLong_AsSsize_t(bound)) == -1 && PyErr_Occurred())
                    goto fail;
                hi = hi < 0 ? 0 : hi > n ? n : hi;
            } else if (PyErr_Occurred())
                goto fail;
        }
        if (held && n) {
            if ((r = holds(held, ks, 0)) < 0)
                goto fail;
            if (r) {  /* it holds block 1: the first lo blocks, not the first hi + 1 */
                for (lo = 1; lo < hi;) {
                    Py_ssize_t mid = (lo + hi + 1) >> 1;
                    if ((r = holds(held, ks, mid - 1)) < 0)
                        goto fail;
                    if (r)
                        lo = mid;
                    else
                        hi = mid - 1;
                }
            }
        }
        PyObject *v = PyLong_FromSsize_t(lo);
        if (!v || PyDict_SetItem(out, w, v) < 0) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
    }
    Py_XDECREF(owned);
    PyBuffer_Release(&kb);
    return out;
fail:
    Py_XDECREF(owned);
    Py_XDECREF(out);
    PyBuffer_Release(&kb);
    return NULL;
}

static PyObject *seed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "seed(k0, k1) takes 2 arguments");
        return NULL;
    }
    uint64_t k0 = PyLong_AsUnsignedLongLongMask(args[0]);
    if (k0 == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    uint64_t k1 = PyLong_AsUnsignedLongLongMask(args[1]);
    if (k1 == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    K0 = k0;
    K1 = k1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"keys", (PyCFunction)(void (*)(void))keys, METH_FASTCALL, "keys(data, block_size, parent) -> array('Q')"},
    {"match", (PyCFunction)(void (*)(void))match, METH_FASTCALL, "match(keys, held_by, candidates, bounds=None) -> dict"},
    {"deepest", (PyCFunction)(void (*)(void))deepest, METH_FASTCALL,
     "deepest(keys, table) -> the deepest of the keys in the table, or None"},
    {"seed", (PyCFunction)(void (*)(void))seed, METH_FASTCALL, "seed(k0, k1): the process's hash key"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "framework.kv_events.native_keys", NULL, -1, methods};

PyMODINIT_FUNC PyInit_native_keys(void) {
    PyObject *array = PyImport_ImportModule("array");
    if (!array)
        return NULL;
    array_type = PyObject_GetAttrString(array, "array");
    Py_DECREF(array);
    if (!array_type)
        return NULL;
    if (PyType_Ready(&CountsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "API", CHAIN_API) < 0 ||
              PyModule_AddObjectRef(m, "Counts", (PyObject *)&CountsType) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
