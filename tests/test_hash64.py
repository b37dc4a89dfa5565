"""kernels/hash64.py: wrapping uint64 arithmetic equals Python's exact integers mod 2^64, and the
hash kernels that use it (hash table, embedding row init, dropout) raise no overflow warning in the
simulator while keeping their exact values (each is compared bit for bit with its NumPy reference).

Warnings raised inside simulated kernel threads turn into errors here (filterwarnings is global), so
a wrapped scalar product left in a kernel fails these tests.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numbactr.embedding.hash_table import HashTable
from numbactr.kernels import dropout, embedding_init, hash_table, hash64
from tests.kernel_util import dev, host

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

M64 = (1 << 64) - 1
U64 = st.integers(0, M64)
EDGES = [0, 1, 2, 0xFFFFFFFF, 1 << 32, (1 << 32) + 1, 1 << 63, M64 - 1, M64, 0x9E3779B97F4A7C15]


def splitmix_mix_exact(z: int) -> int:
    z = ((z ^ (z >> 30)) * hash64.SPLITMIX_M1) & M64
    z = ((z ^ (z >> 27)) * hash64.SPLITMIX_M2) & M64
    return z ^ (z >> 31)


def fmix_exact(k: int) -> int:
    k = ((k ^ (k >> 33)) * hash64.FMIX_C1) & M64
    k = ((k ^ (k >> 33)) * hash64.FMIX_C2) & M64
    return k ^ (k >> 33)


def run_kernel(a, b):
    a, b = np.array(a, np.uint64), np.array(b, np.uint64)
    outs = [dev(np.zeros_like(a)) for _ in range(4)]
    hash64.wrapping_apply(dev(a), dev(b), *outs)
    return [host(o) for o in outs]


@given(pairs=st.lists(st.tuples(U64, U64), min_size=1, max_size=12))
def test_kernel_equals_exact_integers_mod_2_64(pairs):
    a = [p[0] for p in pairs] + EDGES
    b = [p[1] for p in pairs] + EDGES[::-1]
    prod, total, mixed, fmixed = run_kernel(a, b)
    assert prod.tolist() == [(x * y) & M64 for x, y in zip(a, b)]
    assert total.tolist() == [(x + y) & M64 for x, y in zip(a, b)]
    assert mixed.tolist() == [splitmix_mix_exact(x) for x in a]
    assert fmixed.tolist() == [fmix_exact(x) for x in a]


def test_references_equal_exact_integers():
    a = np.array(EDGES, np.uint64)
    b = a[::-1].copy()
    assert hash64.mul64_ref(a, b).tolist() == [(int(x) * int(y)) & M64 for x, y in zip(a, b)]
    assert hash64.add64_ref(a, b).tolist() == [(int(x) + int(y)) & M64 for x, y in zip(a, b)]
    assert hash64.splitmix64_mix_ref(a).tolist() == [splitmix_mix_exact(int(x)) for x in a]
    assert hash64.fmix64_ref(a).tolist() == [fmix_exact(int(x)) for x in a]


def test_hash_kernels_stay_exact_and_quiet():
    keys = np.array([0, 1, 5, 2**63 + 7, M64 - 1, 123456789012345, 5], np.uint64)
    # hash table: rows in first-occurrence order, identical to the reference
    table = HashTable(16, use_kernels=True, xp=np)
    assert host(table.insert(dev(keys))).tolist() == [0, 1, 2, 3, 4, 5, 2]
    assert host(table.find(dev(keys))).tolist() == [0, 1, 2, 3, 4, 5, 2]
    np.testing.assert_array_equal(hash_table._home_slots_ref(keys, 97), [fmix_exact(int(k)) % 97 for k in keys])
    # embedding rows drawn from a hash of (seed, key, d)
    pool = dev(np.zeros((7, 3), np.float32))
    rows = np.arange(7, dtype=np.int64)
    embedding_init.init_new_rows(pool, dev(rows), dev(keys), 0, 2**64 - 3, -0.05, 0.05)
    np.testing.assert_array_equal(host(pool), embedding_init.row_values_ref(keys, 3, 2**64 - 3, -0.05, 0.05))
    # dropout mask
    x = np.ones(37, np.float32)
    y = dev(np.zeros_like(x))
    dropout.dropout_apply(dev(x), y, 0.5, M64, 2**40, 3)
    np.testing.assert_array_equal(host(y), dropout.dropout_forward_ref(x, 0.5, M64, 2**40, 3))
