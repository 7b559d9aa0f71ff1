"""Refusals for load answered at the endpoint (``make_app``), without a round trip to the model.

When a served model refuses a request for load (429 ``overloaded``: its orchestrator's admission, docs/interface.md,
"Priority, deadlines and admission"), the endpoint remembers it for a short window (``--shed-window-ms``, 50 ms by
default; 0: off): until then, requests to that model of the same priority or a lower one (a larger ``priority``
number; none given counts as 0) are answered the same 429 here, at once, with the same ``Retry-After`` (at least 1 s,
which the refused client was told anyway). Under overload these are most of the refusals, and they no longer cross
tritonserver and the orchestrator's loop, the busiest parts then. A higher-priority request is never refused for a
lower one's refusal, and the first request after the window asks the model again."""
from __future__ import annotations

import time
from typing import Callable

from frontend.openai.translate import ApiError


class EndpointRefusal(ApiError):
    """A refusal answered by the endpoint from a remembered one (it opens no window of its own)."""


class Shedding:
    def __init__(self, window: float = 0.05, clock: Callable[[], float] = time.monotonic):
        self.window, self.clock = window, clock
        self._refused: dict[str, dict[int, tuple[float, ApiError]]] = {}  # model -> priority -> when, the refusal

    def refused(self, model: str, priority: int, err: ApiError) -> None:
        """``model`` answered a request of ``priority`` with ``err``; remembered if it is a refusal for load."""
        if self.window > 0 and err.code == "overloaded" and not isinstance(err, EndpointRefusal):
            self._refused.setdefault(model, {})[priority] = (self.clock(), err)

    def check_body(self, body) -> None:
        """``check`` for a request body as it came (its ``model`` and ``priority``), before it is translated; a body
        whose priority is no integer >= 0 is left to the translation's error."""
        if not self._refused or not isinstance(body, dict):
            return
        priority = body.get("priority", 0)
        if isinstance(priority, int) and not isinstance(priority, bool) and priority >= 0:
            self.check(str(body.get("model")), priority)

    def check(self, model: str, priority: int) -> None:
        """Raise the remembered refusal when a request of ``priority`` to ``model`` comes within the window of a
        refusal of its priority or a higher one."""
        refused = self._refused.get(model)
        if not refused:
            return
        now = self.clock()
        for shed, (when, err) in list(refused.items()):
            if now - when >= self.window:
                del refused[shed]
                if not refused:
                    del self._refused[model]
            elif shed <= priority:
                raise EndpointRefusal(err.status, f"{err.message} (answered by the endpoint: {model} refused a priority "
                               f"{shed} request {1000 * (now - when):.0f} ms ago)", err.type, err.param, err.code,
                               err.retry_after)
