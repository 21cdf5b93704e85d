"""A server under test as a subprocess on a free loopback port: `verispec serve` or a peer's
(llama-server), started from its command line, ready once /health answers 200, stopped at the end."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


class Server:
    def __init__(self, args: list[str], log: Path):
        """`args`: the command line, with "{port}" where the port goes."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([a.replace("{port}", str(self.port)) for a in args], stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 900.0) -> "Server":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} (see {self._log.name})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"the server did not start within {timeout_s:.0f} s (see {self._log.name})")

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()
