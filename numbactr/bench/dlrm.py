"""`numbactr bench dlrm`: one DLRM training step in samples/s: numbactr's HugeCTR model, plain PyTorch, and
PyTorch with numbactr's / FBGEMM's TBE for the embeddings."""

import contextlib
import gc
import io
import itertools
import os
import tempfile

import numpy as np

from numbactr.bench.common import DLRM_COLUMNS, Env, Table, measure, thread_count
from numbactr.bench.embedding import fbgemm_training_module


# ---- DLRM --------------------------------------------------------------------------------------
def bench_dlrm(
    env: Env,
    *,
    batch: int,
    batches: int,
    total_rows: int,
    threads=(1, 2),
    min_time: float = 1.0,
    seed: int = 0,
    lr: float = 1e-3,
) -> Table:
    """One training step of a 26-slot DLRM: numbactr's HugeCTR model, plain PyTorch (nn.EmbeddingBag), and the
    same PyTorch DLRM with its embeddings in one TBE: numbactr's FBGEMM face and FBGEMM (when installed)."""
    from numbactr import demo
    from numbactr.data.synthetic import criteo_like_slot_sizes, make_planted_dataset
    from numbactr.config import workspace_mb_for

    slots, vec, dense_dim = 26, 16, 13
    tab = Table(f"DLRM training step ({env.kind})", DLRM_COLUMNS)
    tab.notes = env.header() + [
        f"numbactr.demo.build_dlrm: 13 dense -> 64-32-16, {slots} one-hot slots of width {vec} (hash "
        f"embedding), dot interaction, 128-64-1, BCE, Adam (Update_t.Global); {total_rows:,} embedding rows",
        f"data: make_planted_dataset (Norm files), {batches} batches read into memory first and cycled; "
        "samples/s = batch / median step time (forward + backward + update)",
        "torch: the same layer widths, one nn.EmbeddingBag per slot (dense gradients), dot interaction "
        "with HugeCTR's output layout [dense | strict lower triangle | 0 pad], BCEWithLogitsLoss, "
        "torch.optim.Adam over all parameters (every embedding row moves each step, as HugeCTR's "
        "Adam Global does)",
        "torch+numbactr-tbe / torch+fbgemm-tbe: that PyTorch DLRM with its 26 tables in one "
        "SplitTableBatchedEmbeddingBagsCodegen (numbactr.fbgemm_gpu / fbgemm_gpu), whose fused "
        "EXACT_ROWWISE_ADAGRAD (lr 0.01) updates the rows read in the step (FBGEMM's CPU build has no Adam); "
        "torch.optim.Adam for the MLPs",
        "numbactr's HugeCTR model runs its SparseEmbedding on the same engine: the 26 slots are one fused lookup "
        "of one keyed table, and the update is the engine's fused backward + HugeCTR's Adam (Global)",
        "threads: numbactr.runtime.threads' compute threads and torch.set_num_threads set to the column's value",
    ]
    if env.kind == "cpu":
        from numbactr.runtime import device

        tab.notes.append(
            "numbactr's dense ops on cpu: "
            + (
                "their compiled CPU versions (numba.njit: interaction, bias, ReLU, BCE, the dense update; matrix "
                "products in BLAS)"
                if device.compiled_cpu()
                else "their NumPy references (NUMBACTR_CPU_REFERENCE=1; the engine runs its reference impl too)"
            )
        )
    sizes = criteo_like_slot_sizes(slots, total_rows)
    with tempfile.TemporaryDirectory(prefix="numbactr-bench-") as tmp:
        data = make_planted_dataset(
            os.path.join(tmp, "data"),
            num_train=batch * batches,
            num_eval=batch,
            dense_dim=dense_dim,
            slot_sizes=sizes,
            seed=seed,
            files=(1, 1),
            calibration_samples=min(50_000, max(2_000, batch * batches)),
        )
        import numbactr as hugectr

        with contextlib.redirect_stdout(io.StringIO()):  # keep the tables readable
            model = demo.build_dlrm(
                hugectr,
                data.train_list,
                data.eval_list,
                batch=batch,
                batch_eval=batch,
                eval_batches=1,
                lr=lr,
                workspace_mb=workspace_mb_for(total_rows, vec, 2) + 1,
                vec=vec,
                slots=slots,
                dense=dense_dim,
                seed=seed,
            )
        reader = iter(model._make_reader(data.train_list, batch, True))
        host_batches = [next(reader) for _ in range(batches)]
        model.start_data_reading()  # opens the files, so inside the folder
        model._train_reader = itertools.cycle(host_batches)  # the step without file reading
        impls = [("numbactr", lambda: measure(model.train, sync=env.sync, min_time=min_time))]
        if env.torch is not None:
            from numbactr.fbgemm_gpu import split_table_batched_embeddings_ops_training as ours

            fb = fbgemm_training_module()
            for label, tbe in [(env.torch_label, None), ("torch+numbactr-tbe", ours)] + (
                [("torch+fbgemm-tbe", fb)] if fb is not None else []
            ):
                impls.append(
                    (
                        label,
                        lambda tbe=tbe: _torch_dlrm(
                            env, host_batches, sizes, data.slot_offsets, dense_dim, vec, lr, min_time, seed, tbe
                        ),
                    )
                )
        for n_threads in (None,) if env.kind == "gpu" else tuple(threads):
            with thread_count(env, n_threads):
                for label, timed in impls:
                    t = timed()
                    gc.collect()  # the previous model's tables before the next one
                    tab.add(
                        label,
                        "-" if n_threads is None else n_threads,
                        batch,
                        slots,
                        total_rows,
                        vec,
                        1e3 * t,
                        batch / t,
                    )
    if not np.isfinite(model.get_current_loss()):
        raise AssertionError("bench dlrm: numbactr loss is not finite")
    return tab


def torch_dlrm(torch, slot_sizes, dense_dim: int = 13, vec: int = 16, tbe=None):
    """Plain-PyTorch DLRM with numbactr.demo.build_dlrm's widths and HugeCTR's interaction layout.

    tbe: None for one nn.EmbeddingBag per slot (forward(dense, [indices per slot], [offsets per slot]));
    else an FBGEMM-style training module (fbgemm_gpu's or numbactr.fbgemm_gpu's
    split_table_batched_embeddings_ops_training) whose SplitTableBatchedEmbeddingBagsCodegen holds every
    slot as a table, with the fused EXACT_ROWWISE_ADAGRAD (forward(dense, indices, offsets), FBGEMM's CSR)."""
    nn = torch.nn
    slots = len(slot_sizes)
    n = slots + 1
    width = vec + n * (n - 1) // 2 + 1

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            if tbe is None:
                self.emb = nn.ModuleList(nn.EmbeddingBag(int(v), vec, mode="sum") for v in slot_sizes)
            else:
                cuda = torch.cuda.is_available() and tbe.get_available_compute_device().name == "CUDA"
                where = (
                    (tbe.EmbeddingLocation.DEVICE, tbe.ComputeDevice.CUDA)
                    if cuda
                    else (tbe.EmbeddingLocation.HOST, tbe.ComputeDevice.CPU)
                )
                self.emb = tbe.SplitTableBatchedEmbeddingBagsCodegen(
                    [(int(v), vec, *where) for v in slot_sizes],
                    optimizer=tbe.OptimType.EXACT_ROWWISE_ADAGRAD,
                    learning_rate=0.01,
                )
                self.emb.init_embedding_weights_uniform(-0.05, 0.05)
            self.bottom = nn.Sequential(
                nn.Linear(dense_dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, vec), nn.ReLU()
            )
            self.top = nn.Sequential(nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))
            # torch.tril_indices lists the strict lower triangle row-major: (1,0), (2,0), (2,1), ...
            # which is HugeCTR's column order for the pairs
            self.register_buffer("tril", torch.tril_indices(n, n, offset=-1))

        def forward(self, dense, idx, offsets):
            x = self.bottom(dense)  # (B, vec)
            if tbe is None:
                z = torch.stack([x] + [e(i, o) for e, i, o in zip(self.emb, idx, offsets)], 1)  # (B, n, vec)
            else:
                z = torch.cat([x[:, None], self.emb(idx, offsets).view(x.shape[0], slots, vec)], 1)
            m = torch.bmm(z, z.transpose(1, 2))  # (B, n, n)
            pairs = m[:, self.tril[0], self.tril[1]]  # (B, n(n-1)/2)
            pad = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device)
            return self.top(torch.cat([x, pairs, pad], 1))  # (B, 1) logits

    return DLRM()


def _torch_dlrm(env, host_batches, sizes, slot_offsets, dense_dim, vec, lr, min_time, seed, tbe=None) -> float:
    torch, dev = env.torch, env.torch_dev
    torch.manual_seed(seed)
    model = torch_dlrm(torch, sizes, dense_dim, vec, tbe).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-7)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    slots = len(sizes)
    prepared = []
    for b in host_batches:  # per-slot (indices, offsets) tensors, prepared up front
        keys, offsets = b.sparse[0]  # bag j = sample * S + slot
        keys = np.asarray(keys, dtype=np.int64)
        nnz = np.diff(offsets).reshape(b.batch_size, slots)  # (B, S)
        idx, offs = [], []
        for s in range(slots):
            bags = np.arange(b.batch_size) * slots + s  # (B,) this slot's bags
            take = (
                np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in bags])
                if (nnz[:, s] != 1).any()
                else offsets[bags]
            )  # one-hot: one key per bag
            idx.append(torch.from_numpy(keys[take] - slot_offsets[s]).to(dev))  # slot-local rows
            offs.append(torch.from_numpy(np.concatenate([[0], np.cumsum(nnz[:, s])[:-1]])).to(dev))
        if tbe is not None:  # one CSR for all slots, feature-major (FBGEMM's)
            idx = torch.cat(idx)
            offs = torch.from_numpy(np.concatenate([[0], np.cumsum(nnz.T.reshape(-1))])).to(dev)
        prepared.append((torch.from_numpy(b.dense).to(dev), idx, offs, torch.from_numpy(b.label).to(dev)))
    it = itertools.cycle(prepared)
    last = {}

    def step():
        dense, idx, offs, label = next(it)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(dense, idx, offs), label)
        loss.backward()
        opt.step()
        last["loss"] = loss

    t = measure(step, sync=env.torch_sync, min_time=min_time)
    if not torch.isfinite(last["loss"]).item():
        raise AssertionError("bench dlrm: torch loss is not finite")
    return t
