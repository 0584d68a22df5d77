"""``kv_transfer_params``: a request's KV transfer and stream handoff, as typed values.

Two shapes cross the API, under vLLM's field name: ``KVTransferParams`` is what the proxy
sends a worker with a request (where the prompt's KV comes from or goes to, under which
grant, how the stream is split between workers, and the prompt logprobs a prefill worker
computed for a decode worker to answer with); ``KVTransferResult`` is what a prefill
worker answers about the KV it keeps for its peer. A body's value is checked once, by
``KVTransferParams.from_wire`` (a bad value is an ``InvalidRequestError`` naming
``kv_transfer_params``: one 400); every reader after that uses attributes. Keys the params do
not name are ignored, as vLLM's connectors ignore keys they do not read.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from engine_core.addresses import is_host_port
from engine_core.cluster.grants import MAX_GRANT_CHARS, MAX_TRANSFER_ID_CHARS
from engine_core.errors import InvalidRequestError
from engine_core.parallel.kv_layout import KVLayoutError, PeerRanks
from engine_core.request_limits import MAX_CHOICES

PARAM = "kv_transfer_params"
MAX_PARAMS_DEPTH = 8  # nesting of a body's value (the proxy's are two deep)
_FLAGS = ("do_remote_prefill", "do_remote_decode", "first_token_events", "stream_token_ids")
_TEXTS = ("transfer_id", "remote_kv_address", "grant")
REMOTE_RANKS = "remote_ranks"  # the peer worker's KV layout and rank addresses
PROMPT_LOGPROBS = "prompt_logprobs"  # a decode leg's: the prefill worker's, one per prompt
MAX_PROMPT_LOGPROBS = 20  # top alternatives per position, as SamplingParams.prompt_logprobs


def is_transfer_id(value: object) -> bool:
    """A transfer id: 1 to ``MAX_TRANSFER_ID_CHARS`` printable characters of valid UTF-8
    (a lone surrogate cannot cross the engine socket)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TRANSFER_ID_CHARS:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return value.isprintable()


@dataclass(frozen=True)
class KVTransferParams:
    """What the proxy tells a worker about one request; every field is optional.

    ``do_remote_decode``: a prefill leg; this worker computes the prompt and sends its KV to
    the decode worker at ``remote_kv_address``. ``do_remote_prefill``: a decode leg; the
    prompt's KV comes from the prefill worker at ``remote_kv_address``. Both move KV only
    under ``grant`` (``engine_core.cluster.grants``) for ``transfer_id``; a leg lacking any
    of the three moves no KV and is computed here.
    ``first_token_events``: a prefill worker samples each choice's first token and answers
    the stream's first events too. ``generated_token_ids``: one list per choice of the
    output tokens the client already has; the request continues after them (None: it
    continues nothing). ``stream_token_ids``: each stream event names its output tokens
    (an SSE comment), so the proxy can move the stream to another worker.
    ``prompt_logprobs``: a decode leg's, one per prompt, computed by the prefill worker; the
    server answers with them (checked against its prompts) and its engine computes none.
    ``remote_ranks``: the peer worker's KV layout and each of its ranks' connector
    addresses (as it registered them), so KV moves between tensor-parallel layouts rank to
    rank; None: the peer is one rank at ``remote_kv_address``.
    """

    transfer_id: str | None = None
    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_kv_address: str | None = None
    grant: str | None = None
    first_token_events: bool = False
    generated_token_ids: tuple[tuple[int, ...], ...] | None = None
    stream_token_ids: bool = False
    prompt_logprobs: tuple[PromptLogprobColumns, ...] | None = None
    remote_ranks: PeerRanks | None = None

    def __post_init__(self) -> None:
        for name in _FLAGS:
            if type(getattr(self, name)) is not bool:
                raise InvalidRequestError(f"{PARAM}.{name} must be a boolean", PARAM)
        if self.transfer_id is not None and not is_transfer_id(self.transfer_id):
            raise InvalidRequestError(f"{PARAM}.transfer_id must be 1 to "
                                      f"{MAX_TRANSFER_ID_CHARS} printable characters", PARAM)
        if self.remote_kv_address is not None and not is_host_port(self.remote_kv_address):
            raise InvalidRequestError(f"{PARAM}.remote_kv_address must be host:port", PARAM)
        if self.grant is not None and (not isinstance(self.grant, str)
                                       or len(self.grant) > MAX_GRANT_CHARS):
            raise InvalidRequestError(f"{PARAM}.grant must be a string of at most "
                                      f"{MAX_GRANT_CHARS} characters", PARAM)
        if self.generated_token_ids is not None:
            _check_generated(self.generated_token_ids)
            if self.first_token_events:
                raise InvalidRequestError(f"{PARAM}: first_token_events and "
                                          "generated_token_ids exclude each other", PARAM)
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, tuple) or not self.prompt_logprobs
                or not all(isinstance(c, PromptLogprobColumns) for c in self.prompt_logprobs)):
            raise InvalidRequestError(f"{PARAM}.{PROMPT_LOGPROBS} must be a non-empty list, "
                                      "one entry per prompt", PARAM)
        if self.remote_ranks is not None and not isinstance(self.remote_ranks, PeerRanks):
            raise InvalidRequestError(f"{PARAM}.{REMOTE_RANKS} must be peer ranks", PARAM)

    @classmethod
    def from_wire(cls, value: object) -> KVTransferParams:
        """The params of a request body's ``kv_transfer_params`` (a JSON object; null
        values count as absent); raises InvalidRequestError for anything else."""
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{PARAM} must be an object", PARAM)
        if not _fits_the_wire(value):
            raise InvalidRequestError(
                f"{PARAM} must be JSON of string keys, 64-bit integers and UTF-8 strings, "
                f"nested at most {MAX_PARAMS_DEPTH} deep", PARAM)
        fields: dict[str, Any] = {name: value[name] for name in (*_FLAGS, *_TEXTS)
                                  if value.get(name) is not None}
        generated = value.get("generated_token_ids")
        if generated is not None:
            if not isinstance(generated, list) or not all(isinstance(ids, list)
                                                          for ids in generated):
                raise InvalidRequestError(_GENERATED_SHAPE, PARAM)
            fields["generated_token_ids"] = tuple(tuple(ids) for ids in generated)
        given = value.get(PROMPT_LOGPROBS)
        if given is not None:
            if not isinstance(given, list):
                raise InvalidRequestError(f"{PARAM}.{PROMPT_LOGPROBS} must be a list, one "
                                          "entry per prompt", PARAM)
            fields[PROMPT_LOGPROBS] = tuple(PromptLogprobColumns.from_wire(entry)
                                            for entry in given)
        ranks = value.get(REMOTE_RANKS)
        if ranks is not None:
            try:
                fields[REMOTE_RANKS] = PeerRanks.from_wire(ranks)
            except KVLayoutError as exc:
                raise InvalidRequestError(f"{PARAM}.{REMOTE_RANKS}: {exc}", PARAM) from None
        return cls(**fields)

    def to_wire(self) -> dict[str, Any]:
        """The JSON object: the fields that are set (true, or not None)."""
        wire: dict[str, Any] = {}
        for name in (*_TEXTS, *_FLAGS):
            value = getattr(self, name)
            if value:
                wire[name] = value
        if self.generated_token_ids is not None:
            wire["generated_token_ids"] = [list(ids) for ids in self.generated_token_ids]
        if self.prompt_logprobs is not None:
            wire[PROMPT_LOGPROBS] = [columns.to_wire() for columns in self.prompt_logprobs]
        if self.remote_ranks is not None:
            wire[REMOTE_RANKS] = self.remote_ranks.to_wire()
        return wire

    @property
    def moves_kv(self) -> bool:
        """Whether the request's prompt KV moves to or from another worker."""
        return self.do_remote_prefill or self.do_remote_decode

    def without_kv_transfer(self) -> KVTransferParams:
        """These params with no KV to move (a recompute, or a sample after a prompt's
        first, which finds the prompt in the prefix cache)."""
        return dataclasses.replace(self, do_remote_prefill=False, do_remote_decode=False)


@dataclass(frozen=True)
class PromptLogprobColumns:
    """One prompt's logprobs as its prefill worker computed them, a column per value over
    the prompt's positions after the first (compact JSON): the prompt token, its logprob and
    rank, and the same number (k) of top alternatives' ids and logprobs at every position.
    Whether they belong to a request's prompt and k is the server's check."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top_token_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        columns = (self.token_ids, self.logprobs, self.ranks, self.top_token_ids,
                   self.top_logprobs)
        if not all(isinstance(column, tuple) for column in columns) or len(
                {len(column) for column in columns}) != 1:
            raise _bad_columns("needs token_ids, logprobs, ranks, top_token_ids and "
                               "top_logprobs of one length (the prompt's positions after "
                               "the first)")
        k = len(self.top_token_ids[0]) if self.top_token_ids else 0
        if (not all(_is_token_id(t) for t in self.token_ids)
                or not all(_is_logprob(v) for v in self.logprobs)
                or not all(type(r) is int and r >= 1 for r in self.ranks)
                or not 0 <= k <= MAX_PROMPT_LOGPROBS
                or not all(isinstance(ids, tuple) and isinstance(values, tuple)
                           and len(ids) == len(values) == k
                           and all(_is_token_id(t) for t in ids)
                           and all(_is_logprob(v) for v in values)
                           for ids, values in zip(self.top_token_ids, self.top_logprobs))):
            raise _bad_columns(f"malformed entry (each needs a token id, a logprob <= 0, a "
                               f"rank >= 1 and the same number, at most "
                               f"{MAX_PROMPT_LOGPROBS}, of top ids and logprobs)")

    @property
    def num_top(self) -> int:
        """k: the top alternatives at each position (0 for a one-token prompt)."""
        return len(self.top_token_ids[0]) if self.top_token_ids else 0

    @classmethod
    def from_wire(cls, value: object) -> PromptLogprobColumns:
        """One prompt's entry of a body's ``kv_transfer_params.prompt_logprobs``."""
        if not isinstance(value, dict):
            raise _bad_columns("each prompt's entry must be an object")
        columns = [value.get(name) for name in _COLUMNS]
        if not all(isinstance(column, list) for column in columns):
            raise _bad_columns(f"each prompt's entry needs the lists {', '.join(_COLUMNS)}")
        token_ids, logprobs, ranks, top_ids, top_values = columns
        if not all(isinstance(row, list) for row in (*top_ids, *top_values)):
            raise _bad_columns("top_token_ids and top_logprobs must be lists of lists")
        return cls(tuple(token_ids), tuple(_as_float(v) for v in logprobs), tuple(ranks),
                   tuple(tuple(row) for row in top_ids),
                   tuple(tuple(_as_float(v) for v in row) for row in top_values))

    def to_wire(self) -> dict[str, Any]:
        """The JSON object: one list per column."""
        return {name: [list(v) if isinstance(v, tuple) else v for v in getattr(self, name)]
                for name in _COLUMNS}


_COLUMNS = tuple(f.name for f in dataclasses.fields(PromptLogprobColumns))


def _bad_columns(why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{PARAM}.{PROMPT_LOGPROBS}: {why}", PARAM)


def _is_token_id(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_logprob(value: object) -> bool:
    return type(value) is float and math.isfinite(value) and value <= 0.0


def _as_float(value: object) -> object:
    """A JSON number as a float (an integral logprob arrives as an int); others unchanged,
    for the check to refuse."""
    return float(value) if type(value) is int and abs(value) < 1 << 64 else value


@dataclass(frozen=True)
class KVTransferResult:
    """A prefill worker's answer about the prompt KV it computed for ``transfer_id``:
    ``num_kv_blocks`` blocks, kept at ``remote_kv_address`` (its KV address) for the decode
    worker to pull."""

    transfer_id: str
    remote_kv_address: str
    num_kv_blocks: int

    def to_wire(self) -> dict[str, Any]:
        """The JSON object of a response's ``kv_transfer_params``."""
        return dataclasses.asdict(self)


_GENERATED_SHAPE = (f"{PARAM}.generated_token_ids must be a list (one per choice) of lists "
                    "of non-negative token ids")


def _check_generated(generated: object) -> None:
    """One tuple of non-negative token ids per choice, 1 to ``MAX_CHOICES`` of them (a
    choice's may be empty: a stream moved before its first token)."""
    if not isinstance(generated, tuple) or len(generated) > MAX_CHOICES or not all(
            isinstance(ids, tuple) and all(type(t) is int and t >= 0 for t in ids)
            for ids in generated):
        raise InvalidRequestError(_GENERATED_SHAPE, PARAM)
    if not generated:
        raise InvalidRequestError(f"{PARAM}.generated_token_ids names no choice", PARAM)


def _fits_the_wire(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is JSON the engine socket (msgpack) could carry: a lone surrogate,
    an integer past 64 bits or deep nesting is a 400 at the edge, never a failed encoding
    (a 500) later. The whole value is checked, ignored keys too, so what a body may hold
    does not depend on which keys this version reads."""
    if depth > MAX_PARAMS_DEPTH:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _fits_the_wire(k, depth)
                   and _fits_the_wire(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_fits_the_wire(v, depth + 1) for v in value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return True
    return isinstance(value, int) and -(1 << 63) <= value < (1 << 64)
