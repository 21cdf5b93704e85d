"""Starts `verispec serve` in a subprocess on a free port, for tests that talk to a real server."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, startup_timeout: float = 300.0,
                 env: dict[str, str] | None = None, fault_tokens: list[int] | None = None):
        """`fault_tokens`: the server runs with tests/faults.py's model error on that run of ids."""
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="verispec-serve-", suffix=".log", delete=False)
        entry = [str(Path(__file__).with_name("faults.py"))] if fault_tokens else ["-m", "verispec.entrypoints.cli"]
        cmd = [sys.executable, *entry, "serve", "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        if fault_tokens:
            env["FAULT_TOKENS"] = ",".join(map(str, fault_tokens))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait(startup_timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"verispec serve exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"verispec serve did not become healthy in {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-5000:]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, body, **kw) -> requests.Response:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        headers = {"Content-Type": "application/json", **self.headers, **kw.pop("headers", {})}
        return requests.post(self.url + path, data=data, headers=headers, timeout=kw.pop("timeout", 120), **kw)

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, headers={**self.headers, **kw.pop("headers", {})},
                            timeout=kw.pop("timeout", 30), **kw)

    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: metric name -> value (the last sample of each name wins)."""
        out = {}
        for line in self.get("/metrics").text.splitlines():
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(3))
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Waits until no request runs and every KV block is free; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["verispec:num_requests_running"] == 0 and m["verispec:num_requests_waiting"] == 0
                    and m["verispec:kv_cache_blocks_free"] == m["verispec:kv_cache_blocks_total"])
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        os.unlink(self.log.name)


def sse_events(response: requests.Response) -> list:
    """The JSON payloads of an SSE response, up to (not including) [DONE]; asserts [DONE] came."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):]
        if payload == b"[DONE]":
            return events
        events.append(json.loads(payload))
    raise AssertionError("stream ended without [DONE]")
