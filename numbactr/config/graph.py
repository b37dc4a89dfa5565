"""The graph's configuration objects: Input and its DataReaderSparseParam, DenseLayer, GroupDenseLayer and
DenseLayerComputeConfig (spec §5, §6.0)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from numbactr.enums import (
    Activation_t,
    FcPosition_t,
    GroupLayer_t,
    Initializer_t,
    Layer_t,
    Regularizer_t,
)
from numbactr.validate import warn_ignored
from numbactr.validate import expect as _expect, number as _number


@dataclass
class DataReaderSparseParam:
    """``hugectr.DataReaderSparseParam(top_name, nnz_per_slot, is_fixed_length, slot_num)``."""

    top_name: str
    nnz_per_slot: Any
    is_fixed_length: bool
    slot_num: int

    def __post_init__(self):
        _expect(
            isinstance(self.slot_num, int) and self.slot_num > 0,
            f"DataReaderSparseParam {self.top_name!r}: slot_num must be a positive int",
        )
        if isinstance(self.nnz_per_slot, int):
            self.nnz_per_slot = [self.nnz_per_slot] * self.slot_num
        self.nnz_per_slot = [int(n) for n in self.nnz_per_slot]
        _expect(
            len(self.nnz_per_slot) == self.slot_num,
            f"DataReaderSparseParam {self.top_name!r}: nnz_per_slot has {len(self.nnz_per_slot)} "
            f"entries for slot_num={self.slot_num}",
        )
        _expect(
            all(n > 0 for n in self.nnz_per_slot),
            f"DataReaderSparseParam {self.top_name!r}: nnz_per_slot entries must be > 0",
        )

    @property
    def max_feature_num(self) -> int:
        return sum(self.nnz_per_slot)


class Input:
    """``hugectr.Input``: label(s), dense features and sparse inputs (spec §5.1)."""

    def __init__(
        self,
        label_dim=None,
        label_name=None,
        dense_dim=0,
        dense_name="dense",
        data_reader_sparse_param_array=(),
        *rest,
        label_dims=None,
        label_names=None,
        label_weights=None,
    ):
        if isinstance(dense_dim, (list, tuple)):
            # HugeCTR's third overload: (label_dims, label_names, label_weights, dense_dim, dense_name, sparse)
            _expect(label_weights is None and len(rest) <= 1, "Input: label_weights given twice")
            label_weights, dense_dim, dense_name = dense_dim, dense_name, data_reader_sparse_param_array
            data_reader_sparse_param_array = rest[0] if rest else ()
        elif rest:
            raise TypeError(
                f"Input takes at most 5 positional arguments (6 with label_weights third), got {5 + len(rest)}"
            )
        if label_dims is None:
            label_dims = label_dim
        if label_names is None:
            label_names = label_name
        multi = isinstance(label_dims, (list, tuple))
        self.label_dims = list(label_dims) if multi else [label_dims]
        self.label_names = list(label_names) if multi else [label_names]
        _expect(
            all(isinstance(d, int) and d > 0 for d in self.label_dims),
            f"Input: label dims must be positive ints, got {label_dims!r}",
        )
        _expect(
            len(self.label_dims) == len(self.label_names) and all(self.label_names),
            "Input: give one label name per label dim",
        )
        self.label_weights = list(label_weights) if label_weights else [1.0] * len(self.label_dims)
        _expect(
            len(self.label_weights) == len(self.label_dims),
            f"Input: label_weights has "
            f"{len(self.label_weights)} weight(s) but there are {len(self.label_dims)} label(s) "
            f"{self.label_names}: give one weight per label",
        )
        for j, w in enumerate(self.label_weights):
            _number("Input", f"label_weights[{j}]", w, 0.0)
        _expect(
            isinstance(dense_dim, int) and dense_dim >= 0, f"Input: dense_dim must be an int >= 0, got {dense_dim!r}"
        )
        self.dense_dim = dense_dim
        self.dense_name = dense_name
        self.sparse = list(data_reader_sparse_param_array)
        _expect(
            all(isinstance(p, DataReaderSparseParam) for p in self.sparse),
            "Input: data_reader_sparse_param_array must hold DataReaderSparseParam objects",
        )
        names = self.label_names + [dense_name] + [p.top_name for p in self.sparse]
        _expect(len(set(names)) == len(names), f"Input: tensor names must be unique, got {names}")

    @property
    def label_dim(self) -> int:
        return sum(self.label_dims)


@dataclass(frozen=True)
class DenseLayerComputeConfig:
    """``hugectr.DenseLayerComputeConfig(async_wgrad=False, fuse_wb=False)``: how HugeCTR schedules a
    dense layer's backward, never what it computes (spec §6.0). HugeCTR reads it in MLP (both),
    MultiCross (async_wgrad) and the fp16 FusedInnerProduct / two-top Interaction (async_wgrad).

    * ``async_wgrad``: the weight-gradient GEMMs run on a second CUDA stream, overlapping the
      data-gradient GEMMs of the layers below. numbactr runs every layer on one stream (cupy's
      current stream), so there is nothing to overlap: accepted, no effect.
    * ``fuse_wb``: each layer's bias gradient comes from its own wgrad GEMM's epilogue (cuBLASLt
      BGRADB) instead of the dReLU epilogue of the layer above. numbactr has no cuBLASLt epilogues and
      always computes the bias gradient in the one kernel that applies the ReLU mask
      (kernels/fused_bias_act.py), the fusion HugeCTR's default already makes: accepted, no effect.

    Both give the same numbers either way, so numbactr keeps them (graph JSON, summary) without a
    warning; HugeCTR's graph JSON writer drops them and numbactr writes them as an extra
    ``compute_config`` object only when one is True.
    """

    async_wgrad: bool = False
    fuse_wb: bool = False

    def __post_init__(self):
        for name in ("async_wgrad", "fuse_wb"):
            v = getattr(self, name)
            _expect(isinstance(v, bool), f"DenseLayerComputeConfig: {name} must be a bool, got {v!r}")


_DENSE_DEFAULTS = dict(
    factor=1.0,
    eps=1e-5,
    gamma_init_type=Initializer_t.Default,
    beta_init_type=Initializer_t.Default,
    dropout_rate=0.5,
    elu_alpha=1.0,
    num_output=1,
    weight_init_type=Initializer_t.Default,
    bias_init_type=Initializer_t.Default,
    num_layers=0,
    leading_dim=0,
    time_step=0,
    batchsize=1,
    SeqLength=1,
    vector_size=1,
    selected=False,
    selected_slots=(),
    ranges=(),
    indices=(),
    weight_dims=(),
    projection_dim=0,
    out_dim=0,
    axis=1,
    max_sequence_len_from=1,
    max_sequence_len_to=1,
    max_sequence_len=1,
    num_attention_heads=1,
    transpose_b=False,
    target_weight_vec=(),
    use_regularizer=False,
    regularizer_type=Regularizer_t.L1,
    pos_type=FcPosition_t.Non,
    act_type=Activation_t.Relu,
    num_outputs=(),
    use_bias=True,
    activations=(),
    biases=(),
    compute_config=DenseLayerComputeConfig(),
    shape=(),
    dim=0,
    index=(),
)
_DENSE_DEFAULTS["lambda"] = 0.0
# DenseLayer's parameters after (layer_type, bottom_names, top_names) in HugeCTR's positional order
_DENSE_ORDER = (
    "factor eps gamma_init_type beta_init_type dropout_rate elu_alpha num_output weight_init_type "
    "bias_init_type num_layers leading_dim time_step batchsize SeqLength vector_size selected selected_slots "
    "ranges indices weight_dims projection_dim out_dim axis max_sequence_len_from max_sequence_len_to "
    "num_attention_heads transpose_b target_weight_vec use_regularizer regularizer_type lambda pos_type "
    "act_type num_outputs use_bias activations biases compute_config shape dim index"
).split()


_INITS = ("weight_init_type", "bias_init_type")
_LOSS = ("use_regularizer", "regularizer_type", "lambda")
# the DenseLayer parameters each layer type reads (tests/test_validation_config.py checks this table
# against the layer classes); any other parameter set to a non-default value warns as ignored
_LAYER_PARAMS = {
    "InnerProduct": ("num_output",) + _INITS,
    "FusedInnerProduct": ("num_output", "pos_type", "act_type", "compute_config") + _INITS,
    "MLP": ("num_outputs", "num_output", "use_bias", "biases", "act_type", "activations", "compute_config") + _INITS,
    "MultiCross": ("num_layers", "projection_dim", "compute_config") + _INITS,
    "Interaction": ("compute_config",),
    "BatchNorm": ("factor", "eps", "gamma_init_type", "beta_init_type"),
    "LayerNorm": ("eps", "gamma_init_type", "beta_init_type"),
    "PReLU_Dice": ("elu_alpha", "eps"),
    "ELU": ("elu_alpha",),
    "Dropout": ("dropout_rate",),
    "Scale": ("axis", "factor"),
    "WeightMultiply": ("weight_dims", "weight_init_type"),
    "FmOrder2": ("out_dim",),
    "Concat": ("axis",),
    "Reshape": ("leading_dim", "time_step", "selected", "selected_slots", "shape"),
    "ReduceSum": ("axis",),
    "ReduceMean": ("axis",),
    "Slice": ("ranges",),
    "Select": ("dim", "index"),
    "Gather": ("indices",),
    # max_sequence_len: HugeCTR v23.06's one-bottom form
    "SequenceMask": ("max_sequence_len_from", "max_sequence_len_to", "max_sequence_len"),
    "MultiHeadAttention": ("num_attention_heads", "transpose_b"),
    "Softmax": ("factor",),
    "GRU": ("num_output", "batchsize", "SeqLength", "vector_size") + _INITS,
    "BinaryCrossEntropyLoss": _LOSS,
    "CrossEntropyLoss": _LOSS,
    "MultiCrossEntropyLoss": _LOSS + ("target_weight_vec",),
}


class DenseLayer:
    """``hugectr.DenseLayer(layer_type, bottom_names, top_names, **params)`` (spec §6.0).

    ``lambda`` is a Python keyword: pass it as ``**{"lambda": 0.1}`` (read back as ``.lambda_``).
    """

    def __init__(self, layer_type, bottom_names, top_names, *args, **params):
        _expect(isinstance(layer_type, Layer_t), f"DenseLayer: layer_type must be a Layer_t, got {layer_type!r}")
        _expect(
            len(args) <= len(_DENSE_ORDER),
            f"DenseLayer {layer_type.name}: at most {3 + len(_DENSE_ORDER)} positional arguments, got {3 + len(args)}",
        )
        for name, value in zip(_DENSE_ORDER, args):  # HugeCTR's positional order (model_wrapper.hpp)
            _expect(name not in params, f"DenseLayer {layer_type.name}: {name} given twice")
            params[name] = value
        unknown = sorted(set(params) - set(_DENSE_DEFAULTS))
        _expect(not unknown, f"DenseLayer {layer_type.name} {list(top_names)!r}: unknown parameter(s) {unknown}")
        if isinstance(bottom_names, str):
            bottom_names = [bottom_names]
        if isinstance(top_names, str):
            top_names = [top_names]
        self.layer_type = layer_type
        self.bottom_names = list(bottom_names)
        self.top_names = list(top_names)
        _expect(
            bool(self.bottom_names) and bool(self.top_names),
            f"DenseLayer {layer_type.name}: bottom_names and top_names must not be empty",
        )
        for k, v in _DENSE_DEFAULTS.items():
            setattr(self, "lambda_" if k == "lambda" else k, params.get(k, v))
            if k in params and isinstance(params[k], bool) and not isinstance(v, bool) and isinstance(v, int):
                raise ValueError(
                    f"DenseLayer {layer_type.name} {list(top_names)!r}: {k} must be an integer, got {params[k]!r}"
                )
        _expect(
            isinstance(self.compute_config, DenseLayerComputeConfig),
            f"DenseLayer {layer_type.name} {self.top_names!r}: compute_config must be a "
            f"DenseLayerComputeConfig, got {self.compute_config!r}",
        )
        self.given = dict(params)  # what the user set explicitly (for graph JSON)
        used = _LAYER_PARAMS.get(layer_type.name, ())
        for k, v in params.items():
            if k not in used and not _same(v, _DENSE_DEFAULTS[k]):
                why = f"Layer_t.{layer_type.name} does not use it"
                if k == "compute_config":
                    why += " (HugeCTR reads it only in MLP, MultiCross, FusedInnerProduct and Interaction)"
                warn_ignored(f"DenseLayer {layer_type.name} {self.top_names!r}", k, v, why, stacklevel=2)


class GroupDenseLayer:
    """``hugectr.GroupDenseLayer(group_layer_type, bottom_name_list, top_name_list, num_outputs,
    last_act_type=Activation_t.Relu)`` (HugeCTR v23.08 and before; spec §6.2).

    GroupLayer_t.GroupFusedInnerProduct is a stack of len(num_outputs) >= 2 FusedInnerProducts that
    Model.add expands exactly as HugeCTR's Model::add(GroupDenseLayer&) does: a Head (the bottoms of
    ``bottom_name_list``: one, or two for the fp16 Interaction's mask) with tops ``t0, t0_mask,
    t0_dRelu, t0_db``, Body layers chaining those four, and a Tail with the last top; every layer ReLU
    except the Tail, whose activation is ``last_act_type``. Layer i has ``num_outputs[i]`` outputs and
    tensor ``top_name_list[i]`` is its output. HugeCTR builds it only with use_mixed_precision=True;
    numbactr builds it in float32 too, as it builds FusedInnerProduct (numbactr/layers/dense.py).
    """

    def __init__(self, group_layer_type, bottom_name_list, top_name_list, num_outputs, last_act_type=Activation_t.Relu):
        who = "GroupDenseLayer"
        _expect(
            isinstance(group_layer_type, GroupLayer_t),
            f"{who}: group_layer_type must be a GroupLayer_t, got {group_layer_type!r}",
        )
        bottoms = [bottom_name_list] if isinstance(bottom_name_list, str) else list(bottom_name_list)
        tops = [top_name_list] if isinstance(top_name_list, str) else list(top_name_list)
        who = f"GroupDenseLayer {tops!r}"
        _expect(
            all(isinstance(n, str) and n for n in bottoms + tops),
            f"{who}: bottom_name_list and top_name_list must hold non-empty strings",
        )
        _expect(
            len(bottoms) in (1, 2),
            f"{who}: bottom_name_list must name 1 tensor (or 2: the fp16 "
            f"Interaction's output and mask), got {len(bottoms)}",
        )
        outs = list(num_outputs)
        _expect(
            all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0 for n in outs),
            f"{who}: num_outputs must be positive ints, got {num_outputs!r}",
        )
        _expect(
            len(outs) >= 2,
            f"{who}: there should be at least two layers for GroupDenseLayer (num_outputs has {len(outs)})",
        )
        _expect(
            len(tops) == len(outs),
            f"{who}: top_name_list has {len(tops)} names for {len(outs)} layers (num_outputs); give one top per layer",
        )
        _expect(
            last_act_type in (Activation_t.Relu, Activation_t.Non),
            f"{who}: last_act_type must be Activation_t.Relu or Activation_t.Non, got {last_act_type!r}",
        )
        self.group_layer_type = group_layer_type
        self.bottom_name_list, self.top_name_list = bottoms, tops
        self.num_outputs = [int(n) for n in outs]
        self.last_act_type = last_act_type

    def expand(self) -> list:
        """The DenseLayers HugeCTR adds for this group, in order (HugeCTR's tensor names)."""
        n = len(self.num_outputs)
        # tensor_names[i]: the bottoms of layer i; layer i's tops are tensor_names[i + 1]
        tensor_names = (
            [self.bottom_name_list]
            + [[t, t + "_mask", t + "_dRelu", t + "_db"] for t in self.top_name_list[:-1]]
            + [self.top_name_list[-1:]]
        )
        layers = []
        for i, num_output in enumerate(self.num_outputs):
            pos = FcPosition_t.Head if i == 0 else FcPosition_t.Tail if i == n - 1 else FcPosition_t.Body
            act = self.last_act_type if i == n - 1 else Activation_t.Relu
            layers.append(
                DenseLayer(
                    Layer_t.FusedInnerProduct,
                    tensor_names[i],
                    tensor_names[i + 1],
                    num_output=num_output,
                    pos_type=pos,
                    act_type=act,
                )
            )
        return layers


def _same(a, b) -> bool:
    """Value equality that treats lists and tuples alike ([] == ())."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a is b or (type(a) is type(b) and a == b)
