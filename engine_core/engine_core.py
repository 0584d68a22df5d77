"""EngineCore: one engine's schedule -> execute -> update loop, driven step by step.

It owns the scheduler, the KV cache manager, the model runner and the two halves of the
KV connector. The engine-core process (engine_process.py) and the offline LLM both drive
it through ``add_request`` / ``abort_requests`` / ``step``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine_core.attention.backend import AttentionPlan, AttentionShapes
from engine_core.config import EngineConfig
from engine_core.doorbell import Doorbell
from engine_core.errors import ConfigError, EngineSleepingError, InvalidRequestError, ModelLoadError
from engine_core.grammar.compiler import GrammarCompiler
from engine_core.kernels.jit_variants import compiled_variants
from engine_core.kv_connector import (
    ConnectorScheduler,
    ConnectorWorker,
    NullConnectorScheduler,
    NullConnectorWorker,
)
from engine_core.messages import AddRequest, EngineOutput, EngineStats
from engine_core.parallel.group import TensorParallelGroup, rank_device
from engine_core.parallel.kv_layout import PeerRanks
from engine_core.parallel.rank_processes import start_other_ranks
from engine_core.parallel.rank_sampler import RankSampler, rank_sampler
from engine_core.parallel.sharding import rank_local_spec
from engine_core.request import Request, RequestStatus
from engine_core.request_limits import check_context, check_token_ids
from engine_core.sampling_params import SamplingParams
from engine_core.sched.block_hash import BlockHasher
from engine_core.sched.block_pool import BlockPool
from engine_core.sched.host_tier import HostTier
from engine_core.sched.kv_cache_manager import KVCacheManager
from engine_core.sched.outputs import NewRequestData, SchedulerOutput
from engine_core.sched.scheduler import Scheduler
from engine_core.sleep_mode import SleepMode
from engine_core.step_watch import StepWatch
from engine_core.worker import cuda_graphs, kv_cache
from engine_core.worker.block_copy import stack_layers
from engine_core.worker.cuda_graphs import CaptureStats
from engine_core.worker.host_kv import HostKVStore
from engine_core.worker.loader import (
    load_model,
    read_model_spec,
    resolve_dtype,
    weights_arena,
)
from engine_core.worker.masked_sampling import MaskedSampling
from engine_core.worker.memory_arena import MemoryArena
from engine_core.worker.model_runner import LaunchedStep, ModelRunner
from engine_core.worker.pinned_memory import HostBuffer
from engine_core.worker.sampler import Sampler
from engine_core.worker.sleep import (
    ReleasedWeights,
)
from engine_core.worker.step_clock import StepClock
from engine_core.worker.step_inputs import BatchLimits
from engine_core.worker.warm_up import WarmUpLimits, warm_up_steps

logger = logging.getLogger("pdserve.engine")

ConnectorPair = tuple[ConnectorScheduler, ConnectorWorker]


class EngineCore(SleepMode):
    """A complete engine for one model on one device, or on ``--tensor-parallel-size``
    devices: this process is then rank 0 (scheduler, sampler, outputs) and drives ranks
    1..N-1 (``parallel/rank_worker.py``, which build this same class) step by step."""

    def __init__(self, config: EngineConfig, connector: ConnectorPair | None = None) -> None:
        t0 = time.perf_counter()
        model_dir = Path(config.model.model)
        if not model_dir.is_dir():
            hint = (" (a .gguf file is converted by engine_core.gguf.resolve_gguf_model, "
                    "which LLM and the pdserve commands call)"
                    if model_dir.suffix.lower() == ".gguf" else "")
            raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist{hint}")
        config, self.rank_processes = start_other_ranks(config, connector and connector[1])
        self.config = config
        self.device = rank_device(config.device.resolve(), config.parallel)
        self.tp = TensorParallelGroup.start(config.parallel, torch.device(self.device))
        self.spec = read_model_spec(model_dir)
        # The heads this rank holds: what its KV cache and attention kernels are sized for.
        self.rank_spec = rank_local_spec(self.spec, self.tp.size)
        self.dtype = resolve_dtype(config.model.dtype, self.spec.torch_dtype, self.device)
        self.max_model_len = config.model.max_model_len or self.spec.max_position_embeddings
        if (self.max_model_len > self.spec.trained_max_len
                and not config.model.allow_long_max_model_len):
            # As vLLM: positions past the trained length give garbage, not an error.
            raise ConfigError(
                f"--max-model-len {self.max_model_len} exceeds the model's "
                f"{self.spec.trained_max_len} (max_position_embeddings and RoPE scaling); "
                "set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it")
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            # Unchunked, a prompt (or a preempted request's prompt and output) longer than one
            # step's budget could never be scheduled, and would hold up the queue behind it.
            raise ConfigError(
                f"--max-num-batched-tokens ({sched.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with chunked prefill off: raise it, "
                "lower --max-model-len, or enable chunked prefill")
        self.eos_token_ids = self.spec.eos_token_ids
        self.vocab_size = self.spec.vocab_size
        self.tokenizer_path = config.model.tokenizer_path
        self.grammars = GrammarCompiler(self.tokenizer_path, self.vocab_size, self.eos_token_ids)

        from engine_core.attention.backend import get_attention_backend

        cache_dtype = kv_cache.kv_cache_dtype(config.cache, self.dtype)
        backend = get_attention_backend(self.device, cache_dtype,
                                        config.device.attention_backend,
                                        config.device.triton_gemv_max_rows,
                                        config.device.split_k_mlp, config.device.triton_pdl)
        self.attn_backend = backend
        torch.manual_seed(config.model.seed)
        self.model = load_model(config.model, self.spec, self.device, self.dtype, backend,
                                sleepable=config.model.enable_sleep_mode, tp=self.tp)
        # Sleep mode: weights and KV cache in arenas whose memory sleep gives back and wake-up
        # restores at the same addresses (the CUDA graphs stay valid).
        self.weights_arena = weights_arena(self.model)
        t1 = time.perf_counter()
        logger.info("Model loading took %.2f s (%s, %s, %s)", t1 - t0,
                    self.spec.architecture, self.dtype, self.device)

        self.graph_pool_reserve = 0  # set by the profiling run when graphs will be captured
        shape = kv_cache.plan_kv_cache(
            self.rank_spec, config.cache, cache_dtype, self.device, self.max_model_len,
            config.scheduler.max_num_seqs, profile_peak_bytes=self._profile_peak_bytes,
            held_bytes=self.weights_arena.nbytes if self.weights_arena is not None else 0)
        # Every rank must hold the same blocks: the smallest cache any rank's memory allows.
        shape = replace(shape, num_blocks=self.tp.min_int(shape.num_blocks,
                                                          torch.device(self.device)))
        self.kv_arena = (MemoryArena(kv_cache.kv_cache_nbytes(shape), self.device)
                         if config.model.enable_sleep_mode else None)
        self.kv_caches = kv_cache.allocate_kv_caches(shape, self.device, self.kv_arena)
        self.kv_shape = shape
        self.num_blocks = shape.num_blocks
        logger.info("KV cache allocation took %.2f s", time.perf_counter() - t1)

        connector_scheduler, connector_worker = connector or (
            NullConnectorScheduler(), NullConnectorWorker())
        self.connector_worker = connector_worker
        connector_worker.register_kv_caches(self.kv_caches)
        enable_caching = config.cache.enable_prefix_caching
        self.hasher = BlockHasher(config.cache.block_size, config.cache.prefix_caching_hash_algo,
                                  config.cache.prefix_hash_seed)
        host_tier = self._host_tier(shape)
        self.kv_manager = KVCacheManager(BlockPool(shape.num_blocks, enable_caching),
                                         config.cache.block_size, self.hasher, enable_caching,
                                         host_tier)
        policy = config.kv_transfer.kv_load_failure_policy if config.kv_transfer else "recompute"
        self.scheduler = Scheduler(config.scheduler, config.cache, self.kv_manager,
                                   connector_scheduler, self.max_model_len, policy)
        self.runner = ModelRunner(self.model, self.kv_caches, config.cache.block_size,
                                  torch.device(self.device), self.eos_token_ids, connector_worker,
                                  self._batch_limits(), self._attention_plan(),
                                  self._rank_sampler())
        self.host_kv: HostKVStore | None = None
        if host_tier is not None:
            offload_started = time.perf_counter()
            self.host_kv = HostKVStore(stack_layers(self.kv_caches), host_tier.num_slots,
                                       host_tier)
            self.runner.host_kv = self.host_kv
            logger.info("KV offload: %d host blocks (%.2f GiB, %d tokens), pinned in %.2f s",
                        host_tier.num_slots, self.host_kv.nbytes / 2**30,
                        host_tier.num_slots * shape.block_size,
                        time.perf_counter() - offload_started)
        self.graph_capture: CaptureStats | None = None
        if self._graph_sizes():
            self.graph_capture = self.runner.capture_cuda_graphs(self._graph_sizes())
            if self.graph_pool_reserve and self.graph_capture.pool_bytes > self.graph_pool_reserve:
                logger.warning("CUDA graphs took %.1f MiB, more than the %.1f MiB reserved "
                               "before sizing the KV cache",
                               self.graph_capture.pool_bytes / 2**20,
                               self.graph_pool_reserve / 2**20)
        self._warm_up()
        self.runner.step_clock = StepClock(torch.device(self.device))  # feeds the step rates
        self.step_watch = StepWatch()
        self.step_watch.start()
        self.rejected_messages = 0
        self.masked_sampling = MaskedSampling(self.runner)
        self.masked_steps = self.masked_sampling.counts
        self.async_scheduling = config.scheduler.async_scheduling
        # The step launched last and not yet collected (async scheduling only).
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        # The last step scheduled nothing, returned nothing, left nothing in flight and
        # applied no finished transfer: the queue's head waits for blocks that only a
        # transfer (or an abort) frees.
        self.stalled = False
        self._asleep: ReleasedWeights | None = None  # sleep mode: what the weights kept
        self._sleep_level = 0  # 0 awake; else until both weights and KV cache are back
        self._kv_asleep = False
        self._host_weights: HostBuffer | None = None  # level 1's host copy, kept for reuse

    def _host_tier(self, shape: kv_cache.KVCacheShape) -> HostTier | None:
        """KV offload's slots from ``--kv-offloading-size`` (None when off)."""
        size = self.config.cache.kv_offloading_size
        if size <= 0:
            return None
        if not self.config.cache.enable_prefix_caching:
            logger.warning("--kv-offloading-size needs prefix caching; KV offload is off")
            return None
        num_slots = int(size * 2**30) // shape.bytes_per_block
        if num_slots < 1:
            raise ConfigError(f"--kv-offloading-size {size} GiB holds no block of "
                              f"{shape.bytes_per_block} bytes")
        return HostTier(num_slots)

    def _batch_limits(self) -> BatchLimits:
        sched = self.config.scheduler
        return BatchLimits(max_num_seqs=sched.max_num_seqs,
                           max_num_tokens=sched.max_num_batched_tokens,
                           max_model_len=self.max_model_len,
                           block_size=self.config.cache.block_size)

    def _warm_up(self) -> None:
        """Compile what a serving step can need before the first request (warm_up.py)."""
        sched = self.config.scheduler
        limits = WarmUpLimits(self.config.cache.block_size, self.num_blocks, sched.max_num_seqs,
                              sched.max_num_batched_tokens, self.max_model_len)
        start = time.perf_counter()
        with self.runner.graphs_paused():
            for step in warm_up_steps(limits):
                self.runner.execute(step)
        variants = compiled_variants()
        logger.info("Warm-up steps took %.2f s; %d Triton kernel variants compiled",
                    time.perf_counter() - start, sum(variants.values()))

    def _graph_sizes(self) -> cuda_graphs.GraphSizes:
        """Graph sizes to capture; empty when this engine runs every step eagerly."""
        device = self.config.device
        reason = cuda_graphs.graphs_disabled_reason(torch.device(self.device),
                                                    self.attn_backend.name, device.enforce_eager)
        if reason is not None:
            return cuda_graphs.GraphSizes()
        sched = self.config.scheduler
        return cuda_graphs.capture_sizes(device.cuda_graph_sizes, sched.max_num_seqs,
                                         sched.max_num_batched_tokens, device.cuda_graph_mode)

    def _rank_sampler(self) -> RankSampler:
        """This rank's sampler: rank 0 samples (and broadcasts), the other ranks take its
        tokens."""
        plan = self._attention_plan()
        return rank_sampler(Sampler(plan.triton_sampling, plan.triton_pdl), self.tp)

    def _attention_plan(self) -> AttentionPlan:
        spec = self.rank_spec
        return self.attn_backend.plan(AttentionShapes(
            spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, self.dtype,
            torch.device(self.device)))

    def _profile_peak_bytes(self) -> int:
        """GPU memory a worst-case step needs beyond weights: one max-size prefill forward."""
        device = torch.device(self.device)
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        block_size = self.config.cache.block_size
        num_blocks = -(-num_tokens // block_size)
        shape = kv_cache.KVCacheShape(self.spec.num_hidden_layers, num_blocks, block_size,
                                      self.rank_spec.num_key_value_heads, self.spec.head_dim,
                                      kv_cache.kv_cache_dtype(self.config.cache, self.dtype))
        caches = kv_cache.allocate_kv_caches(shape, self.device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        runner = ModelRunner(self.model, caches, block_size, device, self.eos_token_ids,
                             NullConnectorWorker(), self._batch_limits(),
                             self._attention_plan(), self._rank_sampler())
        params = SamplingParams(temperature=0.0, max_tokens=1)
        request = NewRequestData("profile", [0] * num_tokens, num_tokens, params,
                                 list(range(num_blocks)), 0)
        runner.execute(SchedulerOutput([request], [], {"profile": num_tokens}, num_tokens))
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        # Sampling a full batch of logits needs vocab * max_num_seqs floats a few times over.
        peak += 4 * 4 * self.vocab_size * self.config.scheduler.max_num_seqs
        sizes = self._graph_sizes()
        if sizes:
            # The graphs' private pool is captured after the cache is allocated and is never
            # returned to the allocator: reserve it now.
            pool = runner.estimate_graph_pool_bytes(sizes)
            logger.info("Reserving %.1f MiB for CUDA graphs", pool / 2**20)
            self.graph_pool_reserve = pool
            peak += pool
        del caches, runner
        torch.cuda.empty_cache()
        return int(peak)

    # ---- requests ---------------------------------------------------------------------

    def validate(self, msg: AddRequest) -> SamplingParams:
        """Check a request against this engine's limits; raise InvalidRequestError."""
        if self._sleep_level:
            raise EngineSleepingError("the engine is asleep; POST /wake_up first")
        if msg.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {msg.request_id!r} is already in use")
        prompt = msg.prompt_token_ids
        generated = msg.generated_token_ids
        params = SamplingParams.from_dict(msg.sampling_params)
        if params.n != 1:
            raise InvalidRequestError("an engine request is one sample (n=1); the API server "
                                      "fans n out into requests", "n")
        check_token_ids(prompt, generated, params, self.vocab_size)
        if (params.prompt_logprobs is not None
                and msg.kv_transfer_params is not None
                and msg.kv_transfer_params.do_remote_prefill):
            raise InvalidRequestError("prompt logprobs come from the worker that computes the "
                                      "prompt, not from one that loads its KV", "prompt_logprobs")
        capacity = self.kv_manager.num_total_blocks * self.config.cache.block_size
        check_context(len(prompt), params.max_tokens, self.max_model_len, capacity)
        if params.max_tokens is None:
            params.max_tokens = min(self.max_model_len, capacity) - len(prompt)
        if len(generated) > params.max_tokens:
            raise InvalidRequestError(
                f"{len(generated)} tokens were already generated, more than max_tokens "
                f"({params.max_tokens})", "max_tokens")
        return params

    def add_request(self, msg: AddRequest) -> None:
        params = self.validate(msg)
        request = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=msg.arrival_time,
            kv_transfer_params=msg.kv_transfer_params,
            grammar=self.grammars.sequence_grammar(params.structured_outputs),
        )
        for token_id in msg.generated_token_ids:
            request.append_token(token_id)
        self.scheduler.add_request(request)
        self.stalled = False  # the next step may admit it

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        self.stalled = False  # freed blocks may let the queue's head in

    def has_work(self) -> bool:
        """True while any request is queued, running, awaiting remote KV or being sent, or
        a launched step is still to be collected."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def has_transfer_state(self) -> bool:
        """True while a connector half holds a transfer no request waits on (say the load of
        an aborted request, kept until its deadline); only a step lands, expires or frees it."""
        return not (self.scheduler.connector.is_idle() and self.connector_worker.is_idle())

    def doorbell(self) -> Doorbell | None:
        """The connector's doorbell, rung when a transfer lands (None: colocated)."""
        return self.connector_worker.doorbell()

    def peer_ranks(self) -> PeerRanks | None:
        """This worker's KV layout and rank addresses for the proxy (None: colocated)."""
        return self.connector_worker.peer_ranks()

    def has_runnable(self) -> bool:
        """True when the next step would compute (or collect) something (else poll)."""
        return self.scheduler.has_runnable() or self._in_flight is not None

    def step(self) -> list[EngineOutput]:
        """Schedule and launch a step; return the outputs of the step that completed.

        With async scheduling the step launched here is collected by the next call, after
        that call has launched its own: the host schedules and stages step N+1 while the
        device still runs step N. Outputs therefore trail by one step; a step that
        sampled nothing is collected at once. Penalties read the in-flight step's tokens on
        the device (``Sampler``), so they do not stop the overlap. A step in which a
        constrained request samples is launched without its sampling: the step in flight
        is collected (its tokens advance the grammars), then this step's masks fill on a
        thread while its forward runs and the next call schedules; that call queues the
        sampling just before its own launch (``worker/masked_sampling.py``).
        """
        started = time.perf_counter()
        if self.host_kv is not None:
            self.host_kv.poll()  # downloads that landed may serve this pass's lookups
        outputs = self._land_loads()
        scheduler_output = self.scheduler.schedule()
        transfer_updates = self.scheduler.transfer_updates
        if self.rank_processes is not None:
            self.rank_processes.send_step(scheduler_output)
        self.masked_sampling.finish()  # the launch below reads the in-flight step's tokens
        launched = self.runner.launch(scheduler_output)
        overlapped = self._in_flight is not None
        if self._in_flight is not None:
            outputs += self._complete(*self._in_flight)
            self._in_flight = None
        if launched.awaits_masks:  # its masks need the tokens collected just above
            masks = self.scheduler.grammar_masks(scheduler_output, launched.req_ids)
            self.masked_sampling.start(launched, masks, overlapped)
            if not self.async_scheduling:
                self.masked_sampling.finish()
        if self.async_scheduling and (launched.sampled or launched.awaits_masks):
            self._in_flight = (scheduler_output, launched)
        else:
            outputs += self._complete(scheduler_output, launched)
        self._observe_rates()
        self.step_watch.observe(time.perf_counter() - started,
                                scheduler_output.total_num_scheduled_tokens,
                                len(scheduler_output.num_scheduled_tokens))
        # Stalled only if collecting this step changed nothing the next pass could use (a
        # send that freed blocks, a load that landed or failed is applied after the pass).
        self.stalled = not (scheduler_output.total_num_scheduled_tokens or outputs
                            or self._in_flight is not None
                            or self.scheduler.transfer_updates != transfer_updates)
        return outputs

    def _observe_rates(self) -> None:
        """Feed the prefill-rate and step-time averages with the device time of every step
        finished since the last call (``worker/step_clock.py``)."""
        for cost in self.runner.step_clock.finished():  # type: ignore[union-attr]
            self.scheduler.step_rates.observe(cost.seconds, cost.num_prefill_tokens,
                                              cost.num_decodes)

    def _land_loads(self) -> list[EngineOutput]:
        """KV loads that arrived since the last pass join this one (their calls were
        scattered as they landed, and the host saw the last scatter end): a disaggregated
        request's first token comes one step after its KV landed, not three."""
        landed = self.connector_worker.land_loads()
        if not (landed.recving or landed.failed_recving):
            return []
        return self.scheduler.apply_finished_transfers(landed)

    def _complete(self, scheduler_output: SchedulerOutput,
                  launched: LaunchedStep) -> list[EngineOutput]:
        runner_output = self.runner.collect(launched)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    # ---- state ------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        scheduler, rates = self.scheduler, self.scheduler.step_rates
        counters, decoding = scheduler.counters, scheduler.num_decoding
        return EngineStats(
            num_running=len(scheduler.running),
            num_decoding=decoding,
            num_waiting=scheduler.num_waiting,
            num_waiting_for_remote_kv=len(scheduler.parked),
            kv_cache_usage=self.kv_manager.usage,
            num_free_blocks=self.kv_manager.num_free_blocks,
            num_total_blocks=self.kv_manager.num_total_blocks,
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            num_preemptions=counters.num_preemptions,
            prompt_tokens_total=counters.prompt_tokens,
            generation_tokens_total=counters.generation_tokens,
            num_computed_prompt_tokens_total=counters.computed_prompt_tokens,
            iteration_token_counts=list(counters.iteration_token_counts),
            iteration_tokens_sum=counters.iteration_tokens_sum,
            rejected_messages=self.rejected_messages,
            # Both halves: the worker side holds the transfer buffers and threads.
            connector={**scheduler.connector.stats(), **self.connector_worker.stats()},
            **self._offload_stats(),
            sleep_level=self.sleep_level,
            num_prefill_tokens_queued=scheduler.queued_prefill_tokens(),
            prefill_tokens_per_s=rates.prefill_tokens_per_s,
            decode_step_s=rates.decode_part_s(decoding),
            prefill_alone_tokens_per_s=rates.prefill_alone_tokens_per_s,
            decode_base_s=rates.decode_base_s, decode_hidden_s=rates.hidden_s,
            decode_per_row_s=rates.decode_per_row_s,
            decode_step_target_s=self.config.scheduler.decode_step_target_s or 0.0,
        )

    def _offload_stats(self) -> dict[str, int | float]:
        tier = self.kv_manager.host_tier
        if tier is None:
            return {}
        return {"kv_offload_stored_blocks": tier.stored_blocks,
                "kv_offload_loaded_blocks": tier.loaded_blocks,
                "kv_offload_usage": len(tier) / tier.num_slots}

    def reset_prefix_cache(self) -> bool:
        return self.kv_manager.reset_prefix_cache()

    def request_status(self, request_id: str) -> RequestStatus | None:
        request = self.scheduler.requests.get(request_id)
        return None if request is None else request.status

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.masked_sampling.shutdown()
        self.connector_worker.shutdown()
        if self.rank_processes is not None:
            self.rank_processes.shutdown()
        self.tp.close()

