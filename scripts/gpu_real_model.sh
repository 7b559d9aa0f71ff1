#!/usr/bin/env bash
# On the GPU machine: a checkpoint shaped like a real one (default Qwen2-VL-2B-Instruct: 28 language-model layers,
# the full 32-block vision tower, its config, processor and chat template; this project's 1,024-token vocabulary)
# with random weights, drawn there and saved as bf16 safetensors, so that the encoder's tower and the engines read
# the very same weights (load_format=dummy would draw other weights in each process).
# Usage: scripts/gpu_real_model.sh OUT [LIKE [LAYERS [VISION_LAYERS]]]; needs PYTHONPATH with the project's code.
set -euo pipefail
OUT=$1
LIKE=${2:-$(dirname "$0")/../tests/data/checkpoints/Qwen2-VL-2B-Instruct}
started=$(date +%s)
python3 -m devtools.tiny --like "$LIKE" --out "$OUT" --layers "${3:-28}" --vision-layers "${4:-32}"
python3 - "$OUT" <<'PY'
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

for path in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    tensors = load_file(path)
    if all(t.dtype != torch.float32 for t in tensors.values()):
        continue
    save_file({k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in tensors.items()}, path,
              metadata={"format": "pt"})
params = sum(t.numel() for p in Path(sys.argv[1]).glob("*.safetensors") for t in load_file(p).values())
print(f"{sys.argv[1]}: {params / 1e9:.3f} B parameters, bf16")
PY
echo "model built in $(( $(date +%s) - started )) s"
