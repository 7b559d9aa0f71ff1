"""The benchmark driver's pure parts: percentiles (against numpy), rows, CSV, the Poisson schedule, datasets."""
import asyncio
import csv
import io
import math
import statistics
import time

import numpy as np
import pytest

from clients.bench.e2e import parse_args
from clients.bench.load import folder_requests, rate_schedule, synthetic_audio_requests, synthetic_requests, \
    synthetic_video_requests
from clients.bench.report import (CSV_FIELDS, Sample, csv_rows, markdown_table, percentile, plot_latency_cdf,
                                  plot_throughput, summarise, write_csv)


@pytest.mark.parametrize("values", [[5.0], [3.0, 1.0], [float(v) for v in range(1, 12)], [0.5, 9.0, 2.5, 2.5, 100.0, 7.0]])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))


def samples():
    # tokens 16, TTFT 100 ms + i, latency 400 ms + 10 i -> TPOT (300 + 9 i) / 15 ms
    return [Sample(ttft=(100 + i) / 1000, latency=(400 + 10 * i) / 1000, tokens=16, responses=16,
                   timings={"encode_ms": float(i), "media_ms": 2.0 * i}) for i in range(10)] + [
            Sample(ttft=0.05, latency=0.05, tokens=1, responses=1)]  # a one-token answer has no TPOT


def test_a_row_from_samples():
    items = samples()
    row = summarise("E+PD", "concurrency", 4, items, errors=2, wall=2.0)
    assert row["completed"] == 11 and row["errors"] == 2
    assert row["req_per_s"] == 5.5 and row["tok_per_s"] == (10 * 16 + 1) / 2.0
    assert row["ttft_p50_ms"] == pytest.approx(np.percentile([s.ttft * 1000 for s in items], 50))
    tpots = [(300 + 9 * i) / 15 for i in range(10)]
    assert row["tpot_p90_ms"] == pytest.approx(np.percentile(tpots, 90))
    assert row["latency_p99_ms"] == pytest.approx(np.percentile([s.latency * 1000 for s in items], 99))
    assert row["encode_ms_p50"] == pytest.approx(4.5) and row["media_ms_p50"] == pytest.approx(9.0)
    assert row["prefill_ms_p50"] is None
    assert row["responses_per_request"] == pytest.approx(statistics.mean([16] * 10 + [1]))


def test_csv_has_one_line_per_row_with_the_header_fields(tmp_path):
    rows = [summarise("llm", "rate", 2.5, samples(), 0, 4.0), summarise("E/P/D", "rate", 5, [], 3, 1.0)]
    lines = csv_rows(rows)
    assert lines[0] == list(CSV_FIELDS) and len(lines) == 3
    first = dict(zip(lines[0], lines[1]))
    assert first["deployment"] == "llm" and first["level"] == "2.5" and first["req_per_s"] == "2.750"
    assert first["prefill_ms_p50"] == ""  # no such stage
    empty = dict(zip(lines[0], lines[2]))
    assert empty["completed"] == "0" and empty["errors"] == "3" and empty["ttft_p50_ms"] == ""
    write_csv(tmp_path / "r.csv", rows)
    assert list(csv.reader(io.StringIO((tmp_path / "r.csv").read_text()))) == lines


def test_markdown_table_and_plots(tmp_path):
    rows = [summarise(name, "concurrency", level, samples(), 0, 1.0) for name in ("llm", "E+PD") for level in (1, 4)]
    table = markdown_table(rows).splitlines()
    assert len(table) == 2 + 4 and table[2].startswith("| llm | c=1 | 11.0 | 161 |")
    plot_latency_cdf({("llm", 1): samples(), ("E+PD", 1): samples()}, tmp_path / "cdf.png")
    plot_throughput(rows, tmp_path / "tp.png")
    for name in ("cdf.png", "tp.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_poisson_schedule():
    times = rate_schedule(10.0, 4000, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps > 0).all()
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.05)       # mean gap 1/rate
    assert np.std(gaps) == pytest.approx(0.1, rel=0.08)        # exponential: std = mean
    assert rate_schedule(10.0, 50, seed=1) == times[:50]        # seeded: the same run twice
    assert rate_schedule(10.0, 50, seed=2) != times[:50]
    assert rate_schedule(float("inf"), 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        rate_schedule(0, 3)


def test_datasets():
    made = synthetic_requests(3, images=2, sizes=[(32, 32), (64, 48)], max_tokens=7)
    assert [len(r.images) for r in made] == [2, 2, 2] and made[0].images[0] != made[1].images[0]
    assert made[0].sampling == {"temperature": 0.0, "max_tokens": 7, "ignore_eos": True}
    media = [b"a", b"b", b"c"]
    assert [r.images for r in folder_requests(media, 3, images=2, max_tokens=4)] == [[b"a", b"b"], [b"c", b"a"], [b"b", b"c"]]
    clips = synthetic_video_requests(2, videos=2, size=(64, 48), frames=4, fps=4.0, max_tokens=5, first=3)
    assert [len(r.videos) for r in clips] == [2, 2] and clips[0].videos[0] != clips[1].videos[0]
    assert clips[0].videos[0][4:8] == b"ftyp" and not clips[0].images  # MP4 containers, no images
    assert [p["type"] for p in clips[0].messages[0]["content"]] == ["video", "video", "text"]
    sounds = synthetic_audio_requests(2, audios=3, seconds=0.5, rate=8_000, max_tokens=5, first=1)
    assert [len(r.audios) for r in sounds] == [3, 3] and sounds[0].audios[0] != sounds[1].audios[0]
    assert sounds[0].audios[0][:4] == b"RIFF" and not sounds[0].images and not sounds[0].videos
    assert [p["type"] for p in sounds[1].messages[0]["content"]] == ["audio", "audio", "audio", "text"]


def test_cli_deployments_and_load_modes():
    assert parse_args(["--rate", "2,5"]).rate == "2,5"
    with pytest.raises(SystemExit):
        parse_args(["--models", "llm,nope"])
    with pytest.raises(SystemExit):
        parse_args(["--rate", "2", "--concurrency", "4"])
    with pytest.raises(SystemExit):  # a checkpoint replaces a topology's: which one must be said
        parse_args(["--checkpoint", "/tmp/ckpt"])
    shared = parse_args(["--shared", "--topology", "topologies/checkpoint-gpu.yaml", "--checkpoint", "/tmp/ckpt"])
    assert shared.shared_topology and str(shared.checkpoint) == "/tmp/ckpt"
    with pytest.raises(SystemExit):
        parse_args(["--modalities", "image,speech"])
    with pytest.raises(SystemExit):  # perf_analyzer sends images only
        parse_args(["--modalities", "audio", "--load-generator", "perf_analyzer"])
    assert parse_args(["--modalities", "image,video", "--videos", "2"]).videos == 2
    assert parse_args(["--modalities", "audio", "--audios", "2", "--audio-seconds", "3"]).audio_seconds == 3.0
    committed = parse_args(["--shared"])
    assert not committed.shared_topology and committed.topology.name == "default.yaml"


METRICS = """# HELP epd_vllm_queue_time_seconds_total Seconds finished requests waited
# TYPE epd_vllm_queue_time_seconds_total counter
epd_vllm_queue_time_seconds_total{model="prefill"} %s
epd_vllm_queue_time_seconds_total{model="decode"} %s
epd_vllm_queue_time_count_total{model="prefill"} %s
epd_vllm_queue_time_count_total{model="decode"} %s
epd_vllm_prompt_tokens_total{model="decode"} 7
nv_inference_count{model="epd",version="1"} 3
"""


def test_engine_queue_time_from_two_metric_scrapes():
    from clients.bench.report import engine_queue_ms, parse_metrics

    before = parse_metrics(METRICS % (1.0, 2.0, 10, 10))
    assert before[("epd_vllm_queue_time_count_total", "decode")] == 10 and len(before) == 4
    after = parse_metrics(METRICS % (1.5, 2.1, 20, 30))  # prefill: 0.5 s / 10, decode: 0.1 s / 20
    assert engine_queue_ms(before, after) == pytest.approx(50 + 5)
    assert engine_queue_ms(after, after) is None and engine_queue_ms({}, {}) is None


def test_metrics_of_a_models_instances_are_summed():
    from clients.bench.report import parse_metrics

    text = ('epd_vllm_queue_time_count_total{instance="pd_0_0",model="pd"} 4\n'
            'epd_vllm_queue_time_count_total{instance="pd_0_1",model="pd"} 6\n'
            'epd_vllm_queue_time_count_total{instance="decode_0_0",model="decode"} 5\n')
    assert parse_metrics(text) == {("epd_vllm_queue_time_count_total", "pd"): 10,
                                   ("epd_vllm_queue_time_count_total", "decode"): 5}


class _Param:
    def __init__(self, value):
        self.bool_param = value


class _Result:
    """A gRPC stream result as tritonclient gives it: outputs by name and the final-response flag."""

    def __init__(self, text: str | None, final: bool, tokens: int | None = None):
        self.outputs = {"text_output": None if text is None else np.array([text.encode()], dtype=object),
                        "num_output_tokens": None if tokens is None else np.array([tokens])}
        self.final = final

    def as_numpy(self, name):
        return self.outputs.get(name)

    def get_response(self):
        return type("Response", (), {"parameters": {"triton_final_response": _Param(self.final)}})()


async def _stream(results, delays):
    for result, delay in zip(results, delays):
        await asyncio.sleep(delay)
        yield result, None


def test_ttft_is_the_first_streamed_token_even_where_its_text_is_empty():
    """A random checkpoint's first tokens can decode to "": the first streamed response is still the first token
    (the server sends it at once); TTFT is not pushed to the first visible text, nor to the end of the request."""
    from clients.bench.load import _read_response

    results = [_Result("", False), _Result("", False), _Result("hi", False), _Result("", True, tokens=3)]
    sample, error = asyncio.run(_read_response(_stream(results, [0.0, 0.2, 0.2, 0.0]), time.perf_counter()))
    assert error is None and sample.tokens == 3 and sample.text == "hi" and sample.responses == 4
    assert sample.ttft < 0.15 and sample.latency >= 0.4
    one, _ = asyncio.run(_read_response(_stream([_Result("all", True, tokens=1)], [0.1]), time.perf_counter()))
    assert one.ttft == pytest.approx(one.latency, abs=0.01) and one.text == "all"  # one final response: the token too


def test_metrics_are_read_by_any_label_and_filtered_by_others():
    from clients.bench.report import parse_metrics

    text = ('epd_admission_limit{instance="epd_0",model="epd",stage="pd"} 7\n'
            'epd_admission_limit{instance="epd_1",model="epd",stage="pd"} 2\n'
            'epd_admission_limit{instance="o_0",model="epd_open",stage="decode"} 3\n')
    assert parse_metrics(text, "epd_admission_limit") == {("epd_admission_limit", "epd"): 9.0,
                                                          ("epd_admission_limit", "epd_open"): 3.0}
    assert parse_metrics(text, "epd_admission_limit", by="stage", where={"model": "epd_open"}) == {
        ("epd_admission_limit", "decode"): 3.0}
