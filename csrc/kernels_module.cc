// The CPU kernel library's Python module stub: the library is built as a Python extension
// module (setuptools knows how to build and install those, editable installs included),
// jaxdd.ffi._kernels, from this file and every kernel's csrc/<name>/<name>_cpu.cc.
// Importing it gives an empty module; jaxdd only uses its file path, to load it with ctypes
// (jaxdd/ffi/_library.py).

// Python.h first, as Python asks.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_kernels",
                                     "jaxdd's XLA FFI kernels for the CPU (loaded with ctypes).", -1,
                                     nullptr};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kModule); }
