"""The rows of FBGEMM's inference TBE (IntNBitTableBatchedEmbeddingBagsCodegen): each table its own type.

A row of D values of type ty takes row_bytes(D, ty, alignment) bytes:

    FP32   D float32                       FP16   D float16
    FP8    D bytes: FBGEMM's HFP8 (sign, fp8_exponent_bits exponent bits with bias fp8_exponent_bias, the
           rest mantissa; subnormals, no inf/NaN): bits b -> float32 bits ((b & 0x7F) << (16 + ebits)) times
           2**(127 - bias), with the sign bit copied (FBGEMM's hfp8_to_float; defaults 4 and 7)
    INT8   scale, bias, D uint8            INT4   scale, bias, D/2 bytes (two values per byte)
    INT2   scale, bias, D/4 bytes (four values per byte)

scale and bias are float16 (2 bytes each: scale_bias_bytes = 4) at the start of the row, or at its end with
reverse_qparam; a packed byte holds its values low bits first (INT4: value 2k in bits 0-3, 2k+1 in bits
4-7); value_d = scale * q_d + bias in float32. Each row is padded to a multiple of `alignment` bytes (FBGEMM:
1 on the CPU, 16 on a GPU). D must fill whole bytes (INT4: even, INT2: a multiple of 4).

RowCodec is what the embedding engine needs to read such rows forward (numbactr/embedding/engine.py,
Precision.INT8 with row codecs): the row's bytes and decode(rows) -> float32 values. The fused 8-bit rows
of FBGEMM's training TBE (kernels/fused8bit.py) are one more codec. Array operations on NumPy or CuPy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import fused8bit as Q8

#: bits per value of each type (FBGEMM's SparseType names)
BITS = {"fp32": 32, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}
QUANTIZED = ("int8", "int4", "int2")
SCALE_BIAS_BYTES = 4


def unpadded_row_bytes(dim: int, ty: str, scale_bias_bytes: int = SCALE_BIAS_BYTES) -> int:
    """The bytes of one row before alignment (FBGEMM's unpadded_row_size_in_bytes)."""
    data = dim * BITS[ty] // 8
    return data + (scale_bias_bytes if ty in QUANTIZED else 0)


def row_bytes(dim: int, ty: str, alignment: int = 1, scale_bias_bytes: int = SCALE_BIAS_BYTES) -> int:
    """unpadded_row_bytes rounded up to a multiple of alignment (FBGEMM's rounded_row_size_in_bytes)."""
    r = unpadded_row_bytes(dim, ty, scale_bias_bytes)
    return -(-r // alignment) * alignment


def check_dim(dim: int, ty: str) -> None:
    if ty not in BITS:
        raise ValueError(f"row type {ty!r} is not one of {sorted(BITS)}")
    per_byte = 8 // BITS[ty] if BITS[ty] < 8 else 1
    if dim < 1 or dim % per_byte:
        raise ValueError(f"a {ty} row packs {per_byte} values per byte: its dim must be a positive multiple of "
                         f"{per_byte}, got {dim}")


def hfp8_to_float(b, ebits: int = 4, bias: int = 7, xp=np):
    """uint8 HFP8 bits -> float32 (FBGEMM's hfp8_to_float)."""
    b = xp.asarray(b).astype(np.uint32)
    mag = ((b & np.uint32(0x7F)) << np.uint32(16 + ebits)).view(np.float32) * np.float32(2.0 ** (127 - bias))
    return (mag.view(np.uint32) | ((b & np.uint32(0x80)) << np.uint32(24))).view(np.float32)


def decode_rows(q, dim: int, ty: str, reverse_qparam: bool = False, scale_bias_bytes: int = SCALE_BIAS_BYTES,
                xp=np, ebits: int = 4, bias: int = 7):
    """(m, row bytes) uint8 rows of type ty -> (m, dim) float32 values (NumPy or CuPy)."""
    q = xp.asarray(q)
    m = q.shape[0]
    if ty == "fp8":
        return hfp8_to_float(q[:, :dim], ebits, bias, xp)
    if ty == "fp32":
        return xp.ascontiguousarray(q[:, :4 * dim]).view(np.float32).reshape(m, dim)
    if ty == "fp16":
        return xp.ascontiguousarray(q[:, :2 * dim]).view(np.float16).reshape(m, dim).astype(np.float32)
    data_bytes = dim * BITS[ty] // 8
    if reverse_qparam:
        data, qp = q[:, :data_bytes], q[:, data_bytes:data_bytes + scale_bias_bytes]
    else:
        qp, data = q[:, :scale_bias_bytes], q[:, scale_bias_bytes:scale_bias_bytes + data_bytes]
    sb = xp.ascontiguousarray(qp[:, :4]).view(np.float16).astype(np.float32)          # (m, 2): scale, bias
    bits = BITS[ty]
    if bits == 8:
        vals = data
    else:                                   # low bits first: value k of a byte is (byte >> bits*k) & mask
        per = 8 // bits
        shifts = xp.asarray((np.arange(per) * bits).astype(np.uint8))
        vals = ((data[:, :, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(m, dim)
    return vals.astype(np.float32) * sb[:, :1] + sb[:, 1:]


def encode_rows_ref(x, ty: str, alignment: int = 1, reverse_qparam: bool = False,
                    scale_bias_bytes: int = SCALE_BIAS_BYTES, ebits: int = 4, bias: int = 7) -> np.ndarray:
    """(V, D) float rows -> (V, row bytes) uint8 rows of type ty (host NumPy; for tests and initialization):
    FBGEMM's rowwise quantization for the integer types (bias = the row's min, scale = range / (2**bits - 1),
    scale and bias rounded to float16 first), float16 / float32 as they are."""
    x = np.asarray(x, np.float32)
    v, dim = x.shape
    check_dim(dim, ty)
    out = np.zeros((v, row_bytes(dim, ty, alignment, scale_bias_bytes)), np.uint8)
    if ty == "fp32":
        out[:, :4 * dim] = x.view(np.uint8).reshape(v, 4 * dim)
        return out
    if ty == "fp16":
        out[:, :2 * dim] = x.astype(np.float16).view(np.uint8).reshape(v, 2 * dim)
        return out
    if ty == "fp8":                            # the nearest of the 256 codes (ties: the lower code)
        codes = hfp8_to_float(np.arange(256, dtype=np.uint8), ebits, bias)
        order = np.argsort(codes, kind="stable")
        vals = codes[order]
        pos = np.clip(np.searchsorted(vals, x), 1, 255)
        lo_v, hi_v = vals[pos - 1], vals[pos]
        out[:, :dim] = order[np.where(x - lo_v <= hi_v - x, pos - 1, pos)]
        return out
    bits = BITS[ty]
    levels = (1 << bits) - 1
    lo = x.min(axis=1).astype(np.float16)
    scale = ((x.max(axis=1) - lo.astype(np.float32)) / levels).astype(np.float16)
    s32 = scale.astype(np.float32)
    inv = np.where(s32 > 0, 1.0 / np.where(s32 > 0, s32, 1), 0).astype(np.float32)
    q = np.clip(np.rint((x - lo.astype(np.float32)[:, None]) * inv[:, None]), 0, levels).astype(np.uint8)
    per = 8 // bits
    packed = np.zeros((v, dim // per), np.uint8)
    for k in range(per):
        packed |= (q[:, k::per] << np.uint8(bits * k)).astype(np.uint8)
    qp = np.stack([scale, lo], axis=1).view(np.uint8).reshape(v, 4)
    data_bytes = dim // per
    if reverse_qparam:
        out[:, :data_bytes], out[:, data_bytes:data_bytes + 4] = packed, qp
    else:
        out[:, :4], out[:, scale_bias_bytes:scale_bias_bytes + data_bytes] = qp, packed
    return out


@dataclass(frozen=True)
class RowCodec:
    """How the engine reads one table's byte rows: row_bytes per row, decode -> float32 (m, dim)."""
    dim: int
    ty: str                     # "fused8bit" (kernels/fused8bit.py) or a key of BITS
    row_bytes: int
    reverse_qparam: bool = False
    scale_bias_bytes: int = SCALE_BIAS_BYTES
    fp8_exponent_bits: int = 4
    fp8_exponent_bias: int = 7

    def decode(self, q, xp=np):
        if self.ty == "fused8bit":
            return Q8.dequantize_rows(xp.asarray(q)[:, :self.dim + Q8.QPARAM_BYTES], self.dim, xp)
        return decode_rows(q, self.dim, self.ty, self.reverse_qparam, self.scale_bias_bytes, xp,
                           self.fp8_exponent_bits, self.fp8_exponent_bias)


def fused8bit_codec(dim: int) -> RowCodec:
    """The training TBE's INT8 rows: D uint8, float32 scale, float32 bias (kernels/fused8bit.py)."""
    return RowCodec(dim, "fused8bit", dim + Q8.QPARAM_BYTES)


def nbit_codec(dim: int, ty: str, alignment: int = 1, reverse_qparam: bool = False,
               scale_bias_bytes: int = SCALE_BIAS_BYTES, fp8_exponent_bits: int = 4,
               fp8_exponent_bias: int = 7) -> RowCodec:
    """An inference TBE table's rows (FBGEMM's IntNBit formats above)."""
    check_dim(dim, ty)
    if ty == "fp8" and not 1 <= fp8_exponent_bits <= 7:
        raise ValueError(f"fp8_exponent_bits must be 1..7, got {fp8_exponent_bits}")
    return RowCodec(dim, ty, row_bytes(dim, ty, alignment, scale_bias_bytes), reverse_qparam, scale_bias_bytes,
                    int(fp8_exponent_bits), int(fp8_exponent_bias))


#: no numba.cuda kernels here (array operations on NumPy / CuPy only)
PTX_CHECKS = []
