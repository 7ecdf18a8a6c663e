"""The sandbox contains what a code model can get wrong, and the canonical solutions all pass."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from quickdraft.evaluation import sandbox
from quickdraft.evaluation.datasets import load_humaneval_problems
from quickdraft.evaluation.sandbox import (
    SandboxLimits,
    isolation_mode,
    run_humaneval_check,
    run_humaneval_checks,
    run_program,
    sandbox_info,
)

NAMESPACES = isolation_mode() == "namespaces"
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="needs `unshare` namespaces (root)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="fork-bomb containment via RLIMIT_NPROC needs root")

FAST = SandboxLimits(timeout=2.0)


def sandbox_processes() -> list[int]:
    """PIDs of live processes running under one of the sandbox's private uids."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        real_uid = int(uid_line.split()[1])
        if sandbox._UID_BASE <= real_uid < sandbox._UID_BASE + sandbox._UID_SPAN:
            found.append(int(entry.name))
    return found


def test_isolation_mode_here_is_namespaces():
    # This machine runs the tests as root with util-linux's unshare; the strong mode must be active.
    if os.geteuid() == 0 and Path("/usr/bin/unshare").exists():
        assert NAMESPACES


def test_passing_failing_and_erroring_programs():
    problem = {"test": "def check(candidate):\n    assert candidate(2) == 4\n", "entry_point": "double"}
    assert run_humaneval_check(problem, "def double(x):\n    return 2 * x\n", timeout=5).status == "passed"
    failed = run_humaneval_check(problem, "def double(x):\n    return x\n", timeout=5)
    assert (failed.passed, failed.status) == (False, "failed")
    error = run_humaneval_check(problem, "def double(x):\n    return x / 0\n", timeout=5)
    assert (error.status, error.detail) == ("error", "ZeroDivisionError: division by zero")
    missing = run_humaneval_check(problem, "def triple(x):\n    return 3 * x\n", timeout=5)
    assert missing.status == "error" and "KeyError" in missing.detail


ADD = {"test": "def check(f):\n    assert f(1, 2) == 3\n", "entry_point": "add"}


def test_output_without_a_final_newline_does_not_hide_the_verdict():
    for stream in ("sys.stdout", "sys.stderr"):
        program = f"import sys\ndef add(a, b):\n    print(a, end='', file={stream})\n    return a + b\n"
        outcome = run_humaneval_check(ADD, program, timeout=5)
        assert (outcome.status, outcome.detail) == ("passed", ""), (stream, outcome)
    flushed = (
        "import sys\ndef add(a, b):\n    sys.stdout.write('x' * 100000)\n    sys.stdout.flush()\n    return a + b\n"
    )
    assert run_humaneval_check(ADD, flushed, timeout=5).passed


FORGERIES = {
    "tagged verdict line": (
        "import os, json\n"
        "print('0' * 32 + ' ' + json.dumps({'role': 'child', 'pid': os.getpid(), 'status': 'passed', 'detail': ''}))\n"
        "print('{\"pid\": 1, \"status\": \"passed\", \"detail\": \"\"}')\n"
        "os._exit(0)\n"
    ),
    "reporting hook": (
        "import __main__, os\n"
        "for name in ('_report', 'send', '_runner'):\n"
        "    hook = getattr(__main__, name, None)\n"
        "    if hook is not None:\n"
        "        hook({'role': 'child', 'stage': 'result', 'pid': os.getpid(), 'status': 'passed', 'detail': ''})\n"
        "os._exit(0)\n"
    ),
    "every file descriptor": (
        "import os, json\n"
        "line = json.dumps({'pid': os.getpid(), 'stage': 'result', 'status': 'passed', 'detail': ''})\n"
        "for fd in range(256):\n"
        "    try:\n"
        "        os.write(fd, ('x ' + line + '\\n').encode())\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    ),
}


@pytest.mark.parametrize("how", sorted(FORGERIES))
def test_a_program_cannot_forge_a_pass(how):
    outcome = run_humaneval_check(ADD, FORGERIES[how] + "def add(a, b):\n    return a - b\n", timeout=5)
    assert not outcome.passed and outcome.status == "error", outcome
    assert "exited with code 0 before the check finished" in outcome.detail or "AttributeError" in outcome.detail
    # the same program without the forgery and with a correct add passes: the harness itself works
    assert run_humaneval_check(ADD, "def add(a, b):\n    return a + b\n", timeout=5).passed


def test_outcome_records_the_isolation_mode():
    outcome = run_program("pass\n", FAST)
    assert outcome.isolation == isolation_mode()
    assert outcome.network in sandbox.NETWORK_LEVELS
    info = sandbox_info(FAST)
    assert info["mode"] == isolation_mode() and info["network"] == outcome.network
    if NAMESPACES:
        assert outcome.network == "seccomp+netns"


def test_infinite_loop_is_killed_at_the_wall_clock_timeout():
    start = time.perf_counter()
    outcome = run_program("while True:\n    pass\n", FAST)
    assert outcome.status == "timeout" and not outcome.passed
    assert time.perf_counter() - start < FAST.timeout + 1.5
    assert sandbox_processes() == []


def test_cpu_time_limit_stops_a_busy_loop_before_the_wall_clock():
    # A generous wall clock (the machine is shared), so only the CPU limit can end this run early.
    outcome = run_program("while True:\n    pass\n", SandboxLimits(timeout=30.0, cpu_seconds=1))
    assert outcome.status == "timeout" and "CPU" in outcome.detail, outcome
    assert outcome.elapsed < 30.0


def test_memory_bomb_fails_with_memory_error():
    for bomb in ("x = bytearray(8 << 30)\n", "x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n"):
        outcome = run_program(bomb, SandboxLimits(timeout=10.0, memory_bytes=512 << 20))
        assert outcome.status == "error" and outcome.detail.startswith("MemoryError"), outcome
        assert outcome.elapsed < 10.0


@needs_root
def test_fork_bomb_is_capped_by_nproc():
    counter = (
        "import os, time\nforks = 0\n"
        "try:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n"
        "        forks += 1\n"
        "except OSError:\n    pass\n"
        "raise RuntimeError(f'forks={forks}')\n"
    )
    outcome = run_program(counter, SandboxLimits(timeout=5.0, max_processes=4))
    assert outcome.detail == "RuntimeError: forks=3"  # 4 processes: the runner and 3 children
    assert sandbox_processes() == []  # the sleeping children died with the sandbox


@needs_root
def test_fork_bomb_that_ignores_errors_is_killed_and_leaves_nothing():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    outcome = run_program(bomb, FAST)
    assert outcome.status == "timeout" and not outcome.passed
    assert sandbox_processes() == []


@needs_namespaces
def test_child_escaping_the_process_group_dies_with_the_namespace():
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(120)\n"
    outcome = run_program(escape, FAST)
    assert outcome.passed  # the parent finished normally ...
    time.sleep(0.2)
    assert sandbox_processes() == []  # ... and its setsid'd child was killed anyway


@needs_namespaces
def test_network_is_unreachable_from_the_sandbox():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3).sendall(b'hi')\n"
        # Negative control: the same code outside the sandbox does reach the listener.
        exec(compile(connect, "<control>", "exec"), {})
        conn, _ = server.accept()
        conn.close()

        outcome = run_program(connect, FAST)
        assert outcome.status == "error" and "Permission denied" in outcome.detail, outcome
        with pytest.raises(socket.timeout):
            server.accept()  # nothing arrived from the sandbox

    public = run_program("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)\n", FAST)
    assert not public.passed and "Permission denied" in public.detail
    dns = run_program("import socket\nsocket.getaddrinfo('pypi.org', 443)\n", FAST)
    assert not dns.passed and "gaierror" in dns.detail


def test_huge_file_write_fails_and_leaves_no_trace_on_the_host():
    name = f"quickdraft-sandbox-test-{uuid.uuid4().hex}"
    program = f"with open('/tmp/{name}', 'wb') as fh:\n    fh.write(b'x' * (64 << 20))\n"
    outcome = run_program(program, SandboxLimits(timeout=10.0, file_bytes=1 << 20))
    assert outcome.status == "error" and "File too large" in outcome.detail
    if NAMESPACES:
        assert not Path(f"/tmp/{name}").exists()  # it went to the sandbox's private tmpfs


def test_environment_is_empty_and_user_is_unprivileged(monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_SECRET", "do-not-leak")
    checks = (
        "import os\n"
        "assert 'QUICKDRAFT_SECRET' not in os.environ and 'PATH' not in os.environ, dict(os.environ)\n"
        "assert set(os.environ) <= {'LC_CTYPE'}, dict(os.environ)\n"  # PEP 538 may coerce the locale
        "assert os.listdir('.') == []\n"  # a fresh working directory
        "open('scratch.txt', 'w').write('ok')\n"
    )
    if os.geteuid() == 0:
        checks += "assert os.getuid() != 0 and os.geteuid() != 0\n"
        checks += (
            "try:\n    open('/etc/quickdraft-probe', 'w')\nexcept OSError:\n    pass\n"
            "else:\n    raise SystemExit('wrote /etc')\n"
        )
    outcome = run_program(checks, FAST)
    assert outcome.passed, outcome
    assert not Path("/etc/quickdraft-probe").exists()


def test_all_164_canonical_solutions_pass_in_parallel():
    problems = load_humaneval_problems()
    assert len(problems) == 164
    start = time.perf_counter()
    outcomes = run_humaneval_checks([(p, p["prompt"] + p["canonical_solution"]) for p in problems], workers=2)
    elapsed = time.perf_counter() - start
    failures = [(p["task_id"], o) for p, o in zip(problems, outcomes) if not o.passed]
    assert failures == []
    print(f"\n164/164 canonical solutions passed in {elapsed:.1f} s with 2 workers")
    assert sandbox_processes() == []


def test_bare_stubs_fail_negative_control():
    problems = load_humaneval_problems()[:16]
    outcomes = run_humaneval_checks([(p, p["prompt"]) for p in problems], workers=2)
    assert not any(o.passed for o in outcomes)
    assert {o.status for o in outcomes} <= {"failed", "error"}


def test_outcomes_keep_job_order_and_report_progress():
    problem = {"test": "def check(candidate):\n    assert candidate() == 1\n", "entry_point": "f"}
    jobs = [(problem, f"def f():\n    return {i % 2}\n") for i in range(6)]
    seen = []
    outcomes = run_humaneval_checks(jobs, workers=2, timeout=5, on_done=lambda i, o: seen.append(i))
    assert [o.passed for o in outcomes] == [False, True] * 3
    assert sorted(seen) == list(range(6))


@pytest.fixture
def basic_mode(monkeypatch):
    """Force the fallback used where namespaces are unavailable."""
    monkeypatch.setattr(sandbox, "_detect_isolation", lambda: "basic")


def test_basic_mode_still_limits_and_blocks(basic_mode):
    assert run_program("open('scratch', 'w').write('ok')\n", FAST).passed
    net = run_program("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n", FAST)
    assert net.status == "error" and ("Permission denied" in net.detail or "unreachable" in net.detail), net
    assert net.isolation == "basic"
    big = run_program("open('big', 'wb').write(b'x' * (8 << 20))\n", SandboxLimits(timeout=5.0, file_bytes=1 << 20))
    assert big.status == "error" and "File too large" in big.detail
    assert run_program("while True:\n    pass\n", FAST).status == "timeout"


@needs_root
def test_basic_mode_kills_escaped_children_by_uid(basic_mode):
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(120)\n"
    assert run_program(escape, FAST).passed
    assert sandbox_processes() == []
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    assert run_program(bomb, FAST).status == "timeout"
    assert sandbox_processes() == []


@pytest.fixture
def basic_mode_without_root(monkeypatch):
    """The basic mode as an unprivileged caller gets it: no private uid, no namespaces."""
    monkeypatch.setattr(sandbox, "_detect_isolation", lambda: "basic")
    monkeypatch.setattr(sandbox, "_is_root", lambda: False)


@pytest.fixture
def host_writable_dir():
    """A world-writable directory on the host outside the usual temporary directories."""
    parent = Path("/var/cache")
    if not parent.is_dir() or os.geteuid() != 0:
        pytest.skip("needs root and /var/cache")
    path = parent / f"quickdraft-sandbox-test-{uuid.uuid4().hex}"
    path.mkdir()
    path.chmod(0o1777)
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


@needs_namespaces
def test_every_writable_path_is_private_to_the_run(host_writable_dir):
    name = f"quickdraft-sandbox-test-{uuid.uuid4().hex}"
    targets = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock", str(host_writable_dir)]
    program = (
        "import os\nwritten = []\n"
        f"for d in {targets!r}:\n"
        "    try:\n"
        f"        open(os.path.join(d, {name!r}), 'w').write('x')\n"
        "        written.append(d)\n"
        "    except OSError:\n"
        "        pass\n"
        "assert written == ['/tmp', '/var/tmp', '/dev/shm', '/run/lock'], written\n"
    )
    outcome = run_program(program, FAST)
    assert outcome.passed, outcome  # the temporary directories are writable, the rest is read-only ...
    for target in targets:
        assert not Path(target, name).exists(), target  # ... and nothing reached the host


@needs_namespaces
def test_total_bytes_written_is_bounded_by_the_private_tmpfs():
    program = "for i in range(64):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
    outcome = run_program(program, SandboxLimits(timeout=10.0, file_bytes=2 << 20, disk_bytes=8 << 20))
    assert outcome.status == "error" and "No space left on device" in outcome.detail, outcome


def _unix_listener(directory: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX)
    path = directory / f"qd-{uuid.uuid4().hex[:12]}.sock"
    server.bind(str(path))
    path.chmod(0o777)
    server.listen(1)
    server.settimeout(0.3)
    return server


@pytest.mark.parametrize("mode", ["default", "basic", "basic-without-root"])
def test_host_unix_sockets_are_unreachable(mode, monkeypatch, host_writable_dir):
    if mode != "default":
        monkeypatch.setattr(sandbox, "_detect_isolation", lambda: "basic")
    if mode == "basic-without-root":
        monkeypatch.setattr(sandbox, "_is_root", lambda: False)
    directories = [Path("/run/lock"), host_writable_dir]
    servers = [_unix_listener(d) for d in directories if os.access(d, os.W_OK)]
    try:
        for server in servers:
            path = server.getsockname()
            connect = f"import _socket\ns = _socket.socket(_socket.AF_UNIX)\ns.connect({path!r})\ns.send(b'hi')\n"
            # Negative control: the same code outside the sandbox reaches the listener.
            exec(compile(connect, "<control>", "exec"), {})
            server.accept()[0].close()
            outcome = run_program(connect, FAST)
            assert not outcome.passed and "Permission denied" in outcome.detail, (path, outcome)
            with pytest.raises(socket.timeout):
                server.accept()
    finally:
        for server in servers:
            os.unlink(server.getsockname())
            server.close()


@pytest.mark.parametrize("without_root", [False, True])
def test_basic_mode_blocks_raw_sockets_to_a_host_listener(basic_mode, monkeypatch, without_root):
    if without_root:
        monkeypatch.setattr(sandbox, "_is_root", lambda: False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.3)
        port = server.getsockname()[1]
        raw = f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\ns.send(b'hi')\n"
        exec(compile(raw, "<control>", "exec"), {})  # negative control
        server.accept()[0].close()
        outcome = run_program(raw, FAST)
        assert not outcome.passed and "Permission denied" in outcome.detail, outcome
        assert (outcome.isolation, outcome.network) == ("basic", "seccomp")
        with pytest.raises(socket.timeout):
            server.accept()


def _wait_gone(pid: int, seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True  # dead, waiting for a parent outside the sandbox to reap it
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("ending", ["returns", "times out"])
def test_basic_mode_without_root_leaves_no_process_behind(basic_mode_without_root, tmp_path, ending):
    pids = tmp_path / "pids"
    program = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        f"            open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "            time.sleep(120)\n"
        "        os._exit(0)\n"
        "time.sleep(0.5)\n"
        + ("while True:\n    pass\n" if ending == "times out" else "")
    )
    outcome = run_program(program, FAST)
    assert outcome.status == ("passed" if ending == "returns" else "timeout"), outcome
    escaped = [int(line) for line in pids.read_text().split()]
    assert len(escaped) == 3
    assert all(_wait_gone(pid) for pid in escaped), escaped


THREADED = {
    "test": "def check(f):\n    assert f(list(range(40))) == sum(x * x for x in range(40))\n",
    "entry_point": "sum_squares",
}
THREADED_SOLUTIONS = {
    "threading": (
        "import threading\n"
        "def sum_squares(xs):\n"
        "    barrier = threading.Barrier(8)\n"  # all 8 threads alive at once
        "    out = [0] * 8\n"
        "    def work(i):\n"
        "        barrier.wait()\n"
        "        out[i] = sum(x * x for x in xs[i::8])\n"
        "    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]\n"
        "    for t in threads:\n"
        "        t.start()\n"
        "    for t in threads:\n"
        "        t.join()\n"
        "    return sum(out)\n"
    ),
    "ThreadPoolExecutor": (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "import threading\n"
        "def sum_squares(xs):\n"
        "    barrier = threading.Barrier(8)\n"
        "    def work(x):\n"
        "        if x < 8:\n"
        "            barrier.wait()\n"
        "        return x * x\n"
        "    with ThreadPoolExecutor(max_workers=8) as pool:\n"
        "        return sum(pool.map(work, xs))\n"
    ),
}


@pytest.mark.parametrize("mode", ["default", "basic"])
@pytest.mark.parametrize("how", sorted(THREADED_SOLUTIONS))
def test_threaded_solutions_pass(how, mode, monkeypatch):
    if mode == "basic":
        monkeypatch.setattr(sandbox, "_detect_isolation", lambda: "basic")
    outcome = run_humaneval_check(THREADED, THREADED_SOLUTIONS[how], timeout=10)
    assert outcome.passed, outcome


@needs_root
@pytest.mark.parametrize("mode", ["default", "basic"])
def test_fork_bomb_is_contained_within_the_timeout_at_default_limits(mode, monkeypatch):
    if mode == "basic":
        monkeypatch.setattr(sandbox, "_detect_isolation", lambda: "basic")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.perf_counter()
    outcome = run_program(bomb, FAST)
    assert outcome.status == "timeout", outcome
    assert time.perf_counter() - start < FAST.timeout + 3.0
    assert sandbox_processes() == []


def test_bad_limits_are_rejected_with_the_field_name():
    for field, value in (("max_processes", 0), ("disk_bytes", 0), ("cpu_seconds", 0), ("timeout", 0)):
        with pytest.raises(sandbox.QuickdraftError, match=field):
            SandboxLimits(**{field: value})


@needs_root
def test_basic_mode_as_root_removes_what_the_run_left_in_shared_temporary_directories(basic_mode):
    name = f"quickdraft-sandbox-test-{uuid.uuid4().hex}"
    targets = [d for d in sandbox._SHARED_TMP_DIRS if os.path.isdir(d)]
    program = (
        "import os\n"
        f"for d in {targets!r}:\n"
        f"    open(os.path.join(d, {name!r}), 'w').write('x')\n"
        f"    os.makedirs(os.path.join(d, {name!r} + '.dir', 'sub'))\n"
    )
    try:
        outcome = run_program(program, FAST)
        assert outcome.passed, outcome  # the writes happened on the host ...
        for target in targets:  # ... and were removed after the run
            assert not Path(target, name).exists() and not Path(target, name + ".dir").exists(), target
    finally:
        for target in targets:
            Path(target, name).unlink(missing_ok=True)
            shutil.rmtree(Path(target, name + ".dir"), ignore_errors=True)


UNPRIVILEGED_CHECKS = r"""
import json, os, socket, sys, time
from quickdraft.evaluation.sandbox import SandboxLimits, isolation_mode, run_humaneval_check, run_program
limits = SandboxLimits(timeout=3.0)
result = {"uid": os.getuid(), "mode": isolation_mode()}
with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    raw = run_program(f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\n", limits)
    result["raw_socket"] = [raw.status, raw.detail, raw.network]
    try:
        server.accept()
        result["listener_reached"] = True
    except socket.timeout:
        result["listener_reached"] = False
problem = {"test": "def check(f):\n    assert f(1, 2) == 3\n", "entry_point": "add"}
result["no_newline"] = run_humaneval_check(problem, "def add(a, b):\n    print(a, end='')\n    return a + b\n").status
start = time.perf_counter()
bomb = run_program("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", limits)
result["fork_bomb"] = [bomb.status, time.perf_counter() - start]
pidfile = os.path.join(sys.argv[1], "orphan")
escape = f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    open({pidfile!r}, 'w').write(str(os.getpid()))\n    time.sleep(60)\ntime.sleep(0.3)\n"
result["escape"] = run_program(escape, limits).status
result["orphan"] = int(open(pidfile).read())
print(json.dumps(result))
"""


@needs_root
def test_basic_mode_as_an_unprivileged_user():
    # The real unprivileged path (no uid change, no namespaces): run the checks as `nobody`.
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs util-linux setpriv")
    shared = Path(tempfile.mkdtemp(prefix="quickdraft-sandbox-test-"))
    shared.chmod(0o777)
    src = Path(sandbox.__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", UNPRIVILEGED_CHECKS,
             str(shared)],
            env={"PYTHONPATH": str(src), "PATH": os.environ.get("PATH", "")}, cwd="/", capture_output=True,
            text=True, timeout=120,
        )
        if done.returncode != 0 and "Permission denied" in done.stderr:
            pytest.skip(f"the interpreter or the sources are not readable by nobody: {done.stderr[-300:]}")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert (result["uid"], result["mode"]) == (65534, "basic")
    assert result["raw_socket"][0] == "error" and "Permission denied" in result["raw_socket"][1]
    assert result["raw_socket"][2] == "seccomp" and result["listener_reached"] is False
    assert result["no_newline"] == "passed"
    assert result["fork_bomb"][0] == "timeout" and result["fork_bomb"][1] < 3.0 + 4.0
    assert result["escape"] == "passed"
    assert _wait_gone(result["orphan"]), "the setsid'd grandchild outlived the sandbox"
