"""The GPU profile's lines (clients.plan.measure_gpu) from phases computed by hand: the encoder's from the
orchestrator's encoder call, prefill and the decode step by batch from vLLM's own timings, the KV bytes of a real
checkpoint's config."""
from pathlib import Path

import pytest

from clients.bench.report import Sample
from clients.plan import measure, measure_gpu
from clients.plan.phases import LONG, SHORT, kpixels

CHECKPOINTS = Path(__file__).resolve().parents[1] / "data" / "checkpoints"

ENCODE_BASE, ENCODE_PER_KPIX = 20.0, 0.1  # one image: 20 ms + 0.1 ms per kilopixel
PREFILL_BASE, PREFILL_PER_TOKEN = 10.0, 0.02
STEP_BASE, STEP_PER_SEQ = 3.0, 0.05
TEXT_TOKENS, TOKENS_PER_KPIX = 30, 1.25


def phase(images: list[int], tokens: int = SHORT, load: int = 1, frames: int = 0) -> dict:
    """One phase of 4 requests: ``images`` of those sides (pixels), or a video of ``frames`` frames of the first."""
    kpix = [kpixels(side) * (frames or 1) for side in images]
    encode = (ENCODE_BASE + ENCODE_PER_KPIX * sum(kpix) + 5.0 * (len(kpix) - 1)) if kpix else 0.0  # 5 ms a batch item
    prompt = TEXT_TOKENS + TOKENS_PER_KPIX * sum(kpix) / (2 if frames else 1)
    count = 4
    timings = {"encode_ms": encode, "transfer_ms": 1.0 + prompt / 1000, "transfer_bytes": prompt * 3072}
    samples = [Sample(0.2, 0.2 + (tokens - 1) * 0.005, tokens, dict(timings), tokens) for _ in range(count)]
    vllm = {"epd_vllm_prompt_tokens_total": prompt * count,
            "epd_vllm_prefill_time_seconds_total": count * (PREFILL_BASE + PREFILL_PER_TOKEN * prompt) / 1000,
            "epd_vllm_prefill_time_count_total": count,
            "epd_vllm_time_per_output_token_seconds_total": count * (tokens - 1) * (STEP_BASE + STEP_PER_SEQ * load) / 1000,
            "epd_vllm_time_per_output_token_count_total": count * (tokens - 1)}
    cpu = {"stub pd": 8.0 + tokens * 0.1, "stub epd": 5.0 + tokens * 0.05, "tritonserver": 1.0, "load generator": 2.0}
    out = {"cpu": cpu, "prompt_tokens": prompt, "vllm": vllm, "samples": samples, "wall": 1.0, "count": count}
    return {**out, "units": frames * kpixels(images[0])} if frames else out


def phases() -> dict:
    out = {"text": phase([])}
    out.update({f"image{side}": phase([side]) for side in measure_gpu.SIZES})
    out["batch4"] = phase([measure_gpu.BATCHED] * 4)
    out["video"] = phase([measure_gpu.BATCHED], frames=8)
    out["long"] = phase([measure_gpu.BATCHED], LONG)
    out.update({f"decode{load}": phase([], LONG, load) for load in measure_gpu.DECODE_LOADS})
    out.update({f"encoders{n}": {**phase([measure_gpu.BATCHED]), "concurrency": n, "sizes": list(measure_gpu.SIZES)}
                for n in (4, 8)})
    return out


def test_the_encoder_lines_come_from_the_orchestrators_encoder_call():
    got = measure_gpu.lines(phases())
    image = got["encoder"]["image"]
    # four items cost 3 x (per-item 20 + 0.1/kpix ... ) beyond one: item = 5 ms + the pixels', batch = the rest
    item = 5.0 + ENCODE_PER_KPIX * kpixels(measure_gpu.BATCHED)
    assert image["slope"] == pytest.approx(ENCODE_PER_KPIX)
    assert image["base"] + image["slope"] * kpixels(measure_gpu.BATCHED) == pytest.approx(item)
    assert got["encoder"]["batch"]["base"] == pytest.approx(ENCODE_BASE - 5.0)
    assert got["tokens"]["image"]["slope"] == pytest.approx(TOKENS_PER_KPIX)


def test_prefill_and_the_decode_step_come_from_vllms_own_timings():
    got = measure_gpu.lines(phases())
    assert (got["prefill"]["base"], got["prefill"]["slope"]) == pytest.approx((PREFILL_BASE, PREFILL_PER_TOKEN))
    assert (got["decode"]["base"], got["decode"]["slope"]) == pytest.approx((STEP_BASE, STEP_PER_SEQ))
    assert [load for load, _ in got["decode_by_load"]] == list(measure_gpu.DECODE_LOADS)
    # the relays' CPU: per streamed token from the long answers, per request the rest
    assert got["stub"]["slope"] == pytest.approx(0.1)
    assert got["orchestrator"]["base"] == pytest.approx(6.0)


def test_kv_bytes_per_token_of_a_real_checkpoints_config():
    # Qwen2-VL-2B: 28 layers x K,V x 2 KV heads x 128 x bf16
    assert measure_gpu.kv_bytes_per_token(CHECKPOINTS / "Qwen2-VL-2B-Instruct", "bfloat16") == 28 * 2 * 2 * 128 * 2
    assert measure_gpu.kv_bytes_per_token(CHECKPOINTS / "Qwen2-VL-2B-Instruct", "float32") == 28 * 2 * 2 * 128 * 4
    assert measure_gpu.kv_bytes_per_token(None, "bfloat16") is None


def test_the_encoders_phases_are_kept_for_the_device_share_and_not_read_as_light_phases():
    got = measure_gpu.lines(phases())
    one = ENCODE_BASE + ENCODE_PER_KPIX * kpixels(measure_gpu.BATCHED)
    assert got["encoders_phases"] == [{"concurrency": n, "requests": 4, "sizes": list(measure_gpu.SIZES),
                                       "encode_p50_ms": pytest.approx(one, abs=1e-3)} for n in (4, 8)]
    assert not [name for name in got["cpu_ms_per_request"] if name.startswith("encoders")]


def _profile_doc() -> dict:
    doc = {"name": "t", "kind": "gpu", "cores": 0, **measure_gpu.lines(phases()), "light_ttft_ms": 60.0}
    doc["transfer"]["nixl"] = {"base": 1.0, "slope": 0.08}
    return doc


def _measured(doc: dict, layout, concurrency: int, share: float, sizes=(measure_gpu.BATCHED,)) -> float:
    """The encoders phase's encoder call as the simulator gives it at ``share`` (images of ``sizes`` px)."""
    from clients.plan.simulate import simulate
    from clients.plan.profile import Profile
    from clients.plan.workload import closed

    load = closed(concurrency, 32, round(doc["text_tokens"]), SHORT, tuple((side, side) for side in sizes))
    return simulate(layout, Profile({**doc, "encoder_device_share": share}), load)["encode_p50_ms"]


@pytest.mark.parametrize("true_shares", [(0.0, 0.35), (0.8, 1.0), (0.5, 0.3)])  # 0.05-0.15 simulate as 0 here
def test_each_loads_device_share_is_the_one_whose_simulated_encoder_call_is_the_measured(true_shares):
    # each phase's encoder call "measured" as the simulator gives it at its true share: the fit finds each again
    from clients.plan.simulate import Layout

    layout = Layout(encoder_instances=4)
    doc = _profile_doc()
    doc["encoders_phases"] = [{"concurrency": n, "requests": 32, "encode_p50_ms": _measured(doc, layout, n, share)}
                              for n, share in zip((4, 8), true_shares)]
    fitted = measure_gpu.fit_device_share(doc, layout)
    assert fitted["encoder_share_by_load"] == [[4, pytest.approx(true_shares[0])], [8, pytest.approx(true_shares[1])]]
    simulated = fitted["encoders_phases"][0]["simulated_p50_ms"]
    # four instances busy at once: the whole call time-sliced takes longer than none of it
    assert simulated["1.0"] > 2 * simulated["0.0"]


def test_the_share_is_fitted_on_the_phases_own_image_sizes():
    # the phases send 448, 672 and 896 px in turn (the validation's mix): a call measured on that mix at a share fits
    # that share again, which the 448 px alone would not (larger images keep the device busier at the same share)
    from clients.plan.simulate import Layout

    layout = Layout(encoder_instances=4)
    doc = _profile_doc()
    sizes = list(measure_gpu.SIZES)
    doc["encoders_phases"] = [{"concurrency": 8, "requests": 32, "sizes": sizes,
                               "encode_p50_ms": _measured(doc, layout, 8, 0.5, sizes)}]
    assert measure_gpu.fit_device_share(doc, layout)["encoder_share_by_load"] == [[8, pytest.approx(0.5)]]
    alone = {**doc, "encoders_phases": [{k: v for k, v in doc["encoders_phases"][0].items() if k != "sizes"}]}
    assert measure_gpu.fit_device_share(alone, layout)["encoder_share_by_load"][0][1] > 0.5


def test_an_encoder_call_beyond_every_share_takes_the_nearest_end():
    from clients.plan.simulate import Layout

    doc = {**_profile_doc(), "encoders_phases": [{"concurrency": 4, "requests": 32, "encode_p50_ms": 1e6},
                                                 {"concurrency": 8, "requests": 32, "encode_p50_ms": 0.0}]}
    fitted = measure_gpu.fit_device_share(doc, Layout(encoder_instances=4))
    assert fitted["encoder_share_by_load"] == [[4, 1.0], [8, 0.0]]


def test_measure_keeps_the_checkpoint_with_url_and_refuses_the_rest(capsys):
    with pytest.raises(SystemExit):
        measure.main(["--out", "/tmp/x.json", "--url", "127.0.0.1:8001", "--metrics", "http://m", "--pid", "1",
                      "--checkpoint", "/tmp/ckpt", "--eager"])
    err = capsys.readouterr().err
    assert "--eager: shape the server started here" in err and "--checkpoint" not in err.split("error:")[-1]
