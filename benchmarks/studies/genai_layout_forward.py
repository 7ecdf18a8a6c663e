"""Does the engine's OpenVINO graph cost more per forward than the graph GenAI runs? Both layouts of
the same weights, compiled with the same plugin settings, timed side by side in one process.

The engine's export (``layout="engine"``) takes an explicit additive 4D attention mask and the
columns whose logits are wanted; GenAI's (``layout="genai"``) a 2D mask, and it computes the head
on every column. Same NNCF compression, same stateful KV cache. Each round prefills a random prompt
of ``--prefill`` tokens into both, then times a forward over m = 1, 3, 5 new tokens in each (the
engine's runner, with its masks and bookkeeping; GenAI's graph through a bare infer request, the
logits of the m new columns copied out), rolls both back and goes on; the graphs take turns, the
first round warms up. The JSON holds the machine, every sample and the medians.

    python benchmarks/studies/genai_layout_forward.py --out benchmarks/results/genai_layout_forward_avx2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openvino_compression import _lscpu, _run_clock  # noqa: E402  (the studies' CPU and run record)

BLOCKS = (1, 3, 5)


class GenAIGraph:
    """GenAI's layout behind a bare infer request: prefill, a timed block, and a roll-back that trims
    the state (GenAI's own pipeline trims it the same way)."""

    def __init__(self, path: Path, config: dict) -> None:
        from quickdraft.backends.openvino.runner import core

        self.request = core().compile_model(str(path / "openvino_model.xml"), "CPU", config).create_infer_request()
        self.length = 0

    def _infer(self, ids: np.ndarray) -> np.ndarray:
        m = ids.shape[1]
        self.request.infer({"input_ids": ids, "attention_mask": np.ones((1, self.length + m), np.int64),
                            "position_ids": np.arange(self.length, self.length + m)[None],
                            "beam_idx": np.zeros(1, np.int32)})
        self.length += m
        return np.array(self.request.get_tensor("logits").data[:, -m:], copy=True)

    def prefill(self, ids: np.ndarray) -> None:
        self.request.reset_state()
        self.length = 0
        self._infer(ids)

    def block(self, ids: np.ndarray) -> float:
        start = time.perf_counter()
        self._infer(ids)
        return time.perf_counter() - start

    def truncate(self, length: int) -> None:
        import openvino as ov

        for state in self.request.query_state():
            state.state = ov.Tensor(np.ascontiguousarray(state.state.data[:, :, :length]))
        self.length = length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="target", choices=["target", "draft"], help="which model of the pair")
    parser.add_argument("--weights", default="int8", choices=["int8", "int4"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    clock = _run_clock()
    import openvino as ov

    from quickdraft.backends.openvino import export_for
    from quickdraft.backends.openvino.runner import OpenVINORunner

    ours = OpenVINORunner(export_for(args.model, args.weights), args.model, n_threads=args.threads,
                          drafting=args.model == "draft")
    genai = GenAIGraph(export_for(args.model, args.weights, layout="genai"), dict(ours.plugin_config))
    gen = torch.Generator().manual_seed(args.seed)
    samples = {"engine": {m: [] for m in BLOCKS}, "genai": {m: [] for m in BLOCKS}}
    for rnd in range(args.rounds + 1):
        prompt = torch.randint(100, 30000, (1, args.prefill), generator=gen)
        ours.reset(1)
        ours.forward(prompt, logits_to_keep=1)
        genai.prefill(prompt.numpy())
        for m in BLOCKS:
            block = torch.randint(100, 30000, (1, m), generator=gen)
            timed = {}
            for name in (("engine", "genai") if rnd % 2 else ("genai", "engine")):  # who goes first alternates
                if name == "engine":
                    start = time.perf_counter()
                    ours.forward(block, logits_to_keep=m)
                    timed[name] = time.perf_counter() - start
                    ours.truncate(torch.tensor([args.prefill]))
                else:
                    timed[name] = genai.block(block.numpy())
                    genai.truncate(args.prefill)
            if rnd:  # round 0 warms up
                for name, seconds in timed.items():
                    samples[name][m].append(seconds)
    medians = {name: {str(m): 1e3 * float(np.median(v)) for m, v in per.items()} for name, per in samples.items()}
    for name, row in medians.items():
        print(name, " ".join(f"m={m}: {ms:.1f} ms" for m, ms in row.items()))
    result = {"command": "python benchmarks/studies/genai_layout_forward.py " + " ".join(sys.argv[1:]),
              **clock, "loadavg_after": os.getloadavg(),
              "machine": _lscpu(), "openvino": ov.__version__, "model": args.model, "weights": args.weights, "threads": args.threads,
              "plugin_config": {k: str(v) for k, v in ours.plugin_config.items()}, "prefill": args.prefill,
              "rounds": args.rounds, "median_ms": medians,
              "engine_over_genai": {str(m): medians["engine"][str(m)] / medians["genai"][str(m)] for m in BLOCKS},
              "samples_s": {name: {str(m): v for m, v in per.items()} for name, per in samples.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
