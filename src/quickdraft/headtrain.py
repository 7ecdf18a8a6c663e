"""Training the SpecDec++ acceptance head (``quickdraft train-head``), on CPU.

Data (Huang, Guo & Wang 2024, Sec. 3.2 and their ``data/`` scripts), one example per response token:

1. **responses** -- the target answers the training prompts (:mod:`quickdraft.trainprompts`) with
   batched plain decoding through :func:`quickdraft.engine.generate` (greedy by default):
   ``X = (x_0, ..., x_{n-1})``.
2. **drafts and labels** -- one target and one draft forward over ``prompt + X`` give, at every
   response position ``j``, the target's and the draft's next-token distributions ``p_j, q_j``
   given the *target's* prefix ``X_{<j}``. The draft samples ``y_j ~ q_j`` and the label is the
   exact acceptance probability of speculative sampling, ``a_j = min(1, p_j(y_j) / q_j(y_j))``
   (:func:`acceptance_labels`; at temperature 0 it is ``1[argmax q_j = argmax p_j]``).
3. **mixed context** -- ``Z_j = y_j`` except at a random share ``r`` (default 15%) of positions where
   ``Z_j = x_j`` and no loss is taken (:func:`mix_tokens`), so the head sees prefixes of both kinds.
4. **features** -- one draft forward over ``prompt + Z``; the feature of position ``j`` is the
   draft's last hidden state at token ``Z_j`` (the state the policy reads when ``Z_j`` is fed back
   to draft the next token). Features, labels and masks are cached under
   ``~/.cache/quickdraft/specdecpp/`` so the training itself takes seconds.
5. **training** -- the draft model is frozen; the head minimises the weighted binary cross-entropy
   with soft labels (:func:`weighted_bce`)

   .. math::  \\ell = -\\frac{\\sum_j a_j \\log \\hat P_j + w (1 - a_j) \\log(1 - \\hat P_j)}{\\sum_j a_j + w (1 - a_j)}

   with rejection weight ``w`` (default 6). Its minimiser is ``P̂ = a / (a + w (1 − a))``, not
   ``a``: the weighted head under-predicts acceptance on purpose (it makes the policy stop earlier
   for the same ``h``); :func:`unweight` maps it back to a calibrated probability.

Prompts are split into training and held-out prompts (whole prompts, not positions); the held-out
positions give the Brier score and the reliability plot.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import typer

from quickdraft.errors import QuickdraftError
from quickdraft.head import AcceptanceHead, HeadMetadata, model_fingerprint, save_head
from quickdraft.sampling import SamplingParams, logits_to_probs

DEFAULT_HEAD_PATH = "models/heads/specdecpp-qwen2.5-coder-0.5b.pt"


@dataclass
class TrainConfig:
    """Settings of ``quickdraft train-head``.

    Attributes
    ----------
    num_prompts: training prompts (held-out ones included).
    max_new_tokens: longest target response.
    gen_batch: prompts per batched target generation.
    response_temperature: temperature of the target's responses (0 = greedy).
    temperature: temperature of the draft samples and of the labels' ``p`` and ``q``.
    mix_ratio: share of positions that keep the target's token as context (no loss there).
    reject_weight: weight ``w`` of the rejection class in the loss.
    num_layers: residual blocks of the head.
    epochs: training epochs (the held-out-best epoch is kept).
    lr: Adam learning rate.
    weight_decay: AdamW weight decay.
    batch_size: positions per optimisation step.
    holdout: share of prompts held out for evaluation.
    seed: seeds prompts' sample, draft samples, mixing, split and initialisation.
    """

    num_prompts: int = 160
    max_new_tokens: int = 96
    gen_batch: int = 16
    response_temperature: float = 0.0
    temperature: float = 1.0
    mix_ratio: float = 0.15
    reject_weight: float = 6.0
    num_layers: int = 2
    epochs: int = 30
    lr: float = 1e-3
    weight_decay: float = 0.01
    batch_size: int = 512
    holdout: float = 0.15
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.mix_ratio < 1.0:
            raise QuickdraftError(f"mix_ratio must be in [0, 1), got {self.mix_ratio}")
        if self.reject_weight <= 0:
            raise QuickdraftError(f"reject_weight must be > 0, got {self.reject_weight}")
        if not 0.0 < self.holdout < 1.0:
            raise QuickdraftError(f"holdout must be in (0, 1), got {self.holdout}")
        for name in ("num_prompts", "max_new_tokens", "gen_batch", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise QuickdraftError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Examples:
    """Cached training data: one row per response position.

    Attributes
    ----------
    features: ``[N, H]`` draft hidden states (bf16).
    labels: ``[N]`` acceptance probabilities ``a_j`` (float32).
    loss_mask: ``[N]`` bool, False where the context token is the target's (no loss).
    groups: ``[N]`` int64 prompt index (for the held-out split).
    data_hash: SHA-256 over prompts, responses, draft samples and labels.
    """

    features: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    groups: torch.Tensor
    data_hash: str


# ---------------------------------------------------------------------------------------------
# pure pieces
# ---------------------------------------------------------------------------------------------


def acceptance_labels(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator, greedy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft one token per position and its exact acceptance probability.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[n, V]`` next-token distributions of target and draft given the same prefixes.
    generator:
        Randomness of the draft samples.
    greedy:
        Draft the argmax instead of sampling (temperature 0).

    Returns
    -------
    ``(draft_ids [n], labels [n])`` with ``labels = min(1, p(y) / q(y))``.
    """
    if target_probs.shape != draft_probs.shape or target_probs.dim() != 2:
        raise QuickdraftError(f"need equal [n, V] shapes, got {tuple(target_probs.shape)} and {tuple(draft_probs.shape)}")
    if greedy:
        ids = draft_probs.argmax(dim=-1)
    else:
        ids = torch.multinomial(draft_probs.float(), 1, generator=generator).squeeze(-1)
    p = target_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).float()
    q = draft_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).float()
    return ids, torch.where(q > 0, (p / q.clamp_min(1e-30)).clamp_max(1.0), (p > 0).float())


def mix_tokens(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, ratio: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecDec++'s mixed context: keep the target's token at a random share ``ratio`` of positions.

    Returns ``(mixed_ids [n], loss_mask [n])``; ``loss_mask`` is False where the target token was kept.

    >>> g = torch.Generator().manual_seed(0)
    >>> mix_tokens(torch.tensor([1, 2, 3]), torch.tensor([7, 8, 9]), 0.0, g)[0].tolist()
    [7, 8, 9]
    """
    keep_target = torch.rand(target_ids.shape, generator=generator) < ratio
    return torch.where(keep_target, target_ids, draft_ids), ~keep_target


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """Weighted binary cross-entropy with soft labels (see the module docstring).

    ``logits [N]`` of acceptance, ``labels [N]`` in ``[0, 1]``; normalised by the total weight.
    """
    log_acc = torch.nn.functional.logsigmoid(logits)
    log_rej = torch.nn.functional.logsigmoid(-logits)
    weights = labels + reject_weight * (1.0 - labels)
    return -(labels * log_acc + reject_weight * (1.0 - labels) * log_rej).sum() / weights.sum().clamp_min(1e-12)


def unweight(pred: torch.Tensor, reject_weight: float) -> torch.Tensor:
    """Invert the weighting: from ``P̂ = a / (a + w (1 − a))`` back to ``a = w P̂ / (1 − P̂ + w P̂)``."""
    return reject_weight * pred / (1.0 - pred + reject_weight * pred)


def brier_score(pred: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean squared error of predicted acceptance probabilities against the exact ones."""
    return float(((pred.float() - labels.float()) ** 2).mean())


def reliability_table(pred: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> list[dict]:
    """Per equal-width bin of the prediction: count, mean prediction, mean label."""
    idx = (pred.clamp(0, 1 - 1e-9) * bins).long()
    rows = []
    for b in range(bins):
        sel = idx == b
        n = int(sel.sum())
        rows.append({
            "bin": [b / bins, (b + 1) / bins],
            "count": n,
            "mean_pred": float(pred[sel].mean()) if n else None,
            "mean_label": float(labels[sel].mean()) if n else None,
        })
    return rows


def _hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# data construction (needs the models)
# ---------------------------------------------------------------------------------------------


def specdecpp_cache_dir() -> Path:
    from quickdraft.models import default_cache_dir

    return default_cache_dir() / "specdecpp"


def generate_responses(pipe, prompt_ids: list[list[int]], cfg: TrainConfig, cache: Path, log=print) -> list[list[int]]:
    """Target responses to ``prompt_ids``, batched plain decoding, cached per batch in ``cache``."""
    from quickdraft.engine import generate

    sampling = SamplingParams(temperature=cfg.response_temperature)
    responses: list[list[int]] = []
    eos = pipe.eos_ids()
    for start in range(0, len(prompt_ids), cfg.gen_batch):
        batch = prompt_ids[start:start + cfg.gen_batch]
        key = _hash_json({"t": "responses", "ids": batch, "n": cfg.max_new_tokens, "T": cfg.response_temperature,
                          "seed": cfg.seed + start})
        path = cache / f"responses-{key[:20]}.json"
        if path.exists():
            responses.extend(json.loads(path.read_text()))
            continue
        t0 = time.perf_counter()
        out = generate(pipe.target, batch, method="ar", sampling=sampling, max_new_tokens=cfg.max_new_tokens,
                       seed=cfg.seed + start, eos_token_ids=eos)
        path.write_text(json.dumps(out.sequences))
        responses.extend(out.sequences)
        n_tok = sum(len(s) for s in out.sequences)
        log(f"  responses {start + len(batch)}/{len(prompt_ids)}: {n_tok} tokens in "
            f"{time.perf_counter() - t0:.0f} s")
    return responses


def _next_token_probs(runner, seq: list[int], n: int, params: SamplingParams, hidden: bool = False):
    """Distributions ``[n, V]`` predicting the last ``n`` tokens of ``seq`` (and hidden ``[n, H]``
    at those tokens when ``hidden``), from one forward of ``runner``'s model over ``seq``."""
    runner.reset(1)
    out = runner.forward(torch.tensor([seq]), logits_to_keep=n + 1, output_hidden=hidden)
    probs = logits_to_probs(out.logits[0, :n], params)
    return probs, (out.hidden[0, 1:] if hidden else None)


def build_examples(pipe, prompt_ids: list[list[int]], responses: list[list[int]], cfg: TrainConfig,
                   log=print) -> Examples:
    """Steps 2-4 of the module docstring for every (prompt, response) pair."""
    vocab = pipe.vocab_size
    params = SamplingParams(temperature=cfg.temperature)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    feats, labels, masks, groups = [], [], [], []
    digest = hashlib.sha256()
    t0 = time.perf_counter()
    for g, (prompt, resp) in enumerate(zip(prompt_ids, responses)):
        n = len(resp)
        if n == 0:
            continue
        seq = prompt + resp
        p, _ = _next_token_probs(pipe.target, seq, n, params)
        q, _ = _next_token_probs(pipe.draft, seq, n, params)
        draft_ids, a = acceptance_labels(p[:, :vocab], q[:, :vocab], gen, greedy=params.greedy)
        mixed, mask = mix_tokens(torch.tensor(resp), draft_ids, cfg.mix_ratio, gen)
        pipe.draft.reset(1)
        out = pipe.draft.forward(torch.tensor([prompt + mixed.tolist()]), logits_to_keep=n, output_hidden=True)
        feats.append(out.hidden[0].to(torch.bfloat16))  # [n, H], hidden at Z_j
        labels.append(a)
        masks.append(mask)
        groups.append(torch.full((n,), g, dtype=torch.long))
        digest.update(json.dumps([prompt, resp, draft_ids.tolist(), mixed.tolist()]).encode())
        digest.update(a.numpy().tobytes())
        if (g + 1) % 20 == 0:
            log(f"  examples {g + 1}/{len(prompt_ids)} ({time.perf_counter() - t0:.0f} s)")
    pipe.target.reset(0)
    pipe.draft.reset(0)
    return Examples(torch.cat(feats), torch.cat(labels), torch.cat(masks), torch.cat(groups), digest.hexdigest())


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def split_groups(groups: torch.Tensor, holdout: float, seed: int) -> torch.Tensor:
    """Bool ``[N]``: True for positions of held-out prompts (a seeded ``holdout`` share of prompts)."""
    ids = groups.unique()
    gen = torch.Generator().manual_seed(seed)
    perm = ids[torch.randperm(len(ids), generator=gen)]
    n_hold = max(1, int(round(holdout * len(ids))))
    return torch.isin(groups, perm[:n_hold])


def train_head(examples: Examples, cfg: TrainConfig, metadata: HeadMetadata | None = None,
               log=print) -> tuple[AcceptanceHead, dict]:
    """Fit an :class:`AcceptanceHead` on the loss positions of ``examples``.

    Returns the head of the epoch with the lowest held-out loss and a report (losses per epoch,
    Brier scores, reliability table of the held-out positions).
    """
    torch.manual_seed(cfg.seed)  # nn.Linear's initialisation reads the global generator
    held = split_groups(examples.groups, cfg.holdout, cfg.seed)
    train_sel = examples.loss_mask & ~held
    eval_sel = examples.loss_mask & held
    if int(train_sel.sum()) == 0 or int(eval_sel.sum()) == 0:
        raise QuickdraftError("too little training data: no training or no held-out positions")
    x_tr, y_tr = examples.features[train_sel].float(), examples.labels[train_sel]
    x_ev, y_ev = examples.features[eval_sel].float(), examples.labels[eval_sel]
    head = AcceptanceHead(x_tr.shape[1], cfg.num_layers, metadata)
    head.set_normalisation(x_tr)
    with torch.no_grad():  # start at the (weighted) base rate
        rate = float(y_tr.mean())
        head.out.bias.fill_(math.log(max(rate, 1e-3) / max(cfg.reject_weight * (1 - rate), 1e-3)))
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    history = []
    best = (float("inf"), None, -1)
    for epoch in range(cfg.epochs):
        head.train()
        perm = torch.randperm(len(y_tr), generator=gen)
        total = 0.0
        for s in range(0, len(perm), cfg.batch_size):
            idx = perm[s:s + cfg.batch_size]
            loss = weighted_bce(head(x_tr[idx]), y_tr[idx], cfg.reject_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        head.eval()
        with torch.no_grad():
            ev = float(weighted_bce(head(x_ev), y_ev, cfg.reject_weight))
        history.append({"epoch": epoch, "train_loss": total / len(perm), "heldout_loss": ev})
        if ev < best[0]:
            best = (ev, {k: v.clone() for k, v in head.state_dict().items()}, epoch)
    head.load_state_dict(best[1])
    head.eval()
    with torch.no_grad():
        pred = torch.sigmoid(head(x_ev))
    calibrated = unweight(pred, cfg.reject_weight)
    base = torch.full_like(y_ev, float(y_tr.mean()))
    report = {
        "train_positions": int(train_sel.sum()),
        "heldout_positions": int(eval_sel.sum()),
        "heldout_prompts": int(examples.groups[held].unique().numel()),
        "best_epoch": best[2],
        "history": history,
        "heldout_mean_label": float(y_ev.mean()),
        "brier_raw": brier_score(pred, y_ev),
        "brier_unweighted": brier_score(calibrated, y_ev),
        "brier_constant_baseline": brier_score(base, y_ev),
        "reliability_raw": reliability_table(pred, y_ev),
        "reliability_unweighted": reliability_table(calibrated, y_ev),
    }
    log(f"  best epoch {best[2]}: held-out loss {best[0]:.4f}; Brier raw {report['brier_raw']:.4f}, "
        f"unweighted {report['brier_unweighted']:.4f}, constant baseline {report['brier_constant_baseline']:.4f}")
    return head, report


def plot_reliability(report: dict, path: str | Path, title: str = "") -> Path:
    """Reliability diagram (mean exact acceptance probability per bin of the prediction) as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], ":", color="gray", label="perfect calibration")
    for key, label, marker in (("reliability_raw", f"head output (Brier {report['brier_raw']:.3f})", "o"),
                               ("reliability_unweighted", f"un-weighted (Brier {report['brier_unweighted']:.3f})", "s")):
        rows = [r for r in report[key] if r["count"]]
        ax.plot([r["mean_pred"] for r in rows], [r["mean_label"] for r in rows], marker=marker, label=label)
    ax.set_xlabel("predicted P(accept | earlier accepted)")
    ax.set_ylabel("mean exact acceptance probability min(1, p/q)")
    ax.set_title(title or f"held-out positions: {report['heldout_positions']}")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------


def run_training(cfg: TrainConfig, target: str = "target", draft: str = "draft", out: str = DEFAULT_HEAD_PATH,
                 report_path: str | None = None, plot_path: str | None = None, threads: int | None = None,
                 log=print) -> tuple[AcceptanceHead, dict]:
    """The whole pipeline: prompts, responses, examples (cached), training, saving."""
    from quickdraft.models import ALIASES
    from quickdraft.pipeline import Pipeline, set_threads
    from quickdraft.trainprompts import training_prompts

    set_threads(threads)
    t_start = time.perf_counter()
    cache = specdecpp_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline.from_specs(target, draft)
    prompts = training_prompts(cfg.num_prompts, seed=cfg.seed)
    prompt_ids = [pipe.encode(p) for p in prompts]
    log(f"{len(prompts)} prompts from the standard library's docstrings; target responses ...")
    t0 = time.perf_counter()
    responses = generate_responses(pipe, prompt_ids, cfg, cache, log)
    t_resp = time.perf_counter() - t0
    key = _hash_json({"t": "examples", "prompts": prompt_ids, "responses": responses, "target": target,
                      "draft": draft, "cfg": [cfg.temperature, cfg.mix_ratio, cfg.seed]})
    ex_path = cache / f"examples-{key[:20]}.pt"
    t0 = time.perf_counter()
    if ex_path.exists():
        examples = Examples(**torch.load(ex_path, weights_only=True))
        log(f"examples loaded from {ex_path}")
    else:
        log("draft samples, labels and hidden states ...")
        examples = build_examples(pipe, prompt_ids, responses, cfg, log)
        torch.save(asdict(examples), ex_path)
    t_ex = time.perf_counter() - t0
    meta = HeadMetadata(
        draft=ALIASES.get(draft, draft), target=ALIASES.get(target, target),
        draft_fingerprint=model_fingerprint(pipe.draft_model), data_hash=examples.data_hash,
        temperature=cfg.temperature,
    )
    log(f"training on {int(examples.loss_mask.sum())} positions ...")
    t0 = time.perf_counter()
    head, report = train_head(examples, cfg, meta, log)
    t_train = time.perf_counter() - t0
    report.update(
        config=asdict(cfg), target=meta.target, draft=meta.draft, data_hash=meta.data_hash,
        num_prompts=len(prompts), response_tokens=sum(len(r) for r in responses),
        seconds={"responses": t_resp, "examples": t_ex, "training": t_train, "total": time.perf_counter() - t_start},
    )
    head.metadata.extra = {k: report[k] for k in ("brier_raw", "brier_unweighted", "brier_constant_baseline",
                                                   "train_positions", "heldout_positions", "response_tokens")}
    head.metadata.extra["reject_weight"] = cfg.reject_weight
    save_head(head, out)
    log(f"head saved to {out} ({Path(out).stat().st_size / 1e6:.1f} MB)")
    if report_path:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(report, indent=1))
    if plot_path:
        plot_reliability(report, plot_path, title=f"SpecDec++ head, {report['heldout_positions']} held-out positions")
    return head, report


def train_head_command(
    out: str = typer.Option(DEFAULT_HEAD_PATH, "--out", help="Where to write the head file."),
    target: str = typer.Option("target", help="Target model (registry name, alias, directory or .gguf)."),
    draft: str = typer.Option("draft", help="Draft model the head reads the hidden states of."),
    num_prompts: int = typer.Option(160, "--num-prompts", help="Training prompts (15% held out)."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens", help="Longest target response."),
    gen_batch: int = typer.Option(16, "--gen-batch", help="Prompts per batched target generation."),
    temperature: float = typer.Option(1.0, help="Temperature of the draft samples and the labels."),
    mix_ratio: float = typer.Option(0.15, "--mix-ratio", help="Share of positions with the target's token as context."),
    reject_weight: float = typer.Option(6.0, "--reject-weight", help="Loss weight of the rejection class."),
    num_layers: int = typer.Option(2, "--num-layers", help="Residual blocks of the head."),
    epochs: int = typer.Option(30),
    seed: int = typer.Option(0),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
    report: Optional[str] = typer.Option(None, help="Write the training report (JSON) here."),
    plot: Optional[str] = typer.Option(None, help="Write the reliability plot (PNG) here."),
) -> None:
    """Train the SpecDec++ acceptance-prediction head for a draft/target pair, on CPU."""
    try:
        cfg = TrainConfig(num_prompts=num_prompts, max_new_tokens=max_new_tokens, gen_batch=gen_batch,
                          temperature=temperature, mix_ratio=mix_ratio, reject_weight=reject_weight,
                          num_layers=num_layers, epochs=epochs, seed=seed)
        run_training(cfg, target=target, draft=draft, out=out, report_path=report, plot_path=plot, threads=threads,
                     log=lambda m: typer.echo(m, err=True))
    except QuickdraftError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=2)
