"""Deployment topologies: a YAML file names what to serve; ``render`` writes the model repository.

A topology says which deployments run side by side (``serve``: ``baseline`` -> model ``llm``; ``E+PD``
-> ``epd`` + ``encoder`` + ``pd``; ``E/P/D`` -> ``epd`` (``epd_disagg`` when E+PD is served too) +
``encoder`` + ``prefill`` + ``decode``), how many instances each stage has and on which device, the
checkpoint, the shared vLLM engine arguments, and the transfer pool and request limits.

Where a deployment's orchestrator runs (``orchestrator`` on its host stage: ``stages.pd`` for E+PD,
``stages.prefill`` for E/P/D): ``proxy`` (the default) is a model of its own, ``epd``, that reaches the
generator stages over the server's gRPC endpoint; ``colocated`` runs it inside each instance of the host stage,
beside the instance's vLLM engine. E+PD is then ``encoder`` + ``epd`` (with ``pd``'s instances and device;
no model named ``pd``): per streamed response one stub hop and one gRPC round trip fewer. E/P/D is ``encoder`` +
``epd`` (with ``prefill``'s instances and device, a KV producer that pulls the embeddings; no model named
``prefill``) + ``decode``, still asked over gRPC and relayed token by token: the prefill stage's own stub, its
gRPC call and tritonserver's share of it go. Encoders stay a separate model reached through
BLS either way, and the engines still take metadata-only requests. Example::

    checkpoint: ../models/tiny-qwen2-vl      # relative to this file
    serve: [E/P/D]
    stages:
      encoder: {instances: 2, device: cpu}
      prefill: {instances: 1, device: cpu}
      decode:  {instances: 1, device: cpu}
      epd:     {instances: 1}
    engine_args: {dtype: float32, enforce_eager: true, max_model_len: 4096}
    transfer: {pool_bytes: 67108864, lease_seconds: 30}
    tier: {bytes: 268435456}                 # optional: the shared embedding tier (docs/tier.md)

    python -m backend.deploy.topology render topologies/cpu-e-p-d.yaml --out /tmp/repo
    python -m backend.deploy.topology check topologies/gpu-e-p-d.yaml --machine gpu

An orchestrator reaches ``encoder``, ``pd``, ``prefill`` and ``decode`` at their ``endpoint`` (a stage key):
``local`` (the default) is the server the orchestrator runs in, whatever ports it was started on (the encoder: BLS
there; ``backend.deploy.server_address``); ``host:port`` is another server's gRPC endpoint, several comma-separated
are replicas. A ``hosts:`` block places the stages on hosts, each with a server and a model repository of its own,
and computes those endpoints (``backend.deploy.hosts``; ``render --host NAME``, ``hosts``).

``stages.encoder.video_decoder``: ``cpu`` (the default: vLLM's loader over OpenCV's FFmpeg) or ``nvdec`` (a GPU
encoder decodes videos with NVDEC, frames equal to the CPU's bit for bit: ``backend.request.nvdec``).
``stages.encoder.image_preprocess``: ``cpu`` (the default: the image processor on the host), ``gpu`` (a GPU encoder
resizes, normalises and patchifies images on its GPU, the host's pixels bit for bit: ``backend.encode.gpu_image``) or
``nvjpeg`` (``gpu``, and JPEGs decoded by nvJPEG: within a measured bound of the host's pixels).
``stages.encoder.cuda_graphs``: ``true`` compiles a GPU encoder's tower and replays it as CUDA graphs, one per bucket of
batch shapes (``backend.encode.tower_graphs``); ``false``, the default: compiled where the engines are, no graphs.

Validation is loud: unknown keys, impossible counts, a stage the deployments do not use, a GPU asked
for on a CPU machine, each named. The committed ``model_repository/`` is the rendering of
``topologies/default.yaml`` (a test checks they agree).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from backend.deploy.hosts import cli as hosts_cli, parse_hosts
from backend.deploy.render import render
from backend.deploy.schema import (ADMISSION_DEFAULTS, DEPLOYMENTS, ENCODER_QUEUES, ENDPOINT_STAGES, ENGINE_DEFAULTS, GPU_STAGES, HOSTS, LIMIT_DEFAULTS,
                                   MAX_INSTANCES, ORCHESTRATORS, REUSE_DEFAULTS, ROOT, STAGE_KEYS, TIER_DEFAULTS,
                                   TOP_KEYS, TRANSFER_DEFAULTS, IN_PROCESS_DECODE, StageSpec, Topology, TopologyError,
                                   check_keys, deployment_stages)
from backend.deploy.server_address import EndpointError, LOCAL, check_endpoint
from backend.protocol.settings import ImagePreprocess, VideoDecoder
from backend.protocol.stages import Stage

def load(path: Path, machine: str | None = None, checkpoint: Path | None = None) -> Topology:
    """The topology in ``path`` for a ``machine`` kind (default: this one's); ``checkpoint``: a checkpoint directory
    that replaces the file's (which must then exist and hold a config.json)."""
    path, override = Path(path), checkpoint
    if override is not None and not (Path(override) / "config.json").is_file():
        raise TopologyError(f"checkpoint {override}: not a checkpoint directory (no config.json)")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(doc, dict):
        raise TopologyError(f"{path}: expected a mapping at the top level")
    check_keys(doc, TOP_KEYS, str(path))
    machine = machine or ("gpu" if Path("/dev/nvidia0").exists() else "cpu")
    serve = doc.get("serve")
    if not isinstance(serve, list) or not serve or any(d not in DEPLOYMENTS for d in serve) or len(set(serve)) != len(serve):
        raise TopologyError(f"{path}: serve must list distinct deployments out of {', '.join(DEPLOYMENTS)}; got {serve!r}")
    checkpoint = doc.get("checkpoint")
    if not isinstance(checkpoint, str) or not checkpoint:
        raise TopologyError(f"{path}: checkpoint: expected the path of the model checkpoint")
    stages_doc = doc.get("stages") or {}
    if not isinstance(stages_doc, dict):
        raise TopologyError(f"{path}: stages: expected a mapping of stage -> settings")
    colocated = tuple(d for d, host in HOSTS.items() if d in serve and isinstance(stages_doc.get(host), dict)
                      and stages_doc[host].get("orchestrator") == "colocated")
    needed = {stage for deployment in serve for stage in deployment_stages(deployment, colocated)}
    unused = sorted(set(stages_doc) - needed)
    if unused:
        why = "".join(f" ({HOSTS[d]}.orchestrator is colocated: {d}'s orchestrator runs in the {HOSTS[d]} instances)"
                      for d in colocated if "epd" in unused)
        raise TopologyError(f"{path}: stages: {', '.join(unused)} not used by serve {serve} "
                            f"(uses {', '.join(sorted(needed))}){why}")
    stages = {stage: _stage(stages_doc.get(stage) or {}, f"{path}: stages.{stage}", stage, machine) for stage in sorted(needed)}
    sections = {}
    for key, section_defaults in (("transfer", TRANSFER_DEFAULTS), ("limits", LIMIT_DEFAULTS)):
        section = doc.get(key) or {}
        if not isinstance(section, dict):
            raise TopologyError(f"{path}: {key}: expected a mapping")
        check_keys(section, set(section_defaults), f"{path}: {key}")
        for k, v in section.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise TopologyError(f"{path}: {key}.{k}: expected a positive number, got {v!r}")
        sections[key] = {**section_defaults, **section}
    lease = sections["transfer"]["kv_lease_seconds"]
    if not isinstance(lease, int) or lease < 6:  # the consumer renews it every sixth of it, in whole seconds
        raise TopologyError(f"{path}: transfer.kv_lease_seconds: expected whole seconds, at least 6, got {lease!r}")
    engine_args = doc.get("engine_args") or {}
    if not isinstance(engine_args, dict) or "model" in engine_args:
        raise TopologyError(f"{path}: engine_args: expected a mapping of vLLM engine arguments (the model is 'checkpoint')")
    interval = doc.get("stream_interval_ms", 0)
    if not isinstance(interval, (int, float)) or isinstance(interval, bool) or interval < 0:
        raise TopologyError(f"{path}: stream_interval_ms: expected a number >= 0, got {interval!r}")
    openai_port = doc.get("openai_port", 0)
    if not isinstance(openai_port, int) or isinstance(openai_port, bool) or not 0 <= openai_port < 65536:
        raise TopologyError(f"{path}: openai_port: expected a port number (0: none), got {openai_port!r}")
    if openai_port and len(serve) != 1:
        raise TopologyError(f"{path}: openai_port: the endpoint in a model's process serves that model alone; this "
                            f"file serves {', '.join(serve)} (serve one, or front them with python -m frontend.openai)")
    nice = doc.get("engine_nice", 0)
    if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
        raise TopologyError(f"{path}: engine_nice: expected an integer from 0 (as the server) to 19, got {nice!r}")
    split = doc.get("video_split", 1)
    if not isinstance(split, int) or isinstance(split, bool) or not 1 <= split <= MAX_INSTANCES:
        raise TopologyError(f"{path}: video_split: expected an integer from 1 to {MAX_INSTANCES}, got {split!r}")
    topology = Topology(name=str(doc.get("name") or path.stem),
                        checkpoint=Path(override).resolve() if override is not None else path.parent / checkpoint,
                        serve=tuple(serve), stages=stages, engine_args={**ENGINE_DEFAULTS, **engine_args},
                        transfer=sections["transfer"], limits=sections["limits"], stream_interval_ms=float(interval),
                        openai_port=openai_port, engine_nice=nice, video_split=split, tier=_tier(doc.get("tier"), f"{path}: tier", "encoder" in stages),
                        reuse=_reuse(doc.get("reuse"), f"{path}: reuse", stages, serve),
                        admission=check_admission(doc.get("admission"), f"{path}: admission"), source=_source(path))
    topology = _decode_in_process(topology, doc, f"{path}: stages.{IN_PROCESS_DECODE}")
    return replace(topology, hosts=parse_hosts(doc.get("hosts"), f"{path}: hosts", topology))


def _decode_in_process(topology: Topology, doc: dict, where: str) -> Topology:
    """``stages.decode.orchestrator: colocated`` runs decode's engine in each instance of E/P/D's orchestrator, which
    prefill's instances host: it needs that orchestrator colocated, one server (no hosts block), and decode's
    instances and device as prefill's (given so, or not given: then taken from prefill)."""
    spec = topology.stages.get(IN_PROCESS_DECODE)
    if spec is None or spec.orchestrator != "colocated":
        return topology
    if not topology.decode_in_process:
        raise TopologyError(f"{where}.orchestrator: colocated runs decode's engine in E/P/D's orchestrator; it needs "
                            f"stages.prefill.orchestrator: colocated")
    if doc.get("hosts"):
        raise TopologyError(f"{where}.orchestrator: colocated: not with a hosts block (decode runs where prefill does)")
    given = {k for k in ("instances", "device", "gpus") if k in ((doc.get("stages") or {}).get(IN_PROCESS_DECODE) or {})}
    prefill = topology.stages["prefill"]
    if given and (spec.instances, spec.device, spec.gpus) != (prefill.instances, prefill.device, prefill.gpus):
        raise TopologyError(f"{where}: decode's engine runs in prefill's instances: give it prefill's instances, "
                            f"device and gpus, or none of them")
    return topology.with_decode_in_process()


def check_admission(doc, where: str) -> dict[str, Any]:
    """The ``admission`` block's keys as given (integers >= 0; ``priority_levels`` from 1 to 64; ``max_queue_ms`` a
    number >= 0): rendered into the orchestrators (budgets) and every generate model (``priority_levels``)."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise TopologyError(f"{where}: expected a mapping of {', '.join(ADMISSION_DEFAULTS)}")
    check_keys(doc, set(ADMISSION_DEFAULTS), where)
    for key, value in doc.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "priority_levels" and not (isinstance(value, int) and number and 1 <= value <= 64):
            raise TopologyError(f"{where}.{key}: expected an integer from 1 to 64, got {value!r}")
        if key == "max_queue_ms" and not (number and value >= 0):
            raise TopologyError(f"{where}.{key}: expected a number of ms >= 0 (0: until the deadline), got {value!r}")
        if key == "first_token_target_ms" and not (number and value >= 0):
            raise TopologyError(f"{where}.{key}: expected a number of ms >= 0 (0: fixed budgets), got {value!r}")
        if key == "high_priority_reserve_percent" and not (number and 0 <= value < 100):
            raise TopologyError(f"{where}.{key}: expected a percentage from 0 to below 100, got {value!r}")
        if key == "high_priority_burst_percent" and not (number and 0 <= value <= 400):
            raise TopologyError(f"{where}.{key}: expected a percentage from 0 to 400, got {value!r}")
        if key.endswith("_in_flight") and not (isinstance(value, int) and number and value >= 0):
            raise TopologyError(f"{where}.{key}: expected an integer >= 0 (0: no bound), got {value!r}")
        if key == "encoder_queue" and value not in ENCODER_QUEUES:
            raise TopologyError(f"{where}.{key}: expected one of {', '.join(ENCODER_QUEUES)}, got {value!r}")
    return dict(doc)


def _reuse(doc, where: str, stages: dict[str, "StageSpec"], serve) -> dict[str, Any]:
    """The ``reuse`` block checked, with its defaults ({} without one). Demand-aware encoding asks the consumer the
    request will go to: a proxy orchestrator cannot know which of several consumer instances Triton will pick (a
    lookup answered by one and a request served by another is encoded again after a failed pull), so it needs one
    instance, or the colocated orchestrator (each instance asks itself)."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise TopologyError(f"{where}: expected a mapping of {', '.join(REUSE_DEFAULTS)}")
    check_keys(doc, set(REUSE_DEFAULTS), where)
    reuse = {**REUSE_DEFAULTS, **doc}
    for key, value in reuse.items():
        if key == "demand_aware":
            if not isinstance(value, bool):
                raise TopologyError(f"{where}.{key}: expected true or false, got {value!r}")
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
                key.endswith("bytes") and not isinstance(value, int)):
            raise TopologyError(f"{where}.{key}: expected a {'byte count' if key.endswith('bytes') else 'number'} >= 0, "
                                f"got {value!r}")
    if reuse["demand_aware"] and not (reuse["held_bytes"] or reuse["session_bytes"]):
        raise TopologyError(f"{where}.demand_aware: the consumers keep no copies to find (held_bytes, session_bytes: 0)")
    for deployment in serve:
        if deployment not in HOSTS:
            continue
        host = stages[HOSTS[deployment]]
        if reuse["demand_aware"] and host.orchestrator != "colocated" and host.instances > 1:
            raise TopologyError(f"{where}.demand_aware: {deployment}'s proxy orchestrator cannot know which of stages."
                                f"{HOSTS[deployment]}'s {host.instances} instances Triton gives a request; use one instance, "
                                f"or orchestrator: colocated")
    return reuse


def _tier(doc, where: str, has_encoder: bool) -> dict[str, Any]:
    """The ``tier`` block checked, with its defaults ({} without one)."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise TopologyError(f"{where}: expected a mapping with bytes (the budget) and optional {', '.join(TIER_DEFAULTS)}")
    check_keys(doc, set(TIER_DEFAULTS), where)
    if not has_encoder:
        raise TopologyError(f"{where}: no deployment served has an encoder to use it")
    tier = {**TIER_DEFAULTS, **doc}
    for key, value in tier.items():
        if key in ("master", "metadata"):
            if not isinstance(value, str):
                raise TopologyError(f"{where}.{key}: expected a string, got {value!r}")
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise TopologyError(f"{where}.{key}: expected a positive number, got {value!r}")
    if not isinstance(tier["bytes"], int):
        raise TopologyError(f"{where}.bytes: expected an integer, got {tier['bytes']!r}")
    if bool(tier["master"]) != bool(tier["metadata"]):
        raise TopologyError(f"{where}: master and metadata go together (a tier run elsewhere), or neither (started here)")
    return tier


def _source(path: Path) -> str:
    """How a rendered file names its topology: relative to the project root (stable across checkouts) if inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)


def _stage(doc: dict, where: str, stage: str, machine: str) -> StageSpec:
    if not isinstance(doc, dict):
        raise TopologyError(f"{where}: expected a mapping with instances / device / gpus")
    check_keys(doc, STAGE_KEYS, where)
    instances = doc.get("instances", 1)
    if not isinstance(instances, int) or isinstance(instances, bool) or not 1 <= instances <= MAX_INSTANCES:
        raise TopologyError(f"{where}.instances: expected an integer from 1 to {MAX_INSTANCES}, got {instances!r}")
    device = doc.get("device", "cpu")
    if device not in ("cpu", "gpu"):
        raise TopologyError(f"{where}.device: expected cpu or gpu, got {device!r}")
    if device == "gpu" and stage not in GPU_STAGES:
        raise TopologyError(f"{where}.device: the {stage} stage runs on CPU only")
    if device == "gpu" and machine != "gpu":
        raise TopologyError(f"{where}.device: gpu asked for, but this machine kind is {machine} (no GPU); "
                            f"use device: cpu or render with --machine gpu for a GPU machine")
    gpus = doc.get("gpus", [0] if device == "gpu" else [])
    if not isinstance(gpus, list) or not all(isinstance(g, int) and g >= 0 for g in gpus):
        raise TopologyError(f"{where}.gpus: expected a list of GPU ids")
    if gpus and device != "gpu":
        raise TopologyError(f"{where}.gpus: only for device: gpu")
    orchestrator = doc.get("orchestrator", "proxy")
    if "orchestrator" in doc and stage not in (*HOSTS.values(), IN_PROCESS_DECODE):
        raise TopologyError(f"{where}.orchestrator: only pd (E+PD's) or prefill (E/P/D's) can host an orchestrator "
                            f"(and decode's engine can run in E/P/D's)")
    if orchestrator not in ORCHESTRATORS:
        raise TopologyError(f"{where}.orchestrator: expected one of {', '.join(ORCHESTRATORS)}, got {orchestrator!r}")
    endpoint = doc.get("endpoint", LOCAL)
    if "endpoint" in doc and stage not in ENDPOINT_STAGES:
        raise TopologyError(f"{where}.endpoint: only {', '.join(ENDPOINT_STAGES)} are reached by an orchestrator "
                            f"at an endpoint")
    if "endpoint" in doc and orchestrator == "colocated":
        raise TopologyError(f"{where}.endpoint: this stage runs inside its colocated orchestrator; nothing reaches it over gRPC")
    try:
        check_endpoint(stage, endpoint if isinstance(endpoint, str) else repr(endpoint))
    except EndpointError as exc:
        raise TopologyError(f"{where.rsplit(': ', 1)[0]}: {exc}") from None
    return StageSpec(instances, device, tuple(gpus), orchestrator, endpoint, _video_decoder(doc, where, stage, device),
                     image_preprocess(doc, where, stage, device), _cuda_graphs(doc, where, stage, device))


def _cuda_graphs(doc: dict, where: str, stage: str, device: str) -> bool:
    value = doc.get("cuda_graphs", False)
    if "cuda_graphs" in doc and stage != Stage.ENCODER.value:
        raise TopologyError(f"{where}.cuda_graphs: only the encoder's tower is replayed as CUDA graphs here (the "
                            f"engines' are vLLM's: enforce_eager)")
    if not isinstance(value, bool):
        raise TopologyError(f"{where}.cuda_graphs: expected true or false, got {value!r}")
    if value and device != "gpu":
        raise TopologyError(f"{where}.cuda_graphs: CUDA graphs need device: gpu")
    return value


def _video_decoder(doc: dict, where: str, stage: str, device: str) -> str:
    return _encoder_gpu_choice(doc, where, stage, device, "video_decoder", VideoDecoder, "decodes videos")


def image_preprocess(doc: dict, where: str, stage: str, device: str) -> str:
    """The encoder's ``image_preprocess`` (``doc``: its stage's block; ``where`` names it in errors): also the rule
    ``clients.bench.side_by_side --image-preprocess`` lays over a topology."""
    return _encoder_gpu_choice(doc, where, stage, device, "image_preprocess", ImagePreprocess, "preprocesses images")


def _encoder_gpu_choice(doc: dict, where: str, stage: str, device: str, key: str, choices, what: str) -> str:
    """The encoder's ``key`` setting (one of the enum ``choices``; its ``CPU`` member the default): only the encoder
    takes it, and any other value works on the encoder's GPU, so it needs ``device: gpu``."""
    value = doc.get(key, choices.CPU.value)
    if key in doc and stage != Stage.ENCODER.value:
        raise TopologyError(f"{where}.{key}: only the encoder {what}")
    if value not in tuple(choices):
        raise TopologyError(f"{where}.{key}: expected one of {', '.join(choices)}, got {value!r}")
    if value != choices.CPU and device != "gpu":
        raise TopologyError(f"{where}.{key}: {value} works on the encoder's GPU: it needs device: gpu")
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Validate a deployment topology and render its model repository "
                                                 "(with a hosts block: each host's, and its launch command).")
    parser.add_argument("command", choices=("render", "check", "hosts"))
    parser.add_argument("topology", type=Path)
    parser.add_argument("--out", type=Path, help="model repository to write (render); the hosts' parent folder (hosts)")
    parser.add_argument("--host", help="render: this host's repository only (a topology with a hosts block)")
    parser.add_argument("--tritonserver", help="the binary in the launch commands (default: the venv's tritonserver)")
    parser.add_argument("--machine", choices=("cpu", "gpu"), help="the machine kind it is for (default: this one)")
    parser.add_argument("--checkpoint", type=Path, help="serve this checkpoint directory instead of the topology's")
    args = parser.parse_args(argv)
    try:
        topology = load(args.topology, args.machine, args.checkpoint)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "check":
        hosts = "".join(f"; host {name}: {', '.join(host.stages)}" for name, host in topology.hosts.items())
        print(f"{args.topology}: ok; models: {', '.join(topology.models())}{hosts}")
        return 0
    if args.out is None:
        parser.error(f"{args.command} needs --out")
    if args.host or args.command == "hosts":
        return hosts_cli(topology, args.command, args.out, args.host, args.tritonserver)
    names = render(topology, args.out)
    hosts = f" (one server; its hosts: render --host {'|'.join(topology.hosts)})" if topology.hosts else ""
    print(f"rendered {', '.join(names)} into {args.out}{hosts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
