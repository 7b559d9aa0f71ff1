"""The planner: replicas per stage for a workload, an SLO and a budget, written as a topology and a Kubernetes base.

    python -m clients.plan.planner WORKLOAD PROFILE --budget 8 [--goal goodput|hardware] [--splits E+PD,E/P/D] \
        --out DIR [--checkpoint PATH] [--device gpu]

Candidates: every split of at most ``--budget`` devices (GPUs; or, with a CPU profile, cores: the simulator's shared
cores are the budget) into encoders and engines (E+PD: pd; E/P/D: prefill and decode). Each is ranked by its analytic
capacity (``capacity``: the requests/s of its slowest stage, replicas over that stage's work per request), and the best
``--simulate`` of them are simulated under the workload at its rate. ``goodput``: the one serving most requests within
the SLO per second (ties: fewer devices); ``hardware``: the fewest devices whose simulated TTFT p90 and TPOT p90 meet
the SLO. Budgets above ``SLICE`` devices are planned on a slice of ``SLICE`` at the matching share of the rate, the
counts then scaled (a larger pool of the same ratio queues no longer: pooling only helps).
Written to ``--out``: ``topology.yaml`` (with its ``hosts:`` block, checked by ``backend.deploy.topology``; its
``engine_args`` the profile's and the layout's batch limit: ``engine_args``),
``kubernetes/`` (``backend.deploy.kubernetes``'s base, its autoscalers' targets from the plan: ``targets``), and
``plan.json`` (the candidates simulated, the choice, the targets and how they were derived).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from backend.deploy.schema import ENGINE_DEFAULTS
from clients.plan import profile as profiles
from clients.plan import workload as workloads
from clients.plan.profile import Profile
from clients.plan.simulate import Layout, Simulation
from clients.plan.workload import Workload

SLICE = 16
MEDIA_PART = "engine_media_share"  # profile: the share of the media's encoding a baseline engine does in its steps


def demands(profile: Profile, workload: Workload, max_seqs: int, encoder_instances: int = 1) -> dict[str, float]:
    """Seconds of a replica's time per request, per stage, at the engines' full batch (the workload's mean); the
    encoder's per instance: its line, or where the instances share one device for ``Profile.encoder_device_share`` of
    it, ``encoder_instances`` times that part where the device is what limits the replica."""
    requests = workload.draw()[:200]
    n = len(requests)
    encode = sum(sum(profile.encode_ms(i) for i in r.items) + (profile.line("encoder.batch").at(len(r.items))
                                                                  if r.items else 0.0) for r in requests) / n
    prompt = sum(r.prompt_tokens + sum(profile.tokens(i) for i in r.items) for r in requests) / n
    output = sum(r.output_tokens for r in requests) / n
    per_token = profile.step_ms(0, max_seqs, 0) / max_seqs
    prefill = profile.step_ms(round(prompt), 0, 0)
    share = float(profile.doc.get(MEDIA_PART, 1.0))
    device = profile.encoder_device_share
    sharing = max(1.0 - device, device * encoder_instances)
    return {k: v / 1000.0 for k, v in {"encoder": encode * sharing, "pd": prefill + output * per_token, "prefill": prefill,
                                         "decode": output * per_token,
                                         "llm": prefill + output * per_token + share * encode}.items()}


def capacity(layout: Layout, need: dict[str, float]) -> float:
    """Requests/s of the layout's slowest stage."""
    counts = dict(layout.engines())
    if layout.split != "llm":
        counts["encoder"] = layout.encoders * layout.encoder_instances
    return min(count / need[stage] if need[stage] > 0 else math.inf for stage, count in counts.items())


def candidates(budget: int, splits: list[str], base: Layout) -> list[Layout]:
    out = []
    for total in range(1, budget + 1):
        if "llm" in splits:
            out.append(replace(base, split="llm", llm=total))
        for e in range(1, total):
            if "E+PD" in splits:
                out.append(replace(base, split="E+PD", encoders=e, pd=total - e))
            if "E/P/D" in splits:
                out += [replace(base, split="E/P/D", encoders=e, prefill=p, decode=total - e - p)
                        for p in range(1, total - e)]
    return out


def meets(result: dict, workload: Workload) -> bool:
    return ((not workload.slo_ttft_ms or result["ttft_p90_ms"] <= workload.slo_ttft_ms) and
            (not workload.slo_tpot_ms or result["tpot_p90_ms"] <= workload.slo_tpot_ms) and result["served"] > 0)


def run(layout: Layout, profile: Profile, workload: Workload) -> tuple[dict, Simulation]:
    """The simulated run's figures (``simulate.summary``) and the simulation (``targets`` reads its stages)."""
    sim = Simulation(layout, profile, workload)
    return sim.run(), sim


def scaled(layout: Layout, factor: float, budget: int) -> Layout:
    """The layout's counts times ``factor``, at least 1 each, trimmed to ``budget`` devices (largest first)."""
    names = ["encoders", *layout.engines()] if layout.split != "llm" else ["llm"]
    counts = {n: max(1, round(getattr(layout, n) * factor)) for n in names}
    while sum(counts.values()) > budget:
        biggest = max(counts, key=counts.get)
        counts[biggest] -= 1
    return replace(layout, **counts, orchestrators=max(1, round(layout.orchestrators * factor)))


def plan(profile: Profile, workload: Workload, budget: int, goal: str = "goodput", splits=("E+PD", "E/P/D"),
         base: Layout = Layout(), simulate: int = 6) -> dict:
    """The chosen layout at ``budget`` and the candidates simulated (module docstring)."""
    if profile.cores:  # a CPU profile: the budget is the cores every replica shares
        profile = Profile({**profile.doc, "cores": budget})
    sliced = budget > SLICE and not profile.cores
    factor = budget / SLICE if sliced else 1.0
    small = workload.with_load(rate=workload.rate / factor) if sliced and workload.process == "poisson" else workload
    need = demands(profile, small, base.max_num_seqs, base.encoder_instances)
    pool = candidates(SLICE if sliced else budget, list(splits), base)
    if goal == "hardware":
        pool.sort(key=lambda c: (c.devices(), -capacity(c, need)))
        rate = small.rate or 0.0
        pool = [c for c in pool if capacity(c, need) >= rate / 0.9][: simulate * 3]
    else:
        pool.sort(key=lambda c: (-capacity(c, need), c.devices()))
        pool = pool[:simulate]
    tried, chosen = [], None
    for layout in pool:
        result, sim = run(layout, profile, small)
        tried.append({"layout": layout.label(), "devices": layout.devices(), "capacity": capacity(layout, need),
                      "meets_slo": meets(result, small), **{k: v for k, v in result.items() if k != "layout"}})
        if goal == "hardware" and meets(result, small):
            chosen = (layout, result, sim)
            break
        if goal == "goodput" and (chosen is None or (result["goodput"], -layout.devices()) >
                                  (chosen[1]["goodput"], -chosen[0].devices())):
            chosen = (layout, result, sim)
    if chosen is None:
        return {"chosen": None, "tried": tried, "budget": budget}
    layout, result, sim = chosen
    final = scaled(layout, factor, budget) if sliced else layout
    return {"chosen": final, "slice": layout.label() if sliced else None, "result": result, "tried": tried,
            "budget": budget, "targets": targets(sim, result, profile, small),
            "engine_args": engine_args(profile, final)}


def engine_args(profile: Profile, layout: Layout) -> dict:
    """The engines' vLLM arguments the plan assumed, for its topology (``emit``): the profile's
    (``Profile.engine_args``, its KV size among them) and the layout's batch limit."""
    return {**profile.engine_args, "max_num_seqs": layout.max_num_seqs}


def targets(sim: Simulation, result: dict, profile: Profile, workload: Workload) -> dict:
    """Each tier's autoscaler target from the planned run (``sim``, its figures ``result``): engines' KV-cache use at
    their mean batch and context (over their KV size: ``Profile.engine_args``), encoders' embedding bytes in flight
    per replica (Little's law: items per second times seconds in the stage), orchestrators' requests per second per
    replica."""
    wall = result["wall_s"]
    requests = workload.draw()
    mean_items = sum(len(r.items) for r in requests) / len(requests)
    tokens_per_item = (sum(profile.tokens(i) for r in requests for i in r.items) / max(1, sum(len(r.items) for r in requests)))
    context = sum(r.prompt_tokens + r.output_tokens / 2 for r in requests) / len(requests) + mean_items * tokens_per_item
    kv = profile.engine_args.get("kv_cache_memory_bytes")  # what the written topology gives the engines
    kv_cache = float(kv or ENGINE_DEFAULTS["kv_cache_memory_bytes"])
    kv_source = "the profile's kv_cache_memory_bytes" if kv else "the topology's default kv_cache_memory_bytes"
    out = {}
    for stage, replicas in sim.tiers.items():
        batch = sum(e.batched for e, _ in replicas) / max(1, sum(e.steps for e, _ in replicas))
        used = batch * context * float(profile.doc.get("kv_bytes_per_token", 0)) / kv_cache
        out[stage] = {"metric": "epd_vllm_kv_cache_usage", "target": f"{max(1, round(1000 * min(1.0, used)))}m",
                      "from": f"mean batch {batch:.1f} x {context:.0f} tokens x kv_bytes_per_token / {kv_source}"}
    if sim.layout.split != "llm":
        rate = result["served"] / wall * mean_items / len(sim.encoders)
        held = max(0.001, sum(e.busy for e in sim.encoders) / max(1, result["served"] * mean_items))
        nbytes = rate * held * tokens_per_item * float(profile.doc.get("embedding_bytes_per_token", 0))
        out["encoder"] = {"metric": "epd_pool_used_bytes", "target": str(max(1, round(nbytes))),
                          "from": f"{rate:.1f} items/s per replica x {held * 1000:.1f} ms per item x bytes per item"}
    out["epd"] = {"metric": "epd_requests_per_second",
                  "target": f"{max(1, round(result['served'] / wall / sim.layout.orchestrators))}",
                  "from": "the planned requests/s per orchestrator replica"}
    return out


def main(argv: list[str] | None = None) -> int:
    from clients.plan.emit import write

    parser = argparse.ArgumentParser(description="Plan replicas per stage for an SLO; write the topology and its base.")
    parser.add_argument("workload", type=Path)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--budget", type=int, required=True, help="GPUs (a GPU profile) or cores (a CPU profile)")
    parser.add_argument("--goal", choices=("goodput", "hardware"), default="goodput")
    parser.add_argument("--splits", default="E+PD,E/P/D")
    parser.add_argument("--simulate", type=int, default=6, help="candidates simulated (the best by capacity)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", default="../models/tiny-qwen2-vl", help="the topology's checkpoint")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--max-replicas", type=int, default=0, help="autoscalers' ceiling (0: twice the plan's)")
    args = parser.parse_args(argv)
    try:
        workload, profile = workloads.load(args.workload), profiles.load(args.profile)
    except (workloads.WorkloadError, profiles.ProfileError) as exc:
        parser.exit(2, f"error: {exc}\n")
    result = plan(profile, workload, args.budget, args.goal, args.splits.split(","), simulate=args.simulate)
    if result["chosen"] is None:
        print(json.dumps(result["tried"], indent=1))
        parser.exit(1, f"no layout within {args.budget} meets the SLO at the workload's rate\n")
    layout = result["chosen"]
    ceiling = args.max_replicas or 2 * max(layout.devices(), 1)
    problems = write(result, args.out, args.checkpoint, args.device, workload.name, ceiling)
    print(f"chosen: {layout.label()} ({layout.devices()} devices) -> {args.out}/topology.yaml, {args.out}/kubernetes/")
    for row in result["tried"]:
        print(f"  {row['layout']:>14}: capacity {row['capacity']:.1f}/s, goodput {row['goodput']:.2f}/s, "
              f"TTFT p90 {row['ttft_p90_ms']:.0f} ms, TPOT p90 {row['tpot_p90_ms']:.1f} ms, SLO {row['meets_slo']}")
    if problems:
        print("the Kubernetes base does not validate:\n" + "\n".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
