"""Peak-memory probe for test_logprobs (run in its own process): prints peak RSS deltas as JSON."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import make_tiny_checkpoint, random_prompts  # noqa: E402
from verispec import LLM, SamplingParams  # noqa: E402


def status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def peak_delta(fn) -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS high-water mark (VmHWM)
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def main(path: str) -> None:
    try:  # the peak can be reset only where the kernel lets this process write clear_refs
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        print(json.dumps({"skip": f"cannot reset the peak RSS here: {exc}"}))
        return
    make_tiny_checkpoint(path, "llama", vocab_size=49152, max_position_embeddings=8192, num_hidden_layers=1)
    llm = LLM(path, max_model_len=8192)
    prompt = random_prompts(1, 4096, 4096, seed=15, vocab=49152)[0]
    run = lambda **kw: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, **kw), use_tqdm=False)  # noqa: E731
    modes = {
        "without": {},
        "raw_logprobs": {"prompt_logprobs": 20},
        "processed_logprobs": {"prompt_logprobs": 20, "logprobs_mode": "processed_logprobs", "top_p": 0.9, "top_k": 50},
    }
    for kw in modes.values():  # warm-up: a first use loads code (on CUDA, ~100 MiB of kernel images)
        run(**kw)
    peaks = {mode: peak_delta(lambda kw=kw: run(**kw)) for mode, kw in modes.items()}
    print(json.dumps(peaks))


if __name__ == "__main__":
    main(sys.argv[1])
