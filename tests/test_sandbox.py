"""The sandbox contains what a code model can get wrong, and the canonical solutions all pass."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from quickdraft import sandbox
from quickdraft.datasets import load_humaneval_problems
from quickdraft.sandbox import SandboxLimits, isolation_mode, run_humaneval_check, run_humaneval_checks, run_program

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


def test_printed_output_cannot_fake_a_pass():
    fake = 'print(\'{"pid": 1, "status": "passed", "detail": ""}\')\nimport os\nos._exit(0)\n'
    outcome = run_program(fake, FAST)
    assert outcome.status == "error" and "before the check finished" in outcome.detail


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
        assert outcome.status == "error" and "unreachable" in outcome.detail.lower(), outcome
        with pytest.raises(socket.timeout):
            server.accept()  # nothing arrived from the sandbox

    public = run_program("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)\n", FAST)
    assert not public.passed and "unreachable" in public.detail.lower()
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
            "try:\n    open('/etc/quickdraft-probe', 'w')\nexcept PermissionError:\n    pass\n"
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
    assert net.status == "error" and "unreachable" in net.detail.lower()
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
