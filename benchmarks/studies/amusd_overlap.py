"""What running the draft and the target at once costs on this CPU: the inputs of AMUSD's cost model.

AMUSD (:mod:`quickdraft.decoding.amusd`) runs the target's verification forward and the draft model's next
K forwards at the same time, each model with its own OpenVINO inference threads. Whether that pays
depends on how much slower each forward gets when it has half the cores and shares the memory
bandwidth with the other. For the default pair's OpenVINO exports (int8 target, the backend's int4
draft with its 49,152-id head) after a 200-token prefill, this measures, interleaved ``--repeats``
times:

* ``alone``: the target's forward over ``K + 1`` tokens and ``K`` one-token draft forwards, one
  after the other, each model compiled with all ``--threads`` (what ``sd`` does per step);
* ``alone_split``: the same with the models compiled with ``split_threads`` (one thread each on
  two cores), run one after the other (what AMUSD's draft costs after a rejection);
* ``together``: the split models at once, the draft's K forwards on a second thread (what an
  AMUSD step costs when its block was ready): the target's time, the draft's and the wall time;
* ``together_full``: the same with the models compiled with all threads each (oversubscribed).

Medians in milliseconds, for each K of ``--ks``; the JSON keeps every sample.

    flock /tmp/quickdraft-bench.lock python benchmarks/studies/amusd_overlap.py \\
        --out benchmarks/results/amusd_overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

PROMPT = list(range(1000, 1200))  # 200 tokens; any ids of the vocabulary do for timing


def load(threads: tuple[int, int]):
    from quickdraft.backends.openvino import load_openvino

    target, _ = load_openvino("target", "target", weight_format="int8", n_threads=threads[0])
    draft, _ = load_openvino("draft", "draft", weight_format="int4", draft_vocab=49152, n_threads=threads[1],
                             vocab_size=target.vocab_size)
    for runner in (target, draft):
        runner.reset(1)
        runner.forward(torch.tensor([PROMPT]), logits_to_keep=1)
    return target, draft


def forward(runner, m: int) -> float:
    """Seconds of one forward over ``m`` new tokens, rolled back afterwards."""
    base = runner.lengths.clone()
    start = time.perf_counter()
    runner.forward(torch.tensor([PROMPT[-m:]]), logits_to_keep=m)
    seconds = time.perf_counter() - start
    runner.truncate(base)
    return seconds


def drafts(runner, k: int) -> float:
    return sum(forward(runner, 1) for _ in range(k))


def together(target, draft, k: int) -> dict:
    out = {}

    def draft_side():
        out["draft"] = drafts(draft, k)

    start = time.perf_counter()
    thread = threading.Thread(target=draft_side)
    thread.start()
    out["target"] = forward(target, k + 1)
    thread.join()
    out["wall"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/amusd_overlap.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from quickdraft.decoding.amusd import split_threads
    from quickdraft.backends.openvino.runner import yield_cores_to_openvino

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_perf import _lscpu  # the CPU's model and ISA flags, as every benchmark records them

    loadavg_start = list(os.getloadavg())
    yield_cores_to_openvino()
    split = split_threads(args.threads)
    full_pair, split_pair = load((args.threads, args.threads)), load(split)
    samples: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved: drift hits every measurement alike
        for k in args.ks:
            samples.setdefault(f"alone/target/m={k + 1}", []).append(forward(full_pair[0], k + 1))
            samples.setdefault(f"alone/draft/k={k}", []).append(drafts(full_pair[1], k))
            samples.setdefault(f"alone_split/target/m={k + 1}", []).append(forward(split_pair[0], k + 1))
            samples.setdefault(f"alone_split/draft/k={k}", []).append(drafts(split_pair[1], k))
            for name, pair in (("together", split_pair), ("together_full", full_pair)):
                for part, seconds in together(*pair, k).items():
                    samples.setdefault(f"{name}/{part}/k={k}", []).append(seconds)
    medians = {key: 1000 * statistics.median(v) for key, v in samples.items()}
    table = {}
    for k in args.ks:
        seq = medians[f"alone/target/m={k + 1}"] + medians[f"alone/draft/k={k}"]
        table[f"k={k}"] = {
            "sd_step_ms": seq,  # target forward + K draft forwards, all threads each
            "amusd_ready_step_ms": medians[f"together/wall/k={k}"],  # both at once, split threads
            "amusd_ready_step_full_threads_ms": medians[f"together_full/wall/k={k}"],
            "amusd_after_rejection_ms": medians[f"alone_split/draft/k={k}"] + medians[f"together/wall/k={k}"],
            "target_slowdown_together": medians[f"together/target/k={k}"] / medians[f"alone/target/m={k + 1}"],
            "draft_slowdown_together": medians[f"together/draft/k={k}"] / medians[f"alone/draft/k={k}"],
        }
    result = {
        "command": "python benchmarks/studies/amusd_overlap.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), **_lscpu(), "threads": args.threads,
                    "split_threads": list(split), "loadavg_start": loadavg_start},
        "models": {"target": str(full_pair[0].path), "draft": str(full_pair[1].path)},
        "medians_ms": medians, "per_k": table, "samples_s": samples,
        "loadavg_end": list(os.getloadavg()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"loadavg {result['machine']['loadavg_start']} -> {result['loadavg_end']}")
    for k, row in table.items():
        print(k, {name: round(v, 2) for name, v in row.items()})


if __name__ == "__main__":
    main()
