"""The key index's probe for one 64-bit integer key column without nulls (csrc/keyindex.c ``get_into_int``, the path a
linear group-by by an int64 key takes every step) against a dict model: keys added and removed in steps, read back
with and without a row selection, absent keys, a growing table (the general path) and a settled one, and slot tags
cut to a few hash bits (``keyindex_test_hash_bits``) so that many keys share a tag and only the key word tells them
apart."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa
import pytest

from dbsp_core import _zset

SEED = int(os.environ.get("DBSP_TEST_SEED", random.randrange(2**31)))


@pytest.fixture
def hash_bits():
    yield _zset.keyindex_test_hash_bits
    _zset.keyindex_test_hash_bits(0)


@pytest.mark.parametrize("bits", [0, 3])
@pytest.mark.parametrize("typ", [pa.int64(), pa.uint64(), pa.timestamp("us")])
def test_one_int_key_reads_what_a_dict_model_holds(typ, bits, hash_bits):
    hash_bits(bits)  # before the index is made (the hook's contract)
    rng = np.random.default_rng(SEED)
    print(f"DBSP_TEST_SEED={SEED}")
    ix = _zset.KeyIndex([typ], 2)
    model: dict = {}
    domain = 5_000
    for step in range(60):
        n = int(rng.integers(1, 400)) if step else 3_000  # a first bulk call, then small steps
        keys = rng.integers(0, domain, n) * 7919 - 2**40  # negative and positive words
        if pa.types.is_unsigned_integer(typ):
            keys = keys.astype(np.uint64)
        vals = rng.integers(-5, 6, n)
        w = rng.choice([-1, 1, 1, 2], n)
        t = pa.table({"k": pa.array(keys, typ), "v": vals})
        kh = _zset.hash_columns(t, [0])
        ix.add(t, w.astype(np.int64), [0], kh, [-1, 1])
        for k, v, wi in zip(keys.tolist(), vals.tolist(), w.tolist()):
            c, s = model.get(k, (0, 0))
            model[k] = (c + wi, s + wi * v)
        model = {k: v for k, v in model.items() if v != (0, 0)}
        # read: keys of the step, keys never added, and a selection of rows in another order
        probe = np.concatenate([keys, rng.integers(domain, 2 * domain, 50).astype(keys.dtype) * 7919])
        pt = pa.table({"k": pa.array(probe, typ)})
        pkh = _zset.hash_columns(pt, [0])
        acc = np.zeros((len(probe), 2), dtype=np.int64)
        ix.get(pt, [0], pkh, acc)
        want = np.array([model.get(k, (0, 0)) for k in probe.tolist()], dtype=np.int64).reshape(-1, 2)
        assert (acc == want).all(), f"step {step}: sums differ from the model (DBSP_TEST_SEED={SEED})"
        sel = rng.permutation(len(probe))[: len(probe) // 2]
        acc = np.zeros((len(sel), 2), dtype=np.int64)
        ix.get(pt, [0], pkh[sel], acc, sel=sel)
        assert (acc == want[sel]).all(), f"step {step}: a selection reads other rows (DBSP_TEST_SEED={SEED})"
        assert len(ix) == len(model)
    ix.check()
