"""A peak-RSS sampler for the Spark executors' Python workers (bench/bench_spark_spill.py --breakdown puts this directory on PYTHONPATH): each forked Python worker samples /proc/self/status every 5 ms and, at each new VmRSS peak, writes what it holds and the Python stack of its task thread to ``$BENCH_TASK_PEAK_DIR/<pid>.json`` (and the peak
while a stage task commits to ``<pid>.commit.json``)."""

import json
import os
import sys
import threading
import time
import traceback


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "RssAnon", "RssFile", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def _mallinfo() -> dict:
    """glibc's heap bytes in use, free in the heap, and in mmapped blocks (bench/bench_spill_nexmark.py's reading)."""
    bench = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from bench_spill_nexmark import _mallinfo as mallinfo

    use, free, mapped = mallinfo()
    return {"malloc_in_use": use, "malloc_free": free, "malloc_mapped": mapped}


def _parts(main: int) -> dict:
    out: dict = _mallinfo()
    pa = sys.modules.get("pyarrow")
    if pa is not None:
        pool = pa.default_memory_pool()
        out["arrow_pool"], out["arrow_pool_max"] = pool.bytes_allocated(), pool.max_memory()
        out["arrow_backend"] = pool.backend_name
    st = sys.modules.get("dbsp_core.runtime.stage_task")
    if st is not None:
        mem = disk = 0
        for store in list(st._STORES.values()):
            try:
                m, kept = store.memory()
            except Exception:  # a trace changed under the scan: the next sample reads it
                continue
            mem += m + kept
            disk += store.disk_bytes()
        out["store_memory"], out["store_disk"] = mem, disk
        kix = rows = 0
        for e in list(st._CACHE.values()):
            for t in _traces(e.worker.stateful):
                kix += getattr(t, "index_bytes", 0)
                rows += sum(len(b) for b in t._levels() + t.pending)
        out["key_indexes"], out["trace_rows"] = kix, rows
    z = sys.modules.get("dbsp_core._zset")
    if z is not None and hasattr(z, "cached_bytes"):
        out["c_caches"] = list(z.cached_bytes())
    frame = sys._current_frames().get(main)
    if frame is not None:
        out["stack"] = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                        for f in traceback.extract_stack(frame)][-10:]
    return out


def _traces(stateful: dict) -> list:
    from dbsp_core.trace import Trace

    return [v for inst in stateful.values() for v in vars(inst).values() if isinstance(v, Trace)]


_COMMIT = {"apply", "_put_group", "_log_saves", "commit"}  # a frame of a stage task's commit (snapshot.py, stage_task.py)


def _in_commit(main: int) -> bool:
    f = sys._current_frames().get(main)
    while f is not None:
        if f.f_code.co_name in _COMMIT and f.f_code.co_filename.endswith(("snapshot.py", "stage_task.py",
                                                                          "database.py")):
            return True
        f = f.f_back
    return False


def _write(path: str, s: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(s, f)
    os.replace(path + ".tmp", path)


def _sample(out_dir: str, main: int) -> None:
    """The peak of the process, and the peak while a commit runs (``<pid>.commit.json``)."""
    peak = {"all": 0, "commit": 0}
    path = os.path.join(out_dir, f"{os.getpid()}")
    while True:
        s = _status()
        phase = "commit" if _in_commit(main) else None
        for name in ("all", phase):
            if name is not None and s["VmRSS"] > peak[name] + (1 << 20):
                peak[name] = s["VmRSS"]
                try:
                    s.update(_parts(main))
                except Exception as exc:  # noqa: BLE001 - a sample, never the task's failure
                    s["error"] = repr(exc)
                _write(path + (".json" if name == "all" else ".commit.json"), s)
        time.sleep(0.005)


def _start() -> None:
    out_dir = os.environ.get("BENCH_TASK_PEAK_DIR")
    if out_dir:  # a forked child (the pyspark daemon's Python workers): its task runs on this thread
        threading.Thread(target=_sample, args=(out_dir, threading.get_ident()), daemon=True).start()


if os.environ.get("BENCH_TASK_PEAK_DIR"):
    os.register_at_fork(after_in_child=_start)
