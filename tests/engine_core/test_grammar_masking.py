"""No sampled token leaves the grammar: random weights, temperature 1.0, 1,000 sampled
requests through ``LLM`` in one batch (n=20 over 50 prompts: 400 under a JSON schema, 300 under
a regex, 300 under a choice), so differently constrained rows share every step. With the mask
off the outputs are noise and these fail."""

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
CHOICES = ("yes", "no", 'it "depends"')
SAMPLES_PER_PROMPT = 20
# kind -> (constraint, max_tokens, prompts of that kind)
CASES = {
    "json": (StructuredOutputsParams(json=SCHEMA), 64, 20),
    "regex": (StructuredOutputsParams(regex=REGEX), 24, 15),
    "choice": (StructuredOutputsParams(choice=CHOICES), 24, 15),
}


@pytest.fixture(scope="module")
def samples(tiny_checkpoint) -> dict[str, list[str]]:
    """Each kind's completions, from one generate call over all 1,000 requests."""
    # Async scheduling (the default): masks are filled once the step before is collected.
    llm = LLM(str(tiny_checkpoint("llama")), max_num_seqs=512, max_model_len=128,
              max_num_batched_tokens=4096, enforce_eager=True)
    try:
        prompts, params, kinds = [], [], []
        for kind, (constraint, max_tokens, count) in CASES.items():
            for i in range(count):
                prompts.append(f"request {i} ({kind}): answer")
                params.append(SamplingParams(n=SAMPLES_PER_PROMPT, temperature=1.0,
                                             max_tokens=max_tokens,
                                             structured_outputs=constraint))
                kinds.append(kind)
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    texts: dict[str, list[str]] = {kind: [] for kind in CASES}
    for kind, output in zip(kinds, outputs, strict=True):
        assert len(output.outputs) == SAMPLES_PER_PROMPT
        assert all(c.finish_reason == "stop" for c in output.outputs), (
            kind, [c.text for c in output.outputs if c.finish_reason != "stop"][:3])
        texts[kind].extend(c.text for c in output.outputs)
    assert sum(map(len, texts.values())) == 1000
    return texts


def test_json_schema_outputs_always_validate(samples) -> None:
    for text in samples["json"]:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_outputs_always_match(samples) -> None:
    texts = samples["regex"]
    assert all(re.fullmatch(REGEX, t) for t in texts), [t for t in texts
                                                       if not re.fullmatch(REGEX, t)][:5]
    assert len(set(texts)) > 50  # sampled, not one greedy answer


def test_choice_outputs_are_one_of_the_choices(samples) -> None:
    texts = samples["choice"]
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1
