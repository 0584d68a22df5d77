"""The staged GEMV (batch-1 o projection, weights copied into shared memory before the PDL
wait) against a float32 reference and the plain GEMV, on the GPU: Gluon kernels do not run
under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "staged"), [
    (4096, 4096, 11), (4096, 4096, 12), (4096, 4096, 4), (1000, 2048, 8), (33, 256, 1),
    (2048, 1024, 12), (24, 4096, 11)])
def test_staged_gemv_matches_reference(n: int, k: int, staged: int, dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from benchmarks.staged_gemv import staged_gemv
    from engine_core.kernels.gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k + staged)
    x = torch.randn(1, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype)
    got = staged_gemv(x, w, staged_chunks=staged)
    ref = (x.float() @ w.float().T).to(dtype)
    torch.testing.assert_close(got, ref, rtol=1.6e-2, atol=1e-2)
    # Same rounding as the plain GEMV up to the float32 sum's order: one unit at most.
    plain = gemv(x, w)
    assert (got.float() - plain.float()).abs().max() <= 2 * plain.float().abs().max() * 2 ** -7


def test_staged_gemv_in_a_graph_after_a_writer() -> None:
    """Captured behind a kernel that writes ``x`` (PDL chain): the result uses the new x."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from benchmarks.staged_gemv import staged_gemv
    from engine_core.kernels.gemv import gemv

    torch.manual_seed(0)
    a = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    w2 = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    staged_gemv(gemv(a, w1), w2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = staged_gemv(gemv(a, w1), w2)
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    ref = (gemv(a, w1).float() @ w2.float().T)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
