"""``clients.bench.side_by_side``'s pure parts: the same engine settings in vLLM's command lines as in ours, the
stacks' shapes, rows, token equality, ratios, the tables, the CPU accounting, the requests and SSE parsing, and the
arguments (no server, no proxy)."""
import asyncio
import json
import os
from pathlib import Path

import pytest

from backend.deploy.local_server import ROOT
from backend.deploy.render import render_files
from backend.deploy.topology import load
from clients.bench import side_client, side_stacks, side_table
from clients.bench.report import Sample
from clients.bench.side_by_side import parse_args

TOPOLOGY = ROOT / "topologies" / "default.yaml"
ENGINE_KEYS = ("max_num_seqs", "max_model_len", "kv_cache_memory_bytes", "dtype", "enforce_eager")


def flags(argv: list[str]) -> dict[str, str | bool]:
    """--flag value / --flag -> dict (the values as given)."""
    out, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[argv[i][2:]] = argv[i + 1]
                i += 2
                continue
            out[argv[i][2:]] = True
        i += 1
    return out


def ours_model_json(mode: str, stage: str) -> dict:
    topology = load(TOPOLOGY).only(mode)
    return json.loads(render_files(topology, Path("/tmp/repo"))[f"{stage}/model.json"])


@pytest.mark.parametrize("kind", side_stacks.VLLM_STACKS)
def test_every_vllm_engine_gets_our_engines_settings(kind):
    topology = load(TOPOLOGY)
    ours = ours_model_json("baseline", "llm")
    engines = [s for s in side_stacks.vllm_stack(kind, topology, Path("/x/proxy.py"), list(range(7001, 7007)),
                                                 Path("/tmp/ec"), 1000) if s.name != "proxy"]
    assert engines
    for server in engines:
        given = flags(server.argv)
        for key in ENGINE_KEYS:
            flag = key.replace("_", "-")
            if ours[key] is True:
                assert given[flag] is True, (server.name, key)
            else:
                assert given[flag] == str(ours[key]), (server.name, key)
        assert json.loads(given["limit-mm-per-prompt"]) == ours["limit_mm_per_prompt"]
        assert given["model"] == str(topology.checkpoint.resolve()) and given["host"] == "127.0.0.1"


def test_the_settings_follow_the_topology(tmp_path):
    text = TOPOLOGY.read_text().replace("max_num_seqs: 32", "max_num_seqs: 7")
    (tmp_path / "t.yaml").write_text(text.replace("../models", str(ROOT / "models")))
    topology = load(tmp_path / "t.yaml")
    (single,) = side_stacks.vllm_stack("vllm-single", topology, Path("/x/p.py"), [1, 2, 3, 4, 5, 6], Path("/e"), 1)
    assert flags(single.argv)["max-num-seqs"] == "7"


def test_engine_flags():
    assert side_stacks.engine_flags({"enforce_eager": True, "enable_prefix_caching": False, "max_num_seqs": 4,
                                     "limit_mm_per_prompt": {"image": 2}}) == [
        "--enforce-eager", "--no-enable-prefix-caching", "--max-num-seqs", "4", "--limit-mm-per-prompt", '{"image": 2}']


def test_the_stacks_connectors_and_proxy():
    topology = load(TOPOLOGY)
    e_pd = side_stacks.vllm_stack("vllm-e-pd", topology, Path("/x/p.py"), [1, 2, 3, 4, 5, 6], Path("/ec"), 1000)
    assert [s.name for s in e_pd] == ["encoder", "pd", "proxy"]
    assert json.loads(flags(e_pd[0].argv)["ec-transfer-config"])["ec_role"] == "ec_producer"
    pd = flags(e_pd[1].argv)
    assert json.loads(pd["ec-transfer-config"])["ec_connector_extra_config"] == {"shared_storage_path": "/ec"}
    assert pd["enable-mm-embeds"] is True and "kv-transfer-config" not in pd
    assert flags(e_pd[2].argv)["prefill-servers-urls"] == "disable"
    shipped, delayed = (side_stacks.vllm_stack(k, topology, Path("/x/p.py"), [1, 2, 3, 4, 5, 6], Path("/ec"), 1000)
                        for k in ("vllm-e-p-d", "vllm-e-p-d-delay"))
    assert [s.name for s in shipped] == ["encoder", "prefill", "decode", "proxy"]
    assert [json.loads(flags(s.argv)["kv-transfer-config"])["kv_role"] for s in shipped[1:3]] == ["kv_producer",
                                                                                                  "kv_consumer"]
    assert shipped[1].env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != shipped[2].env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert all(side_stacks.POLL_DELAY_ENV not in s.env for s in shipped)
    assert [s.env.get(side_stacks.POLL_DELAY_ENV) for s in delayed] == [None, "1000", "1000", None]
    assert flags(shipped[3].argv)["decode-servers-urls"] == "http://127.0.0.1:3"


def test_compiled_engines_leave_vllms_encoders_eager():
    from dataclasses import replace

    topology = load(TOPOLOGY)
    compiled = replace(topology, engine_args={**topology.engine_args, "enforce_eager": False})
    for kind in ("vllm-e-pd", "vllm-e-p-d"):
        servers = {s.name: flags(s.argv) for s in
                   side_stacks.vllm_stack(kind, compiled, Path("/x/p.py"), [1, 2, 3, 4, 5, 6], Path("/ec"), 1)}
        assert servers["encoder"].get("enforce-eager") is True and "no-enforce-eager" not in servers["encoder"], kind
        engines = [name for name in servers if name not in ("encoder", "proxy")]
        assert engines and all(servers[name].get("no-enforce-eager") is True for name in engines), kind


def test_vllm_processes_run_without_the_projects_switches(monkeypatch):
    monkeypatch.setenv("EPD_ENGINE_QUICK_EXIT", "1")
    env = side_stacks.process_env(side_stacks.Server("x", [], 1, {"VLLM_PLUGINS": "epd_patches"}))
    assert "EPD_ENGINE_QUICK_EXIT" not in env and env["VLLM_PLUGINS"] == "epd_patches"
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert side_stacks.process_env(side_stacks.Server("x", [], 1))["VLLM_PLUGINS"] == ""


def sample(index: int, ttft_ms: float, latency_ms: float, text: str, tokens: int = 16) -> Sample:
    return Sample(ttft_ms / 1000, latency_ms / 1000, tokens, text=text, index=index)


def test_rows_equality_and_ratios():
    theirs = side_table.summarise("vllm-single", "openai", [sample(i, 10 + i, 40 + i, f"t{i}") for i in range(4)], 0, 2.0, 4)
    mine = side_table.summarise("llm", "openai", [sample(i, 20 + 2 * i, 80, f"t{i}") for i in (0, 1, 3)], 1, 4.0, 4)
    grpc = side_table.summarise("llm", "grpc", [sample(i, 5, 20, f"g{i}") for i in range(4)], 0, 1.0, 4)
    assert theirs["req_per_s"] == 2.0 and theirs["ttft_p50_ms"] == pytest.approx(11.5)
    assert theirs["tpot_p50_ms"] == pytest.approx(30 / 15) and theirs["distinct_texts"] == 4 and grpc["distinct_texts"] == 4
    theirs["cpu_total_ms"], mine["cpu_total_ms"], grpc["cpu_total_ms"] = 10.0, 15.0, 5.0
    rows = [theirs, mine, grpc]
    side_table.add_equality(rows, {("openai", None): theirs["texts"],
                                   ("grpc", None): {i: f"g{i}" for i in range(3)} | {3: "other"}})
    assert theirs["same_text"] == (4, 4) and mine["same_text"] == (3, 4) and grpc["same_text"] == (3, 4)
    pairs = side_table.ratios(rows)
    assert [(p["ours"], p["protocol"], p["vllm"]) for p in pairs] == [("llm", "openai", "vllm-single"),
                                                                       ("llm", "grpc", "vllm-single")]
    assert pairs[0]["req_per_s"] == pytest.approx(0.75 / 2.0) and pairs[0]["cpu_total_ms"] == 1.5
    assert pairs[1]["req_per_s"] == 2.0 and pairs[1]["cpu_total_ms"] == 0.5
    text = side_table.results_table(rows)
    assert "| llm | openai | - | 0.75 |" in text and "3/4" in text
    assert "| llm | grpc | vllm-single | - | 2.00x |" in side_table.ratios_table(pairs)


def test_a_gpu_run_shows_each_row_s_gpu_busy_share():
    from clients.bench import proc_cpu

    busy = proc_cpu.mean_busy("0, 90\n1, 10\n0, 70\nnot a sample\n1, 30\n")
    assert busy == [80.0, 20.0] and proc_cpu.mean_busy("") is None
    rows = [side_table.summarise(name, "openai", [], 0, 1.0, 4) for name in ("vllm-e-pd", "epd")]
    rows[0]["gpu_busy_pct"] = busy
    text = side_table.results_table(rows)
    assert "GPU busy %" in text and "| 80.0/20.0 |" in text and "| - |" in text.splitlines()[3]
    assert "GPU busy" not in side_table.results_table(rows[1:])  # a CPU run: no such column


def test_ratio_edges_and_missing_reference():
    assert side_table.ratio(1.0, 0.0) is None and side_table.ratio(None, 1.0) is None
    assert side_table.ratio(float("nan"), 1.0) is None and side_table.ratio(3.0, 2.0) == 1.5
    assert side_table.same_text({0: "a"}, None) is None
    assert side_table.ratios([side_table.summarise("epd", "openai", [], 0, 1.0, 0)]) == []  # no vLLM row: no pair


def test_cpu_accounting_sums_groups_with_their_descendants():
    # pid -> (parent, start, CPU s): 10 a server with child 11 and grandchild 12; 20 another group; 30 unrelated
    table0 = {10: (1, 100, 1.0), 11: (10, 101, 2.0), 12: (11, 102, 0.5), 20: (1, 200, 3.0), 30: (1, 300, 9.0)}
    groups = {"server": ([10], True), "proxy": ([20], True), "client": ([11], False)}
    before = side_table.cpu_snapshot(groups, table0)
    assert set(before["server"]) == {(10, 100), (11, 101), (12, 102)} and set(before["client"]) == {(11, 101)}
    # later: 12 exited, 13 started (a new child, counted from 0), 11 was replaced by another process with its pid
    table1 = {10: (1, 100, 1.5), 11: (10, 150, 0.25), 13: (10, 160, 0.25), 20: (1, 200, 3.1), 30: (1, 300, 20.0)}
    used = side_table.cpu_per_request(before, side_table.cpu_snapshot(groups, table1), requests=10)
    assert used == {"server": pytest.approx((0.5 + 0.25 + 0.25) * 100), "proxy": pytest.approx(10.0),
                    "client": pytest.approx(25.0)}


def test_cpu_of_this_process_is_read_from_proc():
    stat = side_table.read_stat(os.getpid())
    assert stat is not None and stat[0] == os.getppid() and stat[2] > 0
    assert os.getpid() in side_table.group_pids([os.getppid()], {p: s[0] for p, s in side_table.process_table().items()})


def test_requests_are_seeded_and_alike_on_both_protocols():
    first, again = side_client.request_set(5, 2, 32), side_client.request_set(5, 2, 32)
    assert first == again and first[0].image != first[1].image and first[0].text == "Request 5: what is in the picture?"
    body = side_client.chat_body("m", first[0], 16)
    assert body["stream"] and body["max_tokens"] == 16 and body["temperature"] == 0.0 and body["ignore_eos"]
    parts = body["messages"][0]["content"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,") and parts[1]["text"] == first[0].text
    inputs = side_client.grpc_inputs(first[0], 16)
    assert inputs.images == [first[0].image] and inputs.messages[0]["content"][1]["text"] == first[0].text
    assert inputs.sampling == {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}


def test_sse_lines():
    assert side_client.parse_sse_line(b'data: {"choices": []}\n') == {"choices": []}
    assert side_client.parse_sse_line(b"data: [DONE]\n") == "[DONE]"
    assert side_client.parse_sse_line(b"\n") is None and side_client.parse_sse_line(b": ping\n") is None


class _Stream:
    """An aiohttp-like response whose SSE lines come ``gap`` seconds apart."""

    def __init__(self, lines: list[bytes], gap: float):
        self.status, self.lines, self.gap = 200, lines, gap

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    @property
    def content(self):
        async def lines():
            for line in self.lines:
                await asyncio.sleep(self.gap)
                yield line
        return lines()


class _Session:
    def __init__(self, stream: _Stream):
        self.stream = stream

    def post(self, url, json):
        return self.stream


def test_ttft_is_the_first_chunk_with_a_choice_even_when_its_text_is_empty():
    """A random checkpoint's first tokens may decode to "": TTFT is still the first token's chunk (vLLM's benchmark
    client's rule), not the first visible text (which read the whole request as TTFT on the GPU)."""
    chunk = lambda text: b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode()
    lines = [chunk(""), chunk(""), chunk(""), chunk("a"), b'data: {"choices": [], "usage": {"completion_tokens": 4}}',
             b"data: [DONE]"]
    sample, error = asyncio.run(side_client.stream_chat(_Session(_Stream(lines, 0.05)), "u", {}))
    assert error is None and sample.tokens == 4 and sample.text == "a"
    assert 0.04 <= sample.ttft < 0.12 and sample.latency >= 0.25, (sample.ttft, sample.latency)
    assert not side_client.first_token_event({"choices": [], "usage": {}}) and not side_client.first_token_event("[DONE]")


def test_a_stream_cut_before_done_is_an_error_not_a_short_sample():
    chunk = b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "a"}}]}).encode()
    sample, error = asyncio.run(side_client.stream_chat(_Session(_Stream([chunk, chunk], 0.0)), "u", {}))
    assert sample is None and error == "stream ended before [DONE]"


def test_arguments(tmp_path):
    proxy = tmp_path / "disagg_epd_proxy.py"
    proxy.write_text("")
    args = parse_args(["--proxy", str(proxy), "--rows", "llm,vllm-single", "--requests", "4"])
    assert args.rows == ["vllm-single", "llm"]  # the reference first
    assert parse_args(["--rows", "vllm-single,epd"]).rows == ["vllm-single", "epd"]  # no proxy needed
    with pytest.raises(SystemExit):
        parse_args(["--rows", "vllm-e-pd"])  # needs the proxy
    inside = ROOT / "clients" / "bench" / "side_by_side.py"
    with pytest.raises(SystemExit):
        parse_args(["--proxy", str(inside)])  # vLLM's file stays outside the repository
    with pytest.raises(SystemExit):
        parse_args(["--rows", "nope"])
    with pytest.raises(SystemExit):  # a topology without the stages of a row asked for
        parse_args(["--topology", str(ROOT / "topologies" / "cpu-e-pd.yaml"), "--rows", "vllm-single,epd"])
    assert parse_args(["--topology", str(ROOT / "topologies" / "cpu-e-pd.yaml"), "--rows", "epd"]).rows == ["epd"]


def test_levels_of_concurrency_pair_up_within_their_level():
    rows = []
    for level, rate in ((8, 1.0), (32, 2.0)):
        for name, scale in (("vllm-e-pd", 1.0), ("epd", 1.5)):
            row = side_table.summarise(name, "openai", [sample(i, 10, 40, f"{level}-{i}") for i in range(4)], 0,
                                       4 / (rate * scale), 4)
            row["concurrency"], row["cpu_total_ms"] = level, 1.0
            rows.append(row)
    side_table.add_equality(rows, {("openai", 8): {i: f"8-{i}" for i in range(4)}})
    assert [r["same_text"] for r in rows] == [(4, 4), (4, 4), None, None]
    pairs = side_table.ratios(rows)
    assert [(p["ours"], p["concurrency"]) for p in pairs] == [("epd", 8), ("epd", 32)]
    assert all(p["req_per_s"] == pytest.approx(1.5) for p in pairs)
    text = side_table.results_table(rows)
    assert text.index("| vllm-e-pd | openai | 8 |") < text.index("| epd | openai | 8 |") < text.index(
        "| vllm-e-pd | openai | 32 |")
    assert "| epd | openai | vllm-e-pd | 32 | 1.50x |" in side_table.ratios_table(pairs)


def test_requests_with_several_images_of_several_sizes():
    from PIL import Image
    import io

    requests = side_client.request_set(3, 2, [8, 12, 16], images=4, fmt="JPEG")
    assert requests == side_client.request_set(3, 2, [8, 12, 16], images=4, fmt="JPEG")
    sizes = [[Image.open(io.BytesIO(image)).size[0] for image in r.images] for r in requests]
    assert sizes == [[8, 12, 16, 8], [12, 16, 8, 12]]
    assert len({image for r in requests for image in r.images}) == 8  # no image shared between requests
    assert side_client.request_set(5, 1, 32)[0].image == side_client.request_set(5, 1, [32], 1)[0].images[0]
    body = side_client.chat_body("m", requests[0], 128)
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url"] * 4 + ["text"]
    assert parts[0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    inputs = side_client.grpc_inputs(requests[0], 128)
    assert inputs.images == list(requests[0].images)
    assert [p["type"] for p in inputs.messages[0]["content"]] == ["image"] * 4 + ["text"]


GPU_TOPOLOGY = ROOT / "topologies" / "checkpoint-gpu.yaml"


def test_on_a_gpu_topology_both_sides_get_its_engine_settings_and_vram_buffers(tmp_path):
    from clients.bench.served import served_topology

    args = parse_args(["--topology", str(GPU_TOPOLOGY), "--machine", "gpu", "--checkpoint",
                       str(load(TOPOLOGY).checkpoint), "--eager", "--rows", "vllm-single,llm,epd,epd_disagg",
                       "--concurrency", "8,32", "--image-size", "448,672,896", "--images-per-request", "4"])
    assert args.concurrency == [8, 32] and args.image_size == [448, 672, 896] and args.images_per_request == 4
    topology = served_topology(args)
    assert topology.engine_args["enforce_eager"] is True and topology.engine_args["dtype"] == "bfloat16"
    shipped = side_stacks.vllm_stack("vllm-e-p-d", topology, Path("/x/p.py"), [1, 2, 3, 4, 5, 6], Path("/ec"), 1)
    for server in shipped[:3]:
        given = flags(server.argv)
        assert given["enforce-eager"] is True and given["dtype"] == "bfloat16" and given["max-num-seqs"] == "64"
        assert given["kv-cache-memory-bytes"] == "17179869184" and given["gpu-memory-utilization"] == "0.2"
    assert [json.loads(flags(s.argv)["kv-transfer-config"])["kv_buffer_device"] for s in shipped[1:3]] == ["cuda",
                                                                                                          "cuda"]
    ours = json.loads(render_files(topology.only("E/P/D"), tmp_path)["prefill/model.json"])
    assert ours["enforce_eager"] is True and ours["kv_cache_memory_bytes"] == 17179869184
    on_cpu = side_stacks.vllm_stack("vllm-e-p-d", load(TOPOLOGY), Path("/x/p.py"), [1] * 6, Path("/e"), 1)
    assert json.loads(flags(on_cpu[2].argv)["kv-transfer-config"])["kv_buffer_device"] == "cpu"  # as before
    assert topology.stages["encoder"].image_preprocess == "cpu"  # the topology's
    nvjpeg = served_topology(parse_args(["--topology", str(GPU_TOPOLOGY), "--machine", "gpu", "--rows", "epd",
                                         "--image-preprocess", "nvjpeg"]))
    assert nvjpeg.stages["encoder"].image_preprocess == "nvjpeg"
    assert "image_preprocess" in render_files(nvjpeg.only("E+PD"), tmp_path / "nvjpeg")["encoder/config.pbtxt"]
    with pytest.raises(SystemExit, match="--image-preprocess.image_preprocess: gpu works on the encoder's GPU"):
        served_topology(parse_args(["--rows", "epd", "--image-preprocess", "gpu"]))  # the CPU topology's encoder
    with pytest.raises(SystemExit):
        parse_args(["--eager", "--compile"])
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "8,x"])


def test_the_kv_budget_over_the_topologys_reaches_both_sides(tmp_path, capsys):
    # a 7B's weights on one 80 GB card: the topology's 16 GiB per engine left its GPU encoders out of memory
    from clients.bench.served import served_topology

    args = parse_args(["--topology", str(GPU_TOPOLOGY), "--machine", "gpu", "--kv-cache-gib", "8", "--rows", "epd"])
    topology = served_topology(args)
    assert topology.engine_args["kv_cache_memory_bytes"] == 8 * 2**30
    assert json.loads(render_files(topology.only("E+PD"), tmp_path)["pd/model.json"])["kv_cache_memory_bytes"] == \
        8 * 2**30
    vllm = side_stacks.vllm_stack("vllm-single", topology, Path("/x/p.py"), [1] * 6, Path("/e"), 1)
    assert flags(vllm[0].argv)["kv-cache-memory-bytes"] == str(8 * 2**30)
    for bad in ("0", "-1", "x", "nan", "inf"):
        with pytest.raises(SystemExit):
            parse_args(["--kv-cache-gib", bad])
        assert "--kv-cache-gib: expected a positive number of GiB" in capsys.readouterr().err


def test_start_waves():
    servers = [side_stacks.Server(n, [], i) for i, n in enumerate(("encoder", "prefill", "decode", "proxy"))]
    assert [[s.name for s in w] for w in side_stacks.start_waves(servers, False)] == [["encoder"], ["prefill"],
                                                                                    ["decode"], ["proxy"]]
    assert [[s.name for s in w] for w in side_stacks.start_waves(servers, True)] == [["encoder", "prefill", "decode"],
                                                                                   ["proxy"]]
    assert [[s.name for s in w] for w in side_stacks.start_waves(servers[:1], True)] == [["encoder"]]


def test_the_report_of_a_run_cut_short(tmp_path):
    from clients.bench.side_by_side import Run, report

    args = parse_args(["--rows", "vllm-single,llm", "--requests", "2", "--warmup", "0", "--concurrency", "1,2",
                       "--images-per-request", "2", "--image-size", "16,24", "--eager", "--interleave",
                       "--out", str(tmp_path)])
    run = Run(args)
    assert sorted(run.sets) == [("grpc", 1), ("grpc", 2), ("openai", 1), ("openai", 2)]
    seeds = [r.seed for key in sorted(run.sets) for r in run.sets[key]]
    assert len(set(seeds)) == 8 and [r.seed for r in run.sets["openai", 1]] == [0, 1]
    row = side_table.summarise("vllm-single", "openai", [sample(i, 10, 40, f"t{i}") for i in range(2)], 0, 1.0, 2)
    row.update(concurrency=1, cpu_ms={"api server": 3.0}, cpu_total_ms=3.0)
    run.rows.append(row)
    run.references["openai", 1] = dict(row["texts"])
    run.started_s["vllm-single"], run.failed["llm"] = 12.0, "RuntimeError: tritonserver exited"
    text = report(run)
    assert "| vllm-single | openai | 1 | 2.00 |" in text and "2/2" in text and "engines eager" in text
    assert "started in (s): vllm-single 12" in text and "llm failed: RuntimeError" in text
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["settings"]["engine_args_over_topology"] == {"enforce_eager": True}
    assert saved["settings"]["failed"] == {"llm": "RuntimeError: tritonserver exited"}


def test_rows_through_the_in_process_endpoint_get_the_openai_requests_reference_and_ratios():
    rows = [{"name": "vllm-single", "protocol": "openai", "concurrency": 16, "req_per_s": 100.0, "texts": {0: "a", 1: "b"},
             "cpu_total_ms": 8.0},
            {"name": "llm", "protocol": "openai-in", "concurrency": 16, "req_per_s": 120.0, "texts": {0: "a", 1: "x"},
             "cpu_total_ms": 6.0}]
    side_table.add_equality(rows, {("openai", 16): {0: "a", 1: "b"}})
    assert rows[1]["same_text"] == (1, 2)
    [pair] = side_table.ratios(rows)
    assert (pair["ours"], pair["protocol"], pair["vllm"]) == ("llm", "openai-in", "vllm-single")
    assert pair["req_per_s"] == 1.2 and pair["cpu_total_ms"] == 0.75
    assert parse_args(["--rows", "llm", "--colocated", ""]).colocated == []
    with pytest.raises(SystemExit):
        parse_args(["--rows", "llm", "--colocated", "E+P"])


def test_ours_default_runs_e_p_d_with_decode_in_the_orchestrator_s_process(capsys):
    from clients.bench.side_by_side import Run

    args = parse_args(["--rows", "epd_disagg"])
    assert args.colocated == ["E+PD", "E/P/D", "decode"]
    ours = Run(args).ours_topology
    assert ours.decode_in_process and ours.only("E/P/D").models() == {"encoder": "encoder", "epd": "epd:E/P/D:colocated"}
    assert not Run(parse_args(["--rows", "epd_disagg", "--colocated", "E+PD,E/P/D"])).ours_topology.decode_in_process
    with pytest.raises(SystemExit):
        parse_args(["--rows", "epd_disagg", "--colocated", "decode"])
    assert "list E/P/D too" in capsys.readouterr().err
