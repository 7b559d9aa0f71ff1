"""``clients.tools.openai_http_floor``: the endpoint's application with a backend that answers at once, beside a bare
Starlette SSE app, driven by the benchmark's own client; both answer every request in full ([DONE] after 16
pieces), and the figures are real times (the run is short: this checks the tool, not the figures)."""
from __future__ import annotations


def test_the_floor_tool_drives_both_apps_to_done_and_reports_their_times():
    from clients.tools.openai_http_floor import main

    result = main(["--requests", "6"])
    assert set(result) == {"endpoint", "bare"}
    for row in result.values():
        assert 0 < row["ttft_p50_ms"] <= row["latency_p50_ms"] < 1000
