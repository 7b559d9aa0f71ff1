"""E2E: the differential harness's bounded run (``tests.differential``) on the session's server (Qwen2-VL,
``topologies/default.yaml``): seeded request mixes sent concurrently through llm, epd and epd_disagg over gRPC and the
OpenAI endpoint give llm's tokens, and the invalid ones INVALID_ARG (400) naming the field. The other families' runs
are in their modules, on their servers (``test_families.py``, ``test_audio.py``)."""
from __future__ import annotations

import pytest

from tests.differential import bounded

pytestmark = pytest.mark.e2e


def test_differential_cases_answer_as_llm(server):
    bounded.check(server.grpc_url, "qwen2_vl")
