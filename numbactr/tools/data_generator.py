"""hugectr.tools.DataGenerator / DataGeneratorParams (spec §2.6), Norm format.

Norm output: `<dirname(source)>/train/gen_<k>.data` (k < num_files) and
`<dirname(eval_source)>/val/gen_<k>.data` (k < eval_num_files), num_samples_per_file samples each,
framed per check_type; file lists written to `source` / `eval_source` (generation of a split is skipped
when its list file already exists, as HugeCTR does). label and dense ~ U[0, 1) float32 (labels are not
binary); slot k has exactly nnz_array[k] keys in [sum(size[:k]), sum(size[:k+1])) (globally offset),
uniform or power law (alpha: Long 0.9, Medium 1.1, Short 1.3, Specific = alpha).

numbactr extras (keyword arguments): planted_signal=True draws binary labels from a hidden logistic
model over the keys and dense features (numbactr.data.synthetic.PlantedModel, calibrated to a Bayes AUC
of about 0.775 and a CTR of about 0.25); seed makes the output reproducible (None: fresh entropy, like
HugeCTR's std::random_device).
Deviation: a `source` without a '/' puts the data under "./" (HugeCTR's extract_dir returns "" and
writes to "/train/").
HugeCTR: HugeCTR/src/data_generator.cpp, HugeCTR/include/data_generator.hpp,
HugeCTR/include/pybind/data_generator_wrapper.hpp
"""
from __future__ import annotations

import os

import numpy as np

from ..data.file_list import write_file_list
from ..data.norm import NormWriter
from ..data.synthetic import make_planted_model, power_law_keys, uniform_keys
from ..enums import Check_t, DataReaderType_t, Distribution_t, PowerLaw_t

__all__ = ["DataGeneratorParams", "DataGenerator"]

_POWER_LAW_ALPHA = {PowerLaw_t.Long: 0.9, PowerLaw_t.Medium: 1.1, PowerLaw_t.Short: 1.3}


class DataGeneratorParams:
    """All fields are read/write attributes, as in the pybind class."""

    def __init__(self, format, label_dim, dense_dim, num_slot, i64_input_key, source, eval_source,
                 slot_size_array, nnz_array=None, check_type=Check_t.Sum,
                 dist_type=Distribution_t.PowerLaw, power_law_type=PowerLaw_t.Specific, alpha=1.2,
                 num_files=128, eval_num_files=32, num_samples_per_file=40960, num_samples=5242880,
                 eval_num_samples=1310720, float_label_dense=False, num_threads=1, *,
                 planted_signal=False, seed=None):
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
        if (dist_type == Distribution_t.PowerLaw and power_law_type == PowerLaw_t.Specific
                and (self.alpha <= 0 or abs(self.alpha - 1.0) < 1e-6)):
            raise ValueError("alpha should be greater than zero and should not equal to 1.0 for power "
                             "law distribution")
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
            keys.append(uniform_keys(rng, (n, nnz), size) if alpha is None
                        else power_law_keys(rng, (n, nnz), size, alpha))
        return label, dense, keys

    def generate(self) -> None:
        p = self.params
        if p.format == DataReaderType_t.Raw:
            raise NotImplementedError("DataGenerator: the Raw format is not implemented yet, see issue 5")
        if p.format == DataReaderType_t.Parquet:
            raise NotImplementedError("DataGenerator: the Parquet format is not implemented yet, "
                                      "see issue 5")
        if p.format != DataReaderType_t.Norm:
            raise ValueError(f"DataGenerator: unsupported format {p.format!r}")
        rng = np.random.default_rng(p.seed)
        model = None
        if p.planted_signal:
            if p.label_dim < 1:
                raise ValueError("planted_signal needs label_dim >= 1")
            model = make_planted_model(p.slot_size_array, p.dense_dim, rng)
            _, cal_dense, cal_keys = self._sample(rng, 20_000)
            model.calibrate(cal_dense, cal_keys)
        offsets = np.concatenate([[0], np.cumsum(p.slot_size_array)[:-1]]).astype(np.int64)
        key_dtype = np.int64 if p.i64_input_key else np.uint32
        alpha = self._alpha()
        print(f"[numbactr] Generate Norm dataset: slot_size_array {p.slot_size_array}, nnz_array "
              f"{p.nnz_array}, #files train {p.num_files} eval {p.eval_num_files}, #samples per file "
              f"{p.num_samples_per_file}, power law: {alpha is not None}, alpha {alpha or 0.0}")
        for list_path, sub, nfiles in ((p.source, "train", p.num_files),
                                       (p.eval_source, "val", p.eval_num_files)):
            if os.path.exists(list_path):
                print(f"File ({list_path}) exist. To generate new dataset please remove this file.")
                continue
            if nfiles <= 0:
                raise ValueError(f"number of files for {list_path!r} must be > 0, got {nfiles}")
            prefix = _data_dir(list_path) + f"/{sub}/gen_"
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
            paths = []
            for k in range(nfiles):
                path = f"{prefix}{k}.data"
                label, dense, keys = self._sample(rng, p.num_samples_per_file)
                if model is not None:
                    prob = model.probs(dense, keys)
                    label[:, 0] = rng.random(prob.shape[0]) < prob
                    label[:, 1:] = 0.0
                with NormWriter(path, p.label_dim, p.dense_dim, p.num_slot, p.check_type,
                                key_dtype) as w:
                    w.write(label, dense, [kk + off for kk, off in zip(keys, offsets)])
                paths.append(path)
            write_file_list(list_path, paths)
            print(f"{list_path} done!")
