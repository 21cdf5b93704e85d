"""A trainer's handle on a running `verispec serve` (docs/rl.md): pause, continue and weight
updates over HTTP, with the standard library only (a training process imports nothing of the
server). Errors come back as `ControlError` with the server's status and message.

    server = ServerControl("http://127.0.0.1:8000", api_key=key)
    server.push_weights(model.state_dict(), "checkpoints/step-12", weight_version=12)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path


class ControlError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class ServerControl:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 600.0):
        self.base_url, self.api_key, self.timeout = base_url.rstrip("/"), api_key, timeout

    def pause(self, mode: str = "wait") -> dict:
        """`abort`: unfinished requests end now; `wait`: returns once they finish; `keep`: holds them."""
        return self._post("/pause_generation", {"mode": mode})

    def resume(self) -> dict:
        return self._post("/continue_generation", {})

    def update_weights_from_disk(self, path: str | Path, weight_version: int | str | None = None) -> dict:
        """A safetensors file or directory the server can read; refused (409) while requests run."""
        return self._post("/update_weights_from_disk", {"model_path": str(path), "weight_version": weight_version})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weights", backend: str | None = None) -> dict:
        """Blocks until every rank has joined: call it beside the trainer's own
        `verispec.distributed.weight_group.trainer_weight_group` (a thread for one of the two)."""
        return self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: int | str | None = None) -> dict:
        """Announces the tensors; the trainer broadcasts them meanwhile (`broadcast_weights`)."""
        return self._post("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "weight_version": weight_version})

    def push_weights(self, state_dict: dict, directory: str | Path, weight_version: int | str | None = None,
                     mode: str = "wait") -> dict:
        """Saves `state_dict` (HF names) as safetensors in `directory`, pauses generation (`mode`),
        updates and continues, whatever happens; returns the update's answer."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors, seen = {}, set()
        for name, t in state_dict.items():
            if t.data_ptr() in seen:  # a tied head: the embedding already carries it
                continue
            seen.add(t.data_ptr())
            tensors[name] = t.detach().contiguous().cpu()
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        self.pause(mode)
        try:
            return self.update_weights_from_disk(directory, weight_version)
        finally:
            self.resume()

    def _post(self, path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            raise ControlError(exc.code, str(message)) from None
