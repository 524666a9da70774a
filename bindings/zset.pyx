# zset.pyx: cdef classes that view Arrow columns as C batches and own the C kernels' results (dbsp_core._zset),
# in one included .pxi per C header.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, malloc, free, realloc
from libc.string cimport memset
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_WRITABLE
from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.string cimport memcpy, memmove
from libc.errno cimport errno as c_errno
from posix.mman cimport madvise

from zset cimport *

import errno
import os
import numpy as np
cimport numpy as cnp
import pyarrow as pa

from dbsp_core.errors import DbspError, SchemaError, StorageError, WeightOverflowError

cnp.import_array()

include "column.pxi"
include "hash.pxi"
include "zset.pxi"
include "scratch.pxi"
include "merge.pxi"
include "partition.pxi"
include "join.pxi"
include "reduce.pxi"
include "lookup.pxi"
include "gather.pxi"
include "split.pxi"
include "timefmt.pxi"
include "cdata.pxi"
include "fold.pxi"
include "joinlin.pxi"
include "extremes.pxi"
include "keyindex.pxi"
include "top1.pxi"
