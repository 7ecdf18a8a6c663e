"""Cost of one linear layer of the target (1536 -> 8960, the MLP's up projection) against the number
of tokens ``m`` it processes at once, for every kernel torch offers here: fp32 ``nn.Linear`` (MKL),
fp32 on oneDNN with a packed weight (:mod:`quickdraft.backends.packed`), bf16 ``nn.Linear``, and the
weight-only int8 / int4 layers of :mod:`quickdraft.backends.quant` -- int8 both on quickdraft's AVX2 kernel
(:mod:`quickdraft.backends.int8kernel`, what ``Int8Linear`` runs for float32) and on torch's
``_weight_int8pack_mm``. Kernels are interleaved within each repeat; the figure is the median over
repeats. ``GBps`` is the weight bytes each kernel reads divided by its time.

Speculative decoding needs the cost at ``m = K + 1`` to stay near the cost at ``m = 1``.

    python benchmarks/bench_linear.py --out benchmarks/results/linear_kernels.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from quickdraft.backends import int8kernel
from quickdraft.models import cpu_flags
from quickdraft.backends.packed import PackedLinear
from quickdraft.backends.quant import Int4Linear, Int8Linear


def kernels(in_features: int, out_features: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    bf16 = torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    bf16.weight.data.copy_(linear.weight.data)
    int8 = Int8Linear.from_linear(linear)
    codes, scales = int8.int8_weight(), int8.scales[:out_features].contiguous()
    out = {
        "fp32 (MKL)": (linear, torch.float32),
        "fp32 packed (oneDNN)": (PackedLinear.from_linear(linear), torch.float32),
        "bf16": (bf16, torch.bfloat16),
        "int8 (torch)": (lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scales), torch.float32),
        "int4": (Int4Linear.from_linear(linear, 128), torch.float32),
    }
    if int8kernel.available():
        out["int8 (quickdraft AVX2)"] = (int8, torch.float32)
    return out


#: bytes of weight each kernel reads per call, per weight
BYTES_PER_WEIGHT = {"fp32 (MKL)": 4, "fp32 packed (oneDNN)": 4, "bf16": 2, "int8 (torch)": 1, "int4": 0.5,
                    "int8 (quickdraft AVX2)": 1}


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    ks = kernels(args.in_features, args.out_features)
    times: dict[str, dict[int, list[float]]] = {name: {m: [] for m in args.ms} for name in ks}
    for m in args.ms:
        x = torch.randn(m, args.in_features)
        for name, (layer, dtype) in ks.items():  # warm-up
            layer(x.to(dtype))
        for _ in range(args.repeats):
            for name, (layer, dtype) in ks.items():
                xx = x.to(dtype)
                t = time.perf_counter()
                layer(xx)
                times[name][m].append(time.perf_counter() - t)
    weights = args.in_features * args.out_features
    result = {
        "command": "python benchmarks/bench_linear.py " + " ".join(sys.argv[1:]),
        "cpu": platform.processor() or platform.machine(),
        "avx512": any(f.startswith("avx512") for f in cpu_flags()), "threads": args.threads,
        "torch": torch.__version__, "layer": [args.in_features, args.out_features], "repeats": args.repeats,
        "median_ms": {name: {str(m): 1000 * float(np.median(v)) for m, v in by_m.items()} for name, by_m in times.items()},
    }
    result["ratio_to_m1"] = {
        name: {m: v / by_m[str(args.ms[0])] for m, v in by_m.items()} for name, by_m in result["median_ms"].items()
    }
    result["GBps"] = {
        name: {m: BYTES_PER_WEIGHT[name] * weights / (v / 1000) / 1e9 for m, v in by_m.items()}
        for name, by_m in result["median_ms"].items()
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-features", type=int, default=1536)
    parser.add_argument("--out-features", type=int, default=8960)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 5, 9, 17, 33])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/linear_kernels.json")
    args = parser.parse_args()
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    names = list(result["median_ms"])
    print("m    " + "".join(f"{n:>22s}" for n in names))
    for m in args.ms:
        print(f"{m:<5d}" + "".join(f"{result['median_ms'][n][str(m)]:19.2f} ms" for n in names))


if __name__ == "__main__":
    main()
