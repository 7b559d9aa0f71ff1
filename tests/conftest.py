import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest

from tests.timeline import ran


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up (module and session servers starting), call and teardown of each test, timed (tests.timeline)."""
    with ran(item.nodeid):
        yield


def pytest_terminal_summary(terminalreporter):
    """Where the run's time went, per test file (its tests' set-up, call and teardown, module servers included):
    the files that cost most first (docs/results/ci-time.md)."""
    from tests.timeline import by_file

    files = by_file()
    if not files:
        return
    terminalreporter.section("time per test file")
    total = sum(seconds for _, seconds, _ in files)
    for name, seconds, count in files[:30]:
        terminalreporter.write_line(f"{seconds:8.1f} s {seconds / total:6.1%} {count:5d} tests  {name}")
    terminalreporter.write_line(f"{total:8.1f} s in all, {len(files)} files")
