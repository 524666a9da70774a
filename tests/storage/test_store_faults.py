"""The fault-injecting store wrapper (dbsp_core.storage.store_faults) and the bounded retries of store calls
(dbsp_core.storage.retry) against moto's S3 server through pyarrow's real S3 client: each fault kind does what it
says, random faults replay from their seed, retries are bounded and logged without credentials, and a store that
stays down raises StoreUnavailableError."""

from __future__ import annotations

import logging
import os
import random
from collections import Counter

import pyarrow.fs as pafs
import pytest

from dbsp_core.errors import StoreUnavailableError
from dbsp_core.storage import retry
from dbsp_core.storage.location import resolve
from dbsp_core.storage.store_faults import InjectedFault, StoreFaults

SEED = int(os.environ.get("DBSP_STORE_FAULT_SEED", random.randrange(2**31)))
FAST = retry.RetryPolicy(attempts=8, first_delay_s=0.001, max_delay_s=0.004)


def _put(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def _exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File


@pytest.fixture()
def store(s3_server):
    return s3_server.filesystem(), s3_server.bucket()


def test_each_fault_kind_of_each_operation(store):
    real, bucket = store
    plan = {("put", 1): "error", ("put", 2): "timeout", ("put", 3): "landed", ("put", 4): "delay",
            ("get", 1): "error", ("get", 2): "timeout", ("get", 3): "delay",
            ("list", 1): "error", ("list", 2): "timeout", ("list", 3): "delay",
            ("delete", 1): "error", ("delete", 2): "timeout", ("delete", 3): "delay"}
    f = StoreFaults(real, plan=plan)
    fs = f.fs
    for i in (1, 2):  # error, timeout: nothing reaches the store
        with pytest.raises(OSError, match="injected"):
            _put(fs, f"{bucket}/o{i}", b"x")
        assert not _exists(real, f"{bucket}/o{i}")
    with pytest.raises(InjectedFault, match="after the object landed"):
        _put(fs, f"{bucket}/o3", b"landed")
    assert real.open_input_file(f"{bucket}/o3").read() == b"landed"  # the object is there, whole
    _put(fs, f"{bucket}/o4", b"late")  # delay: written
    assert real.open_input_file(f"{bucket}/o4").read() == b"late"
    for _ in range(2):
        with pytest.raises(OSError, match="injected"):
            fs.open_input_file(f"{bucket}/o4")
    assert fs.open_input_file(f"{bucket}/o4").read() == b"late"
    sel = pafs.FileSelector(bucket, recursive=True)
    for _ in range(2):
        with pytest.raises(OSError, match="injected"):
            fs.get_file_info(sel)
    assert sorted(i.base_name for i in fs.get_file_info(sel)) == ["o3", "o4"]
    for _ in range(2):
        with pytest.raises(OSError, match="injected"):
            fs.delete_file(f"{bucket}/o3")
        assert _exists(real, f"{bucket}/o3")
    fs.delete_file(f"{bucket}/o3")
    assert not _exists(real, f"{bucket}/o3")
    assert f.injected == Counter({(o, k): 1 for (o, _), k in plan.items()})
    assert f.injected_by_kind() == {"error": 4, "timeout": 4, "delay": 4, "landed": 1}


def test_random_faults_retried_and_replayable(store):
    real, bucket = store
    print(f"store faults: seed {SEED} (replay: DBSP_STORE_FAULT_SEED={SEED})")
    where = resolve(bucket, real)

    def run(prefix: str) -> tuple[Counter, dict[str, bytes]]:
        f = StoreFaults(real, seed=SEED, rate=0.3, delay_s=0.001, timeout_s=0.001)
        rng = random.Random(SEED)
        model: dict[str, bytes] = {}
        for i in range(40):
            name = f"{bucket}/{prefix}/k{rng.randrange(12)}"
            op = rng.choice(["put", "put", "get", "delete"])
            if op == "put":
                data = rng.randbytes(rng.randrange(1, 300))
                retry.call(lambda: _put(f.fs, name, data), f"PUT {i}", where, FAST)
                model[name] = data
            elif op == "get" and name in model:
                assert retry.call(lambda: f.fs.open_input_file(name).read(), f"GET {i}", where, FAST) == model[name]
            elif op == "delete" and name in model:
                retry.call(lambda: f.fs.delete_file(name), f"DELETE {i}", where, FAST)
                del model[name]
        listed = retry.call(lambda: f.fs.get_file_info(pafs.FileSelector(f"{bucket}/{prefix}", allow_not_found=True)),
                            "LIST", where, FAST)
        got = {i.path: real.open_input_file(i.path).read() for i in listed if i.type == pafs.FileType.File}
        assert got == model  # every store call done exactly as asked, through the faults
        print(f"store faults: injected {dict(f.injected)} over {dict(f.ops)}")
        return f.injected, {k.rsplit("/", 1)[1]: v for k, v in got.items()}

    first, a = run("one")
    second, b = run("two")
    assert sum(first.values()) > 0, "the run injected no fault: it tests nothing"
    assert first == second  # the seed replays the same faults at the same operations
    assert a == b


def test_store_down_raises_after_bounded_logged_retries(s3_server, caplog):
    bucket = s3_server.bucket()
    loc = resolve(s3_server.uri(bucket, "p"))
    f = StoreFaults(loc.fs)
    f.down()
    policy = retry.RetryPolicy(attempts=4, first_delay_s=0.001, max_delay_s=0.002)
    caplog.set_level(logging.WARNING, logger="dbsp_core.storage.retry")
    with pytest.raises(StoreUnavailableError, match=r"PUT seg on s3://.*failed 4 times") as e:
        retry.call(lambda: _put(f.fs, loc.path + "/x", b"x"), "PUT seg", loc, policy)
    assert f.ops["put"] == 4 and f.injected == Counter({("put", "error"): 4})
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 3
    text = caplog.text + str(e.value)
    assert loc.shown in text
    for secret in ("dbsp-test-secret", "dbsp-test-key"):
        assert secret not in text
    f.down(False)
    retry.call(lambda: _put(f.fs, loc.path + "/x", b"x"), "PUT seg", loc, policy)  # back up: works again
    assert loc.fs.open_input_file(loc.path + "/x").read() == b"x"


def test_permanent_errors_are_not_retried(store):
    real, bucket = store
    f = StoreFaults(real)
    with pytest.raises(FileNotFoundError):
        retry.call(lambda: f.fs.open_input_file(f"{bucket}/missing").read(), "GET", bucket, FAST)
    assert f.ops["get"] == 1
