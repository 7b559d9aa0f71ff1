"""The vision tower's forward, packed: every item of a batch in one pass, attention over cu_seqlens.

Who calls it: ``backend.encode.encoder.VisionEncoder`` (``impl="packed"``, the default), with the weights of the
checkpoint's own transformers tower module (``PackedTower(tower, vision_config)`` borrows them; nothing is
copied). Supports the Qwen2-VL tower (full attention per image, LayerNorm, fc1/fc2 MLP) and the Qwen2.5-VL
tower (window attention except in ``fullatt_block_indexes``, RMSNorm, gated MLP).

What differs from transformers' forward (same weights, same math):
- attention: one variable-length kernel over the whole batch (``torch.nn.attention.varlen.varlen_attn``,
  flash attention, on CUDA); elsewhere, items of equal length are stacked and run through one
  ``scaled_dot_product_attention`` per distinct length. transformers' SDPA path loops over every image
  (and, in Qwen2.5-VL, over every 8x8 window: 16 kernel calls per 448 px image per layer);
- the patch embedding is one matmul (the Conv3d has kernel == stride, so it is a linear map of each patch);
- positions, window orders and cu_seqlens depend only on each item's grid: computed once per grid shape
  and cached, then concatenated per batch (no per-image Python work in the forward);
- on CUDA, ``compile=True`` runs one block function through ``torch.compile`` (weights are its inputs, so
  all layers share one graph), which fuses the norms, rotary and residual adds; only the token and sequence counts
  are dynamic (marked per call), the widths, heads and head size stay constants of the graph (compiled with every
  shape dynamic, the rotary's fused kernel did index arithmetic on symbolic sizes: 4.2 of a 448 px x 8 batch's
  26.4 ms of kernels on an H100, against 1.0 with the sizes known; docs/gpu.md); batches under
  ``COMPILE_MIN_TOKENS`` patches, and anything compile cannot take, run eager.

The output equals transformers' ``pooler_output`` (the merged embeddings vLLM takes as ``image_embeds``):
fp32 to ~1e-6 (``tests/unit/test_packed_tower.py``), bf16 within bf16 rounding (``docs/results/gpu.md``).
"""
from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=256)
def _grid_plan(t: int, h: int, w: int, merge: int, window: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """For one item of ``t x h x w`` patches: (positions [n, 2] as (row, col) in the processor's token order,
    merge-unit order for window attention [n / merge^2] (identity when ``window`` is 0), window lengths in
    tokens)."""
    units_h, units_w = h // merge, w // merge
    # tokens come merge-unit by merge-unit (row-major over units), merge x merge patches inside each unit
    r = torch.arange(h).view(units_h, merge, 1, 1).expand(units_h, merge, units_w, merge)
    c = torch.arange(w).view(1, 1, units_w, merge).expand(units_h, merge, units_w, merge)
    rows = r.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    cols = c.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    positions = torch.stack([rows, cols], dim=-1)
    if not window:
        return positions, torch.arange(t * units_h * units_w), (h * w,) * t
    ur = torch.arange(units_h).view(-1, 1).expand(units_h, units_w).reshape(-1)
    uc = torch.arange(units_w).view(1, -1).expand(units_h, units_w).reshape(-1)
    win_h, win_w = -(-units_h // window), -(-units_w // window)
    win_id = (ur // window) * win_w + uc // window                       # windows row-major over the image
    key = win_id * (window * window) + (ur % window) * window + uc % window  # then row-major inside a window
    order = torch.argsort(key)
    per_frame = units_h * units_w
    order = torch.cat([order + f * per_frame for f in range(t)])
    counts = torch.bincount(win_id, minlength=win_h * win_w)
    lengths = tuple(int(n) * merge * merge for n in counts.tolist() if n) * t
    return positions, order, lengths


# Below this many patches a batch runs eager even with compile=True: measured on an H200 (docs/results/gpu.md),
# the compiled block is slower for one 448 px image (1,024 patches) and faster from 8 of them.
COMPILE_MIN_TOKENS = 4096


class PackedTower(torch.nn.Module):
    def __init__(self, tower: torch.nn.Module, vision_config, compile: bool = False, align: bool = True):
        super().__init__()
        self.tower = tower
        cfg = vision_config
        self.merge = int(cfg.spatial_merge_size)
        self.windowed = hasattr(cfg, "fullatt_block_indexes") and getattr(cfg, "window_size", 0)
        self.window = int(cfg.window_size) // self.merge // int(cfg.patch_size) if self.windowed else 0
        self.full_blocks = set(getattr(cfg, "fullatt_block_indexes", ()) or ()) if self.windowed else None
        proj = tower.patch_embed.proj
        self.embed_dim = proj.weight.shape[0]
        self.num_heads = int(cfg.num_heads)
        self.head_dim = self.embed_dim // self.num_heads
        inv_freq = getattr(tower.rotary_pos_emb, "inv_freq", None)
        if inv_freq is None:
            dim = self.head_dim // 2
            inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq.detach().float().clone(), persistent=False)
        self.compile = compile
        self._block_fn = None
        # a gated MLP whose width leaves its rows unaligned (Qwen2.5-VL's towers: 3,420) padded with zeros on CUDA
        self._padded = align_mlp(tower) if proj.weight.is_cuda and align else {}

    # -- per-batch metadata ----------------------------------------------------------------------
    def host_plan(self, grid: list[tuple[int, int, int]]) -> dict:
        """A batch's metadata on the host: positions [n, 2], the full attention's sequence lengths (one per image or
        frame) and, for a windowed tower, the merge units' window order and the windows' lengths."""
        positions, unit_order, lengths, units = [], [], [], 0
        for t, h, w in grid:
            pos, order, lens = _grid_plan(t, h, w, self.merge, self.window)
            positions.append(pos)
            unit_order.append(order + units)
            lengths.extend(lens)
            units += t * (h // self.merge) * (w // self.merge)
        plan = {"positions": torch.cat(positions), "full": [h * w for t, h, w in grid for _ in range(t)]}
        if self.windowed:
            plan["unit_order"] = torch.cat(unit_order)
            plan["window"] = lengths
        return plan

    def _plan(self, grid: list[tuple[int, int, int]], device: torch.device) -> dict:
        return device_plan(self.host_plan(grid), device)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq                       # [n, 2, head_dim / 4]
        freqs = freqs.flatten(1)                                                     # (rows | cols)
        emb = torch.cat([freqs, freqs], dim=-1)                                      # [n, head_dim]
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    # -- forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor | list) -> torch.Tensor:
        grid = [tuple(int(v) for v in row) for row in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)]
        return self.run(pixels, self._plan(grid, self.tower.patch_embed.proj.weight.device))

    @torch.inference_mode()
    def run(self, pixels: torch.Tensor, plan: dict, compiled: bool | None = None) -> torch.Tensor:
        """The forward on a batch's plan (``_plan``): device work only, no host-to-device copy or host sync, so a
        CUDA graph can capture it (``backend.encode.tower_graphs``). ``compiled``: the compiled block whatever the
        batch's size (None: from ``COMPILE_MIN_TOKENS`` patches on)."""
        tower = self.tower
        weight = tower.patch_embed.proj.weight
        x = F.linear(pixels.to(device=weight.device, dtype=weight.dtype), weight.reshape(self.embed_dim, -1))
        cos, sin = self._rotary(plan["positions"])
        n, unit = x.shape[0], self.merge * self.merge
        if self.windowed:
            order = plan["unit_order"]
            x = x.view(-1, unit, self.embed_dim)[order].view(n, self.embed_dim)
            cos = cos.view(-1, unit, *cos.shape[1:])[order].view(cos.shape)
            sin = sin.view(-1, unit, *sin.shape[1:])[order].view(sin.shape)
        if compiled is None:
            compiled = n >= COMPILE_MIN_TOKENS
        block_fn = self._block() if compiled else _block_eager
        for index, blk in enumerate(tower.blocks):
            cu, lengths, longest = plan["window"] if self.windowed and index not in self.full_blocks else plan["full"]
            x = block_fn(x, cos, sin, cu, longest, lengths, *_block_weights(blk, self._padded.get(index)))
        out = tower.merger(x)
        if self.windowed:
            out = out[plan["unit_restore"]]
        return out

    def warm_up(self) -> None:
        """Forwards of ``COMPILE_MIN_TOKENS`` zero patches or more, so a compiled tower compiles its blocks now, not
        in the first large batch a request brings: one square grid of whole merge units (one attention sequence, as
        an image), then a larger grid with two frames (two sequences, as a video): the first graph takes its longest
        sequence as a constant, and the second, where it differs, compiles the graph where it is an input (the
        token and sequence counts are dynamic from the first: ``_block``)."""
        side = math.isqrt(COMPILE_MIN_TOKENS - 1) + 1
        side = -(-side // self.merge) * self.merge
        weight = self.tower.patch_embed.proj.weight
        for frames, grown in ((1, 0), (2, self.merge)):
            edge = side + grown
            self.forward(torch.zeros(frames * edge * edge, weight[0].numel(), device=weight.device, dtype=weight.dtype),
                         [(frames, edge, edge)])

    def _block(self):
        if self._block_fn is None:
            self._block_fn = _block_eager
            if self.compile and self.tower.patch_embed.proj.weight.is_cuda:
                try:
                    self._block_fn = _token_dynamic(torch.compile(_block_compiled))
                except Exception as exc:  # noqa: BLE001 - eager is always correct
                    log.warning("torch.compile unavailable for the packed tower, running eager: %s", exc)
        return self._block_fn


def _token_dynamic(compiled):
    """``compiled`` (a block, ``torch.compile``'s default: shapes static until they change) with the first dimension
    of the activations, the rotary tables and cu_seqlens marked dynamic at each call, so one graph takes every
    batch's token and sequence counts while the weights' shapes stay constants."""
    def block(x, cos, sin, cu, *rest):
        for tensor in (x, cos, sin, cu):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return compiled(x, cos, sin, cu, *rest)
    return block


def device_plan(host: dict, device) -> dict:
    """``PackedTower.run``'s plan from ``host_plan``'s (or one padded from it)."""
    plan = {"positions": host["positions"].to(device, non_blocking=True), "full": _cu(host["full"], device)}
    if "unit_order" in host:
        order = host["unit_order"]
        plan["unit_order"] = order.to(device, non_blocking=True)
        plan["unit_restore"] = torch.argsort(order).to(device, non_blocking=True)
        plan["window"] = _cu(host["window"], device)
    return plan


def _cu(lengths: list[int], device) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """(cu_seqlens on ``device``, the lengths, the longest): one attention kind's entry of a plan."""
    return cu_seqlens(lengths).to(device, non_blocking=True), tuple(lengths), max(lengths)


def cu_seqlens(lengths) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu


ALIGN = 64  # elements: a bf16 row of a multiple of 64 is 128 bytes, what Hopper's matmul kernels load whole


def align_mlp(tower, multiple: int = ALIGN) -> dict[int, tuple]:
    """Pads each gated MLP whose width is not a multiple of ``multiple`` with zeros, in place: the gate's and up
    projection's rows and biases and the down projection's columns, so the same products come out (the padded
    activations are act(0) * 0 = 0 and meet zero columns). Qwen2.5-VL's towers are 3,420 wide: rows of 6,840 bytes,
    which keep cuBLAS on a 2-element-aligned Ampere kernel (measured on an H100: 35 of the 47 ms of a 448 px x 8
    batch in matmuls). The module's own parameters become views of the padded tensors (its forward is unchanged; no
    copy is kept); returns {block index: (gate w, gate b, up w, up b, down w)} padded, for ``_block_weights``. A
    module padded before (another ``PackedTower`` over the same tower) gives the tensors it was padded with."""
    padded: dict[int, tuple] = {}
    for index, blk in enumerate(tower.blocks):
        mlp = blk.mlp
        if getattr(mlp, "epd_padded", None) is not None:
            padded[index] = mlp.epd_padded
            continue
        if not hasattr(mlp, "gate_proj"):
            continue
        inner = mlp.gate_proj.weight.shape[0]
        wide = -(-inner // multiple) * multiple
        if wide == inner:
            continue
        with torch.no_grad():
            tensors = []
            for linear in (mlp.gate_proj, mlp.up_proj):
                weight = linear.weight.new_zeros(wide, linear.weight.shape[1])
                weight[:inner] = linear.weight
                bias = linear.weight.new_zeros(wide)
                if linear.bias is not None:
                    bias[:inner] = linear.bias
                    linear.bias = torch.nn.Parameter(bias[:inner], requires_grad=False)
                linear.weight = torch.nn.Parameter(weight[:inner], requires_grad=False)
                tensors += [weight, bias if linear.bias is not None else None]
            down = mlp.down_proj
            weight = down.weight.new_zeros(down.weight.shape[0], wide)
            weight[:, :inner] = down.weight
            down.weight = torch.nn.Parameter(weight[:, :inner], requires_grad=False)
            padded[index] = mlp.epd_padded = (*tensors, weight)
    return padded


def _block_weights(blk, padded: tuple | None = None) -> tuple:
    """The block's tensors and norm kinds, in ``_block_eager``'s argument order (``padded``: ``align_mlp``'s for
    the block)."""
    mlp = blk.mlp
    if padded is not None:
        mlp_w = (*padded[:4], padded[4], mlp.down_proj.bias, _act_name(mlp.act_fn))
    elif hasattr(mlp, "gate_proj"):
        mlp_w = (mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias,
                 mlp.down_proj.weight, mlp.down_proj.bias, _act_name(mlp.act_fn))
    else:
        mlp_w = (None, None, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, _act_name(mlp.act))
    return (_norm(blk.norm1), _norm(blk.norm2), blk.attn.qkv.weight, blk.attn.qkv.bias,
            blk.attn.proj.weight, blk.attn.proj.bias, blk.attn.num_heads, *mlp_w)


def _norm(module) -> tuple:
    eps = getattr(module, "variance_epsilon", None)
    if eps is not None:
        return ("rms", module.weight, None, float(eps))
    return ("layer", module.weight, module.bias, float(module.eps))


def _act_name(fn) -> str:
    name = type(fn).__name__.lower()
    for known in ("quickgelu", "silu", "gelutanh", "gelu"):
        if known in name:
            return known
    raise ValueError(f"packed tower: unsupported activation {type(fn).__name__}")


def _apply_norm(x, spec):
    kind, weight, bias, eps = spec
    if kind == "rms":  # as transformers: normalise in fp32, back to the input dtype, then scale
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _activate(x, name):
    if name == "quickgelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelutanh" else "none")


def _rotate(x, cos, sin):
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def _block_eager(x, cos, sin, cu, max_len, lengths, norm1, norm2, qkv_w, qkv_b, proj_w, proj_b, heads,
                 gate_w, gate_b, up_w, up_b, down_w, down_b, act):
    n, dim = x.shape
    qkv = F.linear(_apply_norm(x, norm1), qkv_w, qkv_b).view(n, 3, heads, dim // heads)
    q, k, v = qkv.unbind(1)
    out = packed_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, cu, max_len, lengths)
    x = x + F.linear(out.reshape(n, dim), proj_w, proj_b)
    h = _apply_norm(x, norm2)
    up = F.linear(h, up_w, up_b)
    h = _activate(F.linear(h, gate_w, gate_b), act) * up if gate_w is not None else _activate(up, act)
    return x + F.linear(h, down_w, down_b)


def _block_compiled(x, cos, sin, cu, max_len, lengths, *rest):
    return _block_eager(x, cos, sin, cu, max_len, None, *rest)


def packed_attention(q, k, v, cu: torch.Tensor, max_len: int, lengths) -> torch.Tensor:
    """Non-causal attention within each packed sequence. ``q, k, v``: [tokens, heads, head_dim];
    ``cu``: int32 [sequences + 1] on q's device; ``lengths``: the same boundaries as host ints (for the
    fallback; may be None on CUDA)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn(q, k, v, cu, cu, max_len, max_len)
    if lengths is None:
        lengths = tuple(torch.diff(cu).tolist())
    out = torch.empty_like(q)
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, lengths):
        if length:
            by_length.setdefault(length, []).append(start)
    for length, group in by_length.items():
        index = (torch.tensor(group, device=q.device)[:, None] + torch.arange(length, device=q.device)).reshape(-1)
        shape = (len(group), length, q.shape[1], q.shape[2])
        qs, ks, vs = (t[index].view(shape).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out[index] = o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
    return out
