"""A model error installed from the tests' side: any step whose flat batch feeds a given run of
token ids raises, as a model bug would. A run of several ids keeps random (fuzzed) prompts from
tripping it by chance.

In-process tests call `install(runner, tokens)`. A server's engine core is another process:
`python tests/faults.py serve ...` with `FAULT_TOKENS=1,2,3` runs `verispec serve` with the fault
installed at import, and the core process, started with spawn, imports this file as its main
module too, so it has the fault as well.
"""

from __future__ import annotations

import os
import sys

from verispec.worker.runner import ModelRunner

MESSAGE = "injected fault"


def contains_run(ids: list[int], run: list[int]) -> bool:
    n = len(run)
    return any(ids[i : i + n] == run for i, t in enumerate(ids) if t == run[0])


def faulty_build_batch(tokens: list[int], build=ModelRunner.build_batch):
    def build_batch(self, sched):
        batch = build(self, sched)
        if contains_run(batch.input_ids, tokens):
            raise RuntimeError(f"{MESSAGE}: tokens {tokens} in the batch")
        return batch
    return build_batch


def install(runner: ModelRunner, tokens: list[int]) -> None:
    """This runner's steps raise where their batch holds `tokens`."""
    runner.build_batch = faulty_build_batch(tokens).__get__(runner)


if os.environ.get("FAULT_TOKENS"):  # the server's processes: every runner gets the fault
    ModelRunner.build_batch = faulty_build_batch([int(t) for t in os.environ["FAULT_TOKENS"].split(",")])

if __name__ == "__main__":
    from verispec.entrypoints.cli import main

    sys.exit(main())
