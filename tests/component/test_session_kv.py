"""``backend.engine.session_kv``'s connector in a real vLLM engine (the topology's ``llm`` engine arguments, tiny
Qwen2-VL, in a subprocess): a conversation's next turn, after its prefix cache was emptied (``reset_prefix_cache``:
what other traffic does during a tool pause), loads its earlier blocks from the store instead of prefilling them, and
answers exactly as the engine does when it prefills everything (same tokens, same logprobs). Without a session
nothing is loaded; another image at the same place in the prompt matches nothing past the text before it (vLLM's
block hashes carry the media items' ids)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import io, json, sys
from pathlib import Path
from backend.engine.host import load_engine_args, prepare_process
prepare_process()
from PIL import Image
from vllm import LLM, SamplingParams
from backend.engine.session_kv import SESSION_KEY, connector_config
from tests.images import image_bytes

args = load_engine_args(Path("model_repository/llm/model.json"))
llm = LLM(**args, kv_transfer_config=connector_config(8 << 20, 60)) if "kv_transfer_config" not in args else None
PH = "<|vision_start|><|image_pad|><|vision_end|>"
image = lambda seed: Image.open(io.BytesIO(image_bytes(336, 252, seed=seed))).convert("RGB")
history = "<|im_start|>system\nYou are an agent.<|im_end|>\n" + "".join(
    f"<|im_start|>user\nStep {i}: the screen shows {PH} and these items: "
    + ", ".join(f"item {10 * i + j}" for j in range(30)) + ".<|im_end|>\n"
    f"<|im_start|>assistant\nclick({i}, {2 * i})<|im_end|>\n" for i in range(4))

def ask(prompt, images, session):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2,
                            extra_args={"kv_transfer_params": {SESSION_KEY: session}} if session else None)
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": images}}], params, use_tqdm=False)[0]
    logprobs = [[[t, round(l.logprob, 5)] for t, l in sorted(step.items())] for step in out.outputs[0].logprobs]
    return {"tokens": list(out.outputs[0].token_ids), "logprobs": logprobs, "cached": out.num_cached_tokens,
            "prompt": len(out.prompt_token_ids)}

shots = [image(1), image(2), image(3), image(4)]
report = {"block_size": llm.llm_engine.vllm_config.cache_config.block_size, "first": ask(history, shots, "conv")}
turn = history + "<|im_start|>user\nStep 3: what now?<|im_end|>\n<|im_start|>assistant\n"
for name, images, session in (("kept", shots, "conv"), ("recomputed", shots, None),
                              ("other_image", [shots[0], shots[1], image(9), shots[3]], "conv")):
    llm.reset_prefix_cache()  # the tool pause's other traffic
    report[name] = ask(turn, images, session)
print("REPORT " + json.dumps(report))
'''


def test_a_conversation_s_next_turn_loads_its_kept_blocks_and_answers_as_a_full_prefill():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))[7:])
    block = report.pop("block_size")
    first, kept, recomputed, other = report["first"], report["kept"], report["recomputed"], report["other_image"]
    print("block size", block, {name: (r["prompt"], r["cached"]) for name, r in report.items()})
    assert first["cached"] == 0 and recomputed["cached"] == 0  # the prefix cache was emptied: nothing local
    # the whole first turn's prompt, in full blocks (several), came from the store
    assert kept["cached"] == first["prompt"] // block * block >= 3 * block, (kept["cached"], first["prompt"])
    assert (kept["tokens"], kept["logprobs"]) == (recomputed["tokens"], recomputed["logprobs"])
    # another third screenshot: the blocks before it match, none from the block holding it on
    assert block <= other["cached"] < kept["cached"], (other["cached"], kept["cached"])
