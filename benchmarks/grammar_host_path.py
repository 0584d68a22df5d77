"""The host's share of a constrained decode step, on the CPU: grammar advance, mask fill, and
the whole host part of a step, with real xgrammar matchers and no model.

Matchers run the JSON schema of ``benchmarks/structured_outputs.py`` compiled by the
engine's ``GrammarCompiler`` against a 151,936-id vocabulary (Qwen3's logits width):
``--tokenizer bytes`` (default) is a synthetic byte-level vocabulary of that size
(``benchmarks/synthetic_vocab.py``); ``demo`` is the demo tokenizer's 1,000 entries, which
leaves 150,936 ids empty (what ``structured_outputs.py`` ran on before it took ``bytes``).
Each request follows a script: a valid document of the schema, split greedily into
vocabulary pieces. Per batch size (1, 16, 64), medians in ms of:

- ``advance``: one token into every matcher as the scheduler's update does it
  (``accept_token`` and ``is_terminated`` per request); ``advance_batch``: xgrammar's
  ``batch_accept_token`` over the same matchers;
- ``fill``: the batched fill of every row's mask (``BitmaskFiller``, on its thread);
- ``step``: the whole host part of a step with a scripted runner (no device): schedule,
  collect, update (the advance), mask selection and fill, in the engine's order, for plain
  requests, and for constrained ones with the fill waited for in the step (``serial``) and
  with the fill left running while the next step schedules (``overlapped``, the engine's);
  ``schedule``, ``update`` and ``fill_wait`` are its parts on the engine's thread.

    python3 -m benchmarks.grammar_host_path [--tokenizer bytes|demo] [--out /tmp/ghp.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from benchmarks.model_shapes import write_model_dir
from benchmarks.structured_outputs import SCHEMA
from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.grammar.bitmask import BitmaskFiller, FillJob, num_words
from engine_core.grammar.compiler import GrammarCompiler
from engine_core.grammar.matcher import SequenceGrammar
from engine_core.grammar.spec import grammar_spec
from engine_core.kv_connector import NullConnectorScheduler
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.block_hash import BlockHasher
from engine_core.sched.block_pool import BlockPool
from engine_core.sched.kv_cache_manager import KVCacheManager
from engine_core.sched.outputs import ModelRunnerOutput, SchedulerOutput
from engine_core.sched.scheduler import Scheduler
from engine_core.structured_outputs import StructuredOutputsParams

VOCAB_SIZE = 151936
PROMPT_LEN = 32
BLOCK_SIZE = 16
MAX_PIECE_BYTES = 12


def scripts(decoded_vocab: list[bytes], count: int, min_tokens: int,
            seed: int = 0) -> list[list[int]]:
    """``count`` token scripts of at least ``min_tokens`` ids, each a document of ``SCHEMA``
    (strings of the vocabulary's ASCII-letter pieces) split greedily into pieces."""
    ids = {piece: i for i, piece in enumerate(decoded_vocab) if 0 < len(piece) <= MAX_PIECE_BYTES}
    words = [p.decode() for p in ids if p.strip().isalpha() and p.isascii()]
    rng = random.Random(seed)
    result = []
    for _ in range(count):
        tokens: list[int] = []
        notes: list[str] = []
        while len(tokens) < min_tokens:
            notes.append("".join(rng.choice(words) for _ in range(rng.randint(4, 16))))
            tokens = _split(json.dumps({"notes": notes}).encode(), ids)
        result.append(tokens)
    return result


def _split(text: bytes, ids: dict[bytes, int]) -> list[int]:
    tokens, start = [], 0
    while start < len(text):
        for end in range(min(len(text), start + MAX_PIECE_BYTES), start, -1):
            if text[start:end] in ids:
                tokens.append(ids[text[start:end]])
                start = end
                break
        else:
            raise ValueError(f"no piece for byte {text[start]}")
    return tokens


class ScriptedRunner:
    """The runner's bookkeeping without a device: a row that samples gets its request's
    next script token; ``launch`` decides it (async scheduling: the token is pending until
    the output is handed to the scheduler)."""

    def __init__(self, scripts_by_id: dict[str, list[int]]) -> None:
        self.scripts = scripts_by_id
        self.length: dict[str, int] = {}
        self.computed: dict[str, int] = {}

    def launch(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for new in out.scheduled_new_reqs:
            self.length[new.request_id] = len(new.token_ids)
            self.computed[new.request_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            self.computed[cached.request_id] = cached.num_computed_tokens
        req_ids, sampled = [], []
        for request_id, n in out.num_scheduled_tokens.items():
            if self.computed[request_id] + n == self.length[request_id]:
                script = self.scripts[request_id]
                sampled.append([script[self.length[request_id] - PROMPT_LEN]])
                req_ids.append(request_id)
                self.length[request_id] += 1
            self.computed[request_id] += n
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def _median_ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def host_steps(compiled: Any, token_scripts: list[list[int]], constrained: bool, mode: str,
               num_steps: int, filler: BitmaskFiller) -> dict[str, float | None]:
    """Run ``len(token_scripts)`` requests to decode and time ``num_steps`` steps in which
    all decode. ``mode``: ``serial`` waits for each fill in its step, ``overlapped`` in the
    next step after its schedule (the engine's order)."""
    batch = len(token_scripts)
    num_blocks = batch * (-(-(PROMPT_LEN + num_steps + 16) // BLOCK_SIZE) + 1)
    manager = KVCacheManager(BlockPool(num_blocks, True), BLOCK_SIZE, BlockHasher(BLOCK_SIZE),
                             True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=batch,
                                          max_num_batched_tokens=batch * PROMPT_LEN),
                          CacheConfig(block_size=BLOCK_SIZE), manager,
                          NullConnectorScheduler(), max_model_len=4096)
    params = SamplingParams(temperature=1.0, max_tokens=num_steps + 8, ignore_eos=True)
    done: Future[Any] = Future()
    done.set_result(compiled)
    for i in range(batch):
        scheduler.add_request(Request(
            f"r{i}", [10 + (i + j) % 900 for j in range(PROMPT_LEN)], params, eos_token_ids=(0,),
            grammar=SequenceGrammar(done) if constrained else None))
    runner = ScriptedRunner({f"r{i}": s for i, s in enumerate(token_scripts)})
    rows = torch.empty(batch, num_words(VOCAB_SIZE), dtype=torch.int32)
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    job: FillJob | None = None
    times: dict[str, list[float]] = {"step": [], "schedule": [], "update": [], "fill_wait": [],
                                     "fill": []}
    steps_run = 0
    while len(times["step"]) < num_steps and steps_run < num_steps + 10:
        steps_run += 1
        decoding = len(scheduler.running) == batch and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
        started = time.perf_counter()
        out = scheduler.schedule()
        scheduled = time.perf_counter()
        fill_seconds, fill_wait = None, 0.0
        if job is not None:  # the engine waits here, before the launch
            wait_started = time.perf_counter()
            fill_seconds = job.wait()
            fill_wait = time.perf_counter() - wait_started
            job = None
        result = runner.launch(out)
        update_started = time.perf_counter()
        if in_flight is not None:
            scheduler.update_from_output(*in_flight)
        updated = time.perf_counter()
        masks = scheduler.grammar_masks(out, result.req_ids)
        if masks is not None:
            job = filler.start(masks, rows)
            if mode == "serial":
                wait_started = time.perf_counter()
                fill_seconds = job.wait()
                fill_wait += time.perf_counter() - wait_started
                job = None
        in_flight = (out, result)
        if decoding:
            times["step"].append(time.perf_counter() - started)
            times["schedule"].append(scheduled - started)
            times["update"].append(updated - update_started)
            times["fill_wait"].append(fill_wait)
            if fill_seconds is not None:
                times["fill"].append(fill_seconds)
    if job is not None:
        job.wait()
    return {name: _median_ms(values) for name, values in times.items()}


def matcher_costs(compiled: Any, token_scripts: list[list[int]], num_steps: int,
                  filler: BitmaskFiller) -> dict[str, float | None]:
    """Median ms of one token into every matcher (per request, then batched) and of the
    batched fill of every mask."""
    import xgrammar as xgr

    from engine_core.grammar.bitmask import StepMasks

    done: Future[Any] = Future()
    done.set_result(compiled)
    grammars = [SequenceGrammar(done) for _ in token_scripts]
    for grammar in grammars:
        grammar.ready([])
    twins = [xgr.GrammarMatcher(compiled) for _ in token_scripts]
    rows = torch.empty(len(grammars), num_words(VOCAB_SIZE), dtype=torch.int32)
    masks = StepMasks([g.matcher for g in grammars], list(range(len(grammars))), len(grammars))
    times: dict[str, list[float]] = {"advance": [], "advance_batch": [], "fill": [],
                                     "fill_wall": []}
    for step in range(num_steps):
        tokens = [script[step] for script in token_scripts]
        started = time.perf_counter()
        for grammar, token in zip(grammars, tokens):
            if not grammar.accept(token) or grammar.is_terminated:
                raise RuntimeError("a script left its grammar")
        times["advance"].append(time.perf_counter() - started)
        started = time.perf_counter()
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(twins, tokens)
        times["advance_batch"].append(time.perf_counter() - started)
        if not all(accepted):
            raise RuntimeError("a script left its grammar")
        started = time.perf_counter()
        times["fill"].append(filler.start(masks, rows).wait())
        times["fill_wall"].append(time.perf_counter() - started)
    return {name: _median_ms(values) for name, values in times.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = write_model_dir("qwen3-8b", Path(tempfile.mkdtemp(prefix="ghp-")),
                                args.tokenizer)
    compiler = GrammarCompiler(str(model_dir), VOCAB_SIZE, (151643,))
    filler = BitmaskFiller()
    try:
        compiled = compiler.submit(grammar_spec(StructuredOutputsParams(json=SCHEMA))).result()
        token_scripts = scripts(compiled.tokenizer_info.decoded_vocab, max(args.batch_sizes),
                                args.steps + 64)
        results = []
        for batch in args.batch_sizes:
            chosen = token_scripts[:batch]
            result: dict[str, Any] = {"batch": batch,
                                      **matcher_costs(compiled, chosen, args.steps, filler)}
            for name, constrained, mode in (("plain", False, "overlapped"),
                                            ("serial", True, "serial"),
                                            ("overlapped", True, "overlapped")):
                result[name] = host_steps(compiled, chosen, constrained, mode, args.steps, filler)
            results.append(result)
            print(f"batch {batch:3d}: advance {result['advance']:.3f} (batched "
                  f"{result['advance_batch']:.3f})  fill {result['fill']:.3f} ms", flush=True)
            for name in ("plain", "serial", "overlapped"):
                shown = "  ".join(f"{k} {v:.3f}" for k, v in result[name].items()
                                  if v is not None)
                print(f"  {name:10s} {shown}", flush=True)
    finally:
        filler.shutdown()
        compiler.shutdown()
    return {"tokenizer": args.tokenizer, "vocab_size": VOCAB_SIZE, "steps": args.steps,
            "schema": SCHEMA, "results": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", choices=("bytes", "demo"), default="bytes")
    parser.add_argument("--batch-sizes", type=lambda t: [int(x) for x in t.split(",")],
                        default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per case")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
