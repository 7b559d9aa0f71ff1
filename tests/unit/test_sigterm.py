"""``with TritonServer()`` stops its server when the process gets SIGTERM (``timeout``, ``kill``): the handler
``backend.deploy.local_server._exit_on_sigterm`` installs turns the signal into SystemExit, so ``finally`` and ``__exit__``
run (on the H200 a benchmark cut short by ``timeout`` left four vLLM engines holding 87 GiB)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from backend.deploy.local_server import ROOT


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_sigterm_runs_the_cleanup_and_exits_143():
    done = _run("""
        import os, signal, time
        from backend.deploy.local_server import _exit_on_sigterm
        assert _exit_on_sigterm() is signal.SIG_DFL
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print("not interrupted")
        finally:
            print("cleaned up")
    """)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stdout.split() == ["cleaned", "up"]


def test_a_handler_already_set_is_left_alone():
    done = _run("""
        import signal
        from backend.deploy.local_server import _exit_on_sigterm
        mine = lambda *a: None
        signal.signal(signal.SIGTERM, mine)
        assert _exit_on_sigterm() is None
        assert signal.getsignal(signal.SIGTERM) is mine
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
