"""numbactr's FBGEMM face against fbgemm_gpu itself (FBGEMM's CPU build, `pip install -e ".[fbgemm]"`):
the same constructor call, the same inputs and torch seed, then forward outputs at every step, updated
weights and optimizer states after several steps, per-sample-weight gradients, for each optimizer FBGEMM's
CPU build runs (EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, EMAINPLACE_ROWWISE_ADAGRAD), and
examples/fbgemm_dlrm.py run with either import line. Skipped where torch or fbgemm_gpu is not installed.

Where FBGEMM's CPU build departs from its own GPU kernels, numbactr follows the GPU (array_tbe.py's
docstring lists these); the cases below stay where both agree: Adagrad kinds on tables read by one
feature (rowwise weight decay on a shared table), MEAN without per-sample weights, per-sample-weight
gradients with learning rate 0 (FBGEMM's CPU backward reads the already updated rows for them).
"""

import importlib.util
import pathlib
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
with warnings.catch_warnings():  # fbgemm_gpu's import warns about its own missing SSD modules
    warnings.simplefilter("ignore", DeprecationWarning)
    FB = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")

from numbactr.fbgemm_gpu import split_table_batched_embeddings_ops_training as NB  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "fbgemm_dlrm.py"
NUMBACTR_IMPORT = "from numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training import ("
FBGEMM_IMPORT = "from fbgemm_gpu.split_table_batched_embeddings_ops_training import ("


pytestmark = pytest.mark.usefixtures("cpu")  # conftest.py: the cpu device for every test


def make(mod, specs, enums=(), **kw):
    """The same constructor call on module `mod` (FB or NB); enum arguments given as (name, member name)."""
    for arg, (cls, member) in dict(enums).items():
        kw[arg] = getattr(getattr(mod, cls), member)
    tbe = mod.SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, mod.EmbeddingLocation.HOST, mod.ComputeDevice.CPU) for r, d in specs], **kw
    )
    torch.manual_seed(0)
    tbe.init_embedding_weights_uniform(-1, 1)
    return tbe


def run(mod, specs, steps=4, batch=5, weighted=False, index_dtype=torch.int64, bad_index=False, vbe=None, **kw):
    """Train `steps` steps on seeded random bags; returns outputs, psw gradients, weights, states."""
    tbe = make(mod, specs, **kw)
    ftm = kw.get("feature_table_map") or list(range(len(specs)))
    rows = np.array([specs[t][0] for t in ftm])
    rng = np.random.default_rng(1)
    outs, psw_grads = [], []
    for _ in range(steps):
        n_bags = sum(map(sum, vbe)) if vbe else len(ftm) * batch
        per_feature = [sum(b) for b in vbe] if vbe else [batch] * len(ftm)
        lens = rng.integers(0, 4, n_bags)
        off = np.concatenate([[0], np.cumsum(lens)])
        feat = np.repeat(np.repeat(np.arange(len(ftm)), per_feature), lens)
        idx = (rng.random(off[-1]) * rows[feat]).astype(np.int64)
        if bad_index and idx.size:
            idx[idx.size // 2] = rows[feat[idx.size // 2]] + 3
        psw = torch.from_numpy(rng.random(off[-1]).astype(np.float32)).requires_grad_() if weighted else None
        extra = dict(batch_size_per_feature_per_rank=vbe) if vbe else {}
        out = tbe(
            torch.from_numpy(idx).to(index_dtype),
            torch.from_numpy(off).to(index_dtype),
            per_sample_weights=psw,
            **extra,
        )
        dy = torch.from_numpy(rng.standard_normal(tuple(out.shape)).astype(np.float32))
        out.backward(dy.to(out.dtype))
        outs.append(out.detach().float().numpy())
        psw_grads.append(None if psw is None else psw.grad.numpy())
    weights = [w.float().numpy().copy() for w in tbe.split_embedding_weights()]
    states = [[s.numpy().copy() for s in t] for t in tbe.split_optimizer_states()]
    return outs, psw_grads, weights, states


def assert_same(specs, rtol=1e-5, atol=1e-6, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numbactr's bounds-check warning (FBGEMM logs)
        theirs, ours = run(FB, specs, **kw), run(NB, specs, **kw)
    for name, a, b in zip(("outputs", "psw grads", "weights"), theirs[:3], ours[:3]):
        for x, y in zip(a, b):
            if x is not None:
                np.testing.assert_allclose(y, x, rtol=rtol, atol=atol, err_msg=name)
    assert len(theirs[3]) == len(ours[3])
    for x, y in zip(theirs[3], ours[3]):
        for sx, sy in zip(x, y):
            assert sx.shape == sy.shape
            np.testing.assert_allclose(sy, sx, rtol=rtol, atol=atol, err_msg="optimizer states")


OPT = "optimizer"


@pytest.mark.parametrize("pooling", ["SUM", "MEAN", "NONE"])
@pytest.mark.parametrize("opt", ["EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"])
def test_optimizers_and_poolings(opt, pooling):
    specs = [(10, 8), (7, 8), (12, 8)] if pooling == "NONE" else [(10, 8), (7, 4), (12, 16)]
    assert_same(specs, enums={OPT: ("OptimType", opt), "pooling_mode": ("PoolingMode", pooling)}, learning_rate=0.1)


def test_tables_shared_by_features_sgd():
    assert_same(
        [(10, 8), (7, 4)], feature_table_map=[0, 1, 0, 0], enums={OPT: ("OptimType", "EXACT_SGD")}, learning_rate=0.2
    )


@pytest.mark.parametrize("mode", ["L2", "DECOUPLE"])
def test_rowwise_adagrad_weight_decay(mode):
    assert_same(
        [(10, 8)],
        feature_table_map=[0, 0],
        learning_rate=0.1,
        weight_decay=0.05,
        enums={OPT: ("OptimType", "EXACT_ROWWISE_ADAGRAD"), "weight_decay_mode": ("WeightDecayMode", mode)},
    )


def test_per_sample_weights_forward_and_gradient():
    assert_same([(10, 8), (7, 4)], weighted=True, learning_rate=0.0, steps=2)
    theirs, ours = (run(m, [(10, 8), (7, 4)], weighted=True, learning_rate=0.1, steps=3) for m in (FB, NB))
    for x, y in zip(theirs[2], ours[2]):  # weighted updates (gradients differ: see above)
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)


def test_gradient_clipping():
    assert_same(
        [(10, 8), (7, 4)],
        learning_rate=0.5,
        gradient_clipping=True,
        max_gradient=0.3,
        enums={OPT: ("OptimType", "EXACT_ADAGRAD")},
    )


@pytest.mark.parametrize("mode", ["IGNORE", "WARNING"])
def test_bounds_check_repairs_like_fbgemm(mode):
    assert_same(
        [(10, 8), (7, 4)], bad_index=True, learning_rate=0.1, enums={"bounds_check_mode": ("BoundsCheckMode", mode)}
    )


def test_int32_indices_and_offsets():
    assert_same(
        [(10, 8), (7, 4)],
        index_dtype=torch.int32,
        learning_rate=0.1,
        enums={OPT: ("OptimType", "EXACT_ROWWISE_ADAGRAD")},
        feature_table_map=[0, 1],
    )


def test_variable_batch_sizes():
    assert_same([(10, 8), (7, 4)], vbe=[[2, 3], [4, 1]], learning_rate=0.1)


def test_fp16_weights_and_output_within_one_half_ulp_step():
    # FBGEMM's CPU build rounds FP16 updates its own way: compare to float16's spacing
    specs = [(10, 8), (7, 8)]
    enums = {"weights_precision": ("SparseType", "FP16"), "output_dtype": ("SparseType", "FP16")}
    theirs, ours = (run(m, specs, steps=1, enums=enums, learning_rate=0.1) for m in (FB, NB))
    np.testing.assert_array_equal(ours[0][0], theirs[0][0])  # before any update: exact
    for x, y in zip(theirs[2], ours[2]):
        np.testing.assert_allclose(y, x, rtol=0, atol=2**-10 * 2)


def test_example_dlrm_equals_fbgemm_with_only_the_import_changed():
    source = EXAMPLE.read_text()
    assert source.count(NUMBACTR_IMPORT) == 1
    losses = {}
    for name, text in (("numbactr", source), ("fbgemm", source.replace(NUMBACTR_IMPORT, FBGEMM_IMPORT))):
        spec = importlib.util.spec_from_loader(f"fbgemm_dlrm_{name}", loader=None)
        module = importlib.util.module_from_spec(spec)
        exec(compile(text, str(EXAMPLE), "exec"), module.__dict__)
        losses[name], _ = module.main(steps=25, batch=64, table_rows=(50, 20, 80), dim=8, log_every=0)
    np.testing.assert_allclose(losses["numbactr"], losses["fbgemm"], rtol=1e-4)


# ---- FBGEMM's writeback (use_writeback_bwd_prehook), preallocated host buffers, static helpers ----------------
def writeback_run(mod, specs, pooling, first_feature_only=False, steps=3, batch=12, seed=3):
    """EXACT_SGD with FBGEMM's writeback on one-hot bags (some empty) with many repeated indices."""
    extra = mod.UserEnabledConfigDefinition(
        use_writeback_bwd_prehook=True, writeback_first_feature_only=first_feature_only
    )
    tbe = make(
        mod,
        specs,
        enums={OPT: ("OptimType", "EXACT_SGD"), "pooling_mode": ("PoolingMode", pooling)},
        learning_rate=0.5,
        extra_optimizer_config=extra,
    )
    rng = np.random.default_rng(seed)
    outs = []
    for _ in range(steps):
        lens = rng.integers(0, 2, len(specs) * batch) if pooling != "NONE" else np.ones(len(specs) * batch, int)
        off = np.concatenate([[0], np.cumsum(lens)])
        feat = np.repeat(np.repeat(np.arange(len(specs)), batch), lens)
        idx = rng.integers(0, 3, off[-1]) % np.array([r for r, _ in specs])[feat]  # few rows: many repeats
        out = tbe(torch.from_numpy(idx), torch.from_numpy(off))
        out.backward(torch.from_numpy(rng.standard_normal(tuple(out.shape)).astype(np.float32)))
        outs.append(out.detach().numpy())
    return outs, [w.detach().numpy().copy() for w in tbe.split_embedding_weights()]


@pytest.mark.parametrize("first_feature_only", [False, True])
def test_writeback_sequence_embeddings_like_fbgemm(first_feature_only):
    specs = [(5, 8), (4, 8)]
    theirs, ours = (writeback_run(m, specs, "NONE", first_feature_only) for m in (FB, NB))
    for x, y in zip(theirs[0] + theirs[1], ours[0] + ours[1]):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)


def test_writeback_pooled_one_table_like_fbgemm_and_each_feature_alone():
    theirs, ours = (writeback_run(m, [(5, 8)], "SUM") for m in (FB, NB))
    for x, y in zip(theirs[0] + theirs[1], ours[0] + ours[1]):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)
    # FBGEMM's pooled writeback indexes dLoss/doutput's rows by bag number, so it only runs one feature; numbactr
    # masks each feature's columns: each (feature, row) moves by -lr x its first bag's gradient, nothing else
    specs, batch, lr = [(4, 8), (4, 4)], 6, 0.5
    tbe = make(
        NB,
        specs,
        enums={OPT: ("OptimType", "EXACT_SGD")},
        learning_rate=lr,
        extra_optimizer_config=NB.UserEnabledConfigDefinition(use_writeback_bwd_prehook=True),
    )
    before = [w.detach().numpy().copy() for w in tbe.split_embedding_weights()]
    lens = np.array([1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1])
    idx = np.array([2, 2, 0, 2, 1, 3, 3, 1, 1, 3])  # samples 0-5: feature 0 2 2 - 0 2 1, feature 1 3 - 3 1 1 3
    off = np.concatenate([[0], np.cumsum(lens)])
    dy = np.random.default_rng(0).standard_normal((batch, 12)).astype(np.float32)
    tbe(torch.from_numpy(idx), torch.from_numpy(off)).backward(torch.from_numpy(dy))
    expected = [b.copy() for b in before]
    for (f, cols), firsts in (((0, slice(0, 8)), {2: 0, 0: 3, 1: 5}), ((1, slice(8, 12)), {3: 0, 1: 3})):
        for row, b in firsts.items():
            expected[f][row] -= lr * dy[b, cols]
    for w, e in zip(tbe.split_embedding_weights(), expected):
        np.testing.assert_allclose(w.detach().numpy(), e, rtol=1e-6, atol=1e-6)
    multi_hot = tbe(torch.tensor([1, 2, 3]), torch.tensor([0, 3] + [3] * 11))  # a forward alone is fine
    with pytest.raises(ValueError, match="at most one index"):
        multi_hot.sum().backward()


def test_writeback_is_exact_sgd_only_like_fbgemm():
    for mod in (FB, NB):
        with pytest.raises(AssertionError, match="EXACT_SGD"):
            make(
                mod,
                [(5, 8)],
                enums={OPT: ("OptimType", "EXACT_ROWWISE_ADAGRAD")},
                extra_optimizer_config=FB.UserEnabledConfigDefinition(use_writeback_bwd_prehook=True),
            )


def prealloc_buffers(opt, specs):
    sizes = {"weights": sum(r * d for r, d in specs)}
    if opt != "EXACT_SGD":
        sizes["momentum1"] = (
            sum(r * d for r, d in specs) if opt in ("EXACT_ADAGRAD", "ADAM") else sum(r for r, _ in specs)
        )
    if opt == "ADAM":
        sizes["momentum2"] = sum(r * d for r, d in specs)
    return {k: torch.full((n,), 0.0) for k, n in sizes.items()}


@pytest.mark.parametrize("opt", ["EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"])
def test_preallocated_host_buffers_train_in_place_like_fbgemm(opt):
    specs = [(10, 8), (7, 4)]
    bufs = {m: prealloc_buffers(opt, specs) for m in ("FB", "NB")}
    results = {}
    for name, mod in (("FB", FB), ("NB", NB)):
        tbe = make(mod, specs, enums={OPT: ("OptimType", opt)}, learning_rate=0.1, preallocated_host_buffers=bufs[name])
        assert tbe.weights_host.data_ptr() == bufs[name]["weights"].data_ptr()
        if "momentum1" in bufs[name]:
            assert tbe.momentum1_host.data_ptr() == bufs[name]["momentum1"].data_ptr()
        rng = np.random.default_rng(2)
        for _ in range(3):
            off = np.concatenate([[0], np.cumsum(rng.integers(0, 4, 2 * 6))])
            idx = rng.integers(0, 7, off[-1])
            tbe(torch.from_numpy(idx), torch.from_numpy(off)).sum().backward()
        results[name] = bufs[name]
    for key in results["FB"]:
        np.testing.assert_allclose(results["NB"][key].numpy(), results["FB"][key].numpy(), rtol=1e-5, atol=1e-6)
        assert results["NB"][key].abs().sum() > 0  # trained through the caller's buffer


@pytest.mark.parametrize("bad", ["size", "dtype", "2d", "strided", "key"])
def test_preallocated_host_buffers_refused_like_fbgemm(bad):
    specs = [(10, 8), (7, 4)]
    n = sum(r * d for r, d in specs)
    buf = {
        "size": torch.zeros(n + 1),
        "dtype": torch.zeros(n, dtype=torch.float64),
        "2d": torch.zeros(n // 2, 2),
        "strided": torch.zeros(2 * n)[::2],
        "key": torch.zeros(n),
    }[bad]
    key = "momentum1" if bad == "key" else "weights"  # EXACT_SGD has no momentum1
    for mod in (FB, NB):
        with pytest.raises(AssertionError):
            mod.SplitTableBatchedEmbeddingBagsCodegen(
                [(r, d, mod.EmbeddingLocation.HOST, mod.ComputeDevice.CPU) for r, d in specs],
                optimizer=mod.OptimType.EXACT_SGD,
                preallocated_host_buffers={key: buf},
            )


def test_static_helpers_like_fbgemm():
    for names in (None, [], ["t1"], ["t1", "t1"], ["t2", "t1", "t2"]):
        assert NB.SplitTableBatchedEmbeddingBagsCodegen.get_table_name_for_logging(
            names
        ) == FB.SplitTableBatchedEmbeddingBagsCodegen.get_table_name_for_logging(names)
    x, y = torch.arange(23), torch.arange(23) * 2
    assert NB.MultiPassPrefetchConfig() == tuple(FB.MultiPassPrefetchConfig())
    for conf in (
        None,
        FB.MultiPassPrefetchConfig(num_passes=4, min_splitable_pass_size=3),
        FB.MultiPassPrefetchConfig(num_passes=5, min_splitable_pass_size=7),
        FB.MultiPassPrefetchConfig(num_passes=30, min_splitable_pass_size=1),
    ):
        ours = NB.SplitTableBatchedEmbeddingBagsCodegen.get_prefetch_passes(conf, x, y)
        theirs = FB.SplitTableBatchedEmbeddingBagsCodegen.get_prefetch_passes(conf, x, y)
        assert [(a.tolist(), b.tolist(), s) for a, b, s in ours] == [(a.tolist(), b.tolist(), s) for a, b, s in theirs]


# ---- FBGEMM's dense TBE (DenseTableBatchedEmbeddingBagsCodegen): dense gradients, any torch optimizer ----------
def dense_run(mod, specs, pooling="SUM", ftm=None, weighted=False, output="FP32", steps=3, batch=5):
    torch.manual_seed(4)
    tbe = mod.DenseTableBatchedEmbeddingBagsCodegen(
        specs,
        feature_table_map=ftm,
        use_cpu=True,
        pooling_mode=getattr(mod.PoolingMode, pooling),
        output_dtype=getattr(mod.SparseType, output),
    )
    init = tbe.weights.detach().clone()  # FBGEMM's torch.randn draw
    opt = torch.optim.Adagrad(tbe.parameters(), lr=0.1)
    rng = np.random.default_rng(5)
    ftm = ftm or list(range(len(specs)))
    rows = np.array([specs[t][0] for t in ftm])
    outs, grads = [], []
    for _ in range(steps):
        lens = rng.integers(1 if pooling == "NONE" else 0, 4, len(ftm) * batch)
        off = np.concatenate([[0], np.cumsum(lens)])
        feat = np.repeat(np.repeat(np.arange(len(ftm)), batch), lens)
        idx = (rng.random(off[-1]) * rows[feat]).astype(np.int64)
        psw = torch.from_numpy(rng.random(off[-1]).astype(np.float32)).requires_grad_() if weighted else None
        out = tbe(torch.from_numpy(idx), torch.from_numpy(off), psw)
        opt.zero_grad()
        out.float().backward(torch.from_numpy(rng.standard_normal(tuple(out.shape)).astype(np.float32)))
        grads.append((tbe.weights.grad.numpy().copy(), None if psw is None else psw.grad.numpy().copy()))
        opt.step()
        outs.append(out.detach().float().numpy())
    return init.numpy(), outs, grads, [w.numpy().copy() for w in tbe.split_embedding_weights()]


@pytest.mark.parametrize(
    "case", [dict(), dict(pooling="MEAN"), dict(weighted=True), dict(ftm=[0, 1, 0]), dict(output="BF16")]
)
def test_dense_tbe_like_fbgemm(case):
    specs = case.pop("specs", [(9, 8), (6, 4)])
    theirs, ours = dense_run(FB, specs, **case), dense_run(NB, specs, **case)
    np.testing.assert_array_equal(ours[0], theirs[0])
    tol = dict(rtol=1e-2, atol=1e-2) if case.get("output") == "BF16" else dict(rtol=1e-5, atol=1e-6)
    for x, y in zip(theirs[1], ours[1]):
        np.testing.assert_allclose(y, x, **tol)
    for (gx, px), (gy, py) in zip(theirs[2], ours[2]):
        np.testing.assert_allclose(gy, gx, **tol)
        if px is not None:
            np.testing.assert_allclose(py, px, rtol=1e-5, atol=1e-5)
    for x, y in zip(theirs[3], ours[3]):
        np.testing.assert_allclose(y, x, **tol)


def test_dense_tbe_sequence_embeddings_as_fbgemm_gpu():
    # FBGEMM's CPU build pools even with PoolingMode.NONE (its own tests skip that case on the CPU); numbactr
    # gives the GPU kernels' (N, D) rows, here against torch's nn.functional.embedding on the same weights
    torch.manual_seed(0)
    tbe = NB.DenseTableBatchedEmbeddingBagsCodegen(
        [(9, 8), (6, 8)], feature_table_map=[0, 1, 0], use_cpu=True, pooling_mode=NB.PoolingMode.NONE
    )
    off = torch.tensor([0, 2, 3, 3, 5, 6, 8])  # 3 features x batch 2
    idx = torch.tensor([1, 8, 4, 0, 5, 2, 2, 7])
    table_of = torch.tensor([0, 0, 0, 1, 1, 0, 0, 0])  # the table of each index (feature 0, 1, 2)
    out = tbe(idx, off)
    views = [w.clone().requires_grad_() for w in tbe.split_embedding_weights()]
    ref = torch.stack([torch.nn.functional.embedding(i, views[t]) for i, t in zip(idx, table_of)])
    torch.testing.assert_close(out, ref)
    dy = torch.randn(out.shape)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(tbe.weights.grad, torch.cat([v.grad.reshape(-1) for v in views]))


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_dense_tbe_variable_batch_sizes_as_fbgemm_gpu(pooling):
    # FBGEMM's CPU build ignores batch_size_per_feature_per_rank; numbactr gives its GPU kernels' 1-D output
    # (for each rank, each feature's bags), here against torch's embedding_bag per bag on the same weights
    torch.manual_seed(0)
    specs, ftm, vbe = [(9, 8), (6, 4)], [0, 1, 0], [[2, 1], [1, 3], [0, 2]]  # B_{f,r}: 3 features, 2 ranks
    tbe = NB.DenseTableBatchedEmbeddingBagsCodegen(
        specs, feature_table_map=ftm, use_cpu=True, pooling_mode=getattr(NB.PoolingMode, pooling)
    )
    rng = np.random.default_rng(2)
    n_bags = sum(map(sum, vbe))
    lens = rng.integers(0, 4, n_bags)
    off = np.concatenate([[0], np.cumsum(lens)])
    feat = np.repeat(np.repeat(np.arange(3), [sum(b) for b in vbe]), lens)
    idx = np.array([rng.integers(0, specs[ftm[f]][0]) for f in feat], np.int64)
    out = tbe(torch.from_numpy(idx), torch.from_numpy(off), batch_size_per_feature_per_rank=vbe)
    views = [w.clone().requires_grad_() for w in tbe.split_embedding_weights()]
    first = np.concatenate([[0], np.cumsum([sum(b) for b in vbe])])
    pieces = []
    for r in range(2):
        for f in range(3):
            for k in range(sum(vbe[f][:r]), sum(vbe[f][: r + 1])):
                j = first[f] + k  # the input bag
                rows = torch.from_numpy(idx[off[j] : off[j + 1]])
                emb = torch.nn.functional.embedding(rows, views[ftm[f]])
                pooled = emb.sum(0) if pooling == "SUM" or len(rows) == 0 else emb.mean(0)
                pieces.append(pooled)
    ref = torch.cat(pieces)
    assert out.dim() == 1 and out.shape == ref.shape
    torch.testing.assert_close(out, ref)
    dy = torch.randn(out.shape)
    out.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(tbe.weights.grad, torch.cat([v.grad.reshape(-1) for v in views]))


# ---- counter-based regularization and CowClip (WeightDecayMode.COUNTER / COWCLIP) ------------------------------
def counter_config(mode, cwd, halflife=-1, lr_mode="EQUAL", adjustment_iter=-1, tail=0.0, ratio=False):
    """FBGEMM's own config objects (numbactr's face reads them as they are)."""
    cfg = FB.CounterBasedRegularizationDefinition if mode == "COUNTER" else FB.CowClipDefinition
    wd = FB.CounterWeightDecayMode[cwd]
    if mode == "COWCLIP":
        return dict(
            cowclip_regularization=cfg(
                counter_weight_decay_mode=wd, counter_halflife=halflife, weight_norm_coefficient=0.5, lower_bound=1e-3
            )
        )
    return dict(
        counter_based_regularization=cfg(
            counter_weight_decay_mode=wd,
            counter_halflife=halflife,
            adjustment_iter=adjustment_iter,
            adjustment_ub=0.5,
            learning_rate_mode=FB.LearningRateMode[lr_mode],
            tail_id_threshold=FB.TailIdThreshold(tail, ratio),
        )
    )


@pytest.mark.parametrize(
    "mode,cwd,halflife,lr_mode,adjustment_iter,tail",
    [
        ("COUNTER", "NONE", -1, "EQUAL", -1, 0.0),
        ("COUNTER", "DECOUPLE", 3, "EQUAL", -1, 0.0),
        ("COUNTER", "L2", 3, "COUNTER_SGD", -1, 1.0),
        ("COUNTER", "DECOUPLE", 0, "TAIL_ID_LR_INCREASE", 2, 1.0),
        ("COUNTER", "L2", -1, "TAIL_ID_LR_DECREASE", -1, 0.0),
        ("COUNTER", "ADAGRADW", -1, "EQUAL", -1, 0.0),
        ("COUNTER", "ADAGRADW", -2, "EQUAL", 1, 0.0),
        ("COWCLIP", "NONE", -1, None, None, None),
        ("COWCLIP", "L2", 10, None, None, None),
        ("COWCLIP", "DECOUPLE", 0, None, None, None),
    ],
)
def test_counter_regularization_like_fbgemm(mode, cwd, halflife, lr_mode, adjustment_iter, tail):
    """Weights, momentum1, prev_iter and row_counter after 5 steps equal FBGEMM's CPU build's (which keeps
    max_counter at 1 on the CPU: FBGEMM renews it from its device tables only; the default renewal every 1000
    steps is not reached here)."""
    kw = counter_config(mode, cwd, halflife, lr_mode or "EQUAL", adjustment_iter or -1, tail or 0.0)
    assert_same(
        [(10, 8), (7, 4)],
        steps=5,
        learning_rate=0.1,
        weight_decay=0.05,
        eps=1e-3,
        rtol=2e-5,
        atol=2e-6,
        enums={OPT: ("OptimType", "EXACT_ROWWISE_ADAGRAD"), "weight_decay_mode": ("WeightDecayMode", mode)},
        **kw,
    )


def test_counter_states_start_values_and_state_names_like_fbgemm():
    """Row counters and prev_iter set by the caller (FBGEMM's own test fills them) drive the update alike;
    get_optimizer_state names them as FBGEMM does, with "iter" for ADAGRADW."""
    enums = {OPT: ("OptimType", "EXACT_ROWWISE_ADAGRAD"), "weight_decay_mode": ("WeightDecayMode", "COUNTER")}
    results = []
    for mod in (FB, NB):
        tbe = make(
            mod,
            [(6, 4)],
            enums=enums,
            learning_rate=0.1,
            weight_decay=0.05,
            **counter_config("COUNTER", "ADAGRADW", -1),
        )
        m1, prev_iter, counter = tbe.split_optimizer_states()[0]
        prev_iter.copy_(torch.tensor([0.0, 1.0, 0.0, 5.0, 0.0, 2.0]))
        counter.copy_(torch.tensor([0.0, 3.0, 1.0, 7.0, 0.0, 2.0]))
        m1.fill_(0.5)
        tbe.set_optimizer_step(6)  # the forward below is iteration 7
        out = tbe(torch.tensor([0, 1, 3, 3, 5]), torch.tensor([0, 2, 5]))
        out.backward(torch.ones_like(out))
        state = tbe.get_optimizer_state()[0]
        assert set(state) == {"sum", "prev_iter", "row_counter", "iter"}
        results.append(
            [tbe.split_embedding_weights()[0].detach().clone()]
            + [s.detach().clone() for s in tbe.split_optimizer_states()[0]]
        )
    for x, y in zip(*results):
        np.testing.assert_allclose(y.numpy(), x.numpy(), rtol=1e-5, atol=1e-6)


def test_counter_buffers_have_fbgemms_names_and_max_counter_renews():
    """prev_iter / row_counter / max_counter are buffers under FBGEMM's names; a state_dict round trip restores
    them. max_counter renews to 1 + the largest row counter (FBGEMM's GPU rule; its CPU build keeps 1)."""
    kw = dict(
        weight_decay_mode=FB.WeightDecayMode.COUNTER,
        optimizer=FB.OptimType.EXACT_ROWWISE_ADAGRAD,
        counter_based_regularization=FB.CounterBasedRegularizationDefinition(max_counter_update_freq=2),
    )
    theirs, ours = (make(mod, [(5, 4)], **kw) for mod in (FB, NB))
    assert set(ours.state_dict()) - {"iter"} <= set(theirs.state_dict())
    assert {"prev_iter_host", "row_counter_host", "max_counter"} <= set(ours.state_dict())
    for _ in range(3):
        out = ours(torch.tensor([0, 1, 1]), torch.tensor([0, 2, 3]))
        out.sum().backward()
    assert float(ours.max_counter[0]) == 2.0  # at iteration 2: 1 + the counters (1, 1) of step 1
    saved = {k: v.clone() for k, v in ours.state_dict().items()}
    again = make(NB, [(5, 4)], **kw)
    again.load_state_dict(saved)
    for a, b in zip(again.split_optimizer_states()[0], ours.split_optimizer_states()[0]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert float(again.max_counter[0]) == 2.0


@pytest.mark.parametrize("pooling,weighted", [("SUM", False), ("SUM", True), ("MEAN", False), ("NONE", False)])
def test_int8_weights_forward_like_fbgemm(pooling, weighted):
    """weights_precision INT8 (FBGEMM's fused 8-bit rows: D bytes, float scale, float bias): the same
    (V, D + 8) uint8 split_embedding_weights, the same rows from init_embedding_weights_uniform, the same
    pooled output of those rows; and a backward is refused by both (FBGEMM's CPU TBE has no INT8 backward).
    Sequence embeddings (NONE): FBGEMM's CPU build returns the raw bytes as floats (its own forward test
    skips INT8 there); numbactr returns the dequantized rows, checked with FBGEMM's dequantizing op."""
    specs = [(9, 8), (6, 8), (11, 8)] if pooling == "NONE" else [(9, 4), (6, 12), (11, 8)]
    kw = dict(weights_precision=FB.SparseType.INT8, optimizer=FB.OptimType.EXACT_SGD)
    kw_nb = dict(weights_precision=NB.SparseType.INT8, optimizer=NB.OptimType.EXACT_SGD)
    fb = make(FB, specs, enums=dict(pooling_mode=("PoolingMode", pooling)), **kw)
    nb = make(NB, specs, enums=dict(pooling_mode=("PoolingMode", pooling)), **kw_nb)
    for a, b in zip(fb.split_embedding_weights(), nb.split_embedding_weights()):
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape
        torch.testing.assert_close(b, a)  # torch's uniform values, quantized the same way
    rng = np.random.default_rng(3)
    B = 4
    lens = rng.integers(0, 4, len(specs) * B)
    feat = np.repeat(np.arange(len(specs)), B)
    idx = torch.from_numpy(np.concatenate([rng.integers(0, specs[f][0], n) for f, n in zip(feat, lens)]))
    off = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]))
    psw = torch.from_numpy(rng.standard_normal(idx.numel()).astype(np.float32)) if weighted else None
    want, got = fb(idx, off, psw), nb(idx, off, psw)
    if pooling == "NONE":
        table = np.repeat(feat, lens)
        rows = [torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(w) for w in fb.split_embedding_weights()]
        want = torch.stack([rows[t][i] for t, i in zip(table, idx.tolist())])
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().sum() > 0
    for mod in (fb, nb):
        with pytest.raises((NotImplementedError, RuntimeError)):
            mod(idx, off, psw).sum().backward()


@pytest.mark.parametrize(
    "step_ema,step_start,coef,pooling", [(2, 1, 0.6, "SUM"), (1, 3, 0.3, "MEAN"), (3, 0, 0.5, "NONE")]
)
def test_ema_inplace_rowwise_adagrad_like_fbgemm(step_ema, step_start, coef, pooling):
    """EMAINPLACE_ROWWISE_ADAGRAD (which FBGEMM's CPU build runs): rowwise AdaGrad, and every step_ema training
    forwards from step_start on each row's second half moves coef of the way to its first half; both
    lerp branches (coef below and from 0.5) and every pooling."""
    mode = FB.EmainplaceModeDefinition(step_ema=step_ema, step_start=step_start, step_ema_coef=coef)
    specs = [(10, 8), (7, 8), (12, 8)] if pooling == "NONE" else [(10, 8), (7, 4), (12, 16)]
    nb_mode = NB.EmainplaceModeDefinition(step_ema=step_ema, step_start=step_start, step_ema_coef=coef)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        theirs = run(
            FB,
            specs,
            steps=6,
            enums={OPT: ("OptimType", "EMAINPLACE_ROWWISE_ADAGRAD"), "pooling_mode": ("PoolingMode", pooling)},
            learning_rate=0.1,
            emainplace_mode=mode,
        )
        ours = run(
            NB,
            specs,
            steps=6,
            enums={OPT: ("OptimType", "EMAINPLACE_ROWWISE_ADAGRAD"), "pooling_mode": ("PoolingMode", pooling)},
            learning_rate=0.1,
            emainplace_mode=nb_mode,
        )
    for name, a, b in zip(("outputs", "psw grads", "weights"), theirs[:3], ours[:3]):
        for x, y in zip(a, b):
            if x is not None:
                np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, err_msg=name)
    for x, y in zip(theirs[3], ours[3]):
        for sx, sy in zip(x, y):
            np.testing.assert_allclose(sy, sx, rtol=1e-5, atol=1e-6, err_msg="optimizer states")
    # the EMA really ran: without it the second halves would differ
    plain = run(
        NB,
        specs,
        steps=6,
        enums={OPT: ("OptimType", "EXACT_ROWWISE_ADAGRAD"), "pooling_mode": ("PoolingMode", pooling)},
        learning_rate=0.1,
    )
    assert not all(np.allclose(p, o) for p, o in zip(plain[2], ours[2]))


def test_ema_inplace_counts_iter_skips_eval_and_keeps_fbgemms_state():
    """iter advances on every forward (a persistent buffer, as FBGEMM's), eval forwards take no EMA step,
    get_optimizer_state names the rowwise sum, and odd dims are refused."""
    kw = dict(
        optimizer=FB.OptimType.EMAINPLACE_ROWWISE_ADAGRAD,
        learning_rate=0.1,
        emainplace_mode=NB.EmainplaceModeDefinition(step_ema=1, step_start=0, step_ema_coef=0.5),
    )
    tbe = make(NB, [(6, 4)], **kw)
    ref = make(FB, [(6, 4)], **dict(kw, emainplace_mode=FB.EmainplaceModeDefinition(step_ema=1, step_ema_coef=0.5)))
    assert "iter" in tbe.state_dict() and "iter" in ref.state_dict()
    for m in (tbe, ref):
        m.eval()
        before = m.split_embedding_weights()[0].clone()
        m(torch.tensor([0, 1]), torch.tensor([0, 1, 2]))
        assert torch.equal(m.split_embedding_weights()[0], before)
        assert int(m.iter) == 1
        m.train()
        m(torch.tensor([0, 1]), torch.tensor([0, 1, 2])).sum().backward()
    np.testing.assert_allclose(
        tbe.split_embedding_weights()[0].numpy(), ref.split_embedding_weights()[0].numpy(), rtol=1e-6, atol=1e-7
    )
    assert list(tbe.get_optimizer_state()[0]) == list(ref.get_optimizer_state()[0]) == ["sum"]
    with pytest.raises(AssertionError, match="even"):
        make(NB, [(6, 3)], **kw)


@pytest.mark.parametrize("opt", ["EXACT_ROWWISE_ADAGRAD", "EXACT_ADAGRAD", "EXACT_SGD"])
def test_get_states_and_layout_attributes_like_fbgemm(opt):
    """get_states / get_all_states and the placement and offset attributes TorchRec reads, as FBGEMM's CPU build
    lays them out (HOST tables, table after table); the host buffer is the state itself."""
    specs, ftm = [(10, 8), (5, 4)], [0, 1, 0]
    theirs, ours = (make(mod, specs, feature_table_map=ftm, enums={OPT: ("OptimType", opt)}) for mod in (FB, NB))
    a, b = theirs.get_all_states(), ours.get_all_states()
    assert len(a) == len(b) == (1 if opt == "EXACT_SGD" else 2)
    for x, y in zip(a, b):
        assert [tuple(t.shape) for t in x] == [tuple(t.shape) for t in y]
        assert x[3].tolist() == y[3].tolist() and x[4].tolist() == y[4].tolist()
    for name in ("weights_offsets", "weights_placements") + (() if opt == "EXACT_SGD" else ("momentum1_offsets",)):
        assert getattr(ours, name).tolist() == getattr(theirs, name).tolist(), name
    assert ours.weights_physical_offsets == theirs.weights_physical_offsets
    assert ours.get_states("weights")[1].data_ptr() == ours.weights_host.data_ptr()
    with pytest.raises(NB.DoesNotHavePrefix):
        ours.get_states("momentum2")
    with pytest.raises(FB.DoesNotHavePrefix):
        theirs.get_states("momentum2")
    assert set(ours.state_dict()) - {"iter"} <= set(theirs.state_dict())  # the empty buffers are not saved
