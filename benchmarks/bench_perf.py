"""Performance of the default pair on every backend, side by side in ONE process, interleaved.

Rows (``--configs``; each ``<backend>-<weights>-<method>``):

* ``llamacpp-anchor``  llama.cpp's own plain decoding of the target GGUF (:func:`anchors.llamacpp_generate`)
* ``llamacpp-ar`` / ``llamacpp-sd``  our engine on :class:`LlamaCppRunner` (target + draft GGUFs)
* ``torch-fp32-ar`` / ``torch-fp32-sd``  our engine on the float32 torch models, linear layers on oneDNN
  with packed weights (:mod:`quickdraft.backends.packed`, the default on this CPU); ``torch-fp32mkl-*``: the
  same weights on ``nn.Linear`` (MKL), i.e. before packing; ``torch-bf16-*``: bfloat16
* ``torch-int8-ar`` / ``-sd``, ``torch-int4-ar`` / ``-sd``  the same with :mod:`quickdraft.backends.quant` weights
  (activations, norms and embeddings in ``--base-dtype``)
* ``torch-fp32/int4-sd``  target float32 (untouched), draft int4 (``--quantize-draft int4``)
* ``openvino-int8-ar`` / ``-sd`` / ``-ngram_sd`` …  our engine on :class:`OpenVINORunner` (OpenVINO exports of
  target and draft, NNCF int8 weights; ``openvino-int4-*``: int4; ``openvino-int8/int4-*``: int8 target,
  int4 draft; ``openvino-int8/int4v49152-*``: the int4 draft with a draft vocabulary of 49,152 ids,
  ``--draft-vocab``)
* ``ovgenai-int8-anchor``  OpenVINO GenAI's own plain decoding of the same int8 target weights;
  ``ovgenai-int8-sd`` / ``-sdN``: its own speculative decoding with the int8 draft, ``num_assistant_tokens``
  = K (:func:`anchors.openvino_genai_generate`); weights ending in ``:tuned`` (``ovgenai-int8:tuned-sd``):
  GenAI compiled with the plugin settings our runner uses (:func:`quickdraft.backends.openvino.runner.tuned_config`)
* a method ``sdN`` (e.g. ``torch-fp32/int4-sd8``) drafts ``N`` tokens instead of ``--k``; ``sdc`` / ``sdcN``
  (and ``ngram_sdc``…): at most that many, under the :class:`Confidence` policy (``--p-min``); ``ngram`` /
  ``ngramN``: prompt lookup (no draft model), n-grams of ``--ngram-min`` to 3 tokens; ``ngram_sd`` /
  ``ngram_sdN``: prompt lookup (2-4-grams, ``--lookup-k`` tokens) where it matches, else the draft model;
  ``phrase_sd`` / ``phrase_sdN``: the draft model's drafts extended from a phrase pool (Ouroboros);
  ``amusd`` / ``amusdN``: the draft model drafts the next block while the target verifies
  (:mod:`quickdraft.decoding.amusd`); its rows give ``x_<sd config>`` for every sd config of the same weights
* a config ending in ``:cost`` (``llamacpp-ngram8:cost``): the :class:`CostAware` policy, at most N (or
  ``--k``) tokens, the length (0: a plain step) that pays most under the backend's measured forward costs
* openvino weights ending in ``:split`` (e.g. ``openvino-int8/int4v49152:split-amusd``): models of their own,
  compiled with one share of the cores each (:func:`quickdraft.decoding.amusd.split_threads`) instead of all of
  them; every row records each model's inference seconds and calls (``target_infer_seconds`` …)

``x_own_ar`` divides by the plain decoding of the same *target* weights (``torch-fp32/int4-sd`` is
compared with ``torch-fp32-ar``). ``engine_share`` is the part of a config's time spent outside its
runtime's inference calls: for our engine everything but the models' ``infer``; for GenAI's
speculative decoding everything but the two models' inference durations it reports itself
(``extended_perf_metrics``), its steps counted as its drafted tokens / K. ``draft_acceptance_rate``:
accepted / drafted tokens (GenAI's from its own counts).

Prompts are the first ``--limit`` problems of each of ``--datasets`` (HumanEval, MT-Bench's first turns) as chat; every prompt runs every config (the
order rotates from prompt to prompt, so machine drift hits all alike) after a short warm-up. Times
are end to end per prompt (prefill included). Also measured, unless skipped: memory bandwidth (a
large array copy), the cost of a target forward over m = 1, 2, 5, 9, 16 new tokens (5 and 9 verify K = 4 and 8;
``--forward-blocks``, ``--forward-repeats``; ``--forward-costs-only`` stops after them) per backend
(interleaved), and the process's peak RSS against the bytes of weights held.

    python benchmarks/bench_perf.py --limit 3 --max-new-tokens 128 --temperatures 0 0.7 \\
        --out benchmarks/results/perf_full.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from quickdraft.evaluation.datasets import load_dataset
from quickdraft.evaluation.rates import rate_ratio
from quickdraft.models import resolve_dtype
from quickdraft.decoding.policies import Constant
from quickdraft.verification.sampling import SamplingParams

DEFAULT_CONFIGS = (
    "llamacpp-anchor", "llamacpp-ar", "llamacpp-sd2", "llamacpp-sd", "torch-fp32-ar", "torch-fp32-sd", "torch-fp32-sd6",
)
#: weight label -> (dtype the model is loaded in, quantisation applied after loading, oneDNN packing);
#: dtype None: --base-dtype; packing None: the default of :func:`quickdraft.backends.packed.maybe_pack`
WEIGHTS = {
    "fp32": ("float32", "none", None), "fp32mkl": ("float32", "none", False), "bf16": ("bfloat16", "none", None),
    "int8": (None, "int8", None), "int4": (None, "int4", None),
}


def openvino_weights(label: str) -> tuple[str, int | None]:
    """``"int4v49152"`` -> (NNCF weight format ``"int4"``, draft vocabulary 49152); ``"int8"`` -> (``"int8"``, None)."""
    m = re.fullmatch(r"(int8|int4all|int4|none)(?:v(\d+))?", label)
    if m is None:
        raise SystemExit(f"unknown OpenVINO weights {label!r}: int8, int4, int4all or none, optionally with vN "
                         "(a draft vocabulary)")
    return m.group(1), int(m.group(2)) if m.group(2) else None


def parse_config(config: str) -> tuple[str, str, int | None]:
    """``"torch-fp32/int4-sd8"`` -> (pipeline key ``"torch-fp32/int4"``, method ``"sd"``, K 8); a
    trailing ``:cost`` (``"llamacpp-ngram8:cost"``) names the policy (:data:`COST`), not the method."""
    key, method = config.removesuffix(COST).rsplit("-", 1)
    m = re.fullmatch(r"(ar|sd|ngram_sd|ngram|phrase_sd|amusd)(c?)(\d*)|anchor", method)
    if m is None or (m.group(1) == "amusd" and m.group(2)):
        raise SystemExit(f"unknown method in config {config!r}: ar, sd, sdN, sdcN, ngram, ngramN, ngram_sd, ngram_sdN, "
                         "ngram_sdcN, phrase_sd, phrase_sdN, amusd, amusdN or anchor")
    if method == "anchor":
        return key, "anchor", None
    return key, m.group(1) + m.group(2), int(m.group(3)) if m.group(3) else None


#: suffix of a config whose chain drafts the length the CostAware policy picks (``llamacpp-sd8:cost``)
COST = ":cost"
#: suffix of openvino weights whose models split the cores between them (amusd runs both at once)
SPLIT = ":split"
#: suffix of ovgenai weights whose pipelines compile with our runner's plugin settings
#: (:func:`quickdraft.backends.openvino.runner.tuned_config`) instead of the plugin's defaults
TUNED = ":tuned"


def policy_of(method: str, k: int, p_min: float, cost: bool = False):
    """The draft-length policy of a parsed method: a trailing ``c`` is :class:`Confidence` (at most
    ``k`` tokens, stop below ``p_min``), a config ending in ``:cost`` :class:`CostAware` (at most
    ``k``; the pipeline measures its forward costs in the warm-up, or reads them from the cost cache
    of earlier runs, :class:`quickdraft.backends.costs.CostCache`; ``step_costs`` in the results),
    otherwise :class:`Constant` ``k``."""
    from quickdraft.decoding.policies import Confidence, CostAware

    if cost:
        return CostAware(max_k=k)
    return Confidence(max_k=k, p_min=p_min) if method.endswith("c") else Constant(k)


def own_ar(config: str) -> str:
    """The plain-decoding config with the same target weights as ``config``."""
    key, _, _ = parse_config(config)
    if key.startswith("ovgenai-"):
        return key + "-anchor"
    return key.split("/")[0] + "-ar"


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> dict:
    """Best-of-``repeats`` copy bandwidth: a copy reads and writes every byte, so 2·size / time."""
    src = np.ones(megabytes * (1 << 20) // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    read = src.nbytes / best
    # a pure read: the reduction touches every byte once
    t_best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        float(src.sum())
        t_best = min(t_best, time.perf_counter() - t)
    return {"copy_GBps": 2 * read / 1e9, "read_GBps": src.nbytes / t_best / 1e9, "megabytes": megabytes}


def weight_bytes(model) -> dict:
    """Bytes held by parameters and buffers, and the bytes one forward reads (the input embedding
    is a row lookup, so it is excluded from the read bytes)."""
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    emb = model.get_input_embeddings().weight
    emb_bytes = emb.numel() * emb.element_size()
    return {"held": held, "read_per_forward": held - emb_bytes}


def load_pipelines(configs: list[str], base_dtype: str) -> dict:
    """One pipeline per weight configuration; each model is loaded (and quantised) once and shared,
    e.g. ``torch-fp32`` and ``torch-fp32/int4`` hold the same target object."""
    import gc

    from quickdraft.models import check_compatible, load_model
    from quickdraft.backends.packed import maybe_pack
    from quickdraft.pipeline import Pipeline
    from quickdraft.backends.quant import quantize_by_name

    models: dict[tuple[str, str], object] = {}
    tokenizer = None

    def model(role: str, weights: str):
        nonlocal tokenizer
        if (role, weights) not in models:
            if weights not in WEIGHTS:
                raise SystemExit(f"unknown weights {weights!r} (one of {', '.join(WEIGHTS)})")
            dtype, quant, pack = WEIGHTS[weights]
            m, tok = load_model(role, dtype=dtype or base_dtype)
            tokenizer = tokenizer or tok
            quantize_by_name(m, quant)
            maybe_pack(m, pack)
            models[role, weights] = m
            gc.collect()
        return models[role, weights]

    pipes = {}
    runners: dict[tuple[str, str, int], object] = {}  # (role, weights, threads) -> OpenVINORunner, shared across keys

    def ov_runner(role: str, weights: str, threads: int):
        from quickdraft.backends.openvino import load_openvino

        if (role, weights, threads) not in runners:
            weight_format, draft_vocab = openvino_weights(weights)
            runners[role, weights, threads] = load_openvino(role, role, weight_format=weight_format,
                                                            draft_vocab=draft_vocab, n_threads=threads,
                                                            drafting=role == "draft")
        return runners[role, weights, threads]

    from quickdraft.decoding.amusd import split_threads
    from quickdraft.backends.threads import yield_torch_threads

    for key in sorted({parse_config(c)[0] for c in configs if c.startswith("openvino-")}):
        weights = key.split("-", 1)[1].removesuffix(SPLIT)
        cores = yield_torch_threads()
        target_t, draft_t = split_threads(cores) if key.endswith(SPLIT) else (cores, cores)
        target_w, _, draft_w = weights.partition("/")
        target, tok = ov_runner("target", target_w, target_t)
        draft, _ = ov_runner("draft", draft_w or target_w, draft_t)
        pipes[key] = Pipeline(target.model, tok, draft.model, target_runner=target, draft_runner=draft)
    for weights in sorted({c.split("-")[1] for c in configs if c.startswith("ovgenai-")}):
        plain = f"ovgenai-{weights}-anchor" in configs
        speculative = any(c.startswith(f"ovgenai-{weights}-sd") for c in configs)
        pipes[f"ovgenai-{weights}"] = genai_pipelines(weights.removesuffix(TUNED), plain, speculative,
                                                      tuned=weights.endswith(TUNED))
    for weights in sorted({c.split("-")[1] for c in configs if c.startswith("torch-")}):
        target_w, _, draft_w = weights.partition("/")
        target, draft = model("target", target_w), model("draft", draft_w or target_w)
        check_compatible(tokenizer, tokenizer, target, draft)
        pipes[f"torch-{weights}"] = Pipeline(target, tokenizer, draft)
    if any(c.startswith("llamacpp") for c in configs):
        pipes["llamacpp"] = Pipeline.from_specs("target", "draft", backend="llamacpp")
    return pipes


class GenAIPipelines:
    """OpenVINO GenAI's ``LLMPipeline`` over GenAI-layout exports of the target (plain decoding) and
    of target + draft (its speculative decoding); ``target`` / ``draft`` are the export directories."""

    def __init__(self, target, draft, plain, speculative, tuned: bool = False) -> None:
        self.target, self.draft, self.plain, self.speculative = target, draft, plain, speculative
        self.tuned = tuned

    def renew_speculative(self) -> None:
        """A fresh speculative pipeline: after a call that raised, GenAI's pipeline goes on decoding
        without drafting a token (its later calls report no draft tokens and run at its plain speed)."""
        from quickdraft.evaluation.anchors import openvino_genai_pipeline
        from quickdraft.backends.threads import runtime_threads

        self.speculative = None
        self.speculative = openvino_genai_pipeline(self.target, self.draft, n_threads=runtime_threads(), tuned=self.tuned)


def genai_pipelines(weights: str, plain: bool, speculative: bool, tuned: bool = False) -> GenAIPipelines:
    """GenAI-layout exports (made once into the cache entries, from the same float32 weights and the
    same NNCF compression as the engine-layout exports) and GenAI pipelines over them."""
    from quickdraft.evaluation.anchors import openvino_genai_pipeline
    from quickdraft.backends.openvino import export_for
    from quickdraft.backends.threads import runtime_threads

    dirs = [export_for(role, weights, layout="genai") for role in ("target", "draft")]

    plain = openvino_genai_pipeline(dirs[0], n_threads=runtime_threads(), tuned=tuned) if plain else None
    spec = openvino_genai_pipeline(dirs[0], dirs[1], n_threads=runtime_threads(), tuned=tuned) if speculative else None
    return GenAIPipelines(dirs[0], dirs[1], plain, spec, tuned=tuned)


def _export_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.bin"))


def forward_costs(pipes: dict, prompt_ids: list[int], ms=(1, 2, 5, 9, 16), repeats: int = 3) -> dict:
    """Median seconds of one target forward over ``m`` new tokens after the prompt, per backend,
    interleaved across backends (and the same for the draft with m = 1)."""
    times: dict[str, list[float]] = {}
    for rep in range(repeats):
        for key, pipe in pipes.items():
            if isinstance(pipe, GenAIPipelines):
                continue
            for role, runner in (("target", pipe.target), ("draft", pipe.draft)):
                runner.reset(1)
                runner.forward(torch.tensor([prompt_ids]), logits_to_keep=1)
                base = runner.lengths.clone()
                for m in ms if role == "target" else (1,):
                    block = torch.tensor([prompt_ids[-m:]])
                    t = time.perf_counter()
                    runner.forward(block, logits_to_keep=m)
                    times.setdefault(f"{key}/{role}/m={m}", []).append(time.perf_counter() - t)
                    runner.truncate(base)
    return {k: float(np.median(v)) for k, v in times.items()}


def _utc_now() -> str:
    """The wall-clock time in UTC, to the second (when a run started and finished)."""
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "command": "python benchmarks/bench_perf.py " + " ".join(args.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), **_lscpu(), "threads": args.threads,
                    "torch": torch.__version__, "loadavg_start": list(_loadavg()), "started": _utc_now()},
        "note": "shared machine: compare ratios within this file, not absolute figures across files",
    }
    if not args.skip_bandwidth:
        result["bandwidth"] = memory_bandwidth()
    t0 = time.perf_counter()
    pipes = load_pipelines(args.configs, args.base_dtype)
    result["machine"]["base_dtype"] = str(resolve_dtype(args.base_dtype)).removeprefix("torch.")
    result["load_seconds"] = time.perf_counter() - t0
    result["weights"] = {
        key: {"target": weight_bytes(p.target_model), "draft": weight_bytes(p.draft_model)}
        for key, p in pipes.items() if key.startswith("torch")
    }
    for key, p in pipes.items():
        if key.startswith("openvino"):
            result["weights"][key] = {role: {"held": _export_bytes(r.path), "read_per_forward": _export_bytes(r.path),
                                             "path": str(r.path)}
                                      for role, r in (("target", p.target), ("draft", p.draft))}
        elif key.startswith("ovgenai"):
            result["weights"][key] = {role: {"held": _export_bytes(d), "read_per_forward": _export_bytes(d),
                                             "path": str(d)}
                                      for role, d in (("target", p.target), ("draft", p.draft))}
    if "llamacpp" in pipes:
        p = pipes["llamacpp"]
        result["weights"]["llamacpp"] = {
            role: {"held": r.gguf.path.stat().st_size, "read_per_forward": r.gguf.path.stat().st_size}
            for role, r in (("target", p.target), ("draft", p.draft))
        }
    any_pipe = next(p for p in pipes.values() if not isinstance(p, GenAIPipelines))
    problems = []
    for name in args.datasets:  # the first --limit prompts of each dataset, in file order
        problems += load_dataset(name, args.limit)
    prompt_ids = [any_pipe.encode_messages(p.messages) for p in problems]
    eos = any_pipe.eos_ids()
    anchor_model = None
    if "llamacpp-anchor" in args.configs:
        from quickdraft.backends.llamacpp import LlamaGGUF, gguf_path_for

        anchor_model = LlamaGGUF(gguf_path_for("target"), n_ctx=4096, n_threads=args.threads)
    if not args.skip_forward_costs:
        blocks = tuple(args.forward_blocks)
        if max(blocks) > len(prompt_ids[0]):
            raise SystemExit(f"--forward-blocks up to {max(blocks)} tokens need a first prompt that long "
                             f"(it has {len(prompt_ids[0])} tokens)")
        result["forward_seconds"] = forward_costs(pipes, prompt_ids[0], blocks, args.forward_repeats)
        result["forward_repeats"] = args.forward_repeats
    if args.forward_costs_only:
        result["summary"] = {}
        return result

    def one(config: str, ids: list[int], sampling: SamplingParams, seed: int, max_new: int) -> dict:
        if config == "llamacpp-anchor":
            from quickdraft.evaluation.anchors import llamacpp_generate

            res = llamacpp_generate(None, ids, sampling=sampling, max_new_tokens=max_new, eos_token_ids=eos,
                                    seed=seed, model=anchor_model)
            return {"new_tokens": len(res.new_ids), "seconds": res.seconds, "new_ids": res.new_ids}
        key, method, k = parse_config(config)
        pipe = pipes[key]
        if isinstance(pipe, GenAIPipelines):
            from quickdraft.evaluation.anchors import openvino_genai_generate

            if method == "anchor":
                res = openvino_genai_generate(pipe.plain, ids, sampling=sampling, max_new_tokens=max_new,
                                              eos_token_ids=eos, seed=seed)
            else:
                try:
                    res = openvino_genai_generate(pipe.speculative, ids, sampling=sampling, max_new_tokens=max_new,
                                                  eos_token_ids=eos, seed=seed, num_assistant_tokens=k or args.k)
                except RuntimeError as err:  # recorded, and left out of this config's rate
                    pipe.renew_speculative()
                    return {"error": str(err).strip().splitlines()[-1][:300], "new_tokens": 0, "seconds": 0.0,
                            "new_ids": []}
                if res.drafted_nothing:
                    pipe.renew_speculative()  # not speculative decoding: recorded, left out of the rate
                    return {"error": "GenAI's speculative decoding drafted no token (it decoded plainly)",
                            **res.speculative, "new_tokens": 0, "seconds": 0.0, "new_ids": []}
            extra = {}
            if res.speculative:  # its own counts, and the time outside its two models' inference
                spec = res.speculative
                infer = spec["target_infer_seconds"] + spec["draft_infer_seconds"]
                extra = {**spec, "runtime_seconds": infer, "engine_seconds": res.seconds - infer,
                         "engine_share": (res.seconds - infer) / res.seconds,
                         "steps": max(1, round(spec["drafted_tokens"] / (k or args.k)))}
            return {**extra, "new_tokens": len(res.new_ids), "seconds": res.seconds, "new_ids": res.new_ids}
        runners = [r for r in (pipe.target, pipe.draft) if hasattr(r, "infer_seconds")]
        infer_before = sum(r.infer_seconds for r in runners)
        calls = {r.name: [] for r in runners}  # each model's inference calls, in ms, prefill first
        for r in runners:
            r._infer = _timed(r._infer, calls[r.name])
        policy = policy_of(method, k or args.k, args.p_min, cost=config.endswith(COST))
        method = method.removesuffix("c")
        try:
            out = pipe.generate([""], prompt_ids=[ids], method=method, policy=policy, sampling=sampling,
                                max_new_tokens=max_new, seed=seed,
                                ngram=(args.ngram_min, 3) if method == "ngram" else None, lookup_k=args.lookup_k)
        finally:
            for r in runners:
                del r._infer  # the class's method again
        m = out.metrics
        extra = {}
        if runners and method != "amusd":  # the engine's share: everything but the runtime's inference calls
            infer = sum(r.infer_seconds for r in runners) - infer_before  # (amusd's two models infer at once)
            total = m.prefill_seconds + m.decode_seconds
            extra = {"runtime_seconds": infer, "engine_seconds": total - infer,
                     "engine_share": (total - infer) / total, "steps": max(1, m.target_forwards - 1)}
        if runners:
            for name, ms in calls.items():  # each model's inference calls: the first is its prefill
                extra[f"{name}_infer_ms"] = [round(x, 2) for x in ms]
        return {**extra,
            "new_tokens": m.new_tokens, "prefill_tokens": m.prefill_tokens, "seconds": m.prefill_seconds + m.decode_seconds,
            "decode_seconds": m.decode_seconds, "mean_acceptance_length": m.mean_acceptance_length,
            "target_forwards": m.target_forwards, "draft_forwards": m.draft_forwards,
            "steps_verified": m.steps, "drafted_tokens": m.drafted_tokens, "accepted_tokens": m.accepted_tokens,
            "emitted_tokens": m.emitted_tokens, "new_ids": out.completions[0].token_ids,
        }

    for config in args.configs:  # warm-up
        one(config, prompt_ids[0], SamplingParams(), 0, 4)
    for config in args.configs:  # the forward costs the cost policy decides by (measured or cached)
        if config.endswith(COST):
            key, _, k = parse_config(config)
            costs = pipes[key].step_costs(k or args.k)  # the warm-up's, kept by the pipeline
            result.setdefault("step_costs", {})[config] = {"target_ms": [round(1e3 * t, 2) for t in costs.target],
                                                           "draft_ms": round(1e3 * costs.draft, 2)}
    result["memory_after_load"] = _memory_status()
    _reset_peak_rss()  # VmHWM from here on: the generation's peak, loading (and quantising) excluded
    rows = []
    for temperature in args.temperatures:
        sampling = SamplingParams(temperature=temperature)
        for i, ids in enumerate(prompt_ids):
            order = args.configs[i % len(args.configs):] + args.configs[: i % len(args.configs)]
            for config in order:
                r = one(config, ids, sampling, seed=i, max_new=args.max_new_tokens)
                r.update(config=config, temperature=temperature, prompt=problems[i].id,
                         dataset="mtbench" if problems[i].id.startswith("mtbench/") else "humaneval")
                rows.append(r)
                if args.out:  # a partial file after every row: a cut-off run still leaves its data
                    Path(args.out).with_suffix(".partial.json").write_text(json.dumps({**result, "rows": rows}))
                rate = f"{r['new_tokens'] / r['seconds']:6.2f} tok/s" if "error" not in r else f"error: {r['error']}"
                print(f"T={temperature} {problems[i].id} {config:16s} {rate}", flush=True)
    result["summary"] = summarize(rows, args.configs, args.temperatures)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["memory_status"] = _memory_status()  # RssFile: mmapped weight files (page cache, shared)
    unique = {id(m): m for key, p in pipes.items() if key.startswith("torch") for m in (p.target_model, p.draft_model)}
    files = {w.get("path", f"{key}/{role}"): w["held"]  # a file shared by several keys counts once
             for key, ws in result["weights"].items() if not key.startswith("torch") for role, w in ws.items()}
    held = sum(weight_bytes(m)["held"] for m in unique.values()) + sum(files.values())
    result["weights_held_bytes"] = held
    if result["memory_status"].get("VmHWM"):  # one config per process makes this the target ratio
        result["peak_rss_over_weights"] = result["memory_status"]["VmHWM"] / held
    result["loadavg_end"] = list(_loadavg())
    result["machine"]["finished"] = _utc_now()
    result.update(max_new_tokens=args.max_new_tokens, k=args.k, prompts=[p.id for p in problems], rows=rows)
    return result


def summarize(rows: list[dict], configs: list[str], temperatures: list[float]) -> dict:
    """Per config, temperature and dataset (and over all datasets): tokens/s over the prompts that
    *every* config completed at that temperature (a run stopped midway compares like with like),
    ratios and acceptance. Keys ``<config>@T=<t>`` (all prompts) and ``<config>@<dataset>@T=<t>``.
    Each ratio to an anchor (``x_llamacpp_anchor``, ``x_<GenAI sd config>``) comes with
    ``ci95_x_…``: its 95% paired bootstrap interval over the prompts (:func:`quickdraft.evaluation.rates.rate_ratio`;
    ``NaN`` with fewer than 10 prompts, :data:`quickdraft.evaluation.rates.MIN_PROMPTS`). The point
    ratio ``x_…`` divides each config's rate over its own prompts; where one of the two failed on
    some prompts, the interval covers only the prompts both completed, and ``paired_x_…`` (the ratio
    over those prompts, the interval's own point) and ``paired_prompts_x_…`` (how many) say so."""
    summary = {}
    datasets = list(dict.fromkeys(r.get("dataset", "humaneval") for r in rows))
    groups = [(None, t) for t in temperatures]
    if len(datasets) > 1:
        groups += [(d, t) for d in datasets for t in temperatures]
    for dataset, temperature in groups:
        at_t = [r for r in rows if r["temperature"] == temperature
                and (dataset is None or r.get("dataset", "humaneval") == dataset)]
        complete = [p for p in dict.fromkeys(r["prompt"] for r in at_t)
                    if all(any(r["config"] == c and r["prompt"] == p for r in at_t) for c in configs)]
        if not complete:
            continue
        rows_t = [r for r in at_t if r["prompt"] in complete]

        def tps(config: str) -> float:
            sel = [r for r in rows_t if r["config"] == config and "error" not in r]
            seconds = sum(r["seconds"] for r in sel)
            return sum(r["new_tokens"] for r in sel) / seconds if seconds else float("nan")

        def compare(entry: dict, config: str, other: str, name: str) -> None:
            """``ci95_<name>``: the paired bootstrap interval of ``config``'s rate over ``other``'s on the
            prompts both completed; ``paired_<name>`` and ``paired_prompts_<name>`` where those are
            fewer than either config's own prompts (the point ratio ``<name>`` then covers more)."""
            runs = {c: {r["prompt"]: r for r in rows_t if r["config"] == c and "error" not in r} for c in (config, other)}
            both = [p for p in complete if p in runs[config] and p in runs[other]]
            a, b = [runs[config][p] for p in both], [runs[other][p] for p in both]
            if not sum(x["new_tokens"] for x in b):  # no prompt in common, or the anchor made nothing
                entry[f"ci95_{name}"] = [float("nan"), float("nan")]
                return
            r = rate_ratio([x["new_tokens"] for x in a], [x["seconds"] for x in a],
                           [x["new_tokens"] for x in b], [x["seconds"] for x in b])
            entry[f"ci95_{name}"] = [r.low, r.high]
            if len(both) < max(len(runs[config]), len(runs[other])):
                entry[f"paired_{name}"] = r.ratio
                entry[f"paired_prompts_{name}"] = len(both)

        anchor = tps("llamacpp-anchor") if "llamacpp-anchor" in configs else None
        genai_sd = [c for c in configs if c.startswith("ovgenai-") and parse_config(c)[1] == "sd"]
        for config in configs:
            failed = [r for r in rows_t if r["config"] == config and "error" in r]
            sel = [r for r in rows_t if r["config"] == config and "error" not in r]
            if not sel:
                summary[f"{config}@{dataset}@T={temperature}" if dataset else f"{config}@T={temperature}"] = {
                    "tokens_per_second": float("nan"), "new_tokens": 0, "prompts": 0, "errors": len(failed)}
                continue
            entry = {"tokens_per_second": tps(config), "new_tokens": sum(r["new_tokens"] for r in sel),
                     "prompts": len(sel)}
            if failed:  # its rate is over fewer prompts than the others'
                entry["errors"] = len(failed)
            if anchor:
                entry["x_llamacpp_anchor"] = entry["tokens_per_second"] / anchor
                if config != "llamacpp-anchor":
                    compare(entry, config, "llamacpp-anchor", "x_llamacpp_anchor")
            if sel and all("engine_seconds" in r for r in sel):  # the engine's share of the time
                entry["engine_share"] = sum(r["engine_seconds"] for r in sel) / sum(r["seconds"] for r in sel)
                entry["engine_ms_per_step"] = 1000 * sum(r["engine_seconds"] for r in sel) / sum(r["steps"] for r in sel)
            for other in genai_sd:  # OpenVINO GenAI's own speculative decoding, the bar to beat
                entry[f"x_{other}"] = entry["tokens_per_second"] / tps(other)
                if config != other:
                    compare(entry, config, other, f"x_{other}")
            key, method, _ = parse_config(config)
            if method == "amusd":  # against sequential sd on the same weights
                for other in configs:
                    if parse_config(other)[0].removesuffix(SPLIT) == key.removesuffix(SPLIT) and parse_config(other)[1] == "sd":
                        entry[f"x_{other}"] = entry["tokens_per_second"] / tps(other)
                if all("emitted_tokens" in r for r in sel):  # steps that deferred their bonus: blocks accepted whole
                    steps = sum(r["steps_verified"] for r in sel)
                    entry["deferred_share"] = (steps - sum(r["emitted_tokens"] - r["accepted_tokens"] for r in sel)) / steps
            if all("drafted_tokens" in r for r in sel) and sum(r["drafted_tokens"] for r in sel):
                entry["draft_acceptance_rate"] = (sum(r["accepted_tokens"] for r in sel)
                                                  / sum(r["drafted_tokens"] for r in sel))
            for name in ("target", "draft"):  # a decoding call's median (prefills left out)
                decode = [ms for r in sel for ms in r.get(f"{name}_infer_ms", [])[1:]]
                if decode:
                    entry[f"{name}_ms_per_call"] = float(np.median(decode))
            if method.removesuffix("c") in ("sd", "ngram", "ngram_sd", "amusd"):
                ar = own_ar(config)
                if ar in configs:
                    entry["x_own_ar"] = entry["tokens_per_second"] / tps(ar)
                if all("target_forwards" in r for r in sel):
                    entry["mean_acceptance_length"] = (  # tokens per verifying step (the prefill's first excluded)
                        sum(r["new_tokens"] - r.get("prefill_tokens", 0) for r in sel)
                        / sum(max(1, r["target_forwards"] - 1) for r in sel)
                    )
                if temperature == 0.0 and ar in configs:
                    own = {r["prompt"]: r["new_ids"] for r in rows_t if r["config"] == ar}
                    entry["identical_to_own_ar"] = f"{sum(r['new_ids'] == own[r['prompt']] for r in sel)}/{len(sel)}"
            summary[f"{config}@{dataset}@T={temperature}" if dataset else f"{config}@T={temperature}"] = entry
    return summary


def _timed(infer, log: list):
    """``infer`` that appends each call's milliseconds to ``log`` (the draft thread's calls too)."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return infer(*args, **kwargs)
        finally:
            log.append(1000 * (time.perf_counter() - start))
    return timed


def _lscpu() -> dict:
    """The CPU's model name and its vector / matrix ISA flags, as ``lscpu`` prints them."""
    import subprocess

    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"cpu_model": fields.get("Model name", "").strip(),
            "isa": [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]}


def _reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current RSS (Linux: ``5`` to ``/proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _memory_status() -> dict:
    """VmHWM (peak RSS), VmRSS, RssAnon and RssFile of this process in bytes (Linux)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _loadavg() -> tuple[float, float, float]:
    try:
        import os

        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def finalize_partial(path: str) -> dict:
    """The result of a run cut off after its rows (e.g. by a crash in the summary): summary from the
    partial file's rows; memory figures are absent (they are taken at the end of a run)."""
    partial = json.loads(Path(path).with_suffix(".partial.json").read_text())
    rows = partial["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    temperatures = list(dict.fromkeys(r["temperature"] for r in rows))
    partial["summary"] = summarize(rows, configs, temperatures)
    partial["finalized_from_partial"] = True
    return partial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--datasets", nargs="+", default=["humaneval"], help="humaneval and/or mtbench")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram the ngram method matches")
    parser.add_argument("--lookup-k", type=int, default=8, help="tokens an ngram_sd lookup step copies")
    parser.add_argument("--p-min", type=float, default=0.4, help="the Confidence policy's threshold (methods sdc, ngram_sdc)")
    parser.add_argument("--base-dtype", default="auto",
                        help="dtype of the activations, norms and embeddings of int8/int4 models (auto: bf16 only "
                        "where the CPU computes in it natively, else float32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-bandwidth", action="store_true")
    parser.add_argument("--skip-forward-costs", action="store_true")
    parser.add_argument("--forward-blocks", type=int, nargs="+", default=[1, 2, 5, 9, 16],
                        help="the block sizes m of the target forward costs")
    parser.add_argument("--forward-repeats", type=int, default=3, help="interleaved rounds of the forward costs (median)")
    parser.add_argument("--forward-costs-only", action="store_true",
                        help="measure the forward costs and stop (no generation)")
    parser.add_argument("--out", default="benchmarks/results/perf.json")
    parser.add_argument("--finalize", action="store_true",
                        help="only rebuild --out from its .partial.json (a run that stopped after its rows)")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    result = finalize_partial(args.out) if args.finalize else run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    for key, entry in result["summary"].items():
        extras = " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()
                          if k not in ("tokens_per_second", "new_tokens"))
        print(f"{key:28s} {entry['tokens_per_second']:7.2f} tok/s  {extras}")
    if "forward_seconds" in result:
        for key, sec in result["forward_seconds"].items():
            print(f"forward {key:32s} {sec * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
