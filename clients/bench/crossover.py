"""When does splitting stop paying? E+PD (``epd``) against the single engine (``llm``) over a grid of images per
request x output tokens, one concurrency, one server serving both: a table and a heat map of the ratios (issue 37,
item 5; docs/gpu.md, "The crossover map").

    .venv/bin/python -m clients.bench.crossover --topology topologies/checkpoint-gpu.yaml --checkpoint /tmp/q2b \\
        --compile --image-preprocess gpu --images 0,1,2,4,8 --max-tokens 16,128,512 --concurrency 32 \\
        --requests 64 --out $OUT/crossover

One tritonserver rendered from ``--topology`` with its ``baseline`` and ``E+PD`` deployments only (``--checkpoint``
in its checkpoint's place, ``--compile`` / ``--eager`` laid over every engine, ``--image-preprocess`` over the
encoder's), or a running one (``--url``: its gRPC host:port). A warm-up of ``--warmup`` requests per deployment at
the largest cell; then cell by cell (images, then tokens, in the given order) ``llm`` and ``epd`` in turn, each
driven closed loop over Triton's gRPC (``clients.bench.load.run_concurrency``) with the same ``--requests`` requests
of the cell (``clients.bench.load.synthetic_requests``: random-pixel PNGs of ``--image-sizes`` taken in turn, greedy,
``ignore_eos``), seeds no other cell uses (so neither the encoder's embedding cache nor a prefix cache serves one
cell's images to another), and the GPU's busy share over each row (``proc_cpu.GpuBusy``).

After every cell ``--out`` gets ``results.json`` (settings and rows), ``crossover.md`` (the rows and the ratios
E+PD / llm: requests/s, TTFT p90) and ``crossover.png`` (the two ratios as heat maps), so a run cut short keeps
the cells it finished; a later run with the same settings and ``--out`` goes on from there (``--fresh``: from the
start). ``--seconds`` stops before a cell that would start after that many seconds from the start of the run.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from pathlib import Path

from clients.bench import proc_cpu, report as bench_report
from clients.bench.load import run_concurrency, synthetic_requests
from clients.bench.served import refuse_with_url, served_arguments, served_topology

# (model on the server, topology mode), in the order driven per cell
DEPLOYMENTS = (("llm", "baseline"), ("epd", "E+PD"))
CELL_SEEDS = 100_000  # cell i's requests start at seed (i + 1) * CELL_SEEDS: no two cells share an image
WARMUP_SEED = 10**8
RATIOS = (("req_per_s", "requests/s", "higher: E+PD pays"), ("ttft_p90_ms", "TTFT p90", "lower: E+PD pays"))


def cells(images: list[int], tokens: list[int]) -> list[tuple[int, int]]:
    """The grid, images-major, in the order given."""
    return [(i, t) for i in images for t in tokens]


def complete_cells(rows: list[dict]) -> set[tuple[int, int]]:
    """The cells with a row of each deployment."""
    rows_of: dict[tuple[int, int], set[str]] = {}
    for r in rows:
        rows_of.setdefault((r["images"], r["max_tokens"]), set()).add(r["deployment"])
    return {cell for cell, names in rows_of.items() if names >= {model for model, _ in DEPLOYMENTS}}


def settings(args) -> dict:
    """What the rows depend on: a run goes on from an earlier one's rows only where these are equal."""
    return {"topology": str(args.topology), "checkpoint": str(args.checkpoint or ""), "url": args.url or "",
            "engines": "compile" if args.compile else "eager" if args.eager else "topology",
            "image_preprocess": args.image_preprocess or "topology", "kv_cache_gib": args.kv_cache_gib or "topology",
            "image_sizes": args.image_sizes,
            "concurrency": args.concurrency, "requests": args.requests}


def done_rows(path: Path, wanted: dict) -> list[dict]:
    """The rows of an earlier run in ``path`` with the same settings, else none."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return earlier.get("rows", []) if earlier.get("settings") == wanted else []


def ratio(rows: list[dict], images: int, tokens: int, key: str) -> float | None:
    """E+PD's ``key`` over llm's in the cell, or None (a deployment missing or without that figure)."""
    pair = {r["deployment"]: r.get(key) for r in rows if (r["images"], r["max_tokens"]) == (images, tokens)}
    llm, epd = pair.get("llm"), pair.get("epd")
    if not llm or epd is None or llm != llm or epd != epd:  # missing, zero or NaN
        return None
    return epd / llm


def table(rows: list[dict], images: list[int], tokens: list[int]) -> str:
    """The rows, then each ratio as a grid (images down, tokens across)."""
    lines = ["| images | tokens | deployment | req/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | errors | GPU busy % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        busy = "/".join(f"{v:g}" for v in r["gpu_busy_pct"]) if r.get("gpu_busy_pct") else "-"
        lines.append(f"| {r['images']} | {r['max_tokens']} | {r['deployment']} | {r['req_per_s']:.2f} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r.get('tpot_p50_ms') or 0:.1f} | "
                     f"{r['errors']} | {busy} |")
    for key, name, better in RATIOS:
        lines += ["", f"E+PD / llm, {name} ({better})", "",
                  "| images \\ tokens | " + " | ".join(map(str, tokens)) + " |", "|---" * (len(tokens) + 1) + "|"]
        for i in images:
            cells_text = [f"{v:.2f}" if (v := ratio(rows, i, t, key)) is not None else "-" for t in tokens]
            lines.append(f"| {i} | " + " | ".join(cells_text) + " |")
    return "\n".join(lines) + "\n"


def heat_map(rows: list[dict], images: list[int], tokens: list[int], path: Path, title: str) -> None:
    """The ratios as two heat maps side by side (green where E+PD pays, red where it costs), each cell annotated."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    fig, axes = plt.subplots(1, len(RATIOS), figsize=(5.2 * len(RATIOS), 0.6 * len(images) + 2.2))
    for ax, (key, name, better) in zip(axes, RATIOS):
        grid = np.array([[ratio(rows, i, t, key) or np.nan for t in tokens] for i in images], dtype=float)
        cmap = "RdYlGn" if key == "req_per_s" else "RdYlGn_r"
        shown = ax.imshow(grid, cmap=cmap, norm=LogNorm(vmin=0.25, vmax=4.0), aspect="auto")
        for (y, x), value in np.ndenumerate(grid):
            ax.text(x, y, "-" if np.isnan(value) else f"{value:.2f}x", ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set_yticks(range(len(images)), [str(i) for i in images])
        ax.set_xlabel("output tokens")
        ax.set_ylabel("images per request")
        ax.set_title(f"E+PD / llm {name}\n({better})", fontsize=10)
        bar = fig.colorbar(shown, ax=ax, shrink=0.8, ticks=[0.25, 0.5, 1, 2, 4])
        bar.ax.set_yticklabels(["0.25x", "0.5x", "1x", "2x", "4x"])
        bar.ax.minorticks_off()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


class Crossover:
    """One run: the grid's rows against one server."""

    def __init__(self, args, rows: list[dict]):
        self.args = args
        done = complete_cells(rows)  # a cell's rows are written together: one short of a deployment runs again
        self.rows = [r for r in rows if (r["images"], r["max_tokens"]) in done]
        self.sizes = [tuple(int(v) for v in s.split("x")) for s in args.image_sizes.split(",")]
        self.started = time.monotonic()

    def requests(self, images: int, tokens: int, count: int, first: int):
        return synthetic_requests(count, images, self.sizes, tokens, first)

    async def warm_up(self, url: str) -> None:
        a = self.args
        if a.warmup:
            for model, _ in DEPLOYMENTS:
                await run_concurrency(url, model, min(a.warmup, a.concurrency),
                                      self.requests(max(a.images), max(a.max_tokens), a.warmup, WARMUP_SEED), None)

    async def cell(self, url: str, index: int, images: int, tokens: int, server_pid: int | None) -> None:
        a = self.args
        requests = self.requests(images, tokens, a.requests, (index + 1) * CELL_SEEDS)
        for model, _ in DEPLOYMENTS:  # the same requests for both: neither engine's prefix cache has seen them
            cpu_before = proc_cpu.snapshot(server_pid)
            gpu = proc_cpu.GpuBusy()
            try:
                results, wall = await run_concurrency(url, model, a.concurrency, requests, None)
            finally:
                busy = gpu.stop()
            row = bench_report.summarise(model, "concurrency", a.concurrency, results.samples, len(results.errors),
                                         wall)
            row.update(deployment=model, images=images, max_tokens=tokens, gpu_busy_pct=busy,
                       cpu_ms=proc_cpu.per_request(cpu_before, proc_cpu.snapshot(server_pid), a.requests),
                       error_examples=[str(e)[:300] for e in results.errors[:3]])
            self.rows.append(row)
            print(f"{images} image(s), {tokens} tokens, {model}: {row['req_per_s']:.2f} req/s, TTFT p50/p90 "
                  f"{row['ttft_p50_ms']:.0f}/{row['ttft_p90_ms']:.0f} ms, {row['errors']} errors"
                  + (f", GPU busy {busy}%" if busy else "")
                  + (f" ({row['error_examples'][0]})" if row["errors"] else ""), file=sys.stderr, flush=True)

    def todo(self) -> list[tuple[int, tuple[int, int]]]:
        """(index in the grid, cell) of the cells without their rows yet."""
        done = complete_cells(self.rows)
        return [(n, cell) for n, cell in enumerate(cells(self.args.images, self.args.max_tokens)) if cell not in done]

    async def run(self, url: str, server_pid: int | None = None) -> None:
        a = self.args
        todo = self.todo()
        if todo:
            await self.warm_up(url)
        for left, (index, (images, tokens)) in zip(range(len(todo), 0, -1), todo):
            if a.seconds and time.monotonic() - self.started > a.seconds:
                print(f"stopped after {a.seconds:g} s: {left} cell(s) left for a later run with the same "
                      f"--out", file=sys.stderr, flush=True)
                return
            await self.cell(url, index, images, tokens, server_pid)
            write(self.args, self.rows)


def write(args, rows: list[dict]) -> str:
    args.out.mkdir(parents=True, exist_ok=True)
    run = settings(args)
    (args.out / "results.json").write_text(json.dumps({"settings": run, "rows": rows}, indent=1, default=str))
    text = (f"{args.requests} requests per row at concurrency {args.concurrency}, images of {args.image_sizes} px "
            f"taken in turn, greedy with ignore_eos; topology {args.topology}, checkpoint {args.checkpoint}, engines "
            f"{run['engines']}, image preprocessing {run['image_preprocess']}, KV budget per engine (GiB) "
            f"{run['kv_cache_gib']}\n\n"
            + table(rows, args.images, args.max_tokens))
    (args.out / "crossover.md").write_text(text)
    if rows:
        heat_map(rows, args.images, args.max_tokens, args.out / "crossover.png",
                 f"c={args.concurrency}, {args.requests} requests per cell, {args.checkpoint or args.topology}")
    return text


def serve_and_run(args, crossover: Crossover) -> None:
    import tempfile

    from backend.deploy.local_server import TritonServer
    from backend.deploy.render import render

    with tempfile.TemporaryDirectory(prefix="crossover-") as repo:
        served = render(served_topology(args, tuple(mode for _, mode in DEPLOYMENTS)), Path(repo))
        with TritonServer(Path(repo), log_path=args.out / "server.log") as server:
            print(f"server ready in {server.ready_seconds:.1f} s ({', '.join(served)})", file=sys.stderr, flush=True)
            asyncio.run(crossover.run(server.grpc_url, server.proc.pid))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from backend.deploy.local_server import ROOT
    from clients.bench.side_by_side import int_list

    counts = functools.partial(int_list, minimum=0)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", type=Path, default=ROOT / "topologies" / "default.yaml")
    served_arguments(parser)
    parser.add_argument("--images", type=counts, default=[0, 1, 2, 4, 8], help="images per request, the rows")
    parser.add_argument("--max-tokens", type=counts, default=[16, 128, 512], help="output tokens, the columns")
    parser.add_argument("--image-sizes", default="448x448,672x672,896x896", help="synthetic images: WxH,...")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64, help="requests per deployment and cell")
    parser.add_argument("--warmup", type=int, default=4, help="requests per deployment before the first cell")
    parser.add_argument("--url", help="a running server's gRPC host:port serving llm and epd (default: start one)")
    parser.add_argument("--seconds", type=float, help="start no cell after this many seconds")
    parser.add_argument("--fresh", action="store_true", help="ignore an earlier run's rows in --out")
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "crossover")
    args = parser.parse_args(argv)
    if min(args.max_tokens) < 1:
        parser.error("--max-tokens: at least 1 token")
    if args.concurrency < 1 or args.requests < 1:
        parser.error("--concurrency and --requests: at least 1")
    refuse_with_url(parser, args)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = [] if args.fresh else done_rows(args.out / "results.json", settings(args))
    if rows:
        print(f"going on from {len(rows)} row(s) in {args.out}/results.json", file=sys.stderr, flush=True)
    crossover = Crossover(args, rows)
    if not crossover.todo():
        print(f"every cell is in {args.out}/results.json (--fresh: run them again)", file=sys.stderr, flush=True)
    elif args.url:
        asyncio.run(crossover.run(args.url))
    else:
        serve_and_run(args, crossover)
    print(write(args, crossover.rows))
    return crossover.rows


if __name__ == "__main__":
    main()
