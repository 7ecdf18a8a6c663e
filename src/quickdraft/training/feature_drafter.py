"""Train an EAGLE-style feature drafter (:mod:`quickdraft.decoding.feature_model`) on the target's
own features, within the budget of a 2-core CPU.

Data
----
Chat texts with no generation: each task of :func:`quickdraft.adaptive.trainprompts.task_answer_pairs`
(the Python standard library's docstrings turned into "implement" and "explain" tasks, none of
them HumanEval or MT-Bench) as the user turn and the standard library's own answer (the function's
or class's source, or its whole docstring) as the assistant turn, in the target's chat template, at
most ``max_tokens`` tokens each. The target reads every text once (``extract_features``) and its
final hidden states are cached on disk (bfloat16), so training epochs never run the target.

Objective (EAGLE's)
-------------------
For pair ``i`` (feature ``f_i`` plus uniform noise of width ``noise``, embedding of ``x_{i+1}``) the
layer outputs ``g_{i+1}``; the loss is the smooth-L1 distance to the true ``f_{i+1}`` plus
``ce_weight`` times the cross-entropy between the target's next-token distribution (its head on
``f_{i+1}``) and the drafter's (the head on ``g_{i+1}``), both over the ``ce_vocab`` lowest ids (the
head is the target's and is not trained; the cut keeps each step affordable). The layer starts as
a copy of the target's last decoder layer, ``fc`` as the projection that passes the feature through.

Held out: ``holdout`` of the texts; the report gives the drafter's one-step agreement with the
target's argmax there (teacher-forced: every pair with the true feature), per epoch.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import typer

from quickdraft.decoding.feature_model import (
    FEATURE_DRAFTER_DIR, FeatureDraftModel, FeatureDrafterMeta, default_drafter_dir)
from quickdraft.errors import QuickdraftError


@dataclass
class FeatureTrainConfig:
    """Data and optimisation of :func:`train_feature_drafter` (see the module docstring)."""

    texts: int = 240
    max_tokens: int = 384
    epochs: int = 2
    lr: float = 5e-4
    ce_weight: float = 0.1
    ce_vocab: int = 32768
    noise: float = 0.1
    holdout: float = 0.1
    intermediate_size: int = 0  # 0: the target's (the layer starts as the target's last layer)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.texts < 2:
            raise QuickdraftError(f"texts must be at least 2 (one to train on, one held out), got {self.texts}")
        if self.max_tokens < 8:
            raise QuickdraftError(f"max_tokens must be at least 8, got {self.max_tokens}")
        if self.epochs < 1 or self.lr <= 0 or self.ce_weight < 0 or self.noise < 0:
            raise QuickdraftError("epochs must be >= 1, lr > 0, ce_weight >= 0 and noise >= 0")
        if not 0 < self.holdout < 1:
            raise QuickdraftError(f"holdout must lie in (0, 1), got {self.holdout}")


def corpus_ids(tokenizer, cfg: FeatureTrainConfig) -> list[list[int]]:
    """Token ids of the training texts: ``cfg.texts`` task/answer pairs (a seeded sample, answers
    with code or prose only), each in the chat template and cut to ``cfg.max_tokens``."""
    from quickdraft.adaptive.trainprompts import task_answer_pairs

    pairs = [(t, a) for t, a in task_answer_pairs() if a.strip() and a.strip() != "```python\n```"]
    rng = random.Random(cfg.seed)
    rng.shuffle(pairs)
    out = []
    for task, answer in pairs[: cfg.texts]:
        messages = [{"role": "user", "content": task}, {"role": "assistant", "content": answer}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append(list(ids)[: cfg.max_tokens])
    return out


def feature_file(cache: Path, fingerprint: str, ids: list[int]) -> Path:
    """The cache file of one text's features for the target with ``fingerprint``."""
    key = hashlib.sha256(json.dumps([fingerprint, ids]).encode()).hexdigest()[:20]
    return Path(cache) / f"features-{key}.pt"


@torch.inference_mode()
def extract_features(target, texts: list[list[int]], cache: Path | None = None, progress: bool = True) -> list[torch.Tensor]:
    """The target's final hidden states ``[n, H]`` (bfloat16) of every text; each text's are read
    from ``cache`` when they are there, and written there otherwise."""
    from quickdraft.models import model_fingerprint

    fingerprint = model_fingerprint(target)
    feats = []
    t0 = time.perf_counter()
    for i, ids in enumerate(texts):
        file = None if cache is None else feature_file(cache, fingerprint, ids)
        if file is not None and file.is_file():
            feats.append(torch.load(file))
            continue
        out = target.model(input_ids=torch.tensor([ids], device=target.device))
        feats.append(out.last_hidden_state[0].to(torch.bfloat16).cpu())
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            torch.save(feats[-1], file)
        if progress and (i + 1) % 20 == 0:
            print(f"  features: {i + 1}/{len(texts)} texts, {time.perf_counter() - t0:.0f} s", flush=True)
    return feats


def init_from_target(model: FeatureDraftModel, target) -> None:
    """Start the layer as a copy of the target's last decoder layer (when the widths match) and
    ``fc`` as the projection that passes the feature through."""
    from quickdraft.backends.packed import dense_state_dict

    last = dense_state_dict(target.model.layers[-1])  # a float32 target on CPUs without bf16 has packed layers
    mine = model.layers.layers[0]
    own = mine.state_dict()
    if own.keys() == last.keys() and all(own[k].shape == last[k].shape for k in own):
        mine.load_state_dict({k: v.float() for k, v in last.items()})
    model.layers.norm.load_state_dict({k: v.float() for k, v in target.model.norm.state_dict().items()})
    hidden = model.fc.out_features
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, hidden:] = torch.eye(hidden)
        model.fc.weight[:, :hidden].normal_(0.0, 0.02)
        model.fc.bias.zero_()


def _losses(model: FeatureDraftModel, ids: torch.Tensor, feats: torch.Tensor, head: torch.Tensor,
            cfg: FeatureTrainConfig, train: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(regression loss, cross-entropy, agreement) of one text: pairs ``0 .. n-2``."""
    f_in = feats[:-1].float()
    if train and cfg.noise:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * cfg.noise
    g, _ = model.step(ids[1:].unsqueeze(0), f_in.unsqueeze(0), use_cache=False)
    g = g[0].float()
    f_next = feats[1:].float()
    reg = torch.nn.functional.smooth_l1_loss(g, f_next)
    with torch.no_grad():
        target_logits = f_next @ head.T
        p = target_logits.softmax(dim=-1)
    logq = (g @ head.T).log_softmax(dim=-1)
    ce = -(p * logq).sum(dim=-1).mean()
    agree = (logq.argmax(dim=-1) == target_logits.argmax(dim=-1)).float().mean()
    return reg, ce, agree


def train_feature_drafter(target, texts: list[list[int]], cfg: FeatureTrainConfig, cache: Path | None = None,
                          progress: bool = True, data: str = "") -> tuple[FeatureDraftModel, dict]:
    """Train a feature drafter for the torch model ``target`` on the token-id lists ``texts``
    (:func:`corpus_ids`; ``data`` says what they are, for the report); returns it (float32, eval
    mode) and its report."""
    if len(texts) < 2 or min(len(t) for t in texts) < 3:
        raise QuickdraftError("a feature drafter needs at least 2 texts of at least 3 tokens")
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    feats = extract_features(target, texts, cache, progress)
    extract_s = time.perf_counter() - t0
    n_hold = max(1, int(round(len(texts) * cfg.holdout)))
    order = list(range(len(texts)))
    random.Random(cfg.seed + 1).shuffle(order)
    held, trained = order[:n_hold], order[n_hold:]

    model = FeatureDraftModel(target, intermediate_size=cfg.intermediate_size or None).float()
    init_from_target(model, target)
    head = target.get_output_embeddings().weight.detach()[: cfg.ce_vocab].float()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps = cfg.epochs * len(trained)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    tokens = [torch.tensor(t) for t in texts]

    def evaluate() -> dict:
        model.eval()
        tot = {"reg": 0.0, "ce": 0.0, "agree": 0.0, "pairs": 0}
        with torch.no_grad():
            for i in held:
                n = len(texts[i]) - 1
                reg, ce, agree = _losses(model, tokens[i], feats[i], head, cfg, train=False)
                tot["reg"] += float(reg) * n
                tot["ce"] += float(ce) * n
                tot["agree"] += float(agree) * n
                tot["pairs"] += n
        model.train()
        return {k: (v / tot["pairs"] if k != "pairs" else v) for k, v in tot.items()}

    history = [{"epoch": 0, **evaluate()}]
    if progress:
        print(f"  before training: held-out agreement {history[0]['agree']:.3f}", flush=True)
    model.train()
    rng = random.Random(cfg.seed + 2)
    t1 = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        rng.shuffle(trained)
        run = {"reg": 0.0, "ce": 0.0, "n": 0}
        for j, i in enumerate(trained):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                reg, ce, _ = _losses(model, tokens[i], feats[i], head, cfg, train=True)
            loss = reg + cfg.ce_weight * ce
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            run["reg"] += float(reg.detach())
            run["ce"] += float(ce.detach())
            run["n"] += 1
            if progress and (j + 1) % 50 == 0:
                print(f"  epoch {epoch}: {j + 1}/{len(trained)} texts, reg {run['reg'] / run['n']:.4f}, "
                      f"ce {run['ce'] / run['n']:.3f}, {time.perf_counter() - t1:.0f} s", flush=True)
        history.append({"epoch": epoch, "train_reg": run["reg"] / run["n"], "train_ce": run["ce"] / run["n"],
                        **evaluate()})
        if progress:
            print(f"  epoch {epoch}: held-out agreement {history[-1]['agree']:.3f}", flush=True)
    model.eval()
    report = {
        "config": asdict(cfg),
        "data": data,
        "texts": len(texts), "train_texts": len(trained), "heldout_texts": len(held),
        "tokens": sum(len(t) for t in texts),
        "train_tokens": sum(len(texts[i]) for i in trained),
        "feature_seconds": round(extract_s, 1),
        "train_seconds": round(time.perf_counter() - t1, 1),
        "history": history,
    }
    return model, report


def save_trained(model: FeatureDraftModel, target, report: dict, out: Path) -> Path:
    from quickdraft.models import model_fingerprint

    meta = FeatureDrafterMeta(
        target_fingerprint=model_fingerprint(target), hidden_size=int(target.config.hidden_size),
        intermediate_size=int(model.config.intermediate_size), head_vocab=0, training=report)
    return model.save(out, meta)


def train_drafter_command(
    target: str = typer.Option("target", help="Target model (registry name, alias or directory), loaded on torch."),
    dtype: str = typer.Option("bfloat16", help="The target's dtype while its features are read (as it will run)."),
    out: Optional[Path] = typer.Option(None, help="Directory to save the drafter (default: the target's cache entry, "
                                                  f"{FEATURE_DRAFTER_DIR}/)."),
    texts: int = typer.Option(240, help="Task/answer chat texts to train on (10% held out)."),
    max_tokens: int = typer.Option(384, help="Tokens per text at most."),
    epochs: int = typer.Option(2, help="Passes over the training texts."),
    lr: float = typer.Option(5e-4, help="Peak learning rate (AdamW, cosine decay)."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: all cores)."),
    report: Optional[Path] = typer.Option(None, help="Also write the training report (JSON) here."),
) -> None:
    """Train an EAGLE-style feature drafter for TARGET on its own hidden states (one decoder layer;
    the target's embedding and head are shared). Features are read once and cached."""
    from quickdraft.models import default_cache_dir, load_model
    from quickdraft.pipeline import set_threads

    try:
        set_threads(threads)
        cfg = FeatureTrainConfig(texts=texts, max_tokens=max_tokens, epochs=epochs, lr=lr)
        model_, tokenizer = load_model(target, dtype=dtype)
        texts = corpus_ids(tokenizer, cfg)
        model, rep = train_feature_drafter(
            model_, texts, cfg, cache=default_cache_dir() / "feature-drafter-data",
            data="standard-library task/answer chat texts (quickdraft.adaptive.trainprompts.task_answer_pairs)")
        dest = save_trained(model, model_, rep, out or default_drafter_dir(target))
    except QuickdraftError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(rep, indent=2) + "\n")
    last = rep["history"][-1]
    typer.echo(f"saved {dest}: held-out one-step agreement with the target {last['agree']:.3f} "
               f"({rep['train_tokens']} training tokens, {rep['train_seconds']:.0f} s)")
