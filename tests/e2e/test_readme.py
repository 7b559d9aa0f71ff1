"""E2E: the README's request commands, run as a user runs them (bash, curl, the chat CLI, the Python snippet) against
the session's server, on its ports instead of Triton's defaults. Each answer is checked against ``llm``'s for the
same request through the client library, so a command that stops working, or answers something else, fails here."""
from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import pytest

from backend.deploy.local_server import ROOT
from backend.protocol.generate import GenerateInputs
from clients.triton_client import generate
from tests.images import image_bytes

pytestmark = pytest.mark.e2e
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def on_server(text: str, server) -> str:
    """``text`` pointed at ``server``'s ports and at this checkout's venv (the commands run in a scratch folder)."""
    text = text.replace("127.0.0.1:8000", server.http_url).replace("127.0.0.1:8001", server.grpc_url)
    return text.replace(".venv/bin/python", str(ROOT / ".venv" / "bin" / "python"))


@pytest.fixture()
def workdir(tmp_path):
    """The files the README's commands name."""
    (tmp_path / "cat.png").write_bytes(image_bytes(64, 48, seed=11))
    (tmp_path / "a.png").write_bytes(image_bytes(56, 56, seed=12))
    (tmp_path / "b.jpg").write_bytes(image_bytes(48, 64, seed=13, fmt="JPEG"))
    return tmp_path


def streamed_text(sse: str) -> list[str]:
    return [json.loads(line[len("data: "):])["text_output"] for line in sse.splitlines() if line.startswith("data: ")]


def test_the_curl_commands_answer_as_llm_does(server, workdir):
    (block,) = [b for b in blocks("bash") if "curl" in b]  # the OpenAI examples are `sh`/`py` blocks: test_openai.py
    first, second = [c.strip() for c in on_server(block, server).split("\ncurl") if c.strip()]
    stream = subprocess.run(["bash", "-c", first], cwd=workdir, capture_output=True, text=True, timeout=120)
    assert stream.returncode == 0 and "error" not in stream.stdout, stream.stdout + stream.stderr
    url = "data:image/png;base64," + base64.b64encode((workdir / "cat.png").read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in it?"}]}]
    want = generate(server.grpc_url, "llm", GenerateInputs(messages=messages, sampling={"max_tokens": 16, "temperature": 0}),
                    timeout=120)
    assert "".join(streamed_text(stream.stdout)) == want.text and want.text
    story = subprocess.run(["bash", "-c", "curl " + second], cwd=workdir, capture_output=True, text=True, timeout=120)
    assert json.loads(story.stdout)["text_output"].startswith("Tell me a story."), story.stdout + story.stderr


def test_the_chat_commands_answer_as_llm_does(server, workdir):
    (block,) = [b for b in blocks("bash") if "clients.chat" in b]
    for line in block.splitlines():
        command = on_server(line.split("   #")[0].strip(), server)
        http = "--protocol http" in command
        url = server.http_url if http else server.grpc_url
        run = subprocess.run(["bash", "-c", f"{command} --url {url} --max-tokens 8"], cwd=workdir,
                             capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
        images = re.findall(r"--image (\S+)", command)
        prompt = re.findall(r'"([^"]+)"', command)[-1]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
        want = generate(server.grpc_url, "llm", GenerateInputs(
            messages=[{"role": "user", "content": content}], images=[(workdir / i).read_bytes() for i in images],
            sampling={"max_tokens": 8, "temperature": 0.0}), timeout=120)
        assert run.stdout.startswith(want.text + "\n--\n"), (command, run.stdout, want.text)


def test_the_python_snippet_answers_as_llm_does(server, workdir):
    (snippet,) = blocks("python")
    run = subprocess.run([sys.executable, "-c", on_server(snippet, server)], cwd=workdir, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
    want = generate(server.grpc_url, "llm", GenerateInputs(messages=messages, images=[(workdir / "cat.png").read_bytes()],
                                                           sampling={"max_tokens": 32, "temperature": 0}), timeout=120)
    assert run.stdout.startswith(want.text + " ") and "encode_ms" in run.stdout, (run.stdout, want.text)
