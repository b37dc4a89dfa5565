"""Byte-mutation fuzz of snapshot files: every flipped bit, truncation or insertion gives a clear error (one
that names the damaged file or the manifest) or values identical to the original; never other values.

With the manifest every file is covered, a flipped bit inside a float included (sha256). Without it
(HugeCTR's own snapshots) a flipped bit inside a value, or a changed digit in the .ntp.json, reads as
another valid value and cannot be detected (numbactr/files/checkpoint.py says so); truncations and insertions
of the binary files still can, and that is what the second test asserts.
"""

import os

import numpy as np
import pytest

from numbactr.runtime import device
from numbactr.data.errors import DataFormatError
from tests.model_util import tiny_data
from tests.mpi.snapshot_run import build, load_all, state

FILES = [
    "ck_dense_3.model",
    "ck_opt_dense_3.model",
    "ck_dense_3.model.ntp.json",
    "ck0_sparse_3.model/key",
    "ck0_sparse_3.model/emb_vector",
    "ck0_sparse_3.model/slot_id",
    "ck0_opt_sparse_3.model",
]
MANIFEST = "ck_3.manifest.json"


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    before = device.kind()
    device.set_device("cpu")
    folder = tmp_path_factory.mktemp("fuzz")
    data = tiny_data(str(folder), n_train=240, n_eval=96)
    a = build(*data)
    for _ in range(3):
        a.train()
    a.save_params_to_files(str(folder / "ck"), 3)
    yield folder, data, state(a)
    device.set_device(before)


def mutations(raw: bytes, seed: int, flips=6, cuts=3, inserts=3):
    """(description, mutated bytes): bit flips, truncations (to 0 bytes too), insertions of 1-9 bytes."""
    rng = np.random.default_rng(seed)
    for pos, bit in zip(rng.integers(0, len(raw), flips), rng.integers(0, 8, flips)):
        b = bytearray(raw)
        b[pos] ^= 1 << int(bit)
        yield f"bit {bit} of byte {pos} flipped", bytes(b)
    for size in [0, *rng.integers(1, len(raw), cuts - 1)]:
        yield f"truncated to {size} bytes", raw[:size]
    for pos, n in zip(rng.integers(0, len(raw) + 1, inserts), rng.integers(1, 10, inserts)):
        yield f"{n} bytes inserted at {pos}", raw[:pos] + rng.integers(0, 256, n, dtype=np.uint8).tobytes() + raw[pos:]


def outcome(folder, data, name):
    """None when the whole snapshot loaded; else the error, which must be clear: a DataFormatError or
    FileNotFoundError naming the damaged file or the manifest."""
    model = build(*data, seed=5)
    try:
        load_all(model, str(folder / "ck"), 3)
    except (DataFormatError, FileNotFoundError) as e:
        assert os.path.basename(name) in str(e) or MANIFEST in str(e), f"{name}: unclear error: {e}"
        return e
    return state(model)


def check(snapshot, files, **kinds):
    folder, data, want = snapshot
    tried = errors = 0
    for seed, name in enumerate(files):
        file = folder / name
        raw = file.read_bytes()
        try:
            for what, mutated in mutations(raw, seed, **kinds):
                if mutated == raw:
                    continue
                file.write_bytes(mutated)
                got = outcome(folder, data, name)
                tried += 1
                if isinstance(got, Exception):
                    errors += 1
                    continue
                assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want), (
                    f"{name} ({what}) loaded other values"
                )
        finally:
            file.write_bytes(raw)
    return tried, errors


def test_with_the_manifest_every_mutation_is_an_error_or_harmless(snapshot):
    tried, errors = check(snapshot, FILES + [MANIFEST])
    assert tried >= 90 and errors >= tried - 3  # only JSON whitespace changes can be harmless


def test_without_it_truncation_and_insertion_are_still_caught(snapshot):
    folder = snapshot[0]
    manifest = (folder / MANIFEST).read_bytes()
    os.remove(folder / MANIFEST)
    try:
        binary = [f for f in FILES if not f.endswith(".json")]
        tried, errors = check(snapshot, binary, flips=0, cuts=4, inserts=4)
        assert tried == 8 * len(binary) and errors == tried
    finally:
        (folder / MANIFEST).write_bytes(manifest)
