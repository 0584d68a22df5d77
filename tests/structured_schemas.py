"""JSON schemas generated for the structured-output tests: objects, arrays, enums, nested
objects, required fields; every string, number and array is bounded, so a random-weight
model (which picks among the allowed tokens nearly uniformly) finishes within a few dozen
tokens."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["red", "green", "blue", "cat", "dog", "yes", "no", "up", "down", "left"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["integer", "enum", "boolean", "string", "array"])
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 99)}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "pattern": f"^[a-z]{{1,{rng.randint(1, 5)}}}$"}
    return {"type": "array", "items": {"enum": rng.sample(_WORDS, 2)},
            "maxItems": rng.randint(1, 3)}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["a", "b", "c", "d", "e", "f"], rng.randint(1, 3))
    properties = {name: (_object(rng, depth + 1) if depth < 1 and rng.random() < 0.3
                         else _leaf(rng)) for name in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def generated_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` schemas: mostly objects (some nested), some top-level arrays of objects."""
    rng = random.Random(seed)
    schemas = []
    for index in range(count):
        schema = _object(rng, 0)
        if index % 5 == 4:
            schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 2}
        schemas.append(schema)
    return schemas
