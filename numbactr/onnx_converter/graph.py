"""An ONNX graph under construction: nodes in execution order, initializers, inputs and outputs.

The converter names the tensors a numbactr layer defines after the layer's tops (``fc1``, ``concat1``,
...), so the ONNX graph reads like the HugeCTR graph; the helper tensors of one layer are named
``<top>/<what>`` and made unique. Constants are initializers. Opset 17 of the default domain (onnxruntime
1.14 and later run it) and, only when a table's keys need a hash map, opset 2 of ai.onnx.ml
(LabelEncoder, int64 keys to int64 rows).
"""

from __future__ import annotations

import numpy as np

from numbactr.onnx_converter import require_onnx

OPSET = 17
ML_OPSET = 2
IR_VERSION = 8  # the IR of opset 17: onnxruntime builds that know opset 17 read it
BATCH = "batch"  # the symbolic name of the batch dim of every input and output


class OnnxGraph:
    """Nodes, initializers, inputs and outputs of one graph, with unique tensor names."""

    def __init__(self, name: str):
        self.onnx = require_onnx()
        self.name = name
        self.nodes, self.initializers, self.inputs, self.outputs = [], [], [], []
        self.names: set[str] = set()
        self.uses_ml = False

    # ---- names ------------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        """A tensor name not used yet, ``hint`` itself when it is free."""
        name, k = hint, 1
        while name in self.names:
            name, k = f"{hint}_{k}", k + 1
        self.names.add(name)
        return name

    def claim(self, name: str) -> str:
        """``name`` for a tensor a layer defines (its top): it must be new."""
        if name in self.names:
            raise ValueError(f"ONNX export: tensor {name!r} is defined twice")
        self.names.add(name)
        return name

    # ---- contents ---------------------------------------------------------------------------------
    def const(self, value, hint: str, dtype=np.float32) -> str:
        """An initializer holding ``value`` (an array or a scalar) as ``dtype``."""
        name = self.fresh(hint)
        arr = np.ascontiguousarray(value, dtype=dtype)
        self.initializers.append(self.onnx.numpy_helper.from_array(arr, name))
        return name

    def ints(self, values, hint: str) -> str:
        """A 1-D int64 initializer (shapes, axes, slice bounds)."""
        return self.const(np.asarray(list(values), np.int64).reshape(-1), hint, np.int64)

    def op(self, op_type: str, inputs: list, hint: str, out=None, n_out: int = 1, domain: str = "", **attrs):
        """Append a node; returns its output name (or the list of them when n_out > 1 or out is a list).

        ``out`` names the outputs (names a layer's tops claimed); else fresh names from ``hint``."""
        if out is None:
            outs = [self.fresh(hint if n_out == 1 else f"{hint}{i}") for i in range(n_out)]
        else:
            outs = [out] if isinstance(out, str) else list(out)
        if domain == "ai.onnx.ml":
            self.uses_ml = True
        self.nodes.append(
            self.onnx.helper.make_node(
                op_type, list(inputs), outs, name=self.fresh(f"{hint}/{op_type}"), domain=domain, **attrs
            )
        )
        return outs if (isinstance(out, list) or n_out > 1) else outs[0]

    def add_input(self, name: str, elem: str, dims: list) -> str:
        """A graph input: ``elem`` "float" or "int64", dims with BATCH first."""
        h = self.onnx.helper
        t = {"float": self.onnx.TensorProto.FLOAT, "int64": self.onnx.TensorProto.INT64}[elem]
        self.inputs.append(h.make_tensor_value_info(self.claim(name), t, dims))
        return name

    def add_output(self, name: str, dims: list) -> None:
        """A float graph output (the tensor ``name`` must be defined by a node)."""
        self.outputs.append(self.onnx.helper.make_tensor_value_info(name, self.onnx.TensorProto.FLOAT, dims))

    def model(self, metadata: dict[str, str]):
        """The checked ModelProto, with ``metadata`` as its metadata_props."""
        h = self.onnx.helper
        graph = h.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        opsets = [h.make_opsetid("", OPSET)] + ([h.make_opsetid("ai.onnx.ml", ML_OPSET)] if self.uses_ml else [])
        model = h.make_model(graph, opset_imports=opsets, producer_name="numbactr")
        model.ir_version = IR_VERSION
        for k, v in metadata.items():
            model.metadata_props.add(key=k, value=v)
        return model
