"""The AIPerf benchmark's pure parts (clients.bench.aiperf): AIPerf's argv, its environment, the table row read from its
JSON summary export, the failure verdict and the missing-venv message. The exports under tests/data/aiperf/ were
written by real AIPerf 0.13.0 runs through the endpoint (README.md there says which); nothing here runs AIPerf."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from clients.bench.aiperf import (COLUMNS, aiperf_argv, aiperf_env, failures, parse_args, read_export, require_aiperf,
                                  row, table)

DATA = Path(__file__).resolve().parents[1] / "data" / "aiperf"


def export(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_argv_asks_for_what_the_options_say():
    args = parse_args(["--requests", "32", "--concurrency", "3", "--images", "2", "--image-size", "128",
                       "--image-format", "jpeg", "--input-len", "20", "--output-len", "8", "--warmup", "1"])
    argv = aiperf_argv("http://127.0.0.1:9000", "epd", args, Path("/tmp/a"), tokenizer=Path("/tok"),
                       aiperf=Path("/v/bin/aiperf"))
    assert argv[:2] == ["/v/bin/aiperf", "profile"] and "--streaming" in argv
    assert {k: flag(argv, k) for k in ("--model", "--url", "--endpoint-type", "--tokenizer", "--output-artifact-dir",
                                       "--zmq-host")} == {
        "--model": "epd", "--url": "http://127.0.0.1:9000", "--endpoint-type": "chat", "--tokenizer": "/tok",
        "--output-artifact-dir": "/tmp/a", "--zmq-host": "127.0.0.1"}
    assert [flag(argv, k) for k in ("--image-batch-size", "--image-width-mean", "--image-height-mean", "--image-format",
                                    "--prompt-input-tokens-mean", "--prompt-output-tokens-mean", "--concurrency",
                                    "--request-count", "--warmup-request-count", "--random-seed")] == [
        "2", "128", "128", "jpeg", "20", "8", "3", "32", "1", "0"]
    assert json.loads(flag(argv, "--extra-inputs")) == {"ignore_eos": True, "temperature": 0}
    assert "--warmup-request-count" not in aiperf_argv("http://h:1", "epd", parse_args(["--warmup", "0"]), Path("/a"))


def test_the_argv_is_the_same_for_every_model_but_the_model():
    args = parse_args([])
    llm, epd = (aiperf_argv("http://h:1", m, args, Path("/a")) for m in ("llm", "epd"))
    assert [a for a in llm if a != "llm"] == [a for a in epd if a != "epd"]


def test_the_environment_drops_the_offline_flags_and_our_pythonpath():
    env = aiperf_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": "/work", "PATH": "/bin"})
    assert env == {"PATH": "/bin", "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_a_row_reads_the_export_of_a_real_run():
    data = export("epd.json")
    r = row("epd", data)
    assert r["model"] == "epd" and r["requests"] == 64 and r["errors"] == 0
    assert r["req/s"] == data["request_throughput"]["avg"] > 0
    ttft = data["time_to_first_token"]
    assert r["TTFT p50 ms"] == ttft["p50"] <= r["TTFT p90 ms"] == ttft["p90"]
    assert r["ITL p50 ms"] == data["inter_token_latency"]["p50"] and r["e2e p50 ms"] == data["request_latency"]["p50"]
    assert data["time_to_first_token"]["unit"] == data["request_latency"]["unit"] == "ms"


def test_the_failed_requests_of_a_real_run_are_counted():
    data = export("mixed.json")  # 8 requests round-robin over llm and an unknown model: 4 answered, 4 got 404
    r = row("llm,nosuch", data)
    assert (r["requests"], r["errors"]) == (4, 4) == (r["requests"], sum(e["count"] for e in data["error_summary"]))
    assert data["error_summary"][0]["error_details"]["code"] == 404
    assert failures([r], 8) == ["llm,nosuch: 4 failed request(s)", "llm,nosuch: 4 of 8 requests completed"]
    assert not failures([row("epd", export("epd.json"))], 64)


def test_errors_come_from_the_error_summary_when_the_count_is_missing():
    r = row("m", {"request_count": {"avg": 3.0}, "error_summary": [{"error_details": {"code": 500}, "count": 2}]})
    assert (r["requests"], r["errors"]) == (3, 2)
    assert failures([r], 3) == ["m: 2 failed request(s)"]
    assert failures([{**r, "errors": 0}], 5) == ["m: 3 of 5 requests completed"]


def test_the_table_has_one_row_per_model_and_dashes_for_missing_values(tmp_path):
    (tmp_path / "profile_export_aiperf.json").write_text((DATA / "epd.json").read_text())
    rows = [read_export("epd", tmp_path), row("llm", {"request_count": {"avg": 1.0}})]
    lines = table(rows).splitlines()
    assert lines[0] == "| model | " + " | ".join(COLUMNS) + " |" and len(lines) == 4
    assert lines[2].startswith("| epd | 64 | 0 | ") and lines[3] == "| llm | 1 | 0 | - | - | - | - | - |"


def test_a_missing_export_names_the_directory(tmp_path):
    with pytest.raises(RuntimeError, match=str(tmp_path)):
        read_export("epd", tmp_path)


def test_a_missing_venv_names_the_setup_script(tmp_path):
    with pytest.raises(SystemExit, match="scripts/setup_aiperf.sh"):
        require_aiperf(tmp_path / "bin" / "aiperf")
