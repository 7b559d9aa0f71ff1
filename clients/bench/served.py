"""What a command serves beyond its ``--topology``: the options (``served_arguments``: ``--checkpoint``,
``--machine``, ``--eager`` / ``--compile``, ``--kv-cache-gib``, ``--image-preprocess``) and the topology they give
(``served_topology``).
One set for every command that starts its own server from a topology: ``clients.bench.side_by_side`` (ours and
vLLM's engines), ``clients.bench.crossover``, ``clients.plan.validate`` and ``clients.plan.measure``
(``clients.plan.deployments``)."""
from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from backend.deploy.topology import TopologyError, image_preprocess, load

IMAGE_PREPROCESS = ("cpu", "gpu", "nvjpeg")


def served_arguments(parser, *, eager_help: str = "every engine eager (enforce_eager: true)",
                     compile_help: str = "every engine compiled (enforce_eager: false, CUDA graphs)",
                     image_preprocess_help: str = "the encoder's image_preprocess laid over the topology's "
                                                  "(gpu, nvjpeg: a GPU encoder)") -> None:
    """Add the options ``served_topology`` reads to ``parser`` (an ``argparse`` parser or group); ``*_help``: the
    texts where a command's engines are more than its own server's (side_by_side: vLLM's too)."""
    parser.add_argument("--checkpoint", type=Path, help="serve this checkpoint directory in the topology's place")
    parser.add_argument("--machine", choices=("cpu", "gpu"), help="the topology's machine kind (default: this one's)")
    engines = parser.add_mutually_exclusive_group()
    engines.add_argument("--eager", action="store_true", help=eager_help)
    engines.add_argument("--compile", action="store_true", help=compile_help)
    parser.add_argument("--kv-cache-gib", type=_positive_gib, metavar="GIB",
                        help="every engine's KV cache budget (kv_cache_memory_bytes) in GiB, over the topology's: "
                             "a larger checkpoint's weights leave the GPU's other processes less room")
    parser.add_argument("--image-preprocess", choices=IMAGE_PREPROCESS, help=image_preprocess_help)


# served_arguments' fields
SERVED_OPTIONS = ("checkpoint", "machine", "eager", "compile", "kv_cache_gib", "image_preprocess")


def refuse_with_url(parser, args, keep: tuple[str, ...] = ()) -> None:
    """With ``--url`` (a running server) the served options shape nothing: ``parser.error`` naming those given,
    but ``keep`` (the ones a command still reads then, e.g. measure's ``checkpoint`` for its KV size)."""
    if not getattr(args, "url", None):
        return
    given = ["--" + field.replace("_", "-") for field in SERVED_OPTIONS
             if field not in keep and getattr(args, field, None)]
    if given:
        parser.error(f"{', '.join(given)}: shape the server started here, not one at --url")


def _positive_gib(text: str) -> float:
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return gib


def overrides(args) -> dict:
    """Engine arguments laid over the topology's: ``--eager`` / ``--compile`` (neither: none), ``--kv-cache-gib``."""
    out = {}
    if getattr(args, "eager", False):
        out["enforce_eager"] = True
    elif getattr(args, "compile", False):
        out["enforce_eager"] = False
    if getattr(args, "kv_cache_gib", None):
        out["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    return out


def served_topology(args, deployments: str | tuple[str, ...] | None = None):
    """``args.topology`` for ``--machine``, with ``--checkpoint`` in its checkpoint's place, ``overrides`` laid over
    its engine arguments (so over every engine's, ours and, in side_by_side, vLLM's) and ``--image-preprocess`` over
    its encoder's (the topology's own rule: a GPU choice needs a GPU encoder; broken, the run ends with its message);
    ``deployments``: those alone (``Topology.only``). An option ``args`` lacks (a namespace not made with
    ``served_arguments``) leaves the topology's own."""
    topology = load(Path(args.topology), machine=getattr(args, "machine", None),
                    checkpoint=getattr(args, "checkpoint", None))
    topology = replace(topology, engine_args={**topology.engine_args, **overrides(args)})
    if (chosen := getattr(args, "image_preprocess", None)) is not None:
        encoder = topology.stages["encoder"]
        try:
            chosen = image_preprocess({"image_preprocess": chosen}, "--image-preprocess", "encoder", encoder.device)
        except TopologyError as err:
            raise SystemExit(str(err)) from None
        topology = replace(topology, stages={**topology.stages, "encoder": replace(encoder, image_preprocess=chosen)})
    return topology if deployments is None else topology.only(deployments)
