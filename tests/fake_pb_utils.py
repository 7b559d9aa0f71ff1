"""A fake ``triton_python_backend_utils`` (pb_utils) for unit tests of the Triton adapters (``backend/triton/``).

Who uses it: ``tests/unit/triton/conftest.py`` installs it as ``sys.modules["triton_python_backend_utils"]`` before any
adapter is imported, and ``reset``s it before each test. It holds only what the project's code uses (``grep
pb_utils\\.`` under ``backend/`` and ``model_repository/``), each with the real stub's semantics where a test could
tell them apart (python_backend ``src/response_sender.cc``, ``pb_error.h``, ``metric_family.cc``,
``triton_python_backend_utils.py``):

- ``Tensor`` (a name and a numpy array), ``get_input_tensor_by_name`` / ``get_output_tensor_by_name`` (None: absent);
- ``InferenceRequest``: a request given to ``execute`` (``request_id``, ``parameters`` as JSON text,
  ``get_response_sender``, ``cancel`` to play the client going away) and a BLS request (``exec`` / ``async_exec``,
  answered by the handler a test ``serve``s for that model, recorded in ``bls_requests``);
- ``ResponseSender``: records each ``(response, flags)``; flags other than 0 and the final flag, a response-less send
  without the final flag, and any send after the final flag raise ``TritonModelException``, as the stub's do;
- ``InferenceResponse``, ``TritonError`` (its codes), ``TritonModelException``, ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``;
- ``MetricFamily`` / ``Metric``: one registry (a family name registered again with another kind fails; metrics of
  one family with equal labels share one series); counters only go up, gauges are set, histograms need buckets
  and are observed; ``series`` reads a series back;
- ``Logger`` (records to ``logged``), ``using_decoupled_model_transaction_policy``.

Not faked (unused): decoupled BLS (``exec(decoupled=True)``, ``stream_exec``), DLPack, auto-complete config.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonModelException(Exception):
    """What the stub raises for a misuse of its API (and what ``initialize`` raises to fail a load)."""


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {code_name(self._code)})"


def code_name(code: int) -> str:
    """``TritonError.INVALID_ARG`` -> ``"INVALID_ARG"`` (for assertions and messages)."""
    return next(n for n in ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
                            "ALREADY_EXISTS", "CANCELLED") if getattr(TritonError, n) == code)


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"Tensor {name!r}: expected a numpy array, got {type(array).__name__}")
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def is_cpu(self) -> bool:
        return True


def _by_name(tensors, name: str) -> Tensor | None:
    return next((t for t in tensors if t.name() == name), None)


def get_input_tensor_by_name(request: "InferenceRequest", name: str) -> Tensor | None:
    return _by_name(request.inputs(), name)


def get_output_tensor_by_name(response: "InferenceResponse", name: str) -> Tensor | None:
    return _by_name(response.output_tensors(), name)


class InferenceResponse:
    def __init__(self, output_tensors=None, error: TritonError | None = None, parameters=None):
        self._outputs, self._error = list(output_tensors or ()), error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ResponseSender:
    """A decoupled request's sender; ``sent``: each ``(response or None, flags)``, in order."""

    def __init__(self, request: "InferenceRequest"):
        self._request, self.sent, self.closed = request, [], False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException("Inference Response object must be provided when the response flags is "
                                       "set to zero.")
        if self.closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        self.closed = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()

    @property
    def responses(self) -> list[InferenceResponse]:
        """The responses sent (a bare final flag is not one)."""
        return [response for response, _ in self.sent if response is not None]


def _parameters_text(parameters) -> str:
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):
        return parameters
    for key, value in parameters.items():
        if not isinstance(value, (str, int, bool)):
            raise TritonModelException(f"Expected a string, integer or boolean for parameter {key!r}, "
                                       f"got {type(value).__name__}")
    return json.dumps(parameters)


class InferenceRequest:
    def __init__(self, model_name: str, inputs, requested_output_names, request_id: str = "", correlation_id=0,
                 parameters=None, flags: int = 0, timeout: int = 0, model_version: int = -1):
        self.model_name = model_name
        self._inputs, self._outputs = list(inputs), list(requested_output_names)
        self._request_id, self._parameters = request_id, _parameters_text(parameters)
        self._cancelled, self._sender = False, None

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def request_id(self) -> str:
        return self._request_id

    def parameters(self) -> str:
        return self._parameters

    def get_response_sender(self) -> ResponseSender:
        if self._sender is None:
            self._sender = ResponseSender(self)
        return self._sender

    def is_cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Not pb_utils': the test's client cancels the request (``is_cancelled`` of it and its sender)."""
        self._cancelled = True

    def exec(self, decoupled: bool = False) -> InferenceResponse:
        if decoupled:
            raise NotImplementedError("the fake has no decoupled BLS (the project does not use it)")
        bls_requests.append(self)
        handler = _served.get(self.model_name)
        if handler is None:
            return InferenceResponse(error=TritonError(
                f"Request for unknown model: '{self.model_name}' is not found", TritonError.NOT_FOUND))
        return handler(self)

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse:
        return self.exec(decoupled)


def serve(model_name: str, handler: Callable[[InferenceRequest], InferenceResponse]) -> None:
    """Answer BLS requests to ``model_name`` with ``handler`` (until ``reset``)."""
    _served[model_name] = handler


# -- metrics ------------------------------------------------------------------------------------------------------
@dataclass
class Series:
    """One metric series (a family and its label values): a counter's or gauge's value, a histogram's observations."""

    kind: int
    value: float = 0.0
    observations: list[float] = field(default_factory=list)
    buckets: tuple[float, ...] = ()


class Metric:
    def __init__(self, family: "MetricFamily", series: Series):
        self._family, self._series = family, series

    def increment(self, value: float) -> None:
        kind = self._series.kind
        if kind == MetricFamily.HISTOGRAM or (kind == MetricFamily.COUNTER and value < 0):
            raise TritonModelException(f"{self._family.name}: increment by {value} not allowed on this metric")
        self._series.value += value

    def set(self, value: float) -> None:
        if self._series.kind != MetricFamily.GAUGE:
            raise TritonModelException(f"{self._family.name}: only a gauge can be set")
        self._series.value = value

    def observe(self, value: float) -> None:
        if self._series.kind != MetricFamily.HISTOGRAM:
            raise TritonModelException(f"{self._family.name}: only a histogram is observed")
        self._series.observations.append(value)

    def value(self) -> float:
        if self._series.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException(f"{self._family.name}: a histogram has no single value")
        return self._series.value


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

    def __init__(self, name: str, description: str, kind: int):
        known = families.get(name)
        if known is not None and known != kind:
            raise TritonModelException(f"metric family {name!r} already registered with another kind")
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise TritonModelException(f"metric family {name!r}: unknown kind {kind!r}")
        families[name] = kind
        self.name, self.description, self.kind = name, description, kind

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802
        if (self.kind == self.HISTOGRAM) != (buckets is not None):
            raise TritonModelException(f"{self.name}: buckets are given for a histogram, and only for one")
        if any(not isinstance(v, str) for v in (labels or {}).values()):
            raise TritonModelException(f"{self.name}: label values must be strings, got {labels}")
        key = (self.name, frozenset((labels or {}).items()))
        series = _series.setdefault(key, Series(self.kind, buckets=tuple(buckets or ())))
        return Metric(self, series)


def series(name: str, **labels: str) -> Series:
    """The series of family ``name`` with exactly these labels (KeyError: none was made)."""
    return _series[name, frozenset(labels.items())]


def labelled(name: str) -> list[dict[str, str]]:
    """The label sets of every series of family ``name``."""
    return [dict(key[1]) for key in _series if key[0] == name]


# -- logging and config -------------------------------------------------------------------------------------------
def _logs_at(level: str):
    return staticmethod(lambda message: logged.append((level, message)))


class Logger:
    log_info, log_warn, log_error, log_verbose = (_logs_at(level) for level in ("INFO", "WARNING", "ERROR", "VERBOSE"))


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    policy = model_config.get("model_transaction_policy")
    return bool(policy and policy.get("decoupled"))


# -- the fake's state ---------------------------------------------------------------------------------------------
bls_requests: list[InferenceRequest] = []  # every BLS request, in order
logged: list[tuple[str, str]] = []  # (level, message)
families: dict[str, int] = {}  # family name -> kind
_series: dict[tuple, Series] = {}
_served: dict[str, Callable[[InferenceRequest], InferenceResponse]] = {}


def reset() -> None:
    """Forget every BLS request and handler, log line and metric (before each test)."""
    for state in (bls_requests, logged, families, _series, _served):
        state.clear()


def install() -> None:
    """Make ``import triton_python_backend_utils`` give this module (the real one only exists inside a stub)."""
    sys.modules["triton_python_backend_utils"] = sys.modules[__name__]
