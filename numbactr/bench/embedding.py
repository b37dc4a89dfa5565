"""`numbactr bench embedding`: TBE forward and backward+update in GB/s, numbactr's engine beside torch's
nn.EmbeddingBag and FBGEMM's TBE (FBGEMM's byte count: see numbactr/bench/cli.py)."""

import gc

import numpy as np

from numbactr.bench.common import (
    EMBEDDING_BWD_COLUMNS,
    EMBEDDING_FWD_COLUMNS,
    EMBEDDING_PEAK_COLUMNS,
    Env,
    Table,
    _host,
    _peak_cells,
    measure,
    thread_count,
)


# ---- embedding bag (TBE) -----------------------------------------------------------------------
#: the optimizers of `bench embedding`: numbactr's engine kind, FBGEMM's OptimType name (None: FBGEMM's
#: CPU build lacks it), torch's nearest optimizer for sparse gradients
EMBEDDING_OPTIMIZERS = {
    "sgd": ("EXACT_SGD", "EXACT_SGD", "SGD"),
    "rowwise_adagrad": ("EXACT_ROWWISE_ADAGRAD", "EXACT_ROWWISE_ADAGRAD", "Adagrad"),
    "adam": ("ADAM", "ADAM", "SparseAdam"),
}
EMBEDDING_LR = {"sgd": 0.01, "rowwise_adagrad": 0.01, "adam": 0.001}


def embedding_bytes(nbags: int, hot: int, dim: int) -> int:
    """FBGEMM's forward byte count: rows read nbags*L*D*4 + output written nbags*D*4 (float32)."""
    return nbags * hot * dim * 4 + nbags * dim * 4


def state_bytes_per_row(impl: str, optimizer: str, dim: int) -> int:
    """Optimizer-state bytes per table row (float32 states): rowwise AdaGrad 1 value, Adam 2 x D; torch's
    Adagrad keeps D values (it has no rowwise form)."""
    per_element = {"sgd": 0, "rowwise_adagrad": 0, "adam": 2}[optimizer]
    per_row = 1 if optimizer == "rowwise_adagrad" else 0
    if impl.startswith("torch") and optimizer == "rowwise_adagrad":
        per_element, per_row = 1, 0
    return 4 * (per_element * dim + per_row)


def fbgemm_training_module():
    """fbgemm_gpu's training TBE module, or None when fbgemm_gpu is not installed (or fails to load)."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("fbgemm_gpu") is None:
        return None
    with warnings.catch_warnings():  # fbgemm_gpu warns about its own missing SSD modules
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from fbgemm_gpu import split_table_batched_embeddings_ops_training as fb
        except (ImportError, OSError, RuntimeError):
            return None
    return fb


def bench_embedding(
    env: Env,
    *,
    batch: int,
    features: int,
    hots,
    dims,
    rows: int,
    poolings=("sum", "mean"),
    optimizers=tuple(EMBEDDING_OPTIMIZERS),
    threads=(1, 2),
    min_time: float = 1.0,
    seed: int = 0,
) -> list:
    """TBE forward and backward + fused update: numbactr's engine, torch nn.EmbeddingBag + its optimizer,
    FBGEMM's TBE (when installed), side by side per thread count; returns [forward Table, backward Table]."""
    fb = fbgemm_training_module()
    threads = (None,) if env.kind == "gpu" else tuple(threads)
    fwd = Table(
        f"TBE forward ({env.kind})", EMBEDDING_FWD_COLUMNS + (EMBEDDING_PEAK_COLUMNS[:1] if env.peak_gbs else [])
    )
    bwd = Table(
        f"TBE backward + fused optimizer update ({env.kind})",
        EMBEDDING_BWD_COLUMNS + (EMBEDDING_PEAK_COLUMNS[1:] if env.peak_gbs else []),
    )
    nbags = batch * features
    notes = env.header() + [
        f"one float32 table of {rows:,} rows read by {features} features x B={batch:,} samples: nbags = "
        f"{nbags:,} bags of L indices each (rows uniform at random), pooling sum or mean",
        "numbactr: numbactr.embedding.engine.TableBatchedEmbedding (forward; backward = sort/segment by row "
        f"+ the fused optimizer), impl {_engine_impl()}; fbgemm: fbgemm_gpu's SplitTableBatchedEmbedding"
        "BagsCodegen ("
        + ("installed" if fb is not None else "not installed: pip install -e '.[fbgemm]'")
        + "); torch: nn.EmbeddingBag(sparse=True) + torch.optim SGD / Adagrad (elementwise: torch has no "
        "rowwise AdaGrad) / SparseAdam",
        "GB/s as FBGEMM counts: forward bytes = nbags*L*D*4 (rows read) + nbags*D*4 (output); backward + "
        "update bytes = 2 x forward bytes; 'state B/row' = optimizer-state bytes per table row",
        "threads: numbactr's compute threads (numbactr.runtime.threads: numba + BLAS) and torch.set_num_threads "
        "(torch and FBGEMM's CPU kernels) set to the column's value for that row",
        f"learning rates {EMBEDDING_LR}; FBGEMM's CPU build has no ADAM (CUDA only): no fbgemm adam rows",
    ]
    if env.kind == "gpu":
        notes.append(f"peak memory bandwidth: {env.peak_gbs or '?'} GB/s ({env.peak_src})")
    fwd.notes = bwd.notes = notes
    rng = np.random.default_rng(seed)
    for dim in dims:
        pool_h = rng.uniform(-0.05, 0.05, (rows, dim)).astype(np.float32)  # (V, D)
        for hot in hots:
            n = nbags * hot
            shape = [batch, features, hot, dim, rows]
            data = dict(
                pool=pool_h,
                indices=rng.integers(0, rows, n, dtype=np.int64),  # (N,)
                offsets=np.arange(0, n + 1, hot, dtype=np.int64),  # (nbags + 1,)
                dy=rng.standard_normal((batch, features * dim)).astype(np.float32),
            )  # (B, F*D)
            nbytes = embedding_bytes(nbags, hot, dim)
            for pooling in poolings:
                for n_threads in threads:
                    with thread_count(env, n_threads):
                        label = "-" if n_threads is None else n_threads
                        expect = None
                        for impl, runner in _embedding_impls(env, fb):
                            for i, opt in enumerate(optimizers):
                                got = runner(env, data, features, pooling, opt, min_time, fwd=i == 0)
                                # the tables, states and last gradients (GBs at full size) sit in reference
                                # cycles (engine <-> impl, modules); free them before the next one is built
                                gc.collect()
                                if got is None:
                                    continue
                                t_f, t_b, out = got
                                if t_f is not None:
                                    expect = _agree(impl, out, expect, pooling)
                                    fwd.add(
                                        impl,
                                        label,
                                        pooling,
                                        *shape,
                                        1e3 * t_f,
                                        nbytes / t_f / 1e9,
                                        *_peak_cells(env, [nbytes / t_f / 1e9]),
                                    )
                                bwd.add(
                                    impl,
                                    label,
                                    pooling,
                                    opt,
                                    state_bytes_per_row(impl, opt, dim),
                                    *shape,
                                    1e3 * t_b,
                                    2 * nbytes / t_b / 1e9,
                                    *_peak_cells(env, [2 * nbytes / t_b / 1e9]),
                                )
            del data
    return [fwd, bwd]


def _engine_impl() -> str:
    from numbactr.embedding.engine import TableBatchedEmbedding

    return TableBatchedEmbedding([(1, 1)]).impl


def _agree(impl, out, expect, pooling):
    """The first impl's forward output is the reference; every other must agree with it."""
    if expect is None:
        return out
    if not np.allclose(out, expect, rtol=1e-4, atol=1e-5):
        raise AssertionError(
            f"bench embedding: {impl} and numbactr forward ({pooling}) differ by {np.abs(out - expect).max():.3g}"
        )
    return expect


def _embedding_impls(env, fb) -> list:
    impls = [("numbactr", _numbactr_tbe)]
    if env.torch is not None:
        impls.append((env.torch_label, _torch_embedding_bag))
        if fb is not None:
            impls.append(("fbgemm", lambda *a, **k: _fbgemm_tbe(fb, *a, **k)))
    return impls


def _numbactr_tbe(env, data, features, pooling, opt, min_time, fwd):
    """(forward s or None, backward + update s, forward output (B, F*D) on the host)."""
    from numbactr.embedding.engine import Optim, OptimizerSpec, Pooling, TableBatchedEmbedding

    xp = env.xp
    kind = Optim[EMBEDDING_OPTIMIZERS[opt][0]]
    eng = TableBatchedEmbedding(
        [data["pool"].shape],
        [0] * features,
        pooling=Pooling[pooling.upper()],
        optimizer=OptimizerSpec(kind, EMBEDDING_LR[opt]),
    )
    eng.split_weights()[0][...] = xp.asarray(data["pool"])
    idx, offs, dy = (xp.asarray(data[k]) for k in ("indices", "offsets", "dy"))
    out = _host(eng.forward(idx, offs)[0])
    t_f = measure(lambda: eng.forward(idx, offs), sync=env.sync, min_time=min_time) if fwd else None
    held = {}

    def setup():
        held["ctx"] = eng.forward(idx, offs)[1]

    t_b = measure(lambda: eng.backward(held["ctx"], dy), sync=env.sync, setup=setup, min_time=min_time)
    return t_f, t_b, out


def _time_torch_module(env, module, inputs, dy, opt, min_time, fwd):
    """(forward s or None, backward (+ torch optimizer step) s, forward output on the host)."""
    out = module(*inputs).detach().cpu().numpy()
    t_f = measure(lambda: module(*inputs), sync=env.torch_sync, min_time=min_time) if fwd else None
    held = {}

    def setup():
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        held["out"] = module(*inputs)

    def backward_update():
        held["out"].backward(dy)
        if opt is not None:
            # torch's sparse Adagrad builds coalesced tensors; say that no invariant check is wanted (else
            # torch warns that it skips them implicitly)
            with env.torch.sparse.check_sparse_tensor_invariants(enable=False):
                opt.step()

    t_b = measure(backward_update, sync=env.torch_sync, setup=setup, min_time=min_time)
    return t_f, t_b, out


def _torch_embedding_bag(env, data, features, pooling, opt, min_time, fwd):
    torch, dev = env.torch, env.torch_dev
    pool = data["pool"]
    bag = torch.nn.EmbeddingBag(
        pool.shape[0], pool.shape[1], mode=pooling, sparse=True, include_last_offset=True, device=dev
    )
    with torch.no_grad():
        bag.weight.copy_(torch.from_numpy(pool))
    optim = getattr(torch.optim, EMBEDDING_OPTIMIZERS[opt][2])(bag.parameters(), lr=EMBEDDING_LR[opt])
    idx, offs, dy = (torch.from_numpy(data[k]).to(dev) for k in ("indices", "offsets", "dy"))
    batch = dy.shape[0]

    class Bags(torch.nn.Module):
        """The bags are feature-major (f*B + b): output row f*B + b is column block f of sample b."""

        def forward(self, i, o):
            return bag(i, o).view(features, batch, -1).transpose(0, 1).reshape(batch, -1)  # (B, F*D)

    return _time_torch_module(env, Bags(), (idx, offs), dy, optim, min_time, fwd)


def _fbgemm_tbe(fb, env, data, features, pooling, opt, min_time, fwd):
    torch = env.torch
    name = EMBEDDING_OPTIMIZERS[opt][1]
    gpu = env.torch_dev == "cuda"
    if not gpu and name not in ("EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD"):
        return None  # FBGEMM's CPU build runs these three only
    pool = data["pool"]
    location = fb.EmbeddingLocation.DEVICE if gpu else fb.EmbeddingLocation.HOST
    compute = fb.ComputeDevice.CUDA if gpu else fb.ComputeDevice.CPU
    tbe = fb.SplitTableBatchedEmbeddingBagsCodegen(
        [(pool.shape[0], pool.shape[1], location, compute)],
        feature_table_map=[0] * features,
        optimizer=getattr(fb.OptimType, name),
        learning_rate=EMBEDDING_LR[opt],
        pooling_mode=getattr(fb.PoolingMode, pooling.upper()),
    )
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.from_numpy(pool))
    idx, offs, dy = (torch.from_numpy(data[k]).to(env.torch_dev) for k in ("indices", "offsets", "dy"))
    return _time_torch_module(env, tbe, (idx, offs), dy, None, min_time, fwd)
