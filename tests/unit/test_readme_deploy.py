"""The README's deployment commands (several hosts, Kubernetes), run as a user runs them: each must succeed and write
what it says (the request commands are tests/e2e/test_readme.py's)."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
COMMANDS = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S)
            for line in block.splitlines()
            if "backend.deploy.topology hosts" in line or "backend.deploy.kubernetes" in line]


def test_the_readme_shows_both_deployment_commands():
    assert len(COMMANDS) == 2, COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_deployment_command_works(command, tmp_path):
    argv = [str(tmp_path / "out") if re.fullmatch(r"/tmp/\S+", arg) else arg for arg in shlex.split(command)]
    argv[0] = str(ROOT / argv[0])  # .venv/bin/python of this checkout
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    if "kubernetes" in command:
        assert "kustomization.yaml" in written and "valid against the Kubernetes" in done.stdout
    else:
        assert written == ["encode-1", "front", "pd-1"] and done.stdout.count("tritonserver --model-repository") == 3
