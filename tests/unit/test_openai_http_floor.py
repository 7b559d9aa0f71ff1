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


def test_in_process_calls_both_apps_through_asgi_and_both_stream_to_done():
    """``--in-process``: the apps answer the same chat body in full (the endpoint's answer is OpenAI's chunks, each
    piece's text in order, the usage chunk, [DONE] last), and each gets a real time per request."""
    import json

    from clients.tools.openai_http_floor import PIECES, main

    result = main(["--in-process", "--requests", "20"])
    assert set(result) == {"endpoint", "bare"}
    for row in result.values():
        assert row["answer"].endswith("data: [DONE]\n\n") and 0 < row["ms_per_request"] < 1000, row
    docs = [json.loads(line.removeprefix("data: ")) for line in result["endpoint"]["answer"].split("\n\n")
            if line and line != "data: [DONE]"]
    text = "".join(d["choices"][0]["delta"].get("content", "") for d in docs if d["choices"])
    assert text == "a" * (PIECES - 1) + "b" and docs[-1]["usage"]["completion_tokens"] == PIECES, docs[-2:]
