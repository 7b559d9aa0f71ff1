"""The simulator: a topology (``Layout``: replicas per stage, the split, routing, batching, admission) under a
workload, on SimPy, predicting TTFT/TPOT/E2E percentiles, requests/s, goodput and each stage's utilisation.

A request, as the orchestrator (``orchestrator/core.py``) takes it: the client's work, admission at arrival (the
gates' estimates against ``max_queue_ms``: refused at once, ``shed``), the orchestrator's work, its items to the
encoder replicas (each to the one with the fewest outstanding items), the encoder's gate held meanwhile; then the
generator's gate, the pd (or prefill) replica with the fewest outstanding requests, the embeddings pulled by that
replica's stub, the engine (continuous batching); E/P/D: prefill's one token, the KV pulled by a decode replica, the
tokens from decode. The baseline (``llm``) engine encodes the media itself, in its prefill step. Tokens reach the
user through the stub, tritonserver's frontend threads, the orchestrator (the epd stub) and the client
(``stages.Engine``), each a process of its own running in parallel with the others; each process's per-request work
is split into a share before the first token and the rest after the end, on its own thread (the engine's: between its
steps), with the requests in flight where it runs (``Profile.cost``). Every piece of work runs on the
profile's ``cores`` (a CPU machine's processes share them) or, with 0 cores, on its own device.

    python -m clients.plan.simulate WORKLOAD PROFILE [--split E+PD] [--encoders 1] [--pd 1] ...
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import simpy

from clients.bench.report import percentile
from clients.plan import profile as profiles
from clients.plan import workload as workloads
from clients.plan.profile import Profile
from clients.plan.resources import Cores, Gate
from clients.plan.stages import Encoder, Engine, Process, Sequence
from clients.plan.workload import Request, Workload

SPLITS = ("E+PD", "E/P/D", "llm")


@dataclass(frozen=True)
class Layout:
    """What the simulator serves: the split, replicas per stage (a replica: one engine, one encoder server), the
    embeddings' path, the engines' batching limits and the orchestrator's admission budgets (``AdmissionBudgets``'s
    fields)."""

    split: str = "E+PD"
    encoders: int = 1
    pd: int = 1
    prefill: int = 1
    decode: int = 1
    llm: int = 1
    encoder_instances: int = 1
    orchestrators: int = 1
    clients: int = 1  # the client's threads (the load generator's: the users, at scale)
    transfer_path: str = "shared_memory"
    max_num_seqs: int = 32
    max_batched_tokens: int = 8192
    admission: dict = field(default_factory=dict)

    def engines(self) -> dict[str, int]:
        return {"E+PD": {"pd": self.pd}, "E/P/D": {"prefill": self.prefill, "decode": self.decode},
                "llm": {"llm": self.llm}}[self.split]

    def devices(self) -> int:
        """GPUs (or CPU machines) it takes: one per engine replica and per encoder replica."""
        return sum(self.engines().values()) + (self.encoders if self.split != "llm" else 0)

    def label(self) -> str:
        counts = self.engines()
        if self.split == "llm":
            return f"{self.llm} llm"
        return f"{self.encoders}E+" + "+".join(f"{n}{name.upper()[0] if name != 'pd' else 'PD'}"
                                              for name, n in counts.items())


class Simulation:
    def __init__(self, layout: Layout, profile: Profile, workload: Workload):
        self.layout, self.profile, self.workload = layout, profile, workload
        self.env = env = simpy.Environment()
        self.cores = Cores(env, profile.cores, profile.background())
        ll = layout
        self.client = Process(env, self.cores, threads=ll.clients)
        self.orchestrator = Process(env, self.cores, threads=ll.orchestrators)
        self.frontend = Process(env, self.cores, threads=profile.frontend_threads * ll.orchestrators)
        self.inflight = 0
        self.encoders = [Encoder(env, self.cores, profile, ll.encoder_instances) for _ in range(ll.encoders)]
        for encoder in self.encoders:
            encoder.load = lambda: self.inflight  # the deployment's, as measure_gpu's encoders phases measure
        self.tiers: dict[str, list[tuple[Engine, Process]]] = {}
        for name, count in ll.engines().items():
            self.tiers[name] = [self._engine(name) for _ in range(count)]
        budgets = ll.admission
        reserve = budgets.get("high_priority_reserve_percent", 0) / 100.0
        generator = budgets.get("generator_requests_in_flight", 0)
        self.gates = {"encoder": Gate(env, budgets.get("encoder_items_in_flight", 0), reserve),
                      "pd": Gate(env, generator, reserve), "prefill": Gate(env, generator, reserve),
                      "decode": Gate(env, budgets.get("decode_requests_in_flight", 0), reserve), "llm": Gate(env, 0)}
        self.max_queue = budgets.get("max_queue_ms", 0) / 1000.0
        self.records: list[dict] = []

    def _engine(self, name: str) -> tuple[Engine, Process]:
        stub, p = Process(self.env, self.cores), self.profile
        engine = Engine(self.env, self.cores, p, [], self.layout.max_num_seqs, self.layout.max_batched_tokens)
        engine.load = lambda: self.inflight / len(self.tiers.get(name) or [None])  # its share, as profiles measure
        engine.relays = [(stub, lambda: p.cost("stub", engine.load()).slope)]
        if name != "prefill":
            engine.relays += [(process, lambda key=key: p.cost(key, self.inflight).slope)
                              for process, key in self._front()]
        return engine, stub

    def _front(self) -> list[tuple[Process, str]]:
        """The processes between the engines' stubs and the user, in a response's order."""
        return [(self.frontend, "frontend"), (self.orchestrator, "orchestrator"), (self.client, "client")]

    def _request_ms(self, key: str, load: float) -> float:
        """``key``'s per-request CPU ms with ``load`` requests in flight where it runs."""
        return self.profile.cost(key, load).base

    @staticmethod
    def _least(replicas: list):
        return min(replicas, key=lambda r: (r[0] if isinstance(r, tuple) else r).outstanding)

    def _encode(self, request: Request):
        gate = self.gates["encoder"]
        entered = yield from gate.enter(len(request.items), request.priority)
        jobs = []
        for item in request.items:
            encoder = self._least(self.encoders)
            jobs.append(self.env.process(encoder.encode(item)))
        yield simpy.AllOf(self.env, jobs)
        gate.leave(len(request.items), entered)

    def _generate(self, request: Request, stage: str, prefill: int, output: int, media_ms: float, pull_ms: float,
                  context: int = 0):
        """One engine call: the gate, the least-loaded replica, its stub's pull, the engine; returns the sequence
        (its ``first`` and ``done`` events fired)."""
        gate = self.gates[stage]
        entered = yield from gate.enter(1, request.priority)
        engine, stub = self._least(self.tiers[stage])
        engine.outstanding += 1
        share = self.profile.before_first
        yield from stub.work(pull_ms + share * self._request_ms("stub", engine.load()))
        seq = Sequence(prefill, output, request.priority, self.env.event(), self.env.event(), media_ms, context=context)
        seq.stub, seq.engine = stub, engine
        if self.profile.by_load("engine") and stage != "decode":
            seq.prefill_ms = self.profile.engine_before_first(engine.load()) * self._request_ms("engine", engine.load())
        engine.submit(seq)
        yield seq.done
        engine.outstanding -= 1
        gate.leave(1, entered)
        return seq

    def _passes(self, request: Request) -> list[tuple[Gate, int]]:
        first = {"E+PD": "pd", "E/P/D": "prefill", "llm": "llm"}[self.layout.split]
        return ([(self.gates["encoder"], len(request.items))] if request.items and self.layout.split != "llm" else []) \
            + [(self.gates[first], 1)]

    def request(self, request: Request):
        p, ll = self.profile, self.layout
        record = {"index": request.index, "priority": request.priority, "sent": self.env.now, "shed": False,
                  "tokens": request.output_tokens}
        self.records.append(record)
        self.inflight += 1
        share = p.before_first
        yield from self.client.work(share * self._request_ms("client", self.inflight))
        yield self.env.timeout(p.hop_ms() / 1000.0)
        if self.max_queue and sum(g.estimate(c, request.priority) for g, c in self._passes(request)) > self.max_queue:
            record["shed"] = True
            self.inflight -= 1
            return
        for process, key in self._front()[:2]:  # tritonserver takes the request, then the orchestrator's stub
            yield from process.work(share * self._request_ms(key, self.inflight))
        media_tokens = sum(p.tokens(i) for i in request.items)
        prompt = request.prompt_tokens + media_tokens
        if ll.split == "llm":  # the engine's steps encode its share of the media; its stub processes the rest
            media_ms, share = sum(p.encode_ms(i) for i in request.items), float(p.doc.get("engine_media_share", 1.0))
            seq = yield from self._generate(request, "llm", prompt, request.output_tokens, share * media_ms,
                                            (1 - share) * media_ms)
            return self._finish(record, seq)
        if request.items:
            started = self.env.now
            yield from self._encode(request)
            record["encode_ms"] = (self.env.now - started) * 1000
        pull = p.transfer_ms(media_tokens, ll.transfer_path) if request.items else 0.0
        if ll.split == "E+PD":
            seq = yield from self._generate(request, "pd", prompt, request.output_tokens, 0.0, pull)
            return self._finish(record, seq)
        yield from self._generate(request, "prefill", prompt, 1, 0.0, pull)
        seq = yield from self._generate(request, "decode", 0, request.output_tokens, 0.0, p.kv_transfer_ms(prompt), prompt)
        return self._finish(record, seq)

    def _finish(self, record: dict, seq: Sequence) -> None:
        """Record the request's first token and end; the per-request work done after the end goes on (the cores)."""
        record["first"], record["end"], record["responses"] = seq.first.value, seq.done.value, seq.responses
        record["emitted_ms"] = (seq.emitted - record["sent"]) * 1000
        after, engine = 1.0 - self.profile.before_first, seq.engine
        if after > 0:
            for process, key in self._front():
                self.env.process(process.work(after * self._request_ms(key, self.inflight)))
            self.env.process(seq.stub.work(after * self._request_ms("stub", engine.load())))
        if self.profile.by_load("engine"):  # what the prefill step did not do, on the engine that answered
            load = engine.load()
            engine.chore((1.0 - self.profile.engine_before_first(load)) * self._request_ms("engine", load))
        engine.chore(float(self.profile.doc.get("engine_after_ms", 0.0)))  # on the engine's thread, between steps
        self.inflight -= 1

    def _open_loop(self, requests: list[Request]):
        for request in requests:
            yield self.env.timeout(max(0.0, request.at - self.env.now))
            self.env.process(self.request(request))

    def _closed_client(self, queue: list[Request]):
        while queue:
            yield self.env.process(self.request(queue.pop(0)))

    def run(self) -> dict:
        requests = self.workload.draw()
        if self.workload.process == "closed":
            for _ in range(self.workload.concurrency):
                self.env.process(self._closed_client(requests))
        else:
            self.env.process(self._open_loop(requests))
        self.env.run()
        return summary(self)


def summary(sim: Simulation) -> dict:
    """The run's figures: latencies (ms) of the requests served, requests/s from the first sent to the last answered,
    goodput (served within the workload's SLO, per second), shed share, each stage's utilisation."""
    served = [r for r in sim.records if "end" in r]
    wall = (max(r["end"] for r in served) - min(r["sent"] for r in sim.records)) if served else float("nan")
    ttft = [(r["first"] - r["sent"]) * 1000 for r in served]
    e2e = [(r["end"] - r["sent"]) * 1000 for r in served]
    tpot = [(r["end"] - r["first"]) * 1000 / (r["tokens"] - 1) for r in served if r["tokens"] > 1]
    w = sim.workload
    good = [r for r in served if (not w.slo_ttft_ms or (r["first"] - r["sent"]) * 1000 <= w.slo_ttft_ms) and
            (not w.slo_tpot_ms or r["tokens"] < 2 or
             (r["end"] - r["first"]) * 1000 / (r["tokens"] - 1) <= w.slo_tpot_ms)]
    out = {"layout": sim.layout.label(), "served": len(served), "shed": sum(r["shed"] for r in sim.records),
           "wall_s": wall, "req_per_s": len(served) / wall if served else 0.0,
           "goodput": len(good) / wall if served else 0.0}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q)
        out[f"{name}_mean_ms"] = sum(values) / len(values) if values else float("nan")
    for key in ("encode_ms", "emitted_ms"):  # the encoder call; from sent to the engine's first token
        out[f"{key[:-3]}_p50_ms"] = percentile([r[key] for r in served if key in r], 50)
    out["responses_per_request"] = sum(r["responses"] for r in served) / len(served) if served else float("nan")
    out["utilisation"] = utilisation(sim, wall)
    return out


def utilisation(sim: Simulation, wall: float) -> dict[str, float]:
    """Busy share of each stage's servers over the run (encoder: its instances; an engine: stepping)."""
    if not wall or wall != wall:
        return {}
    out = {}
    if sim.encoders and sim.layout.split != "llm":
        out["encoder"] = sum(e.busy for e in sim.encoders) / (wall * sum(e.instances for e in sim.encoders))
    for name, replicas in sim.tiers.items():
        out[name] = sum(engine.busy for engine, _ in replicas) / (wall * len(replicas))
    out["orchestrator"] = sim.orchestrator.busy / (wall * sim.layout.orchestrators)
    out["frontend"] = sim.frontend.busy / (wall * sim.frontend.slot.capacity)
    out["client"] = sim.client.busy / wall
    if sim.cores.cores:
        out["cores"] = sim.cores.busy / (wall * sim.cores.cores)
    return {k: round(v, 3) for k, v in out.items()}


def simulate(layout: Layout, profile: Profile, workload: Workload) -> dict:
    return Simulation(layout, profile, workload).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Simulate a topology under a workload (docs/planning.md).")
    parser.add_argument("workload", type=Path)
    parser.add_argument("profile", type=Path)
    for f in fields(Layout):
        if f.name != "admission":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--admission", type=json.loads, default={}, help="JSON: AdmissionBudgets' fields")
    args = parser.parse_args(argv)
    try:
        workload, profile = workloads.load(args.workload), profiles.load(args.profile)
    except (workloads.WorkloadError, profiles.ProfileError) as exc:
        parser.exit(2, f"error: {exc}\n")
    if args.split not in SPLITS:
        parser.exit(2, f"error: --split: expected one of {', '.join(SPLITS)}\n")
    layout = Layout(**{f.name: getattr(args, f.name) for f in fields(Layout)})
    print(json.dumps(simulate(layout, profile, workload), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
