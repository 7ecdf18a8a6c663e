"""Adaptive draft length by exact replay (``quickdraft.adaptive.replay``), at T = 0 and, with ERSD, at T > 0.

At T = 0 the output does not depend on the draft length, so one greedy output per prompt and the
draft's greedy chain from every position of it decide the steps, drafted and accepted tokens of
*every* policy exactly (``tests/test_replay.py`` checks this against the engine). At T > 0 the
same holds for ERSD (``--temperature 0.7``: the lossless exponential-race rule, whose output is the
target's race sample for the seed whatever the draft length, and whose draft chains are the draft's
race winners); the Leviathan rule's output depends on the draft length, so it cannot be replayed. With measured
forward times (``measure_step_cost``) each run also gets a modelled decode time. This compares
every fixed K, every threshold of Confidence and SpecDec++, Heuristic and the clairvoyant optimum
(the best per-step draft length knowing where the draft goes wrong) on more prompts than the
wall-clock benchmark can afford, without its run-to-run noise, and tells how much any draft-length
policy could gain over the best fixed K on this pair at all.

Outputs: the T = 0 outputs recorded by ``bench_adaptive.py`` (``--measured``), plus outputs
generated here (``sd`` with K = 4, timed) for further prompts (``--prompts`` per dataset in total).
The measured records also validate the replay: replayed steps and drafted tokens against the
engine's, and modelled against measured tokens/s per configuration. The per-step overhead of the
time model is fitted on the generation runs here (timed), or, without them, on the measured fixed-K runs.

Several heads (``--head LABEL=PATH``, repeated) are replayed side by side: each gets its own
SpecDec++ thresholds under its label.

``--outputs-from RESULT`` replays new policies (another head) on the outputs of an earlier replay:
no generation, the same prompts, setting and cost model (its forward times and overhead); each
output's chains are drafted again and must reproduce the stored ``match`` exactly, and the stops of
every policy are recomputed, so policies the earlier run also replayed come out as before.

Selection is honest: besides the in-sample best (best fixed K and best threshold chosen on the same
prompts, as in the wall-clock benchmark), ``heldout`` chooses K and the threshold on half of the
prompts and scores them on the other half (two folds: even / odd prompt index).

Re-run with the command stored in the result JSON (``meta.command``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from quickdraft.evaluation.datasets import load_humaneval, load_mtbench
from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.decoding.head import load_head
from quickdraft.pipeline import Pipeline
from quickdraft.decoding.policies import Confidence, Constant, Heuristic, SpecDecPP
from quickdraft.adaptive.replay import clairvoyant, draft_chains, race_proposer, walk
from quickdraft.backends.costs import StepCost, measure_step_cost
from quickdraft.evaluation.report import plot_adaptive_replay
from quickdraft.verification.rules import ExponentialRace
from quickdraft.verification.sampling import SamplingParams

from openvino_compression import _lscpu  # the studies' CPU record (this script's folder is on sys.path)
from speedup_ceiling import target_costs  # bench_perf.py's forward-cost keys, parsed


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10, help="prompts per dataset (the first N of each)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-k", type=int, default=10)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--p-min", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--head", action="append", default=None, metavar="LABEL=PATH",
                    help="SpecDec++ head, repeated (default: specdecpp=the committed T = 0 head)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: ERSD at this temperature")
    ap.add_argument("--seed", type=int, default=0, help="ERSD seed (T > 0)")
    ap.add_argument("--measured", default="benchmarks/results/adaptive_default_pair_t0_3prompts.json",
                    help="bench_adaptive.py result at T = 0 whose outputs are reused and whose records validate "
                         "('' for none; ignored at T > 0)")
    ap.add_argument("--rows", type=int, default=16, help="chains drafted at once (draft_chains rows)")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="start no new prompt after this (0 = no limit)")
    ap.add_argument("--step-cost-from", default=None, metavar="RESULT",
                    help="reuse the forward times measured by another replay on this machine instead of timing them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7, help="timings per forward size (median)")
    ap.add_argument("--out", default="benchmarks/results/adaptive_replay_t0.json")
    ap.add_argument("--outputs-from", default=None, metavar="RESULT",
                    help="replay the policies on the stored outputs of an earlier replay (no generation; its "
                         "setting, prompts and cost model); the re-drafted chains must reproduce its match")
    ap.add_argument("--retime", default=None, metavar="RESULT",
                    help="no model work: re-fit the per-step overhead of RESULT (a T = 0 replay) on the "
                         "--measured fixed-K runs (or --calibrate runs), re-time every run and rewrite its summary")
    ap.add_argument("--costs-from", default=None, metavar="PERF_RESULT",
                    help="with --retime: re-score under the forward costs of a bench_perf.py result instead "
                         "(--costs-config's target over m tokens, its draft, its engine ms per step); "
                         "writes --out")
    ap.add_argument("--costs-config", default="openvino-int4/int4v49152",
                    help="the bench_perf.py configuration whose costs --costs-from takes")
    ap.add_argument("--calibrate", type=int, default=0, metavar="N",
                    help="with --retime: fit the overhead on N fresh timed runs per dataset of the stored outputs")
    return ap.parse_args()


def parse_heads(specs: list[str] | None) -> dict[str, str]:
    specs = specs or ["specdecpp=models/heads/specdecpp-qwen2.5-coder-0.5b-t0.pt"]
    heads = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path or "_" in label:
            raise SystemExit(f"--head wants LABEL=PATH with a label without '_', got {spec!r}")
        heads[label] = path
    return heads


def policy_factories(args, heads, max_k) -> dict:
    f = {f"confidence_p{p:g}": (lambda p=p: Confidence(p_min=p, max_k=max_k)) for p in args.p_min}
    for label, head in heads.items():
        f.update({f"{label}_h{h:g}": (lambda h=h, head=head: SpecDecPP(head, threshold=h, max_k=max_k))
                  for h in args.thresholds})
    return f


def replay_output(n, table, cost, args) -> dict[str, dict]:
    runs = {f"fixed_k{k}": walk(n, table.match, lambda j, k=k: k, cost) for k in range(1, args.max_k + 1)}
    for name, stops in table.stops.items():
        runs[name] = walk(n, table.match, lambda j, s=stops: s[j], cost)
    pol = Heuristic(initial_k=4, max_k=args.max_k)  # as bench_adaptive.py
    runs["heuristic"] = walk(n, table.match, lambda j: pol.begin_step(), cost,
                             update=lambda k, a: pol.update(k, torch.tensor([a])))
    runs["clairvoyant"] = clairvoyant(n, table.match, cost, args.max_k)
    return {name: {**r.as_dict(), "lengths": r.lengths} for name, r in runs.items()}


def tokens_per_s(runs: list[dict]) -> float:
    return sum(r["new_tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def best_of(cell: dict[str, float], prefix: str) -> str:
    return max((n for n in cell if n.startswith(prefix)), key=cell.get)


def summarise(outputs: list[dict], prefixes: list[str]) -> dict:
    names = list(outputs[0]["runs"])
    cell = {n: tokens_per_s([o["runs"][n] for o in outputs]) for n in names}
    steps = {n: sum(o["runs"][n]["steps"] for o in outputs) for n in names}
    new = sum(o["runs"][names[0]]["new_tokens"] for o in outputs)
    drafted = {n: sum(o["runs"][n]["drafted"] for o in outputs) for n in names}
    accepted = {n: sum(o["runs"][n]["accepted"] for o in outputs) for n in names}
    fixed = best_of(cell, "fixed_k")
    base = cell[fixed]
    out = {
        "prompts": len(outputs), "new_tokens": new,
        "configs": {n: {"tokens_per_s": cell[n], "gain_over_best_fixed": cell[n] / base - 1,
                        "target_calls_per_token": steps[n] / new,
                        "discarded_per_token": (drafted[n] - accepted[n]) / new,
                        "mean_draft_len": drafted[n] / steps[n],
                        "accepted_per_step": accepted[n] / steps[n]} for n in names},
        "best_fixed": fixed,
    }
    for prefix in prefixes:
        b = best_of(cell, prefix + "_")
        out[f"best_{prefix}"] = b
        out[f"best_{prefix}_gain"] = cell[b] / base - 1
    out["clairvoyant_gain"] = cell["clairvoyant"] / base - 1
    for prefix in prefixes:  # the share of the clairvoyant gain captured (the goal: at least half)
        out[f"best_{prefix}_share_of_clairvoyant"] = out[f"best_{prefix}_gain"] / out["clairvoyant_gain"]
    out["heuristic_gain"] = cell["heuristic"] / base - 1
    # held-out: choose on one fold, score on the other
    folds = [outputs[0::2], outputs[1::2]]
    held: dict[str, list] = {prefix: [] for prefix in prefixes}
    if all(folds):
        for pick, score in ((folds[0], folds[1]), (folds[1], folds[0])):
            c_pick = {n: tokens_per_s([o["runs"][n] for o in pick]) for n in names}
            c_score = {n: tokens_per_s([o["runs"][n] for o in score]) for n in names}
            k = best_of(c_pick, "fixed_k")
            for prefix in held:
                b = best_of(c_pick, prefix + "_")
                held[prefix].append({"chosen_fixed": k, "chosen": b, "gain": c_score[b] / c_score[k] - 1,
                                     "clairvoyant_gain": c_score["clairvoyant"] / c_score[k] - 1})
        out["heldout"] = held
    return out


def validate(measured: dict, replays: dict[str, dict]) -> dict:
    """Replayed vs recorded steps / drafted per (prompt, config); modelled vs measured tokens/s."""
    exact, same_steps, total, mismatches = 0, 0, 0, []
    per_config: dict[str, dict] = {}
    for rec in measured["records"]:
        rep = replays.get(rec["prompt_id"], {}).get(rec["config"])
        if rep is None:
            continue
        total += 1
        same_steps += rep["steps"] == rec["steps"]
        same = (rep["steps"], rep["drafted"]) == (rec["steps"], rec["drafted"])
        exact += same
        if not same:
            mismatches.append({"prompt_id": rec["prompt_id"], "config": rec["config"],
                               "replay": [rep["steps"], rep["drafted"]], "engine": [rec["steps"], rec["drafted"]]})
        key = f"{rec['dataset']}/{rec['config']}"
        c = per_config.setdefault(key, {"new": 0, "measured_s": 0.0, "model_s": 0.0})
        c["new"] += rec["new_tokens"]
        c["measured_s"] += rec["decode_seconds"]
        c["model_s"] += rep["seconds"]
    rows = {k: {"measured_tokens_per_s": c["new"] / c["measured_s"], "model_tokens_per_s": c["new"] / c["model_s"],
                "model_over_measured": c["measured_s"] / c["model_s"]} for k, c in per_config.items()}
    out = {"runs_compared": total, "steps_equal": same_steps, "steps_and_drafted_equal": exact,
           "mismatches": mismatches, "per_config": rows}
    for ds in {k.split("/")[0] for k in rows}:
        keys = [k for k in rows if k.startswith(ds + "/")]
        if len(keys) < 3:  # a rank correlation needs configurations to rank
            continue
        rho = spearmanr([rows[k]["measured_tokens_per_s"] for k in keys], [rows[k]["model_tokens_per_s"] for k in keys])
        ratios = [rows[k]["model_over_measured"] for k in keys]
        out[f"{ds}_spearman"] = float(rho.statistic)
        out[f"{ds}_model_over_measured_range"] = [min(ratios), max(ratios)]
    return out


def same_runs(source: dict, outputs: dict[str, list[dict]]) -> dict[str, str]:
    """For every run name both results replayed: whether its draft lengths are the same on every
    output ("equal") or not ("differs"): a policy replayed again on the same outputs must agree."""
    old = {o["prompt_id"]: o["runs"] for outs in source["outputs"].values() for o in outs}
    compared, differ = set(), set()
    for outs in outputs.values():
        for o in outs:
            for name, run in o["runs"].items():
                if name in old.get(o["prompt_id"], {}):
                    compared.add(name)
                    if run["lengths"] != old[o["prompt_id"]][name]["lengths"]:
                        differ.add(name)
    return {name: "differs" if name in differ else "equal" for name in compared}


def perf_step_cost(perf: dict, config: str, temperature: float, max_k: int) -> tuple[StepCost, dict]:
    """A step cost from a ``bench_perf.py`` result: ``config``'s target forward over m tokens
    (linear between the measured m = 1, 2, 5, 9, 16), its draft's one-token forward, and the
    engine's milliseconds per step of its ``sd`` row at ``temperature``."""
    fs = perf["forward_seconds"]
    costs = target_costs(fs).get(config)
    if not costs:
        raise SystemExit(f"no forward costs of {config} in the perf result")
    ms = sorted(costs)
    times = [costs[m] for m in ms]
    target = tuple(float(np.interp(m, ms, times)) for m in range(1, max_k + 2))
    row = perf["summary"].get(f"{config}-sd@T={temperature:.1f}")
    if row is None or "engine_ms_per_step" not in row:
        raise SystemExit(f"no sd row of {config} at T = {temperature} in the perf result")
    cost = StepCost(target=target, draft=fs[f"{config}/draft/m=1"], overhead=row["engine_ms_per_step"] / 1e3)
    source = {"config": config, "measured_m": ms, "target_by_tokens": list(target), "draft": cost.draft,
              "overhead_per_step": cost.overhead, "machine": perf.get("machine"), "command": perf.get("command")}
    return cost, source


def stored_step_cost(meta: dict) -> StepCost:
    """The cost model a replay result stored (``meta["step_cost"]``: target times by tokens, draft, overhead)."""
    sc = meta["step_cost"]
    return StepCost(target=tuple(sc["target_by_tokens"]), draft=sc["draft"], overhead=sc["overhead_per_step"])


def greedy_replay_step_cost(replay: dict, replay_path: str, costs_from: str | None, costs_config: str) -> tuple[StepCost, dict]:
    """The step cost a study over a T = 0 replay walks with: ``costs_from``'s (a ``bench_perf.py``
    result, :func:`perf_step_cost` of ``costs_config``) where given, else the replay's own; a replay at
    T > 0 is refused (its outputs are not greedy)."""
    if replay["meta"]["args"].get("temperature", 0.0) != 0:
        raise SystemExit(f"{replay_path} is a replay at T > 0; this study reads T = 0 replays (greedy outputs)")
    if costs_from:
        return perf_step_cost(json.loads(Path(costs_from).read_text()), costs_config, 0.0, replay["meta"]["args"]["max_k"])
    return stored_step_cost(replay["meta"]), {"from": replay_path}


def rescore(args) -> None:
    """Re-score a replay under another backend's forward costs: every policy's draft lengths are
    those of the replay (a policy's stops do not depend on time), the clairvoyant optimum and the
    best fixed K and thresholds are chosen again under the new costs."""
    path = Path(args.retime)
    result = json.loads(path.read_text())
    perf = json.loads(Path(args.costs_from).read_text())
    temperature = result["meta"]["args"].get("temperature", 0.0)
    max_k = result["meta"]["args"]["max_k"]
    cost, source = perf_step_cost(perf, args.costs_config, temperature, max_k)
    for outs in result["outputs"].values():
        for o in outs:
            for name, r in o["runs"].items():
                if name == "clairvoyant":
                    c = clairvoyant(o["new_tokens"], o["match"], cost, max_k)
                    o["runs"][name] = {**c.as_dict(), "lengths": c.lengths}
                else:
                    r["seconds"] = sum(cost.step(k) for k in r["lengths"])
    result["meta"]["step_cost"] = {**source, "note": f"re-scored by --costs-from from {path.name}'s replay"}
    result["meta"]["rescore_command"] = "python " + " ".join(sys.argv)
    result["meta"]["validation_note"] = ("validation: steps and drafted tokens as in the replay; its modelled "
                                         "against measured speeds hold for the replay's own cost model")
    prefixes = ["confidence", *result["meta"]["heads"]]
    result["summary"] = {ds: summarise(outs, prefixes) for ds, outs in result["outputs"].items()}
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1))
    plot_adaptive_replay(result["summary"], out.with_suffix(".png"), heads=list(result["meta"]["heads"]),
                         setting=result["meta"]["setting"] + f", {args.costs_config} forward costs")
    print(f"step cost from {args.costs_from} ({args.costs_config}): target "
          f"{['%.1f' % (1e3 * t) for t in cost.target]} ms, draft {1e3 * cost.draft:.1f} ms, "
          f"engine {1e3 * cost.overhead:.1f} ms a step")
    report(result, prefixes)


def retime(args) -> None:
    """Re-time a result from its stored draft lengths, with the overhead fitted on the quiet measured
    runs of ``--measured`` (T = 0) or on ``--calibrate`` fresh timed runs of its stored outputs (for a
    replay whose own generation runs shared the machine)."""
    path = Path(args.retime)
    result = json.loads(path.read_text())
    sampled = result["meta"]["args"].get("temperature", 0.0) > 0
    if sampled and not args.calibrate:
        raise SystemExit(f"{path} replays T > 0, which the measured T = 0 runs cannot time: add --calibrate N")
    # the measured records are T = 0 outputs: at T > 0 they neither fit the overhead nor validate
    measured = {"records": []} if sampled else json.loads(Path(args.measured).read_text())
    sc = result["meta"]["step_cost"]
    base = StepCost(target=tuple(sc["target_by_tokens"]), draft=sc["draft"])
    outputs = result["outputs"]
    replays = {o["prompt_id"]: o["runs"] for outs in outputs.values() for o in outs}
    residuals = []
    if args.calibrate:  # fresh timed engine runs (sd, K = 4) of the stored outputs, on this machine now
        torch.set_num_threads(args.threads)
        pipe = Pipeline.from_specs("target", "draft", dtype="float32")
        loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench}
        seed = result["meta"]["args"].get("seed", 0)
        sampling = SamplingParams(temperature=result["meta"]["args"].get("temperature", 0.0))
        calibration = []
        for ds, outs in outputs.items():
            ids = {p.id: pipe.encode_messages(p.messages) for p in loaders[ds](len(outs))}
            for o in outs[:args.calibrate]:
                out = generate(pipe.target, [ids[o["prompt_id"]]], method="sd",
                               drafter=ModelDrafter(pipe.draft, pipe.vocab_size),
                               rule=ExponentialRace(seed=seed) if sampled else None, policy=Constant(4),
                               sampling=sampling, seed=seed, max_new_tokens=o["new_tokens"], eos_token_ids=pipe.eos_ids())
                bm, rep = out.batch_metrics, o["runs"]["fixed_k4"]
                if out.sequences[0] != o["tokens"] or bm.steps != rep["steps"]:
                    raise SystemExit(f"calibration run of {o['prompt_id']} does not reproduce the stored output")
                residuals.append((bm.decode_seconds - sum(base.step(k) for k in rep["lengths"])) / bm.steps)
                calibration.append({"prompt_id": o["prompt_id"], "steps": bm.steps, "decode_seconds": bm.decode_seconds})
                print(f"calibration {o['prompt_id']}: {bm.decode_seconds:.1f} s, {bm.steps} steps", flush=True)
        result["calibration_runs"] = calibration
        source = f"{len(calibration)} timed sd K = 4 runs of stored outputs (--calibrate, quiet machine)"
    else:
        for rec in measured["records"]:
            rep = replays.get(rec["prompt_id"], {}).get(rec["config"])
            if rep is not None and rec["config"].startswith("fixed_k") and rec["temperature"] == 0:
                residuals.append((rec["decode_seconds"] - sum(base.step(k) for k in rep["lengths"])) / rec["steps"])
        source = f"the fixed-K runs of {args.measured}"
    if not residuals:
        raise SystemExit(f"no fixed-K runs of {args.measured} match the outputs of {path}")
    raw_overhead = float(np.median(residuals))
    cost = StepCost(target=base.target, draft=base.draft, overhead=max(0.0, raw_overhead))
    for outs in outputs.values():
        for o in outs:
            for r in o["runs"].values():
                r["seconds"] = sum(cost.step(k) for k in r["lengths"])
    sc.update(overhead_per_step=cost.overhead, overhead_fit_before_clipping=raw_overhead,
              overhead_note=f"median over {source} of (decode seconds - forwards-only model) / steps, "
                            "re-fitted by --retime")
    result["meta"]["retime_command"] = "python " + " ".join(sys.argv)
    gen = result["validation"].get("generation_runs", {})
    for key, row in gen.get("per_config", {}).items():  # generation runs: sd K = 4 on the generated outputs
        ds, config = key.split("/")
        outs = [o for o in outputs[ds] if o["source"] == "generated"]
        model_s = sum(o["runs"][config]["seconds"] for o in outs)
        new = sum(o["new_tokens"] for o in outs)
        row["model_tokens_per_s"] = new / model_s
        row["model_over_measured"] = row["model_tokens_per_s"] / row["measured_tokens_per_s"]
    result["validation"]["measured_records"] = validate(measured, replays)
    prefixes = ["confidence", *result["meta"]["heads"]]
    result["summary"] = {ds: summarise(outs, prefixes) for ds, outs in outputs.items()}
    path.write_text(json.dumps(result, indent=1))
    plot_adaptive_replay(result["summary"], path.with_suffix(".png"), heads=list(result["meta"]["heads"]),
                         setting=result["meta"]["setting"])
    print(f"per-step overhead re-fitted on {source}: {cost.overhead * 1000:.1f} ms")
    report(result, prefixes)


def report(result: dict, prefixes: list[str]) -> None:
    for ds, s in result["summary"].items():
        print(f"{ds}: best fixed {s['best_fixed']} {s['configs'][s['best_fixed']]['tokens_per_s']:.2f} tok/s; "
              + "; ".join(f"{s[f'best_{x}']} {s[f'best_{x}_gain']:+.1%} "
                          f"({s[f'best_{x}_share_of_clairvoyant']:.0%} of the bound)" for x in prefixes)
              + f"; Heuristic {s['heuristic_gain']:+.1%}; clairvoyant {s['clairvoyant_gain']:+.1%}")
        for prefix, folds in s.get("heldout", {}).items():
            print(f"   held-out {prefix}: " + ", ".join(f"{f['chosen']} vs {f['chosen_fixed']} {f['gain']:+.1%}"
                                                       for f in folds))
    for source, v in result["validation"].items():
        if source == "outputs_from":
            differs = [name for name, verdict in v["same_runs_as_source"].items() if verdict != "equal"]
            print(f"outputs of {v['result']}: match reproduced on {v['match_reproduced']}/{v['outputs']}; runs of "
                  f"policies both replayed: {'all equal' if not differs else 'differ: ' + ', '.join(differs)}")
            continue
        print(f"validation on {source}: {v['steps_equal']}/{v['runs_compared']} runs with equal steps, "
              f"{v['steps_and_drafted_equal']} also equal drafted; "
              + ", ".join(f"{k} {v[k]:.2f}" for k in v if k.endswith("spearman")))


def main() -> None:
    args = parse_args()
    if args.retime and args.costs_from:
        rescore(args)
        return
    if args.retime:
        retime(args)
        return
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    source_result = None
    if args.outputs_from:  # the earlier replay decides the setting, the prompts and the cost model
        source_result = json.loads(Path(args.outputs_from).read_text())
        src_args = source_result["meta"]["args"]
        args.temperature, args.seed = src_args.get("temperature", 0.0), src_args.get("seed", 0)
        args.max_new_tokens, args.max_k = src_args["max_new_tokens"], src_args["max_k"]
        args.prompts = max(len(outs) for outs in source_result["outputs"].values())
        args.measured = ""
    sampled = args.temperature > 0
    sampling = SamplingParams(temperature=args.temperature)
    rule = ExponentialRace(seed=args.seed) if sampled else None
    pipe = Pipeline.from_specs("target", "draft", dtype="float32")
    heads = {}
    for label, path in parse_heads(args.head).items():
        heads[label] = load_head(path, draft_name="draft")
        heads[label].check_draft(pipe.draft_model, "the default draft")
    measured = {"records": []}
    if args.measured and not sampled:
        measured = json.loads(Path(args.measured).read_text())
    known = {}
    for rec in measured["records"]:
        if rec["temperature"] == 0:
            known.setdefault(rec["prompt_id"], rec["tokens"])
    stored = {}  # prompt id -> the earlier replay's output record (--outputs-from)
    if source_result is not None:
        stored = {o["prompt_id"]: o for outs in source_result["outputs"].values() for o in outs}
        known = {pid: o["tokens"] for pid, o in stored.items()}
    loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench}
    prompts = {ds: [(p.id, pipe.encode_messages(p.messages)) for p in loaders[ds](args.prompts)] for ds in loaders}

    # one cost model for every replay: forwards after a real prompt
    ctx = prompts["humaneval"][0][1]
    if source_result is not None:
        cost = stored_step_cost(source_result["meta"])
    elif args.step_cost_from:  # forward times do not depend on the temperature or the rule
        sc = json.loads(Path(args.step_cost_from).read_text())["meta"]["step_cost"]
        cost = StepCost(target=tuple(sc["target_by_tokens"]), draft=sc["draft"])
    else:
        cost = measure_step_cost(pipe.target, pipe.draft, ctx, args.max_k, repeats=args.repeats)
    print(f"step cost: target {['%.3f' % t for t in cost.target]}  draft {cost.draft:.4f}", flush=True)

    factories = policy_factories(args, heads, args.max_k)
    propose = race_proposer(args.seed, sampling) if sampled else None
    outputs: dict[str, list[dict]] = {ds: [] for ds in prompts}
    replays: dict[str, dict] = {}
    generated: list[dict] = []  # timed engine runs (sd, K = 4) for the overhead fit without measured records
    # datasets interleaved (humaneval 0, mtbench 0, humaneval 1, ...) so that --max-seconds cuts both evenly
    order = [(ds, item) for i in range(args.prompts) for ds, plist in prompts.items() if i < len(plist)
             for item in [plist[i]]]
    if stored:
        order = [(ds, item) for ds, item in order if item[0] in stored]
    for ds, (pid, ids) in order:
        if args.max_seconds and time.perf_counter() - t_start > args.max_seconds:
            print(f"--max-seconds {args.max_seconds:g} reached: {sum(map(len, outputs.values()))} outputs replayed",
                  flush=True)
            break
        t0 = time.perf_counter()
        source = stored[pid]["source"] if stored else "measured"
        tokens = known.get(pid)
        if tokens is None:
            source = "generated"
            out = generate(pipe.target, [ids], method="sd", drafter=ModelDrafter(pipe.draft, pipe.vocab_size),
                           rule=rule, policy=Constant(4), sampling=sampling, seed=args.seed,
                           max_new_tokens=args.max_new_tokens, eos_token_ids=pipe.eos_ids())
            tokens = out.sequences[0]
            bm = out.batch_metrics
            generated.append({"prompt_id": pid, "dataset": ds, "config": "fixed_k4", "steps": bm.steps,
                              "new_tokens": len(tokens),
                              "drafted": bm.drafted_tokens, "decode_seconds": bm.decode_seconds})
        table = draft_chains(pipe.draft, ids, tokens, factories, args.max_k, pipe.vocab_size,
                             propose=propose, rows=args.rows)
        if stored and table.match != stored[pid]["match"]:
            raise SystemExit(f"{pid}: the re-drafted chains do not reproduce the match of {args.outputs_from}")
        runs = replay_output(len(tokens), table, cost, args)
        replays[pid] = runs
        outputs[ds].append({"prompt_id": pid, "source": source, "new_tokens": len(tokens),
                            "tokens": list(tokens), "match": table.match, "runs": runs})
        print(f"[{time.perf_counter() - t_start:6.0f}s] {ds} {pid} ({source}, {len(tokens)} tokens, "
              f"{table.forwards} draft forwards, {time.perf_counter() - t0:.0f}s)", flush=True)

    # per-step overhead (sampling, bookkeeping, cache truncation): median of (measured - forwards-only
    # model) / steps over this run's generation runs, or over the measured fixed-K runs without them
    if source_result is not None:  # the earlier replay's fitted overhead, already in the cost
        sc = source_result["meta"]["step_cost"]
        fit_source = f"{args.outputs_from}: {sc.get('overhead_note', '')}"
        raw_overhead, overhead = sc.get("overhead_fit_before_clipping", cost.overhead), cost.overhead
    else:
        fit_on = generated or [r for r in measured["records"] if r["config"].startswith("fixed_k")]
        fit_source = "this run's generation runs (sd, K = 4)" if generated else "measured fixed-K runs"
        residuals = []
        for rec in fit_on:
            rep = replays.get(rec["prompt_id"], {}).get(rec["config"])
            if rep is not None:
                residuals.append((rec["decode_seconds"] - rep["seconds"]) / rec["steps"])
        raw_overhead = float(np.median(residuals)) if residuals else 0.0
        overhead = max(0.0, raw_overhead)
    cost = StepCost(target=cost.target, draft=cost.draft, overhead=overhead)
    for ds, outs in outputs.items():  # re-time with the overhead (step counts do not change)
        for o in outs:
            for name, r in o["runs"].items():
                r["seconds"] = sum(cost.step(k) for k in r["lengths"])
    print(f"per-step overhead fitted on the {fit_source}: {overhead * 1000:.1f} ms", flush=True)

    setting = f"ERSD at T = {args.temperature:g}" if sampled else "T = 0"
    prefixes = ["confidence", *heads]
    result = {
        "meta": {"script": "benchmarks/studies/replay_adaptive.py", "command": "python " + " ".join(sys.argv),
                 "args": vars(args), "torch": torch.__version__, "dtype": "float32", "setting": setting,
                 "machine": {**_lscpu(), "threads": args.threads},
                 "step_cost": {"target_by_tokens": list(cost.target), "draft": cost.draft,
                               "overhead_per_step": overhead, "overhead_fit_before_clipping": raw_overhead,
                               "overhead_note": f"median over the {fit_source} of (decode seconds - "
                                                "forwards-only model) / steps"},
                 "heads": {label: {"path": path, **heads[label].metadata.__dict__}
                           for label, path in parse_heads(args.head).items()},
                 "seconds": time.perf_counter() - t_start,
                 "note": f"step counts are exact replays of the engine ({setting}); seconds are modelled from "
                         "the measured forward times plus the fitted per-step overhead"},
        # the measured records of bench_adaptive.py predate the engine's cap of a step's draft by the
        # tokens left (the replay mirrors it), so against them only the steps must agree; this run's
        # generation runs are checked on steps and drafted tokens
        "validation": {"measured_records": validate(measured, replays),
                       "generation_runs": validate({"records": generated}, replays)}
        if source_result is None else
        {**source_result["validation"],
         "outputs_from": {"result": args.outputs_from, "outputs": sum(map(len, outputs.values())),
                          "match_reproduced": sum(map(len, outputs.values())),
                          "same_runs_as_source": same_runs(source_result, outputs)}},
        "summary": {ds: summarise(outs, prefixes) for ds, outs in outputs.items()},
        "generation_runs": generated,
        "outputs": outputs,
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    if plot_adaptive_replay(result["summary"], out_path.with_suffix(".png"), heads=list(heads), setting=setting):
        print(f"plot: {out_path.with_suffix('.png')}")
    report(result, prefixes)


if __name__ == "__main__":
    main()
