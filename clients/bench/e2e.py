"""End-to-end serving benchmark: several deployments side by side, one run, one table.

Deployments (``--models``): ``llm`` (the baseline), ``epd`` (E+PD), ``epd_naive`` (E+PD with metadata-only
off: the consumer also gets the original media and decodes/preprocesses it, as a naive EPD),
``epd_colocated`` (E+PD with the orchestrator colocated with the pd engine: ``stages.pd.orchestrator:
colocated``; its server is rendered so, whatever ``--topology`` says), ``epd_disagg`` (E/P/D),
``epd_disagg_naive`` and ``epd_disagg_colocated`` (E/P/D with the orchestrator colocated with the prefill engine:
``stages.prefill.orchestrator: colocated``, rendered so likewise), ``epd_nvdec`` (E+PD whose encoder decodes videos
on its GPU: ``stages.encoder.video_decoder: nvdec``; a GPU topology), ``epd_gpu_image`` / ``epd_nvjpeg`` (E+PD whose
encoder preprocesses images on its GPU, JPEGs decoded by nvJPEG with the second: ``stages.encoder.image_preprocess``;
``--image-format JPEG`` sends JPEGs), ``epd_gpu_image_graphs`` (``epd_gpu_image`` whose encoders replay their tower as CUDA
graphs: ``stages.encoder.cuda_graphs``), ``p_d`` (P/D: E/P/D's prefill and decode without
the encoders, request parameter ``epd_encode=false``; each engine processes the media, as vLLM's own P/D). Load (``clients.bench.load``): a concurrency sweep (closed loop,
``--concurrency``) or Poisson arrivals at given request rates (open loop, ``--rate``); or, with
``--load-generator perf_analyzer``, the concurrency sweep sent by Triton's C++ perf_analyzer, TTFT and
latencies read from its profile export (``clients.bench.perf_analyzer.load_level``; the load generator shares
the server's cores, and the Python one costs ~2-3 ms of CPU per request). Dataset: synthetic
images (``--image-sizes``) or ``--image-dir``; ``--images`` per request; ``--modalities image,video`` adds rows of
synthetic MP4 clips (``--videos`` per request, ``--video-size``, ``--video-frames``, ``--video-fps``) beside the
image rows, in the same run; ``--modalities audio`` rows of synthetic WAV files (``--audios`` per request,
``--audio-seconds``, ``--audio-rate``), on an audio checkpoint's topology (``--topology topologies/cpu-audio.yaml``);
``--max-tokens`` greedy tokens with ignore_eos. Reported per deployment and load level (``clients.bench.report``): requests/s, tokens/s,
TTFT, time per output token and end-to-end latency p50/p90/p99, the p50 stage breakdown from the
orchestrators' ``timings`` (encode, transfer, media, prefill, generate); a markdown table on stdout, a
progress bar on stderr, and with ``--out DIR`` results.json (rows and every sample), results.csv,
latency_cdf.png, ttft_cdf.png and throughput.png.

Servers: by default each deployment runs on a server of its own rendered from ``--topology``, one after
the other (on a 2-core machine, idle engines of the other deployments would otherwise share the cores);
deployments of one topology mode (``epd`` and ``epd_naive``) share their server and run in turn.
``--shared`` benchmarks the models of one server started on the committed repository instead (with ``--topology``:
that topology rendered with every deployment asked for, as on a GPU, where idle engines cost memory, not time), and
``--url`` a server that is already running. ``--checkpoint`` serves another checkpoint directory in the topology's
place. ``--compile`` runs the engines with torch.compile and CUDA graphs (and a GPU encoder's blocks compiled). On a
GPU, the GPU memory of each process after the warm-up is printed and written to results.json.

    python -m clients.bench.e2e --models llm,epd,epd_disagg --concurrency 1,4,16 --requests 200 --compile
    python -m clients.bench.e2e --models epd,epd_naive --rate 5,10 --requests 100 --images 2 --out .cache/bench
    python -m clients.bench.e2e --shared --topology topologies/checkpoint-gpu.yaml --checkpoint /tmp/q2b --compile \
        --images 4 --image-sizes 448x448,672x672,896x896 --max-tokens 128 --concurrency 1,8,32,64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from clients.bench import report as bench_report
from clients.bench.load import (folder_images, folder_requests, run_concurrency, run_rate, synthetic_requests,
                                synthetic_audio_requests, synthetic_video_requests)

NAIVE = {"epd_metadata_only": False}
P_D = {"epd_encode": False}  # E/P/D's prefill and decode without the encoders: they process the media themselves
# deployment -> (label, topology mode, model name on the committed repository, request parameters)
DEPLOYMENTS = {
    "llm": ("llm (one engine)", "baseline", "llm", None),
    "epd": ("E+PD", "E+PD", "epd", None),
    "epd_naive": ("E+PD naive (metadata-only off)", "E+PD", "epd", NAIVE),
    "epd_colocated": ("E+PD colocated", "E+PD", "epd", None),
    "epd_disagg": ("E/P/D", "E/P/D", "epd_disagg", None),
    "epd_disagg_naive": ("E/P/D naive (metadata-only off)", "E/P/D", "epd_disagg", NAIVE),
    "epd_disagg_colocated": ("E/P/D colocated", "E/P/D", "epd", None),
    "p_d": ("P/D (no encoder)", "E/P/D", "epd_disagg", P_D),
    "epd_nvdec": ("E+PD, videos decoded by NVDEC", "E+PD", "epd", None),
    "epd_gpu_image": ("E+PD, images preprocessed on the GPU", "E+PD", "epd", None),
    "epd_nvjpeg": ("E+PD, images preprocessed on the GPU, JPEGs by nvJPEG", "E+PD", "epd", None),
    "epd_gpu_image_graphs": ("E+PD, images preprocessed on the GPU, the tower as CUDA graphs", "E+PD", "epd", None),
}
# served by a rendering whose orchestrator runs in the model of the engine given the embeddings (pd / prefill)
COLOCATED = {"epd_colocated", "epd_disagg_colocated"}
# served by a rendering whose encoder works on its GPU: the encoder stage's keys that say so
ENCODER_VARIANTS = {"epd_nvdec": {"video_decoder": "nvdec"}, "epd_gpu_image": {"image_preprocess": "gpu"},
                    "epd_nvjpeg": {"image_preprocess": "nvjpeg"}, "epd_gpu_image_graphs": {"image_preprocess": "gpu", "cuda_graphs": True}}


def server_group(key: str) -> tuple[str, str, str]:
    """Deployments of one group share a server: (topology mode, where E+PD's orchestrator runs, the encoder's
    video decoder)."""
    return (DEPLOYMENTS[key][1], "colocated" if key in COLOCATED else "proxy",
            key if key in ENCODER_VARIANTS else "cpu")


class Bench:
    """One run's settings; ``run_server`` benchmarks deployments against one server."""

    def __init__(self, args):
        self.args = args
        self.mode = "rate" if args.rate else "concurrency"
        self.levels = [float(v) for v in (args.rate or args.concurrency).split(",")]
        self.media = folder_images(args.image_dir) if args.image_dir else None
        self.sizes = [tuple(int(v) for v in s.split("x")) for s in args.image_sizes.split(",")]
        self.modalities = args.modalities.split(",")
        self.label_modality = len(self.modalities) > 1  # rows say their workload (also when audio runs apart)
        self.rows: list[dict] = []
        self.samples: dict[tuple[str, float], list[bench_report.Sample]] = {}
        self.gpu_mib: dict[str, int] = {}

    def _fresh(self, count: int) -> int:
        """The first seed of ``count`` requests never sent before in this run: every level and deployment
        gets its own images, so neither the encoder's embedding cache nor vLLM's processor cache serves an
        image a previous row already sent."""
        self._next_seed = getattr(self, "_next_seed", 0) + count
        return self._next_seed - count

    def requests(self, count: int, parameters: dict | None, first: int = 0, modality: str = "image"):
        a = self.args
        if modality == "video":
            made = synthetic_video_requests(count, a.videos, tuple(int(v) for v in a.video_size.split("x")),
                                            a.video_frames, a.video_fps, a.max_tokens, first, a.video_codec)
        elif modality == "audio":
            made = synthetic_audio_requests(count, a.audios, a.audio_seconds, a.audio_rate, a.max_tokens, first)
        elif self.media is not None:
            made = folder_requests(self.media, count, a.images, a.max_tokens, first)
        else:
            made = synthetic_requests(count, a.images, self.sizes, a.max_tokens, first, a.image_format)
        for inputs in made:
            inputs.parameters = parameters
        return made

    async def _level(self, url: str, model: str, level: float, requests, progress):
        """(results, wall seconds, CPU seconds of a load generator process other than this one)."""
        if self.args.load_generator == "perf_analyzer":
            from backend.deploy.local_server import ROOT
            from clients.bench import perf_analyzer
            from clients.bench.load import Results

            samples, errors, wall, cpu = await asyncio.to_thread(
                perf_analyzer.load_level, url, model, int(level), requests, ROOT / ".cache" / "bench-perf-analyzer",
                self.args.max_tokens)
            results = Results(progress)
            results.samples, results.errors = samples, ["no final response"] * errors
            progress.update(len(requests))
            return results, wall, cpu
        if self.mode == "rate":
            return *await run_rate(url, model, level, requests, progress, seed=self.args.seed), 0.0
        return *await run_concurrency(url, model, int(level), requests, progress), 0.0

    async def run_server(self, url: str, deployments: list[tuple[str, str]], metrics_url: str | None = None,
                         server_pid: int | None = None) -> None:
        """``deployments``: (deployment key, model name on this server), benchmarked in turn; with ``metrics_url``
        each row gets ``vllm_queue_ms`` from the engines' queue-time metrics over its level; with ``server_pid``
        (a server started here) ``cpu_ms``: CPU ms per request of each of its processes and of the load generator
        (``clients.bench.proc_cpu``)."""
        from clients.bench import proc_cpu

        from tqdm import tqdm

        a = self.args
        total = len(deployments) * len(self.modalities) * (len(self.levels) * a.requests + a.warmup)
        with tqdm(total=total, desc=f"requests ({', '.join(k for k, _ in deployments)})", unit="req",
                  file=sys.stderr, disable=a.no_progress) as progress:
            for modality in self.modalities:
                for key, model in deployments:
                    await run_concurrency(url, model, 2, self.requests(a.warmup, DEPLOYMENTS[key][3], 10**6, modality),
                                          progress)
            if gpu := proc_cpu.gpu_memory(server_pid):  # after the warm-up: CUDA graphs and compiled blocks are in
                self.gpu_mib.update(gpu)
                print(f"GPU memory (MiB) by process: {gpu}", file=sys.stderr)
            rows, order = [], []
            for level in self.levels:  # deployments of one server alternate per level: drift hits them alike
                for modality, (key, model) in ((m, d) for m in self.modalities for d in deployments):
                    label, _, _, parameters = DEPLOYMENTS[key]
                    if self.label_modality:
                        label = f"{label} [{modality}]"
                    order.append((self.modalities.index(modality), [k for k, _ in deployments].index(key)))
                    requests = self.requests(a.requests, parameters, self._fresh(a.requests), modality)
                    before = _scrape(metrics_url)
                    cpu_before = proc_cpu.snapshot(server_pid)
                    results, wall, load_cpu = await self._level(url, model, level, requests, progress)
                    cpu = proc_cpu.per_request(cpu_before, proc_cpu.snapshot(server_pid), a.requests)
                    if load_cpu:  # perf_analyzer, a child process: with this one's (idle) share
                        cpu["load generator"] = round(cpu.get("load generator", 0.0) + load_cpu * 1000 / a.requests, 2)
                    rows.append(bench_report.summarise(label, self.mode, level, results.samples, len(results.errors), wall))
                    rows[-1]["cpu_ms"] = cpu
                    rows[-1]["cpu_busy"] = round(sum(cpu.values()) * a.requests / 1000 / wall / (os.cpu_count() or 1), 3)
                    if metrics_url:
                        rows[-1]["vllm_queue_ms"] = bench_report.engine_queue_ms(before, _scrape(metrics_url))
                    self.samples[(label, level)] = results.samples
                    r = rows[-1]  # as it finishes: what a run cut short still reports
                    print(f"{label} @ {level:g}: {r['req_per_s']:.2f} req/s, TTFT p50/p90 {r.get('ttft_p50_ms') or 0:.0f}/"
                          f"{r.get('ttft_p90_ms') or 0:.0f} ms, {r['errors']} errors, cpu_busy {r['cpu_busy']}",
                          file=sys.stderr, flush=True)
                    for error in results.errors[:3]:
                        print(f"{label} @ {level:g}: {error}", file=sys.stderr)
            self.rows += [row for _, row in sorted(zip(order, rows), key=lambda pair: pair[0])]  # stable: levels in turn

    def settings(self) -> dict:
        a = self.args
        return {"deployments": a.models.split(","), "mode": self.mode, "levels": self.levels, "requests": a.requests,
                "images": a.images, "dataset": str(a.image_dir) if a.image_dir else f"synthetic {a.image_sizes}",
                "modalities": self.modalities, "videos": a.videos if "video" in self.modalities else 0,
                "video": f"{a.video_size}, {a.video_frames} frames at {a.video_fps:g} fps" if "video" in self.modalities else "",
                "audios": a.audios if "audio" in self.modalities else 0,
                "audio": f"{a.audio_seconds:g} s at {a.audio_rate} Hz" if "audio" in self.modalities else "",
                "max_tokens": a.max_tokens, "warmup": a.warmup, "compile": a.compile, "seed": a.seed,
                "servers": "given" if a.url else "shared" if a.shared else "one per deployment",
                "stream_interval_ms": a.stream_interval_ms, "load_generator": a.load_generator,
                "topology": str(a.topology), "checkpoint": str(a.checkpoint or ""), "gpu_memory_mib": self.gpu_mib}


def _scrape(metrics_url: str | None) -> dict:
    if not metrics_url:
        return {}
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        return bench_report.parse_metrics(resp.read().decode())


def run_isolated(bench: Bench, keys: list[str]) -> None:
    """One server per topology mode, rendered from ``--topology``, started and stopped in turn."""
    import tempfile

    from backend.deploy.local_server import ROOT, TritonServer
    from backend.deploy.render import render
    from backend.deploy.topology import load

    a = bench.args
    base = load(a.topology, checkpoint=a.checkpoint)
    for mode, where, decoder in dict.fromkeys(server_group(k) for k in keys):
        group = [k for k in keys if server_group(k) == (mode, where, decoder)]
        changes = {} if a.stream_interval_ms is None else {"stream_interval_ms": a.stream_interval_ms}
        topology = base.only(mode, {"enforce_eager": False} if a.compile else None, **changes)
        if mode != "baseline":
            topology = topology.with_orchestrator(where, mode)
        if decoder != "cpu":
            topology = replace(topology, stages={**topology.stages, "encoder": replace(
                topology.stages["encoder"], **ENCODER_VARIANTS[decoder])})
        with tempfile.TemporaryDirectory(prefix="bench-") as repo:
            served = render(topology, Path(repo))
            target = "llm" if "llm" in served else "epd"
            (ROOT / ".cache").mkdir(exist_ok=True)
            log = ROOT / ".cache" / (f"bench-e2e-{mode.replace('/', '').replace('+', '')}"
                                     f"{'-' + where if mode != 'baseline' else ''}{'-' + decoder if decoder != 'cpu' else ''}.log")
            with TritonServer(Path(repo), log_path=log) as server:
                print(f"{mode}: server ready in {server.ready_seconds:.1f} s ({', '.join(served)})", file=sys.stderr)
                asyncio.run(bench.run_server(server.grpc_url, [(k, target) for k in group], server.metrics_url, server.proc.pid))


def run_shared_topology(bench: Bench, keys: list[str]) -> None:
    """One server rendered from ``--topology`` serving every deployment of ``keys`` side by side (all their
    engines loaded; a deployment not being asked stays idle); they alternate per level."""
    import tempfile

    from backend.deploy.local_server import ROOT, TritonServer
    from backend.deploy.render import render
    from backend.deploy.topology import load

    a = bench.args
    modes = tuple(dict.fromkeys(DEPLOYMENTS[k][1] for k in keys))
    changes = {} if a.stream_interval_ms is None else {"stream_interval_ms": a.stream_interval_ms}
    topology = load(a.topology, checkpoint=a.checkpoint).only(modes, {"enforce_eager": False} if a.compile else None,
                                                             **changes)
    with tempfile.TemporaryDirectory(prefix="bench-") as repo:
        served = render(topology, Path(repo))
        (ROOT / ".cache").mkdir(exist_ok=True)
        with TritonServer(Path(repo), log_path=ROOT / ".cache" / "bench-e2e-shared.log") as server:
            print(f"{' + '.join(modes)}: server ready in {server.ready_seconds:.1f} s ({', '.join(served)})", file=sys.stderr)
            asyncio.run(bench.run_server(server.grpc_url, [(k, DEPLOYMENTS[k][2]) for k in keys], server.metrics_url,
                                         server.proc.pid))


def write_outputs(bench: Bench, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(bench_report.results_json(bench.rows, bench.samples, bench.settings()),
                                                 indent=1, default=str))
    bench_report.write_csv(out / "results.csv", bench.rows)
    bench_report.plot_latency_cdf(bench.samples, out / "latency_cdf.png", "latency")
    bench_report.plot_latency_cdf(bench.samples, out / "ttft_cdf.png", "ttft")
    bench_report.plot_throughput(bench.rows, out / "throughput.png")
    print(f"wrote {out}/results.json, results.csv, latency_cdf.png, ttft_cdf.png, throughput.png", file=sys.stderr)


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llm,epd,epd_disagg", help=f"deployments, of {', '.join(DEPLOYMENTS)}")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default="1,4,16", help="closed loop: requests in flight, a sweep")
    load.add_argument("--rate", help="open loop: Poisson arrivals at these requests/s, a sweep")
    parser.add_argument("--requests", type=int, default=200, help="requests per deployment and load level")
    parser.add_argument("--images", type=int, default=1, help="images per request")
    parser.add_argument("--image-sizes", default="64x48,80x64,96x96,112x112", help="synthetic images: WxH,...")
    parser.add_argument("--image-format", default="PNG", choices=("PNG", "JPEG"), help="synthetic images' encoding")
    parser.add_argument("--image-dir", type=Path, help="take the images from this folder instead (name order, round-robin)")
    parser.add_argument("--modalities", default="image",
                        help="workloads, rows of their own side by side: image (--images per request), video (--videos), "
                             "audio (--audios; an audio checkpoint's topology, e.g. topologies/cpu-audio.yaml)")
    parser.add_argument("--videos", type=int, default=1, help="videos per request of the video workload")
    parser.add_argument("--video-size", default="128x96", help="synthetic videos: WxH")
    parser.add_argument("--video-frames", type=int, default=20, help="synthetic videos: frames in the container")
    parser.add_argument("--video-fps", type=float, default=10.0, help="synthetic videos: frame rate")
    parser.add_argument("--video-codec", choices=("mp4v", "h264"), default="mp4v",
                        help="synthetic videos: OpenCV's mp4v, or H.264 (PyAV's libx264: what NVDEC decodes)")
    parser.add_argument("--audio-topology", type=Path, default=Path("topologies/cpu-audio.yaml"),
                        help="with audio among other --modalities: the audio rows' topology (an audio checkpoint's)")
    parser.add_argument("--audios", type=int, default=1, help="audio files per request of the audio workload")
    parser.add_argument("--audio-seconds", type=float, default=5.0, help="synthetic audio: length")
    parser.add_argument("--audio-rate", type=int, default=16_000, help="synthetic audio: sample rate (Hz)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output length (greedy, ignore_eos)")
    parser.add_argument("--load-generator", choices=["python", "perf_analyzer"], default="python",
                        help="python: tritonclient's asyncio gRPC streams (clients.bench.load); perf_analyzer: the C++ "
                             "client of Triton (as genai-perf runs it), TTFT from its profile export; concurrency only")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="arrival times of --rate")
    parser.add_argument("--url", help="host:port of a running server's gRPC endpoint (default: start servers)")
    parser.add_argument("--shared", action="store_true",
                        help="one server for all deployments: the committed repository, or with --topology that "
                             "topology rendered with all of them")
    parser.add_argument("--topology", type=Path,
                        help="topology the servers are rendered from (default: topologies/default.yaml)")
    parser.add_argument("--checkpoint", type=Path, help="serve this checkpoint directory in place of the topology's")
    parser.add_argument("--compile", action="store_true", help="engines with torch.compile (enforce_eager: false)")
    parser.add_argument("--stream-interval-ms", type=float, help="the topology's stream_interval_ms for the servers started here")
    parser.add_argument("--out", type=Path, help="write results.json, results.csv and the PNG plots here")
    parser.add_argument("--json", type=Path, help="write the rows (JSON) here too")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.checkpoint and not args.topology:
        parser.error("--checkpoint replaces a topology's checkpoint: give --topology too")
    args.shared_topology = bool(args.shared and args.topology)
    args.topology = args.topology or Path(__file__).resolve().parents[2] / "topologies" / "default.yaml"
    if args.load_generator == "perf_analyzer" and args.rate:
        parser.error("--load-generator perf_analyzer runs the concurrency sweep (--concurrency), not --rate")
    if any(m not in ("image", "video", "audio") for m in args.modalities.split(",")):
        parser.error(f"--modalities: image, video and/or audio, got {args.modalities!r}")
    if {"video", "audio"} & set(args.modalities.split(",")) and args.load_generator == "perf_analyzer":
        parser.error("--load-generator perf_analyzer sends images only; leave video and audio out or use the python one")
    unknown = [k for k in args.models.split(",") if k not in DEPLOYMENTS]
    if unknown:
        parser.error(f"unknown deployments {unknown}; known: {', '.join(DEPLOYMENTS)}")
    if args.shared and COLOCATED & set(args.models.split(",")):
        parser.error("--shared: the committed repository serves E+PD and E/P/D with the proxy orchestrator; "
                     "benchmark the colocated deployments on servers of their own (leave --shared out) or with --url")
    if args.shared and set(ENCODER_VARIANTS) & set(args.models.split(",")):
        parser.error("--shared: one server has one encoder; benchmark epd_nvdec on a server of its own (leave --shared "
                     "out)")
    return args


def _audio_apart(args) -> argparse.Namespace | None:
    """With audio among other workloads: the audio rows' own arguments (``--audio-topology``, an audio checkpoint's
    topology, since no tiny checkpoint here has both towers), run after the others and shown in the same table."""
    kinds = args.modalities.split(",")
    if "audio" not in kinds or len(kinds) == 1:
        return None
    args.modalities = ",".join(k for k in kinds if k != "audio")
    return argparse.Namespace(**{**vars(args), "modalities": "audio", "topology": args.audio_topology,
                                 "checkpoint": None, "shared_topology": bool(args.shared)})


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    audio = _audio_apart(args)
    bench = Bench(args)
    bench.label_modality |= audio is not None
    _serve(bench, args)
    if audio is not None:
        apart = Bench(audio)
        apart.label_modality = True
        _serve(apart, audio)
        bench.rows += apart.rows
        bench.samples.update(apart.samples)
        bench.modalities += ["audio"]
    _report(bench, args)
    return bench.rows


def _serve(bench: "Bench", args) -> None:
    keys = args.models.split(",")
    if args.url:
        asyncio.run(bench.run_server(args.url, [(k, DEPLOYMENTS[k][2]) for k in keys]))
    elif args.shared_topology:
        run_shared_topology(bench, keys)
    elif args.shared:
        from backend.deploy.local_server import ROOT, TritonServer

        with TritonServer(log_path=ROOT / ".cache" / "bench-e2e-server.log") as server:
            print(f"server ready in {server.ready_seconds:.1f} s", file=sys.stderr)
            asyncio.run(bench.run_server(server.grpc_url, [(k, DEPLOYMENTS[k][2]) for k in keys], server.metrics_url,
                                         server.proc.pid))
    else:
        run_isolated(bench, keys)


def _report(bench: "Bench", args) -> None:
    s = bench.settings()
    load = f"concurrency {args.concurrency}" if bench.mode == "concurrency" else f"Poisson arrivals at {args.rate} req/s"
    workloads = [f"{args.images} image(s) per request from {s['dataset']}"] if "image" in bench.modalities else []
    workloads += [f"{args.videos} video(s) per request ({s['video']})"] if s["video"] else []
    workloads += [f"{args.audios} audio file(s) per request ({s['audio']})"] if s["audio"] else []
    print(f"\n{args.requests} streaming requests per row ({load}), {' / '.join(workloads)}, "
          f"{args.max_tokens} greedy tokens (ignore_eos); servers: {s['servers']}; engines "
          f"{'compiled' if args.compile and not args.url else 'as configured'}; load generator {args.load_generator}"
          + (f"; stream_interval_ms {args.stream_interval_ms:g}" if args.stream_interval_ms is not None else "") + "\n")
    print(bench_report.markdown_table(bench.rows))
    if any(row.get("cpu_ms") for row in bench.rows):
        print("\n" + bench_report.cpu_table(bench.rows))
    if args.out:
        write_outputs(bench, args.out)
    if args.json:
        args.json.write_text(json.dumps(bench.rows, indent=2))


if __name__ == "__main__":
    main()
