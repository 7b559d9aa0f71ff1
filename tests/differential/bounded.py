"""The bounded run of ``make test``: ``check(grpc_url, family)`` sends ``CASES`` cases of one family to a server the
e2e suite already runs (the session server for Qwen2-VL, the family modules' servers for the others), through an
OpenAI endpoint started in front of it for the run, and fails with every mismatch's report and replay command.
The seed is ``SEED`` unless ``EPD_DIFFERENTIAL_SEED`` says another (a CI job may vary it; a failure names it)."""
from __future__ import annotations

import os

from tests.differential.cases import generate_all
from tests.differential.families import family
from tests.differential.runner import Summary, Target, run

CASES = 48  # per family: two windows of 24 cases mixed at once
SEED = 35


def check(grpc_url: str, name: str, cases: int = CASES) -> Summary:
    """Run ``cases`` cases of family ``name`` against the server at ``grpc_url``; assert none failed."""
    from tests.e2e.conftest import openai_endpoint

    seed = int(os.environ.get("EPD_DIFFERENTIAL_SEED", SEED))
    with openai_endpoint(grpc_url) as base:
        summary = run(generate_all(family(name), seed, cases), Target(grpc_url, base), seed=seed)
    print(f"\n[differential] {name} seed {seed}: {summary.line()}")
    reports = "\n".join(failure.report() for failure in summary.failures[:12])
    assert not summary.failures, f"{len(summary.failures)} failures (seed {seed}):\n{reports}"
    assert summary.cases == cases and summary.invalid > 0
    return summary
