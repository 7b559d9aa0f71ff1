"""E2E: ``make demo``'s program as a user runs it: it serves only llm and E+PD, says the model has random
weights, prints the verdict and exits 0 because epd gave llm's tokens."""
import re
import subprocess
import sys

import pytest

from backend.deploy.local_server import ROOT

pytestmark = pytest.mark.e2e


def test_demo_prints_a_verdict_and_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "clients.demo"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "random weights" in out and "llm, encoder, pd, epd" in out
    assert re.search(r"\[demo\] llm and epd gave the same 32 tokens: yes", out), out[-2000:]
    assert re.search(r"stages: items=1 encode_ms=[\d.]+ .*transfer_ms=[\d.]+", out), out[-2000:]
    ready = float(re.search(r"server ready in ([\d.]+) s", out).group(1))
    print(f"demo server ready in {ready:.1f} s")  # the figure docs/results/foundation.md quotes (measured, not asserted)
