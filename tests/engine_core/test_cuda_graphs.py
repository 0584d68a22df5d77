"""CUDA graphs of decode and mixed steps: size schedules (CPU), the padded decode and mixed
paths through the runner with a stand-in for the graphs (CPU), and on CUDA (`gpu`): graph
replay gives the same tokens as eager execution (float32 and bfloat16; padded batch sizes,
prefix caching, chunked prefill mixed with decodes, preemption, seeded sampling),
bit-identical hidden states for the same padded step (both kinds), steps with connector
layer hooks (small ones replayed with the hooks around, on CPU and CUDA), `--enforce-eager`,
`--cuda-graph-mode full_decode_only`, and the captured sizes."""

from __future__ import annotations

import random

import pytest
import torch

from engine_core import LLM, SamplingParams
from engine_core.kv_connector import NullConnectorWorker
from engine_core.worker.cuda_graphs import (
    GraphSizes,
    capture_sizes,
    default_capture_sizes,
    graphs_disabled_reason,
    padded_size,
)
from engine_core.worker.forward_timer import ForwardTimer

# ---- CPU: sizes and padding -------------------------------------------------------------


def test_default_schedule():
    assert default_capture_sizes(512) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112,
                                          128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # a full batch is captured too
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(1024)[-4:] == [640, 768, 896, 1024]


def test_capture_sizes_follow_flag_and_limits():
    def mixed(top: int) -> list[int]:
        return default_capture_sizes(top)[1:]  # a mixed step has two tokens or more

    assert capture_sizes((), 256, 8192) == GraphSizes(default_capture_sizes(256), mixed(2048))
    assert capture_sizes((), 1024, 8192).decode == default_capture_sizes(512)
    assert capture_sizes((), 256, 100) == GraphSizes(default_capture_sizes(100), mixed(100))
    assert capture_sizes((48,), 256, 8192) == GraphSizes(default_capture_sizes(48), mixed(48))
    assert capture_sizes((5, 3, 3, 300), 256, 8192) == GraphSizes([3, 5], [3, 5, 300])
    assert capture_sizes((1, 300), 256, 200) == GraphSizes([1], [])
    sizes = capture_sizes((), 256, 8192)
    assert (len(sizes.decode), len(sizes.mixed), sizes.largest) == (19, 34, 2048)
    assert capture_sizes((), 256, 8192, "full_decode_only") == GraphSizes(
        default_capture_sizes(256), [])
    assert not GraphSizes() and GraphSizes([], [4])


def test_padded_size():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert padded_size(17, sizes) is None
    assert padded_size(1, []) is None


def test_graphs_only_for_cuda_triton_without_enforce_eager():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_disabled_reason(cuda, "triton", False) is None
    assert "enforce-eager" in graphs_disabled_reason(cuda, "triton", True)
    assert graphs_disabled_reason(cpu, "torch_ref", False) is not None
    assert graphs_disabled_reason(cuda, "torch_ref", False) is not None


def test_flags_reach_the_config():
    import argparse

    from engine_core.arg_utils import add_engine_args, engine_config_from_args
    from engine_core.config import EngineConfig
    from engine_core.errors import ConfigError

    parser = add_engine_args(argparse.ArgumentParser())
    parser.add_argument("model")
    args = parser.parse_args(["m", "--enforce-eager", "--cuda-graph-sizes", "1", "2", "4"])
    device = engine_config_from_args(args).device
    assert device.enforce_eager and device.cuda_graph_sizes == (1, 2, 4)
    default = engine_config_from_args(parser.parse_args(["m"])).device
    assert not default.enforce_eager and default.cuda_graph_sizes == ()
    assert EngineConfig.from_kwargs("m", cuda_graph_sizes=[8, 2]).device.cuda_graph_sizes == (8, 2)
    with pytest.raises(ConfigError):
        EngineConfig.from_kwargs("m", cuda_graph_sizes=[0])
    rows = engine_config_from_args(parser.parse_args(["m", "--triton-gemv-max-rows", "4"]))
    assert rows.device.triton_gemv_max_rows == 4 and default.triton_gemv_max_rows is None
    with pytest.raises(ConfigError, match="triton-gemv-max-rows"):
        EngineConfig.from_kwargs("m", triton_gemv_max_rows=17)
    mode = engine_config_from_args(parser.parse_args(["m", "--cuda-graph-mode",
                                                      "full_decode_only"]))
    assert mode.device.cuda_graph_mode == "full_decode_only"
    assert default.cuda_graph_mode == "full"
    with pytest.raises(ConfigError, match="cuda-graph-mode"):
        EngineConfig.from_kwargs("m", cuda_graph_mode="piecewise")
    split = engine_config_from_args(parser.parse_args(["m", "--split-k-mlp", "off"]))
    assert split.device.split_k_mlp == "off" and default.split_k_mlp == "auto"
    with pytest.raises(ConfigError, match="split-k-mlp"):
        EngineConfig.from_kwargs("m", split_k_mlp="yes")


def test_gemv_rows_reach_the_projections(tiny_checkpoint):
    """The backend's GEMV row limit is what every projection of the model holds; the CPU
    reference path has none (``Linear`` then always calls ``F.linear``)."""
    from engine_core.attention.triton_backend import DEFAULT_GEMV_MAX_ROWS, TritonAttentionBackend
    from engine_core.layers.linear import Linear
    from engine_core.models.registry import get_model_class
    from engine_core.worker.loader import read_model_spec

    spec = read_model_spec(tiny_checkpoint("qwen3"))
    for backend, rows in ((TritonAttentionBackend(), DEFAULT_GEMV_MAX_ROWS),
                          (TritonAttentionBackend(gemv_max_rows=0), 0)):
        with torch.device("meta"):
            model = get_model_class(spec.architecture)(spec, backend)
        linears = [m for m in model.modules() if type(m).__name__ in ("Linear", "MergedLinear")]
        assert len(linears) == 4 * spec.num_hidden_layers
        assert all(isinstance(m, Linear) and m.gemv_max_rows == rows for m in linears)
    llm = LLM(str(tiny_checkpoint("qwen3")), max_num_seqs=4)
    assert llm.engine.attn_backend.gemv_max_rows == 0


def test_cpu_engine_captures_nothing(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen3")), max_num_seqs=4)
    assert llm.engine.graph_capture is None and llm.engine.runner.graphs is None


# ---- CPU: the padded decode path through the runner --------------------------------------


class EagerStandIn:
    """Replays by running the captured views eagerly: the graph path's padding and buffer
    handling, minus the capture (CPU has no graphs)."""

    def __init__(self, runner, sizes: list[int], mixed_sizes: list[int] | None = None) -> None:
        self.runner, self.sizes, self.replayed = runner, sizes, []
        self.mixed_sizes = mixed_sizes or []
        self.replayed_mixed: list[int] = []

    def size_for(self, num_tokens: int, mixed: bool) -> int | None:
        return padded_size(num_tokens, self.mixed_sizes if mixed else self.sizes)

    def replay(self, size: int, mixed: bool) -> torch.Tensor:
        (self.replayed_mixed if mixed else self.replayed).append(size)
        return self.runner.graph_forward(size, mixed)


class HookedConnector(NullConnectorWorker):
    """A producer whose every step saves per layer. Records each step's hook calls and, in
    each ``after_layer``, the K/V at the step's slots of that layer (what a send gathers)."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int]]] = []
        self.saved: list[torch.Tensor] = []
        self._slots: torch.Tensor | None = None

    def needs_layer_hooks(self, metadata: object) -> bool:
        return True

    def bind_step(self, metadata: object, attn_metadata) -> None:
        self.steps.append([])
        slots = attn_metadata.slot_mapping
        self._slots = slots[slots >= 0].clone()

    def before_layer(self, layer_idx: int) -> None:
        self.steps[-1].append(("before", layer_idx))

    def after_layer(self, layer_idx: int, kv_cache: torch.Tensor) -> None:
        self.steps[-1].append(("after", layer_idx))
        self.saved.append(kv_cache.flatten(1, 2)[:, self._slots].clone())


def hook_patterns(connector: HookedConnector, num_layers: int) -> set[str]:
    """Each step's hooks: 'between' layers (eager) or 'around' a replay (all before, then
    all after); anything else fails."""
    layers = list(range(num_layers))
    between = [(kind, i) for i in layers for kind in ("before", "after")]
    around = [("before", i) for i in layers] + [("after", i) for i in layers]
    patterns = set()
    for calls in connector.steps:
        assert calls in (between, around), calls
        patterns.add("between" if calls == between else "around")
    return patterns


def prompts_of(lengths: list[int], seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def staggered(prompts: list[list[int]], base: int = 3, **kwargs) -> list[SamplingParams]:
    """Different lengths per request, so decode batches shrink through padded sizes."""
    return [SamplingParams(temperature=0.0, max_tokens=base + 2 * i, ignore_eos=True, **kwargs)
            for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_decode_path_matches_eager_on_cpu(tiny_checkpoint, arch):
    path = str(tiny_checkpoint(arch))
    prompts = prompts_of([5, 17, 33, 2, 40, 16, 9])
    params = staggered(prompts)
    eager = [o.outputs[0].token_ids for o in LLM(path, max_num_seqs=8).generate(prompts, params)]
    llm = LLM(path, max_num_seqs=8, max_num_batched_tokens=64)
    runner = llm.engine.runner
    runner.graphs = stand_in = EagerStandIn(runner, [1, 2, 4, 8])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == eager
    assert 8 in stand_in.replayed  # 5 to 7 rows padded to 8
    assert 4 in stand_in.replayed  # 3 rows padded to 4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_mixed_path_matches_eager_on_cpu(tiny_checkpoint, arch):
    """Chunked prefills beside decodes, padded to mixed sizes (empty sequences, tokens of
    no sequence) with at most max_num_seqs sequences a graph: the same tokens as eager."""
    path = str(tiny_checkpoint(arch))
    prompts = prompts_of([5, 17, 33, 2, 40, 16, 9, 60, 3])
    params = staggered(prompts)
    engine_args = dict(max_num_seqs=6, max_num_batched_tokens=24)
    eager = [o.outputs[0].token_ids for o in LLM(path, **engine_args).generate(prompts, params)]
    llm = LLM(path, **engine_args)
    runner = llm.engine.runner
    runner.graphs = stand_in = EagerStandIn(runner, [1, 2, 4, 6], [8, 16, 24])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == eager
    assert {8, 16, 24} <= set(stand_in.replayed_mixed), stand_in.replayed_mixed
    assert stand_in.replayed


def test_hooked_steps_replay_small_graphs_with_hooks_around(tiny_checkpoint, monkeypatch):
    """A step with layer hooks (a prefill worker's sends) replays a graph up to
    HOOKED_GRAPH_MAX_TOKENS tokens, every layer's hooks called around the replay; larger
    ones run eagerly with hooks between layers. Same tokens and (within float32 rounding) the
same saved KV either way."""
    import engine_core.worker.model_runner as model_runner

    path = str(tiny_checkpoint("qwen3"))
    prompts = prompts_of([4, 9, 12, 30])
    params = staggered(prompts)
    eager_llm = LLM(path, max_num_seqs=4)
    eager_llm.engine.runner.connector = eager_hooks = HookedConnector()
    eager = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params)]
    monkeypatch.setattr(model_runner, "HOOKED_GRAPH_MAX_TOKENS", 16)
    llm = LLM(path, max_num_seqs=4)
    runner = llm.engine.runner
    runner.graphs = stand_in = EagerStandIn(runner, [1, 2, 4], [8, 16, 64])
    runner.connector = hooks = HookedConnector()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == eager
    num_layers = len(runner.kv_caches)
    assert hook_patterns(eager_hooks, num_layers) == {"between"}
    assert hook_patterns(hooks, num_layers) == {"between", "around"}  # 55 tokens: eager
    assert stand_in.replayed and 64 not in stand_in.replayed_mixed
    assert len(hooks.saved) == len(eager_hooks.saved)
    for graph_kv, eager_kv in zip(hooks.saved, eager_hooks.saved):
        # float32; a padded matmul may round its last bit differently (tokens are equal)
        torch.testing.assert_close(graph_kv, eager_kv, rtol=1e-4, atol=1e-5)


# ---- CUDA --------------------------------------------------------------------------------

gpu = pytest.mark.gpu


def free_gpu() -> None:
    """Engines size their cache from what the process holds: free one before the next."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def release_gpu_memory():
    yield
    free_gpu()


def cuda_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("gpu_memory_utilization", 0.25)
    # Graphs against eager token for token: the split-K MLP's float32 atomics land in
    # arrival order, so two runs of a 16-bit model may differ at a near-tie. Its graphs are
    # checked against HF with near-ties allowed (test_gpu_equivalence.py).
    kwargs.setdefault("split_k_mlp", "off")
    return LLM(str(path), device="cuda", **kwargs)


def timed_run(llm: LLM, prompts, params):
    """(token ids, forward samples) of one generate call."""
    timer = ForwardTimer(torch.device("cuda"))
    llm.engine.runner.forward_timer = timer
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.forward_timer = None
    return out, timer.collect()


def eager_tokens(path, prompts, params, **kwargs) -> list[list[int]]:
    llm = cuda_llm(path, enforce_eager=True, **kwargs)
    assert llm.engine.runner.graphs is None
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    free_gpu()
    return out


def mixed_lengths() -> list[list[int]]:
    """11 prompts (decode batches 11 -> 1 pass padded sizes 16, 8, 4) with shared prefixes."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = prompts_of([1, 7, 16, 17, 33, 64, 130])
    prompts += [shared + [rng.randrange(3, 1000) for _ in range(t)] for t in (1, 9, 24, 70)]
    return prompts


@gpu
def test_capture_sizes_and_counts(tiny_checkpoint, release_gpu_memory):
    path = tiny_checkpoint("qwen3")
    llm = cuda_llm(path, max_num_seqs=16)
    assert llm.engine.attn_backend.name == "triton"
    stats = llm.engine.graph_capture
    mixed = default_capture_sizes(2048)[1:]
    assert stats is not None and stats.sizes == GraphSizes([1, 2, 4, 8, 16], mixed)
    assert llm.engine.runner.graphs.sizes == stats.sizes and stats.count == 5 + len(mixed)
    assert stats.pool_bytes >= 0 and stats.seconds > 0
    del llm
    free_gpu()
    custom = cuda_llm(path, max_num_seqs=16, cuda_graph_sizes=[3, 6, 64])
    # 64 is over max_num_seqs for a decode graph, not for a mixed one
    assert custom.engine.graph_capture.sizes == GraphSizes([3, 6], [3, 6, 64])
    del custom
    free_gpu()
    decode_only = cuda_llm(path, max_num_seqs=16, cuda_graph_mode="full_decode_only")
    assert decode_only.engine.graph_capture.sizes == GraphSizes([1, 2, 4, 8, 16], [])
    del decode_only
    free_gpu()
    eager = cuda_llm(path, max_num_seqs=16, enforce_eager=True)
    assert eager.engine.graph_capture is None and eager.engine.runner.graphs is None


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graphs_match_eager(tiny_checkpoint, release_gpu_memory, arch, dtype):
    """Padded decode batches, chunked prefill mixed with decodes, then the same prompts
    again (prefix-cache hits)."""
    path = tiny_checkpoint(arch)
    prompts = mixed_lengths()
    params = staggered(prompts, base=16)
    engine_args = dict(dtype=dtype, max_num_seqs=16, max_num_batched_tokens=48)
    eager_llm = cuda_llm(path, enforce_eager=True, **engine_args)
    eager, eager_samples = timed_run(eager_llm, prompts, params)
    eager_again, _ = timed_run(eager_llm, prompts, params)
    del eager_llm
    free_gpu()
    llm = cuda_llm(path, **engine_args)
    got, samples = timed_run(llm, prompts, params)
    again, samples_again = timed_run(llm, prompts, params)
    for i, (g, e) in enumerate(zip(got, eager)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): graphs {g} != eager {e}"
    assert again == eager_again
    assert not any(s.graphed for s in eager_samples)
    graphed_sizes = {s.num_tokens for s in samples + samples_again if s.graphed}
    assert {4, 8, 16} <= graphed_sizes, graphed_sizes
    # Every step fits a graph (48 tokens at most); over 16 tokens only a mixed one.
    assert all(s.graphed for s in samples + samples_again)
    assert any(s.num_tokens > 16 for s in samples)
    manager = llm.engine.kv_manager
    assert manager.prefix_cache_hits > 0
    assert manager.num_free_blocks == manager.num_total_blocks


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager_under_preemption(tiny_checkpoint, release_gpu_memory, dtype):
    path = tiny_checkpoint("llama")
    prompts = mixed_lengths()
    params = staggered(prompts, base=8)
    engine_args = dict(dtype=dtype, max_num_seqs=16, max_num_batched_tokens=64,
                       num_gpu_blocks_override=30)
    eager = eager_tokens(path, prompts, params, **engine_args)
    llm = cuda_llm(path, **engine_args)
    got, samples = timed_run(llm, prompts, params)
    assert got == eager
    assert llm.engine.get_stats().num_preemptions > 0
    assert any(s.graphed for s in samples)


@gpu
def test_seeded_sampling_matches_eager(tiny_checkpoint, release_gpu_memory):
    path = tiny_checkpoint("qwen3")
    prompts = mixed_lengths()
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=100 + i,
                             max_tokens=4 + i, ignore_eos=True) for i in range(len(prompts))]
    eager = eager_tokens(path, prompts, params, dtype="float32")
    llm = cuda_llm(path, dtype="float32")
    got, samples = timed_run(llm, prompts, params)
    assert got == eager
    assert any(s.graphed for s in samples)


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_is_bit_identical_to_eager_forward(tiny_checkpoint, release_gpu_memory, dtype):
    """The same padded step (same buffers, same cache): replayed graph == eager forward, for
    a mixed graph (the first step's three prefills) and a decode graph."""
    from engine_core.messages import AddRequest

    llm = cuda_llm(tiny_checkpoint("qwen3"), dtype=dtype, max_num_seqs=16)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True).to_dict()
    for i, prompt in enumerate(prompts_of([3, 20, 50])):
        engine.add_request(AddRequest(f"r{i}", prompt, params, 0.0))
    timer = ForwardTimer(torch.device("cuda"))
    runner.forward_timer = timer
    for mixed, size, rows in ((True, 80, 73), (False, 4, 3)):
        # The three prefills (73 tokens: the mixed graph of 80), then a decode of 3 rows.
        engine.step()
        last = timer.collect()[-1]
        assert last.graphed and last.num_tokens == size
        # The buffers still hold that step's inputs; the K/V it writes are the same values.
        replayed = runner.graphs.replay(size, mixed).clone()
        with torch.inference_mode():
            eager = runner.graph_forward(size, mixed)
        assert torch.isfinite(replayed[:rows]).all()
        assert torch.equal(replayed[:rows], eager[:rows])


@gpu
def test_hooked_steps_save_what_eager_saves(tiny_checkpoint, release_gpu_memory):
    """On CUDA a hooked step's hooks run after its graph replay is queued: what
    ``after_layer`` reads on the stream is the step's KV, as in an eager run."""
    path = tiny_checkpoint("qwen3")
    prompts = mixed_lengths()
    params = staggered(prompts, base=4)

    def run(**kwargs):
        llm = cuda_llm(path, dtype="float32", max_num_seqs=16, max_num_batched_tokens=48,
                       **kwargs)
        llm.engine.runner.connector = hooks = HookedConnector()
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        patterns = hook_patterns(hooks, len(llm.engine.runner.kv_caches))
        saved = [t.cpu() for t in hooks.saved]
        del llm
        free_gpu()
        return out, patterns, saved

    eager, eager_patterns, eager_saved = run(enforce_eager=True)
    got, patterns, saved = run()
    assert got == eager
    assert eager_patterns == {"between"} and patterns == {"around"}  # every step <= 48 tokens
    assert len(saved) == len(eager_saved)
    for graph_kv, eager_kv in zip(saved, eager_saved):
        torch.testing.assert_close(graph_kv, eager_kv, rtol=1e-4, atol=1e-5)
