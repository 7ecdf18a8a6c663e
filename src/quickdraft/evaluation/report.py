"""Reports of benchmark runs: summary CSV/JSON, a markdown table, PNG plots, the results section of
the benchmarks page (``docs/benchmarks.md``).

Everything here is computed from the raw per-cell records that :mod:`quickdraft.evaluation.bench` writes
(``DIR/raw/T*/<method>/<prompt>.json``) plus ``DIR/run.json``, so committed results can be
re-reported at any time without a model::

    python -m quickdraft.evaluation.report benchmarks/results/bench/*/ --readme docs/benchmarks.md

Definitions (terms as in :mod:`quickdraft.verification.verify`)
--------------------------------------------------
Rows are per (temperature, method) over the *complete cases*: the prompts that every method at
that temperature finished, so all rows of a table share the same prompts.

``decode_tps``
    Σ decoded tokens / Σ decode seconds: the prefill, and the first token it emits
    (``metrics.prefill_tokens``), excluded; engine methods only.
``e2e_tps``
    Σ new tokens / Σ (prefill + decode) seconds; the only rate anchors expose, so it is the column
    that compares quickdraft with other tools.
``speedup_decode``, ``speedup_e2e``
    Ratio to the ``ar`` row (target alone, our engine) at the same temperature, with
    ``speedup_*_low`` / ``speedup_*_high``: its 95 % paired bootstrap interval over the prompts
    (:func:`quickdraft.evaluation.rates.rate_ratio`; none under 10 prompts, where it would undercover).
``mean_acceptance_length``
    Σ emitted / Σ steps, counting the recovered/bonus token (= new tokens per verifying forward).
``acceptance_by_position``
    Σ accepted at draft position i / Σ steps that reached position i.
``lossy_share``
    Σ tokens accepted by a lossy criterion / Σ emitted tokens.
``pass_at_1`` with ``pass_low``/``pass_high``
    HumanEval pass rate and its 95 % Wilson interval (:func:`quickdraft.evaluation.quality.pass_at_1`);
    unparseable answers count as failures and are counted in ``unparseable``.
``vs_baseline_*``
    Exact McNemar test against the baseline (the lossless reference) on the same problems
    (:func:`quickdraft.evaluation.quality.compare_paired`): difference in pass rate, discordant counts, p.
``target_mean_logprob``
    Token-weighted mean of the target's log-likelihood of the generated tokens (raw distribution).
``vs_baseline_logprob_*``
    The same score per prompt (each output's mean log-likelihood per token), paired with the
    baseline's on the same prompts (:func:`quickdraft.evaluation.quality.compare_paired_means`):
    mean difference, its 95 % t interval and p. A fidelity measure where no pass/fail exists
    (MT-Bench without a judge): a lossy rule that accepts tokens the target finds unlikely lowers it.
``agree_exact`` / ``agree_prefix``
    At temperature 0 only: share of prompts whose tokens equal target-alone (``ar``) greedy output
    (or, in a run without ``ar``, the lossless baseline's, which at temperature 0 is the same
    sequence), and the mean share of the longer output covered by the common prefix.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

from quickdraft.errors import QuickdraftError

README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"

CSV_FIELDS = (
    "temperature", "method", "name", "kind", "lossless", "prompts", "new_tokens", "decode_tps", "e2e_tps",
    "speedup_decode", "speedup_decode_low", "speedup_decode_high", "speedup_e2e", "speedup_e2e_low",
    "speedup_e2e_high", "mean_acceptance_length", "acceptance_rate", "lossy_share",
    "target_forwards", "draft_forwards", "acceptance_by_position", "passed", "pass_at_1", "pass_low", "pass_high",
    "unparseable", "baseline", "vs_baseline_difference", "vs_baseline_only_method", "vs_baseline_only_baseline",
    "vs_baseline_p", "target_mean_logprob", "vs_baseline_logprob_difference", "vs_baseline_logprob_low",
    "vs_baseline_logprob_high", "vs_baseline_logprob_p", "agree_exact", "agree_prefix", "params",
)


# ------------------------------------------------------------------------------------------------
# Loading and summarising
# ------------------------------------------------------------------------------------------------
def load_records(out_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All finished cells of a run directory, in run order (``run_index``)."""
    root = Path(out_dir) / "raw"
    records = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(root.glob("*/*/*.json"))] if root.is_dir() else []
    return sorted(records, key=lambda r: r.get("run_index", 0))


def load_run(run_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(run.json payload, raw records in run order)`` of a run directory."""

    run_dir = Path(run_dir)
    run_file = run_dir / "run.json"
    if not run_file.is_file():
        raise QuickdraftError(f"{run_dir} is not a benchmark run (no run.json)")
    return json.loads(run_file.read_text(encoding="utf-8")), load_records(run_dir)


def _sum(values) -> float:
    return float(sum(v for v in values if v is not None))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _per_prompt_logprob(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """Each record's mean target log-likelihood per token, by prompt; None if any record lacks one."""
    out = {}
    for r in records:
        f = r.get("fidelity")
        if not f or f.get("target_mean_logprob") is None:
            return None
        out[r["prompt_id"]] = float(f["target_mean_logprob"])
    return out


def _speedup_interval(mine, ar) -> tuple[float | None, float | None]:
    """95 % paired bootstrap interval of one row's rate over ``ar``'s from their per-prompt
    (tokens, seconds), the same prompts in the same order; ``(None, None)`` where none can be given."""
    from quickdraft.evaluation.rates import rate_ratio

    if mine is None or ar is None:
        return None, None
    try:
        r = rate_ratio(mine[0], mine[1], ar[0], ar[1])
    except QuickdraftError:  # e.g. a record with zero seconds
        return None, None
    return (None, None) if r.low != r.low else (r.low, r.high)  # NaN: too few prompts


def summarize(records: list[dict[str, Any]], baseline: str | None = None, method_order: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per (temperature, method) over the complete cases (see the module docstring)."""
    from quickdraft.evaluation.quality import compare_paired, compare_paired_means, pass_at_1

    rows: list[dict[str, Any]] = []
    temperatures = sorted({float(r["temperature"]) for r in records})
    for t in temperatures:
        at_t = [r for r in records if float(r["temperature"]) == t]
        methods = list(dict.fromkeys(r["method"] for r in at_t))
        if method_order:
            rank = {m: i for i, m in enumerate(method_order)}
            methods.sort(key=lambda m: rank.get(m, len(rank)))
        by_method = {m: {r["prompt_id"]: r for r in at_t if r["method"] == m} for m in methods}
        common = set.intersection(*(set(v) for v in by_method.values())) if by_method else set()
        base_label = baseline if baseline in by_method else None
        # the greedy reference: target alone, else a lossless baseline (at T = 0 its output is the
        # target's greedy output token for token, which the engine tests assert)
        ar_rows = by_method.get("ar", {})
        if not ar_rows and base_label and all(r.get("lossless") for r in by_method[base_label].values()):
            ar_rows = by_method[base_label]
        for m in methods:
            sel = [by_method[m][pid] for pid in sorted(common)]
            if not sel:
                continue
            first = sel[0]
            new_tokens = _sum(r["new_tokens"] for r in sel)
            row: dict[str, Any] = {
                "temperature": t, "method": m, "name": first["name"], "kind": first.get("kind", "method"),
                "lossless": first.get("lossless"), "params": json.dumps(first.get("params", {}), sort_keys=True),
                "prompts": len(sel), "new_tokens": int(new_tokens),
            }
            decode = [r.get("decode_seconds") for r in sel]
            decoded = [r["new_tokens"] - max(0, min(r["new_tokens"], (r.get("metrics") or {}).get("prefill_tokens", 0)))
                       for r in sel]  # per prompt, the prefill's token left out
            row["decode_tps"] = _ratio(_sum(decoded), _sum(decode)) if all(d is not None for d in decode) else None
            row["e2e_tps"] = _ratio(new_tokens, _sum(r["seconds"] for r in sel))
            row["_per_prompt"] = {"e2e": ([r["new_tokens"] for r in sel], [r["seconds"] for r in sel])}
            if row["decode_tps"] is not None:
                row["_per_prompt"]["decode"] = (decoded, decode)
            metrics = [r.get("metrics") for r in sel]
            if all(mm is not None for mm in metrics):
                steps = _sum(mm["steps"] for mm in metrics)
                row["mean_acceptance_length"] = _ratio(_sum(mm["emitted_tokens"] for mm in metrics), steps)
                row["acceptance_rate"] = _ratio(_sum(mm["accepted_tokens"] for mm in metrics), _sum(mm["drafted_tokens"] for mm in metrics))
                row["lossy_share"] = _ratio(_sum(mm["lossy_accepted_tokens"] for mm in metrics), _sum(mm["emitted_tokens"] for mm in metrics))
                row["target_forwards"] = int(_sum(mm["target_forwards"] for mm in metrics))
                row["draft_forwards"] = int(_sum(mm["draft_forwards"] for mm in metrics))
                width = max((len(mm["position_reached"]) for mm in metrics), default=0)
                reached = [sum(mm["position_reached"][i] for mm in metrics if i < len(mm["position_reached"])) for i in range(width)]
                accepted = [sum(mm["position_accepted"][i] for mm in metrics if i < len(mm["position_accepted"])) for i in range(width)]
                row["acceptance_by_position"] = [a / r if r else None for a, r in zip(accepted, reached)]
            if all("quality" in r and "passed" in r["quality"] for r in sel):
                passed = {r["prompt_id"]: bool(r["quality"]["passed"]) for r in sel}
                rate = pass_at_1(passed)
                row.update(passed=rate.passed, pass_at_1=rate.rate, pass_low=rate.low, pass_high=rate.high,
                           unparseable=sum(not r["quality"].get("parsed", True) for r in sel))
                if base_label and m != base_label:
                    base = {pid: bool(by_method[base_label][pid]["quality"]["passed"]) for pid in passed
                            if "passed" in by_method[base_label][pid].get("quality", {})}
                    if set(base) == set(passed):
                        cmp = compare_paired(passed, base)
                        row.update(baseline=base_label, vs_baseline_difference=cmp.difference,
                                   vs_baseline_only_method=cmp.only_a, vs_baseline_only_baseline=cmp.only_b,
                                   vs_baseline_p=cmp.p_value)
            fid = [r.get("fidelity") for r in sel]
            if all(f is not None and f.get("target_logprob_sum") is not None for f in fid):
                row["target_mean_logprob"] = _ratio(_sum(f["target_logprob_sum"] for f in fid), _sum(f["scored_tokens"] for f in fid))
                if base_label and m != base_label and len(sel) >= 2:
                    mine = _per_prompt_logprob(sel)
                    base = _per_prompt_logprob([by_method[base_label][r["prompt_id"]] for r in sel])
                    if mine is not None and base is not None:
                        cmp_lp = compare_paired_means(mine, base)
                        row.update(baseline=base_label, vs_baseline_logprob_difference=cmp_lp.difference,
                                   vs_baseline_logprob_low=cmp_lp.low, vs_baseline_logprob_high=cmp_lp.high,
                                   vs_baseline_logprob_p=cmp_lp.p_value)
            if t == 0.0 and ar_rows and all(r["prompt_id"] in ar_rows for r in sel):
                pairs = [(r["token_ids"], ar_rows[r["prompt_id"]]["token_ids"]) for r in sel]
                row["agree_exact"] = sum(a == b for a, b in pairs) / len(pairs)
                row["agree_prefix"] = sum(_common_prefix(a, b) / max(len(a), len(b), 1) for a, b in pairs) / len(pairs)
            rows.append(row)
        ar = next((r for r in rows if r["temperature"] == t and r["method"] == "ar"), None)
        for row in rows:
            if row["temperature"] != t:
                continue
            if ar is not None:
                row["speedup_decode"] = _ratio(row["decode_tps"], ar["decode_tps"]) if row.get("decode_tps") and ar.get("decode_tps") else None
                row["speedup_e2e"] = _ratio(row["e2e_tps"], ar["e2e_tps"]) if row.get("e2e_tps") and ar.get("e2e_tps") else None
                if row is not ar:
                    for rate in ("decode", "e2e"):
                        if row[f"speedup_{rate}"] is not None:
                            row[f"speedup_{rate}_low"], row[f"speedup_{rate}_high"] = _speedup_interval(
                                row["_per_prompt"].get(rate), ar["_per_prompt"].get(rate))
    return [{k: row.get(k) for k in CSV_FIELDS} for row in rows]


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------
def write_csv(rows: list[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(CSV_FIELDS))
        writer.writeheader()
        for row in rows:
            out = dict(row)
            if isinstance(out.get("acceptance_by_position"), list):
                out["acceptance_by_position"] = " ".join("" if v is None else f"{v:.4f}" for v in out["acceptance_by_position"])
            writer.writerow({k: "" if out.get(k) is None else out[k] for k in CSV_FIELDS})


def _f(value: Any, fmt: str = ".2f", none: str = "–") -> str:
    return none if value is None else format(value, fmt)


def _with_interval(row: dict[str, Any], key: str) -> str:
    """``1.23 [1.10, 1.35]``: a value with its interval where the row has one."""
    if row[key] is None or row.get(f"{key}_low") is None:
        return _f(row[key])
    return f"{row[key]:.2f} [{row[f'{key}_low']:.2f}, {row[f'{key}_high']:.2f}]"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a GitHub markdown table (columns that are empty for every row are dropped)."""
    columns = [
        ("method", lambda r: f"`{r['method']}`"),
        ("T", lambda r: f"{r['temperature']:g}"),
        ("n", lambda r: str(r["prompts"])),
        ("tok/s decode", lambda r: _f(r["decode_tps"])),
        ("tok/s e2e", lambda r: _f(r["e2e_tps"])),
        ("× ar (decode) [95% CI]", lambda r: _with_interval(r, "speedup_decode")),
        ("× ar (e2e) [95% CI]", lambda r: _with_interval(r, "speedup_e2e")),
        ("acc. length", lambda r: _f(r["mean_acceptance_length"])),
        ("lossy share", lambda r: _f(r["lossy_share"], ".1%") if r["lossy_share"] else ("–" if r["lossy_share"] is None else "0")),
        ("pass@1 [95% CI]", lambda r: "–" if r["pass_at_1"] is None else
            f"{r['passed']}/{r['prompts']} = {100 * r['pass_at_1']:.0f}% [{100 * r['pass_low']:.0f}, {100 * r['pass_high']:.0f}]"),
        ("unparsed", lambda r: "–" if r["unparseable"] is None else str(r["unparseable"])),
        ("Δ vs baseline (McNemar p)", lambda r: "–" if r["vs_baseline_difference"] is None else
            f"{100 * r['vs_baseline_difference']:+.0f} pt (+{r['vs_baseline_only_method']}/−{r['vs_baseline_only_baseline']}, p={r['vs_baseline_p']:.2f})"),
        ("target logprob", lambda r: _f(r["target_mean_logprob"], ".3f")),
        ("Δ logprob vs baseline [95% CI]", lambda r: "–" if r["vs_baseline_logprob_difference"] is None else
            f"{r['vs_baseline_logprob_difference']:+.3f} [{r['vs_baseline_logprob_low']:+.3f}, "
            f"{r['vs_baseline_logprob_high']:+.3f}]"),
        ("= ar greedy", lambda r: "–" if r["agree_exact"] is None else f"{100 * r['agree_exact']:.0f}% (prefix {100 * r['agree_prefix']:.0f}%)"),
    ]
    cells = [[fn(r) for _, fn in columns] for r in rows]
    keep = [j for j in range(len(columns)) if j < 3 or any(c[j] != "–" for c in cells)]
    head = [columns[j][0] for j in keep]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c[j] for j in keep) + " |" for c in cells]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _params(row: dict[str, Any]) -> dict[str, Any]:
    return json.loads(row["params"]) if row.get("params") else {}


def _defaults() -> dict[str, Any]:
    import inspect

    from quickdraft.methods import build_method

    return {n: p.default for n, p in inspect.signature(build_method).parameters.items() if p.kind is p.KEYWORD_ONLY}


def _quality_points(rows: list[dict[str, Any]]) -> tuple[list[tuple[dict, float, float, float]], str] | None:
    """Per row (row, y, low, high) on the quality axis of the trade-off plot, and the axis label:
    HumanEval pass@1 with its Wilson interval where the run has it, otherwise the target's
    log-likelihood per token against the baseline's (paired t interval; the baseline sits at 0)."""
    if any(r["pass_at_1"] is not None for r in rows):
        pts = [(r, 100 * r["pass_at_1"], 100 * r["pass_low"], 100 * r["pass_high"]) for r in rows
               if r["pass_at_1"] is not None]
        return pts, "HumanEval pass@1 (%), 95% Wilson CI"
    base = {r["baseline"] for r in rows if r["vs_baseline_logprob_difference"] is not None}
    if not base:
        return None
    pts = [(r, r["vs_baseline_logprob_difference"], r["vs_baseline_logprob_low"], r["vs_baseline_logprob_high"])
           for r in rows if r["vs_baseline_logprob_difference"] is not None]
    pts += [(r, 0.0, 0.0, 0.0) for r in rows if r["method"] in base]
    return pts, f"target log-likelihood per token − {sorted(base)[0]}'s (nats), paired 95% CI"


def plot_tradeoff(rows: list[dict[str, Any]], path: str | os.PathLike[str]) -> bool:
    """Tokens/s (end to end) against quality — HumanEval pass@1, or where there is none the target's
    log-likelihood against the baseline's — with 95 % intervals: one FSD curve per divergence
    (thresholds annotated) against lossless sd, hybrid FSD, typical and target alone."""
    quality = _quality_points([r for r in rows if r["e2e_tps"]])
    if quality is None:
        return False
    points, ylabel = quality
    plt = _plt()
    temps = sorted({r["temperature"] for r, *_ in points})
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4.8), squeeze=False)
    defaults = _defaults()
    for ax, t in zip(axes[0], temps):
        sel = [pt for pt in points if pt[0]["temperature"] == t]
        curves: dict[str, list[tuple[float, tuple]]] = {}
        for pt in sel:
            p = {**defaults, **_params(pt[0])}
            if pt[0]["name"] == "fsd" and not p.get("hybrid"):
                curves.setdefault(str(p["divergence"]), []).append((float(p["threshold"]), pt))
        for div, pts in sorted(curves.items()):
            pts.sort(key=lambda x: x[0])
            xs = [pt[0]["e2e_tps"] for _, pt in pts]
            ys = [pt[1] for _, pt in pts]
            line = ax.plot(xs, ys, "-o", label=f"FSD ({div}), threshold τ")[0]
            for (thr, (_, y, lo, hi)), x in zip(pts, xs):
                ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], color=line.get_color(), alpha=0.35, capsize=2)
                ax.annotate(f"τ={thr:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        styles = {"sd": ("*", "lossless sd"), "typical": ("^", "typical"), "ar": ("X", "target alone"),
                  "ersd": ("D", "ERSD"), "ngram": ("v", "n-gram")}
        for r, y, lo, hi in sel:
            p = {**defaults, **_params(r)}
            if r["name"] == "fsd" and not p.get("hybrid"):
                continue
            marker, label = ("s", "hybrid FSD") if r["name"] == "fsd" else styles.get(r["name"], ("o", r["name"]))
            ax.errorbar(r["e2e_tps"], y, yerr=[[y - lo], [hi - y]], fmt=marker, markersize=9,
                        capsize=3, label=f"{label}: {r['method']}")
        ax.set_xlabel("tokens/s (end to end, prefill included)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"temperature {t:g}, n={sel[0][0]['prompts']} prompts")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_acceptance(rows: list[dict[str, Any]], path: str | os.PathLike[str]) -> bool:
    """Acceptance rate by draft position, one line per method, one panel per temperature."""
    rows = [r for r in rows if r.get("acceptance_by_position")]
    if not rows:
        return False
    plt = _plt()
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6.5 * len(temps), 4.5), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for r in (r for r in rows if r["temperature"] == t):
            ys = r["acceptance_by_position"]
            xs = [i + 1 for i, v in enumerate(ys) if v is not None]
            ax.plot(xs, [v for v in ys if v is not None], "-o", markersize=3, label=r["method"])
        ax.set_xlabel("draft position i")
        ax.set_ylabel("P(accept i | positions < i accepted)")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"temperature {t:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_speedup_vs_k(rows: list[dict[str, Any]], path: str | os.PathLike[str]) -> bool:
    """Decode speed-up over target alone against the draft length K, one line per method family
    (same method and parameters apart from K) and temperature; only families run at two or more K."""
    defaults = _defaults()
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["kind"] != "method" or r["name"] in ("ar",) or not r.get("speedup_decode"):
            continue
        p = {**defaults, **_params(r)}
        if p.get("policy", "constant") != "constant":
            continue
        rest = ",".join(f"{k}={v}" for k, v in sorted(_params(r).items()) if k != "k")
        key = f"{r['name']}{':' + rest if rest else ''} T={r['temperature']:g}"
        series.setdefault(key, []).append((int(p["k"]), r["speedup_decode"]))
    series = {key: pts for key, pts in series.items() if len({k for k, _ in pts}) >= 2}
    if not series:  # no method was run at two or more draft lengths
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for key, pts in sorted(series.items()):
        pts.sort()
        ax.plot([k for k, _ in pts], [s for _, s in pts], "-o", label=key)
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    _label_k_axes(ax, "decode speed-up over target alone")
    _save_figure(plt, fig, path)
    return True


def _label_k_axes(ax, ylabel: str) -> None:
    ax.set_xlabel("draft length K")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _save_figure(plt, fig, path: str | os.PathLike[str]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_adaptive(summary: dict[str, dict[str, dict]], path: str | os.PathLike[str]) -> bool:
    """Decode tokens/s against the draft length K for fixed K, with the adaptive policies
    (SpecDec++ thresholds, heuristic, confidence) as horizontal lines; one panel per
    ``dataset@T`` of ``benchmarks/bench_adaptive.py``'s ``summary``. False when nothing to plot."""
    panels = {key: cfgs for key, cfgs in summary.items() if any(c.startswith("fixed_k") for c in cfgs)}
    if not panels:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (key, cfgs) in zip(axes[0], sorted(panels.items())):
        fixed = sorted((int(c.removeprefix("fixed_k")), v["tokens_per_s"]) for c, v in cfgs.items()
                       if c.startswith("fixed_k"))
        ax.plot([k for k, _ in fixed], [t for _, t in fixed], "-o", color="black", label="fixed K")
        others = [(c, v["tokens_per_s"]) for c, v in cfgs.items() if not c.startswith("fixed_k") and c != "ar"]
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, (name, tps) in enumerate(sorted(others)):
            ax.axhline(tps, color=colours[i % len(colours)], ls="--", lw=1.2, label=name)
        ax.set_title(key, fontsize=9)
        _label_k_axes(ax, "decode tokens/s")
    _save_figure(plt, fig, path)
    return True


def plot_adaptive_replay(summary: dict[str, dict], path: str | os.PathLike[str],
                         heads: Sequence[str] = ("specdecpp",), setting: str = "T = 0") -> bool:
    """Modelled tokens/s against the mean draft length per step: fixed K as a line, each threshold
    family (``confidence_p*`` and ``<head>_h*`` for each label in ``heads``) as a curve over its
    thresholds, Heuristic and the clairvoyant bound as points; one panel per dataset of
    ``benchmarks/studies/replay_adaptive.py``'s ``summary`` (``{dataset: {"configs": {name: {...}}}}``),
    titled with ``setting``. False when nothing to plot."""
    panels = {ds: s["configs"] for ds, s in summary.items() if s.get("configs")}
    if not panels:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.3), squeeze=False)
    for ax, (ds, cfgs) in zip(axes[0], sorted(panels.items())):
        def xy(prefix):
            pts = sorted((v["mean_draft_len"], v["tokens_per_s"]) for c, v in cfgs.items() if c.startswith(prefix))
            return [x for x, _ in pts], [y for _, y in pts]

        ax.plot(*xy("fixed_k"), "-o", color="black", ms=4, label="fixed K")
        for head in heads:
            ax.plot(*xy(f"{head}_h"), "-s", ms=4, label=f"SpecDec++ {head} (thresholds)")
        ax.plot(*xy("confidence_p"), "-^", ms=4, label="Confidence (p_min)")
        for name, marker in (("heuristic", "D"), ("clairvoyant", "*")):
            if name in cfgs:
                ax.plot([cfgs[name]["mean_draft_len"]], [cfgs[name]["tokens_per_s"]], marker, ms=9, ls="none",
                        label=name)
        ax.set_title(f"{ds}: {setting}, exact replay", fontsize=9)
        ax.set_xlabel("mean draft length per step")
        ax.set_ylabel("modelled decode tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save_figure(plt, fig, path)
    return True


# ------------------------------------------------------------------------------------------------
# A run's reports and the README section
# ------------------------------------------------------------------------------------------------
def write_reports(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Write ``summary.csv``, ``summary.json``, ``summary.md`` and ``plots/*.png`` of a run."""
    run_dir = Path(run_dir)
    meta, records = load_run(run_dir)
    config = meta.get("config", {})
    rows = summarize(records, baseline=config.get("baseline"), method_order=meta.get("entries"))
    write_csv(rows, run_dir / "summary.csv")
    table = markdown_table(rows) if rows else "(no finished cells)\n"
    (run_dir / "summary.md").write_text(table, encoding="utf-8")
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(exist_ok=True)
    plots = []
    for name, fn in (("tradeoff.png", plot_tradeoff), ("acceptance_by_position.png", plot_acceptance),
                     ("speedup_vs_k.png", plot_speedup_vs_k)):
        target = plots_dir / name
        if fn(rows, target):
            plots.append(name)
        elif target.exists():
            target.unlink()
    summary = {"run": meta.get("title") or run_dir.name, "config": config, "plots": plots, "rows": rows}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return summary


def readme_section(run_dirs: list[Path], readme: Path) -> str:
    """Markdown for the page ``readme``: per run its title, exact commands, setting, table, the run's
    ``NOTES.md`` (a committed reading of the numbers) when present, and plots; links are relative
    to the page's folder."""
    readme_dir = readme.parent
    parts = [
        f"<!-- generated by `python -m quickdraft.evaluation.report benchmarks/results/bench/*/ --readme {readme.as_posix()}`; "
        "do not edit by hand -->",
        "",
        "## Results",
        "",
        "Generated from the committed runs under `benchmarks/results/bench/` (raw per-prompt JSON, "
        "`summary.csv`, plots). Terms as above; *tok/s decode* excludes prefill, *e2e* includes it "
        "(the only rate the anchors expose); × ar is relative to target alone in the same run, with a 95% "
        "paired bootstrap interval over the prompts (from 10 prompts on); "
        "pass@1 intervals are 95% Wilson; Δ vs baseline is an exact McNemar test against the lossless "
        "reference on the same problems. Model load time is excluded from every rate.",
        "",
    ]
    for run_dir in run_dirs:
        meta, _ = load_run(run_dir)
        summary_file = run_dir / "summary.json"
        if not summary_file.is_file():
            continue
        summary = json.loads(summary_file.read_text(encoding="utf-8"))
        config = meta.get("config", {})
        rel = os.path.relpath(run_dir, readme_dir)
        parts.append(f"### {meta.get('title') or run_dir.name}")
        parts.append("")
        if meta.get("description"):
            parts += [meta["description"].strip(), ""]
        sessions = meta.get("sessions", [])
        loads = [s.get("model_load_seconds") for s in sessions if s.get("model_load_seconds") is not None]
        prompts = meta.get("prompts", [])
        parts.append(
            f"{config.get('dataset')} · {len(prompts)} prompts ({prompts[0] if prompts else ''} … "
            f"{prompts[-1] if prompts else ''}) · {config.get('max_new_tokens')} new tokens · temperatures "
            f"{', '.join(f'{t:g}' for t in config.get('temperatures', []))}{_truncation_note(config)} · "
            f"seed {config.get('seed')} · models "
            f"{meta.get('models', {}).get('target')} / {meta.get('models', {}).get('draft')} "
            f"({_weights_note(meta.get('models', {}))}) · model load {', '.join(f'{x:.1f}' for x in loads)} s · "
            f"raw results: [`{rel}`]({rel})"
        )
        load_avgs = [s.get("machine", {}).get("load_average_at_start") for s in sessions]
        load_avgs = [la[0] for la in load_avgs if la]
        if load_avgs:
            parts.append(f"(machine load average at start of each session: {', '.join(f'{x:.1f}' for x in load_avgs)} "
                         f"on {sessions[0].get('machine', {}).get('cores')} cores — shared machine, rates are noisy)")
        skipped = sorted({s for sess in sessions for s in sess.get("skipped", [])})
        if skipped:
            parts.append("Skipped: " + "; ".join(skipped))
        commands = [s["command"] + ("" if s.get("finished") else "   # interrupted; resumed below")
                    for s in sessions if s.get("command")]
        parts += ["", "```sh"] + commands + ["```", ""]
        parts.append((run_dir / "summary.md").read_text(encoding="utf-8"))
        notes = run_dir / "NOTES.md"  # the committed reading of the numbers, if any
        if notes.is_file():
            parts += [notes.read_text(encoding="utf-8").strip(), ""]
        for plot in summary.get("plots", []):
            parts.append(f"![{plot[:-4]}]({rel}/plots/{plot})")
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def update_readme(readme: str | os.PathLike[str], run_dirs: list[str | os.PathLike[str]]) -> str:
    """Replace the text between :data:`README_START` and :data:`README_END` (appended if absent)."""
    readme = Path(readme)
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    if README_START not in text or README_END not in text:
        text = text.rstrip("\n") + f"\n\n{README_START}\n{README_END}\n"
    section = readme_section([Path(d) for d in run_dirs], readme)
    pattern = re.compile(re.escape(README_START) + ".*?" + re.escape(README_END), re.DOTALL)
    text = pattern.sub(lambda _: f"{README_START}\n{section}{README_END}", text, count=1)
    readme.write_text(text, encoding="utf-8")
    return section


def _truncation_note(config: dict) -> str:
    """`` (top-p 0.9, top-k 50)`` for a run that truncated its sampled cells, else ``""``."""
    parts = []
    if config.get("top_p", 1.0) < 1.0:
        parts.append(f"top-p {config['top_p']:g}")
    if config.get("top_k", 0):
        parts.append(f"top-k {config['top_k']}")
    return f" ({', '.join(parts)})" if parts else ""


def _weights_note(models: dict) -> str:
    """``"auto"``, ``"auto; draft int4"`` or ``"openvino; target int8; draft int4, 49,153-entry head"``:
    the backend where it is not torch (else the dtype), any weight-only quantisation and a reduced
    draft head."""
    backend = models.get("backend")
    note = str(backend if backend not in (None, "torch") else models.get("dtype"))
    if models.get("quantize"):
        note += f"; target {models['quantize']}"
    draft = [str(models["quantize_draft"])] if models.get("quantize_draft") else []
    if isinstance(models.get("draft_head"), int):  # a reduced head ("full" otherwise)
        draft.append(f"{models['draft_head']:,}-entry head")
    if draft:
        note += "; draft " + ", ".join(draft)
    return note


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Re-write reports of benchmark runs and the README results section.")
    parser.add_argument("runs", nargs="+", help="run directories (with run.json)")
    parser.add_argument("--readme", help="README to update between the results markers")
    args = parser.parse_args(argv)
    dirs = sorted(Path(d) for d in args.runs if (Path(d) / "run.json").is_file())
    for d in dirs:
        write_reports(d)
        print(f"reports written in {d}")
    if args.readme:
        update_readme(args.readme, dirs)
        print(f"updated {args.readme}")


if __name__ == "__main__":  # pragma: no cover
    main()
