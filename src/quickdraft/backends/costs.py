"""What one speculative step costs on a backend: a target forward over ``m`` tokens and a draft
forward, measured on the runners themselves.

A step that drafts ``k`` tokens makes ``k`` draft forwards and one target forward over ``k + 1``
tokens. On a memory-bound target the second costs about one token's forward whatever ``k`` is; on
a compute-bound one (llama.cpp or OpenVINO on two AVX2 cores) it grows with ``k``, and a draft of
``k`` tokens pays only when it is accepted often enough. :class:`StepCost` holds the costs,
:func:`measure_step_cost` measures them; the exact replay of draft-length policies
(:mod:`quickdraft.adaptive.replay`) models decode time with them, and
:class:`quickdraft.decoding.policies.CostAware` drafts the length that maximises tokens per second
under them.

Measuring takes seconds (about 11 s for the default pair on llama.cpp on two AVX2 cores), so
:class:`CostCache` keeps what was measured in the model cache, keyed by :func:`cost_key`: the
machine (CPU model, the ISA extensions the runtimes dispatch on, cores) and what each runner says
decides its speed (``runner.cost_identity()``: weights file, weight format, runtime version,
threads, settings). A pipeline then measures once per machine, backend and pair.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Sequence

import torch

from quickdraft.errors import QuickdraftError


@dataclass(frozen=True)
class RowsCost:
    """The forward costs of a step over ``rows`` batch rows: ``target[m - 1]`` the target's forward
    over ``m`` tokens in every row (``rows x m`` tokens), ``draft`` the draft's over one token in
    every row."""

    rows: int
    target: tuple[float, ...]
    draft: float

    def __post_init__(self) -> None:
        if self.rows < 2 or not self.target or min(self.target) <= 0 or self.draft < 0:
            raise QuickdraftError(f"batch costs need rows >= 2, positive target times and a non-negative draft time, got {self}")


@dataclass(frozen=True)
class StepCost:
    """Seconds of one speculative step that drafts ``k`` tokens: ``k`` draft forwards, one target
    forward over ``k + 1`` tokens (the drafted ones and the token before them), plus ``overhead``.

    ``target[m - 1]`` is the target forward time over ``m`` tokens, ``m = 1 .. len(target)``, in
    one batch row. ``batched``: the same costs measured over more rows (:class:`RowsCost`, by rows
    ascending), for a step that decodes a batch: on a CPU a verification's extra tokens cost little
    in one row (the weights' memory traffic dominates) and a lot in sixteen (the batch already keeps
    the cores busy), so whether a draft pays depends on the batch.
    """

    target: tuple[float, ...]
    draft: float
    overhead: float = 0.0
    batched: tuple[RowsCost, ...] = ()

    def __post_init__(self) -> None:
        if not self.target or min(self.target) <= 0 or self.draft < 0 or self.overhead < 0:
            raise QuickdraftError(f"step cost needs positive target times and non-negative draft/overhead, got {self}")
        rows = [r.rows for r in self.batched]
        if rows != sorted(set(rows)) or any(len(r.target) < len(self.target) for r in self.batched):
            raise QuickdraftError(f"batch costs need distinct rows in ascending order, each over as many target "
                                  f"sizes as one row's ({len(self.target)}), got rows {rows}")

    @property
    def max_rows(self) -> int:
        """The most rows the costs were measured at."""
        return self.batched[-1].rows if self.batched else 1

    def step(self, k: int, rows: int = 1) -> float:
        """Seconds of a step drafting ``k`` tokens in each of ``rows`` rows. Between measured row
        counts the costs are interpolated linearly, beyond the largest extrapolated from the last two
        (never below the largest's); without batch costs every batch costs what one row does.

        >>> c = StepCost((1.0, 1.5), draft=0.5, batched=(RowsCost(3, (2.0, 4.0), 1.0),))
        >>> c.step(1), c.step(1, rows=3), c.step(1, rows=2), c.step(1, rows=5)
        (2.0, 5.0, 3.5, 8.0)
        """
        if not 1 <= k + 1 <= len(self.target):
            raise QuickdraftError(f"no target time for a {k + 1}-token verification (have 1..{len(self.target)})")
        if rows < 1:
            raise QuickdraftError(f"a step decodes at least one row, got {rows}")
        points = [(1, k * self.draft + self.target[k])]
        points += [(r.rows, k * r.draft + r.target[k]) for r in self.batched]
        if rows == 1 or len(points) == 1:
            return points[0][1] + self.overhead
        (r0, c0), (r1, c1) = next(((a, b) for a, b in zip(points, points[1:]) if rows <= b[0]), points[-2:])
        seconds = c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
        return (seconds if rows <= r1 else max(seconds, c1)) + self.overhead  # more rows never cost less

    def without_draft(self) -> "StepCost":
        """The same step for a drafter without a model (prompt lookup, retrieval): free drafts."""
        return dataclasses.replace(self, draft=0.0, batched=tuple(dataclasses.replace(r, draft=0.0)
                                                                  for r in self.batched))


def batch_grid(max_rows: int) -> tuple[int, ...]:
    """The row counts above one at which :func:`measure_step_cost` measures for batches of up to
    ``max_rows``: the powers of two up to the first that is at least ``max_rows``.

    >>> batch_grid(1), batch_grid(16), batch_grid(12)
    ((), (2, 4, 8, 16), (2, 4, 8, 16))
    """
    grid, rows = [], 2
    while max_rows > 1:
        grid.append(rows)
        if rows >= max_rows:
            break
        rows *= 2
    return tuple(grid)


def measure_step_cost(target, draft, context: Sequence[int], max_k: int, repeats: int = 5,
                      max_rows: int = 1) -> StepCost:
    """Median forward times after ``context``: the target over ``m = 1 .. max_k + 1`` tokens and the
    draft (a runner, or ``None``: cost 0) over one token, each rolled back after timing (so every one
    sees the same cache). The sizes are timed round-robin, ``repeats`` rounds after a warm-up, so a
    slow phase of the machine spreads over all. ``max_rows > 1`` also measures them with ``context``
    in each of the rows of :func:`batch_grid` (``StepCost.batched``): the context is prefilled once
    and forked into the rows (``select_rows``) where the runners can, else prefilled in every row.
    The runners are left holding ``context`` in one row."""
    if len(context) < max_k + 1:
        raise QuickdraftError(f"measure_step_cost needs a context of at least max_k + 1 = {max_k + 1} tokens")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise QuickdraftError(f"max_rows must be an integer >= 1, got {max_rows!r}")
    runners = [r for r in (target, draft) if r is not None]
    ctx = torch.tensor([list(context)])
    for runner in runners:
        _prefill(runner, ctx, 1)
    batched, held = [], 1  # the rows that hold the context (every timed forward is rolled back)
    for rows in batch_grid(max_rows) + (1,):  # one row last: the runners keep its context
        if rows != held:
            for runner in runners:
                if hasattr(runner, "select_rows"):
                    runner.select_rows([0] * rows)
                else:
                    _prefill(runner, ctx, rows)
            held = rows
        target_times, draft_time = _forward_times(target, draft, ctx.expand(rows, -1), max_k, repeats)
        if rows > 1:
            batched.append(RowsCost(rows, target_times, draft_time))
    return StepCost(target=target_times, draft=draft_time, batched=tuple(batched))


def _prefill(runner, ctx: torch.Tensor, rows: int) -> None:
    runner.reset(rows)
    runner.forward(ctx.expand(rows, -1).to(getattr(runner, "device", "cpu")), logits_to_keep=1)


def _forward_times(target, draft, ctx: torch.Tensor, max_k: int, repeats: int) -> tuple[tuple[float, ...], float]:
    """The timed rounds over the runners' current rows, which hold ``ctx`` (``[rows, L]``)."""
    base = torch.full((ctx.shape[0],), ctx.shape[1])

    def run(runner, m: int) -> float:
        block = ctx[:, -m:].to(getattr(runner, "device", "cpu"))
        t0 = time.perf_counter()
        runner.forward(block, logits_to_keep=m)
        seconds = time.perf_counter() - t0
        runner.truncate(base.to(runner.lengths.device))
        return seconds

    for runner in (r for r in (target, draft) if r is not None):  # warm-up
        run(runner, 1)
    target_times: list[list[float]] = [[] for _ in range(max_k + 1)]
    draft_times: list[float] = []
    for _ in range(repeats):
        for m in range(1, max_k + 2):
            target_times[m - 1].append(run(target, m))
        if draft is not None:
            draft_times.append(run(draft, 1))
    return tuple(median(t) for t in target_times), (median(draft_times) if draft_times else 0.0)


#: the file in the model cache (:func:`quickdraft.models.default_cache_dir`) that keeps measured step costs
COST_CACHE_FILE = "step_costs.json"

#: the ISA extensions the runtimes' CPU kernels dispatch on (``/proc/cpuinfo`` flag names)
ISA_FLAGS = frozenset({
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
})


def machine_identity(cpuinfo: str | None = None) -> dict:
    """The CPU model, its ISA extensions among :data:`ISA_FLAGS` and the cores this process may use.

    >>> info = "model name : AMD EPYC\\nflags : fpu sse2 avx fma avx2\\n"
    >>> {k: v for k, v in machine_identity(info).items() if k != "cores"}
    {'cpu': 'AMD EPYC', 'isa': ['avx', 'avx2', 'fma']}
    """
    from quickdraft.models import parse_cpu_flags

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model = next((value.strip() for key, sep, value in (line.partition(":") for line in cpuinfo.splitlines())
                  if sep and key.strip() == "model name"), None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model or platform.processor() or platform.machine(),
            "isa": sorted(ISA_FLAGS & parse_cpu_flags(cpuinfo)), "cores": cores}


def path_identity(path: str | os.PathLike[str]) -> dict | None:
    """A file's (or a directory's files') resolved path, sizes and modification times; ``None`` for
    a path that does not exist (a model built in memory)."""
    if not os.fspath(path):  # no name: Path("") would be the working directory
        return None
    path = Path(path).expanduser()
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    return {"path": str(path.resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def cost_key(target, draft) -> dict | None:
    """What a pipeline's step costs depend on: :func:`machine_identity` and each runner's
    ``cost_identity()``; ``None`` where a runner cannot say (a model without files): not cached."""
    key: dict = {"machine": machine_identity()}
    for name, runner in (("target", target), ("draft", draft)):
        if runner is None:
            key[name] = None
            continue
        identity = getattr(runner, "cost_identity", lambda: None)()
        if identity is None:
            return None
        key[name] = identity
    return key


def _files_exist(entry) -> bool:
    try:
        runners = [entry["key"][name] for name in ("target", "draft")]
        return all(r is None or Path(r["weights"]["path"]).exists() for r in runners)
    except (KeyError, TypeError):
        return False


class CostCache:
    """Measured :class:`StepCost` s in one JSON file, one entry per :func:`cost_key`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def default(cls) -> "CostCache":
        """The cache in the model cache directory (``$QUICKDRAFT_CACHE``, else ``~/.cache/quickdraft``)."""
        from quickdraft.models import default_cache_dir

        return cls(default_cache_dir() / COST_CACHE_FILE)

    @staticmethod
    def digest(key: dict) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def entries(self) -> dict[str, dict]:
        """Every entry by digest (``key``, ``target`` and ``draft`` seconds, ``measured_at``); an
        unreadable file reads as empty (it is measured again and rewritten)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: dict, max_k: int, max_rows: int = 1) -> StepCost | None:
        """The costs stored for ``key`` if they cover target forwards of ``max_k + 1`` tokens and
        batches of ``max_rows`` rows."""
        entry = self.entries().get(self.digest(key))
        try:
            if entry is None or entry["key"] != json.loads(json.dumps(key)):
                return None
            batched = tuple(RowsCost(int(r["rows"]), tuple(float(t) for t in r["target"]), float(r["draft"]))
                            for r in entry.get("batched", ()))
            cost = StepCost(target=tuple(float(t) for t in entry["target"]), draft=float(entry["draft"]),
                            batched=batched)
        except (KeyError, TypeError, ValueError, QuickdraftError):
            return None
        return cost if len(cost.target) >= max_k + 1 and cost.max_rows >= max_rows else None

    def put(self, key: dict, cost: StepCost) -> None:
        """Store ``cost`` for ``key`` (one atomic rewrite of the file); entries whose models' files
        are gone are dropped."""
        data = {digest: entry for digest, entry in self.entries().items() if _files_exist(entry)}
        data[self.digest(key)] = {
            "key": key, "target": list(cost.target), "draft": cost.draft,
            "batched": [{"rows": r.rows, "target": list(r.target), "draft": r.draft} for r in cost.batched],
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def clear(self) -> int:
        """Remove every entry; returns how many there were."""
        n = len(self.entries())
        self.path.unlink(missing_ok=True)
        return n
