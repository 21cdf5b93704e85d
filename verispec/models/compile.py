"""The compiled step: graphs of consecutive decoder layers, built in the background.

Eager PyTorch pays a few microseconds of dispatch per op, and a decode step of a 30-layer model
runs about 1500 small ops: at batch 1 that costs as much as the int4 matmuls themselves. Compiled:
- Regional: the layers run as pieces of up to LAYERS_PER_GRAPH layers (models/layer_graph.py),
  one graph per distinct piece: SmolLM2's 30 layers are one graph called five times, a 1B
  Q4_K_M file's mixed down projections two. A graph call costs tens of microseconds;
  compiling costs seconds per layer in it, the first time. The layer a piece starts at comes from
  the attention context (`enter_layer`), never from the graph.
- Called directly: each graph is Inductor's library with the sources of its inputs; a step calls
  it with the piece's current tensors, with no Dynamo and no guards.
- One graph serves every step of 1 to KERNEL_MAX_ROWS rows (an unbacked size); longer steps
  (prefill chunks, where the matmuls dwarf the dispatch) run eager.
- The same bits: Inductor rounds each bf16 intermediate as eager does (`emulate_precision_casts`),
  the norms are verispec's op, the rotary tables come in computed eager, and every graph is
  checked against eager before it is used. So the engine switches from eager to compiled between
  any two steps: a request that spans the switch gets the tokens and logprobs of one that does not.
- In the background (`LayerGraphs.start`): worker processes (models/compile_worker.py; one per
  graph up to the cores, where the weights are mapped and so shared) rebuild the model, compile
  their share of its graphs at low priority and save them, keyed by the pieces' signatures;
  a thread here loads them (milliseconds) while the engine's eager steps answer, and the next
  step runs compiled. A model with the same layer shapes, another thread count or other batch
  limits loads the saved graphs at once (the C++ is single-threaded: `cpp.threads = 1`).
  `compile_missing=False` (a one-shot `verispec generate`) loads saved graphs, never compiles.
- Inductor's on-disk cache lives under verispec's cache, one directory per CPU capability: its
  keys do not include `ATEN_CPU_CAPABILITY`, and C++ generated for AVX2 fails to build at the
  portable level (and AVX-512 code would not run on an AVX2 machine).
- `enforce_eager=True` (the default where the environment switches compiling off, verispec/envs.py),
  or a machine without a C++ compiler runs eager; so does CUDA for now (untested there, and CUDA graphs are what a GPU step needs).
"""

from __future__ import annotations

import atexit
import getpass
import dataclasses
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.models.cpu_kernels import kernel_build
from verispec.models.kernel_compiler import cxx_compiler
from verispec.models.layer_graph import LayerGraph, check_piece, compile_piece, inductor_options, plan_pieces
from verispec.models.linear import KERNEL_MAX_ROWS
from verispec.models.loader import cache_dir

logger = logging.getLogger("verispec.compile")

def compile_wanted(enforce_eager: bool, device: torch.device) -> bool:
    """Whether to compile: on a CPU with a C++ compiler, unless asked for eager."""
    if enforce_eager:  # the environment may make it the default (verispec/envs.py)
        return False
    if device.type != "cpu":  # not yet run on a GPU, where CUDA graphs are the lever: eager until it is
        return False
    if cxx_compiler() is None:
        logger.warning("no C++ compiler found: the model runs eager (slower); install g++ to compile it")
        return False
    if kernel_build().building:  # a graph of torch's kernels would be thrown away at the next start
        logger.info("the model runs eager: its graphs are compiled for verispec's CPU kernels, not built yet")
        return False
    return True


def inductor_cache_dir() -> str:
    """Inductor's cache for this process's CPU capability; a $TORCHINDUCTOR_CACHE_DIR of the
    user's own is kept. Inductor writes its shared default into the variable on first use, so
    that value is replaced too: it would mix the levels' code."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    ours = str(cache_dir() / "inductor" / torch.backends.cpu.get_cpu_capability().lower())
    if current is None or (current != ours and _is_inductor_default(current)):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = ours
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _is_inductor_default(path: str) -> bool:
    """Whether `path` is Inductor's shared default (its rule, without importing Inductor, which
    costs seconds)."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return os.path.abspath(path) == os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + user))


@dataclass(frozen=True, slots=True)
class CompileSource:
    """How a compile worker process rebuilds the engine's model (models/compile_worker.py)."""

    model: str  # the checkpoint or GGUF file
    dtype: str  # "bfloat16", "float32", ...
    quantization: str | None
    rope_context: int
    block_size: int
    max_tokens: int = KERNEL_MAX_ROWS
    capture_layers: tuple[int, ...] = ()
    save_to: str = ""  # the directory the worker writes the graphs to


class LayerGraphs:
    """`model.compiled`: the graphs of a model's layers, built by `build` (at once) or `start` (in a
    background thread); `for_step` hands the model's forward its pieces once every graph is ready."""

    def __init__(self, model, block_size: int, max_tokens: int = KERNEL_MAX_ROWS, source: CompileSource | None = None):
        """source: how a worker process rebuilds the model, to compile there (`start`); without
        it, `start` compiles in its own thread."""
        self.model, self.block_size, self.max_tokens, self.source = model, block_size, max_tokens, source
        self._pieces: list[tuple[int, tuple, LayerGraph]] | None = None  # once every graph is built
        self._every = False  # the graphs return every layer's output (a drafter reads some)
        self._done = threading.Event()
        self._started = time.perf_counter()
        self._stop = False
        self.num_graphs = 0
        self.error: str | None = None
        self.seconds: float | None = None
        self._announced = False
        self._workers: list[subprocess.Popen] = []
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self._pieces is not None

    @property
    def every(self) -> bool:
        """Whether the graphs return every layer's output: a drafter reads some (`capture_layers`)."""
        return bool(self.model.capture_layers)

    def for_step(self, input_ids: torch.Tensor) -> list[tuple[int, tuple, LayerGraph]] | None:
        """Decode and verify steps, once the graphs are ready; a prefill chunk's matmuls dwarf its
        per-op overhead: eager. The graphs are built for inference tensors (the engine's) and for
        whether a drafter reads layers' outputs as it was then."""
        pieces = self._pieces
        if (pieces is None or input_ids.shape[0] > self.max_tokens or not input_ids.is_inference()
                or bool(self.model.capture_layers) != self._every):
            return None
        if not self._announced:  # the first step that runs compiled: between two steps, never inside one
            self._announced = True
            logger.info("the compiled step takes over from eager (the same bits; %d graph%s for %d layers)",
                        self.num_graphs, "" if self.num_graphs == 1 else "s", len(self.model.layers))
        return pieces

    def build(self, save: Path | None = None) -> None:
        """Compiles every piece's graph in this thread (Dynamo and Inductor), checks each against
        eager, and switches to them; `save`: a directory to write the graphs to. Raises if one fails."""
        self._switch(lambda i, layers: compile_piece(layers, self.model, self.block_size, self.every), save)

    def build_share(self, save: Path, share: int, shares: int) -> None:
        """A compile worker's part: graphs `share`, `share + shares`, ... of the plan (numbered as
        `_switch` numbers them), compiled, checked against eager and saved; no switch."""
        layers = list(self.model.layers)
        with torch.inference_mode():
            for i, first, end, _ in _graph_pieces(plan_pieces(layers, self.every)):
                if i % shares == share:
                    self._checked(lambda _, piece: compile_piece(piece, self.model, self.block_size, self.every), i,
                                  tuple(layers[first:end]), save)

    def load(self, directory: Path) -> None:
        """The graphs a worker saved for this model (no tracing: each is Inductor's module, its C++
        in Inductor's cache), checked against eager, then switched to."""
        self._switch(lambda i, layers: LayerGraph.load(directory / f"{i}.json"))

    def _switch(self, make, save: Path | None = None) -> None:
        inductor_cache_dir()
        start = time.perf_counter()
        layers, every = list(self.model.layers), self.every
        plan = plan_pieces(layers, every)
        graphs: dict[tuple, LayerGraph] = {}
        try:
            with torch.inference_mode():
                for i, first, end, key in _graph_pieces(plan):
                    if self._stop:
                        return
                    graphs[key] = self._checked(make, i, tuple(layers[first:end]), save)
            self.seconds, self.num_graphs, self._every = time.perf_counter() - start, len(graphs), every
            # One assignment: the engine's next step runs compiled.
            self._pieces = [(first, tuple(layers[first:end]), graphs[key]) for first, end, key in plan]
        finally:
            self._done.set()

    def _checked(self, make, i: int, piece: tuple, save: Path | None) -> LayerGraph | None:
        """Graph `i` for `piece`, or None where it does not give eager's bits: that piece runs eager,
        so a row computes alike on every path (Gemma 3's sliding layers in fp32 differ by an ulp)."""
        graph = make(i, piece)
        if graph is not None:
            try:
                check_piece(graph, piece, self.model, self.block_size, self.every)
            except RuntimeError as exc:
                logger.info("layers %d-%d run eager: %s", piece[0].index, piece[-1].index, exc)
                graph = None
        if save is not None:
            LayerGraph.save_refused(save / f"{i}.json") if graph is None else graph.save(save / f"{i}.json")
        return graph

    def saved(self) -> bool:
        """Whether a worker saved this model's graphs (they load in milliseconds)."""
        return self.source is not None and (self._saved() / "done").exists()

    def start(self) -> None:
        """Builds the graphs in the background: a worker process compiles them into the cache at low
        priority (unless they are saved already), then a thread here loads them; the model runs
        eager until then."""
        _running.add(self)
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="verispec-compile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self.source is None:
                self.build()
            elif self.saved() or self._compile_in_worker():
                self.load(self._saved())
            if self.ready:
                logger.info("compiled step ready in %.1f s (%d graph%s)", time.perf_counter() - self._started,
                            self.num_graphs, "" if self.num_graphs == 1 else "s")
        except Exception as exc:  # noqa: BLE001 - the engine stays eager, and says why
            self.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            logger.warning("the compiled step could not be built, the engine stays eager: %s", self.error)
        finally:
            self._done.set()

    def _saved(self) -> Path:
        """Where the worker saves this model's graphs, keyed by the pieces' signatures, the
        options, torch's and Python's versions: a model with the same layer shapes finds them."""
        plan = plan_pieces(list(self.model.layers), self.every)
        key = repr(([k for _, _, k in plan], sorted(inductor_options().items()), torch.__version__, sys.version,
                    self.max_tokens))
        return Path(inductor_cache_dir()) / "verispec-graphs" / hashlib.sha256(key.encode()).hexdigest()[:20]

    def _compile_in_worker(self) -> bool:
        """Runs models/compile_worker.py for this model, its graphs shared among `_num_workers`
        processes (a graph's Inductor code generation and C++ compile are one core's work each);
        whether they compiled every graph."""
        logger.info("compiling the decoder layers in the background, once for this model's layer shapes (about "
                    "a minute on 2 cores); eager steps answer meanwhile")
        save = self._saved()
        save.mkdir(parents=True, exist_ok=True)
        spec = json.dumps(dataclasses.asdict(dataclasses.replace(
            self.source, capture_layers=tuple(self.model.capture_layers), save_to=str(save))))
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache_dir())
        shares = self._num_workers()
        logs = [save.parent / f"worker-{i}.log" for i in range(shares)]
        self._workers = []
        for i, log in enumerate(logs):
            with open(log, "w") as out:
                worker = subprocess.Popen([sys.executable, "-m", "verispec.models.compile_worker", spec, str(i),
                                           str(shares)], stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env)
            self._workers.append(worker)
            try:  # at once, so that even its imports yield to the engine (it lowers itself again)
                os.setpriority(os.PRIO_PROCESS, worker.pid, 10)
            except OSError:
                pass
        codes = [w.wait() for w in self._workers]
        if self._stop:
            return False
        for code, log in zip(codes, logs):
            if code != 0:
                self.stop_workers()
                tail = " / ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-300:]
                raise RuntimeError(f"the compile worker exited with {code}: {tail} (log: {log})")
        (save / "done").touch()  # last: the engine loads only a complete set
        return True

    def _num_workers(self) -> int:
        """One worker per graph up to the cores this process may use. One alone where each would
        hold its own copy of the weights (the exact tiers decode them: 4.8 GB of fp32 for a 1B
        model); the fast tier's packed layouts are mapped, shared between the processes."""
        graphs = len({key for _, _, key in plan_pieces(list(self.model.layers), self.every)})
        shared = self.source is not None and self.source.quantization == "gguf" and self.source.dtype != "float32"
        return max(1, min(graphs, len(os.sched_getaffinity(0)))) if shared else 1

    def stop_workers(self) -> None:
        for worker in self._workers:
            if worker.poll() is None:
                worker.kill()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the background build (engine shutdown, interpreter exit): the worker at once, the
        loading thread at its next graph."""
        self._stop = True
        self.stop_workers()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        _running.discard(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the background build ends (built or failed); whether the graphs are ready."""
        self._done.wait(timeout)
        return self.ready



def _graph_pieces(plan: list[tuple[int, int, tuple]]) -> list[tuple[int, int, int, tuple]]:
    """(number, first, end, key) of each key's first piece, in the plan's order: the graphs' numbers,
    which name the files the workers save and the engine loads."""
    numbers: dict[tuple, int] = {}
    return [(numbers.setdefault(key, len(numbers)), first, end, key) for first, end, key in plan if key not in numbers]


def compiled_step(model, source: CompileSource, compile_missing: bool = True) -> LayerGraphs | None:
    """The model's compiled step, to `start`; None where only saved graphs are wanted
    (`compile_missing=False`: a one-shot answer) and none are saved: the model runs eager."""
    graphs = LayerGraphs(model, source.block_size, source.max_tokens, source)
    return graphs if compile_missing or graphs.saved() else None


# Background builds still running at interpreter exit are stopped first: a thread killed inside
# torch's C++ at exit aborts the process.
_running: "weakref.WeakSet[LayerGraphs]" = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
    for graphs in list(_running):
        graphs.stop()
