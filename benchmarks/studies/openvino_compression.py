"""Cost of one forward of the default pair's OpenVINO exports under each NNCF weight compression and
CPU-plugin activation setting, interleaved in one process.

Which int4 layout (symmetric or asymmetric, groups of 128 or whole rows) and whether the plugin
quantises activations on the fly (``DYNAMIC_QUANTIZATION_GROUP_SIZE``, 0 = off) decide how close a
forward gets to the memory roofline; the answer differs between CPUs, so the machine is recorded.
Each variant is compressed from one float32 trace of the model (made once into ``--work``), then
every variant runs a 200-token prefill and then forwards over m = 1, 5, 9 new tokens, rotating
through the variants ``--repeats`` times; the JSON holds every sample and the medians.

    python benchmarks/studies/openvino_compression.py --out benchmarks/results/openvino_compression.json

The int4 head (``int4_sym_g128_all``: the output head in int4 too) against the default int4 target:

    python benchmarks/studies/openvino_compression.py --roles target --variants int4_sym_g128 \
        int4_sym_g128_all --repeats 8 --out benchmarks/results/openvino_compression_head.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: (label, NNCF mode, group size, all layers) of the weight variants; group size -1: one group per
#: output row; all layers: the embedding and the output head in the int4 mode too (NNCF keeps them
#: int8 otherwise; the head is about a seventh of the target's weights and read at every forward)
VARIANTS = (
    ("int8_asym", "int8_asym", -1, False),
    ("int4_asym_g128", "int4_asym", 128, False),
    ("int4_sym_g128", "int4_sym", 128, False),
    ("int4_sym_row", "int4_sym", -1, False),
    ("int4_sym_g128_all", "int4_sym", 128, True),
)
BLOCKS = (1, 5, 9)


def _lscpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model": fields.get("Model name", "").strip(),
            "isa": sorted(f for f in flags if f.startswith(("avx", "amx")))}


def _run_clock() -> dict:
    """When a study starts and the load average then; a study adds ``loadavg_after`` to its JSON."""
    from datetime import datetime, timezone

    return {"started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "loadavg_before": os.getloadavg()}


def make_variants(role: str, work: Path, draft_vocab: int | None, only: list[str] | None = None) -> dict[str, Path]:
    """The compressed variants of ``role``'s model (those labelled in ``only``, default all), each
    compressed once from one float32 trace."""
    import nncf
    import openvino as ov

    from quickdraft.backends.openvino.export import MODEL_XML, export
    from quickdraft.models import resolve

    root = work / (role + (f"-vocab{draft_vocab}" if draft_vocab else ""))
    fp32 = root / "none"
    if not (fp32 / MODEL_XML).is_file():
        export(resolve(role), fp32, "none", draft_vocab=draft_vocab)
    out = {}
    for label, mode, group, all_layers in VARIANTS:
        if only and label not in only:
            continue
        path = root / label
        if not (path / MODEL_XML).is_file():
            model = ov.Core().read_model(fp32 / MODEL_XML)
            kwargs = {"mode": getattr(nncf.CompressWeightsMode, mode.upper())}
            if mode.startswith("int4"):
                kwargs.update(group_size=group, ratio=1.0, all_layers=all_layers)
            model = nncf.compress_weights(model, **kwargs)
            tmp = path.with_name(path.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            ov.save_model(model, tmp / MODEL_XML, compress_to_fp16=False)
            for f in fp32.iterdir():
                if f.suffix in (".json", ".jinja"):
                    shutil.copy2(f, tmp / f.name)
            tmp.rename(path)
            del model
            gc.collect()
        out[label] = path
    return out


def _feed(past: int, m: int) -> dict:
    mask = np.zeros((1, 1, m, past + m), np.float32)
    mask[0, 0, :, past:] = np.triu(np.full((m, m), -np.inf, np.float32), 1)
    return {"input_ids": np.full((1, m), 100, np.int64), "attention_mask": mask,
            "position_ids": np.arange(past, past + m)[None], "logits_index": np.arange(m, dtype=np.int64),
            "beam_idx": np.zeros(1, np.int32)}


def measure(models: dict[str, tuple[Path, dict]], threads: int, repeats: int) -> dict:
    """Seconds of forwards over m new tokens after a 200-token prefill, per model, interleaved."""
    import openvino as ov

    from quickdraft.backends.openvino.export import MODEL_XML
    from quickdraft.backends.openvino.runner import compile_config

    core = ov.Core()
    requests = {}
    for label, (path, extra) in models.items():
        compiled = core.compile_model(str(path / MODEL_XML), "CPU", {**compile_config(threads), **extra})
        requests[label] = compiled.create_infer_request()
    samples: dict[str, dict[int, list[float]]] = {label: {m: [] for m in BLOCKS} for label in models}
    prompt = {**_feed(0, 200), "logits_index": np.array([199], np.int64)}
    for rep in range(repeats + 1):  # the first round warms up (the plugin repacks weights at the first call)
        for label, request in requests.items():
            for state in request.query_state():
                state.reset()
            request.infer(prompt)
            past = 200
            for m in (1, 5, 1, 9, 1, 5):
                t = time.perf_counter()
                request.infer(_feed(past, m))
                if rep:
                    samples[label][m].append(time.perf_counter() - t)
                past += m
    return {label: {"median_ms": {m: 1e3 * float(np.median(v)) for m, v in per.items()},
                    "samples_s": {m: v for m, v in per.items()}}
            for label, per in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "quickdraft" / "compression-study"),
                        help="where the float32 traces and the variants are written (several GB)")
    parser.add_argument("--draft-vocab", type=int, default=49152, help="the draft's head (0: full vocabulary)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--variants", nargs="+", choices=[v[0] for v in VARIANTS],
                        help="only these weight variants (default: all)")
    parser.add_argument("--roles", nargs="+", choices=["target", "draft"], default=["target", "draft"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    work = Path(args.work)
    models = {}
    for role, vocab in (("target", None), ("draft", args.draft_vocab or None)):
        if role not in args.roles:
            continue
        for label, path in make_variants(role, work, vocab, args.variants).items():
            models[f"{role}/{label}"] = (path, {})
            if role == "draft" or label == "int8_asym":  # a draft's forwards hold one token
                models[f"{role}/{label}/dq-off"] = (path, {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": {**_lscpu(), "threads": args.threads},
        "draft_vocab": args.draft_vocab,
        "forward": measure(models, args.threads, args.repeats),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    for label, row in result["forward"].items():
        print(f"{label:32s} " + "  ".join(f"m={m}: {ms:6.1f} ms" for m, ms in row["median_ms"].items()))


if __name__ == "__main__":
    main()
