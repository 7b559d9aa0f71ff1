"""The differential runner: every case through ``llm`` over gRPC (the baseline) and through ``epd`` and
``epd_disagg`` over gRPC and all three through the OpenAI endpoint, the requests of a window of cases sent at once in a
shuffled order by ``concurrency`` threads (so Triton's dynamic batcher puts items of different requests, cases and
deployments in one encoder batch), then compared:

- a valid case: every answer is the baseline's (text, prompt and output token counts, finish reason), or, where the
  baseline refused it, the same refusal (code and field; such a case is counted apart: ``refused``);
- an invalid case: every answer is INVALID_ARG (gRPC) / 400 (OpenAI) naming the field the case expects
  (``tests.differential.requests.expected_field``).

A failure is a ``Failure`` with the seed, the case, its shape and a replay command; ``recheck`` asks the baseline
and the failing deployment again one at a time (is it the batch mix, or the request alone?).
"""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from frontend.openai.translate import finish_reason as openai_finish
from tests.differential.cases import Case
from tests.differential.clients import Outcome, ask_grpc, ask_openai
from tests.differential.requests import Built, grpc_request, openai_request

MODELS = ("llm", "epd", "epd_disagg")
ROUTES = ("grpc", "openai")
BASELINE = ("llm", "grpc")


@dataclass
class Target:
    """Where requests go: Triton's gRPC address and the OpenAI endpoint's base URL (None: no OpenAI route)."""

    grpc_url: str
    openai_base: str | None = None
    models: tuple[str, ...] = MODELS

    def ask(self, model: str, built: Built) -> Outcome:
        if built.route == "grpc":
            return ask_grpc(self.grpc_url, model, built)
        return ask_openai(self.openai_base, model, built)


@dataclass
class Failure:
    case: Case
    model: str
    route: str
    got: Outcome
    want: str
    alone: str = ""  # recheck's finding

    def report(self) -> str:
        c = self.case
        return (f"MISMATCH family={c.family} seed={c.seed} case={c.index} {self.model} over {self.route}\n"
                f"  shape: {c.shape()}\n  want:  {self.want}\n  got:   {self.got.brief()}\n"
                + (f"  alone: {self.alone}\n" if self.alone else "")
                + f"  replay: python -m tests.differential --family {c.family} --seed {c.seed} --only {c.index}")


@dataclass
class Summary:
    cases: int = 0
    invalid: int = 0
    refused: int = 0  # valid by the generator, refused by the baseline (and by the rest alike)
    requests: int = 0
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def errors(self) -> list[Failure]:
        """Failures whose answer was not a refusal of the request (INTERNAL, UNAVAILABLE, timeouts, client errors)."""
        return [f for f in self.failures if f.got.code not in ("OK", "INVALID_ARG")]

    def line(self) -> str:
        return (f"{self.cases} cases ({self.invalid} invalid, {self.refused} valid ones refused by the baseline), "
                f"{self.requests} requests: {len(self.failures) - len(self.errors)} mismatches, "
                f"{len(self.errors)} errors, {self.seconds:.1f} s")


def _built(case: Case, routes: tuple[str, ...]) -> dict[str, Built]:
    out = {"grpc": grpc_request(case)}
    if "openai" in routes and (openai := openai_request(case)) is not None:
        out["openai"] = openai
    return out


def _verdict(built: Built, baseline: Outcome, got: Outcome, route: str) -> str | None:
    """What ``got`` should have been, or None when it is right. An answer that is neither a text nor a refusal of
    the request (INTERNAL, UNAVAILABLE, a timeout) is never right, whatever the baseline said."""
    if got.code not in ("OK", "INVALID_ARG"):
        return "an answer or INVALID_ARG" if built.expect is None else f"[INVALID_ARG] naming {built.expect}"
    if built.expect is not None:
        if got.code == "INVALID_ARG" and got.field == built.expect:
            return None
        return f"[INVALID_ARG] naming {built.expect}"
    if baseline.code != "OK":
        same = got.code == baseline.code and got.field == built.fields.get(baseline.field, baseline.field)
        return None if same else f"the baseline's refusal: {baseline.brief()}"
    if route == "grpc":
        same = (got.answer, got.token_ids) == (baseline.answer, baseline.token_ids)
    else:
        same = got.answer == (*baseline.answer[:3], openai_finish(baseline.finish_reason))
    return None if got.code == "OK" and same else f"the baseline's answer: {baseline.brief()}"


def run_window(cases: list[Case], target: Target, routes: tuple[str, ...], concurrency: int,
               rng: random.Random, summary: Summary) -> None:
    """Send every request of ``cases`` at once (shuffled), then compare; failures go into ``summary``."""
    built = {c.index: _built(c, routes) for c in cases}
    jobs = [(c, model, route) for c in cases for route in routes if route in built[c.index]
            for model in target.models if (model, route) != BASELINE] + [(c, *BASELINE) for c in cases]
    rng.shuffle(jobs)
    answers: dict[tuple, Outcome] = {}
    lock = threading.Lock()

    def send(job):
        case, model, route = job
        outcome = target.ask(model, built[case.index][route])
        with lock:
            answers[(case.index, model, route)] = outcome

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, jobs))
    summary.requests += len(jobs)
    for case in cases:
        mine = {key[1:]: got for key, got in answers.items() if key[0] == case.index}
        _compare(case, built[case.index], mine, summary)


def _compare(case: Case, built: dict[str, Built], answers: dict[tuple[str, str], Outcome], summary: Summary) -> None:
    """``case``'s answers (by (model, route)) against its baseline's and its expectation, into ``summary``."""
    baseline = answers[BASELINE]
    summary.cases += 1
    summary.invalid += case.invalid is not None
    summary.refused += case.invalid is None and baseline.code == "INVALID_ARG"
    if case.invalid is not None or baseline.code not in ("OK", "INVALID_ARG"):  # the baseline itself is checked
        _check(summary, case, built["grpc"], baseline, baseline, *BASELINE)
    for (model, route), got in sorted(answers.items()):
        if (model, route) != BASELINE:
            _check(summary, case, built[route], baseline, got, model, route)


def _check(summary: Summary, case: Case, built: Built, baseline: Outcome, got: Outcome, model: str,
           route: str) -> None:
    want = _verdict(built, baseline, got, route)
    if want is not None:
        summary.failures.append(Failure(case, model, route, got, want))


def recheck(failure: Failure, target: Target) -> None:
    """Ask the baseline and the failing deployment again, one after the other, and note whether they agree."""
    built = _built(failure.case, (failure.route,))
    base = target.ask(BASELINE[0], built["grpc"])
    got = target.ask(failure.model, built[failure.route])
    verdict = _verdict(built[failure.route], base, got, failure.route)
    if (failure.model, failure.route) == BASELINE:
        verdict = _verdict(built["grpc"], base, base, "grpc")
    failure.alone = "right when sent alone (the batch mix matters)" if verdict is None else \
        f"wrong alone too: baseline {base.brief()}; {failure.model} {got.brief()}"


def run(cases: list[Case], target: Target, routes: tuple[str, ...] = ROUTES, concurrency: int = 8,
        window: int = 24, seed: int = 0, on_window=None, recheck_failures: bool = True) -> Summary:
    """Every case, ``window`` cases at a time; ``on_window(summary)`` after each (progress)."""
    summary = Summary()
    started = time.monotonic()
    rng = random.Random(f"order:{seed}")
    for at in range(0, len(cases), window):
        before = len(summary.failures)
        run_window(cases[at:at + window], target, routes, concurrency, rng, summary)
        if recheck_failures:
            for failure in summary.failures[before:]:
                recheck(failure, target)
        summary.seconds = time.monotonic() - started
        if on_window:
            on_window(summary, summary.failures[before:])
    return summary
