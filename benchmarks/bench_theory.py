"""Time quickdraft.theory.optimal_acceptance at Qwen's vocabulary size, and the LP for contrast.

Run:  python benchmarks/bench_theory.py   (writes benchmarks/results/theory_speed.json, prints a table)

Distributions: target = softmax(s * z), draft = softmax(s * (z + 0.5 * z')) with z, z' standard
normal ``[V]`` (a correlated draft), for s = 3 ("realistic") and s = 8 ("peaked"). Minimum and
median of ``--repeats`` runs each (the machine is shared: the minimum is the least disturbed run; the
1-minute load average at the start is recorded). The LP reference is timed at the largest vocabulary it solves within
``--lp-budget`` seconds for n = 2 and 3.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
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


def timed(fn, repeats: int) -> tuple[float, float, float, float, float]:
    """(wall min ms, wall median ms, CPU min ms, CPU median ms, value) over ``repeats`` calls.

    CPU time (``time.process_time``, all threads of this process) is what the call costs on its own;
    wall time also contains the waiting caused by other users of the shared cores.
    """
    times, cpu, value = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        value = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return (min(times) * 1e3, statistics.median(times) * 1e3, min(cpu) * 1e3, statistics.median(cpu) * 1e3,
            float(value))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--num-drafts", type=int, default=8)
    ap.add_argument("--lp-budget", type=float, default=20.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "theory_speed.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    load_start = round(os.getloadavg()[0], 2)
    rows = []
    for label, scale in (("realistic (s=3)", 3.0), ("peaked (s=8)", 8.0)):
        p, q = pair(rng, VOCAB, scale)
        for mode in MODES:
            optimal_acceptance(p, q, args.num_drafts, mode)  # warm-up
            lo, med, cpu_lo, cpu_med, alpha = timed(lambda: optimal_acceptance(p, q, args.num_drafts, mode), args.repeats)
            rows.append({"method": "fast", "distributions": label, "sampling": mode, "vocab": VOCAB,
                         "num_drafts": args.num_drafts, "min_ms": round(lo, 2), "median_ms": round(med, 2),
                         "cpu_min_ms": round(cpu_lo, 2), "cpu_median_ms": round(cpu_med, 2), "alpha_star": alpha})
    for n in (2, 3):
        for vocab in (4, 8, 16, 24, 32, 48, 64, 96, 128):
            p, q = pair(rng, vocab, 1.0)
            t0 = time.perf_counter()
            _, ms, _, _, alpha = timed(lambda: optimal_acceptance_lp(p, q, n, "with_replacement"), 1)
            fast = optimal_acceptance(p, q, n, "with_replacement")
            rows.append({"method": "lp", "distributions": "softmax(z), s=1", "sampling": "with_replacement",
                         "vocab": vocab, "num_drafts": n, "median_ms": round(ms, 2), "alpha_star": alpha,
                         "abs_diff_vs_fast": abs(alpha - fast)})
            if time.perf_counter() - t0 > args.lp_budget / 4:
                break
    out = {"command": "python benchmarks/bench_theory.py " + " ".join(sys.argv[1:]),
           "machine": {"python": platform.python_version(), "cpu_count_visible": os.cpu_count(),
                       "numpy": np.__version__, "load_average_1min_at_start": load_start,
                       "load_average_1min_at_end": round(os.getloadavg()[0], 2)},
           "repeats": args.repeats, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'method':6} {'distributions':18} {'sampling':20} {'V':>7} {'n':>2} {'min ms':>8} {'med ms':>8} "
          f"{'cpu min':>8} {'cpu med':>8} {'alpha*':>12}")
    for r in rows:
        print(f"{r['method']:6} {r['distributions']:18} {r['sampling']:20} {r['vocab']:>7} {r['num_drafts']:>2} "
              f"{r.get('min_ms', r['median_ms']):>8.1f} {r['median_ms']:>8.1f} {r.get('cpu_min_ms', float('nan')):>8.1f} "
              f"{r.get('cpu_median_ms', float('nan')):>8.1f} {r['alpha_star']:>12.8f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
