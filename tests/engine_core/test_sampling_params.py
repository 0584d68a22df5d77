"""SamplingParams validation: every value that reaches the engine is finite, in range, and
fits the engine socket's 64-bit integers."""

from __future__ import annotations

import math

import pytest

from engine_core.errors import InvalidRequestError
from engine_core.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_ALLOWED_TOKEN_IDS,
    SamplingParams,
    sample_seed,
)

BAD = [
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan),
    ("min_p", math.nan), ("presence_penalty", -math.inf), ("frequency_penalty", math.nan),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf),
    ("seed", 1 << 63), ("seed", INT64_MIN - 1), ("top_k", 1 << 64), ("min_tokens", 1 << 64),
    ("max_tokens", 1 << 64), ("n", True), ("stop_token_ids", [1 << 40]),
    ("stop_token_ids", [True]), ("allowed_token_ids", [5] * (MAX_ALLOWED_TOKEN_IDS + 1)),
    ("allowed_token_ids", [1 << 64]), ("logit_bias", {1 << 64: 1.0}),
    ("logit_bias", {5: math.nan}), ("stop", ["x" * 1025]), ("top_k", -5), ("top_k", -2),
    ("top_k", "5"), ("top_k", 2.5),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r:.20}" for n, v in BAD])
def test_out_of_range_values_are_refused_naming_the_parameter(name: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{name: value})
    assert info.value.param == name


def test_edge_values_are_accepted() -> None:
    SamplingParams(seed=INT64_MAX, top_k=-1, temperature=0.0, stop=["x" * 1024],
                   allowed_token_ids=[0] * MAX_ALLOWED_TOKEN_IDS, logit_bias={5: -100})
    SamplingParams(seed=INT64_MIN, repetition_penalty=2.0, stop_token_ids=[(1 << 31) - 1])
    assert SamplingParams(top_k=-1).top_k == SamplingParams(top_k=0).top_k == 0


def test_sample_seeds_are_seed_plus_index_wrapped_into_int64() -> None:
    assert [sample_seed(7, s) for s in range(3)] == [7, 8, 9]
    assert sample_seed(INT64_MAX, 1) == INT64_MIN
    assert sample_seed(-3, 2) == -1
    assert all(INT64_MIN <= sample_seed(INT64_MAX - 5, s) <= INT64_MAX for s in range(128))
