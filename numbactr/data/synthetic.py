"""Synthetic CTR data with a planted signal, for end-to-end training checks.

The hidden model (S slots, D dense features, P slot pairs):
  logit = bias + a_s * sum_k mean_j w_k[key_kj]                     slot effects, w_k (V_k,)
               + a_d * ((x - mu) / sd) . u                           dense effect, u (D,)
               + a_i * sum_{(a,b) in pairs} mean v_a[key_a] . mean v_b[key_b]   crosses, v_k (V_k, R)
  label ~ Bernoulli(sigmoid(logit))
(a_s, a_d, a_i) make the three parts carry fixed shares of the logit variance, then a common scale and
the bias are solved so that the expected AUC of the true probabilities (the Bayes-optimal AUC) and the
base CTR hit their targets (default 0.775 and 0.25). An embedding + MLP (+ dot interaction) model can
learn every term. Keys follow a power law per slot (most mass on a few keys, like Criteo), dense
features are lognormal-ish counts stored as log1p(count), as Criteo preprocessing does.

Also here: `roc_auc` (exact, rank based, ties averaged as in sklearn), `criteo_like_slot_sizes`, the
HugeCTR power-law key sampler used by tools.DataGenerator, and `cached_planted_dataset`, which writes a
dataset once per parameter set into a folder named by a hash of the parameters and reuses it after.
HugeCTR: the key sampler mirrors IntPowerLawDataSimulator in HugeCTR/include/data_generator.hpp.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field

import numpy as np

from numbactr import log
from numbactr.runtime import atomic
from numbactr.enums import Check_t
from numbactr.data.file_list import write_file_list
from numbactr.metrics import roc_auc
from numbactr.data.validation import slot_offsets
from numbactr.data.norm_write import NormWriter, key_dtype_of

__all__ = [
    "roc_auc",
    "expected_auc",
    "criteo_like_slot_sizes",
    "power_law_keys",
    "uniform_keys",
    "PlantedModel",
    "make_planted_model",
    "PlantedDataset",
    "make_planted_dataset",
    "cached_planted_dataset",
    "planted_dataset_key",
    "folder_size",
    "CRITEO_KAGGLE_SLOT_SIZES",
]

#: cardinalities of the 26 categorical columns of Criteo Kaggle (HugeCTR's DCN/WDL samples)
#: samples drawn and written per block by make_planted_dataset
_BLOCK = 1 << 16

CRITEO_KAGGLE_SLOT_SIZES = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]


# ---------------------------------------------------------------------------------------------------
# AUC


def expected_auc(p) -> float:
    """Expected AUC of scores p against labels ~ Bernoulli(p) (pairs i != j, ties counted half)."""
    p = np.sort(np.asarray(p, dtype=np.float64).reshape(-1))
    q = 1.0 - p
    # negatives strictly below each position, with equal-p runs split half/half
    starts = np.concatenate([[0], np.flatnonzero(p[1:] != p[:-1]) + 1])
    ends = np.append(starts[1:], p.shape[0])
    cq = np.concatenate([[0.0], np.cumsum(q)])
    run = np.repeat(np.arange(starts.shape[0]), ends - starts)
    below = cq[starts[run]]
    tie_q = cq[ends[run]] - below - q  # other members of the run (self excluded)
    num = float((p * (below + 0.5 * tie_q)).sum())
    den = float(p.sum() * q.sum() - (p * q).sum())
    return num / den if den > 0 else 0.5


# ---------------------------------------------------------------------------------------------------
# cardinalities and key samplers


def criteo_like_slot_sizes(num_slots: int = 26, total_rows: int = 1_000_000) -> list[int]:
    """num_slots deterministic cardinalities summing to total_rows, shaped like Criteo's: sizes are the
    Criteo Kaggle cardinalities raised to a common power (log-sizes scaled), so a few slots are large
    and many small. For num_slots != 26 the sorted log-size profile is interpolated."""
    if num_slots <= 0:
        raise ValueError("num_slots must be > 0")
    if total_rows < 2 * num_slots:
        raise ValueError(f"total_rows must be >= 2 * num_slots = {2 * num_slots}")
    if num_slots == 26:
        logs = np.log(np.array(CRITEO_KAGGLE_SLOT_SIZES, dtype=np.float64))
    else:
        prof = np.sort(np.log(np.array(CRITEO_KAGGLE_SLOT_SIZES, dtype=np.float64)))[::-1]
        logs = np.interp(np.linspace(0, 25, num_slots), np.arange(26), prof)
        logs = logs[np.random.default_rng(num_slots).permutation(num_slots)]

    def sizes(g):
        return np.maximum(2, np.round(np.exp(g * logs))).astype(np.int64)

    lo, hi = 0.0, 4.0
    for _ in range(100):  # sum(sizes(g)) is non-decreasing in g
        mid = 0.5 * (lo + hi)
        if sizes(mid).sum() > total_rows:
            hi = mid
        else:
            lo = mid
    out = sizes(lo)
    out[int(np.argmax(out))] += total_rows - int(out.sum())  # absorb rounding in the largest slot
    return [int(v) for v in out]


def power_law_keys(rng: np.random.Generator, shape, size: int, alpha: float) -> np.ndarray:
    """Keys in [0, size) with P(k) ~ (k+1)^-alpha, by HugeCTR's inverse-CDF formula
    y = ((size^(1-a) - 1) u + 1)^(1/(1-a)), key = round(y) - 1. alpha > 0, alpha != 1.
    As in HugeCTR the rounding gives key 0 only y in [1, 1.5), so key 1 is the most frequent."""
    if alpha <= 0 or abs(alpha - 1.0) < 1e-6:
        raise ValueError("alpha must be > 0 and != 1 for the power law")
    u = rng.random(shape)
    e = 1.0 - alpha
    y = ((float(size) ** e - 1.0) * u + 1.0) ** (1.0 / e)
    return np.clip(np.round(y).astype(np.int64) - 1, 0, size - 1)


def uniform_keys(rng: np.random.Generator, shape, size: int) -> np.ndarray:
    return rng.integers(0, size, shape, dtype=np.int64)


# ---------------------------------------------------------------------------------------------------
# planted model


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _as_slot_mats(slot_keys, n):
    """list of per-slot local keys -> list of (n, nnz_k) int64 matrices."""
    return [np.asarray(k, dtype=np.int64).reshape(n, -1) for k in slot_keys]


@dataclass
class PlantedModel:
    """Hidden logistic model over local (per-slot, 0-based) keys; see the module docstring."""

    slot_sizes: np.ndarray  # (S,)
    slot_weights: list  # S arrays (V_k,)
    dense_weights: np.ndarray  # (D,) unit-norm direction u
    pairs: list  # [(a, b), ...] slot pairs with a latent cross
    latent: dict  # slot -> (V_k, R) latent vectors
    dense_center: np.ndarray = None  # (D,)
    dense_scale: np.ndarray = None  # (D,)
    shares: tuple = (0.5, 0.25, 0.25)  # variance shares: slots, dense, crosses
    weights: np.ndarray = field(default_factory=lambda: np.ones(3))  # (a_s, a_d, a_i)
    bias: float = 0.0

    def components(self, dense, slot_keys) -> np.ndarray:
        """(n, 3) raw parts of the logit: slot effects, dense effect, crosses."""
        dense = np.asarray(dense, dtype=np.float64)
        n = dense.shape[0]
        mats = _as_slot_mats(slot_keys, n)
        out = np.zeros((n, 3))
        for k, m in enumerate(mats):
            if m.shape[1]:
                out[:, 0] += self.slot_weights[k][m].mean(axis=1)
        if dense.shape[1]:
            out[:, 1] = ((dense - self.dense_center) / self.dense_scale) @ self.dense_weights
        for a, b in self.pairs:
            if mats[a].shape[1] and mats[b].shape[1]:
                va = self.latent[a][mats[a]].mean(axis=1)  # (n, R)
                vb = self.latent[b][mats[b]].mean(axis=1)
                out[:, 2] += (va * vb).sum(axis=1)
        return out

    def logits(self, dense, slot_keys) -> np.ndarray:
        return self.bias + self.components(dense, slot_keys) @ self.weights

    def probs(self, dense, slot_keys) -> np.ndarray:
        return _sigmoid(self.logits(dense, slot_keys))

    def calibrate(self, dense, slot_keys, target_auc: float = 0.775, target_ctr: float = 0.25):
        """Fit dense centering, the component weights and the bias on a calibration sample so that the
        expected (Bayes-optimal) AUC and the mean probability hit the targets."""
        dense = np.asarray(dense, dtype=np.float64)
        if dense.shape[1]:
            self.dense_center = dense.mean(axis=0)
            self.dense_scale = np.where(dense.std(axis=0) > 0, dense.std(axis=0), 1.0)
        c = self.components(dense, slot_keys)
        sd = c.std(axis=0)
        unit = np.where(sd > 0, np.sqrt(np.asarray(self.shares, dtype=np.float64)) / np.where(sd > 0, sd, 1), 0.0)
        z = (c - c.mean(axis=0)) @ unit  # ~ unit variance
        mean_shift = float(c.mean(axis=0) @ unit)

        def bias_for(scale):  # mean sigmoid(b + scale z) = ctr
            lo, hi = -30.0, 30.0
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                if _sigmoid(mid + scale * z).mean() > target_ctr:
                    hi = mid
                else:
                    lo = mid
            return 0.5 * (lo + hi)

        lo, hi = 0.0, 20.0
        for _ in range(40):  # expected AUC grows with scale
            mid = 0.5 * (lo + hi)
            if expected_auc(_sigmoid(bias_for(mid) + mid * z)) > target_auc:
                hi = mid
            else:
                lo = mid
        scale = 0.5 * (lo + hi)
        self.weights = scale * unit
        self.bias = bias_for(scale) - scale * mean_shift
        return self


def _rarity_scale(size: int, head: float) -> np.ndarray:
    """(size,) weight scale per key: 1 for the frequent head, falling as (1 + k/head)^-1/2 for rarer keys."""
    return (1.0 + np.arange(size) / head) ** -0.5 if head > 0 else np.ones(size)


def make_planted_model(
    slot_sizes,
    dense_dim: int,
    rng: np.random.Generator,
    num_pairs: int = 3,
    latent_dim: int = 4,
    shares=(0.5, 0.25, 0.25),
    head: float = 50.0,
) -> PlantedModel:
    """Draw the hidden weights (uncalibrated; call .calibrate on a sample of the data).

    Key k of a slot (k = popularity rank under the power law) gets weights scaled by
    (1 + k/head)^-1/2: as in real click logs, rare categories carry little signal. Without this the
    Bayes-optimal AUC would rest on keys seen once or twice, which no trainer can learn from the sample;
    with it the gap from 0.5 to the Bayes AUC measures the trainer. head <= 0 keeps equal scales."""
    sizes = np.asarray(slot_sizes, dtype=np.int64)
    S = sizes.shape[0]
    slot_w = [rng.standard_normal(int(v)) * _rarity_scale(int(v), head) for v in sizes]
    u = rng.standard_normal(dense_dim)
    u = u / np.linalg.norm(u) if dense_dim else u
    cand = [(a, b) for a in range(S) for b in range(a + 1, S)]
    pick = rng.permutation(len(cand))[: min(num_pairs, len(cand))] if cand else []
    pairs = [cand[i] for i in sorted(pick)]
    latent = {}
    for a, b in pairs:
        for k in (a, b):
            if k not in latent:
                latent[k] = (
                    rng.standard_normal((int(sizes[k]), latent_dim)) * _rarity_scale(int(sizes[k]), head)[:, None]
                )
    shares = tuple(float(x) for x in shares)
    if not dense_dim:
        shares = (shares[0], 0.0, shares[2])
    if not pairs:
        shares = (shares[0], shares[1], 0.0)
    return PlantedModel(sizes, slot_w, u, pairs, latent, np.zeros(dense_dim), np.ones(dense_dim), shares)


# ---------------------------------------------------------------------------------------------------
# planted Criteo-like dataset on disk


@dataclass
class PlantedDataset:
    out_dir: str
    train_list: str  # <out_dir>/train/_file_list.txt
    eval_list: str  # <out_dir>/eval/_file_list.txt
    train_files: list
    eval_files: list
    slot_size_array: list  # per-slot cardinalities; keys are globally offset by their prefix sum
    dense_dim: int
    num_train: int
    num_eval: int
    bayes_auc: float  # roc_auc(eval labels, true eval probabilities)
    eval_probs: np.ndarray  # (num_eval,) true P(label = 1) of every eval sample, file order
    eval_labels: np.ndarray  # (num_eval,) drawn labels
    train_ctr: float
    eval_ctr: float
    check: object = Check_t.Sum
    key_dtype: np.dtype = np.dtype(np.int64)
    model: PlantedModel = None

    @property
    def slot_offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.slot_size_array)[:-1]]).astype(np.int64)


def _sample_features(rng, n, dense_mu, dense_sigma, dense_zero_p, sizes, alpha):
    """dense (n, D) float32 log1p(counts) and local keys (n, S) int64, power-law per slot."""
    D = dense_mu.shape[0]
    counts = np.floor(np.exp(dense_mu + dense_sigma * rng.standard_normal((n, D))))
    counts[rng.random((n, D)) < dense_zero_p] = 0.0  # Criteo's many missing/zero counts
    dense = np.log1p(counts).astype(np.float32)
    keys = np.empty((n, sizes.shape[0]), dtype=np.int64)
    for k, v in enumerate(sizes):
        keys[:, k] = power_law_keys(rng, n, int(v), alpha)
    return dense, keys


def make_planted_dataset(
    out_dir,
    num_train: int,
    num_eval: int,
    dense_dim: int = 13,
    slot_sizes=None,
    total_rows: int = 100_000,
    seed: int = 0,
    files=(4, 1),
    alpha: float = 1.2,
    target_auc: float = 0.775,
    target_ctr: float = 0.25,
    num_pairs: int = 3,
    check=Check_t.Sum,
    key_dtype=np.int64,
    calibration_samples: int = 50_000,
) -> PlantedDataset:
    """Write a Criteo-like Norm dataset (one-hot slots, label_dim 1) with a planted logistic signal.

    slot_sizes defaults to criteo_like_slot_sizes(26, total_rows). files = (train files, eval files)
    or one int for both. Keys are globally offset: slot k's keys lie in
    [sum(slot_sizes[:k]), sum(slot_sizes[:k+1])). Deterministic for a given seed.
    """
    if slot_sizes is None:
        slot_sizes = criteo_like_slot_sizes(26, total_rows)
    sizes = np.asarray(slot_sizes, dtype=np.int64)
    if sizes.ndim != 1 or sizes.shape[0] == 0 or (sizes <= 0).any():
        raise ValueError(f"slot_sizes must be a non-empty list of positive sizes, got {slot_sizes}")
    n_tr_files, n_ev_files = (files, files) if isinstance(files, (int, np.integer)) else files
    if num_train < n_tr_files or num_eval < n_ev_files or n_tr_files < 1 or n_ev_files < 1:
        raise ValueError("need at least one sample per file and at least one file per split")
    rng = np.random.default_rng(seed)
    dense_mu = rng.uniform(0.0, 4.0, dense_dim)
    dense_sigma = rng.uniform(0.5, 1.5, dense_dim)
    dense_zero_p = rng.uniform(0.0, 0.4, dense_dim)
    model = make_planted_model(sizes, dense_dim, rng, num_pairs=num_pairs)
    cal_dense, cal_keys = _sample_features(rng, calibration_samples, dense_mu, dense_sigma, dense_zero_p, sizes, alpha)
    model.calibrate(cal_dense, list(cal_keys.T), target_auc, target_ctr)
    offsets = slot_offsets(sizes)

    out_dir = os.path.abspath(os.fspath(out_dir))
    result = {}
    with log.progress(total=num_train + num_eval, desc="planted-signal data", unit="sample") as bar:
        for split, num, nf in (("train", num_train, n_tr_files), ("eval", num_eval, n_ev_files)):
            d = os.path.join(out_dir, split)
            os.makedirs(d, exist_ok=True)
            paths, probs_all, labels_all = [], [], []
            for f, n in enumerate(np.diff(np.linspace(0, num, nf + 1).astype(np.int64))):
                path = os.path.join(d, f"part_{f}.data")
                with NormWriter(path, 1, dense_dim, sizes.shape[0], check, key_dtype) as w:
                    for lo in range(0, int(n), _BLOCK):  # blocks: bounded memory, live progress
                        m = min(_BLOCK, int(n) - lo)
                        dense, keys = _sample_features(rng, m, dense_mu, dense_sigma, dense_zero_p, sizes, alpha)
                        p = model.probs(dense, list(keys.T))
                        label = (rng.random(m) < p).astype(np.float32)
                        w.write(label.reshape(-1, 1), dense, keys + offsets)  # (m, S) global keys
                        probs_all.append(p)
                        labels_all.append(label)
                        bar.update(m)
                paths.append(path)
            lst = os.path.join(d, "_file_list.txt")
            write_file_list(lst, paths)
            result[split] = (lst, paths, np.concatenate(probs_all), np.concatenate(labels_all))
    ev_probs, ev_labels = result["eval"][2], result["eval"][3]
    bayes = roc_auc(ev_labels, ev_probs) if 0 < ev_labels.sum() < ev_labels.shape[0] else float("nan")
    return PlantedDataset(
        out_dir,
        result["train"][0],
        result["eval"][0],
        result["train"][1],
        result["eval"][1],
        [int(v) for v in sizes],
        dense_dim,
        num_train,
        num_eval,
        bayes,
        ev_probs,
        ev_labels,
        float(result["train"][3].mean()),
        float(ev_labels.mean()),
        check,
        key_dtype_of(key_dtype),
        model,
    )


# ---------------------------------------------------------------------------------------------------
# generated once per parameter set, then reused

#: bump when make_planted_dataset draws different data for the same parameters (invalidates caches)
PLANTED_VERSION = 2
MANIFEST = "dataset.json"


def planted_dataset_key(**params) -> str:
    """'planted-<12 hex>': a name that changes with every parameter of make_planted_dataset."""
    blob = json.dumps({"version": PLANTED_VERSION, **params}, sort_keys=True, default=str)
    return "planted-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def cached_planted_dataset(cache_dir, regenerate: bool = False, **params) -> tuple[PlantedDataset, bool]:
    """make_planted_dataset(<cache_dir>/<planted_dataset_key(params)>, **params), generated once.

    The folder holds the Norm files, eval_probs.npy / eval_labels.npy and dataset.json (the parameters,
    the Bayes AUC, every file with its size), written last: a run stopped while writing leaves no
    manifest and the next run writes the set again; so does a file whose size no longer matches.
    regenerate=True always writes it anew. Returns (dataset, reused). A reused dataset has model=None
    (the hidden weights are not stored); everything else is as make_planted_dataset returned it.
    """
    params = dict(params)
    if params.get("slot_sizes") is not None:
        params["slot_sizes"] = [int(v) for v in params["slot_sizes"]]
    key_params = {k: (v.name if isinstance(v, Check_t) else v) for k, v in params.items()}
    if "key_dtype" in key_params:
        key_params["key_dtype"] = np.dtype(key_params["key_dtype"]).name
    d = os.path.join(os.path.abspath(os.fspath(cache_dir)), planted_dataset_key(**key_params))
    manifest = os.path.join(d, MANIFEST)
    if not regenerate:
        found = _load_planted(d, manifest)
        if found is not None:
            return found, True
    if os.path.isdir(d):
        shutil.rmtree(d)
    data = make_planted_dataset(d, **params)
    np.save(os.path.join(d, "eval_probs.npy"), data.eval_probs)
    np.save(os.path.join(d, "eval_labels.npy"), data.eval_labels)
    files = {os.path.relpath(f, d): os.path.getsize(f) for f in data.train_files + data.eval_files}
    info = {
        "params": key_params,
        "version": PLANTED_VERSION,
        "bayes_auc": data.bayes_auc,
        "slot_size_array": data.slot_size_array,
        "dense_dim": data.dense_dim,
        "num_train": data.num_train,
        "num_eval": data.num_eval,
        "train_ctr": data.train_ctr,
        "eval_ctr": data.eval_ctr,
        "check": data.check.name,
        "key_dtype": np.dtype(data.key_dtype).name,
        "train_files": [os.path.relpath(f, d) for f in data.train_files],
        "eval_files": [os.path.relpath(f, d) for f in data.eval_files],
        "file_sizes": files,
    }
    with atomic.atomic_write(manifest, "w") as f:
        json.dump(info, f, indent=1)
    return data, False


def _load_planted(d: str, manifest: str) -> PlantedDataset | None:
    """The dataset described by a complete manifest whose files are all there at their sizes, else None."""
    try:
        with open(manifest) as f:
            info = json.load(f)
        if info.get("version") != PLANTED_VERSION:
            return None
        for rel, size in info["file_sizes"].items():
            if os.path.getsize(os.path.join(d, rel)) != size:
                return None
        probs = np.load(os.path.join(d, "eval_probs.npy"))
        labels = np.load(os.path.join(d, "eval_labels.npy"))
    except (OSError, ValueError, KeyError):
        return None
    return PlantedDataset(
        d,
        os.path.join(d, "train", "_file_list.txt"),
        os.path.join(d, "eval", "_file_list.txt"),
        [os.path.join(d, r) for r in info["train_files"]],
        [os.path.join(d, r) for r in info["eval_files"]],
        info["slot_size_array"],
        info["dense_dim"],
        info["num_train"],
        info["num_eval"],
        info["bayes_auc"],
        probs,
        labels,
        info["train_ctr"],
        info["eval_ctr"],
        Check_t[info["check"]],
        np.dtype(info["key_dtype"]),
        None,
    )


def folder_size(path) -> int:
    """Bytes of the files under path."""
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
