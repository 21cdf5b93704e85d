"""verispec side by side with its peers (HF transformers, llama.cpp): `python -m benchmarks`.

Not part of the installed package: run it from a checkout (docs/benchmarks.md). `verispec bench`
measures verispec alone."""
