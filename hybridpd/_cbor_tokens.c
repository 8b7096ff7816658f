/* Canonical CBOR encoding of token-id runs, and the SHA-256 block chain, for
 * hybridpd.hashing.
 *
 * Over the ~350-line rule on purpose: one extension module is one translation
 * unit, and the encoder (AVX-512 and scalar), the SHA-NI chain that reads the
 * encoder's buffers in place, and their Python bindings share static helpers.
 *
 * encode(tokens, unit, portable=False) -> (buf: bytes, starts: bytes)
 *   tokens: a list/tuple of ints or any C-contiguous buffer of int64/uint32/int32.
 *   buf:    the canonical CBOR unsigned-int encoding of the first
 *           (len // unit) * unit tokens, concatenated.
 *   starts: native int64 array (n_blocks + 1 entries) of block byte offsets.
 * Raises OverflowError for a token outside [0, 2**32) (or not an int) in a full
 * block: the caller then uses the generic cbor2 path. Tokens of the partial last
 * block are not read.
 *
 * sha256_chain(tokens, unit, parent, tail_first, tail_rest, portable=False) -> list[bytes]
 *   The whole vLLM block-hash chain with sha256_cbor in one call:
 *     h_i = sha256(0x83 | bstr(h_{i-1}) | array(unit) | uint(t)... | tail_i)
 *   with h_{-1} = parent, tail_0 = tail_first, tail_i = tail_rest (both already
 *   canonical CBOR). SHA-NI when the CPU has it (x86-64), else portable C. Token
 *   ids are CBOR-encoded with AVX-512 VBMI2 (compress-store) where the CPU has
 *   it, else branch-free scalar code; ``portable=True`` forces the portable
 *   SHA-256 and the scalar encoder (tests). OverflowError as for encode.
 * join_prefixed(prefix, hashes) -> bytes
 *   prefix + h_1 + prefix + h_2 + ...: the index lookup's chain argument
 *   (ValueError unless every hash is bytes of one length).
 * has_sha_ni() -> bool
 * has_simd_encoder() -> bool
 *
 * Token input: a list or tuple of ints is read under the GIL (exact ints with
 * one digit straight from the object, the common case; no Python code runs);
 * buffers (numpy arrays) of int64/uint32/int32 are read as they are.
 * GIL: sha256_chain of a list or tuple with SHA-NI holds it throughout, reading
 * the ids a few at a time between SHA-256 compressions (the reads are cache
 * misses on the int objects, the compressions a latency-bound chain: together
 * they cost little more than the compressions alone; 164K tokens: ~0.75 ms,
 * against ~1.0 ms reading first and hashing without the GIL). Otherwise the ids
 * are read first and encoding and hashing run without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---- token input ----------------------------------------------------------------- */

/* One int object -> uint32, or -1 with OverflowError (outside [0, 2**32)) / TypeError. */
static inline int long_u32(PyObject *x, uint32_t *v) {
#if PY_VERSION_HEX < 0x030C0000
    if (PyLong_CheckExact(x)) {
        Py_ssize_t size = Py_SIZE(x);
        if (size == 1) { *v = (uint32_t)((PyLongObject *)x)->ob_digit[0]; return 0; }
        if (size == 0) { *v = 0; return 0; }
    }
#else
    if (PyLong_CheckExact(x) && PyUnstable_Long_IsCompact((PyLongObject *)x)) {
        Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)x);
        if (c >= 0 && c <= 0xFFFFFFFFLL) { *v = (uint32_t)c; return 0; }
    }
#endif
    unsigned long long y = PyLong_AsUnsignedLongLong(x);
    if (y == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError) && !PyErr_ExceptionMatches(PyExc_ValueError)
            && !PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear();
    } else if (y <= 0xFFFFFFFFULL) {
        *v = (uint32_t)y;
        return 0;
    }
    PyErr_SetString(PyExc_OverflowError, "token out of range");
    return -1;
}

/* The tokens of obj's full unit-token blocks as uint32 (the rest is not read):
 * *out points either into *view (a uint32 buffer, *view_held = 1; release it) or
 * at a PyMem block (*owned; free it). -1 + OverflowError/TypeError on failure. */
static int tokens_u32(PyObject *obj, Py_ssize_t unit, Py_ssize_t *n_out, const uint32_t **out, uint32_t **owned,
                      Py_buffer *view, int *view_held) {
    *out = NULL; *owned = NULL; *view_held = 0;
    if (PyObject_CheckBuffer(obj) && PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        const char *f = view->format ? view->format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        int kind = 0;
        if (view->itemsize == 8 && (*f == 'l' || *f == 'q')) kind = 8;
        else if (view->itemsize == 4 && (*f == 'I' || *f == 'L')) kind = 4;
        else if (view->itemsize == 4 && (*f == 'i' || *f == 'l')) kind = -4;
        if (kind) {
            Py_ssize_t n = view->len / view->itemsize / unit * unit;
            *n_out = n;
            if (kind == 4) { *out = (const uint32_t *)view->buf; *view_held = 1; return 0; }
            uint32_t *o = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
            if (!o) { PyBuffer_Release(view); PyErr_NoMemory(); return -1; }
            int bad = 0;
            if (kind == 8) {
                const int64_t *src = (const int64_t *)view->buf;
                for (Py_ssize_t i = 0; i < n; i++) { bad |= src[i] < 0 || src[i] > 0xFFFFFFFFLL; o[i] = (uint32_t)src[i]; }
            } else {
                const int32_t *src = (const int32_t *)view->buf;
                for (Py_ssize_t i = 0; i < n; i++) { bad |= src[i] < 0; o[i] = (uint32_t)src[i]; }
            }
            PyBuffer_Release(view);
            if (bad) { PyMem_Free(o); PyErr_SetString(PyExc_OverflowError, "token out of range"); return -1; }
            *out = o; *owned = o;
            return 0;
        }
        PyBuffer_Release(view);
    } else {
        PyErr_Clear();
    }
    PyObject *seq = PySequence_Fast(obj, "tokens must be a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq) / unit * unit;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint32_t *o = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (!o) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (long_u32(items[i], &o[i]) < 0) { PyMem_Free(o); Py_DECREF(seq); return -1; }
    }
    Py_DECREF(seq);
    *n_out = n; *out = o; *owned = o;
    return 0;
}

/* ---- CBOR unsigned ints ------------------------------------------------------------- */

/* Canonical CBOR of t[0:n] (uint(v): 1, 2, 3 or 5 bytes) at q; returns the end.
 * Branch-free: one 8-byte store per token, so q needs 7 writable bytes of slack. */
static unsigned char *enc_scalar(unsigned char *q, const uint32_t *t, Py_ssize_t n) {
    static const uint64_t head[6] = {0, 0, 0x18, 0x19, 0, 0x1a};
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = t[i];
        unsigned w = 1u + (v >= 24) + (v >= 256) + 2u * (v >= 65536);
        uint64_t be = (uint64_t)__builtin_bswap32(v);         /* bytes b3 b2 b1 b0 */
        uint64_t word = head[w] | ((be >> (8 * (5 - w))) << 8); /* w - 1 value bytes after the head */
        word |= (uint64_t)(-(int64_t)(v < 24)) & v;             /* w == 1: the value is the head */
        /* little-endian byte order of word == the bytes to write */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        word = __builtin_bswap64(word);
#endif
        memcpy(q, &word, 8);
        q += w;
    }
    return q;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86_CODE 1
#define SIMD_TARGET __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vbmi2")))

/* As enc_scalar, 8 tokens at a time: each token becomes an 8-byte lane [head, big-endian
 * value bytes], and a byte compress-store keeps the first w bytes of each lane. No slack
 * needed beyond what enc_scalar needs for the last (n % 8) tokens. */
SIMD_TARGET static unsigned char *enc_simd(unsigned char *q, const uint32_t *t, Py_ssize_t n) {
    const __m512i one = _mm512_set1_epi64(1), two = _mm512_set1_epi64(2), five = _mm512_set1_epi64(5);
    const __m512i c24 = _mm512_set1_epi64(24), c256 = _mm512_set1_epi64(256), c64k = _mm512_set1_epi64(65536);
    const __m512i heads = _mm512_set_epi64(0, 0, 0x1a, 0, 0x19, 0x18, 0, 0); /* by width */
    const __m512i ones = _mm512_set1_epi64(-1), eight = _mm512_set1_epi64(8);
    /* per 8-byte lane: [0, b3, b2, b1, b0, 0, 0, 0] from the little-endian value b0 b1 b2 b3 */
    const __m512i bswap = _mm512_set_epi8(
        -1, -1, -1, 8, 9, 10, 11, -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 8, 9, 10, 11, -1, -1, -1, -1, 0, 1, 2, 3, -1,
        -1, -1, -1, 8, 9, 10, 11, -1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 8, 9, 10, 11, -1, -1, -1, -1, 0, 1, 2, 3, -1);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m512i v = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(t + i)));
        __mmask8 g24 = _mm512_cmpge_epu64_mask(v, c24);
        __mmask8 g256 = _mm512_cmpge_epu64_mask(v, c256);
        __mmask8 g64k = _mm512_cmpge_epu64_mask(v, c64k);
        __m512i w = _mm512_mask_add_epi64(one, g24, one, one);
        w = _mm512_mask_add_epi64(w, g256, w, one);
        w = _mm512_mask_add_epi64(w, g64k, w, two);
        __m512i be = _mm512_srli_epi64(_mm512_shuffle_epi8(v, bswap), 8);
        __m512i word = _mm512_slli_epi64(_mm512_srlv_epi64(be, _mm512_slli_epi64(_mm512_sub_epi64(five, w), 3)), 8);
        word = _mm512_or_si512(word, _mm512_permutexvar_epi64(w, heads));
        word = _mm512_mask_mov_epi64(word, (__mmask8)~g24, v);
        __m512i keep = _mm512_srlv_epi64(ones, _mm512_slli_epi64(_mm512_sub_epi64(eight, w), 3));
        __mmask64 km = _mm512_test_epi8_mask(keep, keep);
        _mm512_mask_compressstoreu_epi8(q, km, word);
        q += __builtin_popcountll(km);
    }
    return enc_scalar(q, t + i, n - i);
}

static int cpu_has_simd_encoder(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2");
}
#else
static int cpu_has_simd_encoder(void) { return 0; }
#endif

typedef unsigned char *(*enc_fn)(unsigned char *q, const uint32_t *t, Py_ssize_t n);
static int have_simd_encoder = 0;

static enc_fn pick_encoder(int portable) {
#ifdef HAVE_X86_CODE
    if (have_simd_encoder && !portable) return enc_simd;
#endif
    return enc_scalar;
}

static PyObject *encode(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"tokens", "unit", "portable", NULL};
    PyObject *obj; Py_ssize_t unit; int portable = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|p", kwlist, &obj, &unit, &portable)) return NULL;
    if (unit <= 0) { PyErr_SetString(PyExc_ValueError, "unit must be positive"); return NULL; }
    Py_ssize_t n; const uint32_t *tok; uint32_t *owned; Py_buffer view; int view_held;
    if (tokens_u32(obj, unit, &n, &tok, &owned, &view, &view_held) < 0) return NULL;
    Py_ssize_t nblocks = n / unit, ntok = nblocks * unit;
    PyObject *buf = PyBytes_FromStringAndSize(NULL, ntok * 5 + 8);
    PyObject *starts = PyBytes_FromStringAndSize(NULL, (nblocks + 1) * (Py_ssize_t)sizeof(int64_t));
    if (!buf || !starts) goto fail;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(buf), *q = p;
    int64_t *st = (int64_t *)PyBytes_AS_STRING(starts);
    enc_fn enc = pick_encoder(portable);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        st[b] = q - p;
        q = enc(q, tok + b * unit, unit);
    }
    st[nblocks] = q - p;
    Py_END_ALLOW_THREADS
    if (view_held) PyBuffer_Release(&view);
    PyMem_Free(owned);
    if (_PyBytes_Resize(&buf, q - p) < 0) { Py_DECREF(starts); return NULL; }
    return Py_BuildValue("(NN)", buf, starts);
fail:
    if (view_held) PyBuffer_Release(&view);
    PyMem_Free(owned);
    Py_XDECREF(buf); Py_XDECREF(starts);
    return NULL;
}

/* Canonical CBOR head for (major, n) at p; returns its length. */
static Py_ssize_t put_head(unsigned char *p, unsigned major, uint64_t n) {
    unsigned char mt = (unsigned char)(major << 5);
    if (n < 24) { p[0] = mt | (unsigned char)n; return 1; }
    if (n < 256) { p[0] = mt | 24; p[1] = (unsigned char)n; return 2; }
    if (n < 65536) { p[0] = mt | 25; p[1] = (unsigned char)(n >> 8); p[2] = (unsigned char)n; return 3; }
    if (n < 4294967296ULL) {
        p[0] = mt | 26;
        for (int i = 0; i < 4; i++) p[1 + i] = (unsigned char)(n >> (24 - 8 * i));
        return 5;
    }
    p[0] = mt | 27;
    for (int i = 0; i < 8; i++) p[1 + i] = (unsigned char)(n >> (56 - 8 * i));
    return 9;
}

/* ---- SHA-256 ----------------------------------------------------------------------- */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H256[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_blocks_portable(uint32_t st[8], const unsigned char *p, size_t nblocks) {
    for (; nblocks; nblocks--, p += 64) {
        uint32_t w[64];
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 | (uint32_t)p[4 * t + 2] << 8 | p[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROR(w[t - 15], 7) ^ ROR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROR(w[t - 2], 17) ^ ROR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        st[0] += a; st[1] += b; st[2] += c; st[3] += d; st[4] += e; st[5] += f; st[6] += g; st[7] += h;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_SHANI_CODE 1

/* Token ids still to be read from a list under the GIL, a few at a time between
 * SHA-256 compressions: the reads (cache misses on the int objects) overlap the
 * SHA rounds (a latency-bound dependency chain) instead of preceding them. */
typedef struct {
    PyObject **items;  /* the list's items */
    uint32_t *out;     /* their values */
    Py_ssize_t next;   /* items[next:] not read yet */
    Py_ssize_t end;
    int failed;        /* a token outside [0, 2**32) or not an int: exception set */
} pending_tokens;

static inline __attribute__((always_inline)) void read_tokens(pending_tokens *pt, Py_ssize_t upto) {
    if (upto > pt->end) upto = pt->end;
    Py_ssize_t i = pt->next;
    for (; i < upto; i++) {
        if (long_u32(pt->items[i], &pt->out[i]) < 0) { pt->failed = 1; pt->end = i; break; }
    }
    pt->next = i;
}

/* The SHA extensions' standard schedule (Intel's white paper layout); with pt,
 * reads READ_PER_COMPRESSION pending tokens after each 64-byte block. */
#define READ_PER_COMPRESSION 16
__attribute__((target("sha,sse4.1,ssse3"), always_inline))
static inline void shani_blocks(uint32_t st[8], const unsigned char *p, size_t nblocks, pending_tokens *pt) {
    const __m128i MASK = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&st[0]);
    __m128i s1 = _mm_loadu_si128((const __m128i *)&st[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xB1);             /* CDAB */
    s1 = _mm_shuffle_epi32(s1, 0x1B);               /* EFGH */
    __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);       /* ABEF */
    s1 = _mm_blend_epi16(s1, tmp, 0xF0);            /* CDGH */
    for (; nblocks; nblocks--, p += 64) {
        __m128i abef = s0, cdgh = s1, m[4];
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {
            __m128i *x = &m[g & 3];
            if (g < 4) {
                *x = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * g)), MASK);
            } else {
                __m128i t = _mm_add_epi32(_mm_sha256msg1_epu32(m[g & 3], m[(g + 1) & 3]),
                                          _mm_alignr_epi8(m[(g + 3) & 3], m[(g + 2) & 3], 4));
                *x = _mm_sha256msg2_epu32(t, m[(g + 3) & 3]);
            }
            __m128i k = _mm_add_epi32(*x, _mm_loadu_si128((const __m128i *)&K256[4 * g]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, k);
            k = _mm_shuffle_epi32(k, 0x0E);
            s0 = _mm_sha256rnds2_epu32(s0, s1, k);
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
        if (pt) read_tokens(pt, pt->next + READ_PER_COMPRESSION);
    }
    tmp = _mm_shuffle_epi32(s0, 0x1B);              /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);               /* DCHG */
    s0 = _mm_blend_epi16(tmp, s1, 0xF0);            /* DCBA */
    s1 = _mm_alignr_epi8(s1, tmp, 8);               /* ABEF */
    _mm_storeu_si128((__m128i *)&st[0], s0);
    _mm_storeu_si128((__m128i *)&st[4], s1);
}

__attribute__((target("sha,sse4.1,ssse3")))
static void sha256_blocks_shani(uint32_t st[8], const unsigned char *p, size_t nblocks) {
    shani_blocks(st, p, nblocks, NULL);
}

__attribute__((target("sha,sse4.1,ssse3")))
static void sha256_blocks_shani_reading(uint32_t st[8], const unsigned char *p, size_t nblocks, pending_tokens *pt) {
    shani_blocks(st, p, nblocks, pt);
}

static int cpu_has_sha_ni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sha") && __builtin_cpu_supports("sse4.1") && __builtin_cpu_supports("ssse3");
}
#else
static int cpu_has_sha_ni(void) { return 0; }
#endif

typedef void (*blocks_fn)(uint32_t st[8], const unsigned char *p, size_t nblocks);

/* Pad msg[0:len] for SHA-256 (msg needs 72 writable bytes past len); returns its 64-byte block count. */
static size_t sha256_pad(unsigned char *msg, size_t len) {
    size_t total = (len + 9 + 63) / 64 * 64;
    msg[len] = 0x80;
    memset(msg + len + 1, 0, total - len - 9);
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) msg[total - 1 - i] = (unsigned char)(bits >> (8 * i));
    return total / 64;
}

static void sha256_out(const uint32_t st[8], unsigned char out[32]) {
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(st[i] >> 24); out[4 * i + 1] = (unsigned char)(st[i] >> 16);
        out[4 * i + 2] = (unsigned char)(st[i] >> 8); out[4 * i + 3] = (unsigned char)st[i];
    }
}

static int have_sha_ni = 0;

/* One link's message: 0x83 | bstr(parent) | array(unit) | uint(t)... | tail. Returns its length. */
static size_t chain_message(unsigned char *msg, const unsigned char *parent, Py_ssize_t parent_len,
                            const unsigned char *arr_head, Py_ssize_t arr_len, enc_fn enc, const uint32_t *t,
                            Py_ssize_t unit, const Py_buffer *tail) {
    unsigned char *q = msg;
    *q++ = 0x83;
    q += put_head(q, 2, (uint64_t)parent_len);
    memcpy(q, parent, (size_t)parent_len); q += parent_len;
    memcpy(q, arr_head, (size_t)arr_len); q += arr_len;
    q = enc(q, t, unit);
    memcpy(q, tail->buf, (size_t)tail->len); q += tail->len;
    return (size_t)(q - msg);
}

static PyObject *sha256_chain(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"tokens", "unit", "parent", "tail_first", "tail_rest", "portable", NULL};
    PyObject *obj; Py_ssize_t unit; Py_buffer parent, tail0, tail1; int portable = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ony*y*y*|p", kwlist, &obj, &unit, &parent, &tail0, &tail1,
                                     &portable))
        return NULL;
    PyObject *result = NULL;
    const uint32_t *tok = NULL; uint32_t *owned = NULL; unsigned char *msg = NULL, *digests = NULL;
    Py_buffer view; int view_held = 0;
    if (unit <= 0) { PyErr_SetString(PyExc_ValueError, "unit must be positive"); goto done; }
    Py_ssize_t n;
    /* A list or tuple of ints with SHA-NI: read the ids while hashing (GIL held
     * throughout, no Python code runs); otherwise read them first, hash without the GIL. */
    int reading = 0;
#ifdef HAVE_SHANI_CODE
    reading = have_sha_ni && !portable && (PyList_CheckExact(obj) || PyTuple_CheckExact(obj));
#endif
    if (reading) {
        n = PySequence_Fast_GET_SIZE(obj);
        owned = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
        if (!owned) { PyErr_NoMemory(); goto done; }
        tok = owned;
    } else if (tokens_u32(obj, unit, &n, &tok, &owned, &view, &view_held) < 0) {
        goto done;
    }
    Py_ssize_t nblocks = n / unit;
    size_t plen = (size_t)(parent.len > 32 ? parent.len : 32);
    size_t tlen = (size_t)(tail0.len > tail1.len ? tail0.len : tail1.len);
    size_t cap = 1 + 9 + plen + 9 + 5 * (size_t)unit + tlen + 72;
    msg = PyMem_Malloc(cap);
    digests = PyMem_Malloc((size_t)(nblocks ? nblocks : 1) * 32);
    if (!msg || !digests) { PyErr_NoMemory(); goto done; }
    blocks_fn fn = sha256_blocks_portable;
#ifdef HAVE_SHANI_CODE
    if (have_sha_ni && !portable) fn = sha256_blocks_shani;
#endif
    enc_fn enc = pick_encoder(portable);
    unsigned char arr_head[9];
    Py_ssize_t arr_len = put_head(arr_head, 4, (uint64_t)unit);
    uint32_t st[8];
#ifdef HAVE_SHANI_CODE
    if (reading) {
        pending_tokens pt = {PySequence_Fast_ITEMS(obj), owned, 0, nblocks * unit, 0};
        read_tokens(&pt, unit);
        for (Py_ssize_t b = 0; b < nblocks && !pt.failed; b++) {
            const unsigned char *par = b ? digests + 32 * (b - 1) : (const unsigned char *)parent.buf;
            size_t len = chain_message(msg, par, b ? 32 : parent.len, arr_head, arr_len, enc, tok + b * unit, unit,
                                       b ? &tail1 : &tail0);
            memcpy(st, H256, sizeof st);
            sha256_blocks_shani_reading(st, msg, sha256_pad(msg, len), &pt);
            sha256_out(st, digests + 32 * b);
            read_tokens(&pt, (b + 2) * unit);
        }
        if (pt.failed) goto done;
    } else
#endif
    {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t b = 0; b < nblocks; b++) {
            const unsigned char *par = b ? digests + 32 * (b - 1) : (const unsigned char *)parent.buf;
            size_t len = chain_message(msg, par, b ? 32 : parent.len, arr_head, arr_len, enc, tok + b * unit, unit,
                                       b ? &tail1 : &tail0);
            memcpy(st, H256, sizeof st);
            fn(st, msg, sha256_pad(msg, len));
            sha256_out(st, digests + 32 * b);
        }
        Py_END_ALLOW_THREADS
    }
    result = PyList_New(nblocks);
    if (!result) goto done;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)digests + 32 * b, 32);
        if (!d) { Py_CLEAR(result); goto done; }
        PyList_SET_ITEM(result, b, d);
    }
done:
    if (view_held) PyBuffer_Release(&view);
    PyMem_Free(owned); PyMem_Free(msg); PyMem_Free(digests);
    PyBuffer_Release(&parent); PyBuffer_Release(&tail0); PyBuffer_Release(&tail1);
    return result;
}

/* join_prefixed(prefix, hashes) -> bytes: prefix + h_1 + prefix + h_2 + ... (the
 * lookup's one-argument chain); ValueError unless every hash is bytes of one length. */
static PyObject *join_prefixed(PyObject *self, PyObject *args) {
    Py_buffer prefix; PyObject *obj;
    if (!PyArg_ParseTuple(args, "y*O", &prefix, &obj)) return NULL;
    PyObject *out = NULL;
    PyObject *seq = PySequence_Fast(obj, "hashes must be a sequence of bytes");
    if (!seq) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t size = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(items[i]) || (i && PyBytes_GET_SIZE(items[i]) != size)) {
            PyErr_SetString(PyExc_ValueError, "hashes must be bytes of one length");
            goto done;
        }
        size = PyBytes_GET_SIZE(items[i]);
    }
    out = PyBytes_FromStringAndSize(NULL, n * (prefix.len + size));
    if (!out) goto done;
    char *q = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(q, prefix.buf, (size_t)prefix.len); q += prefix.len;
        memcpy(q, PyBytes_AS_STRING(items[i]), (size_t)size); q += size;
    }
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&prefix);
    return out;
}

static PyObject *py_has_sha_ni(PyObject *self, PyObject *unused) { return PyBool_FromLong(have_sha_ni); }

static PyObject *py_has_simd_encoder(PyObject *self, PyObject *unused) { return PyBool_FromLong(have_simd_encoder); }

static PyMethodDef methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_VARARGS | METH_KEYWORDS,
     "encode(tokens, unit, portable=False) -> (bytes, int64 block starts as bytes)"},
    {"sha256_chain", (PyCFunction)(void (*)(void))sha256_chain, METH_VARARGS | METH_KEYWORDS,
     "sha256_chain(tokens, unit, parent, tail_first, tail_rest, portable=False) -> list of 32-byte digests"},
    {"join_prefixed", join_prefixed, METH_VARARGS,
     "join_prefixed(prefix, hashes) -> prefix + h_1 + prefix + h_2 + ... (ValueError unless one length)"},
    {"has_sha_ni", py_has_sha_ni, METH_NOARGS, "whether sha256_chain uses the CPU's SHA extensions"},
    {"has_simd_encoder", py_has_simd_encoder, METH_NOARGS, "whether token ids are encoded with AVX-512 VBMI2"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cbor_tokens", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cbor_tokens(void) {
    have_sha_ni = cpu_has_sha_ni();
    have_simd_encoder = cpu_has_simd_encoder();
    return PyModule_Create(&module);
}
