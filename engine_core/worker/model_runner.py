"""Executes a SchedulerOutput: builds one flattened batch, runs the model, samples.

The runner keeps a copy of each scheduled request's tokens and block ids, updated from
the scheduler's diffs, so per step it only receives what changed. Positions, slot
mapping and block tables are built with vectorised torch ops from per-request vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.attention.metadata import AttentionMetadata
from engine_core.kv_connector import ConnectorWorker
from engine_core.sampling_params import SamplingParams
from engine_core.sched.outputs import ModelRunnerOutput, SchedulerOutput
from engine_core.worker.sampler import Sampler, SamplingRow


@dataclass
class RunnerRequestState:
    """The runner's view of one request between steps."""

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class ModelRunner:
    """Owns the model, the paged KV caches and the sampler."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, eos_token_ids: tuple[int, ...],
                 connector: ConnectorWorker) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.connector = connector
        self.sampler = Sampler()
        self.requests: dict[str, RunnerRequestState] = {}

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.request_id] = RunnerRequestState(
                token_ids=list(new.token_ids), num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
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
        request_ids = list(scheduler_output.num_scheduled_tokens)
        states = [self.requests[r] for r in request_ids]
        num_new = [scheduler_output.num_scheduled_tokens[r] for r in request_ids]
        starts = [s.num_computed_tokens for s in states]
        input_ids_list: list[int] = []
        for state, start, n in zip(states, starts, num_new):
            input_ids_list.extend(state.token_ids[start:start + n])
        attn_metadata, positions = self._build_metadata(states, starts, num_new)
        self.connector.bind_step(meta, attn_metadata)
        attn_metadata.layer_hooks = self.connector
        input_ids = torch.tensor(input_ids_list, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, attn_metadata, self.kv_caches)

        # Only requests whose scheduled tokens reach their last known token sample.
        sample_rows = [i for i, (s, start, n) in enumerate(zip(states, starts, num_new))
                       if start + n == len(s.token_ids)]
        if not sample_rows:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        ends = attn_metadata.query_start_loc_cpu
        logits_indices = torch.tensor([ends[i + 1] - 1 for i in sample_rows], device=self.device)
        logits = self.model.compute_logits(hidden[logits_indices])
        rows = [SamplingRow(params=states[i].sampling_params, token_ids=states[i].token_ids,
                            num_prompt_tokens=states[i].num_prompt_tokens,
                            eos_token_ids=self.eos_token_ids)
                for i in sample_rows]
        tokens, logprobs = self.sampler(logits, rows)
        for i, token in zip(sample_rows, tokens):
            states[i].token_ids.append(token)
        return ModelRunnerOutput(
            req_ids=[request_ids[i] for i in sample_rows],
            sampled_token_ids=[[t] for t in tokens],
            logprobs=logprobs,
        )

    def _build_metadata(self, states: list[RunnerRequestState], starts: list[int],
                        num_new: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        device = self.device
        num_tokens = sum(num_new)
        query_lens = torch.tensor(num_new, dtype=torch.long)
        start_t = torch.tensor(starts, dtype=torch.long)
        query_start_loc = torch.zeros(len(states) + 1, dtype=torch.long)
        torch.cumsum(query_lens, dim=0, out=query_start_loc[1:])
        seq_lens = start_t + query_lens
        # Token t of sequence i sits at absolute position start_i + (t - query_start_i).
        seq_index = torch.repeat_interleave(torch.arange(len(states)), query_lens)
        positions = (torch.arange(num_tokens) - query_start_loc[:-1][seq_index]
                     + start_t[seq_index])
        max_blocks = max(len(s.block_ids) for s in states)
        block_tables = torch.zeros(len(states), max_blocks, dtype=torch.int32)
        for i, state in enumerate(states):
            block_tables[i, :len(state.block_ids)] = torch.tensor(state.block_ids, dtype=torch.int32)
        block_of_token = block_tables[seq_index, positions // self.block_size].long()
        slot_mapping = block_of_token * self.block_size + positions % self.block_size
        qsl_cpu = query_start_loc.tolist()
        seq_lens_cpu = seq_lens.tolist()
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
            seq_lens=seq_lens.to(device=device, dtype=torch.int32),
            block_tables=block_tables.to(device, non_blocking=True),
            max_query_len=max(num_new),
            max_seq_len=max(seq_lens_cpu),
            block_size=self.block_size,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        return metadata, positions.to(device, non_blocking=True)
