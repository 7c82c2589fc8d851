/* llmfw.core.format._strings: the fast path of a GGUF string array (a vocabulary's tokens, a BPE model's merges).
 *
 * An array item is a little-endian u64 length and that many bytes of UTF-8. Python's loop over the items
 * (gguf_header.Cursor.string_array) spends most of a small model's load in per-item interpreter work; this loop does
 * the same reads in C. It only ever takes the easy case: an item that lies wholly inside the valid bytes, no longer
 * than the limit it is given, and valid UTF-8. At the first item that is not, it stops and says where, and the
 * Python loop reads that item itself: refills the buffer, decodes a long string its memory-saving way, or raises the
 * error that names the problem. Both routes therefore give the same strings and the same errors. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static uint64_t read_u64_le(const unsigned char *p) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--)
        value = (value << 8) | p[i];
    return value;
}

/* decode_strings(buf, pos, available, out, index, max_len) -> (index, pos)
 *
 * Reads items into out[index], out[index + 1], ... from byte pos of buf until out is full or the next item is not
 * the easy case; returns the index of the first item not read and the byte offset where it starts. Only the first
 * `available` bytes of buf are read (never past the buffer's own end). */
static PyObject *decode_strings(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t pos, available, index;
    unsigned long long max_len;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "y*nnO!nK", &view, &pos, &available, &PyList_Type, &out, &index, &max_len))
        return NULL;
    if (available > view.len)
        available = view.len;
    Py_ssize_t count = PyList_GET_SIZE(out);
    if (pos < 0 || index < 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "decode_strings: negative offset or index");
        return NULL;
    }
    const unsigned char *base = view.buf;
    PyObject *failed = NULL;
    while (index < count) {
        if (pos > available || available - pos < 8)
            break;
        uint64_t length = read_u64_le(base + pos);
        if (length > max_len || length > (uint64_t)(available - pos - 8))
            break;
        PyObject *text = PyUnicode_DecodeUTF8((const char *)base + pos + 8, (Py_ssize_t)length, "strict");
        if (text == NULL) {
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                PyErr_Clear();  /* the Python loop decodes this item again and raises the error with its context */
                break;
            }
            failed = out;  /* out of memory: passed on */
            break;
        }
        PyObject *old = PyList_GET_ITEM(out, index);
        PyList_SET_ITEM(out, index, text);
        Py_XDECREF(old);
        pos += 8 + (Py_ssize_t)length;
        index++;
    }
    PyBuffer_Release(&view);
    if (failed != NULL)
        return NULL;
    return Py_BuildValue("nn", index, pos);
}

static PyMethodDef methods[] = {
    {"decode_strings", decode_strings, METH_VARARGS,
     "decode_strings(buf, pos, available, out, index, max_len) -> (index, pos): GGUF string-array items, the easy "
     "case only (see llmfw.core.format.gguf_header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_strings", NULL, -1, methods};

PyMODINIT_FUNC PyInit__strings(void) { return PyModule_Create(&module); }
