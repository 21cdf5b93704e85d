"""One compiled graph of consecutive decoder layers (models/compile.py says how they are used).

- `layer_signature`: what a layer's graph depends on; `plan_pieces`: the model's layers as pieces
  that repeat a period, each piece's graph shared by the pieces with its key.
- `compile_piece`: Dynamo traces the piece once and Inductor compiles it (cpp_wrapper); a
  capturing backend keeps Inductor's library and the sources of its inputs.
- `LayerGraph`: that library called directly with a piece's tensors, gathered by those sources at
  every call: no frame evaluation, no guards, and an in-place weight update read as it is. Saved
  as the library's path and the sources, it loads in milliseconds without Dynamo or Inductor.
- `check_piece`: the graph against eager, bit for bit, at every warm-up size.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import torch

from verispec.models.attention import SeqSpan, attention_context, build_attention_metadata, enter_layer
from verispec.models.kv_cache_tensors import new_layer_cache
from verispec.models.linear import KERNEL_MAX_ROWS

# The compile (2 rows: no 0/1 specialisation), then the sizes that must not recompile: one row, the most rows.
WARM_UP_SIZES = (2, 1, KERNEL_MAX_ROWS)
# Layers per graph: each call of a graph costs some 40 us of Python and argument handling, and
# each layer in it some seconds of compiling the first time.
LAYERS_PER_GRAPH = 6


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


def _every_layer_forward(layers, x, cos, sin):
    """Every layer's output, the piece's last: a drafter reads some of them (`LlamaModel.capture_layers`).
    They are buffers of the graph anyway (each is the next layer's input), so returning them costs a
    handle each, where cutting the pieces at the layers read cost graph calls (0.5 ms of a 16 ms
    step, 8 pieces and 4 graphs against 5 and 1 for SmolLM2) and compiles."""
    outs = []
    for layer in layers:
        x = layer.forward(x, cos, sin)
        outs.append(x)
    return tuple(outs)


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

    def __call__(self, layers: tuple, x, cos, sin) -> list[torch.Tensor]:
        """The graph's outputs: the piece's output alone, or every layer's (`every`), the piece's last."""
        # What Inductor's own Python wrapper does: sizes as 0-d tensors, tensors as handles.
        args = [a if isinstance(a, torch.Tensor) else torch.tensor(a)
                for a in self._inputs({"layers": layers, "x": x, "cos": cos, "sin": sin})]
        return self._from_handles(self._entry(self._to_handles(args)))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"names": self.names, "binary": self.binary}))

    @staticmethod
    def save_refused(path: Path) -> None:
        """A piece whose graph did not give eager's bits: it runs eager."""
        path.write_text(json.dumps({"refused": True}))

    @classmethod
    def load(cls, path: Path) -> "LayerGraph | None":
        saved = json.loads(path.read_text())
        return None if saved.get("refused") else cls(saved["names"], saved["binary"])

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


def compile_piece(layers: tuple, model, block_size: int, every: bool = False) -> LayerGraph:
    """Traces and compiles consecutive `layers` at 2 rows (Dynamo, then Inductor); the graph is
    Inductor's own module, called without Dynamo or AOTAutograd around it. `every`: it returns
    every layer's output, not only the last."""
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
    body = _every_layer_forward if every else _layers_forward
    fn = types.FunctionType(body.__code__.replace(), body.__globals__, "layers_forward")
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


def check_piece(graph: LayerGraph, layers: tuple, model, block_size: int, every: bool = False) -> None:
    """The graph against eager at every warm-up size, bit for bit, each output (it also warms the
    graph up)."""
    for n in WARM_UP_SIZES:
        x, cos, sin = _sample(layers, model, n)
        outs = _on_own_cache(layers, model, block_size, n, lambda: graph(layers, x, cos, sin))
        expected = _on_own_cache(layers, model, block_size, n, lambda: _every_layer_forward(layers, x, cos, sin))
        expected = expected if every else expected[-1:]
        if len(outs) != len(expected) or not all(
                torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)) for a, b in zip(outs, expected)):
            raise RuntimeError(f"the compiled layers differ from eager at {n} rows")


def plan_pieces(layers, every: bool = False, per_graph: int = LAYERS_PER_GRAPH) -> list[tuple[int, int, tuple]]:
    """(start, end, key) for pieces of at most `per_graph` consecutive layers; a piece's key is its
    layers' signatures in order (and whether its graph returns `every` layer's output), and pieces
    with one key share a graph. The pieces repeat one period from an offset (a head and a tail
    apart), the period and offset chosen for the fewest graphs, then the fewest pieces (each call
    costs some 40 us a step): 30 identical layers are 5 x 6; 16 are 4 x 4 (one graph, not
    6 + 6 + 4, two); a Q4_K_M file's 16 layers, whose Q6_K down projections come every third layer
    between two at each end, are 2 + 6 + 6 + 2 (two graphs, not four)."""
    signatures = [layer_signature(layer) for layer in layers]
    tail = (("outputs", "every layer"),) if every else ()
    return [(a, b, tuple(signatures[a:b]) + tail) for a, b in _segment(signatures, 0, len(layers), per_graph)]


def _segment(signatures: list, lo: int, hi: int, per_graph: int) -> list[tuple[int, int]]:
    """The spans of layers lo..hi: the best of every period (half of per_graph up to it) and offset."""
    best: tuple[tuple[int, int], list] | None = None
    for period in range(min(hi - lo, (per_graph + 1) // 2), per_graph + 1):
        for offset in range(min(period, hi - lo)):
            starts = ([lo] if offset else []) + list(range(lo + offset, hi, period))
            spans = list(zip(starts, starts[1:] + [hi]))
            score = (len({tuple(signatures[a:b]) for a, b in spans}), len(spans))
            if best is None or score < best[0]:
                best = (score, spans)
    return best[1]


