"""A stage profile of a deployment whose encoders and engines run on a GPU: their lines are wall times, not CPU.

    python -m clients.plan.measure --topology topologies/checkpoint-gpu.yaml --checkpoint /tmp/q2b --compile \
        --image-preprocess gpu --out profile-h200.json          # a GPU topology: this module; on the device machine
    python -m clients.plan.validate --deployments single --measure-profile ...   # the same, then the validation

The phases of ``clients.plan.measure`` (``clients.plan.phases``) (requests one at a time, fresh images) at a real checkpoint's sizes
(``SIZES``): text only; one image at 448, 672 and 896 px; four 448 px images a request; one 8-frame 448 px video; the
448 px request with ``LONG`` tokens. Read per phase: the orchestrator's ``timings`` (``encode_ms``: its call of the
encoders; ``transfer_ms`` and ``transfer_bytes``: the pd stub's pull), vLLM's own timings of the pd engine
(``epd_vllm_prefill_time``: scheduled to first token; ``epd_vllm_time_per_output_token``), vLLM's prompt tokens and
every process's CPU. Then the decode step by batch: text prompts with ``LONG`` tokens at ``DECODE_LOADS`` requests in
flight. Fitted:
- the encoder's lines (``phases.encoder_lines``) from ``encode_ms``: one image by kilopixels, the batch's own from
  four, video by frame-kilopixels;
- ``prefill``: vLLM's prefill time by prompt tokens; ``decode``: vLLM's time between tokens by the sequences in flight
  (``decode_by_load`` keeps the points); ``decode_context`` is not measured (0);
- media tokens, the same-host pull (CUDA IPC) and the relaying processes' CPU per request and per streamed token
  (``phases.shared_lines``), each process on cores of its own (``cores`` 0: the host's cores do not make the stages
  wait for each other);
- ``hop`` and ``before_first_token``: the one-448-px-image phase's TTFT against the simulated light load
  (``phases.calibrate``);
- ``encoder_share_by_load``: the encoder's instances are processes on the one GPU, which time-slices them, while
  their host work (decode, preprocessing, launches) goes on in parallel: the share of an encoder call the device
  takes, by the requests in flight, fitted (``fit_device_share``) by simulating each ``encoders<n>`` phase (one
  image a request, of the ``SIZES`` in turn as the validation's levels send them, n in flight: 1, 2 and 4 times the
  encoder's instances) at shares from 0 to 1 against its measured encoder call (docs/planning.md, "The encoder's
  device share").
Not measured, and labelled so in ``derived``: the cross-host pull, E/P/D's KV pull.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from clients.bench.report import percentile
from clients.plan.phases import LONG, SHORT, Session, calibrate, encoder_lines, images, shared_lines, video_phase
from clients.plan.profile import Line, Profile, fit

SIZES = (448, 672, 896)
BATCHED = 448  # the four-image phase's, the light load's and the long answers' image
DECODE_LOADS = (1, 8, 32)
ENCODER_LOADS = (1, 2, 4)  # the encoders phases' requests in flight, in the encoder's instances
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def vllm_ms(phase: dict, timing: str) -> float:
    """vLLM's mean of ``timing`` (``epd_vllm_<timing>``) over the phase, in ms (0 where it counted none)."""
    seconds = phase["vllm"].get(f"epd_vllm_{timing}_seconds_total", 0.0)
    count = phase["vllm"].get(f"epd_vllm_{timing}_count_total", 0.0)
    return 1000.0 * seconds / count if count else 0.0


def _encode(phase: dict) -> float:
    """The orchestrator's encoder call, ms (median over the phase)."""
    return percentile([s.timings.get("encode_ms", 0.0) for s in phase["samples"]], 50)


def warm_up(session: Session) -> None:
    """Two requests of every phase's shape first: a compiled engine's and encoder's first of a shape take longer."""
    for size in SIZES:
        session.phase(images(size), 2)
    session.phase(images(BATCHED, 4), 2)
    video_phase(session, BATCHED, 2)


def run_phases(session: Session, repeat: int) -> dict:
    """Every phase (module docstring); ``encoders<n>``: n requests in flight, ``ENCODER_LOADS`` times the encoder's
    instances."""
    warm_up(session)
    phases = {"text": session.phase(images(BATCHED, 0), repeat)}
    for size in SIZES:
        phases[f"image{size}"] = session.phase(images(size), repeat)
    phases["batch4"] = session.phase(images(BATCHED, 4), repeat)
    phases["video"] = video_phase(session, BATCHED, repeat)
    phases["long"] = session.phase(images(BATCHED, tokens=LONG), repeat)
    for load in DECODE_LOADS:
        phases[f"decode{load}"] = session.phase(images(BATCHED, 0, LONG), max(repeat, 2 * load), concurrency=load)
    for load in (times * session.served.encoder_instances for times in ENCODER_LOADS):
        phases[f"encoders{load}"] = {**session.phase(images(SIZES), max(repeat, 8 * load), concurrency=load),
                                     "concurrency": load, "sizes": list(SIZES)}
    return phases


def lines(phases: dict) -> dict:
    """The profile's lines from the phases (module docstring)."""
    encoder = encoder_lines({s: _encode(phases[f"image{s}"]) for s in SIZES}, _encode(phases["batch4"]), BATCHED,
                            _encode(phases["video"]), phases["video"]["units"])
    prefill = fit([(p["prompt_tokens"], vllm_ms(p, "prefill_time")) for name, p in phases.items()
                   if name in ("text", "batch4", "video") or name.startswith("image")])
    by_load = [[load, round(vllm_ms(phases[f"decode{load}"], "time_per_output_token"), 3)] for load in DECODE_LOADS]
    decode = fit([(load, ms) for load, ms in by_load])
    encoders = [p for name, p in phases.items() if name.startswith("encoders")]
    return {"encoder": encoder, **shared_lines({k: v for k, v in phases.items() if not k.startswith("encoders")},
                                               SIZES, f"image{BATCHED}"),
            "encoders_phases": [{"concurrency": p["concurrency"], "requests": p["count"], "sizes": p["sizes"],
                                 "encode_p50_ms": round(_encode(p), 3)} for p in encoders],
            "prefill": Line(max(0.0, prefill.base), max(0.0, prefill.slope)).as_dict(),
            "decode": Line(max(0.0, decode.base), max(0.0, decode.slope)).as_dict(), "decode_by_load": by_load,
            "decode_context": Line().as_dict(),
            "light_ttft_ms": percentile([s.ttft * 1000 for s in phases[f"image{BATCHED}"]["samples"]], 50),
            "vllm_ms": {name: {"prefill": round(vllm_ms(p, "prefill_time"), 3),
                               "between_tokens": round(vllm_ms(p, "time_per_output_token"), 3),
                               "encode": round(_encode(p), 3)} for name, p in phases.items()}}


def kv_bytes_per_token(checkpoint: Path | None, dtype: str) -> int | None:
    """K and V of every layer for one token, from the checkpoint's config (its ``text_config`` where it has one)."""
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return None
    text = config.get("text_config") or config
    heads = text.get("num_key_value_heads", text["num_attention_heads"])
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return text["num_hidden_layers"] * 2 * heads * head_dim * DTYPE_BYTES.get(str(dtype), 2)


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0].strip() if out.strip() else ""


def measure(session: Session, repeat: int, name: str, checkpoint: Path | None = None) -> dict:
    """The profile of the GPU deployment ``session`` measures (module docstring), calibrated on its layout."""
    from clients.plan.simulate import Layout

    served = session.served
    measured = lines(run_phases(session, repeat))
    engine_args = dict(served.engine_args)
    kv = kv_bytes_per_token(checkpoint, engine_args.get("dtype", "bfloat16"))
    doc = {"name": name, "kind": "gpu", "cores": 0, "device": device_name(), "checkpoint": str(checkpoint or ""),
           "measured": time.strftime("%Y-%m-%d %H:%M"), **measured,
           "kv_transfer": measured["transfer"]["shared_memory"],
           "derived": {"transfer.nixl": "across hosts, assumed RDMA at 12 GB/s (1 ms + 0.08 ms/MiB): not measured",
                       "kv_transfer": "assumed equal to the same-host embedding pull (CUDA IPC): E/P/D not run",
                       "decode_context": "not measured (0): the decode phases' prompts are short",
                       "kv_bytes_per_token": "from the checkpoint's config.json and the engines' dtype"}}
    doc["transfer"]["nixl"] = Line(1.0, 0.08).as_dict()
    if kv:
        doc["kv_bytes_per_token"] = kv
    if engine_args.get("kv_cache_memory_bytes"):
        doc["kv_cache_bytes"] = int(engine_args["kv_cache_memory_bytes"])
    if engine_args:
        doc["engine_args"] = engine_args
    layout = Layout(encoder_instances=served.encoder_instances, max_num_seqs=int(engine_args.get("max_num_seqs", 32)))
    return fit_device_share(calibrate(doc, layout, sizes=((BATCHED, BATCHED),)), layout)


SHARES = tuple(i / 20 for i in range(21))


def fit_device_share(doc: dict, layout) -> dict:
    """``doc`` with ``encoder_share_by_load``: for each of its ``encoders_phases`` (one image a request, of its
    ``sizes`` px a side in turn, ``BATCHED`` in profiles before them; a closed loop at its concurrency), the share of
    ``SHARES`` whose simulated encoder call is nearest the measured one (the least of those equally near; the phases'
    simulated calls kept in them)."""
    from clients.plan.simulate import simulate
    from clients.plan.workload import closed

    rows, phases = [], []
    for phase in doc["encoders_phases"]:
        workload = closed(phase["concurrency"], phase["requests"], round(doc["text_tokens"]), SHORT,
                          tuple((side, side) for side in phase.get("sizes", [BATCHED])))
        simulated = {share: simulate(layout, Profile({**doc, "encoder_device_share": share}),
                                     workload)["encode_p50_ms"] for share in SHARES}
        # below some share the instances' device parts seldom overlap: those simulate alike
        best = min(SHARES, key=lambda share: (round(abs(simulated[share] - phase["encode_p50_ms"]), 2), share))
        rows.append([phase["concurrency"], best])
        phases.append({**phase, "simulated_p50_ms": {str(k): round(v, 3) for k, v in simulated.items()}})
    return {**doc, "encoder_share_by_load": rows, "encoders_phases": phases}
