"""CUDA graphs of the packed vision tower, one per bucket of batch shapes (``encoder_cuda_graphs``).

Why: an encoder's batches are small (one to a few images), and the tower's forward is 32 blocks of a dozen kernel
launches each from Python; for one 448 px image the host's launches take longer than the GPU's work
(docs/results/gpu.md). A graph replays the whole forward with one launch.

How: a batch is padded to a bucket, then its metadata is copied into the bucket's static buffers and the bucket's
graph replayed; the output's real rows are copied out (the next replay overwrites them).
- tokens: to the next of 5/6/7/8 x 2^k (at least ``min_tokens``: at most a quarter wasted); the padded tokens are
  zero patches at position 0, in sequences of their own no longer than the batch's longest (full attention) or
  longest window, so they never attend to a real token and lengthen no sequence;
- sequences (cu_seqlens' length): to the next power of two, with empty sequences at the end;
- each attention's longest sequence (the kernel's ``max_seqlen``, which sizes its grid): to the next power of two.
A bucket's graph is captured on its first batch, after one forward outside the capture (so the compiled block has
compiled for it); up to ``max_graphs`` are kept (the least recently used dropped), all in one memory pool: safe in any replay order
here, since what one capture may reuse of another's is memory freed inside that capture (its temporaries, or a
graph's output, which a later replay may overwrite: each output is copied out under the lock right after its replay). Batches over
``max_tokens`` run without a graph (their kernels outlast their launches anyway), and so does a float32 tower on CUDA
(its attention groups sequences by length on the host; the graphs need flash attention's varlen kernel, bf16/fp16).

Off CUDA (the unit tests) the padded batch runs through ``PackedTower.run`` directly: the padding's arithmetic is
checked against the unpadded forward on any machine; the capture itself only on a GPU.
"""
from __future__ import annotations

import collections
import math
import threading

import torch

from backend.encode.packed_tower import PackedTower, cu_seqlens, device_plan


def bucket_tokens(n: int, floor: int) -> int:
    if n <= floor:
        return floor
    step = 1 << max(0, (n - 1).bit_length() - 3)   # n in (4 step, 8 step]: 5, 6, 7 or 8 steps
    return -(-n // step) * step


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pad_lengths(lengths: list[int], pad: int) -> list[int]:
    """``lengths`` with ``pad`` more tokens as sequences no longer than the longest, then empty sequences up to a
    power-of-two count."""
    longest = max(lengths)
    tail = [longest] * (pad // longest) + ([pad % longest] if pad % longest else [])
    padded = list(lengths) + tail
    return padded + [0] * (next_pow2(len(padded)) - len(padded))


def padded_plan(tower: PackedTower, grid: list[tuple[int, int, int]], tokens: int) -> tuple[dict, tuple]:
    """``tower.host_plan(grid)`` padded to ``tokens`` (a multiple of a merge unit) and its bucket key."""
    plan = tower.host_plan(grid)
    n = plan["positions"].shape[0]
    pad = tokens - n
    padded = {"positions": torch.cat([plan["positions"], plan["positions"].new_zeros(pad, 2)]),
              "full": _pad_lengths(plan["full"], pad)}
    key = [tokens, len(padded["full"]), next_pow2(max(plan["full"]))]
    if "unit_order" in plan:
        unit = tower.merge * tower.merge
        order = plan["unit_order"]
        padded["unit_order"] = torch.cat([order, torch.arange(n // unit, tokens // unit, dtype=order.dtype)])
        padded["window"] = _pad_lengths(plan["window"], pad)
        key += [len(padded["window"]), next_pow2(max(plan["window"]))]
    return padded, tuple(key)


def bucket_plan(plan: dict, key: tuple, device) -> dict:
    """``PackedTower.run``'s plan of a padded batch, each attention's longest sequence the bucket's."""
    run_plan = device_plan(plan, device)
    run_plan["full"] = run_plan["full"][:2] + (key[2],)
    if "window" in run_plan:
        run_plan["window"] = run_plan["window"][:2] + (key[4],)
    return run_plan


class _Graph:
    """One bucket: its static inputs, its captured forward and that forward's output."""

    def __init__(self, tower: PackedTower, plan: dict, key: tuple, pool, patch_dim: int):
        weight = tower.tower.patch_embed.proj.weight
        self.pixels = torch.zeros(key[0], patch_dim, device=weight.device, dtype=weight.dtype)
        self.plan = bucket_plan(plan, key, weight.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tower.run(self.pixels, self.plan, compiled=True)       # compiles for this bucket outside the capture
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = tower.run(self.pixels, self.plan, compiled=True)

    def replay(self, pixels: torch.Tensor, plan: dict) -> torch.Tensor:
        n = pixels.shape[0]
        self.pixels[:n].copy_(pixels)
        self.pixels[n:].zero_()
        self.plan["positions"].copy_(plan["positions"], non_blocking=True)
        self.plan["full"][0].copy_(cu_seqlens(plan["full"]), non_blocking=True)
        if "unit_order" in plan:
            self.plan["unit_order"].copy_(plan["unit_order"], non_blocking=True)
            self.plan["unit_restore"].copy_(torch.argsort(plan["unit_order"]), non_blocking=True)
            self.plan["window"][0].copy_(cu_seqlens(plan["window"]), non_blocking=True)
        self.graph.replay()
        return self.out


class TowerGraphs:
    """Callable as ``PackedTower``: ``graphs(pixels, grid_thw)`` -> the merged embeddings."""

    def __init__(self, tower: PackedTower, max_graphs: int = 16, min_tokens: int = 1024, max_tokens: int = 16384):
        self.tower = tower
        self.compile = tower.compile
        self.max_graphs, self.min_tokens, self.max_tokens = max_graphs, min_tokens, max_tokens
        self._graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = None
        self.captures = 0

    def to(self, device):
        self.tower.to(device)
        return self

    def warm_up(self) -> None:
        """The tower's own warm-up (its compile), then the smallest bucket's capture (one 448 px image's)."""
        self.tower.warm_up()
        side = math.isqrt(self.min_tokens) // self.tower.merge * self.tower.merge
        weight = self.tower.tower.patch_embed.proj.weight
        self(torch.zeros(side * side, weight[0].numel(), device=weight.device, dtype=weight.dtype), [(1, side, side)])

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
        grid = [tuple(int(v) for v in row) for row in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)]
        n = pixels.shape[0]
        weight = self.tower.tower.patch_embed.proj.weight
        if n > self.max_tokens or (weight.is_cuda and weight.dtype not in (torch.bfloat16, torch.float16)):
            return self.tower(pixels, grid)   # fp32 on CUDA: attention by length groups, which reads them on the host
        tokens = bucket_tokens(n, self.min_tokens)
        plan, key = padded_plan(self.tower, grid, tokens)
        units = n // (self.tower.merge * self.tower.merge)
        if not weight.is_cuda:
            padded = torch.cat([pixels.to(weight.dtype), pixels.new_zeros(tokens - n, pixels.shape[1], dtype=weight.dtype)])
            return self.tower.run(padded, bucket_plan(plan, key, weight.device))[:units]
        pixels = pixels.to(device=weight.device, dtype=weight.dtype)
        with self._lock:
            graph = self._graphs.get(key)
            if graph is None:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = _Graph(self.tower, plan, key, self._pool, pixels.shape[1])
                self.captures += 1
                self._graphs[key] = graph
                while len(self._graphs) > self.max_graphs:
                    self._graphs.popitem(last=False)
            self._graphs.move_to_end(key)
            return graph.replay(pixels, plan)[:units].clone()
