"""``backend.deploy.stacks``: py-spy's native stacks of a live process (what the harness prints for a straggler
before it kills it), and the report going into the output and the log."""
import subprocess
import sys
import time

from backend.deploy.stacks import native_stacks, report_native_stacks


def test_a_sleeping_process_s_stacks_name_its_frames(tmp_path, capsys):
    code = "import time\ndef napping():\n    print('in', flush=True)\n    time.sleep(60)\nnapping()"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "in"  # in napping, about to sleep
        text = native_stacks(child.pid)
        assert f"--pid {child.pid}" in text and "napping" in text, text
        log = tmp_path / "server.log"
        report_native_stacks([child.pid], log)
        assert "napping" in capsys.readouterr().out and "napping" in log.read_text()
    finally:
        child.kill()
        child.wait()


def test_gdb_shows_a_native_process_s_threads(tmp_path):
    """``gdb_stacks``: tritonserver is no Python process, so py-spy cannot read it; gdb names its threads' C frames
    (``keep`` filters the threads by a frame; skipped where there is no gdb: the harness then logs nothing)."""
    import shutil

    import pytest

    from backend.deploy.stacks import gdb_stacks

    if shutil.which("gdb") is None:
        pytest.skip("no gdb on this machine")
    child = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)
        text = gdb_stacks(child.pid)
        assert f"gdb -p {child.pid}, 1 of 1 threads" in text and "#0" in text, text
        assert "0 of 1 threads" in gdb_stacks(child.pid, keep="no such frame")
    finally:
        child.kill()
        child.wait()
