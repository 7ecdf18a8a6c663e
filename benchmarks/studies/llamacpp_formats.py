"""Does another GGUF weight format make llama.cpp's verification cheaper on this CPU?

The speculative-decoding ceiling on llama.cpp is set by what a forward over m new tokens costs
against a one-token forward (``benchmarks/studies/speedup_ceiling.py``). The default pair ships as
Q4_K_M; llama.cpp's CPU matrix kernels differ by weight format, so a target in another format
might verify a block for less. This study re-quantises the target's GGUF with llama.cpp's own
``llama_model_quantize`` (from the Q4_K_M file: the weights are those values rounded again, so
Q8_0 is the Q4_K_M model to within 8-bit rounding and Q4_0 a coarser copy), then times forwards
over m = 1, 2, 3, 5, 9, 17 new tokens after a prefill of ``--prefill`` random tokens, every format
and block in turn for ``--rounds`` rounds (the first round warms up and is dropped), each block
rolled back after it. The draft's Q4_K_M one-token forward is timed the same way. The JSON
records the machine, the load average before and after, and when the run started.

The results file has ``forward_seconds`` keyed like ``bench_perf.py``'s
(``llamacpp-<format>/target/m=<m>``, medians; the draft under ``llamacpp-q4_k_m/draft/m=1``), so
the ceiling study reads it::

    python benchmarks/studies/llamacpp_formats.py --out benchmarks/results/llamacpp_formats_avx2.json
    python benchmarks/studies/speedup_ceiling.py benchmarks/results/llamacpp_formats_avx2.json \\
        --reference llamacpp-q4_k_m --out benchmarks/results/llamacpp_formats_ceiling_avx2.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openvino_compression import _lscpu, _run_clock  # noqa: E402  (the studies' CPU and run record)

BLOCKS = (1, 2, 3, 5, 9, 17)
#: re-quantised formats: name -> the ``LLAMA_FTYPE_MOSTLY_*`` constant's name
FORMATS = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def requantize(lib, source: Path, out: Path, ftype_name: str, threads: int) -> float:
    """Write ``source`` re-quantised to ``ftype_name`` at ``out``; the seconds it took."""
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, ftype_name)
    params.allow_requantize = True
    params.nthread = threads
    start = time.perf_counter()
    if lib.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {ftype_name}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="target", help="model spec of the target (its model.gguf is re-quantised)")
    parser.add_argument("--draft", default="draft")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=180)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from quickdraft.backends.llamacpp import LlamaGGUF, gguf_path_for, import_llama_cpp
    clock = _run_clock()
    lib = import_llama_cpp()
    source = gguf_path_for(args.target)
    draft = gguf_path_for(args.draft)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        files = {"q4_k_m": source}
        quantize_seconds = {}
        for name, ftype in FORMATS.items():
            files[name] = Path(tmp) / f"target-{name}.gguf"
            quantize_seconds[name] = requantize(lib, source, files[name], ftype, args.threads)
        models = {f"llamacpp-{name}/target": LlamaGGUF(path, n_ctx=1024, n_threads=args.threads)
                  for name, path in files.items()}
        models["llamacpp-q4_k_m/draft"] = LlamaGGUF(draft, n_ctx=1024, n_threads=args.threads)
        sizes = {name: path.stat().st_size for name, path in files.items()}
        prompt = rng.integers(100, 20000, args.prefill).tolist()
        for model in models.values():
            model.decode(prompt, 0, [False] * (args.prefill - 1) + [True])
        samples: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for key, model in models.items():
                for m in (BLOCKS if key.endswith("/target") else (1,)):
                    tokens = rng.integers(100, 20000, m).tolist()
                    start = time.perf_counter()
                    model.decode(tokens, args.prefill, [True] * m)
                    samples.setdefault(f"{key}/m={m}", []).append(time.perf_counter() - start)
                    model.remove_from(args.prefill)
        repack = {key: model.repack for key, model in models.items()}
        for model in models.values():
            model.close()
    forward = {key: statistics.median(v[1:]) for key, v in samples.items()}
    for name in files:
        row = {m: forward[f"llamacpp-{name}/target/m={m}"] for m in BLOCKS}
        print(f"{name:7s} {sizes[name] / 1e9:.2f} GB  " + "  ".join(
            f"m={m}: {1e3 * c:6.1f} ms ({c / row[1]:.2f}x)" for m, c in row.items()))
    print(f"draft q4_k_m one token: {1e3 * forward['llamacpp-q4_k_m/draft/m=1']:.1f} ms")
    Path(args.out).write_text(json.dumps({
        "command": "python benchmarks/studies/llamacpp_formats.py " + " ".join(sys.argv[1:]),
        **clock, "loadavg_after": os.getloadavg(),
        "machine": {**_lscpu(), "threads": args.threads},
        "llama_cpp_python": getattr(lib, "__version__", None), "prefill": args.prefill, "rounds": args.rounds,
        "file_bytes": sizes, "quantize_seconds": quantize_seconds, "repack": repack,
        "forward_seconds": forward, "samples": samples,
    }, indent=1))


if __name__ == "__main__":
    main()
