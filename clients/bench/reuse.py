"""Reuse benchmark (issue 18): what the shared embedding tier, single-flight and demand-aware encoding save, in one run,
one markdown table side by side (``--json``: everything, with every agent turn).

Two deployments of ``--topology`` (default ``topologies/cpu-e-pd-tier.yaml``: 2 encoder instances, E+PD and ``llm``),
one after the other, each on a tritonserver of its own started here with explicit model control:
``caches``, the topology without its ``tier:`` block (per-instance caches only), and ``tier``, the topology as it is
(the shared Mooncake tier, started and stopped with the server). Parts (``--parts``, all by default):

- ``reassignment`` (a), on both: ``--requests`` requests x ``--images`` new images, then the encoder model is reloaded
  (unloaded, then loaded: fresh instances with empty caches, while the tier's holder keeps its entries), then the same
  requests again, so every image goes to an encoder instance that has not seen it. Re-encodes in phase 2 (the
  encoders' counters) and phase-2 TTFT p50/p90, both deployments, and the change.
- ``cold`` (b), on both: ``--cold`` concurrent requests carrying one new image: encodes with single-flight (tier) and
  without.
- ``agent`` (c), on ``caches``: ``--turns`` turns re-sending every earlier screenshot plus a new one, for each of
  ``--pauses``, background traffic of new images in the pauses; demand-aware encoding with retention ON against OFF
  (``clients.bench.reuse_agent``). Needs the topology's ``reuse:`` block (issue 18 items 3-4); without it the part is
  skipped and says so.
- ``lookup`` (e), on ``caches``: ``--lookup-requests`` cold requests (``--images`` new images each) one at a time,
  demand-aware on and off alternately: what a lookup that finds nothing costs a request's TTFT.
- ``cost`` (d), on ``tier``: a tier lookup (miss, hit, ``is_exist``, a claim; ``clients.bench.tier_lookup``), the bytes
  the pool holds, the master's and the holder's RSS/PSS.

Every ``epd`` answer is compared with ``llm``'s for the same request (greedy, ``ignore_eos``): a mismatch or an error
is counted in the table's last rows and listed after it. The baseline's answers are asked for once (on the first
server) and kept for the second. Both deployments' encoders get ``--encoder-cache-mib`` per instance (so that the
agent's background traffic churns them within a pause; the reassignment and cold parts do not depend on it: their
images are new to every instance that gets them).

    python -m clients.bench.reuse                                   # everything (~15 min on 2 busy cores)
    python -m clients.bench.reuse --parts reassignment,cold --requests 32 --json .cache/reuse.json
    python -m clients.bench.reuse --parts agent --pauses 0,5 --turns 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from clients.bench import reuse_parts as parts
from clients.bench.load import run_concurrency, synthetic_requests
from clients.bench.reuse_table import markdown

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("reassignment", "cold", "agent", "lookup", "cost")
DEPLOYMENTS = {"caches": ("reassignment", "cold", "agent", "lookup"), "tier": ("reassignment", "cold", "cost")}
EXPLICIT = ["--model-control-mode=explicit", "--load-model=*"]  # the encoder is reloaded between phases
START_SECONDS = 900.0  # a server's start on a busy 2-core machine took 110 s to over 300 s
WARM_SEEDS, COLD_SEED = 1_000_000, 3_000_000  # requests' seeds (synthetic_requests: images seed * 7 + i)


def sizes(text: str, flag: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag}: WxH[,WxH...], got {text!r}") from None
    if not out or any(len(s) != 2 or min(s) < 28 for s in out):
        raise argparse.ArgumentTypeError(f"{flag}: WxH[,WxH...] of at least 28x28, got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    p.add_argument("--topology", type=Path, default=ROOT / "topologies" / "cpu-e-pd-tier.yaml",
                   help="a topology with a tier: block (the caches deployment is it without the block)")
    p.add_argument("--requests", type=int, default=128, help="(a) requests per phase")
    p.add_argument("--images", type=int, default=4, help="(a) new images per request (1-7)")
    p.add_argument("--image-sizes", default="224x224,448x336,336x448,320x240", help="(a), (b) synthetic PNGs: WxH,...")
    p.add_argument("--concurrency", type=int, default=4, help="(a) closed-loop clients")
    p.add_argument("--cold", type=int, default=16, help="(b) concurrent requests of one new image")
    p.add_argument("--turns", type=int, default=10, help="(c) turns per conversation")
    p.add_argument("--pauses", default="0,5,30", help="(c) seconds between turns, one conversation pair each")
    p.add_argument("--screenshot-size", default="448x280", help="(c) the agent's screenshots (PNG): WxH")
    p.add_argument("--background-concurrency", type=int, default=2, help="(c) clients of background traffic in a pause")
    p.add_argument("--background-images", type=int, default=2, help="(c) new images per background request")
    p.add_argument("--background-size", default="672x420", help="(c) background images (JPEG): WxH")
    p.add_argument("--held-mib", type=int, default=2, help="(c) reuse.held_bytes: the consumer's copy (MiB)")
    p.add_argument("--session-seconds", type=float, default=60.0, help="(c) reuse.session_seconds: retention")
    p.add_argument("--session-mib", type=int, default=32, help="(c) reuse.session_bytes (MiB)")
    p.add_argument("--encoder-cache-mib", type=float, default=2.0, help="each encoder instance's own cache (MiB)")
    p.add_argument("--lookups", type=int, default=100, help="(d) lookups of each kind")
    p.add_argument("--lookup-requests", type=int, default=24, help="(e) cold requests per mode (on, off)")
    p.add_argument("--max-tokens", type=int, default=16, help="output length (greedy, ignore_eos)")
    p.add_argument("--json", type=Path, help="write every result here (JSON)")
    p.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench-reuse", help="server logs")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in args.parts if x not in PARTS]
    if not args.parts or unknown:
        p.error(f"--parts: comma-separated, of {', '.join(PARTS)}; got {','.join(args.parts) or 'nothing'}"
                + (f" ({', '.join(unknown)} unknown)" if unknown else ""))
    if not 1 <= args.images <= 7:
        p.error("--images: 1 to 7 (synthetic_requests gives request i the images of seeds 7i..7i+6)")
    for name in ("requests", "concurrency", "cold", "turns", "background_concurrency", "background_images", "lookups",
                 "lookup_requests", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: at least 1, got {getattr(args, name)}")
    try:
        args.pauses = [float(v) for v in args.pauses.split(",")]
        args.image_sizes = sizes(args.image_sizes, "--image-sizes")
        (args.screenshot_size,), (args.background_size,) = (sizes(args.screenshot_size, "--screenshot-size"),
                                                            sizes(args.background_size, "--background-size"))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        p.error(str(exc))
    if any(v < 0 for v in args.pauses):
        p.error(f"--pauses: seconds >= 0, got {args.pauses}")
    return args


def deployments(args) -> list[str]:
    """The deployments the parts asked for need, in the order they run."""
    return [name for name, runs in DEPLOYMENTS.items() if set(runs) & set(args.parts)]


def reuse_block(args) -> dict | None:
    """The topology's ``reuse:`` block for the agent part, where this checkout's topologies know one (None: not yet)."""
    from backend.deploy.schema import TOP_KEYS

    if "reuse" not in TOP_KEYS:
        return None
    return {"held_bytes": args.held_mib << 20, "session_seconds": args.session_seconds,
            "session_bytes": args.session_mib << 20, "demand_aware": False}


def topology_for(args, deployment: str, baseline: bool = True):
    """``--topology`` as the deployment serves it: ``caches`` without its ``tier:`` block; room for the agent's
    screenshots (``limits.max_images``); the ``reuse:`` block where there is one; ``llm`` only with ``baseline``."""
    import yaml

    from backend.deploy.topology import load

    doc = yaml.safe_load(args.topology.read_text())
    if "tier" not in doc:
        raise SystemExit(f"{args.topology}: no tier: block (the tier deployment is the topology with it)")
    doc["checkpoint"] = str((args.topology.parent / doc["checkpoint"]).resolve())
    doc["name"] = f"{doc.get('name', args.topology.stem)}-{deployment}"
    if deployment == "caches":
        doc.pop("tier")
    if not baseline:
        doc["serve"] = [mode for mode in doc["serve"] if mode != "baseline"]
        doc["stages"].pop("llm", None)
    limits = doc.setdefault("limits", {})
    limits["max_images"] = max(limits.get("max_images", 0), args.images, args.turns)
    if (block := reuse_block(args)) is not None:
        doc["reuse"] = block
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as out:
        yaml.safe_dump(doc, out)
    try:
        return load(Path(out.name), "cpu")
    finally:
        Path(out.name).unlink()


def set_parameter(config: Path, key: str, value) -> None:
    """A model parameter the topology has no key for (the encoder's ``cache_bytes``), into a rendered config.pbtxt."""
    text = config.read_text()
    if f'key: "{key}"' in text:
        raise ValueError(f"{config}: {key} is rendered already")
    config.write_text(text + f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n')


class Run:
    """One benchmark run: the requests, the baseline's answers, the results of every part."""

    def __init__(self, args):
        self.args = args
        a = args
        self.requests = synthetic_requests(a.requests, a.images, a.image_sizes, a.max_tokens)
        self.names = [f"reassignment {i}" for i in range(a.requests)]
        self.cold = synthetic_requests(1, 1, a.image_sizes[1:2] or a.image_sizes, a.max_tokens, COLD_SEED)[0]
        self.checker = parts.Checker()
        self.results: dict = {"settings": settings(args), "reassignment": {}, "cold": {}}
        self.seeds = WARM_SEEDS

    def fresh(self, count: int) -> list:
        """``count`` requests of images nobody sent before (warm-ups)."""
        self.seeds += count
        return synthetic_requests(count, self.args.images, self.args.image_sizes, self.args.max_tokens, self.seeds - count)

    async def on(self, server, deployment: str, progress) -> None:
        a, todo = self.args, [p for p in DEPLOYMENTS[deployment] if p in self.args.parts]
        await run_concurrency(server.grpc_url, "epd", 2, self.fresh(4), progress)  # warm: NIXL, first forwards
        if {"reassignment", "cold"} & set(todo):
            await parts.references(server.grpc_url, a.concurrency, [*self.requests, self.cold],
                                   [*self.names, "cold"], self.checker, progress)
        if "reassignment" in todo:
            self.results["reassignment"][deployment] = await parts.reassignment(
                server, self.requests, self.names, self.fresh(2 * a.concurrency), self.checker, deployment, a.concurrency,
                progress)
        if "cold" in todo:
            self.results["cold"][deployment] = await parts.cold(server, self.cold, "cold", a.cold, self.checker,
                                                                deployment, progress)
        if "agent" in todo:
            await self.agent(server, progress)
        if "lookup" in todo:
            if reuse_block(a) is not None:
                self.results["lookup"] = await parts.lookup_cost(server, self.fresh(a.lookup_requests), progress)
        if "cost" in todo:
            self.results["cost"] = await asyncio.to_thread(parts.cost, server, self.topology.checkpoint, a.lookups,
                                                           a.workdir)

    async def agent(self, server, progress) -> None:
        from clients.bench.reuse_agent import Background, agent

        a = self.args
        if reuse_block(a) is None:
            self.results["agent"] = {"skipped": "the topologies here have no reuse: block yet (issue 18 items 3-4: "
                                                "demand-aware encoding and retention)"}
            return
        background = Background(a.background_concurrency, a.background_images, a.background_size, a.max_tokens)
        self.results["agent"] = await agent(server, a.pauses, a.turns, a.screenshot_size, background, self.checker,
                                            a.max_tokens, progress)

    def serve(self, deployment: str) -> None:
        """Render the deployment, start its server (and tier), run its parts, stop it."""
        from backend.deploy.local_server import TritonServer
        from backend.deploy.render import render
        from tqdm import tqdm

        a = self.args
        # the baseline's answers come from the first server; the second serves E+PD alone (an idle llm engine
        # costs ~1% of a core, its start minutes on a busy machine)
        self.topology = topology_for(a, deployment, baseline=deployment == deployments(a)[0] and a.parts != ["cost"])
        a.workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"reuse-{deployment}-") as repo:
            render(self.topology, Path(repo))
            set_parameter(Path(repo) / "encoder" / "config.pbtxt", "cache_bytes", int(a.encoder_cache_mib * (1 << 20)))
            with TritonServer(Path(repo), log_path=a.workdir / f"server-{deployment}.log", extra_args=EXPLICIT,
                              start_timeout=START_SECONDS) as server:
                print(f"{deployment}: server ready in {server.ready_seconds:.1f} s"
                      f"{' (with the tier)' if server.tier else ''}", file=sys.stderr, flush=True)
                self.results.setdefault("ready_s", {})[deployment] = round(server.ready_seconds, 1)
                with tqdm(desc=f"requests ({deployment})", unit="req", file=sys.stderr, disable=a.no_progress) as bar:
                    asyncio.run(self.on(server, deployment, bar))


def settings(args) -> dict:
    out = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("json", "no_progress")}
    out["image_sizes"] = ["x".join(map(str, s)) for s in args.image_sizes]
    for key in ("screenshot_size", "background_size"):
        out[key] = "x".join(map(str, getattr(args, key)))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    run = Run(args)
    try:
        for deployment in deployments(args):
            run.serve(deployment)
            report(run, args, final=False)
    except BaseException as exc:  # what ran still reports (Ctrl-C, a server that did not start)
        run.results["failed"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        report(run, args)
    return run.results


def report(run: Run, args, final: bool = True) -> None:
    """The table on stdout (at the end), the JSON (``--json``, also after each deployment)."""
    run.results["checks"] = {"tally": run.checker.tally, "problems": run.checker.problems}
    if final:
        print(markdown(run.results), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(run.results, indent=2, default=str))


if __name__ == "__main__":
    main()
