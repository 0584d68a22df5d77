"""No sampled token leaves the grammar: random weights, temperature 1.0, 1,000 samples each
for a JSON schema and a regex through ``LLM`` (n=50 x 20 prompts). With the mask off the
outputs are noise and these fail."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_core.llm import LLM
from engine_core.sampling_params import SamplingParams
from engine_core.structured_outputs import StructuredOutputsParams

# Bounded everywhere (string patterns, integer ranges, item counts): random weights pick
# among allowed tokens nearly uniformly, and an unbounded string or number never ends.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["id", "kind", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{1,3}(\.[A-Z])?"
PROMPTS = [f"request {i}: answer" for i in range(20)]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    # Async scheduling (the default): masks are filled once the step before is collected.
    engine = LLM(str(tiny_checkpoint("llama")), max_num_seqs=512, max_model_len=128,
                 max_num_batched_tokens=4096, enforce_eager=True)
    yield engine
    engine.shutdown()


def _texts(llm: LLM, constraint: StructuredOutputsParams, max_tokens: int) -> list[str]:
    params = SamplingParams(n=50, temperature=1.0, max_tokens=max_tokens,
                            structured_outputs=constraint)
    outputs = llm.generate(PROMPTS, params)
    completions = [c for o in outputs for c in o.outputs]
    assert len(completions) == 1000
    assert all(c.finish_reason == "stop" for c in completions), (
        [c.text for c in completions if c.finish_reason != "stop"][:3])
    return [c.text for c in completions]


def test_json_schema_outputs_always_validate(llm) -> None:
    for text in _texts(llm, StructuredOutputsParams(json=SCHEMA), max_tokens=64):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_outputs_always_match(llm) -> None:
    texts = _texts(llm, StructuredOutputsParams(regex=REGEX), max_tokens=24)
    assert all(re.fullmatch(REGEX, t) for t in texts), [t for t in texts
                                                       if not re.fullmatch(REGEX, t)][:5]
    assert len(set(texts)) > 50  # sampled, not one greedy answer


def test_choice_outputs_are_one_of_the_choices(llm) -> None:
    choices = ("yes", "no", 'it "depends"')
    texts = _texts(llm, StructuredOutputsParams(choice=choices), max_tokens=24)
    assert set(texts) <= set(choices) and len(set(texts)) > 1
