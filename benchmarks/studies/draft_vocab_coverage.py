"""Share of the tokens of real text whose id a draft vocabulary of the N lowest ids keeps.

Byte-level BPE numbers its tokens in merge order, learnt most frequent first, so the lowest ids are a
frequency ranking that needs no corpus (``--draft-vocab``, docs/openvino.md#draft-vocabulary). This
measures that ranking on the HumanEval prompts with their canonical solutions (code) and the MT-Bench
questions (prose), with the target's tokenizer, and beside it a ranking by token counts over the
Python standard library's sources (a corpus at hand on every machine).

    python benchmarks/studies/draft_vocab_coverage.py --out benchmarks/results/draft_vocab_coverage.json
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import numpy as np

SIZES = (16384, 32768, 49152, 65536)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args()

    from quickdraft.evaluation.datasets import load_humaneval_problems, load_mtbench
    from quickdraft.models import resolve
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(resolve("target") / "tokenizer.json"))
    texts = {
        "humaneval": [p["prompt"] + p["canonical_solution"] for p in load_humaneval_problems()],
        "mtbench": [" ".join(m["content"] for m in p.messages) for p in load_mtbench()],
    }
    ids = {name: np.concatenate([np.array(tokenizer.encode(t).ids, dtype=np.int64) for t in rows])
           for name, rows in texts.items()}

    # the other ranking: token counts over the standard library's sources, ties broken by id
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_text(errors="ignore") for p in sorted(stdlib.rglob("*.py")) if "test" not in p.parts and "site-packages" not in p.parts]
    size = max(tokenizer.get_vocab_size(), max(int(v.max()) for v in ids.values()) + 1)
    counts = np.zeros(size, dtype=np.int64)
    for enc in tokenizer.encode_batch(sources):
        if enc.ids:
            np.add.at(counts, np.array(enc.ids, dtype=np.int64), 1)
    rank = np.empty(size, dtype=np.int64)
    rank[np.lexsort((np.arange(size), -counts))] = np.arange(size)

    result = {"tokens": {name: int(v.size) for name, v in ids.items()}, "lowest_ids": {}, "stdlib_counts": {}}
    for name, v in ids.items():
        result["lowest_ids"][name] = {str(n): float((v < n).mean()) for n in SIZES}
        result["stdlib_counts"][name] = {str(n): float((rank[v] < n).mean()) for n in SIZES}
    print("N:", *SIZES)
    for ranking in ("lowest_ids", "stdlib_counts"):
        for name in ids:
            print(f"{ranking:14s} {name:10s}", *(f"{100 * result[ranking][name][str(n)]:.1f}%" for n in SIZES))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
