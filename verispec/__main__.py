"""`python -m verispec ...`: the `verispec` command (generate, serve, bench) under this interpreter,
as `torchrun -m verispec serve` and the benchmarks' server subprocesses start it."""

from verispec.entrypoints.cli import main

raise SystemExit(main())
