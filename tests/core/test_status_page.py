"""The status page the metrics server serves, loaded in a real headless browser (Debian's chromium): it loads without console messages, shows a live pipeline's figures (the step count equals p.metrics()["steps"], refreshed as steps run) and puts view names into the DOM as text, never as markup.

DBSP_REQUIRE_CHROMIUM=1 (.ci/run) makes a missing chromium fail instead of skip; DBSP_STATUS_SCREENSHOT=<file.png>
also saves the page's screenshot there (how bench/status_page.png is made)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pyarrow as pa
import pytest

import dbsp_core as dbsp
from dbsp_core.circuit import Stream
from dbsp_core.connectors import SqliteSink
from dbsp_core.demo import HANDLE, Generator, build_circuit

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    if os.environ.get("DBSP_REQUIRE_CHROMIUM") == "1":
        raise RuntimeError("DBSP_REQUIRE_CHROMIUM=1 but there is no chromium on PATH (apt-get install chromium)")
    pytest.skip("no chromium on PATH (apt-get install chromium; DBSP_REQUIRE_CHROMIUM=1 fails instead)",
                allow_module_level=True)

# a view name that runs script if it ever enters the DOM as markup (its console.error would fail the test too)
EVIL = '<img src=x onerror="console.error(\'injected\')">'
CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\] (.*)")


def browse(url: str, tmp_path, budget_ms: int = 2500, screenshot: str | None = None) -> tuple[str, list[str]]:
    """Load ``url`` in headless chromium for ``budget_ms`` of virtual time; its DOM then (or, with
    ``screenshot``, a PNG written there) and every console message the page logged."""
    args = [CHROMIUM, "--headless=new", "--disable-gpu", "--no-sandbox", "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
            f"--virtual-time-budget={budget_ms}", "--window-size=1280,1500"]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    for attempt in range(2):
        # chromium's own start has hung past two minutes once under load 12 (a browser that never loaded the
        # page, not a page that failed): one more start then, and a second hang fails the test
        try:
            r = subprocess.run(args + [url], capture_output=True, text=True, timeout=120)
            break
        except subprocess.TimeoutExpired:
            if attempt:
                raise
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, [m.group(1) for m in CONSOLE.finditer(r.stderr)]


def _text(dom: str, elem_id: str) -> str:
    m = re.search(rf'id="{elem_id}"[^>]*>([^<]*)<', dom)
    assert m, f"no element #{elem_id} in the page"
    return html.unescape(m.group(1))


def test_the_console_capture_sees_errors(tmp_path) -> None:
    """The check below can fail: a page that logs an error and throws is caught."""
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>console.error('boom'); missing();</script></body></html>")
    _, console = browse(page.as_uri(), tmp_path, budget_ms=500)
    assert any("boom" in c for c in console) and any("missing is not defined" in c for c in console), console


def _push_batch(p: dbsp.Pipeline, gen: Generator) -> None:
    for stream, (rows, weights) in gen.batch().items():
        p.push(HANDLE[stream], dbsp.ZSet.from_arrow(rows, weights))


def _run_steps(p: dbsp.Pipeline, gen: Generator, n: int) -> None:
    p.rescale(3)
    for _ in range(n):
        _push_batch(p, gen)
        p.step()
        time.sleep(0.2)


def test_status_page_shows_the_live_pipeline(tmp_path) -> None:
    c = build_circuit()
    c.output(EVIL, Stream(c, c.inputs["bids"]).select(auction="auction").distinct())
    p = dbsp.Pipeline(c, workers=2, storage=str(tmp_path / "d"), checkpoint_interval=None)
    sink = SqliteSink(p, "top_bid", tmp_path / "top.db")
    gen = Generator(7, int(time.time() * 1000), 200)
    try:
        _, port = p.serve_metrics()
        url = f"http://127.0.0.1:{port}/?interval=250"
        for k in range(6):
            _push_batch(p, gen)
            p.step()
            if k % 3 == 2:
                p.checkpoint()
        sink.poll(limit=3)  # a sink some steps behind: its lag shows
        dom, console = browse(url, tmp_path)
        assert console == [], console  # no errors, and nothing else logged either
        m = p.metrics()
        assert _text(dom, "steps") == str(m["steps"]) == "6"
        assert int(re.search(r'data-polls="(\d+)"', dom).group(1)) >= 2  # it refreshes
        # views with their counts, the profile, the layout, the checkpoints, the sink's lag
        for name in c.outputs:
            assert f"<td>{html.escape(name, quote=False)}</td>" in dom, name
        for r in m["profile"]["operators"]:
            assert f"<td>{r['operator']}</td>" in dom
        assert "<td>worker 1</td>" in dom and "executor, 2 workers" in dom
        assert dom.count("<td>3</td>") + dom.count("<td>6</td>") >= 2  # checkpoints after steps 3 and 6
        lag = m["sink_lag_steps"]
        assert list(lag.values()) == [3]
        status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=10).read())
        assert status["metrics"]["steps"] == 6 and status["layout"]["shards_per_worker"] == \
            np.bincount(p.layout.shard_map.part_of_shard, minlength=2).tolist()
        # the view name is text in the DOM: escaped, and no <img> element was made
        assert html.escape(EVIL, quote=False) in dom and "<img" not in dom
        # live: a rescale and more steps while the page is open (the screenshot: a demo-like run), then
        # the page shows them
        stepper = threading.Thread(target=_run_steps, args=(p, gen, 3))
        stepper.start()
        png = str(tmp_path / "status.png")
        try:
            browse(url, tmp_path, screenshot=png)
        finally:
            stepper.join()
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        shot = os.environ.get("DBSP_STATUS_SCREENSHOT")
        if shot:
            shutil.copyfile(png, shot)
        dom, console = browse(url, tmp_path)
        assert console == [], console
        assert _text(dom, "steps") == str(p.metrics()["steps"]) == "9"
        assert "<td>worker 2</td>" in dom and "from_workers" in dom  # the layout and the rescale
    finally:
        sink.close()
        p.close()
