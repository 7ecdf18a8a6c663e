"""Time quickdraft.theory.optimal_acceptance at Qwen's vocabulary size, and the LP for contrast.

Run:  python benchmarks/bench_theory.py   (writes benchmarks/results/theory_speed.json, prints a table)

Distributions: target = softmax(s * z), draft = softmax(s * (z + 0.5 * z')) with z, z' standard
normal ``[V]`` (a correlated draft), for s = 3 ("realistic") and s = 8 ("peaked"). Minimum and
median of ``--repeats`` runs each (the machine is shared: the minimum is the least disturbed run; the
1-minute load average at the start is recorded). Also timed at V = 151,936: ``verifier_acceptance`` for
every verifier, and ``acceptance_curves`` (all rates for n = 1..8 at once, what ``quickdraft analyze``
runs per position, including the certified RRS-without-replacement interval and its width).

The LP reference (``optimal_acceptance_lp``) is timed for every sampling method and n = 2, 3 on doubling
vocabularies until one solve takes longer than ``--lp-budget`` seconds or the LP would exceed its size
limit; the largest V solved is recorded (``lp_largest``).

Run it alone on the machine, so that no model job competes for the cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from quickdraft.errors import QuickdraftError
from quickdraft.theory import optimal_acceptance, optimal_acceptance_lp, verifier_acceptance
from quickdraft.theory.curves import acceptance_curves
from quickdraft.theory.rrs_wor import rrs_without_replacement_interval

VOCAB = 151_936
#: optimal_acceptance_lp refuses LPs with more variables (draft tuples x drafts per tuple)
LP_MAX_VARIABLES = 5_000_000
MODES = ("with_replacement", "without_replacement", "greedy")
VERIFIERS = (("with_replacement", "rrs"), ("with_replacement", "kseq"), ("greedy", "rrs"), ("greedy", "optimal_greedy"))


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
    ap.add_argument("--lp-budget", type=float, default=10.0, help="stop doubling V once one LP solve takes longer (s)")
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
        for mode, ver in VERIFIERS:
            lo, med, cpu_lo, cpu_med, rate = timed(lambda: verifier_acceptance(p, q, args.num_drafts, mode, ver), args.repeats)
            rows.append({"method": f"verifier_{ver}", "distributions": label, "sampling": mode, "vocab": VOCAB,
                         "num_drafts": args.num_drafts, "min_ms": round(lo, 2), "median_ms": round(med, 2),
                         "cpu_min_ms": round(cpu_lo, 2), "cpu_median_ms": round(cpu_med, 2), "alpha_star": rate})
        curves = {}
        lo, med, cpu_lo, cpu_med, _ = timed(lambda: curves.update(acceptance_curves(p, q, args.num_drafts)) or 0.0, 3)
        width = [u - l for u, l in zip(curves["rrs_without_replacement_upper"], curves["rrs_without_replacement_lower"])]
        rows.append({"method": "acceptance_curves", "distributions": label, "sampling": "all", "vocab": VOCAB,
                     "num_drafts": args.num_drafts, "min_ms": round(lo, 2), "median_ms": round(med, 2),
                     "cpu_min_ms": round(cpu_lo, 2), "cpu_median_ms": round(cpu_med, 2),
                     "alpha_star": curves["optimal_without_replacement"][-1], "rrs_wor_interval_width": width})
        for budget in (64, 256):
            iv = {}
            lo, med, cpu_lo, cpu_med, _ = timed(lambda: iv.update(r=rrs_without_replacement_interval(p, q, args.num_drafts, budget, 8)) or 0.0, 3)
            rows.append({"method": f"rrs_wor_interval_{budget}x8", "distributions": label, "sampling": "without_replacement",
                         "vocab": VOCAB, "num_drafts": args.num_drafts, "min_ms": round(lo, 2), "median_ms": round(med, 2),
                         "cpu_min_ms": round(cpu_lo, 2), "cpu_median_ms": round(cpu_med, 2),
                         "alpha_star": float(iv["r"].lower[-1]), "rrs_wor_lower": iv["r"].lower.tolist(),
                         "rrs_wor_upper": iv["r"].upper.tolist()})
    lp_largest = []
    for mode in MODES:
        for n in (2, 3):
            largest = None
            vocab = 4
            while True:
                tuples = {"with_replacement": vocab**n, "without_replacement": math.perm(vocab, n), "greedy": vocab}[mode]
                if tuples * n > LP_MAX_VARIABLES:  # the LP's own size limit (optimal_acceptance_lp)
                    lp_largest.append({"sampling": mode, "num_drafts": n, "largest_vocab": largest,
                                       "stopped_by": f"V={vocab} needs {tuples * n:,} LP variables (> {LP_MAX_VARIABLES:,})"})
                    break
                p, q = pair(rng, vocab, 1.0)
                try:
                    _, ms, _, cpu_ms, alpha = timed(lambda: optimal_acceptance_lp(p, q, n, mode), 1)
                except (QuickdraftError, MemoryError) as exc:
                    lp_largest.append({"sampling": mode, "num_drafts": n, "largest_vocab": largest, "stopped_by": str(exc)[:120]})
                    break
                fast = optimal_acceptance(p, q, n, mode)
                rows.append({"method": "lp", "distributions": "softmax(z), s=1", "sampling": mode, "vocab": vocab,
                             "num_drafts": n, "median_ms": round(ms, 2), "cpu_median_ms": round(cpu_ms, 2),
                             "alpha_star": alpha, "abs_diff_vs_fast": abs(alpha - fast)})
                largest = {"vocab": vocab, "ms": round(ms, 1)}
                if ms / 1e3 > args.lp_budget:
                    lp_largest.append({"sampling": mode, "num_drafts": n, "largest_vocab": largest,
                                       "stopped_by": f"solve time above --lp-budget {args.lp_budget} s"})
                    break
                vocab *= 2
    out = {"command": "python benchmarks/bench_theory.py " + " ".join(sys.argv[1:]),
           "machine": {"python": platform.python_version(), "cpu_count_visible": os.cpu_count(),
                       "numpy": np.__version__, "load_average_1min_at_start": load_start,
                       "load_average_1min_at_end": round(os.getloadavg()[0], 2)},
           "repeats": args.repeats, "lp_largest": lp_largest, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'method':6} {'distributions':18} {'sampling':20} {'V':>7} {'n':>2} {'min ms':>8} {'med ms':>8} "
          f"{'cpu min':>8} {'cpu med':>8} {'alpha*':>12}")
    for r in rows:
        print(f"{r['method']:6} {r['distributions']:18} {r['sampling']:20} {r['vocab']:>7} {r['num_drafts']:>2} "
              f"{r.get('min_ms', r['median_ms']):>8.1f} {r['median_ms']:>8.1f} {r.get('cpu_min_ms', float('nan')):>8.1f} "
              f"{r.get('cpu_median_ms', float('nan')):>8.1f} {r['alpha_star']:>12.8f}")
    for r in lp_largest:
        print(f"LP {r['sampling']:20} n={r['num_drafts']}: largest V solved {r['largest_vocab']} ({r['stopped_by']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
