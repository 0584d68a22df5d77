"""Shared fixtures: tiny HF checkpoints, HF reference generation, the gpu marker skip."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker's torch ops, and those of the processes it starts, take
    one thread: two workers' tests with two threads each on a 2-core machine spin against
    each other (a test that sets ``OMP_NUM_THREADS`` itself still does)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _cpu_tests_start_cpu_processes(request: pytest.FixtureRequest,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A test without the ``gpu`` marker starts its processes with no GPU visible, so the CPU
    suite tests the same CPU clusters on a GPU machine (the launcher would give each worker
    a GPU), and an engine it builds in this process resolves ``--device auto`` to the CPU
    (this process's own CUDA state was fixed at collection)."""
    if "gpu" not in request.keywords and torch.cuda.is_available():
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_cuda_visible_devices(request: pytest.FixtureRequest,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch plan's test (``--gpus 0,1`` on any machine) plans for GPUs that no
    ``CUDA_VISIBLE_DEVICES`` narrows, whatever the machine running it sets (a ``gpu``
    test keeps the machine's)."""
    if "gpu" not in request.keywords:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests where CUDA is absent (CI deselects them with -m "not gpu")."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY_SHAPES = {
    "llama": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, vocab_size=1024, max_position_embeddings=1024),
    "qwen3": dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate_size=128, vocab_size=1024, max_position_embeddings=1024,
                  tie_word_embeddings=True),
    "qwen2": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1,
                  intermediate_size=96, vocab_size=1024, max_position_embeddings=1024),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Return a builder: arch name -> path of a cached tiny float32 checkpoint."""
    from engine_core.demo_model import build_checkpoint

    @functools.cache
    def build(arch: str) -> Path:
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        return Path(build_checkpoint(path, arch=arch, seed=1234, dtype="float32",
                                     **TINY_SHAPES[arch]))

    return build


@pytest.fixture(scope="session")
def hf_greedy():
    """Return ``f(checkpoint_dir, prompts, max_new_tokens) -> list[list[int]]`` from HF generate.

    EOS does not stop HF here, matching engine requests sent with ignore_eos=True.
    ``logit_bias`` ({token: bias}) becomes HF's ``sequence_bias`` over one-token sequences;
    ``repetition_penalty`` is HF's (prompt and generated tokens, as vLLM's).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    models: dict[tuple[str, str, torch.dtype], torch.nn.Module] = {}

    @functools.cache
    def run(checkpoint: Path, prompts: tuple[tuple[int, ...], ...], max_new_tokens: int,
            device: str, dtype: torch.dtype,
            bias: tuple[tuple[int, float], ...], repetition_penalty: float) -> list[list[int]]:
        key = (str(checkpoint), device, dtype)
        if key not in models:
            models[key] = AutoModelForCausalLM.from_pretrained(
                str(checkpoint), dtype=dtype).to(device).eval()
        model = models[key]
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                  min_new_tokens=0, eos_token_id=None, pad_token_id=0,
                                  sequence_bias={(t,): b for t, b in bias} or None,
                                  repetition_penalty=repetition_penalty)
        outputs = []
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=device)
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     generation_config=config)
                outputs.append(out[0, len(prompt):].tolist())
        return outputs

    def call(checkpoint: Path, prompts: list[list[int]], max_new_tokens: int,
             device: str = "cpu", dtype: torch.dtype = torch.float32,
             logit_bias: dict[int, float] | None = None,
             repetition_penalty: float = 1.0) -> list[list[int]]:
        return run(Path(checkpoint), tuple(tuple(p) for p in prompts), max_new_tokens,
                   device, dtype, tuple(sorted((logit_bias or {}).items())), repetition_penalty)

    return call
