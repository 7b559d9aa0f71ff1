"""Rendering a deployment topology (``backend.deploy.topology``) into a Triton model repository: each model's
``config.pbtxt`` (its interface, instances, parameters), ``model.json`` (vLLM engine arguments) and ``model.py``
(the entry point that imports its class from ``backend.triton.models``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

from backend.deploy.schema import ADMISSION_DEFAULTS, ADMISSION_PARAMETERS, ModelKind, StageSpec, Topology
from backend.protocol import generate
from backend.protocol.modality import modalities
from backend.protocol.stages import Disaggregation, Stage

KV_TRANSFER = ("nixl_poll_delay_us", "kv_lease_seconds")  # the transfer section's keys for KV engines (prefill, decode)
GENERATED_KEY = "_generated"  # model.json's note of where it comes from (JSON has no comments; not an engine argument)


_HEADERS = {
    ModelKind.LLM:
        "Single-engine baseline: one vLLM AsyncLLM given the raw media (engine arguments in model.json).\n"
        "Its inputs/outputs are the interface every generating model shares (llm, epd, pd, ...).",
    ModelKind.PD:
        "E+PD consumer: one vLLM AsyncLLM (prefill + decode) fed metadata-only media (image_layouts); it pulls\n"
        "the embeddings through NIXL. It receives media (original_media) only when the orchestrator runs with\n"
        "metadata-only off (naive EPD) and then decodes and preprocesses them itself. Engine arguments in model.json.",
    ModelKind.PREFILL:
        "E/P/D prefill: vLLM with NixlConnector (kv_producer) fed metadata-only media (image_layouts); it pulls\n"
        "the embeddings, prefills, and returns kv_transfer_params for decode. Given media (image; P/D: the\n"
        "orchestrator skipped the encoders, request parameter epd_encode=false), its engine processes them.\n"
        "Engine arguments in model.json.",
    ModelKind.DECODE:
        "E/P/D decode: vLLM with NixlConnector (kv_consumer). It pulls prefill's KV by kv_transfer_params and\n"
        "takes media as layout metadata only (no embeddings): the KV covers the media positions. Given media\n"
        "(image; P/D, as prefill), its engine processes them.",
    ModelKind.ENCODER:
        "Encoder stage: image processor + vision tower of the checkpoint (tower weights only). Each item's\n"
        "embeddings go into a NIXL-registered lease; the response is the item's layout metadata (JSON).\n"
        "Triton's dynamic batcher gathers items of concurrent requests into one tower forward.",
    ModelKind.EPD:
        "E+PD orchestrator (decoupled): the same interface as llm. Media items go to `encoder` concurrently (BLS);\n"
        "the request goes on to `pd` metadata-only (image_layouts, over the server's gRPC endpoint); pd's stream\n"
        "comes back with a timing breakdown.",
    ModelKind.COLOCATED:
        "E+PD with the orchestrator colocated (decoupled): the same interface as llm. Media items go to `encoder`\n"
        "concurrently (BLS); the metadata-only request goes to this model's own vLLM AsyncLLM (prefill + decode, as\n"
        "pd: it pulls the embeddings by handle, never sees media), in process; the stream comes back with a timing\n"
        "breakdown. Engine arguments in model.json.",
    ModelKind.COLOCATED_PREFILL:
        "E/P/D with the orchestrator colocated with prefill (decoupled): the same interface as llm. Media items\n"
        "go to `encoder` concurrently (BLS); the metadata-only request goes to this model's own vLLM AsyncLLM\n"
        "(prefill: NixlConnector kv_producer, pulls the embeddings by handle; 1 token, do_remote_decode), in\n"
        "process, then to `decode` with its kv_transfer_params over the server's gRPC endpoint; decode's stream\n"
        "comes back with a timing breakdown. Engine arguments in model.json.",
    ModelKind.EPD_DISAGG:
        "E/P/D orchestrator (decoupled): media items go to `encoder` concurrently (BLS); the metadata-only\n"
        "request goes to `prefill` (1 token, do_remote_decode) and then to `decode` with prefill's\n"
        "kv_transfer_params; decode's stream comes back with a timing breakdown.",
}


def _module(kind: ModelKind) -> str:
    """The module of the kind's model class: its role's, ``epd`` for a proxy orchestrator, ``colocated`` beside an engine."""
    return f"backend.triton.models.{'colocated' if kind.colocated else kind.role.value}"


def _io(kind: str, tensors) -> str:
    lines = []
    for t in tensors:
        optional = " optional: true" if kind == "input" and t.optional else ""
        lines.append(f'  {{ name: "{t.name}" data_type: {t.dtype} dims: [ {t.dims} ]{optional} }}')
    return f"{kind} [\n" + ",\n".join(lines) + "\n]\n"


def _generate_io(kind: Stage) -> str:
    """The generate interface's tensors of a model kind (``backend.protocol.generate``)."""
    return _io("input", generate.input_tensors(kind)) + _io("output", generate.output_tensors(kind))


def _params(params: dict[str, Any]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())


def _instances(spec: StageSpec) -> str:
    if spec.device == "gpu":
        return f"instance_group [ {{ count: {spec.instances} kind: KIND_GPU gpus: [ {', '.join(map(str, spec.gpus))} ] }} ]\n"
    return f"instance_group [ {{ count: {spec.instances} kind: KIND_CPU }} ]\n"


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def render_config(topology: Topology, name: str, kind: ModelKind, model_dir: Path) -> str:
    checkpoint = os.path.relpath(topology.checkpoint.resolve(), model_dir.resolve())
    per_prompt = {m.limit_field for m in modalities()}  # the engines': limit_mm_per_prompt; epd's: parameters
    limits = {k: _fmt(v) for k, v in topology.limits.items() if k not in (*per_prompt, "request_timeout_seconds")}
    text = _HEADERS[kind] + ("\nDecode's engine (a KV consumer) runs in this model's process too: its tokens reach "
                             "the client\nwithout a stub or gRPC hop (decode_in_process)."
                             if kind is ModelKind.COLOCATED_PREFILL and topology.decode_in_process else "")
    header = "".join(f"# {line}\n" for line in [generated_by(topology), *text.splitlines()])
    body = f'name: "{name}"\nbackend: "python"\n'
    if kind is ModelKind.ENCODER:
        spec = topology.stages[kind.stage]
        # video parts (video_split) are asked for at once, to run on different instances: a queue delay would gather
        # them into one batch of one instance, so an idle instance takes a request at once (batches still form
        # while every instance is busy)
        delay = 0 if topology.video_split > 1 else 2000
        body += f"max_batch_size: 32\n{_encoder_batching(topology, delay)}\n"
        body += _io("input", generate.ENCODER_INPUTS) + _io("output", generate.ENCODER_OUTPUTS) + "\n" + _instances(spec) + "\n"
        transfer = {k: _fmt(v) for k, v in topology.transfer.items() if k not in KV_TRANSFER}
        # the tower runs in the engines' dtype (a bfloat16 checkpoint served in float32: the engines' own tower
        # computes in float32, and embeddings of another dtype would change the tokens)
        dtype = topology.engine_args.get("dtype")
        engine_dtype = {"encoder_dtype": dtype} if isinstance(dtype, str) and dtype != "auto" else {}
        # engines compiled (CUDA graphs, torch.compile): a GPU encoder compiles its packed blocks too
        if topology.engine_args.get("enforce_eager") is False and spec.device == "gpu":
            engine_dtype["encoder_compile"] = "true"
        if spec.cuda_graphs:  # compiled and replayed as CUDA graphs, whatever the engines do
            engine_dtype.update(encoder_compile="true", encoder_cuda_graphs="true")
        # the shared embedding tier: only where the topology has one (the launcher starts it: tier_service.launch_for)
        tier = {f"tier_{k}": _fmt(v) for k, v in topology.tier.items()}
        decoder = {"video_decoder": spec.video_decoder} if spec.video_decoder != "cpu" else {}
        if spec.image_preprocess != "cpu":
            decoder["image_preprocess"] = spec.image_preprocess
        return header + body + _params({"model": checkpoint, **engine_dtype, **decoder, **transfer, **limits, **tier})
    body += "max_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n\n"
    if kind.colocated:
        body += _generate_io(generate.EPD) + "\n" + _instances(topology.stages[kind.stage]) + "\n"
        params = {"engine_args": "model.json", **limits, "topology": kind.disaggregation.value,
                  "orchestrator": "colocated", "encoder_model": "encoder", "encoder_endpoint": topology.stages["encoder"].endpoint,
                  "request_timeout_seconds": _fmt(topology.limits["request_timeout_seconds"])}
        # decode over gRPC, or its engine here too; this model's engine is prefill's (a KV producer)
        if kind.disaggregation is Disaggregation.E_P_D:
            params.update({"decode_in_process": "true"} if topology.decode_in_process else
                          {"decode_model": "decode", "decode_endpoint": topology.stages["decode"].endpoint})
            params.update(nixl_side_channel_port="", **_kv_transfer(topology))
        if topology.stream_interval_ms:
            params["stream_interval_ms"] = _fmt(topology.stream_interval_ms)
        params.update(_nice(topology))
        if topology.video_split > 1:
            params["video_split"] = _fmt(topology.video_split)
        params.update({k: _fmt(v) for k, v in topology.reuse.items()})  # its engine is the consumer
        return header + body + _params({**params, **_admission(topology), **_openai(topology)})
    if kind.role is Stage.ORCHESTRATOR:
        body += _generate_io(generate.EPD) + "\n" + _instances(topology.stages[kind.stage]) + "\n"
        names = {"model": checkpoint, "topology": kind.disaggregation.value, "encoder_model": "encoder",
                 "encoder_endpoint": topology.stages["encoder"].endpoint}
        names.update({"generator_model": "pd", "generator_endpoint": topology.stages["pd"].endpoint}
                     if kind.disaggregation is Disaggregation.E_PD else
                     {"prefill_model": "prefill", "prefill_endpoint": topology.stages["prefill"].endpoint,
                      "decode_model": "decode", "decode_endpoint": topology.stages["decode"].endpoint})
        if topology.engine_args.get("allowed_media_domains"):  # vLLM's engine argument applies to epd too
            names["allowed_media_domains"] = ",".join(topology.engine_args["allowed_media_domains"])
        per_request = {m.limit_field: _fmt(topology.limits[m.limit_field]) for m in modalities()}
        if topology.video_split > 1:
            per_request["video_split"] = _fmt(topology.video_split)
        if topology.reuse:
            per_request["demand_aware"] = _fmt(topology.reuse["demand_aware"])
        return header + body + _params({**names, **per_request, **limits,
                                        "request_timeout_seconds": _fmt(topology.limits["request_timeout_seconds"]),
                                        **_admission(topology), **_openai(topology)})
    body += _generate_io(kind.role) + "\n" + _instances(topology.stages[kind.stage]) + "\n"
    params = {"engine_args": "model.json", **limits, **_admission(topology, "priority_levels")}
    if topology.stream_interval_ms and kind.role is not Stage.PREFILL:  # one token: nothing to pace
        params["stream_interval_ms"] = _fmt(topology.stream_interval_ms)
    params.update(_nice(topology))
    if kind.role.spec.kv_role:
        params.update(nixl_side_channel_port="", **_kv_transfer(topology))
    if kind.role.spec.pulls_embeddings:  # a consumer: its copies (the reuse block)
        params.update({k: _fmt(v) for k, v in topology.reuse.items() if k != "demand_aware"})
    if kind.role is Stage.LLM:
        params.update(_openai(topology))
    return header + body + _params(params)


def _admission(topology: Topology, *keys: str) -> dict[str, str]:
    """The ``admission`` block's orchestrator settings given in the topology (``keys``: only those), as parameters
    (``encoder_queue`` is the encoder's batcher: ``_encoder_batching``)."""
    return {k: _fmt(v) for k, v in topology.admission.items() if k in (keys or ADMISSION_PARAMETERS)}


def _encoder_batching(topology: Topology, delay_us: int) -> str:
    """The encoder's dynamic batcher. With an ``admission`` block: one queue per priority class (Triton's level 1
    first: a request's epd_priority + 1, as the orchestrators send it over gRPC; requests without one, BLS calls among
    them, take the last level), a request's own timeout honoured in the queue (its deadline: rejected there once it
    passes; Triton lets a request's timeout only shorten the queue's own, so that is the request timeout). Without
    one: a single queue and no policy, because Triton 2.51's batcher cannot prefetch the next batch through priority
    levels or a queue policy (``PriorityQueue``: ``support_prefetching_`` false), and then a request queued while the
    instance is busy waited up to its 500 ms idle wait for the instance to take it (measured: 510-545 ms in the
    encoder's queue for one request of four sent at once, in two bursts out of six; docs/results/epd.md). The
    encoder still checks each request's deadline before it starts (``orchestrator.admission.URGENCY``). An
    ``admission`` block with ``encoder_queue: fifo`` keeps the single queue: the orchestrators' gates still let
    encodes in by priority, but an encoder shared with other servers' orchestrators then serves them in arrival order."""
    if topology.admission.get("encoder_queue", ADMISSION_DEFAULTS["encoder_queue"]) == "fifo" or not topology.admission:
        return f"dynamic_batching {{\n  max_queue_delay_microseconds: {delay_us}\n}}\n"
    levels = topology.admission.get("priority_levels", ADMISSION_DEFAULTS["priority_levels"])
    timeout_us = int(topology.limits["request_timeout_seconds"] * 1e6)
    return (f"dynamic_batching {{\n  max_queue_delay_microseconds: {delay_us}\n  priority_levels: {levels}\n"
            f"  default_priority_level: {levels}\n  default_queue_policy {{ timeout_action: REJECT "
            f"default_timeout_microseconds: {timeout_us} allow_timeout_override: true }}\n}}\n")


def _kv_transfer(topology: Topology) -> dict[str, str]:
    """A KV engine model's NixlConnector settings from the topology's transfer section (``KV_TRANSFER``)."""
    return {k: _fmt(topology.transfer[k]) for k in KV_TRANSFER}


def _nice(topology) -> dict[str, str]:
    """An engine model's EngineCore niceness (``topology.engine_nice``; 0: none rendered)."""
    return {"engine_nice": _fmt(topology.engine_nice)} if topology.engine_nice else {}


def _openai(topology: Topology) -> dict[str, str]:
    """A served model's parameters for the OpenAI endpoint in its process (``topology.openai_port``; none: {})."""
    return {"openai_port": _fmt(topology.openai_port)} if topology.openai_port else {}


def render_engine_args(topology: Topology, stage: str, model_dir: Path) -> str:
    args = {GENERATED_KEY: generated_by(topology), "model": os.path.relpath(topology.checkpoint.resolve(), model_dir.resolve()), **topology.engine_args,
            "limit_mm_per_prompt": {m.limit_key: topology.limits[m.limit_field] for m in modalities()}}
    if topology.stages[stage].device == "gpu":
        args.pop("distributed_executor_backend", None)
    return json.dumps(args, indent=2) + "\n"


def generated_by(topology: Topology) -> str:
    """The line every rendered file starts with: where it comes from, and that it is not edited by hand."""
    return (f"Generated by backend.deploy.render from {topology.source or topology.name}: "
            "edit the topology and render again, not this file.")


def render_files(topology: Topology, out: Path, models: Iterable[str] | None = None) -> dict[str, str]:
    """The model repository for ``topology`` as it would be written at ``out``: relative path -> text. ``models``:
    only these of its models (one host's or tier's share: ``backend.deploy.hosts``); None: all."""
    files = {}
    for name, kind in topology.models().items():
        if models is not None and name not in models:
            continue
        model_dir = Path(out) / name
        files[f"{name}/config.pbtxt"] = render_config(topology, name, kind, model_dir)
        module = _module(kind)
        files[f"{name}/1/model.py"] = (f'"""Triton Python-backend entry point of `{name}`: the model class lives in '
                                       f'{module}.\n\n{generated_by(topology)}\n"""\n'
                                       f'from {module} import TritonPythonModel  # noqa: F401\n')
        if kind.engine is not None:
            files[f"{name}/model.json"] = render_engine_args(topology, kind.stage, model_dir)
    return files


def render(topology: Topology, out: Path, models: Iterable[str] | None = None) -> list[str]:
    """Write the model repository for ``topology`` into ``out`` (replacing what is there); ``models``: as in
    ``render_files``. Returns the names of the models written."""
    out = Path(out)
    write_files(out, render_files(topology, out, models))
    return [name for name in topology.models() if models is None or name in models]


def write_files(out: Path, files: dict[str, str]) -> None:
    """``out`` made to hold exactly ``files`` (relative path -> text). One that holds them already is left as it is: a
    second launcher of the same topology (another server on other ports) rendering while the first server loads from
    it emptied the folder under that server's stubs (2 launchers at once, 2026-12-06: ``FileNotFoundError`` in one,
    the other's models failing to load). Otherwise the new contents are written beside it and swapped in."""
    out = Path(out)
    if _holds(out, files):
        return
    fresh = out.with_name(f".{out.name}.{os.getpid()}.new")
    shutil.rmtree(fresh, ignore_errors=True)
    for relative, text in files.items():
        (fresh / relative).parent.mkdir(parents=True, exist_ok=True)
        (fresh / relative).write_text(text)
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    if out.exists():
        out.rename(old)
    fresh.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _holds(out: Path, files: dict[str, str]) -> bool:
    """Whether ``out`` has exactly ``files``: the same file paths, each with the same text (the bytecode Python
    caches beside a served ``model.py`` aside)."""
    if not out.is_dir():
        return False
    present = {str(path.relative_to(out)) for path in out.rglob("*")
               if path.is_file() and "__pycache__" not in path.parts}
    try:
        return present == set(files) and all((out / rel).read_text() == text for rel, text in files.items())
    except OSError:  # a file that went while it was read
        return False


def copy_model(source: Path, model: str, repo: Path, name: str) -> Path:
    """The rendered ``source/model`` written as ``repo/name``: a second model of the same stage under another name
    beside the first (a variant with other parameters, the same orchestrator without budgets); returns its config."""
    shutil.copytree(Path(source) / model, Path(repo) / name)
    config = Path(repo) / name / "config.pbtxt"
    text, found = re.subn(rf'^name: "{re.escape(model)}"$', f'name: "{name}"', config.read_text(), flags=re.M)
    if found != 1:
        raise ValueError(f"{config}: no name: \"{model}\" line to rename")
    config.write_text(text)
    return config
