"""Declares the native extensions: each bindings/<stem>.pyx is compiled with csrc/*.c into dbsp_core._<stem>.

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

csources = sorted(glob.glob("csrc/*.c"))
extensions = [
    Extension(
        "dbsp_core._" + os.path.splitext(os.path.basename(pyx))[0],
        [pyx] + csources,
        include_dirs=["csrc", numpy.get_include()],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for pyx in sorted(glob.glob("bindings/*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        include_path=["bindings"],
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False,
                             "initializedcheck": False, "cdivision": True, "embedsignature": True},
    ),
)
