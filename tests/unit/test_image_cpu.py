"""``clients.tools.image_cpu`` on the CPU: rows per mode and format, threads' CPU read from /proc, the pixel
cap replaced in a linked copy of the checkpoint (the GPU modes run on the H200: scripts/gpu_image.sh cpu)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from clients.tools import image_cpu

ROOT = Path(__file__).resolve().parents[2]


def test_thread_cpu_names_this_process_threads():
    threads = image_cpu.thread_cpu()
    assert threads and all(seconds >= 0 for seconds in threads.values())


def test_a_linked_copy_caps_pixels_where_asked(tmp_path):
    model = ROOT / "models" / "tiny-qwen2-vl"
    where = Path(image_cpu.with_max_pixels(str(model), 12845056, str(tmp_path / "big")))
    assert json.loads((where / "preprocessor_config.json").read_text())["size"]["longest_edge"] == 12845056
    assert (where / "config.json").resolve() == (model / "config.json").resolve()


def test_main_measures_the_cpu_mode_here(tmp_path, monkeypatch):
    import backend.engine.host

    monkeypatch.setattr(backend.engine.host, "prepare_process", lambda: None)  # no process-wide settings in pytest
    out = tmp_path / "rows.json"
    before = set(Path(tempfile.gettempdir()).glob("epd-image-cpu-*"))
    rows = image_cpu.main([str(ROOT / "models" / "tiny-qwen2-vl"), "--device", "cpu", "--dtype", "float32",
                           "--size", "64", "--batch", "2", "--repeats", "1", "--formats", "JPEG", "--json", str(out),
                           "--max-pixels", "200704"])
    assert [(r.mode, r.fmt) for r in rows] == [("cpu", "JPEG")]  # no CUDA: the GPU modes are left out
    assert rows[0].cpu_ms_per_image > 0 and json.loads(out.read_text())[0]["mode"] == "cpu"
    assert set(Path(tempfile.gettempdir()).glob("epd-image-cpu-*")) <= before  # the capped checkpoint is removed
