"""The planner (clients.plan.planner, emit) on cases computed by hand: the analytic capacity of a layout, the split it
picks when one stage is the bottleneck, and the topology and Kubernetes base it writes (the project's own loaders)."""
import json
from pathlib import Path

import pytest

from clients.plan.planner import candidates, capacity, demands, plan
from clients.plan.profile import Profile
from clients.plan.simulate import Layout
from clients.plan.workload import parse
from tests.unit.test_plan_simulate import profile


def heavy_encoder():
    # every request: one image of 40 ms to encode, a 10 ms prefill, one token: the encoder is 4x the engine's work
    return profile(encoder__image=(40.0, 0.0), prefill=(10.0, 0.0))


def workload(rate: float, slo_ms: float = 0):
    return parse({"arrivals": {"process": "poisson", "rate": rate}, "requests": 400, "seed": 3,
                  "slo": {"ttft_p90_ms": slo_ms},
                  "mix": [{"prompt_tokens": 4, "output_tokens": 1, "images": {"count": 1, "sizes": [[10, 10]]}}]})


def test_the_capacity_of_a_layout_is_its_slowest_stages():
    need = demands(heavy_encoder(), workload(1.0), max_seqs=1)
    assert need["encoder"] == pytest.approx(0.040) and need["pd"] == pytest.approx(0.010)
    assert capacity(Layout(encoders=1, pd=1), need) == pytest.approx(25.0)  # the encoder: 1 / 40 ms
    assert capacity(Layout(encoders=4, pd=1), need) == pytest.approx(100.0)  # both at 100/s
    assert capacity(Layout(encoders=4, pd=2), need) == pytest.approx(100.0)


def test_candidates_cover_every_split_of_the_budget():
    layouts = candidates(4, ["E+PD", "E/P/D"], Layout())
    labels = {c.label() for c in layouts}
    assert {"1E+1PD", "3E+1PD", "1E+2PD", "2E+1P+1D", "1E+1P+2D"} <= labels
    assert all(c.devices() <= 4 for c in layouts) and "4E+1PD" not in labels


def test_the_planner_gives_the_encoder_the_devices_it_needs():
    # 5 devices, 60 requests/s: only 4 encoders + 1 pd (capacity 100/s) keep up; 3+2 serves 75/s, 2+3 50/s
    result = plan(heavy_encoder(), workload(60.0), 5, "goodput", ("E+PD",), Layout(max_num_seqs=1), simulate=4)
    assert result["chosen"].label() == "4E+1PD"
    assert {row["layout"] for row in result["tried"]} >= {"4E+1PD", "3E+1PD"}


def test_minimising_hardware_takes_the_fewest_devices_that_meet_the_slo():
    result = plan(heavy_encoder(), workload(20.0, slo_ms=200), 6, "hardware", ("E+PD",), Layout(max_num_seqs=1))
    # 20/s against 40 ms per encode: 1E+1PD (capacity 25/s) is under the 20/0.9 floor; 2E+1PD is the smallest
    assert result["chosen"].label() == "2E+1PD"


def test_the_plan_is_written_as_a_topology_and_a_kubernetes_base(tmp_path):
    from backend.deploy.topology import load
    from clients.plan.emit import write

    result = plan(heavy_encoder(), workload(60.0), 5, "goodput", ("E+PD",), Layout(max_num_seqs=1), simulate=2)
    problems = write(result, tmp_path, "../models/tiny-qwen2-vl", "cpu", "planned", 10)
    topology = load(tmp_path / "topology.yaml", "cpu")
    hosts = topology.hosts
    assert sum("encoder" in h.stages for h in hosts.values()) == 4 and sum("pd" in h.stages for h in hosts.values()) == 1
    text = (tmp_path / "kubernetes" / "encoder.yaml").read_text()
    assert f"averageValue: '{result['targets']['encoder']['target']}'" in text or \
        f"averageValue: \"{result['targets']['encoder']['target']}\"" in text or \
        f"averageValue: {result['targets']['encoder']['target']}" in text
    assert "replicas: 4" in text and problems == []


def test_the_engines_autoscaler_target_without_the_profile_s_kv_size_is_the_written_topology_s():
    """A profile without ``kv_cache_bytes`` (the measured CPU ones): the engines' KV target is computed against the KV
    size the written topology gives them (the renderer's default), not saturated at 1000m."""
    doc = {**heavy_encoder().doc, "kv_bytes_per_token": 1024}
    result = plan(Profile(doc).check(), workload(60.0), 5, "goodput", ("E+PD",), Layout(max_num_seqs=4), simulate=2)
    target = result["targets"]["pd"]
    assert target["target"] != "1000m" and "default kv_cache_memory_bytes" in target["from"], target
    sized = plan(Profile({**doc, "kv_cache_bytes": 1 << 20}).check(), workload(60.0), 5, "goodput", ("E+PD",),
                 Layout(max_num_seqs=4), simulate=2)
    assert int(sized["targets"]["pd"]["target"][:-1]) > int(target["target"][:-1])  # 1 MiB of KV: fuller


def test_the_at_scale_cells_take_a_gpu_profile_and_keep_no_percentile_as_none():
    from clients.plan import scale

    with pytest.raises(ValueError, match="CPU profile"):
        scale.cell(Profile({**heavy_encoder().doc, "cores": 2}), workload(1.0), 8, 1)
    assert scale._rounded(float("nan")) is None and scale._rounded(12.34, 1) == 12.3 and scale._rounded(None) is None
    row = {"workload": "w", "gpus": 8, "rate": 1.0, **{k: {"layout": "x", "goodput": 0.0, "ttft_p90_ms": None,
                                                            "tpot_p90_ms": None} for k in scale.OPTIONS}}
    assert "| - |" in scale.table([row])


def test_a_replay_reads_the_run_s_own_arguments_back():
    """``clients.plan.replay`` predicts a run again with the workload it was made with: the arguments come from the
    command its validation.json records (validate's own parser), not from defaults of its own."""
    import shlex

    from clients.plan.replay import run_arguments
    from clients.plan.validate import COMMAND

    args = run_arguments(shlex.join([*COMMAND.split(), "--profile", "p.json", "--requests", "12", "--max-tokens", "9",
                                     "--image-sizes", "64x48", "--pd-replicas", "3", "--out", "a dir"]))
    assert (args.requests, args.max_tokens, args.pd_replicas, str(args.out)) == (12, 9, 3, "a dir")
    assert run_arguments(f"{COMMAND} --profile p.json").requests == 48  # the run's defaults: validate's
    with pytest.raises(ValueError, match="not a clients.plan.validate command"):
        run_arguments("python -m clients.plan.measure --out x")


def test_the_written_topology_serves_with_the_engine_args_the_plan_assumed(tmp_path):
    """The planned topology's engines get the profile's engine arguments and KV size (a GPU profile's 16 GiB, not the
    topology's CPU default) and the layout's batch limit, in the topology and in the Kubernetes base's rendered
    model.json; a profile that names none leaves the topology's defaults, which its KV target is computed against."""
    from backend.deploy.schema import ENGINE_DEFAULTS
    from backend.deploy.topology import load
    from clients.plan.emit import write

    doc = {**heavy_encoder().doc, "kv_bytes_per_token": 1024, "kv_cache_bytes": 16 << 30,
           "engine_args": {"dtype": "bfloat16", "enforce_eager": False}}
    result = plan(Profile(doc).check(), workload(60.0), 5, "goodput", ("E+PD",), Layout(max_num_seqs=4), simulate=2)
    assert write(result, tmp_path / "gpu", "../models/tiny-qwen2-vl", "gpu", "planned", 10) == []
    args = load(tmp_path / "gpu" / "topology.yaml", "gpu").engine_args
    assert (args["kv_cache_memory_bytes"], args["dtype"], args["enforce_eager"], args["max_num_seqs"]) == \
        (16 << 30, "bfloat16", False, 4)
    assert f'"kv_cache_memory_bytes": {16 << 30}' in (tmp_path / "gpu" / "kubernetes" / "pd.yaml").read_text()
    assert "the profile's kv_cache_memory_bytes" in result["targets"]["pd"]["from"]

    plain = plan(heavy_encoder(), workload(60.0), 5, "goodput", ("E+PD",), Layout(max_num_seqs=4), simulate=2)
    write(plain, tmp_path / "cpu", "../models/tiny-qwen2-vl", "cpu", "planned", 10)
    args = load(tmp_path / "cpu" / "topology.yaml", "cpu").engine_args
    assert args == {**ENGINE_DEFAULTS, "max_num_seqs": 4}
    assert "default kv_cache_memory_bytes" in plain["targets"]["pd"]["from"]


def test_a_replay_of_the_gpu_run_gives_its_repredicted_table(tmp_path, capsys):
    """The GPU validation run (docs/planning.md) predicted again from its files: the table docs cite
    (``validation-repredicted.md``) is what the simulator gives now, and the drift from the run's own predictions
    (made before the encoder's instances shared their device) is reported with exit status 1."""
    from clients.plan.replay import main

    run = Path(__file__).resolve().parents[2] / "docs" / "results" / "data" / "plan-gpu-2026-12-07"
    assert main([str(run), "--out", str(tmp_path / "again.md")]) == 1
    assert (tmp_path / "again.md").read_text() == (run / "validation-repredicted.md").read_text()
    assert "largest difference from the recorded predictions" in capsys.readouterr().out


def test_validate_needs_a_profile_unless_it_measures_a_gpu_deployments_whole(capsys):
    from clients.plan.validate import main

    for argv in (["--deployments", "single"], ["--deployments", "single", "--measure-profile"]):  # a CPU topology
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
    assert "--profile is needed" in capsys.readouterr().err


def test_validate_s_lines_measured_now_replace_the_profile_s_and_keep_what_the_run_cannot_measure():
    from clients.plan.validate import with_lines

    old = {"encoder": {"image": {"base": 15.0}}, "transfer": {"shared_memory": {"base": 1.0}, "nixl": {"base": 9.0}},
           "kv_transfer": {"base": 2.0}, "by_load": {"engine": []}}
    now = {"encoder": {"image": {"base": 6.0}}, "transfer": {"shared_memory": {"base": 0.5}},
           "cpu_ms_per_request": {"text": {}}}
    doc = with_lines(old, now)
    assert doc["encoder"] == {"image": {"base": 6.0}}
    assert doc["transfer"] == {"shared_memory": {"base": 0.5}, "nixl": {"base": 9.0}}  # the cross-host pull: old's
    assert doc["kv_transfer"] == {"base": 2.0} and doc["by_load"] == {"engine": []}
    assert "cpu_ms_per_request" not in doc and doc["lines_measured"]


def test_a_topology_the_machine_cannot_serve_is_a_clear_error_before_any_server(capsys):
    from clients.plan import measure, validate

    for main, argv in ((validate.main, ["--deployments", "single", "--measure-profile"]), (measure.main, ["--out", "x"])):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--topology", str(Path(__file__).resolve().parents[2] / "topologies" / "checkpoint-gpu.yaml"),
                  "--machine", "cpu"])
        assert exit_.value.code == 2
        assert "stages.decode.device: gpu asked for" in capsys.readouterr().err


def test_at_scale_a_workload_the_profile_has_no_line_for_is_named_and_left_out(tmp_path, capsys):
    # an image-only profile (a Qwen2-VL checkpoint's): the audio workload is not simulated, the image one is
    from clients.plan import scale

    doc = heavy_encoder().doc
    doc = {**doc, "name": "images-only", "cores": 0, "transfer": {**doc["transfer"], "nixl": {"base": 1.0}}}
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    mix = ("arrivals: {process: poisson, rate: 5}\nmix: [{prompt_tokens: 4, output_tokens: 1, %s}]\nrequests: 40\n"
           "slo: {ttft_p90_ms: 500}\n")
    (workloads / "audio.yaml").write_text("name: audio\n" + mix % "audios: {count: 1, seconds: 2.0}")
    (workloads / "image.yaml").write_text("name: image\n" + mix % "images: {count: 1, sizes: [[10, 10]]}")
    assert scale.main(["--profile", str(tmp_path / "profile.json"), "--workloads", str(workloads), "--budgets", "8",
                       "--simulate", "1", "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "scale.json").read_text())
    assert [r["workload"] for r in rows] == ["image"]
    text = (tmp_path / "out" / "scale.md").read_text()
    assert "audio: not simulated: encoder.audio: missing from the profile 'images-only'" in text
    assert "not simulated" in capsys.readouterr().err


def test_at_scale_the_orchestrators_carry_the_offered_rate():
    # 10 ms a request and 0.5 a token at 1 token: 10.5 ms; 200 requests/s take 2.1 threads, at half of each: 5
    from clients.plan import scale

    doc = profile(orchestrator=(10.0, 0.5)).doc
    assert scale.orchestrators_for(Profile(doc), workload(1.0), 200.0, 8) == 5
    assert scale.orchestrators_for(Profile(doc), workload(1.0), 1.0, 8) == 1  # one per 8 GPUs at least
    assert scale.orchestrators_for(Profile(doc), workload(1.0), 1.0, 16) == 2


def test_a_client_of_two_threads_sends_two_requests_at_once():
    # the client's 10 ms per request: one thread serves two arrivals at 0 one after the other, two at once
    from clients.plan.simulate import simulate
    from tests.unit.test_plan_simulate import workload as closed_workload

    costs = profile(client=(10.0, 0.0))
    one = simulate(Layout(split="E+PD"), costs, closed_workload("closed", 2, concurrency=2))
    two = simulate(Layout(split="E+PD", clients=2), costs, closed_workload("closed", 2, concurrency=2))
    assert one["ttft_p90_ms"] > two["ttft_p90_ms"] == pytest.approx(10.0 * costs.before_first)


def test_a_replay_with_a_profile_key_set_predicts_what_if(tmp_path, capsys):
    """``--set KEY=JSON`` predicts a run again with its profiles changed: run 7 (docs/planning.md) without its fitted
    engine share gives the committed what-if table; unchanged, it reproduces its own; a malformed change exits 2."""
    from clients.plan.replay import main

    run = Path(__file__).resolve().parents[2] / "docs" / "results" / "data" / "plan-2026-12-07-cpu" / "run3"
    assert main([str(run)]) == 0
    assert main([str(run), "--set", "engine_first_token_by_load=null", "--out", str(tmp_path / "what-if.md")]) == 1
    assert (tmp_path / "what-if.md").read_text() == (run / "validation-without-engine-share.md").read_text()
    for bad in ("engine_thread_share", "engine_thread_share=one"):
        with pytest.raises(SystemExit) as exit_:
            main([str(run), "--set", bad])
        assert exit_.value.code == 2
    assert "--set: " in capsys.readouterr().err
