"""Crash isolation: a step that raises fails the request(s) at fault, not the whole batch."""

from __future__ import annotations

import logging
import traceback

from verispec.distributed.comm import WorkerDiedError
from verispec.worker.runner import ModelRunner
from verispec.core.step_types import SchedulerOutput, StepResult
from verispec.sample.grammar import GrammarFailed

logger = logging.getLogger("verispec")

# request id -> (error message, kind): "invalid" (the client's input, e.g. a grammar past its
# limits) or "internal"
Failures = dict[str, tuple[str, str]]


def execute_isolating_failures(runner: ModelRunner, sched: SchedulerOutput) -> tuple[StepResult, Failures]:
    """The step's results, and the requests that failed when the batch raised. A raising batch is
    run again one request at a time (`execute` never changes its input, so each solo run computes
    that request's share of the same step): those that raise alone fail, the rest keep their
    solo results."""
    try:
        return runner.execute(sched), {}
    except WorkerDiedError:  # the tensor-parallel group is gone: nothing to retry on
        raise
    except Exception as exc:  # noqa: BLE001 - isolated below; one request must not sink the batch
        logger.warning("engine step failed (%s: %s); retrying its %d requests one by one",
                       type(exc).__name__, exc, len(sched.scheduled))
        merged, failed = StepResult(), {}
        for s in sched.scheduled:
            part_exc = exc if len(sched.scheduled) == 1 else None
            if part_exc is None:
                try:
                    merged.update(runner.execute(sched.only(s)))
                except Exception as e:  # noqa: BLE001
                    part_exc = e
            if part_exc is not None:
                failed[s.request.request_id] = _failure(s.request.request_id, part_exc)
        return merged, failed


def _failure(request_id: str, exc: Exception) -> tuple[str, str]:
    if isinstance(exc, GrammarFailed):  # the client's grammar hit a limit: no bug to trace
        logger.warning("request %s failed: %s", request_id, exc)
        return str(exc), "invalid"
    logger.error("request %s failed: %s", request_id, "".join(traceback.format_exception(exc)))
    return f"{type(exc).__name__}: {exc}", "internal"
