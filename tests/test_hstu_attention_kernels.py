"""HSTU's jagged attention kernels (forward, backward dq/drab per query tile, dk/dv per key tile) against the
NumPy reference, in the simulator (tiny problems: it runs a Python thread per CUDA thread) or on a GPU."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numbactr.kernels import hstu_attention as ha
from tests.kernel_util import dev, host
from tests.test_hstu_attention import (
    CASES,
    assert_matches_reference,
    case_problem,
    device_kwargs,
    problems,
    reference,
)

TILES = [(2, 2), (2, 3), (3, 2), (4, 4)]


def run_kernels(pr, tile, threads):
    q, k, v, dout, cu, rab = (dev(pr[n]) if pr[n] is not None else None for n in ("q", "k", "v", "dout", "cu", "rab"))
    ctx, tgt = dev(pr["dev"]["num_contexts"]), dev(pr["dev"]["num_targets"])
    kw = dict(device_kwargs(pr), rab=rab, tile=tile, threads=threads)
    out = dev(np.full(pr["v"].shape, np.nan, np.float32))
    ha.hstu_attn_forward(q, k, v, cu, ctx, tgt, out, pr["max_seqlen"], **kw)
    dq, dk, dv = (dev(np.full(pr[n].shape, np.nan, np.float32)) for n in ("q", "k", "v"))
    drab = None if rab is None else dev(np.zeros(pr["rab"].shape, np.float32))  # added to: zeroed
    ha.hstu_attn_backward(q, k, v, dout, cu, ctx, tgt, dq, dk, dv, pr["max_seqlen"], drab=drab, **kw)
    return tuple(None if a is None else host(a) for a in (out, dq, dk, dv, drab))


@settings(max_examples=12)
@given(
    pr=problems(max_seqs=3, max_len=6, max_heads=2, max_dim=4),
    tile=st.sampled_from(TILES),
    threads=st.sampled_from([4, 8]),
)
def test_kernels_match_reference(pr, tile, threads):
    assert_matches_reference(run_kernels(pr, tile, threads), reference(pr))


@pytest.mark.parametrize("lengths, kw", CASES[1:4])
def test_kernels_match_reference_with_contexts_and_targets(lengths, kw):
    pr = case_problem(lengths, kw, rab_heads=1)
    assert_matches_reference(run_kernels(pr, (2, 3), 8), reference(pr))


def test_tiles_fit_shared_memory():
    for d in (1, 32, 64, 128, 256):
        t = ha.tile_for(d, d)
        assert 4 * (t * 6 * d + 2 * t * t) <= ha.SHARED_BYTES
    assert (ha.tile_for(64, 64), ha.tile_for(128, 128), ha.tile_for(256, 256)) == (16, 8, 4)
    with pytest.raises(ValueError, match="too large"):
        ha.tile_for(1024, 1024)


def test_buffer_shapes_are_checked():
    pr = case_problem([3, 2], dict(window=(-1, 0)), rab_heads=None)
    z = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="out must be"):
        ha.hstu_attn_forward(pr["q"], pr["k"], pr["v"], pr["cu"], z, z, np.zeros((5, 2, 9), np.float32), 4)
    with pytest.raises(ValueError, match="num_contexts, num_targets must be"):
        ha.hstu_attn_forward(pr["q"], pr["k"], pr["v"], pr["cu"], z[:1], z, np.zeros_like(pr["v"]), 4)
    with pytest.raises(ValueError, match="drab needs rab"):
        g = [np.zeros_like(pr[n]) for n in ("q", "k", "v")]
        ha.hstu_attn_backward(
            pr["q"], pr["k"], pr["v"], pr["dout"], pr["cu"], z, z, *g, 4, drab=np.zeros((2, 1, 4, 4), np.float32)
        )


@pytest.mark.gpu
@settings(max_examples=50)
@given(pr=problems(max_seqs=8, max_len=70, max_heads=4, max_dim=64))
def test_kernels_match_reference_on_gpu(pr):
    assert_matches_reference(run_kernels(pr, None, None), reference(pr))
