r"""``quickdraft analyze``: optimal multi-draft acceptance vs real verifiers on the default model pair.

The study of Hu et al. (2025, "Towards Optimal Multi-draft Speculative Decoding", §6) on our models,
with the full Qwen vocabulary (V = 151,936). For each temperature:

1. generate a response to each HumanEval and MT-Bench prompt with the engine (chain speculative
   decoding, lossless, so the text is a sample of the target at that temperature);
2. run **one** target forward and **one** draft forward over prompt + response, which gives the
   target's and the draft's next-token logits at every response position at once;
3. at ``--positions-per-prompt`` evenly spaced response positions turn both into distributions with
   :func:`quickdraft.verification.sampling.logits_to_probs` (the temperature applied, no top-k/top-p) and compute,
   for ``n = 1 .. --max-drafts`` drafts, the optimal acceptance rate :math:`\alpha^*` for the three
   draft sampling schemes and the exact acceptance rate of every verifier that is tractable at this
   vocabulary (:mod:`quickdraft.theory`);
4. average over positions and write ``analyze.json`` plus two plots into ``--out``.

"Acceptance rate" is the probability that the emitted token is one of the ``n`` drafts at one
position (the terms of :mod:`quickdraft.theory.multidraft`).

**RRS with drafts sampled without replacement** has no closed form: its residuals depend on the
masses of the drafts rejected so far, so the exact recursion visits every ordered prefix of rejected
drafts (:math:`O(V^{n-1})` residuals of size ``V``). It is reported as a *certified interval*
(``rrs_without_replacement_lower`` / ``_upper``, :mod:`quickdraft.theory.rrs_wor`): the exact rate lies
in it, and its width is part of the results (``rrs_wor_interval_width``), never hidden in a point value.
All per-position numbers come from :func:`quickdraft.theory.curves.acceptance_curves`, which shares one
sort of the vocabulary between all rates.
"""

from __future__ import annotations

import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quickdraft.errors import QuickdraftError
from quickdraft.theory.curves import METRICS, acceptance_curves

#: gap curves of the plot: label -> (bound metric, achieved metric); the RRS-without-replacement gap is
#: drawn as a band between the ends of its certified interval
GAPS: dict[str, tuple[str, str]] = {
    "with repl.: α* − RRS": ("optimal_with_replacement", "rrs_with_replacement"),
    "with repl.: α* − K-SEQ": ("optimal_with_replacement", "kseq_with_replacement"),
    "greedy: α* − RRS": ("optimal_greedy", "rrs_greedy"),
    "greedy: α* − optimal greedy verifier": ("optimal_greedy", "optimal_greedy_verifier"),
}
WOR_BAND = ("optimal_without_replacement", "rrs_without_replacement_lower", "rrs_without_replacement_upper")

#: Default budget of the certified RRS-without-replacement interval per position (tree expansions, children).
RRS_WOR_EXPANSIONS = 256
RRS_WOR_CHILDREN = 8

DEFAULT_OUT = Path("benchmarks/results/analyze")


# ----------------------------------------------------------------------------------------------------
# Pure mathematics and aggregation
# ----------------------------------------------------------------------------------------------------


def position_metrics(
    target_probs, draft_probs, max_drafts: int, rrs_wor_expansions: int = RRS_WOR_EXPANSIONS,
    rrs_wor_children: int = RRS_WOR_CHILDREN,
) -> dict[str, list[float]]:
    """Every metric of :data:`METRICS` for ``n = 1 .. max_drafts`` at one position.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[V]`` target and draft next-token distributions.
    max_drafts:
        Largest number of drafts ``n``.
    rrs_wor_expansions, rrs_wor_children:
        Budget of the certified RRS-without-replacement interval.

    Returns
    -------
    dict
        metric name -> list of ``max_drafts`` rates (index ``n - 1``), from
        :func:`quickdraft.theory.curves.acceptance_curves`.
    """
    return acceptance_curves(target_probs, draft_probs, max_drafts, rrs_wor_expansions, rrs_wor_children)


def aggregate(records: list[dict]) -> dict:
    """Mean and standard error of every metric over positions, per temperature and per (temperature, dataset).

    Parameters
    ----------
    records:
        One dict per position with keys ``temperature`` (float), ``dataset`` (str) and ``metrics``
        (metric name -> list over ``n``), as :func:`position_metrics` returns.

    Returns
    -------
    dict
        ``{"by_temperature": {"0.7": {"positions": N, "mean": {metric: [...]}, "stderr": {...}}},
        "by_temperature_dataset": {"0.7/humaneval": {...}}}``; keys are ``str(temperature)``. When the
        records hold the RRS-without-replacement interval, each group also has
        ``"rrs_wor_interval_width": {"mean": [...], "max": [...]}`` over positions.
    """
    if not records:
        raise QuickdraftError("no positions to aggregate")

    def summarise(rows: list[dict]) -> dict:
        names = list(rows[0]["metrics"])
        mean, stderr = {}, {}
        for name in names:
            arr = np.asarray([r["metrics"][name] for r in rows], dtype=np.float64)  # [positions, n]
            mean[name] = arr.mean(axis=0).tolist()
            stderr[name] = (arr.std(axis=0, ddof=1) / math.sqrt(len(rows))).tolist() if len(rows) > 1 else [0.0] * arr.shape[1]
        out = {"positions": len(rows), "mean": mean, "stderr": stderr}
        if "rrs_without_replacement_lower" in names and "rrs_without_replacement_upper" in names:
            width = np.asarray([np.subtract(r["metrics"]["rrs_without_replacement_upper"],
                                            r["metrics"]["rrs_without_replacement_lower"]) for r in rows])  # [positions, n]
            out["rrs_wor_interval_width"] = {"mean": width.mean(axis=0).tolist(), "max": width.max(axis=0).tolist()}
        return out

    by_t: dict[str, list[dict]] = {}
    by_td: dict[str, list[dict]] = {}
    for r in records:
        by_t.setdefault(str(float(r["temperature"])), []).append(r)
        by_td.setdefault(f"{float(r['temperature'])}/{r['dataset']}", []).append(r)
    return {
        "by_temperature": {k: summarise(v) for k, v in sorted(by_t.items())},
        "by_temperature_dataset": {k: summarise(v) for k, v in sorted(by_td.items())},
    }


def pick_positions(num_response_tokens: int, per_prompt: int) -> list[int]:
    """``per_prompt`` evenly spaced indices into a response of ``num_response_tokens`` tokens (fewer if short)."""
    if num_response_tokens <= 0 or per_prompt <= 0:
        return []
    return sorted({int(round(x)) for x in np.linspace(0, num_response_tokens - 1, min(per_prompt, num_response_tokens))})


# ----------------------------------------------------------------------------------------------------
# Collecting distributions along real generations
# ----------------------------------------------------------------------------------------------------


@dataclass
class PositionSample:
    """Target and draft distributions at one response position."""

    dataset: str
    prompt_id: str
    temperature: float
    index: int  # position within the response (0 = first generated token)
    target_probs: np.ndarray  # [V] float64
    draft_probs: np.ndarray  # [V] float64


def collect(pipe, prompts, temperature: float, max_new_tokens: int, positions_per_prompt: int, seed: int):
    """Yield :class:`PositionSample` along generations of ``pipe`` (target + draft) at ``temperature``."""
    import torch

    from quickdraft.verification.sampling import SamplingParams, logits_to_probs

    params = SamplingParams(temperature=temperature)
    for i, prompt in enumerate(prompts):
        ids = pipe.encode_messages(prompt.messages)
        out = pipe.generate([""], prompt_ids=[ids], method="sd", k=4, sampling=params,
                            max_new_tokens=max_new_tokens, seed=seed + i)
        response = list(out.completions[0].token_ids)
        chosen = pick_positions(len(response), positions_per_prompt)
        if not chosen:
            continue
        full = torch.tensor([ids + response], dtype=torch.long)  # [1, L]
        rows = torch.tensor([len(ids) - 1 + j for j in chosen])  # logits at row r predict token r + 1
        with torch.inference_mode():
            t_logits = pipe.target_model(full).logits[0, rows].float()  # [P, V]
            d_logits = pipe.draft_model(full).logits[0, rows].float()  # [P, V]
        vocab = pipe.vocab_size
        t_probs = logits_to_probs(t_logits[:, :vocab], params).double().numpy()
        d_probs = logits_to_probs(d_logits[:, :vocab], params).double().numpy()
        for j, idx in enumerate(chosen):
            yield PositionSample(prompt.dataset, prompt.id, temperature, idx, t_probs[j], d_probs[j])


# ----------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------


def plot(summary: dict, out_dir: Path) -> list[Path]:
    """Write ``acceptance.png`` (rates vs n) and ``gaps.png`` (gap to the bound vs n), one panel per temperature.

    In ``gaps.png`` the gap of RRS without replacement to :math:`\alpha^*_{\text{without repl.}}` is a band
    (its certified interval), next to the with-replacement gaps; the dotted curve is the gain of the
    without-replacement bound over the with-replacement one.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(summary["by_temperature"])
    paths = []
    fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 4.4), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], temps):
        s = summary["by_temperature"][t]
        for name, vals in s["mean"].items():
            n = np.arange(1, len(vals) + 1)
            style = "-" if name.startswith("optimal_") and name != "optimal_greedy_verifier" else "--"
            ax.errorbar(n, vals, yerr=s["stderr"][name], fmt=style, marker="o", ms=3, capsize=2, label=name)
        ax.set_title(f"temperature {t} ({s['positions']} positions)")
        ax.set_xlabel("drafts per position n")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("acceptance rate (emitted token is a draft)")
    axes[0][-1].legend(fontsize=6, loc="lower right")
    fig.suptitle("Qwen2.5-Coder 1.5B target / 0.5B draft, HumanEval + MT-Bench: optimal α* (solid) vs verifiers (dashed)")
    fig.tight_layout()
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 4.4), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], temps):
        m = summary["by_temperature"][t]["mean"]
        n_max = len(m["optimal_with_replacement"])
        n = np.arange(1, n_max + 1)
        for label, (bound, achieved) in GAPS.items():
            if bound in m and achieved in m:
                ax.plot(n, np.asarray(m[bound]) - np.asarray(m[achieved]), marker="o", ms=3, label=label)
        bound, lower, upper = WOR_BAND
        if all(k in m for k in WOR_BAND):
            hi_gap = np.asarray(m[bound]) - np.asarray(m[lower])
            lo_gap = np.asarray(m[bound]) - np.asarray(m[upper])
            ax.fill_between(n, lo_gap, hi_gap, color="tab:purple", alpha=0.35, label="without repl.: α* − RRS (certified band)")
            ax.plot(n, 0.5 * (lo_gap + hi_gap), color="tab:purple", lw=0.8)
            gain = np.asarray(m["optimal_without_replacement"]) - np.asarray(m["optimal_with_replacement"])
            ax.plot(n, gain, color="k", ls=":", marker=".", label="α*(without repl.) − α*(with repl.)")
        ax.axhline(0.0, color="k", lw=0.6)
        ax.set_title(f"temperature {t}")
        ax.set_xlabel("drafts per position n")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean gap to the optimal rate of the same sampling")
    axes[0][-1].legend(fontsize=6, loc="upper left")
    fig.suptitle("Gap to the optimal acceptance rate per verifier, with vs without replacement (and greedy drafts)")
    fig.tight_layout()
    paths.append(out_dir / "gaps.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


# ----------------------------------------------------------------------------------------------------
# CLI command
# ----------------------------------------------------------------------------------------------------


def _write(out: Path, command, records, temps, names, pipe, t0, t_models, t_theory, complete, config):
    """Aggregate, plot and write ``analyze.json`` (called after every temperature)."""
    summary = aggregate(records)
    out.mkdir(parents=True, exist_ok=True)
    figures = plot(summary, out)
    result = {
        "command": command,
        "complete": complete,
        "config": {**config, "temperatures": temps, "datasets": names,
                   "generation": "chain SD (k=4), lossless at each temperature",
                   "distributions": "logits_to_probs(logits, SamplingParams(temperature)), no top-k/top-p"},
        "vocab_size": int(pipe.vocab_size),
        "metrics": {k: {"sampling": s, "verifier": v or "optimal (alpha*)"} for k, (s, v) in METRICS.items()},
        "rrs_without_replacement": "certified interval [rrs_without_replacement_lower, rrs_without_replacement_upper] "
                                   "per position (quickdraft.theory.rrs_wor); summary.*.rrs_wor_interval_width gives "
                                   "its mean and max width over positions",
        "environment": {"python": platform.python_version(), "numpy": np.__version__},
        "timing_s": {"total": round(time.perf_counter() - t0, 1), "models": round(t_models, 1), "theory": round(t_theory, 1),
                     "theory_per_position_mean": round(t_theory / max(1, len(records)), 3),
                     "theory_per_position_max": round(max((r.get("theory_s", 0.0) for r in records), default=0.0), 3)},
        "summary": summary,
        "positions": records,
        "figures": [p.name for p in figures],
    }
    (out / "analyze.json").write_text(json.dumps(result, indent=1) + "\n")
    return summary, figures


def analyze_command(
    limit: int = 4,
    max_new_tokens: int = 48,
    positions_per_prompt: int = 8,
    out: Path = DEFAULT_OUT,
    max_drafts: int = 8,
    temperatures: str = "0.5,0.7,1.0",
    datasets: str = "humaneval,mtbench",
    target: str = "target",
    draft: str = "draft",
    seed: int = 0,
    rrs_wor_expansions: int = RRS_WOR_EXPANSIONS,
    rrs_wor_children: int = RRS_WOR_CHILDREN,
    time_budget: float = 0.0,
) -> None:
    """Optimal multi-draft acceptance (Hu et al. 2025) vs RRS / K-SEQ / greedy verifiers on real distributions.

    Generates responses to the first LIMIT prompts of each dataset at each temperature, collects target and
    draft next-token distributions at POSITIONS_PER_PROMPT response positions, and writes analyze.json,
    acceptance.png and gaps.png into OUT.
    """
    import typer

    from quickdraft.evaluation.datasets import load_humaneval, load_mtbench
    from quickdraft.pipeline import Pipeline

    try:
        temps = [float(x) for x in temperatures.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--temperatures must be comma-separated numbers, got {temperatures!r}") from None
    if time_budget < 0:
        raise typer.BadParameter(f"--time-budget must be >= 0 seconds, got {time_budget}")
    if not temps or any(t <= 0 for t in temps):
        raise typer.BadParameter("--temperatures must be positive (the optimal rate needs sampled distributions)")
    for name, val in (("limit", limit), ("max-new-tokens", max_new_tokens), ("positions-per-prompt", positions_per_prompt), ("max-drafts", max_drafts), ("rrs-wor-expansions", rrs_wor_expansions), ("rrs-wor-children", rrs_wor_children)):
        if val < 1:
            raise typer.BadParameter(f"--{name} must be >= 1, got {val}")
    loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench}
    names = [d.strip() for d in datasets.split(",") if d.strip()]
    unknown = [d for d in names if d not in loaders]
    if unknown:
        raise typer.BadParameter(f"unknown dataset(s) {unknown}; choose from {sorted(loaders)}")

    command = "quickdraft analyze " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a != "analyze")
    t0 = time.perf_counter()
    pipe = Pipeline.from_specs(target, draft)
    per_dataset = [loaders[d](limit) for d in names]
    # interleave the datasets (humaneval 0, mtbench 0, humaneval 1, ...) so a time budget cuts both evenly
    prompts = [ps[i] for i in range(max(len(x) for x in per_dataset)) for ps in per_dataset if i < len(ps)]
    typer.echo(f"loaded models in {time.perf_counter() - t0:.1f} s; {len(prompts)} prompts x {len(temps)} temperatures", err=True)
    records: list[dict] = []
    t_models = t_theory = 0.0
    config = dict(limit=limit, max_new_tokens=max_new_tokens, positions_per_prompt=positions_per_prompt,
                  max_drafts=max_drafts, target=target, draft=draft, seed=seed, rrs_wor_expansions=rrs_wor_expansions,
                  rrs_wor_children=rrs_wor_children, time_budget=time_budget)
    t_loop = time.perf_counter()
    done = 0
    for i, prompt in enumerate(prompts):
        elapsed = time.perf_counter() - t0
        per_prompt = (time.perf_counter() - t_loop) / done if done else 0.0
        if time_budget and done and elapsed + per_prompt > time_budget:
            typer.echo(f"time budget: stopping after {done} of {len(prompts)} prompts ({elapsed:.0f} s elapsed, "
                       f"~{per_prompt:.0f} s per prompt)", err=True)
            break
        for temp in temps:
            it = collect(pipe, [prompt], temp, max_new_tokens, positions_per_prompt, seed + i)
            while True:
                t1 = time.perf_counter()
                try:
                    sample = next(it)
                except StopIteration:
                    t_models += time.perf_counter() - t1
                    break
                t2 = time.perf_counter()
                metrics = position_metrics(sample.target_probs, sample.draft_probs, max_drafts, rrs_wor_expansions,
                                           rrs_wor_children)
                t3 = time.perf_counter()
                t_models += t2 - t1
                t_theory += t3 - t2
                records.append({"dataset": sample.dataset, "prompt_id": sample.prompt_id, "temperature": temp,
                                "response_index": sample.index, "theory_s": round(t3 - t2, 3), "metrics": metrics})
        done += 1
        typer.echo(f"prompt {i + 1}/{len(prompts)} ({prompt.dataset}): {len(records)} positions so far "
                   f"({time.perf_counter() - t0:.0f} s elapsed)", err=True)
        # write what is done so far after every prompt, so an interrupted run still leaves results
        if records:
            summary, figures = _write(Path(out), command, records, temps, names, pipe, t0, t_models, t_theory,
                                      complete=done == len(prompts), config={**config, "prompts_done": done})
    if not records:
        raise QuickdraftError("no positions were collected (empty responses?)")
    out = Path(out)
    typer.echo(f"wrote {out / 'analyze.json'} and {', '.join(str(p) for p in figures)}", err=True)
    for t, s in summary["by_temperature"].items():
        m = s["mean"]
        typer.echo(f"T={t} n={max_drafts}: α*wr {m['optimal_with_replacement'][-1]:.4f}  α*wor {m['optimal_without_replacement'][-1]:.4f}  "
                   f"α*greedy {m['optimal_greedy'][-1]:.4f}  rrs {m['rrs_with_replacement'][-1]:.4f}  "
                   f"kseq {m['kseq_with_replacement'][-1]:.4f}  rrs-wor [{m['rrs_without_replacement_lower'][-1]:.4f}, "
                   f"{m['rrs_without_replacement_upper'][-1]:.4f}]  rrs-greedy {m['rrs_greedy'][-1]:.4f}")
