"""The compiled decoder layer: one Inductor graph per distinct layer shape, built in the background.

Eager PyTorch pays a few microseconds of dispatch per op, and a decode step of a 30-layer model
runs about 1500 small ops: at batch 1 that costs as much as the int4 matmuls themselves. Compiled:
- Regional: one graph per distinct layer signature (`layer_signature`: its modules' types,
  constants and tensor shapes; the layer's index is not one of them), reused by every layer of
  that signature. A model of identical layers compiles one graph, a Q4_K_M file two or three (its
  down projections mix Q4_K and Q6_K), and Inductor's on-disk cache serves every model and thread
  count with the same layer shapes (`cpp.dynamic_threads`: no per-thread-count C++).
- Called directly: Dynamo traces each graph once, and a capturing backend keeps Inductor's
  callable and the sources of its inputs (the layer's tensors by attribute path, the step's
  tensors and sizes). Each step then calls the callable with the layer's current tensors, with
  no frame evaluation and no guards (an in-place weight update is read as it is).
- Attention stays one opaque op (`verispec::attention`); the layer it serves comes from the
  attention context (`enter_layer`), so one graph serves every layer.
- The token count is an unbacked symbol: one graph serves every step of 1 to KERNEL_MAX_ROWS rows
  (decode, verify, short chunks). Longer steps (prefill chunks, where the matmuls dwarf the
  dispatch) run eager.
- Inductor rounds each bf16 intermediate as eager does (`emulate_precision_casts`), the bf16
  norms are verispec's op and the rotary tables come in computed eager: a layer gets the same bits
  compiled and eager. Each graph is checked for it before it is used, so the engine may switch
  from eager to compiled between any two steps: a request that spans the switch gets the tokens
  and logprobs of one that does not.
- In the background: `start` builds the graphs in a thread of lower priority (its compiler
  processes inherit it), with a cache and attention metadata of its own, while the engine's eager
  steps answer; the engine switches once every graph is ready, between steps.
- Inductor's on-disk cache lives under verispec's cache, one directory per CPU capability: its
  keys do not include `ATEN_CPU_CAPABILITY`, and C++ generated for AVX2 fails to build at the
  portable level (and AVX-512 code would not run on an AVX2 machine).
- `enforce_eager=True` (the default where the environment switches compiling off, verispec/envs.py),
  or a machine without a C++ compiler runs eager; so does CUDA for now (untested there, and CUDA graphs are what a GPU step needs).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.models.attention import SeqSpan, attention_context, build_attention_metadata, enter_layer, new_layer_cache
from verispec.models.cpu_kernels import cxx_compiler
from verispec.models.linear import KERNEL_MAX_ROWS
from verispec.models.loader import cache_dir

logger = logging.getLogger("verispec.compile")

# The compile (2 rows: no 0/1 specialisation), then the sizes that must not recompile: one row, the most rows.
WARM_UP_SIZES = (2, 1, KERNEL_MAX_ROWS)
# Layers per graph: each call of a graph costs some 40 us of Python and argument handling, and
# each layer in it some seconds of compiling the first time.
LAYERS_PER_GRAPH = 6


def compile_wanted(enforce_eager: bool, device: torch.device) -> bool:
    """Whether to compile: on a CPU with a C++ compiler, unless asked for eager."""
    if enforce_eager:  # the environment may make it the default (verispec/envs.py)
        return False
    if device.type != "cpu":  # not yet run on a GPU, where CUDA graphs are the lever: eager until it is
        return False
    if cxx_compiler() is None:
        logger.warning("no C++ compiler found: the model runs eager (slower); install g++ to compile it")
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
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # imports Inductor: only where needed

    return os.path.abspath(path) == os.path.abspath(default_cache_dir())


def inductor_options() -> dict:
    """cpp_wrapper: the kernels called from C++, not from a Python wrapper. emulate_precision_casts:
    fused bf16 ops round each intermediate as eager does. cpp.threads = 1: the graph's own kernels
    (norm inputs, rotary, activations, residuals: a few thousand values a row) run on one thread,
    as fast as on two at decode sizes, with no parallel region to wait on, and the C++ does not
    depend on the thread count, so a new `num_threads` reuses the cache. The matmuls and
    attention are verispec's ops and use every thread."""
    return {"cpp_wrapper": True, "emulate_precision_casts": True, "cpp.threads": 1}


def layer_signature(layer: torch.nn.Module) -> tuple:
    """What a layer's graph depends on: each submodule's type, its constants (ints, floats,
    strings, flags, functions) and its tensors' shapes and dtypes. The index is left out: the
    attention context supplies it."""
    parts = []
    for name, module in layer.named_modules():
        parts.append((name, type(module).__qualname__))
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or attr == "index":
                continue
            if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
                parts.append((name, attr, value))
            elif isinstance(value, functools.partial):
                parts.append((name, attr, value.func.__qualname__, tuple(sorted(value.keywords.items()))))
            elif callable(value) and not isinstance(value, torch.nn.Module):
                parts.append((name, attr, getattr(value, "__qualname__", repr(value))))
        for tname, t in [*module._parameters.items(), *module._buffers.items()]:
            parts.append((name, tname, None if t is None else (tuple(t.shape), t.stride(), t.dtype)))
    return tuple(parts)


def _layers_forward(layers, x, cos, sin):
    for layer in layers:
        x = layer.forward(x, cos, sin)
    return x


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


class LayerGraph:
    """Inductor's compiled C++ for one piece signature (the library its cpp_wrapper builds, with
    one entry taking the inputs as tensor handles), and the sources of its inputs, by which a
    piece's own are gathered at each call. Loading it needs neither Dynamo nor Inductor."""

    ENTRY = "inductor_entry_cpp"

    def __init__(self, names: list[str], binary: str):
        if not all(n.startswith("L[") for n in names):
            raise RuntimeError(f"a graph input is not a piece's: {[n for n in names if not n.startswith('L[')]}")
        self.names, self.binary = names, binary  # Dynamo's input sources in the graph's order; the library
        # One function that evaluates the sources (`L['layers'][0]._modules['qkv']._buffers['codes']`,
        # `L['x'].size()[0]`) against the call's locals.
        self._inputs = eval(f"lambda L: [{', '.join(names)}]", {"__builtins__": {}})  # noqa: S307 - Dynamo's own
        self._entry = _load_entry(binary, self.ENTRY)
        self._to_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
        self._from_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs

    def __call__(self, layers: tuple, x, cos, sin):
        # What Inductor's own Python wrapper does: sizes as 0-d tensors, tensors as handles.
        args = [a if isinstance(a, torch.Tensor) else torch.tensor(a)
                for a in self._inputs({"layers": layers, "x": x, "cos": cos, "sin": sin})]
        return self._from_handles(self._entry(self._to_handles(args)))[0]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"names": self.names, "binary": self.binary}))

    @classmethod
    def load(cls, path: Path) -> "LayerGraph":
        saved = json.loads(path.read_text())
        return cls(saved["names"], saved["binary"])

    @classmethod
    def of_module(cls, names: list[str], code: str) -> "LayerGraph":
        """From Inductor's output module (its source loads the library from Inductor's cache)."""
        module = types.ModuleType("verispec_layer_graph")
        exec(compile(code, "<verispec layer graph>", "exec"), module.__dict__)  # noqa: S102 - Inductor's output
        return cls(names, module.inductor_entry.__self__.__file__)


def _load_entry(binary: str, entry: str):
    """The entry of a library Inductor's cpp_wrapper built (a Python extension whose init reads
    the address of torch's tensor-data hook from the environment, as Inductor's loader sets it)."""
    os.environ["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(
        torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
    name = f"verispec_graph_{hashlib.sha256(binary.encode()).hexdigest()[:16]}.{entry}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, binary)
        if spec is None or not os.path.exists(binary):
            raise FileNotFoundError(f"the compiled layers' library is gone: {binary}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return getattr(module, entry)


def _source_name(node) -> str:
    source = node.meta["grapharg"].source
    return source.name() if callable(source.name) else source.name


def compile_piece(layers: tuple, model, block_size: int) -> LayerGraph:
    """Traces and compiles consecutive `layers` at 2 rows (Dynamo, then Inductor); the graph is
    Inductor's own module, called without Dynamo or AOTAutograd around it."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    captured = []

    def capture(gm, example_inputs):
        names = [_source_name(n) for n in gm.graph.find_nodes(op="placeholder")]

        def inner(*args, **kwargs):
            out = compile_fx_inner(*args, **kwargs)
            captured.append(LayerGraph.of_module(names, out.source_code))
            return out

        return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=inductor_options())

    # A fresh code object: Dynamo keeps its cache on the code, and this graph is this signature's.
    fn = types.FunctionType(_layers_forward.__code__.replace(), _layers_forward.__globals__, "layers_forward")
    traced = torch.compile(fn, backend=capture, dynamic=True, fullgraph=True)
    x, cos, sin = _sample(layers, model, WARM_UP_SIZES[0])
    torch._dynamo.decorators.mark_unbacked(x, 0)
    for t in (cos, sin):  # [tables, T, 1, rotary dims]
        torch._dynamo.decorators.mark_unbacked(t, 1)
    # The model's float constants (norm eps, rope, attention scale) never change: traced as
    # symbols, they would make Dynamo trace the layers a second time.
    # AOTAutograd's own cache would hand back a callable without Inductor's module: off, so that
    # `inner` sees the module even when Inductor's cache has it.
    with torch._dynamo.config.patch(specialize_float=True), torch._functorch.config.patch(enable_autograd_cache=False):
        _on_own_cache(layers, model, block_size, x.shape[0], lambda: traced(layers, x, cos, sin))
    if len(captured) != 1:
        raise RuntimeError(f"the layers compiled to {len(captured)} graphs, not one")
    return captured[0]


def _sample(layers: tuple, model, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded hidden states for `n` rows, and the rotary tables."""
    dev = model.embed.device
    x = torch.randn(n, layers[0].o_rows, generator=torch.Generator(device=dev).manual_seed(n), device=dev)
    return (x.to(model.dtype), *model.rope(torch.arange(n, device=dev) + 7))


def _on_own_cache(layers: tuple, model, block_size: int, n: int, run):
    """`run()` for `n` rows in the attention context of a cache of its own (another thread may be
    stepping the engine's)."""
    first, blocks = layers[0], -(-KERNEL_MAX_ROWS // block_size)
    caches = [new_layer_cache(blocks, block_size, first.num_kv_heads, first.head_dim, model.dtype, model.embed.device)
              for _ in layers]
    meta = build_attention_metadata([SeqSpan(0, n, n, list(range(blocks)))], block_size, model.embed.device,
                                    model.dtype)
    with attention_context(meta, caches):
        enter_layer(0)
        return run()


def check_piece(graph: LayerGraph, layers: tuple, model, block_size: int) -> None:
    """The graph against eager at every warm-up size, bit for bit (it also warms the graph up)."""
    for n in WARM_UP_SIZES:
        x, cos, sin = _sample(layers, model, n)
        out = _on_own_cache(layers, model, block_size, n, lambda: graph(layers, x, cos, sin))
        expected = _on_own_cache(layers, model, block_size, n, lambda: _layers_forward(layers, x, cos, sin))
        if not torch.equal(out.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)):
            raise RuntimeError(f"the compiled layers differ from eager at {n} rows")


def plan_pieces(layers, cuts: set[int], per_graph: int = LAYERS_PER_GRAPH) -> list[tuple[int, int, tuple]]:
    """(start, end, key) for runs of consecutive layers of one signature, cut after every layer in
    `cuts` (a drafter reads their outputs) and into pieces of at most `per_graph` layers. Pieces
    with the same key share a graph."""
    pieces, start = [], 0
    signatures = [layer_signature(layer) for layer in layers]
    for i in range(len(layers)):
        last = i + 1 == len(layers)
        if last or i in cuts or i + 1 - start == per_graph or signatures[i + 1] != signatures[i]:
            pieces.append((start, i + 1, (signatures[i], i + 1 - start)))
            start = i + 1
    return pieces


class LayerGraphs:
    """`model.compiled`: the graphs of a model's layers, built by `build` (at once) or `start` (in a
    background thread); `for_step` hands the model's forward its pieces once every graph is ready."""

    def __init__(self, model, block_size: int, max_tokens: int = KERNEL_MAX_ROWS, source: CompileSource | None = None):
        """source: how a worker process rebuilds the model, to compile there (`start`); without
        it, `start` compiles in its own thread."""
        self.model, self.block_size, self.max_tokens, self.source = model, block_size, max_tokens, source
        self._pieces: list[tuple[int, tuple, LayerGraph]] | None = None  # once every graph is built
        self._cuts: tuple[int, ...] = ()
        self._done = threading.Event()
        self._started = time.perf_counter()
        self._stop = False
        self.num_graphs = 0
        self.error: str | None = None
        self.seconds: float | None = None
        self._announced = False
        self._worker: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._compile_missing = True

    @property
    def ready(self) -> bool:
        return self._pieces is not None

    def for_step(self, input_ids: torch.Tensor) -> list[tuple[int, tuple, LayerGraph]] | None:
        """Decode and verify steps, once the graphs are ready; a prefill chunk's matmuls dwarf its
        per-op overhead: eager. The graphs are built for inference tensors (the engine's) and for
        the layers a drafter reads as they were then."""
        pieces = self._pieces
        if (pieces is None or input_ids.shape[0] > self.max_tokens or not input_ids.is_inference()
                or self.model.capture_layers != self._cuts):
            return None
        if not self._announced:  # the first step that runs compiled: between two steps, never inside one
            self._announced = True
            logger.info("the compiled step takes over from eager (the same bits; %d graph%s for %d layers)",
                        self.num_graphs, "" if self.num_graphs == 1 else "s", len(self.model.layers))
        return pieces

    def build(self, save: Path | None = None) -> None:
        """Compiles every piece's graph in this thread (Dynamo and Inductor), checks each against
        eager, and switches to them; `save`: a directory to write the graphs to. Raises if one fails."""
        self._switch(lambda i, layers: compile_piece(layers, self.model, self.block_size), save)

    def load(self, directory: Path) -> None:
        """The graphs a worker saved for this model (no tracing: each is Inductor's module, its C++
        in Inductor's cache), checked against eager, then switched to."""
        self._switch(lambda i, layers: LayerGraph.load(directory / f"{i}.json"))

    def _switch(self, make, save: Path | None = None) -> None:
        inductor_cache_dir()
        start = time.perf_counter()
        layers, cuts = list(self.model.layers), tuple(self.model.capture_layers)
        plan = plan_pieces(layers, set(cuts))
        graphs: dict[tuple, LayerGraph] = {}
        try:
            with torch.inference_mode():
                for first, end, key in plan:
                    if self._stop:
                        return
                    if key not in graphs:
                        piece = tuple(layers[first:end])
                        graphs[key] = graph = make(len(graphs), piece)
                        check_piece(graph, piece, self.model, self.block_size)
                        if save is not None:
                            graph.save(save / f"{len(graphs) - 1}.json")
            self.seconds, self.num_graphs, self._cuts = time.perf_counter() - start, len(graphs), cuts
            # One assignment: the engine's next step runs compiled.
            self._pieces = [(first, tuple(layers[first:end]), graphs[key]) for first, end, key in plan]
        finally:
            self._done.set()

    def start(self, compile_missing: bool = True) -> None:
        """Builds the graphs in the background: a worker process compiles them into the cache at low
        priority (unless they are saved already, or not `compile_missing`), then a thread here loads
        them; the model runs eager until then."""
        self._compile_missing = compile_missing
        _running.add(self)
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="verispec-compile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            saved = self.source is not None and (self._saved() / "done").exists()
            if self.source is None:
                self.build()
            elif saved or (self._compile_missing and self._compile_in_worker()):
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
        plan = plan_pieces(list(self.model.layers), set(self.model.capture_layers))
        key = repr(([k for _, _, k in plan], sorted(inductor_options().items()), torch.__version__, sys.version,
                    self.max_tokens))
        return Path(inductor_cache_dir()) / "verispec-graphs" / hashlib.sha256(key.encode()).hexdigest()[:20]

    def _compile_in_worker(self) -> bool:
        """Runs models/compile_worker.py for this model; whether it compiled every graph."""
        logger.info("compiling the decoder layers in the background, once for this model's layer shapes (about "
                    "a minute on 2 cores); eager steps answer meanwhile")
        log = self._saved().parent / "worker.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        spec = json.dumps(dataclasses.asdict(dataclasses.replace(
            self.source, capture_layers=tuple(self.model.capture_layers), save_to=str(self._saved()))))
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache_dir())
        with open(log, "w") as out:
            self._worker = subprocess.Popen([sys.executable, "-m", "verispec.models.compile_worker", spec],
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            try:  # at once, so that even its imports yield to the engine (it lowers itself again)
                os.setpriority(os.PRIO_PROCESS, self._worker.pid, 10)
            except OSError:
                pass
            code = self._worker.wait()
        if self._stop:
            return False
        if code != 0:
            tail = " / ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-300:]
            raise RuntimeError(f"the compile worker exited with {code}: {tail} (log: {log})")
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the background build (engine shutdown, interpreter exit): the worker at once, the
        loading thread at its next graph."""
        self._stop = True
        if self._worker is not None and self._worker.poll() is None:
            self._worker.kill()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        _running.discard(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the background build ends (built or failed); whether the graphs are ready."""
        self._done.wait(timeout)
        return self.ready



# Background builds still running at interpreter exit are stopped first: a thread killed inside
# torch's C++ at exit aborts the process.
_running: "weakref.WeakSet[LayerGraphs]" = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
    for graphs in list(_running):
        graphs.stop()
