"""HugeCTR's ``hugectr2onnx`` package under numbactr: ``hugectr2onnx.converter.convert(...)``.

HugeCTR: ``import hugectr2onnx``; numbactr: ``from numbactr.onnx_converter import hugectr2onnx``.
"""

from numbactr.onnx_converter.hugectr2onnx import converter

__all__ = ["converter"]
