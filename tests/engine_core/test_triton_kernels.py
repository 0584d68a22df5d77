"""Triton kernels against the torch reference, on fresh random inputs.

Every test runs on two devices: ``cuda`` (marked ``gpu``: the real acceptance, with the
full case lists) and ``interpret`` (CPU tensors under ``TRITON_INTERPRET=1``, small cases;
test_triton_interpret.py runs this module that way in a subprocess). Kernel modules are
imported inside the tests, so collecting this module never imports triton.

References are computed in float32 from exactly what the kernels see (the cache contents
as stored, fp8 included), so tolerances measure the kernels' arithmetic alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from engine_core.attention.metadata import AttentionMetadata
from engine_core.attention.torch_ref import (
    TorchRefAttentionBackend,
    causal_attention,
    gather_sequence_kv,
    write_to_paged_cache,
)
from engine_core.kernels import triton_available

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


if INTERPRETING and triton_available():
    from tests.engine_core import triton_interpreter_fixes

    triton_interpreter_fixes.apply()
_interpret_only = pytest.mark.skipif(
    not (INTERPRETING and triton_available()),
    reason="interpreter cases run under TRITON_INTERPRET=1 (see test_triton_interpret.py)")
# The Triton 3.6 interpreter rounds fp8 downcasts wrongly (it drops the carry into the
# exponent: 1.99 -> 1.0); GPUs convert in hardware. Writes into an fp8 cache are therefore
# checked on CUDA only; fp8 *reads* are checked in both modes.
_FP8_WRITE_SKIP = "interpreter fp8 downcast is wrong in triton 3.6 (GPU only)"

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOLERANCE = {FP32: dict(atol=1e-4, rtol=1e-4), FP16: dict(atol=4e-3, rtol=4e-3),
             BF16: dict(atol=1.5e-2, rtol=1.5e-2)}


def params(cuda_cases: list, interpret_cases: list) -> list:
    """(device, case) params: full lists on CUDA, small ones under the interpreter."""
    return ([pytest.param("cuda", c, marks=pytest.mark.gpu, id=f"cuda-{c}")
             for c in cuda_cases]
            + [pytest.param("cpu", c, marks=_interpret_only, id=f"interpret-{c}")
               for c in interpret_cases])


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all(), "non-finite values in the kernel output"
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


# ---- attention batches ----------------------------------------------------------------


@dataclass(frozen=True)
class AttnCase:
    """One batch: sequence i has ``cached[i]`` tokens in the cache and adds ``new[i]``."""

    dtype: torch.dtype
    num_kv_heads: int
    group: int
    head_dim: int
    cached: tuple[int, ...]
    new: tuple[int, ...]
    cache_dtype: torch.dtype | None = None
    block_size: int = 16
    num_splits: int | None = None
    pad_rows: int = 0  # CUDA-graph padding: rows with one token, seq_len 0, slot -1

    def __str__(self) -> str:
        cache = str(self.cache_dtype).removeprefix("torch.") if self.cache_dtype else "same"
        return (f"{str(self.dtype).removeprefix('torch.')}-kv{cache}-h{self.num_kv_heads}"
                f"x{self.group}-d{self.head_dim}-bs{self.block_size}"
                f"-c{'_'.join(map(str, self.cached))}-n{'_'.join(map(str, self.new))}"
                f"-s{self.num_splits}-p{self.pad_rows}")

    @property
    def storage(self) -> torch.dtype:
        return self.cache_dtype or self.dtype


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor          # new tokens' K/V [T, Hkv, D]
    v: torch.Tensor
    kv_cache: torch.Tensor   # holds the cached prefixes only (new tokens not written yet)
    metadata: AttentionMetadata
    scale: float


def random_tables(seq_lens: list[int], block_size: int,
                  gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Disjoint shuffled blocks per sequence, in a table wider than needed (as a fixed-width
    CUDA-graph table would be; the tail holds 0), and the number of blocks used."""
    counts = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(counts) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(counts + [1]) + 2, dtype=torch.int32)
    for i, count in enumerate(counts):
        tables[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    return tables, num_blocks


def build_metadata(cached: list[int], new: list[int], tables: torch.Tensor, block_size: int,
                   pad_rows: int, device: str) -> AttentionMetadata:
    """Metadata of one step, plus ``pad_rows`` CUDA-graph pad rows (one token, seq_len 0,
    slot -1, a zero block-table row) after the real sequences."""
    slots = []
    for i, (c, n) in enumerate(zip(cached, new)):
        positions = torch.arange(c, c + n)
        slots.append(tables[i, positions // block_size].long() * block_size
                     + positions % block_size)
    slots.append(torch.full((pad_rows,), -1, dtype=torch.long))
    tables = torch.cat([tables[:len(new)], torch.zeros(pad_rows, tables.shape[1],
                                                       dtype=torch.int32)])
    query_lens = list(new) + [1] * pad_rows
    seq_lens = [c + n for c, n in zip(cached, new)] + [0] * pad_rows
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)


def make_batch(case: AttnCase, device: str, seed: int = 0) -> Batch:
    """Random batch whose cache holds the cached prefixes; unwritten slots hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    seq_lens = [c + n for c, n in zip(case.cached, case.new)]
    tables, num_blocks = random_tables(seq_lens, bs, gen)
    hq, hkv, d = case.num_kv_heads * case.group, case.num_kv_heads, case.head_dim
    kv_cache = torch.full((2, num_blocks, bs, hkv, d), float("nan")).to(case.storage)
    q_list, k_list, v_list = [], [], []
    for i, (c, n) in enumerate(zip(case.cached, case.new)):
        positions = torch.arange(c)
        k_seq = torch.randn(c + n, hkv, d, generator=gen).to(case.dtype)
        v_seq = torch.randn(c + n, hkv, d, generator=gen).to(case.dtype)
        write_to_paged_cache(k_seq[:c], v_seq[:c], kv_cache,
                             tables[i, positions // bs].long() * bs + positions % bs)
        k_list.append(k_seq[c:])
        v_list.append(v_seq[c:])
        q_list.append(torch.randn(n, hq, d, generator=gen).to(case.dtype))
    for parts, heads in ((q_list, hq), (k_list, hkv), (v_list, hkv)):
        parts.append(torch.randn(case.pad_rows, heads, d, generator=gen).to(case.dtype))
    metadata = build_metadata(list(case.cached), list(case.new), tables, bs, case.pad_rows,
                              device)
    return Batch(torch.cat(q_list).to(device), torch.cat(k_list).to(device),
                 torch.cat(v_list).to(device), kv_cache.to(device), metadata, d ** -0.5)


def reference_attention(q: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """float32 paged attention over ``kv_cache`` (which must hold the new tokens too);
    rows of sequences with ``seq_len`` 0 are zeros."""
    q32 = q.float()
    out = torch.zeros_like(q32)
    starts = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo or seq_len == 0:
            continue
        k, v = gather_sequence_kv(kv_cache, meta.block_tables[i], seq_len, torch.float32)
        out[lo:hi] = causal_attention(q32[lo:hi], k, v, scale)
    return out


def write_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """The torch reference write, skipping slot -1 (pad rows) as the kernel does."""
    keep = slot_mapping >= 0
    write_to_paged_cache(k[keep], v[keep], kv_cache, slot_mapping[keep])


def cache_with_new_tokens(batch: Batch) -> torch.Tensor:
    """The batch's cache after the reference write of this step's K/V."""
    kv_cache = batch.kv_cache.clone()
    write_reference(batch.k, batch.v, kv_cache, batch.metadata.slot_mapping)
    return kv_cache


def expected_output(batch: Batch, kv_cache: torch.Tensor) -> torch.Tensor:
    return reference_attention(batch.q, batch.metadata, kv_cache, batch.scale)


# ---- KV write ---------------------------------------------------------------------------

WRITE_CASES_CUDA = [AttnCase(dt, hkv, 1, d, (0, 5, 40), (23, 17, 1), cache, pad_rows=2)
                    for dt in (BF16, FP16, FP32) for cache in (None, E4M3, E5M2)
                    for hkv, d in ((1, 64), (8, 128), (3, 96))]
WRITE_CASES_INTERPRET = [AttnCase(FP32, 2, 1, 32, (0, 3), (9, 17), pad_rows=1),
                         AttnCase(BF16, 1, 1, 16, (4,), (13,)),
                         AttnCase(FP16, 3, 1, 24, (0,), (5,), E4M3)]


@pytest.mark.parametrize(("device", "case"), params(WRITE_CASES_CUDA, WRITE_CASES_INTERPRET))
def test_write_kv_matches_reference_bytes(device: str, case: AttnCase) -> None:
    from engine_core.kernels.kv_write import write_kv

    if device == "cpu" and is_fp8(case.storage):
        pytest.skip(_FP8_WRITE_SKIP)
    batch = make_batch(case, device)
    expected = cache_with_new_tokens(batch)
    got = batch.kv_cache.clone()
    write_kv(batch.k, batch.v, got, batch.metadata.slot_mapping)
    # Byte equality: the same casts, and slot -1 rows and untouched slots (NaN) unchanged.
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


# ---- prefill / chunked prefill -----------------------------------------------------------

_PREFILL_SHAPE = ((0, 37, 5, 130), (45, 19, 2, 77))  # first prefill, chunk after prefix, ...
PREFILL_CASES_CUDA = (
    [AttnCase(dt, 2, g, d, *_PREFILL_SHAPE) for dt in (BF16, FP16, FP32)
     for g in (1, 4, 8) for d in (64, 128)]
    + [AttnCase(dt, 2, 4, 128, *_PREFILL_SHAPE, cache_dtype=c) for dt in (BF16, FP32)
       for c in (E4M3, E5M2)]
    + [AttnCase(BF16, 4, 2, 16, *_PREFILL_SHAPE), AttnCase(FP32, 2, 2, 32, *_PREFILL_SHAPE),
       AttnCase(BF16, 2, 3, 96, *_PREFILL_SHAPE, block_size=32),
       AttnCase(BF16, 8, 8, 128, (1000, 0), (300, 1500), block_size=32),
       AttnCase(FP16, 1, 6, 64, (3, 0, 64), (1, 1, 1))]
)
PREFILL_CASES_INTERPRET = [
    AttnCase(FP32, 2, 1, 16, (0, 21, 3), (19, 6, 1), block_size=4),
    AttnCase(BF16, 1, 4, 32, (0, 9), (14, 5), block_size=8),
    AttnCase(FP16, 2, 2, 16, (17, 0), (3, 12), cache_dtype=E5M2, block_size=4),
    AttnCase(FP32, 1, 3, 24, (6,), (11,), cache_dtype=E4M3, block_size=8),
]


@pytest.mark.parametrize(("device", "case"), params(PREFILL_CASES_CUDA, PREFILL_CASES_INTERPRET))
def test_prefill_matches_reference(device: str, case: AttnCase) -> None:
    batch = make_batch(case, device)
    kv_cache = cache_with_new_tokens(batch)
    out = run_prefill(batch, kv_cache, graph_grid=False)
    assert_close(out, expected_output(batch, kv_cache), case.dtype)


def run_prefill(batch: Batch, kv_cache: torch.Tensor, graph_grid: bool) -> torch.Tensor:
    """The prefill kernel over every sequence's tiles (single-token rows included);
    ``graph_grid``: launched over the bound of a graph of this size, the rest ``-1``."""
    from engine_core.attention.prefill_tiles import max_prefill_tiles, prefill_tiles
    from engine_core.kernels.paged_prefill import paged_prefill_attention, query_tile_tokens

    meta = batch.metadata
    q = batch.q
    tile = query_tile_tokens(q.shape[1], batch.k.shape[1], q.shape[2], q.dtype)
    tiles, count = prefill_tiles(meta.query_start_loc_cpu, tile, q.device, include_single=True)
    if graph_grid:
        bound = max_prefill_tiles(meta.num_tokens, meta.num_seqs, tile)
        assert tiles.shape[0] == 2 * bound and count < bound
        count = bound
    out = torch.zeros_like(q)
    paged_prefill_attention(q, kv_cache[0], kv_cache[1], out, meta.block_tables,
                            meta.seq_lens, meta.query_start_loc, tiles, count, tile,
                            meta.block_size, batch.scale)
    return out


PADDED_PREFILL_CASES_CUDA = [AttnCase(dt, 2, g, 128, (0, 37, 300), (130, 19, 77))
                             for dt in (BF16, FP32) for g in (1, 4)]
PADDED_PREFILL_CASES_INTERPRET = [AttnCase(FP32, 1, 2, 16, (0, 9), (21, 6), block_size=4)]


@pytest.mark.parametrize(("device", "case"),
                         params(PADDED_PREFILL_CASES_CUDA, PADDED_PREFILL_CASES_INTERPRET))
def test_prefill_over_a_graph_grid(device: str, case: AttnCase) -> None:
    """The grid a mixed graph captured (more programs than tiles): the surplus exits, and
    the result equals the exact grid's bit for bit."""
    batch = make_batch(case, device)
    kv_cache = cache_with_new_tokens(batch)
    exact = run_prefill(batch, kv_cache, graph_grid=False)
    padded = run_prefill(batch, kv_cache, graph_grid=True)
    assert torch.equal(exact, padded)
    assert_close(padded, expected_output(batch, kv_cache), case.dtype)


NO_CACHE_CASES_CUDA = [AttnCase(dt, 2, g, d, (0, 0, 0), (200, 1, 67))
                       for dt in (BF16, FP32) for g in (1, 8) for d in (64, 128)]
NO_CACHE_CASES_INTERPRET = [AttnCase(FP32, 2, 2, 16, (0, 0), (13, 4))]


@pytest.mark.parametrize(("device", "case"), params(NO_CACHE_CASES_CUDA, NO_CACHE_CASES_INTERPRET))
def test_profile_run_without_cache(device: str, case: AttnCase) -> None:
    from engine_core.attention.triton_backend import TritonAttentionBackend

    batch = make_batch(case, device)
    out = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, None, batch.metadata,
                                           batch.scale)
    expected = TorchRefAttentionBackend().forward(batch.q.float(), batch.k.float(),
                                                  batch.v.float(), None, batch.metadata,
                                                  batch.scale)
    assert_close(out, expected, case.dtype)


# ---- decode ------------------------------------------------------------------------------

_LONG = (0, 16, 300, 2047, 4100)  # cached tokens before the decode token
DECODE_CASES_CUDA = (
    [AttnCase(dt, 2, g, d, _LONG, (1,) * 5, num_splits=s, pad_rows=2)
     for dt in (BF16, FP16, FP32) for g in (1, 4, 8) for d in (64, 128) for s in (None, 1, 7)]
    + [AttnCase(dt, 2, 4, 128, _LONG, (1,) * 5, cache_dtype=c, num_splits=s)
       for dt in (BF16, FP32) for c in (E4M3, E5M2) for s in (None, 5)]
    + [AttnCase(BF16, 4, 2, 16, (7, 33), (1, 1), num_splits=3),
       AttnCase(BF16, 2, 5, 96, (95, 1500), (1, 1), block_size=32, num_splits=4),
       AttnCase(BF16, 8, 8, 128, (16000,), (1,)),
       AttnCase(BF16, 8, 4, 128, tuple(range(0, 6000, 97)), (1,) * 62, block_size=32)]
)
DECODE_CASES_INTERPRET = [
    AttnCase(FP32, 2, 4, 16, (0, 5, 70), (1, 1, 1), num_splits=1, pad_rows=1, block_size=4),
    AttnCase(FP32, 1, 2, 32, (3, 150), (1, 1), num_splits=4, pad_rows=1, block_size=8),
    AttnCase(BF16, 2, 8, 16, (40,), (1,), num_splits=3, block_size=4),
    AttnCase(FP16, 1, 1, 16, (33, 8), (1, 1), cache_dtype=E4M3, num_splits=2, block_size=4),
    # 38 used splits and 2 empty ones: the merge walks three chunks of splits
    AttnCase(FP32, 1, 2, 16, (1199, 5), (1, 1), num_splits=40, block_size=16),
]


@pytest.mark.parametrize(("device", "case"), params(DECODE_CASES_CUDA, DECODE_CASES_INTERPRET))
def test_decode_matches_reference(device: str, case: AttnCase) -> None:
    from engine_core.kernels.paged_decode import paged_decode_attention

    batch = make_batch(case, device)
    kv_cache = cache_with_new_tokens(batch)
    meta = batch.metadata
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(batch.q, kv_cache[0], kv_cache[1], out, meta.block_tables,
                           meta.seq_lens, meta.query_start_loc, batch.scale, case.num_splits)
    # Padding rows (one token, seq_len 0) come out as zeros, never NaN.
    assert_close(out, expected_output(batch, kv_cache), case.dtype)


WORK_CASES_CUDA = (
    [AttnCase(dt, 2, g, d, _LONG, (1,) * 5, pad_rows=2)
     for dt in (BF16, FP32) for g in (1, 4) for d in (64, 128)]
    + [AttnCase(BF16, 8, 4, 128, (16000, 3, 700), (1, 1, 1)),
       AttnCase(BF16, 2, 4, 128, (0, 37, 300, 5000), (130, 1, 1, 1), cache_dtype=E4M3)]
)
WORK_CASES_INTERPRET = [
    AttnCase(FP32, 2, 4, 16, (0, 5, 700), (1, 1, 1), pad_rows=1, block_size=4),
    AttnCase(BF16, 1, 2, 16, (1199, 9, 40), (1, 7, 1), block_size=16),
]


@pytest.mark.parametrize("graph_grid", [False, True], ids=["exact", "graph-grid"])
@pytest.mark.parametrize(("device", "case"), params(WORK_CASES_CUDA, WORK_CASES_INTERPRET))
def test_decode_over_a_work_list(device: str, case: AttnCase, graph_grid: bool) -> None:
    """Mixed steps' decode: each decode row split by its own length (a pad row of seq_len 0
    gets zeros, rows of other lengths are untouched); over a graph's longer grid the
    surplus items exit."""
    from engine_core.attention.decode_work import decode_work, max_decode_items
    from engine_core.kernels.paged_decode import paged_decode_attention

    batch = make_batch(case, device)
    kv_cache = cache_with_new_tokens(batch)
    meta = batch.metadata
    target = 33
    work = decode_work(meta.query_start_loc_cpu, meta.seq_lens_cpu, target, batch.q.device)
    assert int(work.rows.view(-1, 2)[:, 1].max()) > 1  # some row is split
    if graph_grid:
        work = work._replace(count=max_decode_items(meta.num_seqs, target))
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(batch.q, kv_cache[0], kv_cache[1], out, meta.block_tables,
                           meta.seq_lens, meta.query_start_loc, batch.scale, work=work)
    starts = meta.query_start_loc_cpu
    decode_rows = [starts[i] for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1]
    others = sorted(set(range(meta.num_tokens)) - set(decode_rows))
    expected = expected_output(batch, kv_cache)
    assert_close(out[decode_rows], expected[decode_rows], case.dtype)
    assert torch.isnan(out[others]).all()


ROPE_DECODE_CASES_CUDA = (
    [AttnCase(dt, 2, g, d, _LONG, (1,) * 5, num_splits=s, pad_rows=2)
     for dt in (BF16, FP16, FP32) for g in (1, 4) for d in (64, 128) for s in (None, 1, 7)]
    + [AttnCase(dt, 2, 4, 128, _LONG, (1,) * 5, cache_dtype=c, num_splits=s)
       for dt in (BF16, FP32) for c in (E4M3, E5M2) for s in (None, 5)]
    + [AttnCase(BF16, 8, 4, 128, (1023,), (1,), block_size=16, num_splits=33),
       AttnCase(BF16, 2, 5, 96, (95, 1500), (1, 1), block_size=32, num_splits=4),
       AttnCase(BF16, 8, 4, 128, tuple(range(0, 6000, 97)), (1,) * 62, block_size=32)]
    # one sequence (8 warps with a 16-bit cache), its splits of several tiles
    + [AttnCase(dt, 8, 4, 128, (4100,), (1,), cache_dtype=c, block_size=16)
       for dt, c in ((BF16, None), (FP16, None), (BF16, E4M3))]
)


# Interpreted: the decode cases but the 40-split one; the merge's walk over chunks of splits
# does not depend on where q and the new K came from (test_decode_matches_reference runs
# it), and the interpreter takes ~7 s a run of it here.
ROPE_DECODE_CASES_INTERPRET = DECODE_CASES_INTERPRET[:-1]


@pytest.mark.parametrize(("device", "case"),
                         params(ROPE_DECODE_CASES_CUDA, ROPE_DECODE_CASES_INTERPRET))
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qknorm-rope"])
def test_decode_with_rope_equals_rope_then_write_then_decode(device: str, case: AttnCase,
                                                             norm: bool) -> None:
    """Decode attention handed the raw q/k/v (column views of one qkv output) with
    ``NewTokenRope``: the same output as ``apply_rope``, ``write_kv`` and decode attention
    over the written cache, and the same K/V in the cache (pad rows: zeros, no write)."""
    from engine_core.kernels.kv_write import write_kv
    from engine_core.kernels.paged_decode import NewTokenRope, paged_decode_attention
    from engine_core.kernels.rotary import apply_rope
    from engine_core.layers.rotary import RotaryEmbedding

    if device == "cpu" and is_fp8(case.storage):
        pytest.skip(_FP8_WRITE_SKIP)
    batch = make_batch(case, device)
    meta = batch.metadata
    t, hq, hkv, d = batch.q.shape[0], batch.q.shape[1], case.num_kv_heads, case.head_dim
    qkv = torch.cat([batch.q.flatten(1), batch.k.flatten(1) * 2, batch.v.flatten(1)], dim=1)
    q, k, v = (part.view(t, -1, d) for part in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    gen = torch.Generator().manual_seed(11)
    positions = torch.tensor(meta.seq_lens_cpu).clamp(min=1) - 1
    cos, sin = RotaryEmbedding(d, 10000.0).to(device).cos_sin(positions.to(device), case.dtype)
    weights = ((torch.rand(d, generator=gen) + 0.5).to(device, case.dtype),
               (torch.rand(d, generator=gen) + 0.5).to(device, case.dtype)) if norm else ()

    ref_cache = batch.kv_cache.clone()
    q_ref, k_ref = apply_rope(q, k, cos, sin, *weights)
    write_kv(k_ref, v, ref_cache, meta.slot_mapping)
    expected = torch.full_like(q_ref, float("nan"))
    paged_decode_attention(q_ref, ref_cache[0], ref_cache[1], expected, meta.block_tables,
                           meta.seq_lens, meta.query_start_loc, batch.scale, case.num_splits)

    cache = batch.kv_cache.clone()
    got = torch.full_like(q_ref, float("nan"))
    rope = NewTokenRope(k, v, cos, sin, meta.slot_mapping, *weights)
    paged_decode_attention(q, cache[0], cache[1], got, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, batch.scale, case.num_splits, rope=rope)
    assert_close(got, expected, case.dtype)
    assert (got[t - case.pad_rows:] == 0).all()
    if not norm:  # RoPE alone rounds exactly as apply_rope: the same bytes
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    else:  # the per-head mean may sum in another order: a value may move by one unit
        written = ~torch.isnan(ref_cache.float())
        assert torch.equal(written, ~torch.isnan(cache.float()))
        ulp = 2.0 ** -{BF16: 7, FP16: 10, FP32: 21, E4M3: 3, E5M2: 2}[case.storage]
        torch.testing.assert_close(cache.float()[written], ref_cache.float()[written],
                                   atol=ulp, rtol=ulp)


def test_split_choice_depends_on_shapes_only() -> None:
    from engine_core.kernels import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    from engine_core.kernels.paged_decode import choose_num_splits

    cpu = torch.device("cpu")  # counted as 8 SMs
    assert choose_num_splits(1, 8, 1, 16, cpu) == 1           # 16 tokens: never split
    assert choose_num_splits(1, 1, 24, 16, cpu) == 2          # 384 tokens: >= 256 a split
    assert choose_num_splits(1, 1, 4096, 16, cpu) == 16       # 2 programs per SM
    assert choose_num_splits(512, 8, 4096, 16, cpu) == 1      # the batch fills the GPU


def test_early_kv_only_for_one_sequence_cut_into_splits() -> None:
    """The first K/V tile before the PDL wait (and 8 warps with a 16-bit cache) only for
    batch-1 decode with RoPE in the kernel and several splits; batches keep the old launch."""
    from engine_core.kernels import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    from engine_core.kernels.paged_decode import early_kv_launch

    assert early_kv_launch(True, 1, 33, 2) == (True, 8)
    assert early_kv_launch(True, 1, 33, 1) == (True, 4)      # fp8 cache: 4 warps
    assert early_kv_launch(True, 8, 5, 2) == (False, 4)      # a batch
    assert early_kv_launch(True, 1, 1, 2) == (False, 4)      # one split walks the row
    assert early_kv_launch(False, 1, 33, 2) == (False, 4)    # mixed steps: no RoPE
    assert early_kv_launch(True, 8, 5, 2, early_kv=True) == (True, 4)
    assert early_kv_launch(False, 1, 33, 2, early_kv=True) == (False, 4)


# ---- the backend: write + attention, two steps, mixed batches ---------------------------

BACKEND_CASES_CUDA = [
    AttnCase(dt, 2, g, d, (0, 0, 0, 0), (1, 50, 300, 33), cache_dtype=c)
    for dt in (BF16, FP32) for g in (1, 4, 8) for d in (64, 128) for c in (None, E4M3)
]
BACKEND_CASES_INTERPRET = [AttnCase(FP32, 2, 2, 16, (0, 0, 0), (1, 9, 23), block_size=4),
                           AttnCase(BF16, 1, 4, 32, (0, 0), (6, 3), block_size=8)]


@pytest.mark.parametrize(("device", "case"), params(BACKEND_CASES_CUDA, BACKEND_CASES_INTERPRET))
def test_backend_two_steps_with_mixed_batch(device: str, case: AttnCase) -> None:
    """Step 1 prefills part of each prompt; step 2 mixes decodes, chunks and a pad row."""
    from engine_core.attention.triton_backend import TritonAttentionBackend

    if device == "cpu" and is_fp8(case.storage):
        pytest.skip(_FP8_WRITE_SKIP)
    gen = torch.Generator().manual_seed(3)
    final = [n + 12 for n in case.new]
    step1 = [max(n // 2, 1) for n in case.new]
    step2 = [1 if i % 2 == 0 else f - s for i, (f, s) in enumerate(zip(final, step1))]
    tables, num_blocks = random_tables(final, case.block_size, gen)
    hq, hkv, d = case.num_kv_heads * case.group, case.num_kv_heads, case.head_dim
    q_all, k_all, v_all = (torch.randn(sum(final), h, d, generator=gen).to(case.dtype)
                           for h in (hq, hkv, hkv))
    triton_cache = torch.full((2, num_blocks, case.block_size, hkv, d),
                              float("nan")).to(case.storage).to(device)
    ref_cache = triton_cache.clone()
    offsets = [sum(final[:i]) for i in range(len(final))]
    backend = TritonAttentionBackend()
    for pad_rows, done, todo in ((0, [0] * len(final), step1), (1, step1, step2)):
        meta = build_metadata(done, todo, tables, case.block_size, pad_rows, device)
        rows = torch.cat([torch.arange(o + c, o + c + n) for o, c, n in zip(offsets, done, todo)])
        q, k, v = (torch.cat([t[rows], torch.randn(pad_rows, *t.shape[1:], generator=gen)
                              .to(case.dtype)]).to(device) for t in (q_all, k_all, v_all))
        out = backend.forward(q, k, v, triton_cache, meta, d ** -0.5)
        write_reference(k, v, ref_cache, meta.slot_mapping)
        assert_close(out, reference_attention(q, meta, ref_cache, d ** -0.5), case.dtype)
    assert torch.equal(triton_cache.view(torch.uint8), ref_cache.view(torch.uint8))


PADDED_BACKEND_CASES_CUDA = [AttnCase(dt, 2, g, 128, (0, 40, 7, 100), (30, 1, 1, 17))
                             for dt in (BF16, FP32) for g in (1, 4)]
PADDED_BACKEND_CASES_INTERPRET = [AttnCase(FP32, 1, 2, 16, (0, 9, 5), (7, 1, 3), block_size=4)]


@pytest.mark.parametrize(("device", "case"),
                         params(PADDED_BACKEND_CASES_CUDA, PADDED_BACKEND_CASES_INTERPRET))
def test_backend_over_a_graph_padded_step(device: str, case: AttnCase) -> None:
    """A mixed step as `StepInputs` pads it for a graph (empty sequences, tokens of no
    sequence, the tile list's bound as the prefill grid) gives the real rows the unpadded
    step's attention and writes the same cache bytes."""
    import numpy as np

    from engine_core.attention.triton_backend import TritonAttentionBackend
    from engine_core.kernels.paged_decode import decode_work_target
    from engine_core.kernels.paged_prefill import query_tile_tokens
    from engine_core.worker.step_inputs import BatchLimits, HostBlockTable, StepInputs

    gen = torch.Generator().manual_seed(5)
    bs = case.block_size
    seq_lens = [c + n for c, n in zip(case.cached, case.new)]
    tables, num_blocks = random_tables(seq_lens, bs, gen)
    hq, hkv, d = case.num_kv_heads * case.group, case.num_kv_heads, case.head_dim
    table = HostBlockTable(len(seq_lens), tables.shape[1])
    rows = np.array([table.add(tables[i, :-(-n // bs)].tolist()) for i, n in enumerate(seq_lens)])
    num_tokens = sum(case.new)
    padded = num_tokens + 5
    limits = BatchLimits(len(seq_lens) + 2, padded, tables.shape[1] * bs, bs)
    tile = query_tile_tokens(hq, hkv, d, case.dtype)
    target = decode_work_target(hkv, torch.device(device))
    q, k, v = (torch.randn(padded, h, d, generator=gen).to(case.dtype).to(device)
               for h in (hq, hkv, hkv))
    start = torch.randn(2, num_blocks, bs, hkv, d, generator=gen).to(case.storage).to(device)
    outs, caches, metas = [], [], []
    for pad_to in (None, padded):
        inputs = StepInputs(limits, torch.device(device), tile, target)
        batch = inputs.prepare(table, rows, np.array(case.cached), np.array(case.new),
                               list(range(num_tokens)), np.arange(len(seq_lens)), pad_to=pad_to)
        n = batch.input_ids.shape[0]
        cache = start.clone()
        out = TritonAttentionBackend().forward(q[:n], k[:n], v[:n], cache, batch.attn_metadata,
                                               d ** -0.5)
        outs.append(out[:num_tokens])
        caches.append(cache)
        metas.append(batch.attn_metadata)
    assert metas[1].num_prefill_tiles > metas[0].num_prefill_tiles  # the graph's larger grids
    assert metas[1].decode_work.count > metas[0].decode_work.count > 0
    assert metas[1].query_start_loc.shape[0] > metas[0].query_start_loc.shape[0]
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    expected = reference_attention(q[:num_tokens], metas[0], caches[0], d ** -0.5)
    for out in outs:
        assert_close(out, expected, case.dtype)


# ---- RMSNorm and RoPE ---------------------------------------------------------------------


@dataclass(frozen=True)
class NormCase:
    dtype: torch.dtype
    rows: int
    hidden: int
    residual: bool

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}-{self.rows}x{self.hidden}-r{int(self.residual)}"


NORM_CASES_CUDA = [NormCase(dt, rows, hidden, res) for dt in (BF16, FP16, FP32)
                   for rows, hidden in ((1, 4096), (37, 896), (300, 128), (5, 8192))
                   for res in (False, True)]
NORM_CASES_INTERPRET = [NormCase(FP32, 5, 96, True), NormCase(BF16, 3, 64, False),
                        NormCase(BF16, 4, 48, True), NormCase(FP16, 2, 32, True)]


@pytest.mark.parametrize(("device", "case"), params(NORM_CASES_CUDA, NORM_CASES_INTERPRET))
def test_rms_norm_matches_layer(device: str, case: NormCase) -> None:
    from engine_core.kernels.rms_norm import rms_norm
    from engine_core.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(1)
    layer = RMSNorm(case.hidden, eps=1e-5).to(device=device, dtype=case.dtype)
    layer.weight.copy_(torch.rand(case.hidden, generator=gen) + 0.5)
    x = (torch.randn(case.rows, case.hidden, generator=gen) * 3).to(device, case.dtype)
    residual = torch.randn(case.rows, case.hidden, generator=gen).to(device, case.dtype)
    if case.residual:
        expected, expected_sum = layer.add_and_norm(x, residual)  # the layer's torch path
        out, summed = rms_norm(x, layer.weight, layer.eps, residual)
        assert summed is not None and torch.equal(summed, expected_sum)
    else:
        expected = layer(x)
        out, summed = rms_norm(x, layer.weight, layer.eps)
        assert summed is None
    # Same roundings; only the order of the mean's float32 sum differs (a last-bit flip).
    ulp = {FP32: 1e-6, FP16: 2 ** -10, BF16: 2 ** -7}[case.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=ulp, rtol=ulp)


@dataclass(frozen=True)
class RopeCase:
    dtype: torch.dtype
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: str

    def __str__(self) -> str:
        return (f"{str(self.dtype).removeprefix('torch.')}-q{self.num_q_heads}"
                f"k{self.num_kv_heads}-d{self.head_dim}-{self.scaling}")


_SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 2.0},
             "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
ROPE_CASES_CUDA = [RopeCase(dt, hq, hkv, d, s) for dt in (BF16, FP16, FP32)
                   for hq, hkv, d in ((32, 8, 128), (14, 2, 64), (4, 4, 16)) for s in _SCALINGS]
ROPE_CASES_INTERPRET = [RopeCase(FP32, 4, 2, 16, "llama3"), RopeCase(BF16, 3, 1, 32, "default"),
                        RopeCase(FP16, 2, 2, 12, "linear")]


@pytest.mark.parametrize(("device", "case"), params(ROPE_CASES_CUDA, ROPE_CASES_INTERPRET))
def test_rope_matches_reference_exactly(device: str, case: RopeCase) -> None:
    from engine_core.kernels.rotary import apply_rope
    from engine_core.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(case.head_dim, 10000.0, _SCALINGS[case.scaling]).to(device)
    positions = torch.cat([torch.arange(0, 7), torch.arange(40, 61), torch.tensor([5000])])
    cos, sin = rope.cos_sin(positions.to(device), case.dtype)
    t = positions.shape[0]
    q = torch.randn(t, case.num_q_heads, case.head_dim, generator=gen).to(device, case.dtype)
    k = torch.randn(t, case.num_kv_heads, case.head_dim, generator=gen).to(device, case.dtype)
    q_out, k_out = apply_rope(q, k, cos, sin)
    # Bit-exact: the kernel rounds where torch rounds.
    assert torch.equal(q_out, RotaryEmbedding.apply(q, cos, sin))
    assert torch.equal(k_out, RotaryEmbedding.apply(k, cos, sin))


@pytest.mark.parametrize(("device", "case"), params(ROPE_CASES_CUDA, ROPE_CASES_INTERPRET))
def test_rope_cos_sin_kernel_matches_torch(device: str, case: RopeCase) -> None:
    """``rope_cos_sin`` (one launch) against ``RotaryEmbedding.cos_sin``'s torch ops on the
    same positions: bit for bit on CUDA (both call libdevice's cosf/sinf); under the
    interpreter (numpy's cos) within one unit of the dtype."""
    from engine_core.kernels.rotary import rope_cos_sin
    from engine_core.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(4)
    rope = RotaryEmbedding(case.head_dim, 1000000.0, _SCALINGS[case.scaling]).to(device)
    positions = torch.cat([torch.arange(0, 40), torch.randint(0, 40960, (37,), generator=gen),
                           torch.tensor([40959, 131071])]).to(device)
    cos, sin = rope_cos_sin(positions, rope.inv_freq, case.dtype)
    ref_cos, ref_sin = rope.cos_sin(positions, case.dtype)
    assert cos.shape == ref_cos.shape and cos.dtype == case.dtype
    if device == "cuda":
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        via_module = RotaryEmbedding(case.head_dim, 1000000.0, _SCALINGS[case.scaling],
                                     use_triton=True).to(device)
        assert torch.equal(via_module.cos_sin(positions, case.dtype)[0], ref_cos)
    else:
        ulp = {FP32: 1e-6, FP16: 2 ** -10, BF16: 2 ** -7}[case.dtype]
        assert (cos.float() - ref_cos.float()).abs().max() <= ulp
        assert (sin.float() - ref_sin.float()).abs().max() <= ulp
    assert rope_cos_sin(positions[:0], rope.inv_freq, case.dtype)[0].shape == (0, 1, case.head_dim)


@dataclass(frozen=True)
class QkvCase:
    dtype: torch.dtype
    tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    norm: bool

    def __str__(self) -> str:
        return (f"{str(self.dtype).removeprefix('torch.')}-t{self.tokens}-q{self.num_q_heads}"
                f"k{self.num_kv_heads}-d{self.head_dim}-norm{int(self.norm)}")


QKV_CASES_CUDA = [QkvCase(dt, t, hq, hkv, d, norm) for dt in (BF16, FP16, FP32)
                  for t, hq, hkv, d in ((1, 32, 8, 128), (29, 16, 8, 128), (300, 14, 2, 64))
                  for norm in (False, True)]
QKV_CASES_INTERPRET = [QkvCase(FP32, 5, 4, 2, 16, True), QkvCase(BF16, 3, 3, 1, 32, True),
                       QkvCase(BF16, 2, 2, 2, 16, False)]


@pytest.mark.parametrize(("device", "case"), params(QKV_CASES_CUDA, QKV_CASES_INTERPRET))
def test_qk_norm_rope_on_fused_qkv_views(device: str, case: QkvCase) -> None:
    """q and k as column views of one qkv output (the fused projection), with Qwen3's
    per-head norm fused in: equal to the layers' torch path (RoPE alone: bit for bit)."""
    from engine_core.kernels.rotary import apply_rope
    from engine_core.layers.norm import RMSNorm
    from engine_core.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim
    qkv = (torch.randn(case.tokens, (hq + 2 * hkv) * d, generator=gen) * 2).to(device, case.dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(case.tokens, hq, d), k.view(case.tokens, hkv, d)
    assert case.tokens == 1 or not q.is_contiguous()  # one row: torch calls it contiguous
    rope = RotaryEmbedding(d, 10000.0).to(device)
    positions = torch.randint(0, 4000, (case.tokens,), generator=gen)
    cos, sin = rope.cos_sin(positions.to(device), case.dtype)
    q_norm = RMSNorm(d, eps=1e-6).to(device=device, dtype=case.dtype)
    k_norm = RMSNorm(d, eps=1e-6).to(device=device, dtype=case.dtype)
    q_norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
    k_norm.weight.copy_(torch.rand(d, generator=gen) + 0.5)
    if not case.norm:
        q_out, k_out = apply_rope(q, k, cos, sin)
        assert torch.equal(q_out, RotaryEmbedding.apply(q, cos, sin))
        assert torch.equal(k_out, RotaryEmbedding.apply(k, cos, sin))
        return
    q_out, k_out = apply_rope(q, k, cos, sin, q_norm.weight, k_norm.weight, q_norm.eps)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    # Same roundings as the layers; only the mean's float32 sum order differs, so a value
    # may land one unit of the dtype away, and RoPE adds two such values.
    ulp = {FP32: 2e-6, FP16: 2 ** -9, BF16: 2 ** -6}[case.dtype]
    for got, x, norm in ((q_out, q, q_norm), (k_out, k, k_norm)):
        expected = RotaryEmbedding.apply(norm(x), cos, sin)
        torch.testing.assert_close(got.float(), expected.float(), atol=ulp, rtol=ulp)


@dataclass(frozen=True)
class SiluCase:
    dtype: torch.dtype
    rows: int
    width: int

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}-{self.rows}x{self.width}"


SILU_CASES_CUDA = [SiluCase(dt, rows, width) for dt in (BF16, FP16)
                   for rows, width in ((1, 12288), (64, 3072), (333, 1000), (2, 17))]
SILU_CASES_INTERPRET = [SiluCase(BF16, 3, 40), SiluCase(FP16, 2, 1100)]


@pytest.mark.parametrize(("device", "case"), params(SILU_CASES_CUDA, SILU_CASES_INTERPRET))
def test_silu_and_mul_matches_torch(device: str, case: SiluCase) -> None:
    import torch.nn.functional as F

    from engine_core.kernels.silu_mul import silu_and_mul

    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(case.rows, 2 * case.width, generator=gen) * 4).to(device, case.dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = silu_and_mul(x)
    assert got.shape == expected.shape and got.dtype == case.dtype
    # Same roundings; the GPU's fast exp may move silu(g) by one unit at a rounding tie.
    ulp = {FP16: 2 ** -10, BF16: 2 ** -7}[case.dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=2 * ulp, rtol=2 * ulp)
    assert (got == expected).float().mean() > 0.99


@dataclass(frozen=True)
class GemvCase:
    dtype: torch.dtype
    rows: int
    n: int
    k: int
    bias: bool

    def __str__(self) -> str:
        return (f"{str(self.dtype).removeprefix('torch.')}-m{self.rows}-{self.n}x{self.k}"
                f"-b{int(self.bias)}")


GEMV_CASES_CUDA = [GemvCase(dt, m, n, k, b) for dt in (BF16, FP16) for m in (1, 3, 8, 16)
                   for n, k, b in ((4096, 1024, False), (6144, 1024, False), (1024, 3072, True),
                                   (1000, 1000, True), (24576, 4096, False))]
GEMV_CASES_INTERPRET = [GemvCase(BF16, 1, 40, 300, True), GemvCase(FP16, 5, 33, 64, False)]


def gemv_inputs(case: GemvCase, device: str, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Fresh x, W and bias for a GEMV case, and the float32 result they should give."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.rows, case.k, generator=gen).to(device, case.dtype)
    w = (torch.randn(case.n, case.k, generator=gen) / case.k ** 0.5).to(device, case.dtype)
    b = torch.randn(case.n, generator=gen).to(device, case.dtype) if case.bias else None
    expected = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    return x, w, b, expected


@pytest.mark.parametrize(("device", "case"), params(GEMV_CASES_CUDA, GEMV_CASES_INTERPRET))
def test_gemv_matches_linear(device: str, case: GemvCase) -> None:
    """The small-batch GEMV against float32 math on the same inputs, and through ``Linear``
    (which takes it only for small 16-bit CUDA inputs)."""
    from engine_core.kernels.gemv import gemv
    from engine_core.layers.linear import Linear

    x, w, b, expected = gemv_inputs(case, device, seed=5)
    got = gemv(x, w, b)
    assert got.dtype == case.dtype and got.shape == (case.rows, case.n)
    assert_close(got, expected, case.dtype)
    if device == "cuda":
        import torch.nn.functional as F

        from engine_core.layers.linear import GEMV_MAX_WEIGHT_ELEMENTS

        layer = Linear(case.k, case.n, bias=case.bias, gemv_max_rows=16).to(device, case.dtype)
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)
        # Small weights take the GEMV; large ones stay with cuBLAS.
        small = case.n * case.k <= GEMV_MAX_WEIGHT_ELEMENTS
        assert torch.equal(layer(x), got if small else F.linear(x, w, b))


@pytest.mark.parametrize(("device", "case"), params(GEMV_CASES_CUDA[:8], GEMV_CASES_INTERPRET))
def test_gemv_float32_out_is_the_rounded_result_upcast(device: str, case: GemvCase) -> None:
    """``out_dtype=float32`` (the LM head's logits) stores the result rounded to the model
    dtype, as ``gemv(...).float()`` would, without the cast kernel."""
    from engine_core.kernels.gemv import gemv

    x, w, b, _ = gemv_inputs(case, device, seed=9)
    got = gemv(x, w, b, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, gemv(x, w, b).float())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize(("vocab", "hidden"), [(151936, 1024), (151936, 4096), (32003, 896)])
def test_lm_head_takes_the_gemv_up_to_its_rows(rows: int, vocab: int, hidden: int) -> None:
    """A vocabulary-sized LM head (past ``Linear``'s GEMV size cap) goes through the GEMV up
    to ``gemv_max_rows`` rows and through cuBLAS beyond; float32 logits near float32 math."""
    import torch.nn.functional as F

    from engine_core.kernels.gemv import gemv
    from engine_core.layers.embedding import LMHead

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    case = GemvCase(BF16, rows, vocab, hidden, False)
    x, w, _, expected = gemv_inputs(case, "cuda", seed=rows + vocab + hidden)
    head = LMHead(vocab, hidden, gemv_max_rows=8).to("cuda", BF16)
    head.weight.copy_(w)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
    via = gemv(x, w) if rows <= 8 else F.linear(x, w)
    assert torch.equal(logits, via.float())
    assert_close(logits, expected, BF16)


@pytest.mark.parametrize(("device", "case"),
                         params([GemvCase(BF16, m, n, k, True)
                                 for m in (1, 7) for n, k in ((6144, 4096), (24576, 4096),
                                                              (1024, 3072), (4099, 1000),
                                                              (4096, 12288))],
                                [GemvCase(BF16, 2, 130, 24, True), GemvCase(FP16, 1, 70, 64, False)]))
def test_gemv_every_tiling_agrees(device: str, case: GemvCase) -> None:
    """Each tiling ``choose_tiling`` can pick computes the same projection, whichever the
    shape; and the choice follows the shape (wide, >= 4096 columns, deep, narrow)."""
    from engine_core.kernels.gemv import gemv
    from engine_core.kernels.gemv_tilings import (
        DEEP_TILING,
        MEDIUM_TILING,
        NARROW_TILING,
        TUNED_TILINGS,
        WIDE_TILING,
        choose_tiling,
    )

    x, w, b, expected = gemv_inputs(case, device, seed=6)
    tilings = {NARROW_TILING, MEDIUM_TILING, DEEP_TILING, WIDE_TILING, *TUNED_TILINGS.values()}
    if device == "cpu":  # the interpreter ignores warps and stages: one run a tile shape
        tilings = {(t.block_n, t.block_k): t for t in sorted(tilings)}.values()
    for tiling in tilings:
        assert_close(gemv(x, w, b, tiling=tiling), expected, case.dtype)
    assert choose_tiling(24576, 4096) == WIDE_TILING and choose_tiling(6144, 1024) == WIDE_TILING
    assert choose_tiling(6144, 4096) == MEDIUM_TILING and choose_tiling(4096, 4096) == MEDIUM_TILING
    assert choose_tiling(5120, 12800) == TUNED_TILINGS[(5120, 12800)]
    assert choose_tiling(4096, 12288) == DEEP_TILING and choose_tiling(5120, 25600) == DEEP_TILING
    assert choose_tiling(1024, 3072) == NARROW_TILING


@pytest.mark.parametrize(("device", "case"),
                         params([GemvCase(dt, m, n, k, b) for dt in (BF16, FP16) for m in (1, 5, 16)
                                 for n, k, b in ((24576, 4096, False), (6144, 1024, False),
                                                 (2 * 1000, 1000, True))],
                                [GemvCase(BF16, 1, 40, 300, True), GemvCase(FP16, 5, 66, 64, False)]))
def test_gemv_silu_mul_equals_projection_then_silu_mul(device: str, case: GemvCase) -> None:
    """SiLU * up in the GEMV's epilogue gives, bit for bit, what the plain GEMV followed by
    ``silu_and_mul`` gives (same tiles, same roundings), under every tiling."""
    from engine_core.kernels.gemv import gemv
    from engine_core.kernels.gemv_tilings import (
        DEEP_TILING,
        MEDIUM_TILING,
        NARROW_TILING,
        WIDE_TILING,
    )
    from engine_core.kernels.silu_mul import silu_and_mul

    x, w, b, expected = gemv_inputs(case, device, seed=7)
    for tiling in (None, NARROW_TILING, MEDIUM_TILING, DEEP_TILING, WIDE_TILING):
        fused = gemv(x, w, b, tiling=tiling, silu_mul=True)
        assert fused.shape == (case.rows, case.n // 2) and fused.dtype == case.dtype
        assert torch.equal(fused, silu_and_mul(gemv(x, w, b, tiling=tiling)))
    gate, up = expected.chunk(2, dim=-1)
    assert_close(fused, torch.nn.functional.silu(gate) * up, case.dtype)


@dataclass(frozen=True)
class MlpCase:
    """A SwiGLU MLP at decode: ``rows`` tokens, hidden ``h``, intermediate ``inter``."""

    dtype: torch.dtype
    rows: int
    h: int
    inter: int

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}-m{self.rows}-h{self.h}-i{self.inter}"


@pytest.mark.parametrize(("device", "case"),
                         params([MlpCase(dt, m, h, i) for dt in (BF16, FP16) for m in (1, 5, 16)
                                 for h, i in ((4096, 12288), (1024, 3072), (1000, 2999))],
                                [MlpCase(BF16, 1, 64, 96), MlpCase(FP16, 3, 40, 70)]))
def test_split_k_mlp_equals_gate_up_then_down(device: str, case: MlpCase) -> None:
    """The one-launch MLP adds to its float32 accumulator what gate/up (SiLU fused) then the
    down GEMV compute, for either layout of the down weight and every tiling: its rounded
    result is the two GEMVs' up to the order of the float32 sums, and it adds to what the
    accumulator held."""
    from engine_core.kernels.gemv import gemv
    from engine_core.kernels.split_k_mlp import DEFAULT_TILING, SplitKMlpTiling, split_k_mlp

    gen = torch.Generator().manual_seed(case.rows + case.h + case.inter)
    x = torch.randn(case.rows, case.h, generator=gen).to(device, case.dtype)
    gate_up = (torch.randn(2 * case.inter, case.h, generator=gen) / case.h ** 0.5).to(
        device, case.dtype)
    down = (torch.randn(case.h, case.inter, generator=gen) / case.inter ** 0.5).to(
        device, case.dtype)
    act = gemv(x, gate_up, silu_mul=True)
    two_gemvs = gemv(act, down)
    expected = act.float() @ down.float().T
    start = torch.randn(case.rows, case.h, generator=gen).to(device)
    small = device == "cpu"
    tilings = ([DEFAULT_TILING, SplitKMlpTiling(16, 32, 16, 1, 1)] if small else
               [DEFAULT_TILING, SplitKMlpTiling(16, 256, 256, 2, 4),
                SplitKMlpTiling(64, 128, 128, 8, 4)])
    for tiling in tilings:
        for transposed in (False, True):
            weight = down.t().contiguous() if transposed else down
            acc = torch.zeros(case.rows, case.h, dtype=torch.float32, device=device)
            got = split_k_mlp(x, gate_up, weight, acc, tiling, down_transposed=transposed)
            assert got is acc
            assert_close(got, expected, case.dtype)
            # Only the float32 sums' order differs: a unit in the last place, plus what
            # reordering float32 sums of these magnitudes can move.
            bound = (torch.finfo(case.dtype).eps * two_gemvs.float().abs()
                     + 1e-5 * (act.float().abs() @ down.float().abs().T))
            diff = (got.to(case.dtype).float() - two_gemvs.float()).abs()
            assert (diff <= bound).all(), (tiling, transposed, diff.max())
            acc = start.clone()
            split_k_mlp(x, gate_up, weight, acc, tiling, down_transposed=transposed)
            torch.testing.assert_close(acc, start + got, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("device", "case"),
                         params([MlpCase(dt, m, h, i) for dt in (BF16, FP16) for m in (1, 3, 8, 16)
                                 for h, i in ((4096, 12288), (1000, 2999))],
                                [MlpCase(BF16, 3, 40, 70), MlpCase(FP16, 1, 64, 96)]))
def test_split_k_gemv_t_equals_the_gemv(device: str, case: MlpCase) -> None:
    """The split-K GEMV over a transposed weight adds to its float32 accumulator what the
    GEMV over the plain weight computes (up to the float32 sums' order), at each tiling."""
    from engine_core.kernels.gemv import gemv
    from engine_core.kernels.split_k_mlp import GEMV_T_TILING, SplitKGemvTiling, split_k_gemv_t

    gen = torch.Generator().manual_seed(case.rows + case.h)
    x = torch.randn(case.rows, case.inter, generator=gen).to(device, case.dtype)
    down = (torch.randn(case.h, case.inter, generator=gen) / case.inter ** 0.5).to(
        device, case.dtype)
    reference = gemv(x, down)
    bound = (torch.finfo(case.dtype).eps * reference.float().abs()
             + 1e-5 * (x.float().abs() @ down.float().abs().T))
    tilings = ([GEMV_T_TILING, SplitKGemvTiling(16, 32, 16, 1, 1)] if device == "cpu" else
               [GEMV_T_TILING, SplitKGemvTiling(64, 2048, 64, 4, 4),
                SplitKGemvTiling(256, 512, 64, 8, 4)])
    start = torch.randn(case.rows, case.h, generator=gen).to(device)
    for tiling in tilings:
        acc = torch.zeros(case.rows, case.h, dtype=torch.float32, device=device)
        assert split_k_gemv_t(x, down.t().contiguous(), acc, tiling) is acc
        assert_close(acc, x.float() @ down.float().T, case.dtype)
        diff = (acc.to(case.dtype).float() - reference.float()).abs()
        assert (diff <= bound).all(), (tiling, diff.max())
        again = start.clone()
        split_k_gemv_t(x, down.t().contiguous(), again, tiling)
        torch.testing.assert_close(again, start + acc, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("device", "case"),
                         params([MlpCase(dt, m, 4096, 0) for dt in (BF16, FP16) for m in (1, 7)],
                                [MlpCase(BF16, 2, 100, 0)]))
def test_rms_norm_rounds_a_float32_accumulator_and_clears(device: str, case: MlpCase) -> None:
    """A float32 split-K accumulator as the norm's input gives, bit for bit, what its value
    rounded to the residual's dtype gives; ``clear`` zeroes the buffer it is given, which
    may not be the input (the zero stores could overtake the loads)."""
    from engine_core.kernels.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(case.rows)
    acc = (torch.randn(case.rows, case.h, generator=gen) * 3).to(device)
    residual = torch.randn(case.rows, case.h, generator=gen).to(device, case.dtype)
    weight = (torch.rand(case.h, generator=gen) + 0.5).to(device, case.dtype)
    out_ref, res_ref = rms_norm(acc.to(case.dtype), weight, 1e-6, residual)
    other = torch.ones(case.rows, case.h, device=device)
    out, res = rms_norm(acc, weight, 1e-6, residual, clear=other)
    assert out.dtype == case.dtype and res.dtype == case.dtype
    assert torch.equal(out, out_ref) and torch.equal(res, res_ref)
    assert not other.any()
    with pytest.raises(AssertionError, match="alias"):
        rms_norm(acc, weight, 1e-6, residual, clear=acc)


# ---- CUDA only: capture and replay ----------------------------------------------------------


@dataclass(frozen=True)
class BlockCopyCase:
    dtype: torch.dtype
    layers: int
    cache_blocks: int
    block_shape: tuple[int, int, int]  # block_size, kv heads, head dim
    request_blocks: int

    def __str__(self) -> str:
        shape = "x".join(map(str, self.block_shape))
        return (f"{str(self.dtype).removeprefix('torch.')}-L{self.layers}-{shape}"
                f"-{self.request_blocks}of{self.cache_blocks}")


BLOCK_COPY_CASES_CUDA = [BlockCopyCase(dt, layers, nb, shape, req)
                         for dt in (BF16, FP32, E4M3)
                         for layers, nb, shape, req in ((36, 300, (16, 8, 128), 1),
                                                        (36, 300, (16, 8, 128), 129),
                                                        (3, 40, (3, 1, 5), 17),
                                                        (2, 70, (32, 4, 64), 70))]
BLOCK_COPY_CASES_INTERPRET = [BlockCopyCase(BF16, 3, 20, (4, 2, 8), 5),
                              BlockCopyCase(E5M2, 2, 9, (3, 1, 5), 4),
                              BlockCopyCase(FP32, 2, 6, (2, 1, 3), 6)]


@pytest.mark.parametrize(("device", "case"),
                         params(BLOCK_COPY_CASES_CUDA, BLOCK_COPY_CASES_INTERPRET))
def test_copy_blocks_gathers_and_scatters_bit_exact(device: str, case: BlockCopyCase) -> None:
    """The connector's block copy: gather equals indexing, scatter writes exactly the listed
    blocks, for odd chunk sizes (2-byte words) and random bit patterns (NaNs included)."""
    from engine_core.kernels.kv_blocks import copy_blocks

    gen = torch.Generator().manual_seed(hash(str(case)) % 2**31)
    shape = (case.layers, 2, case.cache_blocks, *case.block_shape)
    element = torch.empty((), dtype=case.dtype).element_size()
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[element]

    def random_bits(*dims: int) -> torch.Tensor:
        raw = torch.randint(0, 256, (*dims[:-1], dims[-1] * element), generator=gen,
                            dtype=torch.uint8)
        return raw.view(case.dtype).to(device)

    cache = random_bits(*shape)
    ids = torch.randperm(case.cache_blocks, generator=gen)[:case.request_blocks]
    out = torch.empty((case.layers, 2, case.request_blocks, *case.block_shape),
                      dtype=case.dtype, device=device)
    copy_blocks(cache, out, ids.to(device), None)
    assert torch.equal(out.view(word).cpu(), cache.view(word).cpu()[:, :, ids])
    before = cache.view(word).cpu().clone()
    payload = random_bits(case.layers, 2, case.request_blocks, *case.block_shape)
    copy_blocks(payload, cache, None, ids.to(device))
    expected = before.clone()
    expected[:, :, ids] = payload.view(word).cpu()
    assert torch.equal(cache.view(word).cpu(), expected)


@pytest.mark.parametrize(("device", "case"),
                         params(BLOCK_COPY_CASES_CUDA, BLOCK_COPY_CASES_INTERPRET))
def test_copy_blocks_between_cache_and_pinned_host_slots(device: str, case: BlockCopyCase) -> None:
    """KV offload's copies: cache blocks -> host slots and back, both sides indexed, the host
    side pinned memory the kernel reads and writes in place; only the listed slots and blocks
    change, bit for bit."""
    from engine_core.kernels.kv_blocks import copy_blocks

    gen = torch.Generator().manual_seed(hash(str(case)) % 2**31 + 1)
    element = torch.empty((), dtype=case.dtype).element_size()
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[element]

    def random_bits(*dims: int) -> torch.Tensor:
        raw = torch.randint(0, 256, (*dims[:-1], dims[-1] * element), generator=gen,
                            dtype=torch.uint8)
        return raw.view(case.dtype)

    slots = case.cache_blocks + 3
    cache = random_bits(case.layers, 2, case.cache_blocks, *case.block_shape).to(device)
    host = random_bits(case.layers, 2, slots, *case.block_shape)
    if device == "cuda":
        host = host.pin_memory()
    blocks = torch.randperm(case.cache_blocks, generator=gen)[:case.request_blocks]
    slot_ids = torch.randperm(slots, generator=gen)[:case.request_blocks]
    host_before, cache_before = host.view(word).clone(), cache.view(word).cpu().clone()
    copy_blocks(cache, host, blocks.to(device), slot_ids.to(device))  # download
    if device == "cuda":
        torch.cuda.synchronize()
    expected_host = host_before.clone()
    expected_host[:, :, slot_ids] = cache_before[:, :, blocks]
    assert torch.equal(host.view(word), expected_host)
    back = torch.randperm(case.cache_blocks, generator=gen)[:case.request_blocks]
    copy_blocks(host, cache, slot_ids.to(device), back.to(device))  # upload elsewhere
    expected_cache = cache_before.clone()
    expected_cache[:, :, back] = expected_host[:, :, slot_ids]
    assert torch.equal(cache.view(word).cpu(), expected_cache)


@pytest.mark.gpu
def test_decode_replays_in_cuda_graph() -> None:
    """Write + decode captured once, replayed on new lengths, tables and values in place.

    As the engine captures a general step: both work lists live in static buffers at their
    bound (a graph cannot copy host lists in), refilled on the host before each replay.
    """
    import numpy as np

    from engine_core.attention.decode_work import DecodeWork, fill_decode_work, max_decode_items
    from engine_core.attention.prefill_tiles import fill_prefill_tiles, max_prefill_tiles
    from engine_core.attention.triton_backend import TritonAttentionBackend
    from engine_core.kernels.paged_decode import decode_work_target
    from engine_core.kernels.paged_prefill import query_tile_tokens

    case = AttnCase(BF16, 2, 4, 128, (100, 5000, 0, 17), (1, 1, 1, 1), pad_rows=2)
    batch = make_batch(case, "cuda")
    backend = TritonAttentionBackend()
    meta = batch.metadata
    q, k, v, kv_cache = batch.q.clone(), batch.k.clone(), batch.v.clone(), batch.kv_cache
    tile_tokens = query_tile_tokens(q.shape[1], k.shape[1], q.shape[2], q.dtype)
    target = decode_work_target(k.shape[1], q.device)
    num_seqs = meta.num_seqs
    max_tiles = max_prefill_tiles(meta.num_tokens, num_seqs, tile_tokens)
    tiles_host = np.empty(2 * max_tiles, dtype=np.int32)
    items_host = np.empty(3 * max_decode_items(num_seqs, target), dtype=np.int32)
    rows_host = np.empty(2 * num_seqs, dtype=np.int32)
    tiles = torch.empty(tiles_host.shape[0], dtype=torch.int32, device="cuda")
    items = torch.empty(items_host.shape[0], dtype=torch.int32, device="cuda")
    rows = torch.empty(rows_host.shape[0], dtype=torch.int32, device="cuda")

    def fill_lists(starts: list[int], seq_lens: list[int]) -> None:
        fill_prefill_tiles(np.asarray(starts, dtype=np.int64), tile_tokens, tiles_host)
        fill_decode_work(np.asarray(starts, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64),
                         target, items_host, rows_host)
        for static, host in ((tiles, tiles_host), (items, items_host), (rows, rows_host)):
            static.copy_(torch.from_numpy(host))

    fill_lists(meta.query_start_loc_cpu, meta.seq_lens_cpu)
    meta.prefill_tiles, meta.num_prefill_tiles, meta.prefill_tile_tokens = tiles, max_tiles, tile_tokens
    meta.decode_work = DecodeWork(items, items_host.shape[0] // 3, rows)
    backend.forward(q, k, v, kv_cache.clone(), meta, batch.scale)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kv_cache, meta, batch.scale)
    for seed, cached in ((5, (2500, 7, 64, 1)), (6, (31, 1, 4000, 250))):
        fresh = make_batch(AttnCase(BF16, 2, 4, 128, cached, (1, 1, 1, 1), pad_rows=2),
                           "cuda", seed=seed)
        width = fresh.metadata.block_tables.shape[1]
        assert width <= meta.block_tables.shape[1] and fresh.kv_cache.shape[1] <= kv_cache.shape[1]
        for static, new in ((q, fresh.q), (k, fresh.k), (v, fresh.v),
                            (meta.slot_mapping, fresh.metadata.slot_mapping),
                            (meta.seq_lens, fresh.metadata.seq_lens)):
            static.copy_(new)
        fill_lists(fresh.metadata.query_start_loc_cpu, fresh.metadata.seq_lens_cpu)
        meta.block_tables.zero_()
        meta.block_tables[:, :width] = fresh.metadata.block_tables
        kv_cache.fill_(float("nan"))
        kv_cache[:, :fresh.kv_cache.shape[1]] = fresh.kv_cache
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, expected_output(fresh, cache_with_new_tokens(fresh)), BF16)


@pytest.mark.parametrize(("device", "shape"),
                         params([(1, 151936), (3, 151936), (64, 32003), (300, 1000), (2, 4096),
                                 (1, 1)],
                                [(1, 9000), (3, 4097), (2, 5)]))
def test_row_argmax_matches_torch(device: str, shape: tuple[int, int]) -> None:
    """The first index of each row's maximum, as ``torch.argmax``: random rows, a maximum
    repeated (the first wins), a row of -inf only, a row with NaN (the maximum), bf16."""
    from engine_core.kernels.argmax import row_argmax

    rows, vocab = shape
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen)
    if vocab > 1:
        top = x[0].max() + 1.0
        x[0, vocab - 1] = top
        x[0, vocab // 2] = top  # a tie: the first one is the answer
    if rows > 1:
        x[1] = -float("inf")
    if rows > 2:
        x[2, vocab // 3] = float("nan")
    x = x.to(device)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    half = x.to(BF16)  # many ties
    assert torch.equal(row_argmax(half), half.argmax(dim=-1))
    assert torch.equal(row_argmax(x[:, : max(1, vocab // 2)]), x[:, : max(1, vocab // 2)].argmax(-1))
    assert torch.equal(row_argmax(x.t().contiguous().t()), x.argmax(dim=-1))  # column-major


@pytest.mark.parametrize(("device", "shape"),
                         params([(1, 151936), (16, 151936), (64, 151936), (7, 32003), (3, 31),
                                 (5, 1000), (2, 32), (64, 128256)],
                                [(3, 1100), (2, 32), (4, 70)]))
def test_bitmask_apply_matches_torch(device: str, shape: tuple[int, int]) -> None:
    """The Triton apply sets exactly the tokens the packed mask forbids to -inf, in place,
    as the torch path does: random masks (all-allowed and none-allowed rows among them),
    vocabularies that are not multiples of 32, a mask wider than the vocabulary, bf16."""
    from engine_core.grammar.bitmask import num_words
    from engine_core.kernels.bitmask import apply_bitmask_inplace

    rows, vocab = shape
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31, (rows, num_words(vocab) + 1), dtype=torch.int64,
                            generator=gen).to(torch.int32)
    bitmask[0] = -1  # every token allowed
    if rows > 1:
        bitmask[1] = 0  # none allowed
    shifts = torch.arange(32, dtype=torch.int32)
    forbidden = (((bitmask[:, :, None] >> shifts) & 1) == 0).reshape(rows, -1)[:, :vocab]
    expected = logits.masked_fill(forbidden, float("-inf"))
    for dtype in (FP32, BF16):
        out = logits.to(dtype).to(device)
        apply_bitmask_inplace(out, bitmask.to(device))
        assert torch.equal(out.cpu(), expected.to(dtype))
    # A batch's rows as a strided view of a wider buffer (the sampler's logits rows).
    wide = torch.zeros(rows, vocab + 64).to(device)
    apply_bitmask_inplace(wide[:, :vocab], bitmask.to(device))
    assert torch.equal(torch.isinf(wide[:, :vocab]).cpu(), forbidden)
    assert not torch.isinf(wide[:, vocab:]).any()
