"""Requests and responses of the generate interface as a Triton model sees them (fake pb_utils objects)."""
from __future__ import annotations

import json

import numpy as np

from tests import fake_pb_utils as pb


def tensor(name: str, value) -> pb.Tensor:
    """A request tensor as Triton hands it over: strings as bytes (TYPE_STRING), a list as one item each."""
    if isinstance(value, bool):
        return pb.Tensor(name, np.array([value], dtype=bool))
    items = value if isinstance(value, list) else [value]
    return pb.Tensor(name, np.array([v.encode() if isinstance(v, str) else v for v in items], dtype=np.object_))


def generate_request(model: str = "llm", request_id: str = "", parameters: dict | None = None,
                     **inputs) -> pb.InferenceRequest:
    """A request to a generate model: ``inputs`` by tensor name (``sampling_parameters`` may be a dict)."""
    if isinstance(inputs.get("sampling_parameters"), dict):
        inputs["sampling_parameters"] = json.dumps(inputs["sampling_parameters"])
    return pb.InferenceRequest(model_name=model, inputs=[tensor(n, v) for n, v in inputs.items()],
                               requested_output_names=[], request_id=request_id, parameters=parameters)


def outputs(response: pb.InferenceResponse) -> dict:
    """A response's outputs by name: one value each (bytes decoded, numbers as int)."""
    values = {}
    for t in response.output_tensors():
        value = t.as_numpy().reshape(-1)[0]
        values[t.name()] = value.decode() if isinstance(value, bytes) else int(value)
    return values


def only_error(sender: pb.ResponseSender) -> pb.TritonError:
    """The error of a request answered with one final error response, and nothing else."""
    (response, flags), = sender.sent
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response.has_error(), sender.sent
    return response.error()
