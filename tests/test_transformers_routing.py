"""The routing's crossing to the host (strata_stream.transformers.engine): the model's ids and
mixture weights arrive as they are (on CUDA, copied raw into pinned staging) and the host widens
them into the binding's int32 and float32 tables. The widening must give the values torch's own
casts give, bit for bit, for every dtype a router hands over, and fresh arrays the binding may
keep while the staging is written again. The CUDA copy itself is held by
tests/cuda/test_transformers_cuda.py (bitwise against plain transformers and across configs)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from strata_stream.transformers.engine import _host_tables  # noqa: E402


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("idtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("strided", [False, True])
def test_host_widening_is_torch_cast_bit_for_bit(
    wdtype: torch.dtype, idtype: torch.dtype, strided: bool
) -> None:
    gen = torch.Generator().manual_seed(7)
    rows, k = 5, 8
    ids = torch.randint(0, 128, (rows, 2 * k), generator=gen, dtype=torch.int64).to(idtype)
    weights = torch.randn(rows, 2 * k, generator=gen).to(wdtype)
    weights[0, 0] = float("inf")  # specials widen as torch widens them too
    weights[0, 1] = -0.0
    weights[1, 0] = torch.finfo(wdtype).tiny / 2  # a subnormal
    if strided:  # a router's [T, k] view of a wider tensor
        ids, weights = ids[:, ::2], weights[:, ::2]
    else:
        ids, weights = ids[:, :k].contiguous(), weights[:, :k].contiguous()
    pred = ids.flip(0)
    got_ids, got_w, got_p1, got_p2 = _host_tables([ids, weights, pred, None])
    want_w = weights.to(torch.float32).numpy()
    assert got_w.dtype == np.float32 and got_w.flags.c_contiguous
    assert np.array_equal(got_w.view(np.uint32), want_w.view(np.uint32))
    assert got_ids.dtype == np.int32 and got_ids.flags.c_contiguous
    assert np.array_equal(got_ids, ids.to(torch.int32).numpy())
    assert got_p1 is not None and np.array_equal(got_p1, pred.to(torch.int32).numpy())
    assert got_p2 is None
    w_host = weights.view(torch.int16) if wdtype == torch.bfloat16 else weights
    for arr in (got_ids, got_w, got_p1):  # the binding's own: the staging may change after
        assert not np.shares_memory(arr, ids.numpy())
        assert not np.shares_memory(arr, w_host.numpy())
