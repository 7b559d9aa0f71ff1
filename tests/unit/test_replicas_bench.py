"""The replica benchmark's (``clients.bench.replicas``) pure parts: its arguments, the closed loop's concurrency, the
check of answers against the first deployment's, the split over pd replicas and the table (a full run starts two
multi-host deployments in network namespaces: minutes, so it is not run here; docs/benchmarks.md has the command and a
run's table)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from backend.protocol.generate import GenerateInputs
from clients.bench.replicas import check, closed_loop, parse_args, split, table
from clients.bench.report import Sample, summarise
from clients.triton_client import GenerateError, GenerateResult
from tests.hosts_deploy import hosts_e_pd


def test_the_defaults_are_the_issue_s_load():
    args = parse_args([])
    assert (args.replicas, args.requests, args.concurrency, args.max_tokens, args.warmup) == ([1, 2], 64, 16, 64, 4)
    assert args.image_sizes == [(64, 48), (80, 64), (96, 96), (112, 112)]
    assert parse_args(["--replicas", "2,1,3", "--image-sizes", "10x20"]).replicas == [2, 1, 3]


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "1,1"], "--replicas"), (["--replicas", "0,2"], "--replicas"), (["--replicas", "two"], "--replicas"),
    (["--requests", "0"], "--requests"), (["--concurrency", "33"], "at most 32"), (["--max-tokens", "0"], "--max-tokens"),
    (["--warmup", "-1"], "--warmup"), (["--image-sizes", "64"], "--image-sizes"), (["--image-sizes", "0x5"], "--image-sizes")])
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_topologies_differ_only_in_their_pd_hosts(tmp_path):
    one, two = hosts_e_pd(tmp_path, 1), hosts_e_pd(tmp_path, 2)
    assert sorted(one.hosts) == ["encode-1", "front", "pd-1"]
    assert sorted(two.hosts) == ["encode-1", "front", "pd-1", "pd-2"]
    assert two.hosts["pd-2"].grpc == "10.77.0.5:8001" and two.hosts["pd-2"].stages == ("pd",)
    assert {k: v for k, v in two.hosts.items() if k != "pd-2"} == one.hosts
    with pytest.raises(ValueError, match="pd_replicas"):
        hosts_e_pd(tmp_path, 0)


def test_the_closed_loop_keeps_at_most_concurrency_in_flight_and_returns_outcomes_in_request_order():
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def serve(inputs):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        threading.Event().wait(0.01)
        with lock:
            state["now"] -= 1
        return inputs.prompt

    requests = [GenerateInputs(prompt=f"r{i}") for i in range(20)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes, wall = closed_loop(lambda inputs: pool.submit(serve, inputs), requests, 3)
    assert outcomes == [f"r{i}" for i in range(20)]
    assert state["most"] == 3 and wall > 0


def _answer(text: str, replica: str, tokens: int = 4) -> GenerateResult:
    return GenerateResult(text=text, num_output_tokens=tokens, ttft=0.1, total=0.5, timings={"pd_replica": replica})


def test_a_different_answer_or_a_failed_request_is_an_error_and_no_sample():
    reference = [_answer("a", "10.77.0.4:8001"), _answer("b", "10.77.0.4:8001"), _answer("c", "10.77.0.4:8001")]
    got = [_answer("a", "10.77.0.5:8001"), _answer("b!", "10.77.0.4:8001"), GenerateError("503", "stage pd lost")]
    samples, errors = check(got, reference)
    assert [s.index for s in samples] == [0]
    assert errors[0].startswith("request 1: answer differs") and errors[1] == "request 2: [503] stage pd lost"
    assert check([_answer("a", "x", tokens=5)], reference[:1])[1][0].startswith("request 0: answer differs")
    first, none = check(reference, None)  # the first deployment: nothing to compare with
    assert len(first) == 3 and none == []


def test_the_split_names_each_pd_host_and_counts_an_unknown_address_under_itself():
    samples = [Sample(0.1, 0.2, 4, {"pd_replica": a}) for a in ["10.77.0.4:8001"] * 3 + ["10.77.0.9:8001"]]
    replicas = {"10.77.0.4:8001": "pd-1", "10.77.0.5:8001": "pd-2"}
    assert split(samples, replicas) == {"pd-1": 3, "pd-2": 0, "10.77.0.9:8001": 1}


def test_the_table_puts_the_deployments_side_by_side():
    rows = []
    for n, replicas in ((1, ["10.77.0.4:8001"] * 4), (2, ["10.77.0.4:8001", "10.77.0.5:8001"] * 2)):
        samples = [Sample(0.1 * (i + 1), 1.0 * (i + 1), 64, {"pd_replica": a}) for i, a in enumerate(replicas)]
        row = summarise(str(n), "concurrency", 16, samples, n - 1, 2.0)
        row["pd_split"] = split(samples, {"10.77.0.4:8001": "pd-1", "10.77.0.5:8001": "pd-2"})
        row["cpu_s"] = {"front": 0.5, "pd-1": 1.5, "client": 1.0, "machine": 3.8}
        rows.append(row)
    lines = table(rows).splitlines()
    assert lines[0].startswith("| pd replicas | req/s | TTFT p50 / p90 ms | total p50 / p90 ms | errors |")
    assert lines[2] == ("| 1 | 2.00 | 250 / 370 | 2500 / 3700 | 0 | pd-1 4, pd-2 0 | front 0.50, pd-1 1.50, client 1.00 "
                        "| 1.50 / 1.90 |")
    assert lines[3].startswith("| 2 | 2.00 | 250 / 370 | 2500 / 3700 | 1 | pd-1 2, pd-2 2 |")
