"""Executes a SchedulerOutput: builds one flattened batch, runs the model, samples.

The runner keeps a copy of each scheduled request's tokens and its row of block ids,
updated from the scheduler's diffs, so per step it only receives what changed. Step
inputs are built with numpy into persistent buffers (``step_inputs.py``) and moved with
non-blocking copies; a step replays a captured CUDA graph (decode-only or mixed) when one
fits (``cuda_graphs.py``). The one host sync of a step is reading the sampled tokens.

A step is ``launch`` (queue the forward and the sampling; return at once) then ``collect``
(read the tokens). Between the two the engine may launch the next step: a request whose
previous token is still on the device (pending) takes it as input straight from the
previous step's sampled-token tensor, so the host never waits to build a step. A step in
which a constrained request samples is launched without its sampling: the engine collects
the step before (its tokens advance the grammars), then ``sample`` fills the masks on the
host while the device runs the forward, and queues the sampling behind it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_core.attention.backend import AttentionPlan
from engine_core.kv_connector import ConnectorWorker
from engine_core.parallel.rank_sampler import RankSampler
from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import ModelRunnerOutput, SchedulerOutput
from engine_core.worker.block_copy import stack_layers
from engine_core.worker.cuda_graphs import (
    HOOKED_GRAPH_MAX_TOKENS,
    CaptureStats,
    GraphSizes,
    StepGraphs,
    estimate_pool_bytes,
)
from engine_core.worker.forward_timer import ForwardTimer
from engine_core.worker.grammar_mask import GrammarMaskStage, MaskFill, SampleTimer
from engine_core.worker.host_kv import HostKVStore
from engine_core.worker.prompt_logprobs import (
    DevicePromptLogprobs,
    compute_prompt_logprobs,
    prompt_rows,
)
from engine_core.worker.sampler import DeviceSamples, PromptTokens, Sampler, SamplingRow
from engine_core.worker.step_clock import StepClock
from engine_core.worker.step_inputs import BatchLimits, HostBlockTable, StepInputs


@dataclass
class RunnerRequestState:
    """The runner's view of one request between steps (its block ids live in ``row``)."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    num_computed_tokens: int
    row: int
    # Tokens sampled by launched steps and not yet collected (at most one step's worth);
    # ``pending_index`` is this request's row in the last launched step's samples.
    num_pending: int = 0
    pending_index: int = -1
    # The prompt's tokens on the device once a step samples with repetition penalty.
    prompt_tokens: PromptTokens = field(default_factory=PromptTokens)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending


@dataclass
class LaunchedStep:
    """A step queued on the device: what ``collect`` needs to finish it (empty: a step
    that sampled nothing)."""

    req_ids: list[str] = field(default_factory=list)
    states: list[RunnerRequestState] = field(default_factory=list)
    samples: DeviceSamples | None = None
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    prompt_logprobs: DevicePromptLogprobs | None = None
    # Logits whose sampling waits for grammar masks (``ModelRunner.sample``), else None.
    logits: torch.Tensor | None = None

    @property
    def sampled(self) -> bool:
        return self.samples is not None

    @property
    def awaits_masks(self) -> bool:
        """The forward is queued; the sampling waits for ``ModelRunner.sample``."""
        return self.logits is not None


class ModelRunner:
    """Owns the model, the paged KV caches, the step buffers, the CUDA graphs, the sampler.

    ``limits`` sizes the step buffers up front (required before capturing graphs);
    without it they grow to fit each step. ``plan``: the attention backend's kernel choices
    for this model (the sizes of its prefill and decode work lists). ``sampler``: a
    tensor-parallel rank's (``parallel/rank_sampler.py``); default, the plan's own.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, eos_token_ids: tuple[int, ...],
                 connector: ConnectorWorker, limits: BatchLimits | None = None,
                 plan: AttentionPlan | None = None,
                 sampler: RankSampler | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.connector = connector
        self.requests: dict[str, RunnerRequestState] = {}
        limits = limits or BatchLimits(1, 1, block_size, block_size)
        self.plan = plan or AttentionPlan()
        self.sampler = sampler or Sampler(self.plan.triton_sampling, self.plan.triton_pdl)
        self.inputs = StepInputs(limits, device, self.plan.prefill_tile_tokens,
                                 self.plan.decode_work_target)
        self.block_table = HostBlockTable(limits.max_num_seqs, limits.max_blocks_per_seq)
        self.graphs: StepGraphs | None = None
        self._graphs_paused = False
        # Set by benchmarks: GPU time of each forward (eager or replay), and of sampling.
        self.forward_timer: ForwardTimer | None = None
        self.sample_timer: SampleTimer | None = None
        # Set by the engine once warmed up: each step's device time, for its step rates.
        self.step_clock: StepClock | None = None
        self._max_rows = limits.max_num_seqs
        self._grammar_masks: GrammarMaskStage | None = None  # made with the first mask
        # KV offload's host slots (set by the engine when --kv-offloading-size is given).
        self.host_kv: HostKVStore | None = None
        # The last launched step's sampled tokens on the device (pending inputs read them)
        # and two pinned buffers their copies alternate between (one may still be unread).
        self._last_samples: torch.Tensor | None = None
        self._host_tokens: list[torch.Tensor] = []
        if device.type == "cuda":
            self._host_tokens = [torch.empty(limits.max_num_seqs, dtype=torch.int64,
                                             pin_memory=True) for _ in range(2)]
        self._num_launched = 0

    # ---- CUDA graphs --------------------------------------------------------------------

    def capture_cuda_graphs(self, sizes: GraphSizes) -> CaptureStats:
        """Capture the graphs of ``sizes``; the step buffers keep their addresses after."""
        largest = sizes.largest
        self.inputs.reserve(largest, self.inputs.graph_seqs(largest), 1)
        self.inputs.freeze()
        graphs = StepGraphs(self.device)
        with torch.inference_mode():
            stats = graphs.capture(sizes, self.inputs.fill_dummy, self.graph_forward)
        self.graphs = graphs
        return stats

    def estimate_graph_pool_bytes(self, sizes: GraphSizes) -> int:
        """Memory the graphs of ``sizes`` will hold (profiling runner)."""
        with torch.inference_mode():
            return estimate_pool_bytes(self.inputs.fill_dummy, self.graph_forward, sizes,
                                       self.device)

    def graph_forward(self, size: int, mixed: bool) -> torch.Tensor:
        """The forward a graph of ``size`` tokens records, on the buffers' current contents."""
        input_ids, positions, metadata = self.inputs.graph_views(size, mixed)
        return self.model(input_ids, positions, metadata, self.kv_caches)

    @contextlib.contextmanager
    def graphs_paused(self) -> Iterator[None]:
        """Run every step eagerly inside the block (the startup warm-up compiles the eager
        path, which steps with connector layer hooks and steps beyond the graphs take)."""
        self._graphs_paused = True
        try:
            yield
        finally:
            self._graphs_paused = False

    # ---- steps --------------------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_req_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self.block_table.free(state.row)
        for new in scheduler_output.scheduled_new_reqs:
            stale = self.requests.pop(new.request_id, None)
            if stale is not None:
                self.block_table.free(stale.row)
            self.requests[new.request_id] = RunnerRequestState(
                token_ids=list(new.token_ids), num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                num_computed_tokens=new.num_computed_tokens,
                row=self.block_table.add(new.block_ids))
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            self.block_table.append(state.row, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def execute(self, scheduler_output: SchedulerOutput,
                fill_masks: MaskFill | None = None) -> ModelRunnerOutput:
        """Run one step and wait for it: ``launch``, ``sample`` when it awaits grammar masks
        (``fill_masks`` fills them), then ``collect``."""
        step = self.launch(scheduler_output)
        if step.awaits_masks:
            self.sample(step, fill_masks)
        return self.collect(step)

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue one step's forward and sampling; report finished transfers."""
        self._update_states(scheduler_output)
        if self.host_kv is not None and scheduler_output.host_copies:
            # Before anything of this step touches the blocks, even on a step with no tokens:
            # the pass already counts the uploaded blocks as cached.
            self.host_kv.apply(stack_layers(self.kv_caches), scheduler_output.host_copies)
        meta = scheduler_output.kv_connector_metadata
        self.connector.start_load_kv(meta)
        step = LaunchedStep()
        if not scheduler_output.is_empty:
            step = self._forward(scheduler_output, meta)
            if step.awaits_masks and not scheduler_output.grammar_request_ids.intersection(
                    step.req_ids):
                self.sample(step)
        self.connector.wait_for_save()
        finished = self.connector.get_finished()
        step.finished_sending = finished.sending
        step.finished_recving = finished.recving
        step.failed_recving = finished.failed_recving
        return step

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens and append them to its requests."""
        output = ModelRunnerOutput.empty()
        if step.samples is not None:
            tokens, logprobs = step.samples.read()
            for state, token in zip(step.states, tokens):
                state.token_ids.append(token)
                state.num_pending -= 1
            output = ModelRunnerOutput(req_ids=step.req_ids,
                                       sampled_token_ids=[[t] for t in tokens],
                                       logprobs=logprobs)
        if step.prompt_logprobs is not None:
            output.prompt_logprobs = step.prompt_logprobs.read()
        output.finished_sending = step.finished_sending
        output.finished_recving = step.finished_recving
        output.failed_recving = step.failed_recving
        return output

    def _step_tokens(self, states: list[RunnerRequestState], num_new: list[int]
                     ) -> tuple[list[int], list[int], list[int]]:
        """This step's input token ids, flattened, plus (positions in it, rows of the last
        step's samples) of the tokens still pending on the device (0 stands in for them)."""
        token_ids: list[int] = []
        pending_at: list[int] = []
        pending_from: list[int] = []
        for state, n in zip(states, num_new):
            start = state.num_computed_tokens
            known = state.token_ids[start:start + n]
            if len(known) < n:
                if len(known) != n - 1 or state.num_pending != 1:
                    raise RuntimeError("only a decode's single input token can be pending")
                pending_at.append(len(token_ids) + len(known))
                pending_from.append(state.pending_index)
                known = known + [0]
            token_ids.extend(known)
        return token_ids, pending_at, pending_from

    def _graph_size(self, num_tokens: int, num_reqs: int, mixed: bool,
                    hooked: bool) -> int | None:
        """The captured size this step replays, or None to run it eagerly: no graphs, the
        warm-up, a hooked step over ``HOOKED_GRAPH_MAX_TOKENS``, a step larger than the
        graphs of its kind, or more sequences than a graph holds (never in serving)."""
        if self.graphs is None or self._graphs_paused:
            return None
        if hooked and num_tokens > HOOKED_GRAPH_MAX_TOKENS:
            return None
        size = self.graphs.size_for(num_tokens, mixed)
        if size is None or num_reqs > self.inputs.graph_seqs(size):
            return None
        return size

    def _forward(self, scheduler_output: SchedulerOutput, meta: object) -> LaunchedStep:
        """Queue the step's forward and its logits; ``sample`` samples them."""
        scheduled = scheduler_output.num_scheduled_tokens
        request_ids = list(scheduled)
        states = [self.requests[r] for r in request_ids]
        num_reqs = len(states)
        num_new = np.fromiter(scheduled.values(), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64,
                             count=num_reqs)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        num_new_l = num_new.tolist()
        decode_only = int(num_new.sum()) == num_reqs  # one token each
        token_ids, pending_at, pending_from = self._step_tokens(states, num_new_l)
        # Only requests whose scheduled tokens reach their last known or pending token sample.
        sample_rows = [i for i, (s, n) in enumerate(zip(states, num_new_l))
                       if s.num_computed_tokens + n == s.num_tokens_with_pending]
        for state, n in zip(states, num_new_l):
            state.num_computed_tokens += n
        every_row_samples = decode_only and len(sample_rows) == num_reqs

        hooked = self.connector.needs_layer_hooks(meta)
        graph_size = self._graph_size(len(token_ids), num_reqs, not decode_only, hooked)
        batch = self.inputs.prepare(
            self.block_table, rows, starts, num_new, token_ids,
            None if every_row_samples else np.asarray(sample_rows, dtype=np.int64),
            pad_to=graph_size)
        if pending_at:
            if self._last_samples is None:
                raise RuntimeError("a pending input token without a launched step to read")
            self.inputs.fill_pending_ids(batch.input_ids, pending_at, pending_from,
                                         self._last_samples)
        self.connector.bind_step(meta, batch.attn_metadata)
        timer, clock = self.forward_timer, self.step_clock
        if timer is not None:
            timer.start()
        mark = clock.start() if clock is not None else None
        if graph_size is not None:
            assert self.graphs is not None
            if hooked:  # every layer's wait before the replay: strictly more than needed
                for layer_idx in range(len(self.kv_caches)):
                    self.connector.before_layer(layer_idx)
            hidden = self.graphs.replay(graph_size, mixed=not decode_only)
            if hooked:  # every layer's KV is in the cache once the replay's work is queued
                for layer_idx, kv_cache in enumerate(self.kv_caches):
                    self.connector.after_layer(layer_idx, kv_cache)
        else:
            batch.attn_metadata.layer_hooks = self.connector
            hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata,
                                self.kv_caches)
        if timer is not None:
            timer.stop(graph_size is not None, batch.input_ids.shape[0])
        if clock is not None:  # a one-token row is a decode
            num_decodes = int((num_new == 1).sum())
            clock.stop(mark, int(num_new.sum()) - num_decodes, num_decodes)
        prompt = prompt_rows(request_ids, states, starts.tolist(), num_new_l)
        prompt_logprobs = (None if prompt is None
                           else compute_prompt_logprobs(hidden, self.model.compute_logits, prompt))
        if not sample_rows:
            return LaunchedStep(prompt_logprobs=prompt_logprobs)

        selected = (hidden[:num_reqs] if batch.logits_indices is None
                    else hidden[batch.logits_indices])
        logits = self.model.compute_logits(selected)
        if self.sample_timer is not None:
            self.sample_timer.mark("logits")
        return LaunchedStep([request_ids[i] for i in sample_rows],
                            [states[i] for i in sample_rows],
                            prompt_logprobs=prompt_logprobs, logits=logits)

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, fill_masks: MaskFill | None = None) -> bool:
        """Queue the sampling of a launched step's logits; ``fill_masks`` fills its rows'
        grammar masks in the pinned staging buffer first (a step whose rows all sample
        unconstrained passes None). True when masks were applied. The rows are read now,
        not at the forward: a step collected in between moved its tokens from pending to
        known."""
        logits, step.logits = step.logits, None
        assert logits is not None, "the step was sampled already"
        timer = self.sample_timer
        grammar_mask = None
        if fill_masks is not None:
            stage = self._mask_stage(len(step.req_ids), logits.shape[-1])
            started = time.perf_counter()
            host_rows = stage.host_rows(len(step.req_ids))
            constrained = fill_masks(step.req_ids, host_rows)
            if timer is not None:
                timer.wait_seconds(time.perf_counter() - started)
                timer.mark("copy_start")
            if constrained:
                grammar_mask = stage.to_device(len(step.req_ids))
        if timer is not None:
            timer.mark("sample_start")
        rows = [SamplingRow(params=s.sampling_params, token_ids=s.token_ids,
                            num_prompt_tokens=s.num_prompt_tokens,
                            eos_token_ids=self.eos_token_ids, num_pending=s.num_pending,
                            pending_index=s.pending_index if s.num_pending else -1,
                            prompt_tokens=s.prompt_tokens)
                for s in step.states]
        # _last_samples is still the step in flight's: pending tokens are read from it.
        samples = self.sampler.sample(logits, rows, self._last_samples, grammar_mask)
        if timer is not None:
            timer.mark("sample_end")
            timer.end_step(grammar_mask is not None)
        host = self._host_tokens[self._num_launched % 2] if self._host_tokens else None
        self._num_launched += 1
        samples.start_copy(host)
        self._last_samples = samples.token_ids
        for index, state in enumerate(step.states):
            state.num_pending += 1
            state.pending_index = index
        step.samples = samples
        return grammar_mask is not None

    def mask_rows(self, step: LaunchedStep) -> torch.Tensor:
        """The pinned host rows a launched step's grammar masks are filled into, free to
        fill (the copy out of them for the step before has run)."""
        assert step.logits is not None, "the step was sampled already"
        num_rows = len(step.req_ids)
        return self._mask_stage(num_rows, step.logits.shape[-1]).host_rows(num_rows)

    def _mask_stage(self, num_rows: int, vocab_size: int) -> GrammarMaskStage:
        """The staging buffers, made with the first mask for ``max_num_seqs`` rows (remade
        larger for a runner without batch limits, whose steps grow)."""
        stage = self._grammar_masks
        if stage is None or stage.max_rows < num_rows:
            stage = GrammarMaskStage(max(num_rows, self._max_rows), vocab_size, self.device)
            self._grammar_masks = stage
        return stage
