"""Reference outputs from an in-process vLLM ``LLM`` on the same model and engine arguments as ``llm``.

Run as a subprocess by the e2e tests (so the test process never hosts an engine):
    python -m tests.vllm_reference CASES.json OUT.json
A case is ``{"prompt": str, "images": [base64]}`` (``LLM.generate`` with ``multi_modal_data``) or
``{"messages": [...], "images": [base64]}`` (``LLM.chat``; ``{"type": "image"}`` parts take the case's
images in order, sent to vLLM as data URLs), plus ``"sampling"`` (SamplingParams keyword arguments). With
``logprobs`` in them, the output's ``logprobs`` are its tokens' entries as the generate interface returns them
(``backend.engine.logprobs``).
"""
from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

from backend.engine.host import load_engine_args, prepare_process, private_ipc_dir, release_ipc_dir
from backend.engine.logprobs import token_entries

ROOT = Path(__file__).resolve().parent.parent


def _chat_messages(messages: list[dict], images: list[str]) -> list[dict]:
    pending = list(images)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + pending.pop(0)}}
                       if part.get("type") == "image" else part for part in content]
        out.append({"role": message["role"], "content": content})
    return out


def main(cases_path: str, out_path: str) -> None:
    prepare_process()
    from PIL import Image
    from vllm import LLM, SamplingParams

    args = load_engine_args(ROOT / "model_repository" / "llm" / "model.json")
    ipc_dir = private_ipc_dir()  # vLLM leaves its IPC socket files behind
    try:
        results = _generate(LLM(**args), cases_path, SamplingParams, Image)
    finally:
        release_ipc_dir(ipc_dir)
    Path(out_path).write_text(json.dumps(results))


def _generate(llm, cases_path: str, SamplingParams, Image) -> list[dict]:
    results = []
    for case in json.loads(Path(cases_path).read_text()):
        params = SamplingParams(**case["sampling"])
        if "messages" in case:
            out = llm.chat(_chat_messages(case["messages"], case["images"]), params, use_tqdm=False)[0]
        else:
            prompt = {"prompt": case["prompt"]}
            if case["images"]:
                prompt["multi_modal_data"] = {"image": [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB")
                                                        for b in case["images"]]}
            out = llm.generate(prompt, params, use_tqdm=False)[0]
        completion = out.outputs[0]
        results.append({"text": completion.text, "token_ids": list(completion.token_ids),
                        "num_input_tokens": len(out.prompt_token_ids), "finish_reason": completion.finish_reason})
        if params.logprobs is not None:
            decode = llm.get_tokenizer().decode
            results[-1]["logprobs"] = token_entries(completion.token_ids, completion.logprobs, params.logprobs,
                                                    lambda token_id: decode([token_id]))
    return results


if __name__ == "__main__":
    main(*sys.argv[1:3])
