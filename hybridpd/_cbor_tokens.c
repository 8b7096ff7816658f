/* Canonical CBOR encoding of token-id runs, for hybridpd.hashing.
 *
 * encode(tokens, unit) -> (buf: bytes, starts: bytes)
 *   tokens: a list/tuple of ints or any C-contiguous buffer of int64/uint32.
 *   buf:    the canonical CBOR unsigned-int encoding of the first
 *           (len // unit) * unit tokens, concatenated.
 *   starts: native int64 array (n_blocks + 1 entries) of block byte offsets.
 * Raises OverflowError for a token outside [0, 2**32): the caller then uses
 * the generic cbor2 path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static inline Py_ssize_t put_uint(unsigned char *p, uint64_t v) {
    if (v < 24) { p[0] = (unsigned char)v; return 1; }
    if (v < 256) { p[0] = 0x18; p[1] = (unsigned char)v; return 2; }
    if (v < 65536) { p[0] = 0x19; p[1] = (unsigned char)(v >> 8); p[2] = (unsigned char)v; return 3; }
    p[0] = 0x1a; p[1] = (unsigned char)(v >> 24); p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 8); p[4] = (unsigned char)v; return 5;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t unit;
    if (!PyArg_ParseTuple(args, "On", &obj, &unit)) return NULL;
    if (unit <= 0) { PyErr_SetString(PyExc_ValueError, "unit must be positive"); return NULL; }

    Py_buffer view; int have_view = 0; PyObject *seq = NULL;
    Py_ssize_t n;
    int kind = 0; /* 0: sequence, 8: int64 buffer, 4: uint32 buffer */
    if (PyObject_CheckBuffer(obj) && PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        have_view = 1;
        const char *f = view.format ? view.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        if (view.itemsize == 8 && (*f == 'l' || *f == 'q')) kind = 8;
        else if (view.itemsize == 4 && (*f == 'I' || *f == 'L')) kind = 4;
        else { PyBuffer_Release(&view); have_view = 0; }
    } else {
        PyErr_Clear();
    }
    if (kind == 0) {
        seq = PySequence_Fast(obj, "tokens must be a sequence of ints");
        if (!seq) return NULL;
        n = PySequence_Fast_GET_SIZE(seq);
    } else {
        n = view.len / view.itemsize;
    }
    Py_ssize_t nblocks = n / unit, ntok = nblocks * unit;
    PyObject *buf = PyBytes_FromStringAndSize(NULL, ntok * 5);
    PyObject *starts = PyBytes_FromStringAndSize(NULL, (nblocks + 1) * (Py_ssize_t)sizeof(int64_t));
    if (!buf || !starts) goto fail;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(buf);
    int64_t *st = (int64_t *)PyBytes_AS_STRING(starts);
    Py_ssize_t off = 0;
    PyObject **items = seq ? PySequence_Fast_ITEMS(seq) : NULL;
    for (Py_ssize_t i = 0; i < ntok; i++) {
        if (i % unit == 0) st[i / unit] = off;
        uint64_t v;
        if (kind == 8) {
            int64_t x = ((const int64_t *)view.buf)[i];
            if (x < 0 || x > 0xFFFFFFFFLL) { PyErr_SetString(PyExc_OverflowError, "token out of range"); goto fail; }
            v = (uint64_t)x;
        } else if (kind == 4) {
            v = ((const uint32_t *)view.buf)[i];
        } else {
            unsigned long long x = PyLong_AsUnsignedLongLong(items[i]);
            if (x == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear(); PyErr_SetString(PyExc_OverflowError, "token out of range"); goto fail;
            }
            if (x > 0xFFFFFFFFULL) { PyErr_SetString(PyExc_OverflowError, "token out of range"); goto fail; }
            v = x;
        }
        off += put_uint(p + off, v);
    }
    st[nblocks] = off;
    if (have_view) PyBuffer_Release(&view);
    Py_XDECREF(seq);
    if (_PyBytes_Resize(&buf, off) < 0) { Py_DECREF(starts); return NULL; }
    return Py_BuildValue("(NN)", buf, starts);
fail:
    if (have_view) PyBuffer_Release(&view);
    Py_XDECREF(seq); Py_XDECREF(buf); Py_XDECREF(starts);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS, "encode(tokens, unit) -> (bytes, int64 block starts as bytes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cbor_tokens", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cbor_tokens(void) { return PyModule_Create(&module); }
