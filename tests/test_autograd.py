"""Tape autograd: reverse replay, gradients summed for a tensor read twice, no-grad inputs."""

import numpy as np

from numbactr.autograd import Function, Tape, Tensor


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.a, ctx.b = a, b
        return a * b

    @staticmethod
    def backward(ctx, dy):
        return dy * ctx.b, dy * ctx.a


class Split(Function):
    @staticmethod
    def forward(ctx, x):
        return x[:2].copy(), x[2:].copy()

    @staticmethod
    def backward(ctx, d0, d1):
        z0 = np.zeros(2) if d0 is None else d0
        z1 = np.zeros(1) if d1 is None else d1
        return (np.concatenate([z0, z1]),)


def test_chain_rule_and_read_twice():
    tape = Tape()
    x = Tensor(np.array([3.0]), "x", requires_grad=True)
    y = Mul.apply(tape, x, x)  # x read twice by one op: dy/dx = 2x
    z = Mul.apply(tape, y, x)  # and again: z = x^3, dz/dx = 3x^2
    tape.backward({id(z): (z, np.ones(1))})
    np.testing.assert_allclose(x.grad, [27.0])
    assert tape.entries == []


def test_no_grad_inputs_get_nothing_and_are_not_recorded():
    tape = Tape()
    a = Tensor(np.array([2.0]), "a")
    b = Tensor(np.array([5.0]), "b", requires_grad=True)
    c = Mul.apply(tape, a, a)  # no input needs grad: not on the tape
    assert len(tape.entries) == 0 and not c.requires_grad
    d = Mul.apply(tape, c, b)
    tape.backward({id(d): (d, np.ones(1))})
    assert a.grad is None
    np.testing.assert_allclose(b.grad, [4.0])


def test_multi_output_with_an_unused_output():
    tape = Tape()
    x = Tensor(np.array([1.0, 2.0, 3.0]), "x", requires_grad=True)
    first, _ = Split.apply(tape, x)
    w = Tensor(np.array([10.0, 20.0]), "w", requires_grad=True)
    y = Mul.apply(tape, first, w)
    tape.backward({id(y): (y, np.ones(2))})
    np.testing.assert_allclose(x.grad, [10.0, 20.0, 0.0])
    np.testing.assert_allclose(w.grad, [1.0, 2.0])


def test_gradients_accumulate_over_two_backward_passes():
    x = Tensor(np.array([2.0]), "x", requires_grad=True)
    for _ in range(2):
        tape = Tape()
        y = Mul.apply(tape, x, x)
        tape.backward({id(y): (y, np.ones(1))})
    np.testing.assert_allclose(x.grad, [8.0])
