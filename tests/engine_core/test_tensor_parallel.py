"""Tensor parallelism on CPU (gloo, real rank processes): TP=2 greedy output equals TP=1
through chunked prefill, prefix hits and preemption; the shard arithmetic; what TP refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core.config import EngineConfig, KVTransferConfig
from engine_core.errors import ConfigError, EngineDeadError
from engine_core.llm import LLM
from engine_core.parallel.sharding import HeadPartition, Shard, rank_local_spec
from engine_core.parallel.support import check_parallel_support
from engine_core.sampling_params import SamplingParams

# Llama: two KV heads split over two ranks. Qwen3: one KV head replicated on both ranks,
# tied embeddings, and a vocabulary (1001) that pads to 2 x 501 rows.
CHECKPOINTS = {
    "llama": dict(arch="llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, initializer_range=0.3),
    "qwen3": dict(arch="qwen3", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1,
                  head_dim=32, intermediate_size=96, vocab_size=1001, tie_word_embeddings=True,
                  initializer_range=0.3),
}
# Steps of at most 32 tokens (prompts up to 50 are chunked), 24 blocks of 4 tokens for 7
# requests of up to 58 tokens (preemptions), and a prompt that extends another (prefix hits).
ENGINE_ARGS = dict(max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=24,
                   block_size=4, dtype="float32", max_model_len=256)
PROMPTS = [[(7 * i + 3 * j) % 1000 for j in range(5 + 9 * i)] for i in range(6)]
PROMPTS.append(PROMPTS[3] + [5, 6, 7])
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    from engine_core.demo_model import build_checkpoint

    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = build_checkpoint(tmp_path_factory.mktemp(name), seed=7,
                                           **CHECKPOINTS[name])
        return built[name]

    return build


def _generate(path: Path, tp: int, **extra) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), tensor_parallel_size=tp, **ENGINE_ARGS, **extra)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)], llm


@pytest.mark.parametrize("name,async_scheduling", [("llama", True), ("qwen3", False)])
def test_tp2_greedy_equals_tp1(checkpoint, name: str, async_scheduling: bool) -> None:
    path = checkpoint(name)
    expected, single = _generate(path, 1, async_scheduling=async_scheduling)
    single.shutdown()
    got, llm = _generate(path, 2, async_scheduling=async_scheduling)
    try:
        engine = llm.engine
        assert engine.scheduler.counters.num_preemptions > 0
        assert engine.kv_manager.prefix_cache_hits > 0
        assert got == expected
        ranks = engine.rank_processes
        assert ranks is not None
        processes = list(ranks._processes)
        assert all(p.poll() is None for p in processes)
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in processes), "a rank outlived its engine"


def test_tp2_structured_outputs_equal_tp1(checkpoint) -> None:
    """Rank 0 samples a constrained step once the step before is collected and broadcasts
    the tokens; the other ranks queue the broadcast right after their forward. TP=2 gives
    TP=1's tokens, seeded and greedy, with masked steps overlapping (async scheduling)."""
    from engine_core.structured_outputs import StructuredOutputsParams

    regex = StructuredOutputsParams(regex=r"[a-z]{2,6}-\d{1,3}")
    params = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=24,
                             structured_outputs=regex) for i in range(4)]
    params += [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=regex), GREEDY,
               GREEDY]
    path = checkpoint("llama")
    outputs = []
    for tp in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp, **ENGINE_ARGS)
        try:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])
            # Masked steps ran with the step before in flight (whether any ran without one
            # depends on the machine's load: a busy machine overlaps them all).
            assert llm.engine.masked_steps.overlapped > 0
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]


def test_a_dead_rank_fails_the_engine(checkpoint) -> None:
    llm = LLM(str(checkpoint("llama")), tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        assert llm.engine.rank_processes is not None
        worker = llm.engine.rank_processes._processes[0]
        worker.kill()
        worker.wait()
        with pytest.raises(EngineDeadError, match="rank 1 exited"):
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        llm.shutdown()


def test_head_partition_splits_or_replicates_kv_heads() -> None:
    # 8 query heads, 2 KV heads over 4 ranks: each KV head serves two ranks.
    parts = [HeadPartition.of(8, 2, rank, 4) for rank in range(4)]
    assert [(p.q_start, p.num_q_heads) for p in parts] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(p.kv_start, p.num_kv_heads) for p in parts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert HeadPartition.of(8, 4, 1, 2) == HeadPartition(4, 4, 2, 2)
    with pytest.raises(ConfigError, match="attention heads"):
        HeadPartition.of(6, 2, 0, 4)
    with pytest.raises(ConfigError, match="KV heads"):
        HeadPartition.of(12, 3, 0, 2)


def test_shard_take_pads_past_the_end(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    full = torch.arange(10.0).reshape(5, 2)
    assert torch.equal(Shard(0, 0, 3).take(full), full[:3])
    tail = Shard(0, 3, 3).take(full)
    assert torch.equal(tail[:2], full[3:]) and torch.equal(tail[2], torch.zeros(2))
    assert torch.equal(Shard(1, 1, 1).take(full), full[:, 1:])
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as lazy:
        for shard in (Shard(0, 0, 3), Shard(0, 3, 3), Shard(1, 1, 1), Shard(-1, 1, 2)):
            assert torch.equal(shard.read(lazy.get_slice("w")), shard.take(full))


def test_rank_local_spec_has_the_rank_heads(checkpoint) -> None:
    from engine_core.worker.loader import read_model_spec

    spec = read_model_spec(checkpoint("qwen3"))
    local = rank_local_spec(spec, 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)


def test_sleep_mode_refuses_tp_and_kv_transfer_does_not() -> None:
    config = EngineConfig.from_kwargs("m", tensor_parallel_size=2)
    check_parallel_support(config)
    check_parallel_support(config.with_changes(kv_transfer=KVTransferConfig()))
    sleepy = EngineConfig.from_kwargs("m", tensor_parallel_size=2, enable_sleep_mode=True)
    with pytest.raises(ConfigError, match="sleep"):
        check_parallel_support(sleepy)


def test_tp_flag_parses_for_every_engine_command() -> None:
    from deploy.cli import build_parser
    from engine_core.arg_utils import engine_config_from_args

    for command in ("serve", "prefill", "decode"):
        args = build_parser().parse_args([command, "/models/x", "-tp", "2"])
        assert engine_config_from_args(args).parallel.tensor_parallel_size == 2
        args = build_parser().parse_args([command, "/models/x", "--tensor-parallel-size", "4"])
        assert engine_config_from_args(args).parallel.tensor_parallel_size == 4
        assert not engine_config_from_args(args).parallel.disable_custom_all_reduce
        args = build_parser().parse_args([command, "/models/x", "-tp", "2",
                                          "--disable-custom-all-reduce"])
        assert engine_config_from_args(args).parallel.disable_custom_all_reduce


def _greedy_on_gpus(path: str, tp: int) -> list[list[int]]:
    """Greedy token ids of PROMPTS from an engine of ``tp`` ranks on cuda:0.. (run in a
    process of its own: a CUDA engine of TP > 1 is one per process)."""
    llm = LLM(path, tensor_parallel_size=tp, device="cuda", gpu_memory_utilization=0.3,
              **ENGINE_ARGS)
    try:
        assert llm.engine.tp.size == tp and llm.engine.device.startswith("cuda")
        assert llm.engine.tp.uses_peer_memory == (tp > 1)  # two GPUs of one host map peers
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tp2_greedy_equals_tp1_over_nccl(checkpoint, name: str) -> None:
    """Two GPUs: rank 0 on cuda:0, rank 1 on cuda:1, the collectives (small all-reduces over
    peer memory, the rest NCCL) captured in the CUDA graphs of each rank's decode and mixed
    steps."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import multiprocessing

    path = str(checkpoint(name))
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        expected = pool.apply(_greedy_on_gpus, (path, 1))
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        assert pool.apply(_greedy_on_gpus, (path, 2)) == expected


def test_each_rank_loads_its_shards(model_checkpoint) -> None:
    """Qwen2 (q/k/v biases, one KV head replicated, tied embeddings): each rank's parameters
    are its slices of the single-rank model's. Loading needs no collective, so the groups
    here are never started."""
    from engine_core.attention.backend import get_attention_backend
    from engine_core.config import ModelConfig
    from engine_core.parallel.group import TensorParallelGroup
    from engine_core.worker.loader import load_model, read_model_spec

    path = model_checkpoint("qwen2-tied-linear")
    spec = read_model_spec(path)
    backend = get_attention_backend("cpu", "auto")

    def load(rank: int, size: int):
        return load_model(ModelConfig(model=str(path)), spec, "cpu", torch.float32, backend,
                          tp=TensorParallelGroup(rank, size))

    full = load(0, 1)
    hd, hidden = spec.head_dim, spec.hidden_size
    q_rows = spec.num_attention_heads * hd
    for rank in range(2):
        part = load(rank, 2)
        attn, whole = part.model.layers[1].self_attn, full.model.layers[1].self_attn
        q = slice(rank * q_rows // 2, (rank + 1) * q_rows // 2)
        kv = slice(q_rows, q_rows + hd)  # the one KV head, on both ranks
        v = slice(q_rows + hd, q_rows + 2 * hd)
        for name in ("weight", "bias"):
            mine, theirs = getattr(attn.qkv_proj, name), getattr(whole.qkv_proj, name)
            assert torch.equal(mine, torch.cat([theirs[q], theirs[kv], theirs[v]]))
        assert torch.equal(attn.o_proj.weight, whole.o_proj.weight[:, q])
        mlp, whole_mlp = part.model.layers[1].mlp, full.model.layers[1].mlp
        inter = spec.intermediate_size
        rows = slice(rank * inter // 2, (rank + 1) * inter // 2)
        gate_up = whole_mlp.gate_up_proj.weight
        assert torch.equal(mlp.gate_up_proj.weight,
                           torch.cat([gate_up[:inter][rows], gate_up[inter:][rows]]))
        assert torch.equal(mlp.down_proj.weight, whole_mlp.down_proj.weight[:, rows])
        vocab = spec.vocab_size // 2
        assert torch.equal(part.model.embed_tokens.weight,
                           full.model.embed_tokens.weight[rank * vocab:(rank + 1) * vocab])
        assert part.lm_head.weight is part.model.embed_tokens.weight
        assert part.model.embed_tokens.weight.shape == (vocab, hidden)
