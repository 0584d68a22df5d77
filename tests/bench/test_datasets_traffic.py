"""Dataset generators (lengths, seeds, prefix repetition) and request-rate arrival times."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serve.config import DatasetConfig
from benchmarks.serve.datasets import (
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from benchmarks.serve.traffic import arrival_offsets

VOCAB = 1000


def test_random_exact_lengths_and_prefix() -> None:
    config = DatasetConfig(num_prompts=20, random_input_len=64, random_output_len=16,
                           random_prefix_len=8, seed=3)
    requests = random_requests(config, VOCAB)
    assert len(requests) == 20
    assert all(r.prompt_len == 72 == len(r.prompt) for r in requests)
    assert all(r.expected_output_len == 16 for r in requests)
    assert len({tuple(r.prompt[:8]) for r in requests}) == 1  # one shared prefix
    assert len({tuple(r.prompt) for r in requests}) == 20
    assert all(0 <= t < VOCAB for r in requests for t in r.prompt)


def test_random_range_ratio_bounds() -> None:
    config = DatasetConfig(num_prompts=400, random_input_len=100, random_output_len=10,
                           random_range_ratio=0.5)
    requests = random_requests(config, VOCAB)
    inputs = [r.prompt_len for r in requests]
    outputs = [r.expected_output_len for r in requests]
    assert min(inputs) >= 50 and max(inputs) <= 150 and len(set(inputs)) > 50
    assert min(outputs) >= 5 and max(outputs) <= 15


@pytest.mark.parametrize(("mean", "ratio"), [(100, 0.1), (10, 0.1), (1000, 0.3), (100, 0.7)])
def test_random_range_ratio_float_products_stay_in_range(mean: int, ratio: float) -> None:
    """100 * 1.1 is 110.00000000000001 in floats: its ceil must not admit 111."""
    config = DatasetConfig(num_prompts=3000, random_input_len=mean, random_output_len=mean,
                           random_range_ratio=ratio, seed=2)
    requests = random_requests(config, VOCAB)
    low, high = round(mean * (1 - ratio)), round(mean * (1 + ratio))
    for lengths in ([r.prompt_len for r in requests],
                    [r.expected_output_len for r in requests]):
        assert min(lengths) == low and max(lengths) == high


def test_random_is_seeded() -> None:
    config = DatasetConfig(num_prompts=5, random_input_len=32, seed=7)
    assert random_requests(config, VOCAB) == random_requests(config, VOCAB)
    other = random_requests(dataclasses.replace(config, seed=8), VOCAB)
    assert other != random_requests(config, VOCAB)


def test_prefix_repetition() -> None:
    config = DatasetConfig(name="prefix_repetition", num_prompts=12, prefix_len=32,
                           suffix_len=8, num_prefixes=3, prefix_output_len=5, seed=1)
    requests = prefix_repetition_requests(config, VOCAB)
    assert len(requests) == 12
    assert all(r.prompt_len == 40 and r.expected_output_len == 5 for r in requests)
    prefixes = [tuple(r.prompt[:32]) for r in requests]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert len({tuple(r.prompt[32:]) for r in requests}) == 12
    assert requests == prefix_repetition_requests(config, VOCAB)


class _SpaceTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))


def test_sharegpt_filters_and_overrides(tmp_path: Path) -> None:
    def conv(prompt_words: int, reply_words: int) -> dict:
        return {"conversations": [{"from": "human", "value": "w " * prompt_words},
                                  {"from": "gpt", "value": "r " * reply_words}]}

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([conv(10, 20), conv(2, 20), conv(30, 3), conv(2000, 10),
                                conv(12, 8), {"conversations": []}]))
    config = DatasetConfig(name="sharegpt", path=str(path), num_prompts=10)
    requests = sharegpt_requests(config, _SpaceTokenizer())
    assert sorted((r.prompt_len, r.expected_output_len) for r in requests) == [(10, 20), (12, 8)]
    fixed = sharegpt_requests(dataclasses.replace(config, sharegpt_output_len=7),
                              _SpaceTokenizer())
    # A fixed output length lifts only the reply's floor: prompts are still filtered.
    assert sorted(r.prompt_len for r in fixed) == [10, 12, 30]
    assert all(r.expected_output_len == 7 for r in fixed)


def test_sharegpt_fixed_output_len_still_filters_prompt_lengths(tmp_path: Path) -> None:
    """vLLM's filter with --sharegpt-output-len: a short reply is fine, but a prompt under
    4 or over 1024 tokens, or prompt + output over 2048, is still dropped (it used to send
    every conversation, so over-long prompts hit the server's length limit)."""
    def conv(prompt_words: int) -> dict:
        return {"conversations": [{"from": "human", "value": "w " * prompt_words},
                                  {"from": "gpt", "value": "r"}]}

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([conv(10), conv(2), conv(2000), conv(1000), conv(900)]))
    config = DatasetConfig(name="sharegpt", path=str(path), num_prompts=10,
                           sharegpt_output_len=1100)
    requests = sharegpt_requests(config, _SpaceTokenizer())
    assert sorted(r.prompt_len for r in requests) == [10, 900]
    assert all(r.expected_output_len == 1100 for r in requests)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5


def test_offsets_end_at_n_over_rate_and_increase() -> None:
    offsets = arrival_offsets(200, 4.0, burstiness=1.0, seed=0)
    assert offsets[-1] == pytest.approx(200 / 4.0)
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets == arrival_offsets(200, 4.0, burstiness=1.0, seed=0)
    assert offsets != arrival_offsets(200, 4.0, burstiness=1.0, seed=1)


def test_infinite_burstiness_is_evenly_spaced() -> None:
    offsets = arrival_offsets(4, 2.0, burstiness=math.inf)
    assert offsets == pytest.approx([0.5, 1.0, 1.5, 2.0])


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_gaps_have_the_rate_mean_and_burstiness_variance(burstiness: float) -> None:
    offsets = np.array(arrival_offsets(20000, 10.0, burstiness=burstiness, seed=5))
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert gaps.mean() == pytest.approx(0.1, rel=1e-6)  # normalized to n / rate
    # Gamma(shape=k): squared coefficient of variation 1/k (1 = Poisson).
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.1)


def test_bad_rates_are_refused() -> None:
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, burstiness=0.0)
