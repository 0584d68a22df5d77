"""Benchmark prompts: random tokens, ShareGPT conversations, prefixes repeated across requests.

Random and prefix-repetition prompts are drawn as token ids from a seeded generator, so
the same seed gives the same prompts everywhere. They are sent as token ids to
``/v1/completions`` (exact lengths, no re-tokenization drift) and as decoded text to chat
endpoints, where their token count is only approximately kept.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.serve.config import DatasetConfig

logger = logging.getLogger("pdserve.bench")

# ShareGPT filter, as vLLM's: drop too-short turns and too-long conversations.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to send: token ids or text, its length and the output length asked for."""

    prompt: list[int] | str
    prompt_len: int
    expected_output_len: int


def resolve_tokenizer_path(tokenizer: str | None, model: str | None) -> str | None:
    """``--tokenizer``, else ``--model`` when it is a local directory or .gguf file, else
    the embedded models' (by their served names)."""
    from engine_core.default_model import DEFAULT_MODEL_NAME
    from engine_core.demo_model import RANDOM_DEMO_MODEL_NAME

    if tokenizer:
        return tokenizer
    if model and (Path(model).is_dir() or Path(model).is_file()):
        return model
    if model == DEFAULT_MODEL_NAME:
        from engine_core.default_model import default_model_path

        return str(default_model_path())
    if model == RANDOM_DEMO_MODEL_NAME:
        from engine_core.demo_model import random_demo_model_path

        return str(random_demo_model_path())
    return None


def load_tokenizer(path: str) -> Any:
    """A local HF tokenizer: a checkpoint directory's, or a .gguf file's."""
    from engine_core.gguf import is_gguf_path

    if is_gguf_path(path):
        from transformers import PreTrainedTokenizerFast

        gguf = Path(path)
        return PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """``n`` lengths uniform in [floor(mean*(1-ratio)), ceil(mean*(1+ratio))], at least 1.
    The products are rounded first: 100 * 1.1 is 110.00000000000001, whose ceil is 111."""
    low = max(1, int(np.floor(round(mean * (1 - ratio), 9))))
    high = max(low, int(np.ceil(round(mean * (1 + ratio), 9))))
    return rng.integers(low, high + 1, size=n)


def random_requests(config: DatasetConfig, vocab_size: int) -> list[SampleRequest]:
    """``random_prefix_len`` shared tokens, then ``random_input_len`` (+-ratio) random ones."""
    rng = np.random.default_rng(config.seed)
    prefix = rng.integers(0, vocab_size, size=config.random_prefix_len).tolist()
    input_lens = _lengths(rng, config.random_input_len, config.random_range_ratio,
                          config.num_prompts)
    output_lens = _lengths(rng, config.random_output_len, config.random_range_ratio,
                           config.num_prompts)
    requests = []
    for input_len, output_len in zip(input_lens, output_lens):
        ids = prefix + rng.integers(0, vocab_size, size=int(input_len)).tolist()
        requests.append(SampleRequest(ids, len(ids), int(output_len)))
    return requests


def lognormal_requests(config: DatasetConfig, vocab_size: int) -> list[SampleRequest]:
    """Random tokens whose input and output lengths are lognormal around the configured
    medians (mixed chat-like traffic): inputs in [16, lognormal_max_input_len], outputs >= 8."""
    rng = np.random.default_rng(config.seed)
    n, sigma = config.num_prompts, config.lognormal_sigma
    input_lens = np.clip(rng.lognormal(np.log(config.random_input_len), sigma, n), 16,
                         config.lognormal_max_input_len).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(config.random_output_len), sigma, n), 8,
                          None).astype(int)
    return [SampleRequest(rng.integers(0, vocab_size, size=int(i)).tolist(), int(i), int(o))
            for i, o in zip(input_lens, output_lens)]


def prefix_repetition_requests(config: DatasetConfig, vocab_size: int) -> list[SampleRequest]:
    """``num_prefixes`` random prefixes, each shared by an equal share of the requests
    (plus a random suffix each), in shuffled order."""
    if config.num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be >= 1")
    rng = np.random.default_rng(config.seed)
    prefixes = [rng.integers(0, vocab_size, size=config.prefix_len).tolist()
                for _ in range(config.num_prefixes)]
    requests = []
    for i in range(config.num_prompts):
        ids = prefixes[i % config.num_prefixes] + rng.integers(
            0, vocab_size, size=config.suffix_len).tolist()
        requests.append(SampleRequest(ids, len(ids), config.prefix_output_len))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def sharegpt_requests(config: DatasetConfig, tokenizer: Any) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's length as the output length."""
    if not config.path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path")
    data = json.loads(Path(config.path).read_text())
    pairs = [(d["conversations"][0]["value"], d["conversations"][1]["value"])
             for d in data if len(d.get("conversations", [])) >= 2]
    order = np.random.default_rng(config.seed).permutation(len(pairs))
    requests: list[SampleRequest] = []
    for index in order:
        if len(requests) == config.num_prompts:
            break
        prompt, reply = pairs[index]
        prompt_len = len(tokenizer.encode(prompt))
        output_len = (config.sharegpt_output_len if config.sharegpt_output_len is not None
                      else len(tokenizer.encode(reply)))
        # A fixed output length lifts only the reply's floor; prompts are filtered anyway.
        reply_too_short = config.sharegpt_output_len is None and output_len < SHAREGPT_MIN_LEN
        if (reply_too_short or prompt_len < SHAREGPT_MIN_LEN
                or prompt_len > SHAREGPT_MAX_PROMPT_LEN
                or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN):
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
    if len(requests) < config.num_prompts:
        logger.warning("ShareGPT: only %d usable conversations for %d prompts",
                       len(requests), config.num_prompts)
    return requests


def sample_requests(config: DatasetConfig, tokenizer: Any) -> list[SampleRequest]:
    """The prompts of ``config`` (``tokenizer`` gives the vocabulary and ShareGPT lengths)."""
    if tokenizer is None:
        raise ValueError(f"--dataset-name {config.name} needs a tokenizer: give --tokenizer "
                         "(a local tokenizer directory) or a local --model path")
    if config.name == "random":
        return random_requests(config, tokenizer.vocab_size)
    if config.name == "lognormal":
        return lognormal_requests(config, tokenizer.vocab_size)
    if config.name == "prefix_repetition":
        return prefix_repetition_requests(config, tokenizer.vocab_size)
    if config.name == "sharegpt":
        return sharegpt_requests(config, tokenizer)
    raise ValueError(f"unknown dataset {config.name!r}")


def as_text(request: SampleRequest, tokenizer: Any) -> str:
    """The prompt as text (chat endpoints take no token ids)."""
    if isinstance(request.prompt, str):
        return request.prompt
    return tokenizer.decode(request.prompt)
