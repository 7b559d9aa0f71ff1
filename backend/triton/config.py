"""A Triton model's settings at load: its ``config.pbtxt`` parameters parsed once into the frozen dataclass of its
kind (``backend.protocol.settings``); a parameter that cannot be used fails the load, naming the model and it."""
from __future__ import annotations

import json
from importlib.metadata import entry_points
from typing import Any, Callable, TypeVar

import triton_python_backend_utils as pb_utils

from backend.protocol.settings import ConfigError, parse_settings

S = TypeVar("S")
# endpoints a package above the server serves from a model's own process (pyproject: frontend.openai.in_process)
ENDPOINTS = "triton_epd.endpoints"


def load_settings(cls: type[S], args: dict[str, Any]) -> S:
    """``cls`` made of the model's config (``initialize``'s ``args``); raises ``TritonModelException``."""
    try:
        return parse_settings(cls, args["model_name"], json.loads(args["model_config"]))
    except ConfigError as exc:
        raise pb_utils.TritonModelException(str(exc)) from None


def instance_count(model_config: dict) -> int:
    """How many instances of the model Triton runs (its config's ``instance_group`` counts; none: 1)."""
    return sum(int(group.get("count", 1)) for group in model_config.get("instance_group") or [{}]) or 1


def in_process_endpoint(name: str) -> Callable:
    """The ``serve_for`` of the in-process endpoint ``name`` (``openai``: ``frontend.openai.in_process``), found by its
    entry point in ``ENDPOINTS``: the frontend plugs into the server, which never imports it. Missing (the project
    not installed): ``TritonModelException`` saying so."""
    found = [point for point in entry_points(group=ENDPOINTS) if point.name == name]
    if not found:
        raise pb_utils.TritonModelException(f"no in-process endpoint {name!r} is installed (entry point group "
                                            f"{ENDPOINTS}); install the project: pip install -e .")
    return found[0].load()
