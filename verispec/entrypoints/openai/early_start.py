"""What `verispec serve` starts before it imports its web stack: the engine core processes and the
tokenizer's load (with llguidance's view of it), so that all of them run beside those imports.

The core is the long pole of a warm start (it imports torch, 2 s here); started first, it loads
while the frontend imports FastAPI and uvicorn instead of after. Nothing here imports either.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass
from typing import Any

from verispec.config import EngineConfig
from verispec.engine.dp_client import DPEngineClient
from verispec.tokenization import TextEncoder, text_encoder

logger = logging.getLogger("verispec.server")


@dataclass(slots=True)
class EarlyStart:
    client: DPEngineClient
    tokenizer: cf.Future  # -> (tokenizer or None, its TextEncoder or None)


def start_early(engine: EngineConfig, data_parallel_size: int) -> EarlyStart:
    """Launches the cores and loads the tokenizer in a thread; the server's lifespan waits for both."""
    from verispec.models.default import default_model_path

    client = DPEngineClient(engine, data_parallel_size)
    client.launch()
    pool = cf.ThreadPoolExecutor(1, thread_name_prefix="verispec-tokenizer")
    tokenizer = pool.submit(load_tokenizer, engine.model or default_model_path())
    pool.shutdown(wait=False)
    return EarlyStart(client, tokenizer)


def load_tokenizer(path: str) -> tuple[Any, TextEncoder | None]:
    """The tokenizer and its encoder; llguidance's view of it is built now (0.4 s) for the
    tokenizer's own vocabulary and EOS, which the core's are nearly always: the core's ready
    message confirms them, and a model that differs builds it again then."""
    from verispec.models.tokenizer_cache import load_tokenizer as load
    from verispec.sample.grammar import llguidance_tokenizer

    tokenizer = load(path)
    if tokenizer is None:
        return None, None
    encoder = text_encoder(tokenizer)
    if tokenizer.eos_token_id is not None:
        try:
            llguidance_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
        except Exception as exc:  # noqa: BLE001 - only a head start: the first grammar says what is wrong
            logger.debug("llguidance's tokenizer was not built ahead: %s", exc)
    return tokenizer, encoder
