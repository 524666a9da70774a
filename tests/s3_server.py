"""A throwaway S3-compatible server for the tests: moto's server (``moto[server]``, in the test extras) as its own
process on 127.0.0.1 at a free port, with dummy credentials in the environment the way a real deployment gives
them (``AWS_ACCESS_KEY_ID`` ...), stopped afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "dbsp-test-key", "AWS_SECRET_ACCESS_KEY": "dbsp-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def available() -> str | None:
    """None when the server can start here, else why not."""
    try:
        import moto.server  # noqa: F401
    except ImportError as e:
        return f"moto's server is not installed (pip install 'moto[server]'): {e}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """One running server. :meth:`bucket` makes a new bucket; :meth:`uri` names a prefix in it as users write it."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        # its log (a line per request) goes to a file: a pipe nobody drains fills up after some 64 KiB of requests
        # and then blocks the server in the middle of a reply
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    err = self.log.read().decode(errors="replace")[-2000:]
                    self.stop()
                    raise RuntimeError(f"moto's S3 server did not start on {self.endpoint}: {err}")
                time.sleep(0.1)
        os.environ.update(CREDENTIALS)

    def filesystem(self):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", region="us-east-1")

    def bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:12]}"
        import pyarrow.fs as pafs

        pafs.S3FileSystem(endpoint_override=self.endpoint, scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir(name)
        return name

    def uri(self, bucket: str, prefix: str = "") -> str:
        path = f"{bucket}/{prefix}".rstrip("/")
        return f"s3://{path}?endpoint_override={self.endpoint}&scheme=http&region=us-east-1"

    def requests(self) -> dict[str, int]:
        """Requests served so far, from the server's log: by HTTP method, and ``objects written`` (a PUT of a whole
        object, or the start of a multipart upload, as pyarrow's output streams write: POST ?uploads, PUT a part,
        POST to complete)."""
        import re

        fd = self.log.fileno()  # read with pread: the server writes through the same file offset
        raw = os.pread(fd, os.fstat(fd).st_size, 0)
        text = re.sub(r"\x1b\[[0-9;]*m", "", raw.decode(errors="replace"))
        got: dict[str, int] = {}
        for method, target in re.findall(r'"([A-Z]+) (\S+) HTTP/', text):
            got[method] = got.get(method, 0) + 1
            if (method == "POST" and target.endswith("?uploads")) or (method == "PUT" and "?" not in target
                                                                       and target.count("/") > 1):
                got["objects written"] = got.get("objects written", 0) + 1
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
