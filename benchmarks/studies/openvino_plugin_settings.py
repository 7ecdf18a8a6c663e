"""Cost of the engine's OpenVINO forwards under each CPU-plugin setting, interleaved in one process.

The CPU plugin quantises the activations of int8/int4 layers on the fly in groups
(``DYNAMIC_QUANTIZATION_GROUP_SIZE``, 32 by default), keeps the KV cache in u8 and computes in bf16
where the CPU has bf16 instructions. ``OpenVINORunner`` compiles with
:func:`quickdraft.backends.openvino.runner.tuned_config` instead unless told otherwise. This study
times each export of the default pair through the runner (the engine's own masks and cache
bookkeeping) under:

* ``plugin``: the plugin's defaults (``tuned=False``);
* ``tuned``: ``tuned_config`` (the engine's default for a target);
* ``tuned-drafting``: ``tuned_config(drafting=True)`` (the engine's default for a draft);
* ``tuned-bf16``: ``tuned`` with bf16 activations (what float32 activations change);
* ``tuned-kv-u8``: ``tuned`` with the u8 KV cache (what the float16 cache changes);
* ``f32-kv-f16``: the plugin's activation groups with ``tuned``'s precisions (what the groups change).

``--exports`` picks the exports: by default the int8 and int4 targets and the int4 draft with the
49,152-id head; ``draft-int8-vocab49152`` and ``draft-int8`` (the draft GenAI's speculative decoding
runs) compare the draft's weight formats. Each round resets every runner, times a prefill of
``--prefill`` tokens and then forwards over m = 1, 2, 3, 5, 9, 16 new tokens after it (each rolled
back); runners take turns within a round, the first round warms up. The JSON holds the machine,
the compiled settings read back from the plugin, every sample and the medians.

    python benchmarks/studies/openvino_plugin_settings.py --out benchmarks/results/openvino_plugin_settings.json
    python benchmarks/studies/openvino_plugin_settings.py --exports target-int8 draft-int4-vocab49152 \
        draft-int8-vocab49152 draft-int8 --settings plugin tuned tuned-drafting --repeats 8 \
        --out benchmarks/results/openvino_plugin_settings_avx2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

from openvino_compression import _lscpu  # the studies' CPU record (this script's folder is on sys.path)

#: name -> OpenVINORunner keyword arguments
SETTINGS = {
    "plugin": {"tuned": False},
    "tuned": {},
    "tuned-drafting": {"drafting": True},
    "tuned-bf16": {"inference_precision": "bf16"},
    "tuned-kv-u8": {"kv_cache_precision": "u8"},
    "f32-kv-f16": {"tuned": False, "inference_precision": "f32", "kv_cache_precision": "f16"},
}
#: (label, registry role, weight format, draft vocabulary)
EXPORTS = (
    ("target-int8", "target", "int8", None),
    ("target-int4", "target", "int4", None),
    ("draft-int4-vocab49152", "draft", "int4", 49152),
    ("draft-int8-vocab49152", "draft", "int8", 49152),
    ("draft-int8", "draft", "int8", None),
)
BLOCKS = (1, 2, 3, 5, 9, 16)
READ_BACK = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE")


def measure(path: Path, settings: dict[str, dict], threads: int, repeats: int, prefill: int, seed: int) -> dict:
    """Medians and samples (seconds) of a prefill and of forwards over each block size, per setting."""
    from quickdraft.backends.openvino.runner import OpenVINORunner

    runners = {name: OpenVINORunner(path, name, n_threads=threads, **kwargs) for name, kwargs in settings.items()}
    compiled = {name: {key: str(r.compiled.get_property(key)) for key in READ_BACK} for name, r in runners.items()}
    gen = torch.Generator().manual_seed(seed)
    samples = {name: {"prefill": [], **{m: [] for m in BLOCKS}} for name in runners}
    for rep in range(repeats + 1):
        prompt = torch.randint(100, 30000, (1, prefill), generator=gen)
        blocks = {m: torch.randint(100, 30000, (1, m), generator=gen) for m in BLOCKS}
        for name, runner in runners.items():
            runner.reset(1)
            t = time.perf_counter()
            runner.forward(prompt, logits_to_keep=1)
            took = {"prefill": time.perf_counter() - t}
            for m in BLOCKS:
                t = time.perf_counter()
                runner.forward(blocks[m], logits_to_keep=m)
                took[m] = time.perf_counter() - t
                runner.truncate(torch.tensor([prefill]))
            if rep:  # round 0 warms up
                for key, value in took.items():
                    samples[name][key].append(value)
    del runners
    gc.collect()
    return {name: {"compiled": compiled[name],
                   "median_ms": {str(k): 1e3 * float(np.median(v)) for k, v in per.items()},
                   "samples_s": {str(k): v for k, v in per.items()}}
            for name, per in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exports", nargs="+", choices=[e[0] for e in EXPORTS], default=[e[0] for e in EXPORTS[:3]])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import openvino as ov

    from quickdraft.backends.openvino import export_for

    result = {"command": "python benchmarks/studies/openvino_plugin_settings.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items()),
              "machine": _lscpu(), "openvino": ov.__version__, "threads": args.threads,
              "repeats": args.repeats, "prefill": args.prefill, "blocks": list(BLOCKS), "exports": {}}
    settings = {name: SETTINGS[name] for name in args.settings}
    for label, role, fmt, vocab in EXPORTS:
        if label not in args.exports:
            continue
        path = export_for(role, fmt, draft_vocab=vocab)
        result["exports"][label] = {"path": str(path), "settings": measure(
            path, settings, args.threads, args.repeats, args.prefill, args.seed)}
        row = result["exports"][label]["settings"]
        for name, r in row.items():
            print(label, name, " ".join(f"{k}:{v:.1f}" for k, v in r["median_ms"].items()), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
