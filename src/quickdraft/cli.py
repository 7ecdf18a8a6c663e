"""The ``quickdraft`` command line.

Bad arguments print one line naming the problem and exit with code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from quickdraft.evaluation.analyze import analyze_command
from quickdraft.evaluation.bench import bench_command
from quickdraft.errors import QuickdraftError
from quickdraft.backends import resolve_backend
from quickdraft.adaptive.headtrain import train_head_command
from quickdraft.training.feature_drafter import train_drafter_command
from quickdraft.methods import METHOD_NAMES, build_method
from quickdraft.models_cli import models_app
from quickdraft.verification.sampling import SamplingParams

app = typer.Typer(
    help="quickdraft: speculative decoding for Hugging Face causal LMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(models_app, name="models")
app.command("train-head")(train_head_command)
app.command("train-drafter")(train_drafter_command)
app.command("analyze")(analyze_command)
app.command("bench")(bench_command)


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _divergence_name(divergence: str) -> str:
    """``divergence`` with a deprecated name replaced by its current one, said on stderr (Python
    does not show a library's DeprecationWarning on the command line)."""
    from quickdraft.verification.divergences import DEPRECATED_NAMES

    if divergence in DEPRECATED_NAMES:
        typer.echo(f"warning: divergence {divergence!r} is deprecated; use {DEPRECATED_NAMES[divergence]!r} "
                   "(the same quantity)", err=True)
        return DEPRECATED_NAMES[divergence]
    return divergence



def full_head_unless_given(draft_vocab: int | None, rule) -> int | None:
    """``--draft-vocab`` as given; unset, ``0`` (the draft's full head) for a rule that reads the
    draft's probability of every token (FSD's ``js``, contrastive decoding), else the backend's preset."""
    if draft_vocab is None and getattr(rule, "needs_full_draft", False):
        return 0
    return draft_vocab

@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts (several run as one batch)."),
    method: str = typer.Option("sd", help=f"Decoding method: {', '.join(METHOD_NAMES)}."),
    k: int = typer.Option(4, "--k", help="Draft length (tokens drafted per step; the most per step for the "
                          "confidence, specdecpp, cost and auto policies)."),
    policy: str = typer.Option("auto", help="Draft-length policy: constant, heuristic, confidence, specdecpp, "
                               "cost (the length up to --k that pays most under this backend's measured forward "
                               "costs, 0 where none does; measured once per machine and pair, then cached), auto "
                               "(cost where the method may make plain steps, else constant)."),
    temperature: float = typer.Option(0.0, help="0 = greedy (as is anything below 1e-5)."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: int = typer.Option(0),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    target: str = typer.Option("target", help="Registry name, alias, HF model directory or .gguf file."),
    draft: str = typer.Option("draft", help="Registry name, alias, HF model directory or .gguf file."),
    dtype: str = typer.Option("auto", help="auto (bf16 where the CPU supports it), bfloat16, float32."),
    draft_dtype: Optional[str] = typer.Option(
        None, "--draft-dtype", help="Draft dtype (default: as --dtype)."),
    backend: str = typer.Option(
        "auto", help="auto (the fastest installed on this CPU that runs the request: llamacpp on AVX2 CPUs "
        "without AVX-512 for one prompt of a chain method, else openvino where installed, else torch); openvino "
        "(OpenVINO exports of the models, made once; needs quickdraft[openvino]); torch (the reference and research backend); or llamacpp "
        "(runs the GGUF files; needs quickdraft[llamacpp])."),
    quantize: str = typer.Option(
        "auto", help="Weights: auto (torch: as loaded; openvino: int8), none, int8 or int4 (torch: weight-only "
        "linear layers; openvino: NNCF weight compression, the head kept int8), openvino also int4all (the head "
        "and embedding in int4 too)."),
    quantize_draft: Optional[str] = typer.Option(
        None, help="Override --quantize for the draft alone (e.g. int4: lossless methods stay exact). Default: "
        "as --quantize; with --quantize auto on openvino, int4 with a 49,152-id head (see --draft-vocab)."),
    exact: bool = typer.Option(
        False, "--exact", help="openvino, llamacpp: batch-invariant kernels, so greedy speculative output equals plain "
        "greedy output token for token; verification costs more."),
    plugin_defaults: bool = typer.Option(
        False, "--plugin-defaults", help="openvino: compile the models with the CPU plugin's own settings (bf16 "
        "activations where the CPU has them, activations quantised in groups of 32, u8 KV cache) instead of "
        "quickdraft's tuned ones (docs/openvino.md#plugin-settings)."),
    draft_vocab: Optional[int] = typer.Option(
        None, "--draft-vocab", help="openvino: the draft's head keeps only this many token ids (the most frequent, "
        "plus end-of-sequence): faster drafting, still lossless; 0 keeps the full head. Default: 49152 when "
        "neither --quantize nor --quantize-draft is given, else 0."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string, non-empty (repeatable)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Apply the chat template (default: when there is one)."),
    divergence: str = typer.Option(
        "js", help="fsd: js (default: FSD's \"JS\", KL from the mixture, unbounded; the FSD reference code's default, "
        "its example threshold is 0.4), jsd (textbook Jensen-Shannon, <= ln 2), kl, kl_reverse, tv, and topk_* / topp_* of each. Thresholds "
        "are in each divergence's own units: js and jsd thresholds are not comparable."),
    threshold: float = typer.Option(0.4, help="fsd: divergence threshold T (>= 0)."),
    hybrid: bool = typer.Option(False, "--hybrid", help="fsd: lossless test instead of rejection above T."),
    fsd_raw: bool = typer.Option(
        True, "--raw/--processed", help="fsd: divergence on the raw temperature-1 distributions (FSD's default) or the processed ones."),
    divergence_top_k: int = typer.Option(50, "--divergence-top-k", help="fsd: k of the topk_* divergences."),
    divergence_top_p: float = typer.Option(0.9, "--divergence-top-p", help="fsd: nucleus mass p of the topp_* divergences, in (0, 1]."),
    drafts: str = typer.Option(
        "auto", "--drafts", help="fsd, typical: auto (fsd greedy, hybrid fsd and typical sampled), greedy or sampled."),
    epsilon: float = typer.Option(0.09, help="typical: posterior threshold epsilon in (0, 1] (Medusa: 0.09)."),
    delta: float = typer.Option(0.3, help="typical: posterior alpha delta > 0 (Medusa: 0.3)."),
    lantern_k: int = typer.Option(
        100, "--lantern-k", help="lantern: latent neighbourhood size k, the drafted token included (1 = lossless)."),
    lantern_delta: float = typer.Option(
        0.1, "--lantern-delta", help="lantern: total-variation budget delta in [0, 1] of the pooled target mass "
        "(0 = lossless)."),
    cd_alpha: float = typer.Option(
        0.1, "--cd-alpha", help="cd, scd: plausibility cut alpha in [0, 1]: only tokens the target gives at least alpha "
        "times its top probability."),
    cd_beta: float = typer.Option(
        0.5, "--cd-beta", help="cd, scd: weight beta >= 0 of the amateur (draft model): scores log p_target - beta "
        "log p_draft (0 = the target cut at alpha)."),
    candidates: int = typer.Option(1, help="ersd: candidates per position (> 1: a race tree of depth K, --tree-budget nodes)."),
    head: Optional[str] = typer.Option(None, help="specdecpp: path of the trained acceptance head."),
    stop_threshold: float = typer.Option(0.5, "--stop-threshold", help="specdecpp: stop when P(reject) > h; confidence: p_min."),
    tree_budget: int = typer.Option(16, "--tree-budget", help="tree: draft nodes per tree (N)."),
    depth: int = typer.Option(4, "--depth", help="tree: draft layers (d)."),
    topk: int = typer.Option(4, "--topk", help="tree: children per expanded node / frontier width (k)."),
    verifier: str = typer.Option("rrs", "--verifier", help="tree: rrs, kseq, optimal_greedy."),
    tree_sampling: str = typer.Option(
        "topk", "--sampling", help="tree: how children are drawn: topk, with_replacement, without_replacement, greedy (--rule ersd: race)."
    ),
    tree_rule: str = typer.Option("lossless", "--rule", help="tree: lossless, fsd (FSD on trees; --divergence/--threshold) or ersd (race candidates, --topk per node)."),
    tree_shape: str = typer.Option(
        "dynamic", "--tree-shape", help="tree --rule ersd: dynamic (EAGLE-2-style race trees) or optimal (the static "
        "Tunstall tree of --tree-budget nodes, at most --depth deep, for the pair's rank law; docs/trees.md)."),
    rank_law: str = typer.Option(
        "", "--rank-law", help="--tree-shape optimal: rank-law JSON of the pair (benchmarks/estimate_rank_law.py); "
        "default: the shipped laws of the default pair on openvino."),
    datastore: Optional[str] = typer.Option(
        None, "--datastore", help="rest, rest_sd: what to retrieve drafts from: a directory of text files (e.g. a "
        "source tree), a text file, a .jsonl corpus, or an index saved by RetrievalIndex.save (.npz)."),
    datastore_field: str = typer.Option("text", "--datastore-field", help="rest, rest_sd: the text field of a .jsonl datastore."),
    phrase_len: int = typer.Option(8, "--phrase-len", help="phrase_sd: most tokens of a pooled phrase (one lookup appends at most this many)."),
    phrase_pool: int = typer.Option(4096, "--phrase-pool", help="phrase_sd: most phrases each sequence's pool keeps (least recently seen dropped)."),
    phrase_max_draft: int = typer.Option(
        16, "--phrase-max-draft", help="phrase_sd: most draft tokens per step, draft model's and phrases' together "
        "(--k counts draft-model forwards)."),
    drafter: str = typer.Option(
        "model", "--drafter", help="Who drafts sd's chains (and fsd, typical, ersd, lantern) and tree's trees: model "
        "(the draft model) or feature (the target's EAGLE-style feature drafter; torch backend; "
        "`quickdraft train-drafter` makes it)."),
    feature_drafter: Optional[Path] = typer.Option(
        None, "--feature-drafter", help="--drafter feature: the drafter's directory (default: the target's cache entry)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate text, streaming it to stdout (one prompt), then print the metrics."""
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k or None, top_p=top_p)
        spec = build_method(
            method, k=k, policy=policy, sampling=sampling, divergence=_divergence_name(divergence), threshold=threshold,
            hybrid=hybrid, fsd_raw=fsd_raw, divergence_top_k=divergence_top_k, divergence_top_p=divergence_top_p,
            drafts=drafts, epsilon=epsilon,
            delta=delta, lantern_k=lantern_k, lantern_delta=lantern_delta, cd_alpha=cd_alpha, cd_beta=cd_beta,
            candidates=candidates, seed=seed, head=head,
            stop_threshold=stop_threshold, tree_budget=tree_budget, depth=depth, topk=topk, verifier=verifier,
            tree_sampling=tree_sampling, tree_rule=tree_rule, tree_shape=tree_shape, rank_law=rank_law,
            phrase_len=phrase_len, phrase_pool=phrase_pool,
            phrase_max_draft=phrase_max_draft,
        )
        from quickdraft.decoding.engine import check_max_new_tokens
        from quickdraft.pipeline import Pipeline, check_prompt_text, check_stop_strings

        # everything that does not need the models is checked before they load
        check_max_new_tokens(max_new_tokens)
        for prompt in prompts:
            check_prompt_text(prompt)
        check_stop_strings(stop)
        check_datastore_option(method, spec.needs_datastore, datastore)
        from quickdraft.pipeline import DRAFTER_KINDS

        if drafter not in DRAFTER_KINDS:
            raise QuickdraftError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTER_KINDS)}")
        from quickdraft.backends.llamacpp import runs_on_llamacpp

        # auto: the fastest backend installed on this CPU that runs this request
        backend = resolve_backend(backend, llamacpp_runs=backend == "auto" and runs_on_llamacpp(
            method, spec.engine_method, prompts=len(prompts), target=target, draft=draft if spec.needs_draft else None,
            needs_hidden=drafter != "model" or getattr(spec.policy, "head", None) is not None,
            backend_options=quantize != "auto" or quantize_draft is not None or draft_vocab is not None
            or plugin_defaults or dtype != "auto" or draft_dtype is not None))
        if drafter == "feature" and backend != "torch":
            raise QuickdraftError("--drafter feature reads the target's hidden states: use --backend torch")
        by_features = drafter == "feature" and spec.needs_draft
        threads = None
        if spec.engine_method == "amusd" and backend == "openvino":  # both models run at once
            from quickdraft.decoding.amusd import split_threads
            from quickdraft.backends.threads import runtime_threads

            threads = split_threads(runtime_threads())
        pipe = Pipeline.from_specs(
            target, draft if spec.needs_draft and not by_features else None, dtype=dtype, backend=backend,
            quantize=quantize, quantize_draft=quantize_draft, draft_dtype=draft_dtype, exact=exact,
            draft_vocab=full_head_unless_given(draft_vocab, spec.rule) if spec.needs_draft and not by_features else None,
            threads=threads, plugin_defaults=plugin_defaults,
        )
        if by_features:
            pipe.load_feature_drafter(feature_drafter)
        if datastore is not None:
            pipe.set_datastore(datastore, datastore_field)
        acceptance_head = getattr(spec.policy, "head", None)
        if acceptance_head is not None and pipe.draft_model is not None and backend != "llamacpp":
            acceptance_head.check_draft(pipe.draft_model, name=f"draft {draft!r}")  # clear error on a mismatch
        if not json_out:
            who = "feature drafter" if by_features else (draft if spec.needs_draft else "-")
            typer.echo(f"[{method}] backend={backend} policy={spec.policy.name} target={target} draft={who}", err=True)
        if spec.policy.name == "cost":
            def measuring(store) -> None:
                if not json_out:
                    kept = f"; kept in {store.path}" if store is not None else ""
                    typer.echo(f"[{method}] policy cost: measuring this pair's forward costs on this machine "
                               f"(seconds{kept})", err=True)

            pipe.step_costs(spec.policy.max_k, max_rows=len(prompts), on_measure=measuring)
        single = len(prompts) == 1
        stream = None if json_out or not single else (lambda row, text: (sys.stdout.write(text), sys.stdout.flush()))
        out = pipe.generate(
            list(prompts), method=spec.engine_method, policy=spec.policy, rule=spec.rule, sampling=sampling,
            max_new_tokens=max_new_tokens, seed=seed, stop_strings=tuple(stop), chat=chat, on_text=stream,
            tree=spec.tree, verifier=spec.verifier, phrase=spec.phrase, drafter="feature" if by_features else "model",
        )
    except QuickdraftError as err:
        fail(str(err))
        return
    if json_out:
        results = [
            {"method": method, "backend": backend, "policy": spec.policy.name, "text": c.text, "finish_reason": c.finish_reason,
             "metrics": c.metrics.to_dict()}
            for c in out.completions
        ]
        payload = results[0] if single else {"method": method, "backend": backend, "policy": spec.policy.name,
                                             "completions": results,
                                             "batch_metrics": out.metrics.to_dict()}
        typer.echo(json.dumps(payload, indent=2))
        return
    for row, completion in enumerate(out.completions):
        if not single:
            typer.echo(f"=== prompt {row}\n{completion.text}")
        _print_metrics(completion)


@app.command()
def serve(
    target: str = typer.Option("target", help="Registry name, alias, HF model directory or .gguf file."),
    draft: str = typer.Option("draft", help="Registry name, alias, HF model directory or .gguf file; 'none' for no draft."),
    backend: str = typer.Option(
        "auto", help="auto (openvino where installed, else torch); torch or openvino (continuous batching); "
                     "llamacpp (one request at a time)."),
    dtype: str = typer.Option("auto", help="auto (bf16 where the CPU supports it), bfloat16, float32."),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype", help="Draft dtype (default: as --dtype)."),
    quantize: str = typer.Option("auto", help="Weights: auto, none, int8, int4 or int4all (as for `generate`)."),
    quantize_draft: Optional[str] = typer.Option(None, help="Override --quantize for the draft alone."),
    draft_vocab: Optional[int] = typer.Option(
        None, "--draft-vocab", help="openvino: the draft's head keeps only this many token ids (as for `generate`)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model id in /v1/models (default: --target)."),
    method: str = typer.Option("sd", help="Default method: ar, sd, ngram, ngram_sd, rest, rest_sd, phrase_sd, amusd, fsd, typical, "
                                "ersd, lantern, cd, scd."),
    k: int = typer.Option(4, "--k", help="Default draft length."),
    policy: str = typer.Option("auto", help="Default draft-length policy: constant, heuristic, confidence, specdecpp, "
                               "cost, auto (as for `generate`: cost for chain methods, deciding each step by the "
                               "forward costs at the rows it decodes, measured over batches up to --max-batch at start "
                               "and cached)."),
    temperature: float = typer.Option(0.0, help="Default temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Default top-p."),
    top_k: int = typer.Option(0, "--top-k", help="Default top-k (0 = off)."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Default max_tokens of a request."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context limit per row (default: the target's)."),
    max_batch: int = typer.Option(16, "--max-batch", help="Most rows decoded at once (over all settings)."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Request size limit."),
    divergence: str = typer.Option(
        "js", help="fsd: js (default: FSD's \"JS\", KL from the mixture, unbounded; the FSD reference code's default, "
        "its example threshold is 0.4), jsd (textbook Jensen-Shannon, <= ln 2), kl, kl_reverse, tv, and topk_* / topp_* of each. Thresholds "
        "are in each divergence's own units: js and jsd thresholds are not comparable."),
    threshold: float = typer.Option(0.4, help="fsd: divergence threshold T (>= 0)."),
    hybrid: bool = typer.Option(False, "--hybrid", help="fsd: lossless test instead of rejection above T."),
    fsd_raw: bool = typer.Option(True, "--raw/--processed", help="fsd: divergence on the raw or processed distributions."),
    divergence_top_k: int = typer.Option(50, "--divergence-top-k", help="fsd: k of the topk_* divergences."),
    divergence_top_p: float = typer.Option(0.9, "--divergence-top-p", help="fsd: nucleus mass p of the topp_* divergences, in (0, 1]."),
    drafts: str = typer.Option("auto", "--drafts", help="fsd, typical: auto, greedy or sampled."),
    epsilon: float = typer.Option(0.09, help="typical: posterior threshold epsilon in (0, 1]."),
    delta: float = typer.Option(0.3, help="typical: posterior alpha delta > 0."),
    head: Optional[str] = typer.Option(None, help="specdecpp: path of the trained acceptance head."),
    stop_threshold: float = typer.Option(0.5, "--stop-threshold", help="specdecpp: threshold h; confidence: p_min."),
    datastore: Optional[str] = typer.Option(
        None, "--datastore", help="rest, rest_sd: what to retrieve drafts from (as for `generate`)."),
    datastore_field: str = typer.Option("text", "--datastore-field", help="rest, rest_sd: the text field of a .jsonl datastore."),
    lantern_k: int = typer.Option(100, "--lantern-k", help="lantern: latent neighbourhood size k (1 = lossless)."),
    lantern_delta: float = typer.Option(0.1, "--lantern-delta", help="lantern: total-variation budget delta in [0, 1]."),
    cd_alpha: float = typer.Option(0.1, "--cd-alpha", help="cd, scd: plausibility cut alpha in [0, 1]."),
    cd_beta: float = typer.Option(0.5, "--cd-beta", help="cd, scd: weight beta >= 0 of the amateur (draft model)."),
    phrase_len: int = typer.Option(8, "--phrase-len", help="phrase_sd: most tokens of a pooled phrase."),
    phrase_pool: int = typer.Option(4096, "--phrase-pool", help="phrase_sd: most phrases each request's pool keeps."),
    phrase_max_draft: int = typer.Option(16, "--phrase-max-draft", help="phrase_sd: most draft tokens per step."),
    drain_seconds: float = typer.Option(60.0, "--drain-seconds", help="At shutdown, wait this long for running requests."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning, error."),
) -> None:
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions) with speculative decoding."""
    try:
        from quickdraft.serve.app import ServerConfig
        from quickdraft.serve.server import run_server
        from quickdraft.serve.settings import ServeDefaults, build_spec
    except ImportError as err:
        fail(f"{err.name or err} is missing: pip install -e '.[serve]'")
        return
    try:
        defaults = ServeDefaults(
            method=method, k=k, policy=policy, threshold=threshold, divergence=_divergence_name(divergence), hybrid=hybrid,
            drafts=drafts, epsilon=epsilon, delta=delta, stop_threshold=stop_threshold, head=head,
            fsd_raw=fsd_raw, divergence_top_k=divergence_top_k, divergence_top_p=divergence_top_p,
            lantern_k=lantern_k, lantern_delta=lantern_delta, cd_alpha=cd_alpha, cd_beta=cd_beta,
            phrase_len=phrase_len, phrase_pool=phrase_pool, phrase_max_draft=phrase_max_draft,
        )
        sampling = SamplingParams(temperature=temperature, top_k=top_k or None, top_p=top_p)
        spec = build_spec(defaults, sampling, 0)  # a bad default fails here, not at the first request
        from quickdraft.pipeline import Pipeline

        use_draft = None if draft.lower() == "none" else draft
        if use_draft is None and spec.needs_draft:
            raise QuickdraftError(f"the default method {method!r} needs a draft model: give --draft or --method ar/ngram")
        if spec.needs_datastore and datastore is None:
            raise QuickdraftError(f"the default method {method!r} retrieves its drafts: give --datastore PATH")
        if datastore is not None and not Path(datastore).exists():
            raise QuickdraftError(f"datastore {datastore} does not exist")
        backend = resolve_backend(backend)  # never llamacpp: it serves one request at a time
        pipe = Pipeline.from_specs(
            target, use_draft, dtype=dtype, backend=backend, quantize=quantize, quantize_draft=quantize_draft,
            draft_dtype=draft_dtype, draft_vocab=full_head_unless_given(draft_vocab, spec.rule) if use_draft else None,
        )
        if head is not None and backend == "torch" and pipe.draft_model is not None:
            from quickdraft.decoding.policies import SpecDecPP

            SpecDecPP.from_file(head).head.check_draft(pipe.draft_model, name=f"draft {draft!r}")
        if datastore is not None:
            pipe.set_datastore(datastore, datastore_field)
    except QuickdraftError as err:
        fail(str(err))
        return
    config = ServerConfig(
        model_name=model_name or target, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
        max_context=max_context, max_rows=max_batch, max_body_bytes=max_body_bytes, drain_seconds=drain_seconds,
        defaults=defaults,
    )
    run_server(pipe, config, host=host, port=port, log_level=log_level)


def check_datastore_option(method: str, needs_datastore: bool, datastore: str | None) -> None:
    """Raise :class:`QuickdraftError` unless ``--datastore`` is given (and exists) exactly when the
    method retrieves (checked before the models load)."""
    if needs_datastore and datastore is None:
        raise QuickdraftError(f"method {method!r} retrieves its drafts: give --datastore PATH (a directory, a text "
                              "file or a .jsonl corpus)")
    if datastore is not None and not needs_datastore:
        raise QuickdraftError(f"--datastore applies to the retrieval methods rest and rest_sd, not {method!r}")
    if datastore is not None and not Path(datastore).exists():
        raise QuickdraftError(f"datastore {datastore} does not exist")


def _print_metrics(completion) -> None:
    typer.echo("")
    m = completion.metrics
    typer.echo(
        f"\n--- {m.new_tokens} new tokens: {m.prefill_tokens} from the prefill ({m.prefill_seconds:.2f} s, "
        f"{m.prompt_tokens} prompt tokens), then {m.tokens_per_second:.2f} tok/s for {m.decode_seconds:.2f} s\n"
        f"    target forwards {m.target_forwards}, draft forwards {m.draft_forwards}, "
        f"mean acceptance length {m.mean_acceptance_length:.2f} (incl. bonus), "
        + (f"acceptance rate {m.acceptance_rate:.1%}" if m.drafted_tokens else "nothing drafted (plain steps)")
        + f", finish: {completion.finish_reason}"
        + (f", lossy share {m.lossy_share:.1%}" if m.lossy_accepted_tokens else "")
        + ("\n    acceptance by position: " + " ".join(f"{r:.2f}" for r in m.acceptance_rate_by_position)
           if m.drafted_tokens else "")
    )


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
