"""Run one of NVIDIA's HugeCTR scripts on numbactr, on synthetic data, with its sizes shrunk.

    cd SCRATCH_DIR && python /path/to/numbactr/.ci/hugectr_scripts.py HUGECTR_SCRIPT.py [its arguments]

A maintainer's check of drop-in compatibility beyond the test suite: HugeCTR's samples, pybind tests and
inference tests (fetch NVIDIA-Merlin/HugeCTR; check out a release such as v23.08.00) expect data at their own
paths, usually absolute ones, and run for hours. This runner

1. maps ``hugectr`` to numbactr (numbactr.hugectr_alias does this for ``hugectr.X``; the top-level name is the
   script's own import) and rewrites the script's absolute path literals ("/data/x") to relative ones
   ("./data/x"), creating their folders;
2. runs the script until ``Model.compile``/``fit``, recording the DataReaderParams, Input and embeddings;
3. writes random data of that shape where the reader looks (Norm, Raw, RawAsync or Parquet; one-hot or
   multi-hot; a one-hot embedding's slot offsets), unless the files exist;
4. runs the script again for real, with the training batch at most 512, max_eval_batches at most 4, a
   ``fit`` longer than 2500 iterations (or one that snapshots nothing) cut to 60, and a hand-written loop
   stopped after 80 ``train()`` calls.

It prints "HUGECTR-SCRIPT: OK" when the script finished. Scripts that check an AUC threshold fail on random
data by design; those are read by their error, not their exit status. A script that catches every exception
around its model (HugeCTR's multi-node tests) swallows the first pass's stop and ends there. Not part of the test suite (the scripts
are NVIDIA's; none is copied here); tests/test_ci_scripts.py runs it on a small script of the same shape.
"""

import os
import re
import sys

import numpy as np

os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
import numbactr  # noqa: E402
import numbactr.config as cfg  # noqa: E402
from numbactr.data.file_list import write_file_list  # noqa: E402
from numbactr.data.norm import write_norm_file  # noqa: E402
from numbactr.data.parquet import ParquetDatasetWriter  # noqa: E402
from numbactr.data.raw import write_raw_file  # noqa: E402
from numbactr.data.raw_async import write_raw_async_file  # noqa: E402

MAX_BATCH, MAX_EVAL_BATCHES, SHORT_FIT, LOOP_STEPS = 512, 4, 60, 80


class _Captured(Exception):
    """Raised at compile/fit in the first pass: the data's shape is known by then."""


class _LoopStop(Exception):
    """Raised by train() in a hand-written loop after LOOP_STEPS calls."""


def _load(script):
    text = open(script).read()
    text = re.sub(r"""(["'])/(?!tmp/|usr/|dev/|proc/|etc/|opt/)(?=[A-Za-z_])""", r"\1./", text)
    for m in re.finditer(r"""["']\./((?:[A-Za-z_][\w.\-]*/)+)""", text):
        os.makedirs(m.group(1), exist_ok=True)
    return compile(text, script, "exec")


class Runner:
    def __init__(self, script, argv):
        self.script, self.argv = script, argv
        self.code = _load(script)
        self.first_pass = True
        self.readers, self.inputs, self.layers, self.solver_kw = [], [], [], {}
        self.in_fit, self.loop_steps = False, 0
        self._patch()

    def run(self):
        sys.argv = self.argv
        exec(self.code, {"__name__": "__main__", "__file__": self.script})

    def _patch(self):
        M, run = numbactr.Model, self
        init, add, compile_, fit, train = M.__init__, M.add, M.compile, M.fit, M.train
        create_solver = numbactr.CreateSolver

        def model_init(self, solver, reader, *a, **k):
            run.readers.append(reader)
            return init(self, solver, reader, *a, **k)

        def model_add(self, layer, *a, **k):
            (run.inputs if isinstance(layer, cfg.Input) else run.layers).append(layer)
            return add(self, layer, *a, **k)

        def model_compile(self, *a, **k):
            if run.first_pass:
                raise _Captured()
            return compile_(self, *a, **k)

        def model_fit(self, *a, **k):
            if run.first_pass:
                raise _Captured()
            it = k.get("max_iter", 0)
            if it > 2500 or (it > SHORT_FIT and k.get("snapshot", 10**9) > it):
                k["max_iter"] = SHORT_FIT
                for key in ("display", "eval_interval"):
                    if k.get(key, 0) > SHORT_FIT // 3:
                        k[key] = SHORT_FIT // 3
            if k.get("num_epochs", 0) > 1:
                k["num_epochs"] = 1
            run.in_fit = True
            try:
                return fit(self, *a, **k)
            finally:
                run.in_fit = False

        def model_train(self, *a, **k):
            if not run.in_fit:
                run.loop_steps += 1
                if run.loop_steps > LOOP_STEPS:
                    raise _LoopStop()
            return train(self, *a, **k)

        def solver(**kw):
            run.solver_kw = dict(kw)
            for key, cap in (("batchsize", MAX_BATCH), ("max_eval_batches", MAX_EVAL_BATCHES)):
                if kw.get(key, 0) > cap:
                    kw[key] = cap
            return create_solver(**kw)

        M.__init__, M.add, M.compile, M.fit, M.train = model_init, model_add, model_compile, model_fit, model_train
        numbactr.CreateSolver = solver

    # ---- synthetic data ----------------------------------------------------------------------------
    def write_data(self, rng):
        reader, inp = self.readers[-1], self.inputs[0]
        kind = reader.data_reader_type.name
        nnz = [
            v
            for p in inp.sparse
            for v in (
                list(p.nnz_per_slot) if isinstance(p.nnz_per_slot, (list, tuple)) else [p.nnz_per_slot] * p.slot_num
            )
        ]
        emb_sizes, one_hot = None, False
        for layer in self.layers:
            if isinstance(layer, cfg.SparseEmbedding) and layer.slot_size_array:
                emb_sizes = emb_sizes or list(layer.slot_size_array)
                one_hot = one_hot or "OneHot" in layer.embedding_type.name
        sizes = [int(s) for s in (list(reader.slot_size_array or []) or emb_sizes or [])]
        offsets = np.zeros(len(nnz), np.int64)
        if one_hot and kind in ("Raw", "RawAsync", "Norm") and len(sizes) == len(nnz):
            offsets[1:] = np.cumsum(sizes)[:-1]  # a one-hot table reads globally offset keys
        evals = self.solver_kw.get("batchsize_eval", 2048) * self.solver_kw.get("max_eval_batches", 1)
        rows = int(min(max(4096, evals), 40000))
        L, D = inp.label_dim, inp.dense_dim

        def keys(n):
            out = []
            for k, z in enumerate(nnz):
                hi = max(1, min(sizes[k] if k < len(sizes) and sizes[k] else 1000, 1000))
                out.append(rng.integers(0, hi, size=(n, z) if z > 1 else (n,)) + offsets[k])
            return out

        sources = list(reader.source) if isinstance(reader.source, (list, tuple)) else [reader.source]
        for src in sources + [reader.eval_source]:
            if not src or os.path.exists(src):
                continue
            folder = os.path.dirname(src) or "."
            os.makedirs(folder, exist_ok=True)
            label = rng.integers(0, 2, size=(rows, L))
            if kind == "Parquet":
                w = ParquetDatasetWriter(
                    folder, L, D, len(nnz), list_path=src, multi_hot={k for k, z in enumerate(nnz) if z > 1}
                )
                w.write_file("part_0.parquet", label.astype(np.float32), rng.random((rows, D), np.float32), keys(rows))
                w.close()
            elif kind == "Norm":  # one file per list: a batch never spans files (readers differ there)
                path = os.path.abspath(os.path.join(folder, os.path.basename(src) + ".data"))
                write_norm_file(
                    path,
                    label.astype(np.float32),
                    rng.random((rows, D), np.float32),
                    keys(rows),
                    check=reader.check_type,
                    key_dtype=np.int64 if self.solver_kw.get("i64_input_key") else np.uint32,
                )
                write_file_list(src, [path])
            elif kind == "Raw":
                n = min(max(rows, reader.num_samples or 0, reader.eval_num_samples or 0), 60000)
                f = reader.float_label_dense
                dense = rng.random((n, D), np.float32) if f else rng.integers(0, 100, (n, D))
                lab = rng.integers(0, 2, (n, L))
                write_raw_file(
                    src, lab.astype(np.float32) if f else lab, dense, np.stack(keys(n), axis=1), float_label_dense=f
                )
            elif kind == "RawAsync":
                ap = reader.async_param  # 64-bit keys with i64_input_key, as the reader reads them
                wide, fl = bool(self.solver_kw.get("i64_input_key")), bool(getattr(ap, "is_dense_float", False))
                n = max(rows, 8192)
                dense = rng.random((n, D), np.float32) if fl else rng.integers(0, 100, (n, D))
                write_raw_async_file(
                    src,
                    rng.integers(0, 2, (n, L)),
                    dense,
                    np.concatenate([k.reshape(n, -1) for k in keys(n)], axis=1),
                    fl,
                    wide_keys=wide,
                )


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    script = os.path.abspath(argv[1])
    sys.path.insert(0, os.path.dirname(script))
    run = Runner(script, argv[1:])
    try:
        run.run()
        print("HUGECTR-SCRIPT: OK (no Model.compile: nothing to shrink)")
        return 0
    except _Captured:
        pass
    run.write_data(np.random.default_rng(0))
    run.first_pass = False
    run.readers.clear()
    run.inputs.clear()
    run.layers.clear()
    try:
        run.run()
    except _LoopStop:
        print(f"HUGECTR-SCRIPT: stopped its training loop after {LOOP_STEPS} train() calls")
    print("HUGECTR-SCRIPT: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
