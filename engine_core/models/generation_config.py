"""A checkpoint's ``generation_config.json`` applied to requests as vLLM applies it.

Its ``eos_token_id`` ids (and the tokenizer's eos token) stop every request that does not
set ``ignore_eos``: they join the request's ``stop_token_ids``, so such a stop reports the
id as ``stop_reason`` (ids the engine already treats as EOS, config.json's, report None).
Its sampling values (``--generation-config``, ``--override-generation-config``) are the
defaults of requests that omit them; a request's own values win.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_core.config import GENERATION_CONFIG_KEYS, ModelConfig
from engine_core.errors import ConfigError, InvalidRequestError
from engine_core.models.spec import ModelSpec, token_ids
from engine_core.sampling_params import SamplingParams

logger = logging.getLogger("pdserve.generation_config")

FILE_NAME = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """What the generation config asks of every request."""

    # Added to each request's stop_token_ids unless it sets ignore_eos.
    stop_token_ids: tuple[int, ...] = ()
    # Sampling values (GENERATION_CONFIG_KEYS) for requests that omit them; never mutated.
    sampling: dict[str, Any] = field(default_factory=dict)

    def request_kwargs(self, given: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams arguments of an API request: ``given`` (the values the request
        set) over the defaults, the eos ids among its stop ids unless it ignores eos."""
        kwargs = {**self.sampling, **given}
        if not kwargs.get("ignore_eos"):
            kwargs["stop_token_ids"] = self._with_stops(kwargs.get("stop_token_ids") or [])
        return kwargs

    def default_params(self) -> SamplingParams:
        """The offline ``LLM``'s params when none are given (vLLM's
        ``get_default_sampling_params``)."""
        return SamplingParams(**self.sampling)

    def stopping(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the eos ids among its stop ids (a copy; ``params`` may be shared)."""
        if params.ignore_eos:
            return params
        stops = self._with_stops(params.stop_token_ids)
        if len(stops) == len(params.stop_token_ids):
            return params
        return dataclasses.replace(params, stop_token_ids=stops)

    def _with_stops(self, stop_token_ids: Sequence[int]) -> list[int]:
        present = set(stop_token_ids)
        return [*stop_token_ids, *(t for t in self.stop_token_ids if t not in present)]


def load_generation_defaults(model: ModelConfig, tokenizer_eos: int | None
                             ) -> GenerationDefaults:
    """The defaults ``model``'s flags select (logged when there are sampling values).

    ``tokenizer_eos``: the tokenizer's eos token id, which stops requests in vLLM even
    where the configs do not name it. Raises ConfigError for a folder without the file or
    values SamplingParams refuses."""
    model_dir = Path(model.model)
    spec = ModelSpec.from_hf_config(_read_json(model_dir / "config.json"))
    source = model_dir if model.generation_config in ("auto", "vllm") else Path(
        model.generation_config)
    if source != model_dir and not (source / FILE_NAME).is_file():
        raise ConfigError(f"--generation-config {str(source)!r} has no {FILE_NAME}")
    found = _read_json(source / FILE_NAME) if (source / FILE_NAME).is_file() else {}
    stops = _stop_token_ids(found, tokenizer_eos, spec)
    from_file = {} if model.generation_config == "vllm" else _sampling_values(found)
    sampling = {**from_file, **model.override_generation_config}
    _check(sampling)
    if from_file:
        logger.info("Default sampling parameters from %s: %s (requests that omit them get "
                    "these; --generation-config vllm ignores them)", source / FILE_NAME,
                    from_file)
    if model.override_generation_config:
        logger.info("Default sampling parameters from --override-generation-config: %s",
                    model.override_generation_config)
    if stops:
        logger.info("Requests also stop at eos token ids %s (unless ignore_eos)", list(stops))
    return GenerationDefaults(stops, sampling)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def _stop_token_ids(found: dict[str, Any], tokenizer_eos: int | None,
                    spec: ModelSpec) -> tuple[int, ...]:
    """The generation config's eos ids and the tokenizer's, less those the engine already
    stops at (config.json's) and any outside the vocabulary (the engine refuses those)."""
    try:
        ids = token_ids(found.get("eos_token_id"))
    except (TypeError, ValueError):
        raise ConfigError(f"{FILE_NAME}: eos_token_id must be a token id or a list of them"
                          ) from None
    if tokenizer_eos is not None:
        ids += (int(tokenizer_eos),)
    outside = sorted({t for t in ids if not 0 <= t < spec.vocab_size})
    if outside:
        logger.warning("eos token ids %s are outside the vocabulary (%d); ignored", outside,
                       spec.vocab_size)
    engine_eos = set(spec.eos_token_ids)
    return tuple(dict.fromkeys(t for t in ids
                               if t not in engine_eos and 0 <= t < spec.vocab_size))


def _sampling_values(found: dict[str, Any]) -> dict[str, Any]:
    """The file's sampling keys that are set (as vLLM; ``do_sample`` is not one)."""
    if found.get("max_new_tokens") is not None:
        logger.warning("%s: max_new_tokens=%s is not applied as a default", FILE_NAME,
                       found["max_new_tokens"])
    return {key: found[key] for key in GENERATION_CONFIG_KEYS if found.get(key) is not None}


def _check(sampling: dict[str, Any]) -> None:
    """Refuse at startup values every request would be refused for."""
    try:
        SamplingParams(**sampling)
    except InvalidRequestError as exc:
        raise ConfigError(f"generation config default {exc.param}: {exc}") from None

