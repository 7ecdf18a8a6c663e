"""Time quickdraft.theory.optimal_acceptance at Qwen's vocabulary size, and the LP for contrast.

Run:  python benchmarks/bench_theory.py   (writes benchmarks/results/theory_speed.json, prints a table)

Distributions: target = softmax(s * z), draft = softmax(s * (z + 0.5 * z')) with z, z' standard
normal ``[V]`` (a correlated draft), for s = 3 ("realistic") and s = 8 ("peaked"). Median of
``--repeats`` runs each. The LP reference is timed at the largest vocabulary it solves within
``--lp-budget`` seconds for n = 2 and 3.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from quickdraft.theory import optimal_acceptance, optimal_acceptance_lp

VOCAB = 151_936
MODES = ("with_replacement", "without_replacement", "greedy")


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def pair(rng: np.random.Generator, vocab: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    z = rng.standard_normal(vocab)
    return softmax(scale * z), softmax(scale * (z + 0.5 * rng.standard_normal(vocab)))


def timed(fn, repeats: int) -> tuple[float, float]:
    times, value = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, float(value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-drafts", type=int, default=8)
    ap.add_argument("--lp-budget", type=float, default=20.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "theory_speed.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for label, scale in (("realistic (s=3)", 3.0), ("peaked (s=8)", 8.0)):
        p, q = pair(rng, VOCAB, scale)
        for mode in MODES:
            ms, alpha = timed(lambda: optimal_acceptance(p, q, args.num_drafts, mode), args.repeats)
            rows.append({"method": "fast", "distributions": label, "sampling": mode, "vocab": VOCAB,
                         "num_drafts": args.num_drafts, "median_ms": round(ms, 2), "alpha_star": alpha})
    for n in (2, 3):
        for vocab in (4, 8, 16, 24, 32, 48, 64, 96, 128):
            p, q = pair(rng, vocab, 1.0)
            t0 = time.perf_counter()
            ms, alpha = timed(lambda: optimal_acceptance_lp(p, q, n, "with_replacement"), 1)
            fast = optimal_acceptance(p, q, n, "with_replacement")
            rows.append({"method": "lp", "distributions": "softmax(z), s=1", "sampling": "with_replacement",
                         "vocab": vocab, "num_drafts": n, "median_ms": round(ms, 2), "alpha_star": alpha,
                         "abs_diff_vs_fast": abs(alpha - fast)})
            if time.perf_counter() - t0 > args.lp_budget / 4:
                break
    out = {"machine": {"python": platform.python_version(), "cpu_count_visible": __import__("os").cpu_count(),
                       "numpy": np.__version__}, "repeats": args.repeats, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'method':6} {'distributions':18} {'sampling':20} {'V':>7} {'n':>2} {'ms':>9} {'alpha*':>12}")
    for r in rows:
        print(f"{r['method']:6} {r['distributions']:18} {r['sampling']:20} {r['vocab']:>7} {r['num_drafts']:>2} "
              f"{r['median_ms']:>9.1f} {r['alpha_star']:>12.8f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
