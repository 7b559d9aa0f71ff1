"""The house's shape: which folder may import which (model_repository -> backend/triton -> ensemble -> the stage
folders -> backend/protocol), Triton imported only at its boundary, server code never importing the clients."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRITON = ("triton_python_backend_utils", "tritonclient")

# package -> the project packages its modules may import (besides their own). Server code is backend/ and ensemble/.
ALLOWED = {
    "backend.protocol": set(),
    "backend.request": {"backend.protocol"},
    "backend.encode": {"backend.protocol", "backend.request"},
    "backend.transfer": {"backend.protocol"},
    "backend.engine": {"backend.protocol", "backend.request", "backend.transfer"},
    "backend.deploy": {"backend.protocol"},
    "ensemble": {"backend.protocol", "backend.request", "backend.encode", "backend.engine"},
    "backend.triton": {"backend.protocol", "backend.request", "backend.encode", "backend.engine", "backend.transfer",
                       "backend.deploy", "ensemble"},
}


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "backend" else parts[0]


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted([*root.glob("backend/**/*.py"), *root.glob("ensemble/**/*.py")]):
        where = path.relative_to(root)
        if where.parts == ("backend", "__init__.py"):
            continue
        package = package_of(".".join(where.with_suffix("").parts))
        if package not in ALLOWED:
            found.append(f"{where}: package {package} is not in the house's layer table")
            continue
        for line, module in imports(path):
            top = module.split(".")[0]
            if top in TRITON and package != "backend.triton":
                found.append(f"{where}:{line} imports {module} outside backend/triton")
            elif top in ("clients", "tests"):
                found.append(f"{where}:{line} (server code) imports {module}")
            elif top in ("backend", "ensemble"):
                target = package_of(module)
                if target != package and target not in ALLOWED[package]:
                    found.append(f"{where}:{line}: {package} may not import {target} ({module})")
    return found


def test_the_house_keeps_its_layers():
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path):
    (tmp_path / "backend" / "protocol").mkdir(parents=True)
    (tmp_path / "ensemble").mkdir()
    (tmp_path / "backend" / "protocol" / "bad.py").write_text("import triton_python_backend_utils as pb_utils\n"
                                                             "from backend.engine.serving import Outcome\n")
    (tmp_path / "ensemble" / "bad.py").write_text("from clients.triton_client import generate\n")
    assert violations(tmp_path) == [
        "backend/protocol/bad.py:1 imports triton_python_backend_utils outside backend/triton",
        "backend/protocol/bad.py:2: backend.protocol may not import backend.engine (backend.engine.serving)",
        "ensemble/bad.py:1 (server code) imports clients.triton_client",
    ]


def test_model_entry_points_import_only_the_boundary():
    for path in (ROOT / "model_repository").glob("*/1/model.py"):
        modules = [module for _, module in imports(path)]
        assert modules and all(m.startswith("backend.triton.models.") for m in modules), (path, modules)
