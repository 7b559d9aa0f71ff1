"""``backend.deploy.stacks``: py-spy's native stacks of a live process (what the harness prints for a straggler
before it kills it), and the report going into the output and the log."""
import subprocess
import sys

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
