"""``clients.bench.side_profile``: process labels, CPU per request per process, py-spy's raw stacks summarised, the
per-process table (no server, no py-spy)."""
import os
import subprocess
import sys
from collections import Counter

from clients.bench import side_profile, side_table


def test_frame_names_drop_lines_and_keep_the_file():
    assert side_profile.frame_name("send (backend/triton/io.py:120)") == "send (triton/io.py)"
    assert side_profile.frame_name("<module> (x.py:1)") == "<module> (x.py)"
    assert side_profile.frame_name("odd frame") == "odd frame"


def test_raw_stacks_are_read_and_summarised(tmp_path):
    raw = tmp_path / "p.txt"
    raw.write_text("main (a/m.py:1);loop (a/l.py:5);send (a/s.py:9) 30\n"
                   "main (a/m.py:1);loop (a/l.py:6);parse (a/p.py:2) 10\n"
                   "main (a/m.py:1);loop (a/l.py:5);send (a/s.py:10) 20\n")
    stacks = side_profile.read_raw(raw)
    assert sum(stacks.values()) == 60 and len(stacks) == 2  # lines of one function merged
    summary = side_profile.summarise(stacks, cpu_ms_per_request=6.0)
    assert summary["samples"] == 60
    assert summary["self"][0] == ("send (a/s.py)", round(50 / 60, 4), 5.0)
    assert summary["self"][1] == ("parse (a/p.py)", round(10 / 60, 4), 1.0)
    assert ("main (a/m.py)", 1.0, 6.0) in summary["inclusive"]
    assert "| `send (a/s.py)` | 83% | 5.0 |" in side_profile.report("x", {"stub llm": summary})


def test_recursion_counts_a_frame_once_in_inclusive():
    summary = side_profile.summarise(Counter({("f (a.py)", "f (a.py)", "g (b.py)"): 4}), None)
    assert dict((n, s) for n, s, _ in summary["inclusive"]) == {"f (a.py)": 1.0, "g (b.py)": 1.0}


def test_cpu_by_process_labels_and_sums():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me, start_me = os.getpid(), side_table.read_stat(os.getpid())[1]
        start_child = side_table.read_stat(child.pid)[1]
        before = {"g": {(me, start_me): 1.0}}
        after = {"g": {(me, start_me): 1.5, (child.pid, start_child): 0.25}}
        mine, its = side_profile.label(me), side_profile.label(child.pid)
        assert mine and its
        per = side_profile.by_process(before, after, requests=10)["g"]
        # the child counts from 0; processes of one name are summed
        assert per == ({mine: 75.0} if mine == its else {mine: 50.0, its: 25.0})
        assert list(per.values()) == sorted(per.values(), reverse=True)
    finally:
        child.kill()
        child.wait()
    assert side_profile.label(child.pid) == ""  # gone


def test_labels_of_the_stacks_processes(monkeypatch, tmp_path):
    def fake(argv, comm="python3"):
        def read(pid):
            return argv, comm
        return read
    cases = {("/opt/tritonserver/bin/tritonserver", "--model-repository", "/r"): "tritonserver",
             ("/x/triton_python_backend_stub", "/r/llm/1/model.py", "x"): "stub llm",
             ("VLLM::EngineCore",): "EngineCore",
             (sys.executable, "-m", "frontend.openai", "--port", "1"): "openai endpoint",
             (sys.executable, "/elsewhere/disagg_epd_proxy.py"): "proxy",
             (sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"): "api server"}
    for argv, want in cases.items():
        monkeypatch.setattr(side_profile, "_identity", fake(list(argv)))
        assert side_profile.label(1) == want, argv


def test_the_process_table_lists_each_rows_processes():
    rows = [{"name": "llm", "protocol": "grpc", "concurrency": 16, "cpu_by_process": {"tritonserver group": {"EngineCore": 9.0,
                                                                                         "stub llm": 5.5}}}]
    text = side_table.process_cpu_table(rows)
    assert "| llm | grpc | 16 | EngineCore 9.0, stub llm 5.5 |" in text
