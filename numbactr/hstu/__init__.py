"""Generative recommenders (issue 43): HSTU's jagged attention with FBGEMM's signature, the HSTU layer and a
sequential recommender (HSTU and SASRec) trained with a sampled softmax and evaluated by full ranking.

``hstu_attn_varlen_func`` (numbactr/hstu/attention.py) takes torch tensors (autograd) or NumPy / CuPy arrays
(with ``hstu_attn_varlen_backward`` for the gradients); importing this package does not import torch."""

from numbactr.hstu.attention import hstu_attn_varlen_backward, hstu_attn_varlen_func

__all__ = ["hstu_attn_varlen_func", "hstu_attn_varlen_backward"]
