"""The house's shape. import-linter holds it (``[tool.importlinter]`` in pyproject.toml: the layers from
backend.protocol up to frontend, the server importing no client, test or developers' tool, Triton imported only in
backend.triton, no import circles inside a package); these tests run it, so ``make test`` fails on a broken contract
with the offending import chain. And what import-linter cannot see: ``model_repository/<model>/1/model.py`` is not
an importable package, so its imports are checked here."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("backend", "orchestrator", "frontend", "clients", "devtools", "tests")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with the project's contracts on the packages under ``root``."""
    argv = [str(Path(sys.executable).with_name("lint-imports")), "--config", str(ROOT / "pyproject.toml"), "--no-cache"]
    return subprocess.run(argv, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
                          timeout=300)


def _python_only(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or os.path.isdir(os.path.join(folder, n)))]


def test_the_house_keeps_its_contracts():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_contracts_see_a_violation(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=_python_only)
    (tmp_path / "backend" / "protocol" / "bad.py").write_text("import triton_python_backend_utils as pb_utils\n"
                                                             "from backend.engine.serving import ResponseChunk\n")
    (tmp_path / "orchestrator" / "bad.py").write_text("from clients.triton_client import generate\n")
    (tmp_path / "backend" / "request" / "media_back.py").write_text("from backend.request import generate\n")
    (tmp_path / "backend" / "request" / "media.py").write_text(
        (ROOT / "backend" / "request" / "media.py").read_text() + "\nfrom backend.request import media_back\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    for chain in ("backend.protocol.bad -> backend.engine.serving", "orchestrator.bad -> clients.triton_client",
                  "backend.protocol.bad -> triton_python_backend_utils", "No cycles are allowed in backend.request"):
        assert chain in done.stdout, done.stdout


def imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def test_model_entry_points_import_only_the_boundary():
    for path in (ROOT / "model_repository").glob("*/1/model.py"):
        modules = imports(path)
        assert modules and all(m.startswith("backend.triton.models.") for m in modules), (path, modules)
