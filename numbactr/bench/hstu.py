"""``numbactr bench hstu``: HSTU's jagged attention, forward and backward, beside the same math in PyTorch.

What it compares: numbactr's ``hstu_attn_varlen_func`` and ``hstu_attn_varlen_backward`` (numbactr.hstu, on
the device's arrays: the compiled cpu version on cpu, the numba.cuda kernels on a GPU) against the
attention as PyTorch code computes it without a fused kernel: the jagged batch padded to (B, M, H, D),
``silu(alpha q k^T) * mask / M`` as dense (B, H, M, M) products, unpadded (FBGEMM's test reference does the
same). Causal window (``(-1, 0)``, HSTU's), no contexts, targets or rab; alpha = 1/sqrt(D).

The batch: per maximum length L, ``sequences`` sequences whose lengths run evenly from L down to L/2 (a
jagged batch: the padded code computes every (B, M, M) score, the jagged kernels only the ones each
sequence has, and only under the causal diagonal). fwd ms = median time of one forward; bwd ms = of one
backward (numbactr: ``hstu_attn_varlen_backward``, which recomputes the scores; PyTorch: autograd through
the kept graph, ``torch.autograd.grad(..., retain_graph=True)``). The padded batch's mask is built once,
outside the timer. Both sides run at each thread count of --threads in turn (numbactr's compute threads and
torch's intra-op threads set alike), side by side in one run.
"""

from __future__ import annotations

import math

import numpy as np

from numbactr.bench.common import Env, Table, measure, thread_count

COLUMNS = ["impl", "threads", "L", "sequences", "tokens", "heads", "D", "fwd ms", "bwd ms"]
FULL = dict(lengths=(50, 128, 256, 512), sequences=4, heads=2, dim=64, threads=(1, 2))
QUICK = dict(lengths=(12,), sequences=2, heads=2, dim=8, threads=(1,))


def seq_lengths(max_len: int, sequences: int) -> list:
    """Lengths running evenly from max_len down to max_len / 2."""
    return [max_len - (max_len // 2) * b // max(sequences - 1, 1) for b in range(sequences)]


def _numbactr_fns(env: Env, lengths, heads, dim, rng):
    """(forward, backward) closures of numbactr's face on this batch."""
    from numbactr.hstu import hstu_attn_varlen_backward, hstu_attn_varlen_func

    xp = env.xp
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t, m = int(cu[-1]), max(lengths)
    q, k, v, dout = (xp.asarray(rng.standard_normal((t, heads, dim)).astype(np.float32)) for _ in range(4))
    cu = xp.asarray(cu)
    args = (cu, cu, None, None, m, m, -1, None, None)
    kw = dict(window_size=(-1, 0), alpha=1 / math.sqrt(dim))
    return (
        lambda: hstu_attn_varlen_func(q, k, v, *args, **kw),
        lambda: hstu_attn_varlen_backward(dout, q, k, v, *args, **kw),
    )


def _torch_fns(env: Env, lengths, heads, dim, rng):
    """(forward, backward) closures of the padded dense PyTorch attention on the same shapes."""
    torch = env.torch
    dev = env.torch_dev
    b, m = len(lengths), max(lengths)
    t = sum(lengths)
    q, k, v, dout = (
        torch.tensor(rng.standard_normal((t, heads, dim)), dtype=torch.float32, device=dev) for _ in range(4)
    )
    for x in (q, k, v):
        x.requires_grad_(True)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pos = np.arange(m)
    valid = pos[None, :] < np.asarray(lengths)[:, None]  # (B, M)
    gather = torch.tensor(np.where(valid, starts[:, None] + pos[None, :], t), device=dev)  # row t: zeros
    rows = torch.tensor(np.flatnonzero(valid.ravel()), device=dev)  # the padded rows that are tokens
    causal = torch.tril(torch.ones(m, m, dtype=torch.bool, device=dev))
    vt = torch.tensor(valid, device=dev)
    mask = (causal[None] & vt[:, :, None] & vt[:, None, :]).to(torch.float32)[:, None]  # (B, 1, M, M)
    alpha = 1 / math.sqrt(dim)

    def forward():
        pad = [torch.cat([x, x.new_zeros(1, heads, dim)])[gather] for x in (q, k, v)]  # (B, M, H, D)
        scores = torch.einsum("bihd,bjhd->bhij", pad[0], pad[1])
        p = torch.nn.functional.silu(alpha * scores) * mask / m
        out = torch.einsum("bhij,bjhd->bihd", p, pad[2])
        return out.reshape(b * m, heads, dim)[rows]

    kept = {}

    def backward():
        if "out" not in kept:
            kept["out"] = forward()
        return torch.autograd.grad(kept["out"], (q, k, v), dout, retain_graph=True)

    return forward, backward


def bench_hstu(
    env: Env,
    *,
    lengths=(50, 128, 256, 512),
    sequences: int = 4,
    heads: int = 2,
    dim: int = 64,
    threads=(1, 2),
    min_time: float = 1.0,
    seed: int = 0,
) -> Table:
    """The table of ``numbactr bench hstu`` (see the module docstring)."""
    if min(lengths) < 2 or sequences < 1 or heads < 1 or dim < 1:
        raise ValueError(f"bench hstu: lengths >= 2, sequences, heads and dim >= 1, got {lengths}, {sequences}, "
                         f"{heads}, {dim}")  # fmt: skip
    tab = Table(f"HSTU jagged attention, forward and backward ({env.kind})", list(COLUMNS))
    path = "numba.cuda kernels" if env.kind == "gpu" else "compiled cpu version (numba.njit)"
    tab.notes = env.header() + [
        f"numbactr: numbactr.hstu.hstu_attn_varlen_func / hstu_attn_varlen_backward, the {path}, float32",
        f"{env.torch_label}: the same math padded dense (einsum, silu, mask, einsum), autograd for the backward",
        f"causal window, alpha 1/sqrt(D), no rab; {sequences} sequences of lengths L down to L/2 "
        "(seq_lengths), H heads of width D",
        "fwd ms / bwd ms: median of repetitions after a warm-up; the threads column sets numbactr's compute "
        "threads and torch's intra-op threads alike",
    ]
    counts = [None] if env.kind == "gpu" else list(threads)
    for n in counts:
        with thread_count(env, n):
            for max_len in lengths:
                ls = seq_lengths(int(max_len), sequences)
                shape = (n or "-", int(max_len), sequences, sum(ls), heads, dim)
                rng = np.random.default_rng(seed)
                fwd, bwd = _numbactr_fns(env, ls, heads, dim, rng)
                times = [measure(f, sync=env.sync, min_time=min_time) for f in (fwd, bwd)]
                tab.add("numbactr", *shape, *(1e3 * s for s in times))
                if env.torch is not None:
                    fwd, bwd = _torch_fns(env, ls, heads, dim, np.random.default_rng(seed))
                    times = [measure(f, sync=env.torch_sync, min_time=min_time) for f in (fwd, bwd)]
                    tab.add(env.torch_label, *shape, *(1e3 * s for s in times))
    return tab
