"""The table-batched embedding engine: every embedding-shaped op of numbactr runs here.

Contract (the math is in numbactr/kernels/tbe_ref.py's docstring; this is the interface):

    eng = TableBatchedEmbedding(
        tables=[(rows, dim), ...] or [TableSpec(rows, dim, keyed=False, init_range=(-0.05, 0.05)), ...],
        feature_table_map=None,             # feature f reads table feature_table_map[f]; None: f -> f
        pooling=Pooling.SUM,                # SUM | MEAN | NONE (sequence embeddings, one row per index)
        optimizer=OptimizerSpec(Optim.EXACT_SGD, learning_rate=0.01, ...),
        weights_precision=Precision.FP32,   # FP32 | FP16 (updates stochastically rounded by default) | INT8
                                            # (FBGEMM's fused 8-bit rows, kernels/fused8bit.py: forward only)
        output_dtype=Precision.FP32,        # FP32 | FP16
        bounds_check=BoundsCheck.WARNING,   # FATAL | WARNING | IGNORE | NONE (FBGEMM's modes)
        stochastic_rounding=True,
        layout=Layout.FEATURE_MAJOR,        # CSR bag order: f*B + b (FBGEMM) or b*F + f (HugeCTR)
        seed=0,                             # stochastic rounding and keyed-row initialization
        impl=None)                          # "ref" | "cpu" | "kernels"; None: the device's (see below)
    out, ctx = eng.forward(indices, offsets, per_sample_weights=None, training=True,
                           pooling=None, feature_requires_grad=None)
        indices (N,) int32/int64 (keys of keyed tables may also be uint64), offsets (F*B + 1,) int32/int64,
        per_sample_weights (N,) float. out: (B, sum_f D_f) pooled ((B, F, D) when all D are equal and
        reshaped), or (N, D) for NONE; float32 or float16. ctx: what backward needs (a LookupContext).
    grads = eng.backward(ctx, grad_output)
        applies the fused update (sort/segment by row, deterministic per-row sum, optimizer, in one pass)
        and returns Grads(per_sample_weights=(N,) or None, sparse=SparseRowGrad or None (optimizer NONE)).
    eng.split_weights() -> [(V_t, D_t) views]    eng.split_optimizer_states() -> [[state views] per table]
    eng.learning_rate (settable), eng.step (updates done; settable), eng.set_hyper_parameters(**values),
    eng.init_uniform(lo, hi, seed), eng.bounds_warnings (bad indices/offsets seen under WARNING)
    ctx = eng.lookup(indices, offsets, ...); out = eng.pool(ctx)     forward in two halves (rows changed between)
    eng.touched_rows(ctx) -> (U,) distinct linear rows read    eng.row_state(name) -> flat per-row state
    eng.scale_rows(rows, factors), eng.lerp_halves(coef)   row ops on the device (kernels/tbe_row_ops.py):
        FBGEMM's global weight decay and EMA in place;  eng.copy_rows(rows) / eng.restore_rows(rows, saved)

Storage: one weights buffer for all tables, row r of table t at elem_offset[t] + r * stride[t], the stride
the width padded to 16 bytes (4 float32 or 8 float16) so every row starts aligned on the kernel path;
per-element optimizer states (float32) share those offsets, per-row states use row_offset[t] + r. The
linear row id of (t, r) is row_offset[t] + r (FBGEMM's hash_size_cumsum indexing). INT8 weights: rows of
D_t + 8 bytes (D_t uint8, float32 scale, float32 bias; D_t a multiple of 4), unpadded as FBGEMM's; a lookup
dequantizes the rows it touches into a float32 block of the same layout and pools that (every impl), and a
backward raises NotImplementedError (as FBGEMM's CPU TBE does for INT8).

Keyed tables (HugeCTR's hash embeddings): the feature's indices are keys; the engine maps them to rows with
numbactr.embedding.hash_table.HashTable (training inserts: new keys take the next rows in order of first
occurrence, initialized U(init_range) from a hash of (seed, key); evaluation finds: a missing key is row
-1, which contributes zero but still counts in a MEAN bag's length, HugeCTR's rule, while an unkeyed
table's MEAN divides by the bag length as FBGEMM does; the two agree because -1 rows count). The forward's
insert gives each occurrence its row, so the backward needs no second table.

Steps: `step` counts updates; an update uses t = step + 1 (Adam's bias correction, stochastic rounding's
random stream). FBGEMM increments its `iter` in forward instead: a face that wants FBGEMM's count after
several forwards per backward sets `step`.

Devices: impl "kernels" (the default on gpu and sim) launches the numba.cuda kernels of
numbactr.kernels.tbe, "cpu" (the default on the cpu device) runs the numba-compiled CPU code of
numbactr.kernels.tbe_cpu, "ref" the NumPy reference (the test oracle). All three give the same result to
float32 rounding (float16 weights: to one float16 step per update); every row's gradient is summed in
occurrence order in all of them, so a step is deterministic. A kernels step launches one kernel per op for
all tables (counted in numbactr.kernels.launch.COUNTS on the sim device) and reads nothing back to the host,
except: bounds_check FATAL / WARNING read one status array per forward (to raise or warn at once), optimizer
NONE reads the number of touched rows to size its result, and keyed tables read the hash table's new-key
count (and do their key bookkeeping on the host).

Bounds check order: offsets are repaired and every unkeyed index checked before a keyed table is touched,
so a FATAL batch raises with the hash tables unchanged.
"""

# the names other modules import from numbactr.embedding.engine (re-exported)
from numbactr.embedding.engine.buffers import fill_uniform_rows, lerp_halves_of  # noqa: F401
from numbactr.embedding.engine.core import TableBatchedEmbedding
from numbactr.embedding.engine.specs import (
    FIXED_HYPER_PARAMETERS as FIXED_HYPER_PARAMETERS,
    IMPLS,
    MAX_DIM as MAX_DIM,
    BoundsCheck,  # noqa: F401
    CounterRegularization,
    CounterWeightDecay,
    EmbeddingBoundsError,
    FloatRows as FloatRows,
    Grads,
    Layout,
    LookupContext,
    Optim,
    OptimizerSpec,
    Pooling,
    Precision,
    SparseRowGrad,
    TableSpec,
    UpdateType,
    WeightDecay,
    _as_table as _as_table,
    _check_optimizer as _check_optimizer,
    state_specs as state_specs,
)

__all__ = [
    "TableBatchedEmbedding",
    "TableSpec",
    "OptimizerSpec",
    "LookupContext",
    "Grads",
    "SparseRowGrad",
    "Pooling",
    "Layout",
    "BoundsCheck",
    "Precision",
    "Optim",
    "UpdateType",
    "WeightDecay",
    "CounterRegularization",
    "CounterWeightDecay",
    "EmbeddingBoundsError",
    "IMPLS",
]
