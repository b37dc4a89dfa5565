"""Run FBGEMM's own TBE unit tests against numbactr's FBGEMM face.

    python /path/to/numbactr/.ci/fbgemm_tests.py FBGEMM/fbgemm_gpu/test [pytest arguments]
    e.g.  python .ci/fbgemm_tests.py ~/FBGEMM/fbgemm_gpu/test tbe/training tbe/utils tbe/cache tbe/config

A maintainer's check of drop-in compatibility beyond the test suite. Fetch pytorch/FBGEMM and check out the
tag of the installed fbgemm-gpu-cpu (v1.8.0 here: the tests follow their release's API). FBGEMM's tests build
their reference with torch and FBGEMM's own helpers (fbgemm_gpu.tbe.utils, torch.ops.fbgemm), so fbgemm_gpu
stays installed; this runner, loaded as a pytest plugin before the tests are collected, puts numbactr's
SplitTableBatchedEmbeddingBagsCodegen and DenseTableBatchedEmbeddingBagsCodegen in place of FBGEMM's in
fbgemm_gpu.split_table_batched_embeddings_ops_training, so every test that builds a TBE builds numbactr's.
FBGEMM's GPU-only tests skip themselves on a machine without CUDA; the CPU ones run on numbactr's cpu device.
Set NUMBACTR_FBGEMM_SWAP=0 to run the same tests on FBGEMM itself (the baseline).

Not part of the test suite (the tests are FBGEMM's; none is copied here); tests/test_ci_scripts.py runs it on
a small test file of the same shape.
"""

import os
import pathlib
import subprocess
import sys
import warnings

HERE = pathlib.Path(__file__).resolve().parent
SWAPPED = ("SplitTableBatchedEmbeddingBagsCodegen", "DenseTableBatchedEmbeddingBagsCodegen")
SWAPPED_INFERENCE = ("IntNBitTableBatchedEmbeddingBagsCodegen",)


def _swap() -> None:
    """Replace FBGEMM's TBE classes by numbactr's in FBGEMM's training module (before any test imports them)."""
    os.environ.setdefault("NUMBACTR_DEVICE", "cpu")
    with warnings.catch_warnings():  # fbgemm_gpu warns about its own missing SSD modules
        warnings.simplefilter("ignore", DeprecationWarning)
        import fbgemm_gpu.split_table_batched_embeddings_ops_training as theirs
        import fbgemm_gpu.split_table_batched_embeddings_ops_inference as theirs_inference
    import numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_inference as ours_inference
    import numbactr.fbgemm_gpu.split_table_batched_embeddings_ops_training as ours

    for name in SWAPPED:
        setattr(theirs, name, getattr(ours, name))
    theirs_inference.IntNBitTableBatchedEmbeddingBagsCodegen = ours_inference.IntNBitTableBatchedEmbeddingBagsCodegen
    print(f"fbgemm_tests: FBGEMM's {', '.join(SWAPPED + SWAPPED_INFERENCE)} are numbactr's", file=sys.stderr)


def main(argv) -> int:
    if not argv or not pathlib.Path(argv[0]).is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    test_dir, rest = pathlib.Path(argv[0]).resolve(), argv[1:]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(test_dir), env.get("PYTHONPATH")) if p)
    plugin = ["-p", "fbgemm_tests"] if env.get("NUMBACTR_FBGEMM_SWAP", "1") != "0" else []
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *plugin, "-W", "ignore", *(rest or ["."])]
    return subprocess.call(cmd, cwd=test_dir, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
else:  # loaded by pytest as the plugin `fbgemm_tests`
    _swap()
