"""Write datasets/criteo/tiny_criteo.tsv: a small, deterministic file in the Criteo click-log format.

    python datasets/criteo/make_fixture.py [--lines 600] [--out datasets/criteo/tiny_criteo.tsv]

Each line: label, 13 integer counts, 26 categorical values as 8-digit hex hashes, tab separated; empty
fields are missing values (as in the real logs: some dense counts and some categories are missing, I2
has negative values). Categories per slot follow a power law over a small vocabulary, so with
HugeCTR's min count of 6 some categories are frequent and many are rare. Labels come from a hidden
logistic model over a few categorical slots and dense counts (CTR about 0.25), so a model trained on
the file beats a coin flip. Nothing here is real Criteo data; the generator is self-contained (NumPy
only) and the output is byte-identical for a given --lines and --seed.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def make_lines(n: int, seed: int = 2024) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab_sizes = rng.integers(3, 120, 26)  # categories per slot
    hashes = [rng.integers(0, 1 << 32, int(v), dtype=np.uint64) for v in vocab_sizes]
    miss_cat = rng.uniform(0.0, 0.25, 26) * (rng.random(26) < 0.5)  # half the slots have missing values
    # power-law category index per slot: P(i) ~ (i + 1)^-1.2
    cats = np.empty((n, 26), dtype=np.int64)
    for k, v in enumerate(vocab_sizes):
        p = (np.arange(v) + 1.0) ** -1.2
        cats[:, k] = rng.choice(int(v), size=n, p=p / p.sum())
    mu = rng.uniform(0.0, 4.0, 13)
    counts = np.floor(np.exp(mu + rng.standard_normal((n, 13)))).astype(np.int64)
    counts[:, 1] -= 3  # I2 goes negative, as in Criteo
    miss_dense = rng.random((n, 13)) < rng.uniform(0.0, 0.4, 13)
    # the hidden model: three slots and two dense counts carry signal
    w = [rng.standard_normal(int(v)) * 1.5 for v in vocab_sizes]
    logit = -1.6 + sum(w[k][cats[:, k]] for k in (0, 5, 11)) / np.sqrt(3)
    log_count = np.log1p(np.maximum(counts, 0))
    logit += 0.6 * (log_count[:, 0] - mu[0]) - 0.4 * (log_count[:, 4] - mu[4])
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    miss = rng.random((n, 26)) < miss_cat
    lines = []
    for i in range(n):
        dense = ["" if miss_dense[i, j] else str(counts[i, j]) for j in range(13)]
        cat = ["" if miss[i, k] else f"{int(hashes[k][cats[i, k]]):08x}" for k in range(26)]
        lines.append("\t".join([str(label[i])] + dense + cat))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=600)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--out", default=os.path.join(HERE, "tiny_criteo.tsv"))
    a = ap.parse_args(argv)
    lines = make_lines(a.lines, a.seed)
    with open(a.out, "w", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.lines} lines to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
