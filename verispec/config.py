"""Engine-wide configuration and its defaults.

Everything a user can set on `LLM(...)` lands in one `EngineConfig`; the engine's parts read it and
never look at keyword arguments themselves, so a default lives in exactly one place.
"""

from __future__ import annotations

import enum
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from verispec import envs

if TYPE_CHECKING:
    import torch


class LogprobsMode(str, enum.Enum):
    """Which scores a request's logprobs report: the model's raw scores or the processed ones (after
    the request's processors), each as logprobs or as logits."""

    RAW_LOGPROBS = "raw_logprobs"
    RAW_LOGITS = "raw_logits"
    PROCESSED_LOGPROBS = "processed_logprobs"
    PROCESSED_LOGITS = "processed_logits"

    @classmethod
    def parse(cls, value: "LogprobsMode | str") -> "LogprobsMode":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"logprobs_mode must be one of {valid}; got {value!r}") from None

    @property
    def is_raw(self) -> bool:
        return self in (LogprobsMode.RAW_LOGPROBS, LogprobsMode.RAW_LOGITS)

    @property
    def is_logprobs(self) -> bool:
        return self in (LogprobsMode.RAW_LOGPROBS, LogprobsMode.PROCESSED_LOGPROBS)


# Names of torch's dtypes, not the dtypes: the command line's --help builds from this module and
# does not import torch (2 s).
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "fp16": "float16"}


# Weight quantizations (the fast tier); see verispec.models.loader.load_checkpoint.
QUANTIZATIONS = ("gguf", "int4", "int8")


def parse_dtype(dtype: "str | torch.dtype | None") -> torch.dtype | None:
    """None stands for "auto": the engine resolves it from the checkpoint."""
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
        raise ValueError(f"dtype must be 'auto', float32, bfloat16 or float16; got {dtype}")
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"dtype must be one of {['auto'] + sorted(set(_DTYPES))}; got {dtype!r}")
    name = _dtype_name(dtype)
    return None if name is None else getattr(torch, name)


def parse_device(device: "str | torch.device") -> torch.device:
    import torch

    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    return dev


def _dtype_name(dtype: "str | torch.dtype | None") -> "str | torch.dtype | None":
    """A dtype's name, checked without torch; None for "auto". A torch.dtype (torch is imported
    already) goes through `parse_dtype`."""
    if dtype is None or dtype == "auto":
        return None
    if not isinstance(dtype, str):
        return parse_dtype(dtype)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {['auto'] + sorted(set(_DTYPES))}; got {dtype!r}")
    return _DTYPES[dtype]


def _device_name(device: "str | torch.device") -> "str | torch.device":
    """`parse_device`'s checks on the form of a name, without torch (CUDA's presence is the engine's)."""
    if not isinstance(device, str):
        return device
    if device != "auto" and not re.fullmatch(r"(cpu|cuda)(:\d+)?", device):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    return device


SPEC_METHODS = ("ngram", "draft_model", "layer_skip", "suffix", "dspark", "dflash")
MAX_SPECULATIVE_TOKENS = 32


@dataclass(slots=True)
class SpeculativeConfig:
    """`LLM(speculative_config={...})`, or this dataclass directly."""

    method: str = "ngram"
    # None: 3, or suffix_decoding_max_tree_depth for suffix decoding (vLLM's defaults).
    num_speculative_tokens: int | None = None
    # ngram: match lengths tried, longest first. One-token matches propose often and wrongly, and
    # every rejected draft row costs a verify row; 2..4 measured best here (docs/benchmarks.md).
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # draft_model: checkpoint with the target's tokenizer; dspark / dflash: the drafter (dspark: default
    # the one shipped for the default model, SmolLM2-135M-Instruct)
    model: str | None = None
    num_layers: int | None = None  # layer_skip: the target's first layers used as the draft
    # Per-request draft budgets decided on the device (spec_decode/adaptive.py).
    adaptive_verification: bool = False
    # [[num_tokens, seconds], ...]: the forward's cost table for adaptive verification; None
    # profiles the model at start-up.
    cost_table: list | None = None
    # Verification processes at most this many rows at a time (logits, processors, scores): it
    # bounds the step's [rows, vocab] temporaries. None: all rows at once.
    max_verify_rows_per_chunk: int | None = None
    # suffix (spec_decode/suffix.py), vLLM's names and defaults: how deep the trees hold each
    # suffix (the longest match, and the longest draft); finished requests whose outputs stay
    # in the global tree (0: no global tree); a draft's length at most this times its match
    # length; a branch followed only while the path's probability stays at least this.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # The global tree's memory bound: cached finished tokens (docs/benchmarks.md has the bytes
    # per token); the oldest requests leave first. Not in vLLM, whose bound is requests alone.
    suffix_decoding_max_cached_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        # dspark / dflash: None until the checkpoint's block says how many drafts it gives.
        if self.num_speculative_tokens is None and self.method not in ("dspark", "dflash"):
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth if self.method == "suffix" else 3

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, cls):
            if value is not None:
                value.validate()
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig; got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}; got {self.method!r}")
        if self.method == "suffix":
            self._validate_suffix()
        k = self.num_speculative_tokens
        block_default = k is None and self.method in ("dspark", "dflash")
        if not block_default and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]; got {k!r}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config.prompt_lookup_min and prompt_lookup_max must satisfy "
                f"1 <= min <= max; got {self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if not isinstance(self.adaptive_verification, bool):
            raise ValueError(
                f"speculative_config.adaptive_verification must be true or false; got {self.adaptive_verification!r}"
            )
        rows = self.max_verify_rows_per_chunk
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
            raise ValueError(f"speculative_config.max_verify_rows_per_chunk must be an integer >= 1; got {rows!r}")
        if self.cost_table is not None:
            table = self.cost_table
            ok = isinstance(table, (list, tuple)) and len(table) > 0 and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], int) and p[0] >= 1
                and isinstance(p[1], (int, float)) and p[1] > 0 for p in table
            )
            if not ok:
                raise ValueError(
                    "speculative_config.cost_table must be a non-empty list of [num_tokens >= 1, seconds > 0] pairs"
                )
        # dspark alone: the drafter shipped for the default model.
        if self.method in ("draft_model", "dflash") and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}")
        if self.method == "layer_skip" and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ValueError("speculative_config.num_layers must be an integer >= 1 for method 'layer_skip'")

    def _validate_suffix(self) -> None:
        def whole(name: str, low: int, high: int | None = None) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low or (high is not None and v > high):
                bound = f"in [{low}, {high}]" if high is not None else f"an integer >= {low}"
                raise ValueError(f"speculative_config.{name} must be {bound}; got {v!r}")

        whole("suffix_decoding_max_tree_depth", 1, 64)
        whole("suffix_decoding_max_cached_requests", 0)
        whole("suffix_decoding_max_cached_tokens", 0)
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_spec_factor must be > 0; got {factor!r}")
        if not isinstance(prob, (int, float)) or isinstance(prob, bool) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1]; got {prob!r}")


# Defaults shared by EngineConfig, LLM's keyword arguments and the command line.
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(slots=True, frozen=True)
class GrammarLimits:
    """What one request's grammar may cost. The engine core and the server's frontend check with
    the same values (`EngineConfig.grammar_limits`), so what the frontend accepts the core compiles."""

    max_bytes: int = 128 << 10  # the grammar's text: a schema as JSON, a regex, a grammar, the choices as JSON
    max_choices: int = 1000  # a choice list is one parser row, and llguidance's rows hold max_items_in_row
    timeout_s: float = 10.0  # the frontend's wall-clock bound on compiling and checking one grammar
    # llguidance's parser limits (llguidance.LLParserLimits), at its defaults.
    max_items_in_row: int = 2000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000
    max_grammar_size: int = 500_000


def _option(default: Any = None, help: str = "", *, factory=None, type=None, choices=None, user_default=MISSING,
            name: str | None = None, flags: tuple[str, ...] = ()):
    """An EngineConfig field that users set: `LLM(name=...)` and `--name` on the command line.
    `user_default` / `type`: the value as users write it, where it differs from the resolved one."""
    meta = {"help": help, "type": type, "choices": choices, "user_default": user_default, "name": name, "flags": flags}
    return field(default_factory=factory, metadata=meta) if factory is not None else field(default=default, metadata=meta)


@dataclass(slots=True)
class EngineConfig:
    """Resolved engine options. `LLM(**options)` and the command line's engine flags are derived
    from the fields made with `_option` (`user_options()`): names, defaults and help live here."""

    model: str | None = _option(None, "HF checkpoint dir or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
                                type=str)
    # None ("auto") until the engine resolves it from the checkpoint (loader.resolve_precision).
    dtype: torch.dtype | None = _option(
        None, "auto: a GGUF file runs quantized in bfloat16 (the fast tier), an HF checkpoint in its own dtype; "
        "float32 is the exact tier", type=str, choices=("auto", "float32", "bfloat16", "float16"), user_default="auto")
    quantization: str | None = _option(
        None, "weights stay packed: gguf keeps a GGUF file's blocks, int4/int8 round an HF checkpoint's "
        "(default: gguf for a GGUF file under dtype auto)", type=str, choices=QUANTIZATIONS)
    device: torch.device = _option(help="cpu, cuda or auto", factory=lambda: parse_device("cpu"), type=str,
                                   user_default="auto")
    max_model_len: int | None = _option(None, "longest sequence, prompt and output (default: the model's context)",
                                        type=int)
    max_num_seqs: int = _option(DEFAULT_MAX_NUM_SEQS, "requests in the running batch at most")
    max_num_batched_tokens: int = _option(DEFAULT_MAX_NUM_BATCHED_TOKENS, "tokens per engine step at most")
    block_size: int = _option(16, "tokens per KV cache block")
    # Pool size: an explicit block count wins over a byte budget; with neither, the pool holds
    # max_num_seqs full-length sequences, capped by kv_cache_bytes' default below.
    num_kv_blocks: int | None = _option(None, "KV cache pool size in blocks", type=int)
    kv_cache_bytes: int | None = _option(None, "KV cache pool size in bytes", type=int)
    seed: int = _option(0, "the seed of requests that give none")
    logprobs_mode: LogprobsMode = _option(
        LogprobsMode.RAW_LOGPROBS, "the scores logprobs report unless a request says otherwise", type=str,
        choices=tuple(m.value for m in LogprobsMode), user_default=LogprobsMode.RAW_LOGPROBS.value)
    max_logprobs: int = _option(20, "the most logprobs a request may ask for (-1: the whole vocabulary)")
    # Rows of logits processed at once when computing prompt logprobs; bounds peak memory.
    prompt_logprobs_chunk_rows: int = 32
    num_threads: int | None = _option(None, "torch threads of the engine (default: torch's)", type=int)
    speculative: SpeculativeConfig | None = _option(
        None, "speculative decoding as a dict (JSON on the command line), e.g. "
        '{"method": "ngram", "num_speculative_tokens": 4}', type=str, name="speculative_config")
    # True: never torch.compile the layer stack; the environment's compile switch makes it the
    # default (verispec/envs.py).
    enforce_eager: bool = _option(help="do not compile the layer stack (faster start-up, slower steps)",
                                  factory=lambda: not envs.compile_enabled())
    # Automatic prefix caching (core/prefix_cache.py), and the memory its cached prompt-logprob
    # rows may take (0: cache KV only).
    enable_prefix_caching: bool = _option(True, "reuse the KV (and prompt-logprob rows) of shared prompt prefixes")
    prompt_logprobs_cache_bytes: int = _option(64 << 20, "memory for prompt-logprob rows cached beside prefix "
                                                         "blocks (0: KV only)")
    # Ranks the model is sharded over (verispec/distributed, docs/scaling.md); 1: one process.
    tensor_parallel_size: int = _option(1, "ranks the model is sharded over. On one machine the engine starts "
                                           "them; across machines launch every rank with torchrun (docs/scaling.md)",
                                        flags=("-tp",))
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    # False: the compiled step only where its graphs are saved from an earlier start, no compile
    # worker (`verispec generate`: one answer ends before a first compile would).
    compile_missing: bool = True

    @classmethod
    def create(
        cls,
        *,
        dtype: "str | torch.dtype | None" = "auto",
        device: "str | torch.device" = "auto",
        logprobs_mode: "LogprobsMode | str" = LogprobsMode.RAW_LOGPROBS,
        speculative_config: "SpeculativeConfig | dict | None" = None,
        resolve: bool = True,
        **options,
    ) -> "EngineConfig":
        """From user-facing values (strings, dicts), as `LLM(...)` and `verispec serve` take them.
        An unknown option is a ValueError naming it. `resolve=False` (a server's frontend): dtype
        and device stay as written, checked in form only, and the engine resolves them
        (`validate`): the frontend never imports torch, and starts the core 2 s sooner."""
        known = {o.name for o in user_options()} | {"grammar_limits", "prompt_logprobs_chunk_rows", "compile_missing"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(
            dtype=parse_dtype(dtype) if resolve else _dtype_name(dtype),
            device=parse_device(device) if resolve else _device_name(device),
            logprobs_mode=LogprobsMode.parse(logprobs_mode),
            speculative=SpeculativeConfig.parse(speculative_config),
            **options,
        )

    def validate(self, resolve: bool = True) -> None:
        """Checks every option; `resolve`: dtype and device written as names become torch's."""
        if resolve and isinstance(self.dtype, str):
            self.dtype = parse_dtype(self.dtype)
        if resolve and isinstance(self.device, str):
            self.device = parse_device(self.device)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            choices = ", ".join(map(repr, QUANTIZATIONS))
            raise ValueError(f"quantization must be one of {choices} or None; got {self.quantization!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1; got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1; got {self.kv_cache_bytes}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false; got {self.enable_prefix_caching!r}")
        budget = self.prompt_logprobs_cache_bytes
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"prompt_logprobs_cache_bytes must be an integer >= 0; got {budget!r}")
        for name in ("max_bytes", "max_choices", "max_items_in_row"):
            value = getattr(self.grammar_limits, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"grammar_limits.{name} must be an integer >= 1; got {value!r}")
        if not self.grammar_limits.timeout_s > 0:
            raise ValueError(f"grammar_limits.timeout_s must be > 0; got {self.grammar_limits.timeout_s!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1; got {self.max_logprobs!r}")


@dataclass(frozen=True, slots=True)
class UserOption:
    """One engine option as users set it (EngineConfig.create's keyword arguments)."""

    name: str
    default: Any
    type: type
    help: str
    choices: tuple | None = None
    flags: tuple[str, ...] = ()  # short command-line aliases


def user_options() -> list[UserOption]:
    """EngineConfig's user-facing options, in field order."""
    out = []
    for f in fields(EngineConfig):
        meta = f.metadata
        if "help" not in meta:
            continue
        if meta["user_default"] is not MISSING:
            default = meta["user_default"]
        else:
            default = f.default if f.default is not MISSING else f.default_factory()
        kind = meta["type"] or type(default)
        out.append(UserOption(meta["name"] or f.name, default, kind, meta["help"], meta["choices"], meta["flags"]))
    return out
