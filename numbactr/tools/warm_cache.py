"""Compile numbactr's CPU kernels ahead of use: ``python -m numbactr.tools.warm_cache``.

The cpu device's hot ops are Numba functions compiled on first use and cached on disk (``cache=True``,
next to their sources or under ``NUMBA_CACHE_DIR``). A fresh install pays that compile in the first
steps: about 30-40 s for each type signature of the embedding engine's forward and fused update, a few
minutes in all. This runs those first uses on tiny inputs (the engine in every weights precision, index
type, pooling and layout; the hash table; the dot interaction; MultiCross and PReLU_Dice; LayerNorm and
softmax; two training steps of the demo's DLRM, which compile the dense ops), so that a container image, a CI
job or a test run finds them compiled. It changes no state but Numba's cache; running it twice costs seconds.

tests/conftest.py starts it in a background process when a test session begins, so a fresh clone's
test run compiles on the second core while its first tests run.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import numpy as np


def _engine_cases():
    """Both cpu pipelines: the small-table one (gather, sort-free update) these tiny tables take, and the
    sorted one every larger table takes (forced here by setting the small-table limit to 0)."""
    from numbactr.embedding.engine.impl_cpu import _CpuImpl

    limit = _CpuImpl.small_rows
    try:
        for small_rows in (limit, 0):
            _CpuImpl.small_rows = small_rows
            _engine_pipeline_cases()
    finally:
        _CpuImpl.small_rows = limit


def _engine_pipeline_cases():
    from numbactr.embedding.engine import (
        Layout,
        Optim,
        OptimizerSpec,
        Pooling,
        Precision,
        TableBatchedEmbedding,
        UpdateType,
    )

    rng = np.random.default_rng(0)
    for wp, itype, pooling, layout, psw in itertools.product(
        (Precision.FP32, Precision.FP16),
        (np.int64, np.int32),
        (Pooling.SUM, Pooling.MEAN, Pooling.NONE),
        (Layout.FEATURE_MAJOR, Layout.SAMPLE_MAJOR),
        (False, True),
    ):
        eng = TableBatchedEmbedding(
            [(50, 8), (40, 8)],
            [0, 1, 1],
            pooling=pooling,
            layout=layout,
            weights_precision=wp,
            optimizer=OptimizerSpec(Optim.EXACT_ROWWISE_ADAGRAD, 0.01),
        )
        batch = 4
        lengths = rng.integers(0, 3, 3 * batch)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(itype)
        indices = rng.integers(0, 40, int(offsets[-1])).astype(itype)
        weights = rng.random(indices.shape[0]).astype(np.float32) if psw else None
        out, ctx = eng.forward(indices, offsets, weights)
        eng.backward(ctx, np.ones_like(out, dtype=np.float32))
    for kind, update in (
        (Optim.HUGECTR_ADAM, UpdateType.GLOBAL),
        (Optim.HUGECTR_ADAM, UpdateType.LAZY_GLOBAL),
        (Optim.NONE, UpdateType.LOCAL),
    ):
        eng = TableBatchedEmbedding([(30, 4)], [0, 0], optimizer=OptimizerSpec(kind, 0.01, update_type=update))
        out, ctx = eng.forward(np.arange(8, dtype=np.int64), np.arange(0, 9, 2, dtype=np.int64))
        eng.backward(ctx, np.ones_like(out))


def _hash_and_dense_cases():
    from numbactr.embedding.hash_table import HashTable
    from numbactr.kernels import interaction

    table = HashTable(100, use_kernels=False, compiled=True)
    for dtype in (np.int64, np.uint64, np.int32):
        keys = np.arange(1, 21, dtype=dtype)
        table.insert(keys)  # (the direct index: kernels/hash_table_cpu.direct_rows, direct_note)
        table.find(keys)
    big = np.arange(1, 5, dtype=np.uint64) << np.uint64(40)  # keys past the direct index: hashed
    table.insert(big)
    hashed = HashTable(100, use_kernels=False, compiled=True, direct=False)
    hashed.insert(big)
    hashed.find(big)
    # inference's warm-request pass (ModelCache.serve_pooled); its arrays' types are fixed, so one signature
    from numbactr.kernels.hash_table_cpu import serve_cached_cpu

    tkeys, trows = table.probe_arrays()
    keys = np.arange(1, 5, dtype=np.uint64)
    serve_cached_cpu(
        tkeys,
        trows,
        keys,
        np.arange(5, dtype=np.int64),
        np.arange(100, dtype=np.int64),
        0,
        0,
        np.zeros(400, np.float32),
        4,
        4,
        False,
        np.empty(4, np.int64),
        np.zeros(100, np.int64),
        np.zeros(100, np.int64),
        1,
        np.empty(4, np.float32),
        np.empty(16, np.float32),
    )
    b, s, v = 3, 4, 8
    dense = np.ones((b, v), np.float32)
    emb = np.ones((b, s, v), np.float32)
    out = np.empty((b, interaction.interaction_out_width(s, v)), np.float32)
    interaction.interaction_forward_cpu(dense, emb, out)
    interaction.interaction_backward_cpu(dense, emb, out, np.empty_like(dense), np.empty_like(emb))


def _cross_and_dice_cases():
    """The compiled CPU passes of MultiCross (DCN v1 and v2), PReLU_Dice (DIN; both backward formulas) and DIN's
    fused activation-unit input."""
    from numbactr.kernels import multi_cross, prelu_dice

    b, d = 3, 4
    x, row, col = np.ones((b, d), np.float32), np.ones(b, np.float32), np.ones(d, np.float32)
    e = np.empty_like
    multi_cross.v1_forward_cpu(x, x, col, col, e(x), e(row))
    multi_cross.v1_backward_cpu(x, x, x, col, row, True, e(x), e(x), e(row), e(col), e(col))
    multi_cross.v2_forward_cpu(x, x, x, col, e(x))
    multi_cross.v2_backward_cpu(x, None, x, x, col, True, e(x), e(x), e(col))
    multi_cross.v2_backward_cpu(x, x.copy(), x, x, col, False, e(x), e(x), e(col))
    mean, inv = e(col), e(col)
    prelu_dice.prelu_dice_forward_cpu(x, 0.2, 1e-5, e(x), mean, inv)
    for exact in (False, True):
        prelu_dice.prelu_dice_backward_cpu(x, x, 0.2, mean, inv, exact, e(x))
    from numbactr.kernels import activation_unit  # DIN's fused activation-unit input (the planned step's)

    h = np.ones((2 * b, d), np.float32)
    y = activation_unit.activation_input(x, h, 2)
    for dh0 in (None, h):
        activation_unit.activation_input_backward(x, h, 2, y, dh0)


def _norm_softmax_cases():
    """LayerNorm and the softmax rows (plain and masked) compiled for the CPU: attention models' dense ops."""
    from numbactr.kernels import layer_norm, softmax

    x = np.linspace(-1.0, 1.0, 2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    y, dx = np.empty_like(x), np.empty_like(x)
    softmax.softmax_forward_cpu(x, y)
    softmax.masked_softmax_forward_cpu(x, np.ones((2, 1, 1, 5), np.float32), y, 1.0)
    softmax.softmax_backward_cpu(y, x, dx)
    x2, g = x.reshape(-1, 5), np.ones(5, np.float32)
    mean, inv = np.empty(x2.shape[0], np.float32), np.empty(x2.shape[0], np.float32)
    layer_norm.layer_norm_forward_cpu(x2, g, g, 1e-5, y.reshape(-1, 5), mean, inv)
    layer_norm.layer_norm_backward_cpu(x2, x2, g, mean, inv, dx.reshape(-1, 5), np.empty_like(g), np.empty_like(g))


def _model_cases():
    """Two training steps and an evaluation of the demo's DLRM on a few generated samples: the dense ops'
    compiled CPU code as a first training run meets it (bias, ReLU, the interaction, BCE, the dense Adam
    update), and the engine and hash table in the signatures a model uses."""
    import contextlib
    import io
    import os
    import tempfile

    import numbactr as hugectr

    from numbactr import demo
    from numbactr.data.synthetic import make_planted_dataset

    with tempfile.TemporaryDirectory(prefix="numbactr-warm-cache-") as tmp:
        data = make_planted_dataset(
            os.path.join(tmp, "data"),
            num_train=64,
            num_eval=32,
            slot_sizes=[3] * 26,
            files=(1, 1),
            calibration_samples=2_000,
        )
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            model = demo.build_dlrm(
                hugectr,
                data.train_list,
                data.eval_list,
                batch=32,
                batch_eval=32,
                eval_batches=1,
                lr=1e-3,
                workspace_mb=1,
            )
            model.fit(max_iter=2, display=1, eval_interval=2, snapshot=0)


STEPS = (
    ("embedding engine", _engine_cases),
    ("hash table, interaction", _hash_and_dense_cases),
    ("MultiCross, PReLU_Dice, activation unit", _cross_and_dice_cases),
    ("LayerNorm, softmax", _norm_softmax_cases),
    ("a DLRM's dense ops", _model_cases),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m numbactr.tools.warm_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quiet", action="store_true", help="print nothing")
    ap.add_argument(
        "--threads",
        type=int,
        action="append",
        metavar="N",
        help="compile for runs of N numba threads (repeatable; default: 1 and numba's thread count, "
        "since one-thread runs call the parallel functions' serial twins)",
    )
    args = ap.parse_args(argv)
    import warnings
    from numbactr.runtime import device

    before = device.kind()
    device.set_device("cpu")  # the compiled CPU ops, whatever the process's default device
    import numba

    threads_before = numba.get_num_threads()
    # parallel functions have a serial twin for one-thread runs (kernels.parallel_cpu.pjit): compile both
    counts = sorted(set(args.threads or (1, numba.config.NUMBA_NUM_THREADS)))
    if any(n < 1 or n > numba.config.NUMBA_NUM_THREADS for n in counts):
        ap.error(f"--threads must lie in 1..{numba.config.NUMBA_NUM_THREADS} (NUMBA_NUM_THREADS), got {counts}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the bounds-check warnings of random tiny inputs are not news
            for n in counts:
                numba.set_num_threads(n)
                for name, step in STEPS:
                    t = time.time()
                    step()
                    if not args.quiet:
                        print(
                            f"warm_cache: {name} compiled for {n} thread{'s' if n > 1 else ''} "
                            f"({time.time() - t:.1f} s)",
                            flush=True,
                        )
    finally:
        numba.set_num_threads(threads_before)
        device.set_device(before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
