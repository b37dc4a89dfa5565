"""FBGEMM's inference TBE face (numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_inference): the same
split_embedding_weights views as fbgemm_gpu's IntNBitTableBatchedEmbeddingBagsCodegen and the same outputs
for every row type (FP32, FP16, INT8, INT4, INT2) and pooling, where fbgemm_gpu's CPU build is installed; the
row formats round-trip (kernels/nbit_rows.py); what is not implemented is a clear error."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from numbactr.fbgemm_gpu import split_table_batched_embeddings_ops_inference as NI  # noqa: E402
from numbactr.fbgemm_gpu.split_embedding_configs import SparseType as NS  # noqa: E402
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation as NL  # noqa: E402
from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode as NP  # noqa: E402
from numbactr.kernels import nbit_rows as NB  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test

TYPES = ["INT8", "INT4", "INT2", "FP16", "FP32", "FP8"]
ROWS = [20, 30, 15, 25, 10, 12]


def fbgemm():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_inference")


def build(mod, sparse_type, location, pooling_mode, dims, types=TYPES, **kw):
    specs = [("", r, d, getattr(sparse_type, t), location.HOST) for r, d, t in zip(ROWS, dims, types)]
    return mod.IntNBitTableBatchedEmbeddingBagsCodegen(specs, pooling_mode=pooling_mode, device="cpu", **kw)


def fill(modules, dims, types=TYPES, seed=1):
    """The same rows in every module: random weight bytes, sane float16 scales and biases, normal floats."""
    rng = np.random.default_rng(seed)
    splits = [m.split_embedding_weights() for m in modules]
    for t, ty in enumerate(types):
        w0 = splits[0][t][0]
        if ty == "FP8":  # any byte is a finite HFP8 value
            src, qp = torch.from_numpy(rng.integers(0, 256, (w0.shape[0], dims[t])).astype(np.uint8)), None
        elif ty in ("FP16", "FP32"):
            vals = rng.standard_normal((w0.shape[0], dims[t])).astype(np.float16 if ty == "FP16" else np.float32)
            src, qp = torch.from_numpy(vals.view(np.uint8).reshape(w0.shape[0], -1)), None
        else:
            src = torch.from_numpy(rng.integers(0, 256, tuple(w0.shape)).astype(np.uint8))
            qp = torch.from_numpy(
                np.stack([rng.uniform(0.01, 0.1, w0.shape[0]), rng.uniform(-1, 1, w0.shape[0])], 1)
                .astype(np.float16)
                .view(np.uint8)
            )
        for split in splits:
            w, s = split[t]
            w[:, : src.shape[1]].copy_(src)
            if qp is not None:
                s.copy_(qp)


def batch(dims, seed=2, weighted=True):
    rng = np.random.default_rng(seed)
    F, B = len(dims), 4
    lens = rng.integers(0, 4, F * B)
    feat = np.repeat(np.arange(F), B)
    idx = torch.from_numpy(np.concatenate([rng.integers(0, ROWS[f], n) for f, n in zip(feat, lens)])).int()
    off = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)])).int()
    psw = torch.from_numpy(rng.standard_normal(idx.numel()).astype(np.float32)) if weighted else None
    return idx, off, psw


@pytest.mark.parametrize(
    "pooling,weighted,out",
    [("SUM", True, "FP32"), ("SUM", False, "FP16"), ("MEAN", False, "FP32"), ("NONE", False, "FP32")],
)
def test_outputs_equal_fbgemm_for_every_row_type(pooling, weighted, out):
    FI = fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType as FS
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation as FL
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode as FP

    dims = [8] * 6 if pooling == "NONE" else [8, 16, 8, 12, 4, 8]
    fb = build(FI, FS, FL, getattr(FP, pooling), dims, output_dtype=getattr(FS, out))
    nb = build(NI, NS, NL, getattr(NP, pooling), dims, output_dtype=getattr(NS, out))
    fb.initialize_weights()
    nb.initialize_weights()
    for (a, sa), (b, sb) in zip(fb.split_embedding_weights(), nb.split_embedding_weights()):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
        assert (sa is None) == (sb is None) and (sa is None or sa.shape == sb.shape)
    for (a, _), (b, _) in zip(fb.split_embedding_weights(False), nb.split_embedding_weights(False)):
        assert a.shape == b.shape
    fill([fb, nb], dims)
    idx, off, psw = batch(dims, weighted=weighted)
    want, got = fb(idx, off, psw), nb(idx, off, psw)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if out == "FP32" else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert want.abs().sum() > 0


def test_scale_bias_views_and_row_alignment_like_fbgemm():
    FI = fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType as FS
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation as FL
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode as FP

    dims = [8, 16, 8, 12, 4, 8]
    fb = build(FI, FS, FL, FP.SUM, dims, row_alignment=16)
    nb = build(NI, NS, NL, NP.SUM, dims, row_alignment=16)
    fb.initialize_weights()
    nb.initialize_weights()
    for mode in (0, 1, 2):
        for a, b in zip(
            fb.split_embedding_weights_with_scale_bias(mode), nb.split_embedding_weights_with_scale_bias(mode)
        ):
            for x, y in zip(a, b):
                assert (x is None) == (y is None)
                if x is not None:
                    assert x.shape == y.shape and x.dtype == y.dtype
    assert NI.rounded_row_size_in_bytes(12, NS.INT4, 16) == 16 and NI.unpadded_row_size_in_bytes(12, NS.INT4) == 10


@pytest.mark.parametrize("ty", ["int8", "int4", "int2", "fp16", "fp32", "fp8"])
@pytest.mark.parametrize("reverse", [False, True])
def test_row_formats_round_trip(ty, reverse):
    """encode_rows_ref then decode_rows: within half a quantization step (exact for fp32; fp16 rounding)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((30, 16)) * rng.uniform(0.1, 5, (30, 1))).astype(np.float32)
    q = NB.encode_rows_ref(x, ty, alignment=16, reverse_qparam=reverse)
    assert q.shape == (30, NB.row_bytes(16, ty, 16))
    back = NB.decode_rows(q, 16, ty, reverse_qparam=reverse)
    if ty == "fp32":
        np.testing.assert_array_equal(back, x)
    elif ty == "fp16":
        np.testing.assert_array_equal(back, x.astype(np.float16).astype(np.float32))
    elif ty == "fp8":  # 3 mantissa bits: within 1/16 relative, or subnormal
        assert (np.abs(back - x) <= np.abs(x) / 16 + 2.0**-9).all()
    else:
        levels = (1 << NB.BITS[ty]) - 1
        step = (x.max(1) - x.min(1)) / levels
        assert (np.abs(back - x) <= step[:, None] * 0.51 + np.abs(x) * 2e-3 + 1e-3).all()


def test_reverse_qparam_reads_the_qparams_where_the_views_put_them():
    """reverse_qparam=True: split_embedding_weights puts scale and bias at the end of each row, and the
    lookup reads them there (FBGEMM's documented meaning; its CPU kernel ignores the flag)."""
    m = build(NI, NS, NL, NP.SUM, [8], types=["INT4"], output_dtype=NS.FP32, reverse_qparam=True)
    x = np.random.default_rng(4).standard_normal((ROWS[0], 8)).astype(np.float32)
    q = torch.from_numpy(NB.encode_rows_ref(x, "int4", reverse_qparam=True))
    m.assign_embedding_weights([(q[:, :4], q[:, 4:])])
    out = m(torch.tensor([3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    np.testing.assert_allclose(out.numpy()[0], NB.decode_rows(q.numpy(), 8, "int4", reverse_qparam=True)[3])
    np.testing.assert_allclose(out.numpy()[0], x[3], atol=(x[3].max() - x[3].min()) / 15 * 0.51 + 1e-2)


def test_per_sample_weights_of_sequence_embeddings_warn_and_are_not_applied():
    m = build(NI, NS, NL, NP.NONE, [8], types=["FP32"], output_dtype=NS.FP32)
    m.initialize_weights()
    m.split_embedding_weights()[0][0].copy_(torch.ones(ROWS[0], 8).view(torch.uint8))
    with pytest.warns(RuntimeWarning, match="not applied"):
        out = m(
            torch.tensor([1, 2], dtype=torch.int32),
            torch.tensor([0, 1, 2], dtype=torch.int32),
            torch.tensor([3.0, 4.0]),
        )
    np.testing.assert_array_equal(out.numpy(), np.ones((2, 8)))


def test_clear_errors():
    m = build(NI, NS, NL, NP.SUM, [8], types=["INT8"])
    with pytest.raises(RuntimeError, match="initialize_weights"):
        m(torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="initialize_weights"):
        m.split_embedding_weights()
    m.fill_random_weights()
    with pytest.raises(TypeError, match="int32 or int64"):
        m(torch.tensor([1.0]), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="1 .weights, scale_shift. pairs"):
        m.assign_embedding_weights([])
    with pytest.raises(ValueError, match=r"index_remapping\[0\]\[1\] = 99"):
        m.set_index_remappings([torch.tensor([0, 99])])
    with pytest.raises(NotImplementedError, match="NFP8"):
        build(NI, NS, NL, NP.SUM, [8], types=["NFP8"])
    with pytest.raises(NotImplementedError, match="output_dtype=INT4 is implemented for PoolingMode.NONE"):
        build(NI, NS, NL, NP.SUM, [8], types=["INT4"], output_dtype=NS.INT4)
    with pytest.raises(ValueError, match="every table's weights must be INT8"):
        build(NI, NS, NL, NP.NONE, [8, 8], types=["INT8", "INT4"], output_dtype=NS.INT8)
    with pytest.raises(NotImplementedError, match="output_dtype=FP8"):
        build(NI, NS, NL, NP.NONE, [8], types=["FP8"], output_dtype=NS.FP8)
    with pytest.raises(ValueError, match="multiple of 2"):
        build(NI, NS, NL, NP.SUM, [7], types=["INT4"])
    with pytest.raises(NotImplementedError, match="MANAGED_CACHING"):
        NI.IntNBitTableBatchedEmbeddingBagsCodegen([("", 5, 8, NS.INT8, NL.MANAGED_CACHING)])
    with pytest.raises(NotImplementedError, match="backward|forward only"):
        m.engine.backward(None, None)


@pytest.mark.parametrize("use_array", [True, False])
def test_pruning_like_fbgemm(use_array):
    """index_remapping: original indices mapped to rows, pruned ones (-1) reading nothing; FBGEMM's array and
    hash-map forms give the same output, and the same as FBGEMM's."""
    FI = fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType as FS
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation as FL
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode as FP

    dims, types = [8, 16], ["INT8", "FP16"]
    rng = np.random.default_rng(8)
    remap = []
    for r in ROWS[:2]:  # 3 r original indices, r of them kept
        m = -np.ones(3 * r, np.int32)
        m[rng.choice(3 * r, r, replace=False)] = np.arange(r, dtype=np.int32)
        remap.append(torch.from_numpy(m))
    kw = dict(index_remapping=remap, use_array_for_index_remapping=use_array)
    fb = build(FI, FS, FL, FP.SUM, dims, types=types, output_dtype=FS.FP32, **kw)
    nb = build(NI, NS, NL, NP.SUM, dims, types=types, output_dtype=NS.FP32, **kw)
    fb.initialize_weights()
    nb.initialize_weights()
    fill([fb, nb], dims, types)
    lens = rng.integers(0, 4, 2 * 5)
    feat = np.repeat(np.arange(2), 5)
    idx = torch.from_numpy(np.concatenate([rng.integers(0, 3 * ROWS[f], n) for f, n in zip(feat, lens)])).int()
    off = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)])).int()
    torch.testing.assert_close(nb(idx, off), fb(idx, off), rtol=1e-5, atol=1e-5)
    assert nb.original_rows_per_table == [3 * ROWS[0], 3 * ROWS[1]]


@pytest.mark.parametrize("ty,reverse", [("INT8", False), ("INT8", True), ("INT4", False)])
def test_int8_and_int4_output_of_sequence_embeddings_is_the_stored_rows_like_fbgemm(ty, reverse):
    """output_dtype INT8 / INT4 with PoolingMode.NONE: each occurrence's stored row bytes (scale, bias and
    values, row padding left out), byte for byte as FBGEMM's (uint8, or torch.quint4x2 of twice the width);
    an out-of-range index under WARNING reads row 0 as FBGEMM's does, a pruned index reads zeros (FBGEMM's
    CPU kernel leaves such rows unset)."""
    FI = fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType as FS
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation as FL
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode as FP

    dims, types = [8, 8, 8], [ty] * 3
    width = NB.unpadded_row_bytes(8, ty.lower())
    # (FBGEMM's CPU INT4 output writes padded rows past its output's end when row_alignment > 1)
    kw = dict(row_alignment=16 if ty == "INT8" else 1, reverse_qparam=reverse)
    fb = build(FI, FS, FL, FP.NONE, dims, types=types, output_dtype=getattr(FS, ty), **kw)
    nb = build(NI, NS, NL, NP.NONE, dims, types=types, output_dtype=getattr(NS, ty), **kw)
    fb.initialize_weights()
    nb.initialize_weights()
    fill([fb, nb], dims, types)
    idx, off, _ = batch(dims, weighted=False)
    idx[0] = 10**6  # out of range: WARNING reads row 0
    want = fb(idx.clone(), off)  # (FBGEMM's bounds check zeroes the index in place)
    with pytest.warns(RuntimeWarning, match="outside its table"):
        got = nb(idx, off)
    assert got.dtype == want.dtype and got.shape == want.shape

    def as_bytes(t):
        return np.frombuffer(bytes(t.untyped_storage()), np.uint8).reshape(t.shape[0], -1)

    assert as_bytes(got).shape == (idx.numel(), width)
    np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
    if ty == "INT4":  # FBGEMM's own decoder reads it
        dec = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfFrontToFloatOrHalf(got, bit_rate=4, output_dtype=0)
        nb_f = build(NI, NS, NL, NP.NONE, dims, types=types, output_dtype=NS.FP32, **kw)
        nb_f.initialize_weights()
        fill([nb_f], dims, types)
        with pytest.warns(RuntimeWarning, match="outside its table"):
            want_f = nb_f(idx, off)
        torch.testing.assert_close(dec, want_f, rtol=1e-3, atol=1e-3)
    rows = [w for w, _, _ in nb.split_embedding_weights_with_scale_bias(0)]
    np.testing.assert_array_equal(as_bytes(got)[0], rows[nb.feature_table_map[0]][0, :width].numpy())
    # pruning: the remapped row's bytes, zeros for a pruned index
    nb.set_index_remappings([torch.tensor([2, -1, 0], dtype=torch.int32), None, None])
    got = as_bytes(nb(torch.tensor([0, 1, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 4, 4], dtype=torch.int32)))
    np.testing.assert_array_equal(
        got,
        np.stack(
            [
                rows[0][2, :width].numpy(),
                np.zeros(width, np.uint8),
                rows[0][0, :width].numpy(),
                rows[1][5, :width].numpy(),
            ]
        ),
    )


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_pooled_int8_output_is_each_features_block_quantized(pooling):
    """Pooled INT8 output (FBGEMM's GPU kernels; its CPU kernel leaves the bytes unset): per feature, the
    FP32 pooled block in FBGEMM's fused 8-bit rows, byte for byte FloatToFused8BitRowwiseQuantized of it."""
    fbgemm()
    dims, types = [8, 16, 8, 12, 4, 8], TYPES
    nb8 = build(NI, NS, NL, getattr(NP, pooling), dims, output_dtype=NS.INT8)
    nb32 = build(NI, NS, NL, getattr(NP, pooling), dims, output_dtype=NS.FP32)
    for m in (nb8, nb32):
        m.initialize_weights()
    fill([nb8, nb32], dims, types)
    idx, off, _ = batch(dims, weighted=False)
    got, ref = nb8(idx, off), nb32(idx, off)
    assert got.dtype == torch.uint8 and got.shape == (4, sum(dims) + 8 * len(dims))
    want = torch.cat(
        [
            torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(part.contiguous())
            for part in torch.split(ref, dims, dim=1)
        ],
        dim=1,
    )
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    back = torch.cat(
        [
            torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(part.contiguous())
            for part in torch.split(got, [d + 8 for d in dims], dim=1)
        ],
        dim=1,
    )
    for part_back, part_ref in zip(torch.split(back, dims, dim=1), torch.split(ref, dims, dim=1)):
        half_step = (part_ref.max(1).values - part_ref.min(1).values) / 255 / 2  # per row
        assert ((part_back - part_ref).abs() <= half_step[:, None] * 1.01 + 1e-6).all()


@pytest.mark.parametrize("pruned", [False, True])
def test_embedding_inplace_update_like_fbgemm(pruned):
    """embedding_inplace_update (per-table rows) and embedding_inplace_update_internal (flat, original
    indices through the pruning map) write the same bytes as FBGEMM's, and the lookups then agree."""
    FI = fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType as FS
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation as FL
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode as FP

    dims, types = [8, 16, 8], ["INT8", "FP16", "INT4"]
    kw = dict(output_dtype=None, row_alignment=16)
    if pruned:
        kw["index_remapping"] = [torch.tensor([3, -1, 0, 1, 2, 5, 4] + [-1] * 13, dtype=torch.int32), None, None]
    fb = build(FI, FS, FL, FP.SUM, dims, types=types, **{**kw, "output_dtype": FS.FP32})
    nb = build(NI, NS, NL, NP.SUM, dims, types=types, **{**kw, "output_dtype": NS.FP32})
    fb.initialize_weights()
    nb.initialize_weights()
    fill([fb, nb], dims, types)
    rng = np.random.default_rng(11)
    widths = [w.shape[1] for w, _ in nb.split_embedding_weights(False)]
    rows = [[1, 4], [], [0, 7, 3]]
    upd = [torch.from_numpy(rng.integers(0, 256, (len(r), widths[t])).astype(np.uint8)) for t, r in enumerate(rows)]
    # sane qparams for the quantized rows (float16 scale, bias at the front)
    for t in (0, 2):
        upd[t][:, :4] = torch.from_numpy(np.tile(np.array([0.05, -0.5], np.float16).view(np.uint8), (len(rows[t]), 1)))
    for m in (fb, nb):
        m.embedding_inplace_update([0, 1, 2], rows, upd)
    for (a, _), (b, _) in zip(fb.split_embedding_weights(False), nb.split_embedding_weights(False)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    tables, originals = [0, 2, 0], [2, 5, 5]
    flat = torch.from_numpy(rng.integers(0, 256, sum(widths[t] for t in tables)).astype(np.uint8))
    flat[:4] = torch.from_numpy(np.array([0.02, 0.5], np.float16).view(np.uint8))
    nb.embedding_inplace_update_internal(tables, originals, flat)
    # (FBGEMM's flat form is a GPU op; its meaning written out on FBGEMM's views)
    remap = kw.get("index_remapping", [None] * 3)
    at = 0
    for t, i in zip(tables, originals):
        r = i if remap[t] is None else int(remap[t][i])
        if r >= 0:
            fb.split_embedding_weights(False)[t][0][r] = flat[at : at + widths[t]]
        at += widths[t]
    for (a, _), (b, _) in zip(fb.split_embedding_weights(False), nb.split_embedding_weights(False)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    idx, off, _ = batch(dims, weighted=False)
    torch.testing.assert_close(nb(idx, off), fb(idx.clone(), off), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"update_row_indices\[0\] has row 99"):
        nb.embedding_inplace_update([0], [[99]], [upd[0][:1]])
    with pytest.raises(ValueError, match=r"update_weights\[0\] must be uint8 of shape"):
        nb.embedding_inplace_update([0], [[1]], [upd[0]])
    with pytest.raises(ValueError, match="not a table"):
        nb.embedding_inplace_update_internal([7], [0], flat[: widths[0]])
