"""hugectr.tools.DataGenerator / DataGeneratorParams (spec §2.6): Norm, Raw and Parquet.

Norm output: `<dirname(source)>/train/gen_<k>.data` (k < num_files) and
`<dirname(eval_source)>/val/gen_<k>.data` (k < eval_num_files), num_samples_per_file samples each,
framed per check_type; file lists written to `source` / `eval_source` (generation of a split is skipped
when its list file already exists, as HugeCTR does). label and dense ~ U[0, 1) float32 (labels are not
binary); slot k has exactly nnz_array[k] keys in [sum(size[:k]), sum(size[:k+1])) (globally offset),
uniform or power law (alpha: Long 0.9, Medium 1.1, Short 1.3, Specific = alpha).
Raw output: ONE file at `source` with num_samples samples (and `eval_source` with eval_num_samples);
label = i % 2, dense column j = the constant j (int32, or float32 with float_label_dense), one key per
slot in [0, size_k) (per-slot, NOT offset, as HugeCTR writes them: the one-hot embeddings that read Raw data,
LocalizedSlotSparseEmbeddingOneHot and HybridSparseEmbedding, add the slot offsets themselves, spec §5.4);
nnz_array must be all 1; check_type is ignored. Always regenerated.
Parquet output: `<dirname(source)>/train/gen_<k>.parquet` (eval: `/val/`), num_samples_per_file rows
each, columns label0.., C{L+i} conts, C{L+D+k} cats; label and dense U[0, 1) float32, slot k keys in
[0, size_k) (not offset: the reader adds slot_size_array offsets), 1 + U{0..nnz_array[k]-1} keys per
row, a list<int64> column when nnz_array[k] > 1; `_metadata.json` next to the files and the file list
at `source` / `eval_source`. Always regenerated.

numbactr extras (keyword arguments): planted_signal=True draws binary labels from a hidden logistic
model over the keys and dense features (numbactr.data.synthetic.PlantedModel, calibrated to a Bayes AUC
of about 0.775 and a CTR of about 0.25; for Raw the model sees the keys only, the dense columns being
constants); seed makes the output reproducible (None: fresh entropy, like HugeCTR's std::random_device).
Deviations: a `source` without a '/' puts the data under "./" (HugeCTR's extract_dir returns "" and
writes to "/train/").
HugeCTR: HugeCTR/src/data_generator.cpp, HugeCTR/include/data_generator.hpp,
HugeCTR/include/pybind/data_generator_wrapper.hpp
"""

from __future__ import annotations

import os

import numpy as np

from numbactr.data.file_list import write_file_list
from numbactr.data.norm import NormWriter
from numbactr.data.parquet import ParquetDatasetWriter
from numbactr.data.raw import write_raw_file
from numbactr.data.synthetic import make_planted_model, power_law_keys, uniform_keys
from numbactr import log
from numbactr.enums import Check_t, DataReaderType_t, Distribution_t, PowerLaw_t

__all__ = ["DataGeneratorParams", "DataGenerator"]

_POWER_LAW_ALPHA = {PowerLaw_t.Long: 0.9, PowerLaw_t.Medium: 1.1, PowerLaw_t.Short: 1.3}


class DataGeneratorParams:
    """All fields are read/write attributes, as in the pybind class."""

    def __init__(
        self,
        format,
        label_dim,
        dense_dim,
        num_slot,
        i64_input_key,
        source,
        eval_source,
        slot_size_array,
        nnz_array=None,
        check_type=Check_t.Sum,
        dist_type=Distribution_t.PowerLaw,
        power_law_type=PowerLaw_t.Specific,
        alpha=1.2,
        num_files=128,
        eval_num_files=32,
        num_samples_per_file=40960,
        num_samples=5242880,
        eval_num_samples=1310720,
        float_label_dense=False,
        num_threads=1,
        *,
        planted_signal=False,
        seed=None,
    ):
        self.format = format
        self.label_dim = int(label_dim)
        self.dense_dim = int(dense_dim)
        self.num_slot = int(num_slot)
        self.i64_input_key = bool(i64_input_key)
        self.source = str(source)
        self.eval_source = str(eval_source)
        self.slot_size_array = [int(v) for v in slot_size_array]
        self.nnz_array = [int(v) for v in nnz_array] if nnz_array else [1] * self.num_slot
        self.check_type = check_type
        self.dist_type = dist_type
        self.power_law_type = power_law_type
        self.alpha = float(alpha)
        self.num_files = int(num_files)
        self.eval_num_files = int(eval_num_files)
        self.num_samples_per_file = int(num_samples_per_file)
        self.num_samples = int(num_samples)
        self.eval_num_samples = int(eval_num_samples)
        self.float_label_dense = bool(float_label_dense)
        self.num_threads = int(num_threads)
        self.planted_signal = bool(planted_signal)
        self.seed = seed
        # the same checks as the C++ constructor
        if len(self.slot_size_array) != self.num_slot:
            raise ValueError("slot_size_array.size() should be equal to num_slot")
        if len(self.nnz_array) != self.num_slot:
            raise ValueError("nnz_array.size() should be equal to num_slot")
        if (
            dist_type == Distribution_t.PowerLaw
            and power_law_type == PowerLaw_t.Specific
            and (self.alpha <= 0 or abs(self.alpha - 1.0) < 1e-6)
        ):
            raise ValueError("alpha should be greater than zero and should not equal to 1.0 for power law distribution")
        if self.num_threads < 1:
            raise ValueError("must have num_threads at least 1")

    def __repr__(self):
        return "DataGeneratorParams(" + ", ".join(f"{k}={v!r}" for k, v in vars(self).items()) + ")"


def _data_dir(list_path: str) -> str:
    i = list_path.rfind("/")
    return list_path[:i] if i > 0 else ("/" if i == 0 else ".")


class DataGenerator:
    def __init__(self, data_generator_params: DataGeneratorParams):
        self.params = data_generator_params

    def _alpha(self):
        p = self.params
        if p.dist_type != Distribution_t.PowerLaw:
            return None
        return _POWER_LAW_ALPHA.get(p.power_law_type, p.alpha)

    def _sample(self, rng, n):
        """label (n, L), dense (n, D) U[0,1) float32 and LOCAL keys: S arrays (n, nnz_k) int64."""
        p = self.params
        label = rng.random((n, p.label_dim), dtype=np.float32)
        dense = rng.random((n, p.dense_dim), dtype=np.float32)
        alpha = self._alpha()
        keys = []
        for size, nnz in zip(p.slot_size_array, p.nnz_array):
            if size <= 0 and nnz > 0:
                raise ValueError("slot_size_array entries must be > 0 for slots with keys")
            keys.append(
                uniform_keys(rng, (n, nnz), size) if alpha is None else power_law_keys(rng, (n, nnz), size, alpha)
            )
        return label, dense, keys

    def _planted(self, rng, dense_fn=None):
        p = self.params
        if not p.planted_signal:
            return None
        if p.label_dim < 1:
            raise ValueError("planted_signal needs label_dim >= 1")
        model = make_planted_model(p.slot_size_array, p.dense_dim, rng)
        _, cal_dense, cal_keys = self._sample(rng, 20_000)
        if dense_fn is not None:
            cal_dense = dense_fn(cal_dense.shape[0])
        model.calibrate(cal_dense, cal_keys)
        return model

    def _say_labels(self, hugectr_labels: str) -> None:
        """One line on what the labels are: HugeCTR's carry no signal, so a model trained on them scores
        AUC 0.5 whatever it is; a user reading the log should not have to find that out by training."""
        if self.params.planted_signal:
            print("[numbactr] labels: drawn from a hidden logistic model of the features (planted_signal=True)")
        else:
            print(
                f"[numbactr] labels: {hugectr_labels}, as HugeCTR's generator writes them: no model can learn "
                f"them (AUC 0.5); planted_signal=True gives labels with a signal"
            )

    def generate(self) -> None:
        p = self.params
        if p.format == DataReaderType_t.Raw:
            return self._generate_raw()
        if p.format == DataReaderType_t.Parquet:
            return self._generate_parquet()
        if p.format != DataReaderType_t.Norm:
            raise ValueError(f"DataGenerator: unsupported format {p.format!r}")
        rng = np.random.default_rng(p.seed)
        model = self._planted(rng)
        offsets = np.concatenate([[0], np.cumsum(p.slot_size_array)[:-1]]).astype(np.int64)
        key_dtype = np.int64 if p.i64_input_key else np.uint32
        alpha = self._alpha()
        print(
            f"[numbactr] Generate Norm dataset: slot_size_array {p.slot_size_array}, nnz_array "
            f"{p.nnz_array}, #files train {p.num_files} eval {p.eval_num_files}, #samples per file "
            f"{p.num_samples_per_file}, power law: {alpha is not None}, alpha {alpha or 0.0}"
        )
        self._say_labels("uniform random in [0, 1)")
        for list_path, sub, nfiles in ((p.source, "train", p.num_files), (p.eval_source, "val", p.eval_num_files)):
            if os.path.exists(list_path):
                print(f"File ({list_path}) exist. To generate new dataset please remove this file.")
                continue
            if nfiles <= 0:
                raise ValueError(f"number of files for {list_path!r} must be > 0, got {nfiles}")
            prefix = _data_dir(list_path) + f"/{sub}/gen_"
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
            paths = []
            bar = log.progress(total=nfiles * p.num_samples_per_file, desc=f"DataGenerator {list_path}", unit="sample")
            for k in range(nfiles):
                path = f"{prefix}{k}.data"
                label, dense, keys = self._sample(rng, p.num_samples_per_file)
                if model is not None:
                    prob = model.probs(dense, keys)
                    label[:, 0] = rng.random(prob.shape[0]) < prob
                    label[:, 1:] = 0.0
                with NormWriter(path, p.label_dim, p.dense_dim, p.num_slot, p.check_type, key_dtype) as w:
                    w.write(label, dense, [kk + off for kk, off in zip(keys, offsets)])
                paths.append(path)
                bar.update(p.num_samples_per_file)
            bar.close()
            write_file_list(list_path, paths)
            print(f"{list_path} done!")

    # ---- Raw ---------------------------------------------------------------------------------------
    def _generate_raw(self) -> None:
        p = self.params
        if any(v != 1 for v in p.nnz_array):
            raise ValueError(
                f"DataGenerator: the Raw format holds exactly one key per slot; nnz_array must "
                f"be all 1, got {p.nnz_array}"
            )
        rng = np.random.default_rng(p.seed)
        dt = np.float32 if p.float_label_dense else np.int64

        def const_dense(n):  # dense column j = j
            return np.broadcast_to(np.arange(p.dense_dim, dtype=dt), (n, p.dense_dim))

        def reader_dense(n):  # what the reader will hand the model
            d = const_dense(n).astype(np.float32)
            return d if p.float_label_dense else np.log(d + np.float32(1))

        model = self._planted(rng, reader_dense)
        print(
            f"[numbactr] Generate Raw dataset: slot_size_array {p.slot_size_array}, #samples train "
            f"{p.num_samples} eval {p.eval_num_samples}, float_label_dense {p.float_label_dense}"
        )
        self._say_labels("sample index % 2")
        for path, total in ((p.source, p.num_samples), (p.eval_source, p.eval_num_samples)):
            if total <= 0:
                raise ValueError(f"number of samples for {path!r} must be > 0, got {total}")
            if os.path.dirname(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").close()  # truncate; blocks are appended below
            done = 0
            bar = log.progress(total=total, desc=f"DataGenerator {path}", unit="sample")
            while done < total:
                n = min(1 << 20, total - done)
                _, _, keys = self._sample(rng, n)
                label = (np.arange(done, done + n) % 2).reshape(-1, 1)
                label = np.broadcast_to(label, (n, p.label_dim)).astype(dt)
                if model is not None:
                    label = np.zeros((n, p.label_dim), dt)
                    label[:, 0] = rng.random(n) < model.probs(reader_dense(n), keys)
                write_raw_file(
                    path,
                    label,
                    const_dense(n),
                    np.concatenate(keys, axis=1),  # (n, S) per-slot keys in [0, size_k)
                    p.float_label_dense,
                    append=True,
                )
                done += n
                bar.update(n)
            bar.close()
            print(f"{path} done!")

    # ---- Parquet -----------------------------------------------------------------------------------
    def _generate_parquet(self) -> None:
        p = self.params
        rng = np.random.default_rng(p.seed)
        model = self._planted(rng)
        alpha = self._alpha()
        print(
            f"[numbactr] Generate Parquet dataset: slot_size_array {p.slot_size_array}, nnz_array "
            f"{p.nnz_array}, #files train {p.num_files} eval {p.eval_num_files}, #samples per file "
            f"{p.num_samples_per_file}, power law: {alpha is not None}, alpha {alpha or 0.0}"
        )
        self._say_labels("uniform random in [0, 1)")
        multi = {k for k, v in enumerate(p.nnz_array) if v > 1}
        for list_path, sub, nfiles in ((p.source, "train", p.num_files), (p.eval_source, "val", p.eval_num_files)):
            if nfiles <= 0:
                raise ValueError(f"number of files for {list_path!r} must be > 0, got {nfiles}")
            w = ParquetDatasetWriter(
                _data_dir(list_path) + f"/{sub}",
                p.label_dim,
                p.dense_dim,
                p.num_slot,
                multi_hot=multi,
                list_path=list_path,
            )
            bar = log.progress(total=nfiles * p.num_samples_per_file, desc=f"DataGenerator {list_path}", unit="sample")
            for k in range(nfiles):
                n = p.num_samples_per_file
                label, dense, keys = self._sample(rng, n)
                if model is not None:
                    label[:, 0] = rng.random(n) < model.probs(dense, keys)
                    label[:, 1:] = 0.0
                slots = []
                for s, kk in enumerate(keys):
                    if s in multi:  # 1 + rand() % nnz keys per row
                        lens = 1 + rng.integers(0, p.nnz_array[s], n)
                        keep = np.arange(kk.shape[1]) < lens[:, None]
                        slots.append((kk[keep], lens))
                    else:
                        slots.append(kk[:, 0])
                w.write_file(f"gen_{k}.parquet", label, dense, slots)
                bar.update(n)
            bar.close()
            w.close()
            print(f"{list_path} done!")
