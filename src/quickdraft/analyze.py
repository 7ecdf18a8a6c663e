r"""``quickdraft analyze``: optimal multi-draft acceptance vs real verifiers on the default model pair.

The study of Hu et al. (2025, "Towards Optimal Multi-draft Speculative Decoding", §6) on our models,
with the full Qwen vocabulary (V = 151,936). For each temperature:

1. generate a response to each HumanEval and MT-Bench prompt with the engine (chain speculative
   decoding, lossless, so the text is a sample of the target at that temperature);
2. run **one** target forward and **one** draft forward over prompt + response, which gives the
   target's and the draft's next-token logits at every response position at once;
3. at ``--positions-per-prompt`` evenly spaced response positions turn both into distributions with
   :func:`quickdraft.sampling.logits_to_probs` (the temperature applied, no top-k/top-p) and compute,
   for ``n = 1 .. --max-drafts`` drafts, the optimal acceptance rate :math:`\alpha^*` for the three
   draft sampling schemes and the exact acceptance rate of every verifier that is tractable at this
   vocabulary (:mod:`quickdraft.theory`);
4. average over positions and write ``analyze.json`` plus two plots into ``--out``.

"Acceptance rate" is the probability that the emitted token is one of the ``n`` drafts at one
position (the terms of :mod:`quickdraft.theory.multidraft`).

Not computed: **RRS with drafts sampled without replacement** for ``n >= 2``. Its exact rate depends
on which tokens were drafted and rejected before (the residual after rejecting ``x_1`` differs for
each ``x_1``), so the exact recursion visits every ordered prefix of rejected drafts:
:math:`O(V^{n-1})` residual distributions of size ``V``, about :math:`2 \cdot 10^{10}` operations already
for ``n = 2``. (For ``n = 1`` it is :math:`1 - \mathrm{TV}`.) Monte Carlo would be possible but is not
exact, so it is left out rather than mixed with exact numbers.
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

#: metric name -> (sampling scheme, verifier); verifier None means the optimal rate alpha*
METRICS: dict[str, tuple[str, str | None]] = {
    "optimal_with_replacement": ("with_replacement", None),
    "optimal_without_replacement": ("without_replacement", None),
    "optimal_greedy": ("greedy", None),
    "rrs_with_replacement": ("with_replacement", "rrs"),
    "kseq_with_replacement": ("with_replacement", "kseq"),
    "rrs_greedy": ("greedy", "rrs"),
    "optimal_greedy_verifier": ("greedy", "optimal_greedy"),
}

#: gap curves of the plot: label -> (bound metric, achieved metric)
GAPS: dict[str, tuple[str, str]] = {
    "α*(with repl.) − RRS": ("optimal_with_replacement", "rrs_with_replacement"),
    "α*(with repl.) − K-SEQ": ("optimal_with_replacement", "kseq_with_replacement"),
    "α*(greedy) − RRS(greedy)": ("optimal_greedy", "rrs_greedy"),
    "α*(greedy) − optimal greedy verifier": ("optimal_greedy", "optimal_greedy_verifier"),
    "α*(without repl.) − α*(with repl.)": ("optimal_without_replacement", "optimal_with_replacement"),
}

DEFAULT_OUT = Path("benchmarks/results/analyze")


# ----------------------------------------------------------------------------------------------------
# Pure mathematics and aggregation
# ----------------------------------------------------------------------------------------------------


def position_metrics(target_probs, draft_probs, max_drafts: int) -> dict[str, list[float]]:
    """Every metric of :data:`METRICS` for ``n = 1 .. max_drafts`` at one position.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[V]`` target and draft next-token distributions.
    max_drafts:
        Largest number of drafts ``n``.

    Returns
    -------
    dict
        metric name -> list of ``max_drafts`` rates (index ``n - 1``).
    """
    from quickdraft.theory import optimal_acceptance, verifier_acceptance

    p = np.asarray(target_probs, dtype=np.float64)
    q = np.asarray(draft_probs, dtype=np.float64)
    out: dict[str, list[float]] = {}
    for name, (sampling, verifier) in METRICS.items():
        vals = []
        for n in range(1, max_drafts + 1):
            if verifier is None:
                vals.append(optimal_acceptance(p, q, n, sampling))
            else:
                vals.append(verifier_acceptance(p, q, n, sampling, verifier))
        out[name] = vals
    return out


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
        "by_temperature_dataset": {"0.7/humaneval": {...}}}``; keys are ``str(temperature)``.
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
        return {"positions": len(rows), "mean": mean, "stderr": stderr}

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

    from quickdraft.sampling import SamplingParams, logits_to_probs

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
    """Write ``acceptance.png`` (rates vs n) and ``gaps.png`` (gap to the bound vs n), one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(summary["by_temperature"])
    paths = []
    fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 4.2), squeeze=False, sharey=True)
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
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Qwen2.5-Coder 1.5B target / 0.5B draft, HumanEval + MT-Bench: optimal α* (solid) vs verifiers (dashed)")
    fig.tight_layout()
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 4.2), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], temps):
        s = summary["by_temperature"][t]
        for label, (bound, achieved) in GAPS.items():
            gap = np.asarray(s["mean"][bound]) - np.asarray(s["mean"][achieved])
            ax.plot(np.arange(1, gap.size + 1), gap, marker="o", ms=3, label=label)
        ax.axhline(0.0, color="k", lw=0.6)
        ax.set_title(f"temperature {t}")
        ax.set_xlabel("drafts per position n")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean gap (acceptance-rate points)")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle("Gap to the optimal acceptance rate per verifier; last curve: gain of sampling without replacement")
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
        "not_computed": {"rrs_without_replacement": "exact rate needs O(V^(n-1)) residual distributions of size "
                                                     "V (~2e10 operations at n = 2, V = 151,936); n = 1 equals 1 - TV"},
        "environment": {"python": platform.python_version(), "numpy": np.__version__},
        "timing_s": {"total": round(time.perf_counter() - t0, 1), "models": round(t_models, 1), "theory": round(t_theory, 1)},
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
) -> None:
    """Optimal multi-draft acceptance (Hu et al. 2025) vs RRS / K-SEQ / greedy verifiers on real distributions.

    Generates responses to the first LIMIT prompts of each dataset at each temperature, collects target and
    draft next-token distributions at POSITIONS_PER_PROMPT response positions, and writes analyze.json,
    acceptance.png and gaps.png into OUT.
    """
    import typer

    from quickdraft.datasets import load_humaneval, load_mtbench
    from quickdraft.pipeline import Pipeline

    try:
        temps = [float(x) for x in temperatures.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--temperatures must be comma-separated numbers, got {temperatures!r}") from None
    if not temps or any(t <= 0 for t in temps):
        raise typer.BadParameter("--temperatures must be positive (the optimal rate needs sampled distributions)")
    for name, val in (("limit", limit), ("max-new-tokens", max_new_tokens), ("positions-per-prompt", positions_per_prompt), ("max-drafts", max_drafts)):
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
    prompts = [p for d in names for p in loaders[d](limit)]
    typer.echo(f"loaded models in {time.perf_counter() - t0:.1f} s; {len(prompts)} prompts x {len(temps)} temperatures", err=True)
    records: list[dict] = []
    t_models = t_theory = 0.0
    for temp in temps:
        it = collect(pipe, prompts, temp, max_new_tokens, positions_per_prompt, seed)
        while True:
            t1 = time.perf_counter()
            try:
                sample = next(it)
            except StopIteration:
                t_models += time.perf_counter() - t1
                break
            t2 = time.perf_counter()
            metrics = position_metrics(sample.target_probs, sample.draft_probs, max_drafts)
            t3 = time.perf_counter()
            t_models += t2 - t1
            t_theory += t3 - t2
            records.append({"dataset": sample.dataset, "prompt_id": sample.prompt_id, "temperature": temp,
                            "response_index": sample.index, "metrics": metrics})
        typer.echo(f"temperature {temp}: {sum(r['temperature'] == temp for r in records)} positions "
                   f"({time.perf_counter() - t0:.0f} s elapsed)", err=True)
        # write what is done so far after every temperature, so an interrupted run still leaves results
        summary, figures = _write(Path(out), command, records, temps, names, pipe, t0, t_models, t_theory,
                                  complete=temp == temps[-1], config=dict(limit=limit, max_new_tokens=max_new_tokens,
                                  positions_per_prompt=positions_per_prompt, max_drafts=max_drafts, target=target,
                                  draft=draft, seed=seed))
    out = Path(out)
    typer.echo(f"wrote {out / 'analyze.json'} and {', '.join(str(p) for p in figures)}", err=True)
    for t, s in summary["by_temperature"].items():
        m = s["mean"]
        typer.echo(f"T={t} n={max_drafts}: α*wr {m['optimal_with_replacement'][-1]:.4f}  α*wor {m['optimal_without_replacement'][-1]:.4f}  "
                   f"α*greedy {m['optimal_greedy'][-1]:.4f}  rrs {m['rrs_with_replacement'][-1]:.4f}  "
                   f"kseq {m['kseq_with_replacement'][-1]:.4f}  rrs-greedy {m['rrs_greedy'][-1]:.4f}")
