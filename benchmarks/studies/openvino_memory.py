"""Resident memory of OpenVINO exports against the bytes of their weights, under the CPU plugin's
loading options and with the backend's release of the weight file's pages.

The plugin repacks every weight into its own layout at the first inference; whether the original
weights stay resident beside that copy depends on how they were read. Each mode runs in a fresh
process: load the export, one 8-token forward, five one-token forwards, reading ``/proc/self/status``
(peak ``VmHWM``, anonymous and file-backed resident sets) after the load, after the first forward and
at the end:

* ``release``  the file memory-mapped and its pages given back once the plugin has its copy (how the
  openvino backend loads: ``OpenVINORunner(release_weights=True)``, :mod:`quickdraft.backends.openvino.pages`);
* ``mapped``  the file memory-mapped and left resident (``release_weights=False``);
* ``cache_write`` / ``cache_read``  with the plugin's model cache (``CACHE_DIR``), file left resident:
  the first process compiles and writes the cache, the second imports the compiled blob (memory-mapped);
* ``no_mmap``  ``ENABLE_MMAP`` off: the weights read into anonymous memory.

``--role pair`` measures the default configuration instead: ``Pipeline.from_specs("target", "draft",
backend="openvino")`` (int8 target, int4 draft with its 49,152-id head) and ``sd`` (K = 4) on a chat
prompt, 64 new tokens, in the modes ``release`` and ``mapped``.

    python benchmarks/studies/openvino_memory.py --out benchmarks/results/openvino_memory.json
    python benchmarks/studies/openvino_memory.py --role pair --out benchmarks/results/openvino_memory_pair.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("release", "mapped", "cache_write", "cache_read", "no_mmap")
PAIR_MODES = ("release", "mapped")


def _status() -> dict:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1e6  # kB -> GB
    return fields


def measure_pair(mode: str, threads: int) -> dict:
    """The default configuration (``sd`` on the openvino backend) in this process, in one mode."""
    import time

    import torch

    from quickdraft import Pipeline, SamplingParams
    from quickdraft.backends.openvino import runner as ov

    torch.set_num_threads(threads)
    ov.OpenVINORunner.__init__.__kwdefaults__["release_weights"] = mode == "release"
    t = time.perf_counter()
    pipe = Pipeline.from_specs("target", "draft", backend="openvino")
    load_seconds = time.perf_counter() - t
    after_load = _status()
    weight_bytes = sum(f.stat().st_size for runner in (pipe.target, pipe.draft) for f in runner.path.glob("*.bin"))
    out = pipe.generate(["Write a Python function that merges two sorted lists."], method="sd", k=4,
                        sampling=SamplingParams(temperature=0.0), max_new_tokens=64)
    end = _status()
    return {"mode": mode, "exports": [str(pipe.target.path), str(pipe.draft.path)], "weight_bytes": weight_bytes,
            "load_seconds": load_seconds, "new_tokens": out.metrics.new_tokens,
            "tokens_per_second": out.metrics.tokens_per_second, "after_load": after_load, "end": end,
            "peak_over_weights": end["VmHWM"] * 1e9 / weight_bytes}


def measure(mode: str, role: str, weights: str, cache_dir: str, threads: int) -> dict:
    """One mode in this process (call in a fresh one: the peak is per process)."""
    import time

    import torch

    from quickdraft.backends.openvino import export_for
    from quickdraft.backends.openvino import runner as ov

    path = export_for(role, weights)
    weight_bytes = sum(f.stat().st_size for f in path.glob("*.bin"))
    if mode.startswith("cache"):
        ov.core().set_property({"CACHE_DIR": cache_dir})
    if mode == "no_mmap":
        ov.core().set_property({"ENABLE_MMAP": False})
    t = time.perf_counter()
    run = ov.OpenVINORunner(path, role, n_threads=threads, release_weights=mode == "release")
    load_seconds = time.perf_counter() - t
    after_load = _status()
    run.reset(1)
    t = time.perf_counter()
    run.forward(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), logits_to_keep=1)
    first_seconds = time.perf_counter() - t
    after_first = _status()
    for _ in range(5):
        run.forward(torch.tensor([[9]]), logits_to_keep=1)
    end = _status()
    return {"mode": mode, "export": str(path), "weight_bytes": weight_bytes, "load_seconds": load_seconds,
            "first_forward_seconds": first_seconds, "after_load": after_load, "after_first_forward": after_first,
            "end": end, "peak_over_weights": end["VmHWM"] * 1e9 / weight_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="target", help="registry name of the model (default: target), "
                        "or 'pair': the default configuration generating")
    parser.add_argument("--weights", default="int8", help="export weights: int8 or int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in a child process
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        if args.role == "pair":
            print(json.dumps(measure_pair(args.mode, args.threads)))
        else:
            print(json.dumps(measure(args.mode, args.role, args.weights, args.cache_dir, args.threads)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from openvino_compression import _lscpu

    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for mode in PAIR_MODES if args.role == "pair" else MODES:
            out = subprocess.run([sys.executable, __file__, "--mode", mode, "--cache-dir", cache_dir, "--role", args.role,
                                  "--weights", args.weights, "--threads", str(args.threads), "--out", args.out],
                                 capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(f"{mode}: peak {rows[-1]['end']['VmHWM']:.2f} GB = {rows[-1]['peak_over_weights']:.2f}x the weights",
                  file=sys.stderr)
    import openvino

    result = {"command": "python benchmarks/studies/openvino_memory.py " + " ".join(sys.argv[1:]),
              "machine": {**_lscpu(), "threads": args.threads}, "openvino": openvino.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
