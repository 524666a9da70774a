"""Declares the native extensions: bindings/zset.pyx over the Z-set kernels of csrc/ (dbsp_core._zset) and
bindings/storage.pyx over its storage engine (dbsp_core._storage).

The C core is compiled once, and each C file is linked into exactly one extension, the one whose bindings call it
(STORAGE below: the storage engine; every other csrc/*.c: the kernels). An extension is a shared object whose C
symbols are private to it, so a C file linked into both would exist twice in a process, with two copies of its
globals (scratch and region caches, the key-index budget, the fault VFS's state), one of them dead weight.
Neither part calls the other: a call across would fail at import with an undefined symbol, and
tests/c/test_one_core.py checks with nm that no C symbol is in both. Code both parts need goes in a header as
static inline functions without state (as csrc/le.h), or, if it has state, calls for one extension over both.

Environment flags:
  DBSP_DEBUG=1     -O0 -g, asserts on (-UNDEBUG), invariant checkers enabled (DBSP_CHECK_INVARIANTS)
  DBSP_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer (needs LD_PRELOAD of libasan at run time)
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)

debug = os.environ.get("DBSP_DEBUG") == "1"
sanitize = os.environ.get("DBSP_SANITIZE") == "1"

cflags = ["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
          "-D_GNU_SOURCE", "-fvisibility=hidden"]
ldflags = []
if debug:
    cflags += ["-O0", "-g", "-UNDEBUG", "-DDBSP_CHECK_INVARIANTS=1"]
else:
    cflags += ["-O3", "-DNDEBUG"]
if sanitize:
    cflags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
    ldflags += ["-fsanitize=address,undefined"]

# the storage engine's C files (page store, step log, small files, their VFS, status and checksum): _storage's
STORAGE = ["csrc/bloom.c", "csrc/crc32c.c", "csrc/groupdecode.c", "csrc/pagestore.c", "csrc/smallfile.c",
           "csrc/spillread.c", "csrc/steplog.c", "csrc/storage_status.c", "csrc/vfs.c"]
csources = {
    "storage": STORAGE,
    "zset": [c for c in sorted(glob.glob("csrc/*.c")) if c not in STORAGE],
}
extensions = [
    Extension(
        "dbsp_core._" + stem,
        ["bindings/" + stem + ".pyx"] + csources[stem],
        include_dirs=["csrc", numpy.get_include()],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for stem in sorted(csources)
]

setup(
    ext_modules=cythonize(
        extensions,
        include_path=["bindings"],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False,
                             "initializedcheck": False, "cdivision": True, "embedsignature": True},
    ),
)
