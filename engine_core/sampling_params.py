"""Per-request sampling parameters, validated once at creation."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from engine_core.errors import InvalidRequestError
from engine_core.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# Bounds on the host work one request adds to every step it is in (its bias and allowed
# tokens are gathered per step) and to every token it decodes (stop-string hold-back).
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_STOP_STRING_CHARS = 1024
MAX_N = 128  # samples per prompt in one API request
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # what the engine's socket codec carries
MAX_TOKEN_ID = (1 << 31) - 1  # any vocabulary's bound; the engine checks its own size


def _is_int(value: Any, low: int = INT64_MIN, high: int = INT64_MAX) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value <= high


def _is_token_id(value: Any) -> bool:
    return _is_int(value, 0, MAX_TOKEN_ID)


# Sampling runs in float32: a parameter beyond its range becomes inf on the device (a
# temperature of 1e300 made every logit NaN and the sampler pick token 0).
FLOAT32_MAX = 3.4028234663852886e38
# repetition_penalty divides or multiplies logits: further out, they overflow float32.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


def _is_number(value: Any) -> bool:
    """An int or float that is finite in float32 (JSON's NaN and Infinity are not, nor an
    integer of hundreds of digits, which float() cannot even convert)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and abs(float(value)) <= FLOAT32_MAX
    except OverflowError:
        return False


def _is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a lone surrogate, which JSON's \\ud800 escape
    gives, does not, and the engine socket could not carry it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def sample_seed(seed: int, sample: int) -> int:
    """Sample ``sample``'s seed of a request seeded ``seed`` (``seed + sample``, as vLLM),
    wrapped into int64 so that it still crosses the engine socket."""
    return (seed + sample - INT64_MIN) % (1 << 64) + INT64_MIN


@dataclass
class SamplingParams:
    """What to sample and when to stop; mirrors vLLM's fields and defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # vLLM's prompt_logprobs: per prompt position after the first, the prompt token's
    # logprob and the top ``prompt_logprobs`` alternatives.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Token id -> value added to its logit before sampling (OpenAI's logit_bias, -100..100).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's allowed_token_ids: when given, every other token is masked out.
    allowed_token_ids: list[int] | None = None
    # The grammar the output must match (response_format, structured_outputs, guided_*).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k is None or (_is_int(self.top_k) and self.top_k == -1):
            self.top_k = 0  # vLLM accepts -1 and 0 for "off"
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the offending parameter."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not _is_number(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a finite number", name)
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be an integer", name)
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise InvalidRequestError(f"{name} must be a 64-bit integer", name)
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be -1 or 0 (off), or at least 1", "top_k")
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}]", "n")
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequestError("presence_penalty must be in [-2, 2]", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequestError("frequency_penalty must be in [-2, 2]", "frequency_penalty")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise InvalidRequestError(f"repetition_penalty must be in [{low:g}, {high:g}]",
                                      "repetition_penalty")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be >= 1", "max_tokens")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidRequestError("min_tokens must be in [0, max_tokens]", "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("logprobs must be in [0, 20]", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError("prompt_logprobs must be in [0, 20]", "prompt_logprobs")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS
               or not _is_utf8(s) for s in self.stop):
            raise InvalidRequestError(
                f"stop must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters",
                "stop")
        if not all(_is_token_id(t) for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be token ids", "stop_token_ids")
        if self.allowed_token_ids is not None and (
                not 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
                or not all(_is_token_id(t) for t in self.allowed_token_ids)):
            raise InvalidRequestError(
                f"allowed_token_ids must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} "
                "token ids", "allowed_token_ids")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens", "logit_bias")
        for token, bias in self.logit_bias.items():
            if not _is_token_id(token):
                raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias")
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError("logit_bias values must be in [-100, 100]",
                                          "logit_bias")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameters {sorted(unknown)}")
        return cls(**data)
