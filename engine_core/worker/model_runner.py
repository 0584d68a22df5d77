"""Executes a SchedulerOutput: builds one flattened batch, runs the model, samples.

The runner keeps a copy of each scheduled request's tokens and its row of block ids,
updated from the scheduler's diffs, so per step it only receives what changed. Step
inputs are built with numpy into persistent buffers (``step_inputs.py``) and moved with
non-blocking copies; a decode-only step replays a captured CUDA graph when one fits
(``cuda_graphs.py``). The one host sync of a step is reading the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine_core.kv_connector import ConnectorWorker
from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import ModelRunnerOutput, SchedulerOutput
from engine_core.worker.cuda_graphs import CaptureStats, DecodeGraphs, estimate_pool_bytes
from engine_core.worker.forward_timer import ForwardTimer
from engine_core.worker.sampler import Sampler, SamplingRow
from engine_core.worker.step_inputs import BatchLimits, HostBlockTable, StepInputs


@dataclass
class RunnerRequestState:
    """The runner's view of one request between steps (its block ids live in ``row``)."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    num_computed_tokens: int
    row: int


class ModelRunner:
    """Owns the model, the paged KV caches, the step buffers, the decode graphs, the sampler.

    ``limits`` sizes the step buffers up front (required before capturing graphs);
    without it they grow to fit each step.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, eos_token_ids: tuple[int, ...],
                 connector: ConnectorWorker, limits: BatchLimits | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.connector = connector
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}
        limits = limits or BatchLimits(1, 1, block_size, block_size)
        self.inputs = StepInputs(limits, device)
        self.block_table = HostBlockTable(limits.max_num_seqs, limits.max_blocks_per_seq)
        self.graphs: DecodeGraphs | None = None
        # Set by benchmarks: GPU time of each forward (eager or replay).
        self.forward_timer: ForwardTimer | None = None

    # ---- CUDA graphs --------------------------------------------------------------------

    def capture_cuda_graphs(self, sizes: list[int]) -> CaptureStats:
        """Capture one decode graph per size; the step buffers keep their addresses after."""
        largest = max(sizes)
        self.inputs.reserve(largest, largest, 1)
        self.inputs.freeze()
        graphs = DecodeGraphs(self.device)
        with torch.inference_mode():
            stats = graphs.capture(sizes, self.inputs.fill_dummy_decode, self._decode_forward)
        self.graphs = graphs
        return stats

    def estimate_graph_pool_bytes(self, largest: int) -> int:
        """Memory the decode graphs of up to ``largest`` rows will hold (profiling runner)."""
        with torch.inference_mode():
            return estimate_pool_bytes(self.inputs.fill_dummy_decode, self._decode_forward,
                                       largest, self.device)

    def _decode_forward(self, size: int) -> torch.Tensor:
        input_ids, positions, metadata = self.inputs.decode_views(size)
        return self.model(input_ids, positions, metadata, self.kv_caches)

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

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and report sampled tokens plus finished transfers."""
        self._update_states(scheduler_output)
        meta = scheduler_output.kv_connector_metadata
        self.connector.start_load_kv(meta)
        output = ModelRunnerOutput.empty()
        if not scheduler_output.is_empty:
            output = self._forward_and_sample(scheduler_output, meta)
        self.connector.wait_for_save()
        finished = self.connector.get_finished()
        output.finished_sending = finished.sending
        output.finished_recving = finished.recving
        output.failed_recving = finished.failed_recving
        return output

    def _forward_and_sample(self, scheduler_output: SchedulerOutput, meta: object) -> ModelRunnerOutput:
        scheduled = scheduler_output.num_scheduled_tokens
        request_ids = list(scheduled)
        states = [self.requests[r] for r in request_ids]
        num_reqs = len(states)
        num_new = np.fromiter(scheduled.values(), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64,
                             count=num_reqs)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        decode_only = int(num_new.sum()) == num_reqs  # one token each
        token_ids: list[int] = []
        if decode_only:
            token_ids = [s.token_ids[s.num_computed_tokens] for s in states]
        else:
            for state, n in zip(states, num_new.tolist()):
                start = state.num_computed_tokens
                token_ids.extend(state.token_ids[start:start + n])
        # Only requests whose scheduled tokens reach their last known token sample.
        sample_rows = [i for i, (s, n) in enumerate(zip(states, num_new.tolist()))
                       if s.num_computed_tokens + n == len(s.token_ids)]
        every_row_samples = decode_only and len(sample_rows) == num_reqs

        graph_size = None
        if (decode_only and self.graphs is not None
                and not self.connector.needs_layer_hooks(meta)):
            graph_size = self.graphs.size_for(num_reqs)
        batch = self.inputs.prepare(
            self.block_table, rows, starts, num_new, token_ids,
            None if every_row_samples else np.asarray(sample_rows, dtype=np.int64),
            pad_to=graph_size)
        self.connector.bind_step(meta, batch.attn_metadata)
        timer = self.forward_timer
        if timer is not None:
            timer.start()
        if graph_size is not None:
            assert self.graphs is not None
            hidden = self.graphs.replay(graph_size)
        else:
            batch.attn_metadata.layer_hooks = self.connector
            hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata,
                                self.kv_caches)
        if timer is not None:
            timer.stop(graph_size is not None, batch.input_ids.shape[0])
        if not sample_rows:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        selected = (hidden[:num_reqs] if batch.logits_indices is None
                    else hidden[batch.logits_indices])
        logits = self.model.compute_logits(selected)
        sampled = [states[i] for i in sample_rows]
        rows_to_sample = [SamplingRow(params=s.sampling_params, token_ids=s.token_ids,
                                      num_prompt_tokens=s.num_prompt_tokens,
                                      eos_token_ids=self.eos_token_ids)
                          for s in sampled]
        tokens, logprobs = self.sampler(logits, rows_to_sample)
        for state, token in zip(sampled, tokens):
            state.token_ids.append(token)
        return ModelRunnerOutput(
            req_ids=[request_ids[i] for i in sample_rows],
            sampled_token_ids=[[t] for t in tokens],
            logprobs=logprobs,
        )
