"""Token trees vs chain speculative decoding vs target alone, and the cost of verifying M tree nodes.

On the default pair (--dtype auto: bf16 only on a CPU with native bf16, else fp32; the JSON records
the dtype the weights actually have) and the first --limit HumanEval prompts (as chat), in one
process:

1. ``forward_cost``: one forward over M = 1 … 64 new tokens after a prompt, for the target and the
   draft, (a) as a *tree* (a random recursive tree: node i's parent drawn uniformly among nodes
   0 … i-1, fed through :meth:`ModelRunner.forward_tree` with its ancestor mask and per-node
   positions) and (b) as a *chain* (a plain causal :meth:`ModelRunner.forward` of M tokens).
   One warm-up round is discarded; then --repeats rounds, each visiting every (model, shape, M) in
   turn (interleaved, so machine drift hits all sizes alike); the median is reported.
2. ``runs``: per prompt and temperature (--temperatures), every method once, interleaved prompt by
   prompt (machine drift hits every method alike) with the method order rotated by one each prompt:

   * ``ar``                  target alone
   * ``sd-k{K}``             chain speculative decoding with the draft model, K drafts (--ks)
   * ``tree-N{N}-d{d}-k{k}-{scheme}-{verifier}``  token trees (--trees0 at T = 0, --trees at T > 0)

Terms as in :mod:`quickdraft.decoding.metrics`: a *step* is one verifying target forward; the *mean
acceptance length* (MAL) is emitted tokens per step and counts the bonus/recovered token. Tokens/s
is decode only (prefill excluded), the same for every method. The time spent inside each model's
forwards during decoding is measured by wrapping the runners' ``forward`` / ``forward_tree``
(prefill forwards excluded), so a step splits into target, draft and everything else (tree
building, verification, Python). At T = 0 every lossless method must reproduce the target's own
greedy output (``ar``): ``greedy_check`` in the JSON lists, per method, the prompts whose output is
identical and the first differing position otherwise. A k-token (or tree) forward does not round
exactly like k one-token forwards (other matmul shapes; much more so in bf16), so a near-tie of
the two best logits may flip — a difference is a rounding near-tie or a bug, to be looked at.

The JSON (--out) is rewritten atomically after the forward-cost part and after every method run,
with ``complete: false`` until the end; the summary pools only the prompts on which every method
of that temperature has run, so a killed job leaves a consistent partial result. It records the
command, the machine (CPU, threads, load averages before, during and after the run) and the dtype.

    python benchmarks/bench_tree.py --limit 5 --max-new-tokens 64 --temperatures 0 0.7 \\
        --repeats 3 --max-seconds 1080 --out benchmarks/results/tree_humaneval.json

Run it alone on the machine (the shared lock): every number is a wall-clock time. --max-seconds
caps the job: no prompt is started that would likely end past it (estimated from the mean time of
the prompts so far); ``prompts`` in the JSON lists the prompts actually run.
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

import torch

from quickdraft.evaluation.datasets import load_humaneval
from quickdraft.pipeline import Pipeline
from quickdraft.decoding.policies import Constant
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams
from quickdraft.decoding.tree import TreeConfig, ancestor_mask
from quickdraft.decoding.tree_decoding import generate_tree

#: trees as "N:d:k:scheme:verifier" (budget N draft nodes, depth d, top-k k); at T = 0 the walk
#: follows the target's argmax, so only the (deterministic) topk scheme runs there
TREES_T0 = ["8:4:2:topk:rrs", "16:5:3:topk:rrs", "32:6:4:topk:rrs"]
#: at T > 0: the same three topk trees with RRS, and sampled children with K-SEQ and the optimal greedy verifier
TREES_T = [
    "8:4:2:topk:rrs",
    "16:5:3:topk:rrs",
    "32:6:4:topk:rrs",
    "16:5:3:with_replacement:kseq",
    "16:5:3:greedy:optimal_greedy",
]


def parse_tree(spec: str) -> tuple[int, int, int, str, str]:
    """``"N:d:k:scheme:verifier"`` -> ``(N, d, k, scheme, verifier)``."""
    parts = spec.split(":")
    if len(parts) != 5:
        raise SystemExit(f"tree spec {spec!r} must be N:d:k:scheme:verifier")
    return int(parts[0]), int(parts[1]), int(parts[2]), parts[3], parts[4]


def tree_name(n: int, d: int, k: int, scheme: str, verifier: str) -> str:
    return f"tree-N{n}-d{d}-k{k}-{scheme}-{verifier}"


class ForwardClock:
    """Accumulate the wall time of a runner's forwards, excluding the first forward after ``reset``
    (the prefill). Wraps the instance's ``reset``, ``forward`` and ``forward_tree``."""

    def __init__(self, runner: ModelRunner) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._prefill_next = False
        for name in ("forward", "forward_tree"):
            setattr(runner, name, self._timed(getattr(runner, name)))
        reset = runner.reset

        def timed_reset(batch_size: int) -> None:
            reset(batch_size)
            self._prefill_next = True

        runner.reset = timed_reset

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self._prefill_next:
                self._prefill_next = False
            else:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
            return out

        return wrapper

    def take(self) -> tuple[float, int]:
        """Seconds and calls since the last ``take``."""
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def random_tree(m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths ``[1, m]`` and ancestor mask ``[1, m, m]`` of a random recursive tree of ``m`` nodes."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, m)]
    depths = [0]
    for i in range(1, m):
        depths.append(depths[parents[i]] + 1)
    return torch.tensor([depths]), ancestor_mask(torch.tensor([parents]))


def forward_cost(pipe: Pipeline, prompt: list[int], sizes: list[int], repeats: int, seed: int) -> list[dict]:
    """Median seconds of one forward over ``m`` new tokens (tree or chain) after ``prompt``, per model."""
    gen = torch.Generator().manual_seed(seed)
    runners = {"target": pipe.target, "draft": pipe.draft}
    times: dict[tuple[str, str, int], list[float]] = {}
    depth_of: dict[int, int] = {}
    for rnd in range(repeats + 1):  # round 0 is a discarded warm-up
        for name, runner in runners.items():
            runner.reset(1)
            runner.forward(torch.tensor([prompt]), logits_to_keep=1)
            base = runner.lengths.clone()
            for m in sizes:
                tokens = torch.randint(0, min(1000, pipe.vocab_size), (1, m), generator=gen)
                depths, mask = random_tree(m, gen)
                depth_of[m] = max(depth_of.get(m, 0), int(depths.max()))
                for shape in ("tree", "chain"):
                    if shape == "tree":
                        runner.begin_tree()
                        t0 = time.perf_counter()
                        runner.forward_tree(tokens, depths, mask)
                        dt = time.perf_counter() - t0
                        runner.commit_tree(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
                    else:
                        t0 = time.perf_counter()
                        runner.forward(tokens, logits_to_keep=m)
                        dt = time.perf_counter() - t0
                        runner.truncate(base)
                    if rnd:
                        times.setdefault((name, shape, m), []).append(dt)
    out = []
    for (name, shape, m), ts in times.items():
        out.append({
            "model": name, "shape": shape, "nodes": m, "max_tree_depth": depth_of[m] if shape == "tree" else m - 1,
            "median_seconds": statistics.median(ts), "seconds": ts,
        })
    for row in out:  # relative to the same model's one-token forward (same shape)
        one = next(r for r in out if r["model"] == row["model"] and r["shape"] == row["shape"] and r["nodes"] == sizes[0])
        row["relative_to_first"] = row["median_seconds"] / one["median_seconds"]
    return out


def complete_rows(rows: list[dict], temperature: float, names: list[str]) -> list[dict]:
    """Rows at ``temperature`` of the prompts on which every method in ``names`` has run."""
    sel_t = [r for r in rows if r["temperature"] == temperature]
    done: dict[str, set[str]] = {}
    for r in sel_t:
        done.setdefault(r["prompt"], set()).add(r["method"])
    full = {p for p, methods in done.items() if set(names) <= methods}
    return [r for r in sel_t if r["prompt"] in full]


def summarize(rows: list[dict], temperatures: list[float], names_for, ks: list[int]) -> list[dict]:
    """Per (temperature, method): pooled rates over the complete prompts, ratios vs ``ar`` of the same run."""
    summary = []
    for temperature in temperatures:
        names = names_for(temperature)
        sel_t = complete_rows(rows, temperature, names)
        if not sel_t:
            continue
        ar_rows = [r for r in sel_t if r["method"] == "ar"]
        ar_tps = sum(r["new_tokens"] for r in ar_rows) / sum(r["decode_seconds"] for r in ar_rows)
        for name in names:
            sel = [r for r in sel_t if r["method"] == name]
            tokens = sum(r["new_tokens"] for r in sel)
            seconds = sum(r["decode_seconds"] for r in sel)
            steps = sum(r["steps"] for r in sel)
            target_s = sum(r["target_decode_forward_seconds"] for r in sel)
            draft_s = sum(r["draft_decode_forward_seconds"] for r in sel)
            entry = {
                "temperature": temperature, "method": name, "prompts": len(sel), "new_tokens": tokens,
                "tokens_per_second": tokens / seconds,
                "speedup_vs_ar": tokens / seconds / ar_tps,
                # emitted tokens per verification step over all prompts (counts the bonus token)
                "mean_acceptance_length": sum(r["emitted_tokens"] for r in sel) / steps,
                "steps": steps,
                "target_forwards": sum(r["target_forwards"] for r in sel),
                "target_forwards_per_token": sum(r["target_forwards"] for r in sel) / tokens,
                "draft_forwards": sum(r["draft_forwards"] for r in sel),
                "drafted_tokens_per_step": sum(r["drafted_tokens"] for r in sel) / steps,
                "ms_per_step": 1000 * seconds / steps,
                "target_ms_per_step": 1000 * target_s / steps,
                "draft_ms_per_step": 1000 * draft_s / steps,
                "other_ms_per_step": 1000 * (seconds - target_s - draft_s) / steps,
            }
            if temperature == 0:
                for ref in ("ar", f"sd-k{ks[0]}"):
                    ref_ids = {r["prompt"]: r["new_ids"] for r in sel_t if r["method"] == ref}
                    entry[f"identical_to_{ref}"] = sum(r["new_ids"] == ref_ids[r["prompt"]] for r in sel)
                    entry[f"first_difference_vs_{ref}"] = [first_difference(r["new_ids"], ref_ids[r["prompt"]]) for r in sel]
            summary.append(entry)
    return summary


def greedy_check(rows: list[dict], names: list[str]) -> dict:
    """At T = 0: per method, whether each complete prompt's output equals target-alone greedy (``ar``)."""
    sel = complete_rows(rows, 0.0, names)
    ref = {r["prompt"]: r["new_ids"] for r in sel if r["method"] == "ar"}
    methods = {}
    for name in names:
        if name == "ar":
            continue
        mine = [r for r in sel if r["method"] == name]
        diffs = {r["prompt"]: first_difference(r["new_ids"], ref[r["prompt"]]) for r in mine
                 if r["new_ids"] != ref[r["prompt"]]}
        methods[name] = {"prompts": len(mine), "identical": len(mine) - len(diffs), "first_difference": diffs}
    return {
        "reference": "ar",
        "prompts": len(ref),
        "all_identical": bool(ref) and all(m["identical"] == m["prompts"] for m in methods.values()),
        "methods": methods,
    }


def machine_info(threads: int) -> dict:
    """CPU model, native bf16 support, cores and threads (the load averages are sampled separately)."""
    from quickdraft.models import _cpu_has_native_bf16

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(), "cpu": cpu, "native_bf16": _cpu_has_native_bf16(),
        "cpu_count": os.cpu_count(), "threads": threads, "torch": torch.__version__,
    }


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (``None`` where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; ``None`` if the lists are equal, the shorter length if
    one is a proper prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(args: argparse.Namespace, pipe: Pipeline | None = None) -> dict:
    """The whole benchmark; ``pipe`` (default: loaded from --target/--draft/--dtype) is for smoke tests."""
    torch.set_num_threads(args.threads)
    load_before = load_average()
    t0 = time.perf_counter()
    if pipe is None:
        pipe = Pipeline.from_specs(args.target, args.draft, dtype=args.dtype)
    load_seconds = time.perf_counter() - t0
    dtypes = {name: str(next(r.model.parameters()).dtype).removeprefix("torch.")
              for name, r in (("target", pipe.target), ("draft", pipe.draft))}
    machine = machine_info(args.threads)
    load_samples: list[dict] = []
    problems = load_humaneval(args.limit)
    prompt_ids = [pipe.encode_messages(p.messages) for p in problems]
    eos = pipe.eos_ids()
    trees0 = [parse_tree(s) for s in args.trees0]
    trees = [parse_tree(s) for s in args.trees]

    cost = forward_cost(pipe, prompt_ids[0], args.sizes, args.repeats, args.seed)
    load_samples.append({"after": "forward_cost", "load_average": load_average()})
    for name in ("target", "draft"):
        for shape in ("tree", "chain"):
            print(f"forward cost {name} {shape}:",
                  {c["nodes"]: round(c["median_seconds"], 3) for c in cost if c["model"] == name and c["shape"] == shape},
                  flush=True)

    clocks = {"target": ForwardClock(pipe.target), "draft": ForwardClock(pipe.draft)}

    def one(method: str, spec, ids: list[int], sampling: SamplingParams, seed: int, max_new: int):
        if spec is not None:
            n, d, k, scheme, verifier = spec
            out = generate_tree(
                pipe.target, pipe.draft, [ids], config=TreeConfig(d, k, n, scheme), verifier=verifier,
                sampling=sampling, max_new_tokens=max_new, seed=seed, eos_token_ids=eos,
            )
            return out.batch_metrics, out.sequences[0]
        kk = int(method.split("-k")[1]) if method.startswith("sd") else 4
        res = pipe.generate(
            [""], prompt_ids=[ids], method="ar" if method == "ar" else "sd", policy=Constant(kk),
            sampling=sampling, max_new_tokens=max_new, seed=seed,
        )
        return res.metrics, res.completions[0].token_ids

    def methods_for(temperature: float) -> list[tuple[str, tuple | None]]:
        specs = trees0 if temperature == 0 else trees
        return ([("ar", None)] + [(f"sd-k{k}", None) for k in args.ks]
                + [(tree_name(*s), s) for s in specs])

    # warm-up: every method once on a few tokens (first calls allocate and pick kernels), discarded
    for temperature in args.temperatures:
        for method, spec in methods_for(temperature):
            one(method, spec, prompt_ids[0], SamplingParams(temperature=temperature), args.seed, args.warmup_tokens)
    for c in clocks.values():
        c.take()

    rows: list[dict] = []
    started = time.perf_counter()
    prompts_run = 0

    def result(complete: bool) -> dict:
        names_for = lambda t: [n for n, _ in methods_for(t)]  # noqa: E731
        return {
            "command": "python benchmarks/bench_tree.py " + " ".join(args.argv),
            "complete": complete,
            "machine": machine,
            "load_average": {"before": load_before, "samples": load_samples, "now": load_average()},
            "models": {"target": args.target, "draft": args.draft, "dtype_option": args.dtype, "dtype": dtypes},
            "prompts": [p.id for p in problems[:prompts_run]],
            "prompts_requested": args.limit,
            "load_seconds": load_seconds,
            "bench_seconds": time.perf_counter() - started,
            "max_new_tokens": args.max_new_tokens,
            "temperatures": args.temperatures,
            "methods": {str(t): names_for(t) for t in args.temperatures},
            "forward_cost": cost,
            "greedy_check": greedy_check(rows, names_for(0.0)) if 0.0 in args.temperatures else None,
            "summary": summarize(rows, args.temperatures, names_for, args.ks),
            "rows": rows,
        }

    write_json(args.out, result(complete=False))  # the forward costs survive a killed job

    for pi, ids in enumerate(prompt_ids):
        elapsed = time.perf_counter() - t0  # since the start of the job (model load included)
        if args.max_seconds and pi and elapsed + (time.perf_counter() - started) / pi > args.max_seconds:
            print(f"stopping after {pi} prompts: {elapsed:.0f} s used, another prompt would pass "
                  f"--max-seconds {args.max_seconds:.0f}", flush=True)
            break
        prompts_run += 1
        for temperature in args.temperatures:
            sampling = SamplingParams(temperature=temperature)
            methods = methods_for(temperature)
            shift = pi % len(methods)  # rotate the order so no method always runs first
            for method, spec in methods[shift:] + methods[:shift]:
                m, seq = one(method, spec, ids, sampling, args.seed + pi, args.max_new_tokens)
                target_s, target_calls = clocks["target"].take()
                draft_s, draft_calls = clocks["draft"].take()
                row = {
                    "temperature": temperature, "prompt": problems[pi].id, "method": method,
                    "new_tokens": m.new_tokens, "decode_seconds": m.decode_seconds,
                    "tokens_per_second": m.tokens_per_second, "mean_acceptance_length": m.mean_acceptance_length,
                    "steps": m.steps, "emitted_tokens": m.emitted_tokens,
                    "target_forwards": m.target_forwards, "draft_forwards": m.draft_forwards,
                    "drafted_tokens": m.drafted_tokens, "accepted_tokens": m.accepted_tokens,
                    "acceptance_rate_by_position": m.acceptance_rate_by_position,
                    "target_decode_forward_seconds": target_s, "target_decode_forward_calls": target_calls,
                    "draft_decode_forward_seconds": draft_s, "draft_decode_forward_calls": draft_calls,
                    "new_ids": seq,
                }
                rows.append(row)
                write_json(args.out, result(complete=False))  # a killed job keeps every finished run
                print(f"T={temperature} {problems[pi].id} {method:36s} {m.new_tokens:4d} tok "
                      f"{m.tokens_per_second:5.2f} tok/s  MAL {m.mean_acceptance_length:4.2f}  "
                      f"step {1000 * m.decode_seconds / max(m.steps, 1):4.0f} ms "
                      f"(target {1000 * target_s / max(m.steps, 1):4.0f}, draft {1000 * draft_s / max(m.steps, 1):4.0f})",
                      flush=True)
        load_samples.append({"after": problems[pi].id, "load_average": load_average()})
    return result(complete=True)


def write_json(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file, then a rename)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="target")
    parser.add_argument("--draft", default="draft")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 6], help="chain draft lengths")
    parser.add_argument("--trees0", nargs="*", default=TREES_T0, help="trees at T = 0, N:d:k:scheme:verifier")
    parser.add_argument("--trees", nargs="*", default=TREES_T, help="trees at T > 0, N:d:k:scheme:verifier")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-tokens", type=int, default=8, help="tokens per method in the discarded warm-up")
    parser.add_argument("--max-seconds", type=float, default=0.0,
                        help="do not start another prompt if the job would then likely run longer (0: no limit)")
    parser.add_argument("--out", default="benchmarks/results/tree_humaneval.json")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    result = run(args)
    write_json(args.out, result)
    print(json.dumps(result["summary"], indent=1))
    check = result["greedy_check"]
    if check is not None:
        print(f"greedy check (T = 0, vs ar on {check['prompts']} prompts): "
              f"{'all identical' if check['all_identical'] else 'DIFFERENCES'}",
              {m: f"{c['identical']}/{c['prompts']}" for m, c in check["methods"].items()}, flush=True)


if __name__ == "__main__":
    main()
