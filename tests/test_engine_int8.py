"""INT8 weights (Precision.INT8, FBGEMM's fused 8-bit rowwise rows: kernels/fused8bit.py), forward only: on
each impl the pooled output equals an FP32 engine holding the dequantized rows; the quantizer equals FBGEMM's
own op where fbgemm-gpu is installed; what INT8 cannot do fails with a clear error."""

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.embedding.engine import Layout, OptimizerSpec, Optim, Pooling, Precision, TableBatchedEmbedding, TableSpec
from numbactr.kernels import fused8bit as Q8

TABLES, FMAP = [(7, 4), (5, 8), (9, 4)], [0, 1, 2, 0]  # two features read table 0


def batch(rng, n_features, b, hot, rows_of_bag):
    """(indices, offsets, per-sample weights) of one random batch (with empty bags); rows_of_bag(j): the
    rows of bag j's table."""
    lens = rng.integers(0, hot + 1, n_features * b)
    idx = np.concatenate(
        [rng.integers(0, rows_of_bag(j), lens[j]) for j in range(n_features * b)] + [np.zeros(0, np.int64)]
    ).astype(np.int64)
    return (
        idx,
        np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        rng.standard_normal(idx.size).astype(np.float32),
    )


def engines(impl, pooling, layout, fmap=FMAP, tables=TABLES):
    """(INT8 engine, FP32 engine with the same values) over random rows."""
    rng = np.random.default_rng(5)
    kw = dict(pooling=pooling, layout=layout, optimizer=OptimizerSpec(Optim.EXACT_SGD), impl=impl)
    q = TableBatchedEmbedding(tables, fmap, weights_precision=Precision.INT8, **kw)
    f = TableBatchedEmbedding(tables, fmap, **kw)
    for t, (rows, dim) in enumerate(tables):
        fused = Q8.quantize_rows_ref(rng.standard_normal((rows, dim)).astype(np.float32))
        q.split_weights()[t][...] = device.xp().asarray(fused)
        f.split_weights()[t][...] = device.xp().asarray(Q8.dequantize_rows(fused, dim))
    return q, f


def impl_device(impl, on_device):
    on_device("sim" if impl == "kernels" else "cpu")


@pytest.mark.parametrize("impl", ["ref", "cpu", "kernels"])
@pytest.mark.parametrize(
    "pooling,layout,psw",
    [
        (Pooling.SUM, Layout.FEATURE_MAJOR, False),
        (Pooling.SUM, Layout.FEATURE_MAJOR, True),
        (Pooling.MEAN, Layout.SAMPLE_MAJOR, False),
        (Pooling.NONE, Layout.FEATURE_MAJOR, True),
    ],
)
def test_int8_forward_equals_fp32_of_the_dequantized_rows(impl, pooling, layout, psw, on_device):
    impl_device(impl, on_device)
    tables, fmap = (TABLES, FMAP) if pooling != Pooling.NONE else ([(7, 4), (9, 4)], [0, 1, 0])
    q, f = engines(impl, pooling, layout, fmap, tables)
    rng = np.random.default_rng(int(pooling) * 10 + int(layout) + psw)
    F, B = len(fmap), 3
    # bag j reads feature j // B (feature-major) or j % F (sample-major: bag j = b * F + f)
    feature_of = (lambda j: j // B) if layout == Layout.FEATURE_MAJOR else (lambda j: j % F)
    idx, offs, w = batch(rng, F, B, 3, lambda j: tables[fmap[feature_of(j)]][0])
    xp = device.xp()
    args = (xp.asarray(idx), xp.asarray(offs), xp.asarray(w) if psw else None)
    out_q, _ = q.forward(*args)
    out_f, _ = f.forward(*args)
    np.testing.assert_allclose(device.to_host(out_q), device.to_host(out_f), rtol=1e-6, atol=1e-6)
    assert device.to_host(out_q).any()


@pytest.mark.parametrize("impl", ["ref", "cpu"])
def test_int8_bad_indices_are_treated_as_fp32s(impl, on_device):
    """An out-of-range index under bounds check IGNORE (FBGEMM's rule: it reads row 0) and a bag of it
    read in INT8 what they read in FP32."""
    from numbactr.embedding.engine import BoundsCheck

    impl_device(impl, on_device)
    vals = np.arange(12, dtype=np.float32).reshape(3, 4)
    outs = []
    for p in (Precision.INT8, Precision.FP32):
        e = TableBatchedEmbedding([(3, 4)], [0], weights_precision=p, bounds_check=BoundsCheck.IGNORE, impl=impl)
        e.split_weights()[0][...] = Q8.quantize_rows_ref(vals) if p == Precision.INT8 else vals
        outs.append(e.forward(np.array([2, 9, 0]), np.array([0, 2, 3]))[0])
    np.testing.assert_allclose(outs[0], outs[1], atol=0.03)  # within a quantization step
    np.testing.assert_allclose(outs[1], [[8, 10, 12, 14], [0, 1, 2, 3]])


def test_int8_layout_init_and_errors(on_device):
    on_device("cpu")
    e = TableBatchedEmbedding([(5, 4), (3, 12)], weights_precision=Precision.INT8)
    assert e.weights.dtype == np.uint8 and e.weights.size == 5 * 12 + 3 * 20
    assert [w.shape for w in e.split_weights()] == [(5, 12), (3, 20)]
    assert not e.weights.any()  # FBGEMM's INT8 tables start at zero
    e.init_uniform(-0.5, 0.5, seed=3)
    f = TableBatchedEmbedding([(5, 4), (3, 12)])
    f.init_uniform(-0.5, 0.5, seed=3)
    for wq, wf in zip(e.split_weights(), f.split_weights()):
        np.testing.assert_array_equal(wq, Q8.quantize_rows_ref(wf))  # each row quantized
    out, ctx = e.forward(np.array([1, 2]), np.array([0, 1, 2]))
    with pytest.raises(NotImplementedError, match="forward only"):
        e.backward(ctx, np.ones_like(out))
    with pytest.raises(ValueError, match="multiple of 4"):
        TableBatchedEmbedding([(5, 6)], weights_precision=Precision.INT8)
    with pytest.raises(NotImplementedError, match="keyed"):
        TableBatchedEmbedding([TableSpec(5, 4, keyed=True)], weights_precision=Precision.INT8)
    with pytest.raises(ValueError, match="output_dtype INT8"):
        TableBatchedEmbedding([(5, 4)], output_dtype=Precision.INT8)


def test_quantizer_is_fbgemms():
    """quantize_rows_ref equals torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized byte for byte, and
    dequantize_rows its inverse within float32 rounding (a constant row included)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fbgemm_gpu")
    rng = np.random.default_rng(1)
    for shape in [(40, 4), (9, 16), (3, 64)]:
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        x[0] = 1.25
        theirs = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(Q8.quantize_rows_ref(x), theirs)
        back = torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(torch.from_numpy(theirs)).numpy()
        np.testing.assert_allclose(Q8.dequantize_rows(theirs, shape[1]), back, rtol=1e-6, atol=1e-6)


def test_quantizer_bounds_the_error_by_half_a_step():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((50, 8)) * rng.uniform(0.01, 10, (50, 1))).astype(np.float32)
    fused = Q8.quantize_rows_ref(x)
    scale = fused[:, 8:12].copy().view(np.float32)
    np.testing.assert_array_equal(fused[:, 12:16].copy().view(np.float32)[:, 0], x.min(1))
    assert (np.abs(Q8.dequantize_rows(fused, 8) - x) <= scale * 0.5 + 1e-6).all()


@pytest.mark.parametrize("impl", ["ref", "cpu", "kernels"])
def test_row_codecs_per_table_read_like_fp32_rows(impl, on_device):
    """The inference TBE's tables (kernels/nbit_rows.py): one row type per table, rows aligned to 16 bytes and
    tables to 128; the pooled output equals an FP32 engine holding the decoded rows."""
    from numbactr.kernels import nbit_rows as NB

    impl_device(impl, on_device)
    tables, fmap = [(7, 8), (5, 16), (9, 8), (4, 4)], [0, 1, 2, 3, 0]
    types = ["int4", "int8", "int2", "fp16"]
    codecs = [NB.nbit_codec(d, ty, alignment=16) for (_, d), ty in zip(tables, types)]
    q = TableBatchedEmbedding(
        tables,
        fmap,
        weights_precision=Precision.INT8,
        row_codecs=codecs,
        table_align=128,
        optimizer=OptimizerSpec(Optim.NONE),
        impl=impl,
    )
    f = TableBatchedEmbedding(tables, fmap, optimizer=OptimizerSpec(Optim.NONE), impl=impl)
    assert all(int(o) % 128 == 0 for o in q.elem_offsets)
    rng = np.random.default_rng(6)
    xp = device.xp()
    for t, ((rows, dim), ty) in enumerate(zip(tables, types)):
        enc = NB.encode_rows_ref(rng.standard_normal((rows, dim)).astype(np.float32), ty, alignment=16)
        q.split_weights()[t][...] = xp.asarray(enc)
        f.split_weights()[t][...] = xp.asarray(NB.decode_rows(enc, dim, ty))
    idx, offs, w = batch(rng, len(fmap), 3, 3, lambda j: tables[fmap[j // 3]][0])
    args = (xp.asarray(idx), xp.asarray(offs), xp.asarray(w))
    np.testing.assert_allclose(
        device.to_host(q.forward(*args)[0]), device.to_host(f.forward(*args)[0]), rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ValueError, match="row_codecs"):
        TableBatchedEmbedding(tables, fmap, row_codecs=codecs)
