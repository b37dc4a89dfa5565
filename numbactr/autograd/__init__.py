"""Tape autograd: Tensor, Context, Function, Tape."""

from numbactr.autograd.tape import Context, Function, Tape, Tensor

__all__ = ["Context", "Function", "Tape", "Tensor"]
