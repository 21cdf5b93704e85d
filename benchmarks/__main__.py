"""`python -m benchmarks [--quick] [--peers hf,llamacpp] [--scenarios ...] [--out DIR]`."""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.options import add_arguments
from benchmarks.runner import run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="verispec against HF transformers and llama.cpp on the bundled model, in one run",
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
