"""Gates.mixture: soft, straight-through and Gumbel paths, and frozen method gates.

References are computed here from cloned leaf tensors with plain torch.softmax, and the Gumbel
noise from a fresh generator with the same seed (the documented perturbation: logits plus
-log(-log(U)), U ~ torch.rand of theta's shape).
"""

from __future__ import annotations

import pytest
import torch

from learnroute.gates.gates import Gates

METHODS = ["tova", "knorm", "snapkv", "streaming"]
L = 5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _gates(seed: int, learn: str = "methods") -> Gates:
    gates = Gates(METHODS, [True] * L, learn=learn)
    theta = torch.randn(L, len(METHODS), generator=torch.Generator().manual_seed(seed)) * 2.0
    with torch.no_grad():
        gates.theta.copy_(theta)
    return gates


def _one_hot_argmax(p: torch.Tensor) -> torch.Tensor:
    """One-hot of each row's largest entry, found in plain Python (rows have distinct values here)."""
    out = torch.zeros_like(p)
    for i, row in enumerate(p.tolist()):
        assert len(set(row)) == len(row)
        out[i, max(range(len(row)), key=row.__getitem__)] = 1.0
    return out


def _soft_reference(theta: torch.Tensor, temperature: float, noise: torch.Tensor | None = None):
    """(leaf, softmax((leaf + noise) / T)) on a detached clone of theta."""
    leaf = theta.detach().clone().requires_grad_()
    logits = leaf if noise is None else leaf + noise
    return leaf, torch.softmax(logits / temperature, dim=-1)


def _gumbel_noise(seed: int, shape) -> torch.Tensor:
    u = torch.rand(shape, generator=torch.Generator().manual_seed(seed))
    assert (u > 0).all()  # no clamping needed for this seed
    return -torch.log(-torch.log(u))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_soft_mixture_is_softmax_over_temperature(temperature):
    gates = _gates(0)
    _, ref = _soft_reference(gates.theta, temperature)
    pi = gates.mixture(temperature)
    torch.testing.assert_close(pi, ref, atol=1e-7, rtol=1e-6)
    assert pi.max() < 1.0  # soft: not one-hot (the straight-through tests below can tell the difference)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_straight_through_forward_is_one_hot_argmax(temperature):
    """Forward: the one-hot argmax of softmax(theta / T), up to one rounding of hard + pi - pi."""
    gates = _gates(1)
    _, soft = _soft_reference(gates.theta, temperature)
    pi = gates.mixture(temperature, straight_through=True).detach()
    ref = _one_hot_argmax(soft.detach())
    torch.testing.assert_close(pi, ref, atol=2 * torch.finfo(pi.dtype).eps, rtol=0)
    assert torch.equal(pi.argmax(-1), ref.argmax(-1))
    assert (pi[ref == 0] == 0).all()  # the off entries are exactly zero


def test_straight_through_forward_is_exactly_one_hot():
    gates = _gates(0)
    _, soft = _soft_reference(gates.theta, 1.0)
    pi = gates.mixture(1.0, straight_through=True).detach()
    assert torch.equal(pi, _one_hot_argmax(soft.detach()))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_straight_through_gradient_is_the_soft_one(temperature):
    gates = _gates(2)
    w = torch.randn(L, len(METHODS), generator=torch.Generator().manual_seed(20))
    pi = gates.mixture(temperature, straight_through=True)
    (got,) = torch.autograd.grad((pi * w).sum(), gates.theta)
    leaf, soft = _soft_reference(gates.theta, temperature)
    (ref,) = torch.autograd.grad((soft * w).sum(), leaf)
    assert ref.abs().max() > 1e-3  # a gradient that is there to compare
    torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-5)
    # and not the (zero) gradient of the one-hot itself
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("straight_through", [False, True])
def test_gumbel_perturbation_is_the_documented_one(straight_through):
    """logits = theta - log(-log(U)), U = torch.rand(theta.shape, generator): value and gradient."""
    seed, temperature = 123, 0.7
    gates = _gates(3)
    noise = _gumbel_noise(seed, gates.theta.shape)
    w = torch.randn(L, len(METHODS), generator=torch.Generator().manual_seed(21))
    pi = gates.mixture(temperature, gumbel=torch.Generator().manual_seed(seed), straight_through=straight_through)
    (got,) = torch.autograd.grad((pi * w).sum(), gates.theta)
    leaf, soft = _soft_reference(gates.theta, temperature, noise)
    (ref,) = torch.autograd.grad((soft * w).sum(), leaf)
    if straight_through:
        expect = _one_hot_argmax(soft.detach())
        torch.testing.assert_close(pi.detach(), expect, atol=2 * torch.finfo(pi.dtype).eps, rtol=0)
        # the noise changes the argmax of some layer (so the one-hot above really saw the noise)
        assert not torch.equal(expect, _one_hot_argmax(gates.theta.detach()))
    else:
        torch.testing.assert_close(pi.detach(), soft.detach(), atol=1e-7, rtol=1e-6)
        assert (pi.detach() - torch.softmax(gates.theta.detach() / temperature, -1)).abs().max() > 1e-2
    torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-5)


def test_gumbel_draw_advances_the_generator():
    """Two calls with one generator draw two different perturbations (the second is the next draw)."""
    gates = _gates(4)
    gen = torch.Generator().manual_seed(5)
    first = gates.mixture(1.0, gumbel=gen).detach()
    second = gates.mixture(1.0, gumbel=gen).detach()
    ref_gen = torch.Generator().manual_seed(5)
    torch.rand(gates.theta.shape, generator=ref_gen)  # the first draw
    u2 = torch.rand(gates.theta.shape, generator=ref_gen)
    torch.testing.assert_close(first, torch.softmax(gates.theta.detach() + _gumbel_noise(5, gates.theta.shape), -1))
    torch.testing.assert_close(second, torch.softmax(gates.theta.detach() - torch.log(-torch.log(u2)), -1))
    assert not torch.allclose(first, second)


@pytest.mark.parametrize("learn", ["budgets", "none"])
@pytest.mark.parametrize(
    "kwargs", [{}, {"straight_through": True}, {"gumbel": "gen"}, {"gumbel": "gen", "straight_through": True}]
)
def test_frozen_methods_return_the_hard_one_hot(learn, kwargs):
    """theta does not train: the mixture is the one-hot of the initial methods, whatever the
    temperature, noise or straight-through flag, and carries no gradient."""
    init = ["knorm", "tova", "streaming", "knorm", "snapkv"]
    gates = Gates(METHODS, [True] * L, learn=learn, init_methods=init)
    assert not gates.theta.requires_grad
    kw = dict(kwargs)
    if "gumbel" in kw:
        kw["gumbel"] = torch.Generator().manual_seed(0)
    expect = torch.zeros(L, len(METHODS))
    for layer, m in enumerate(init):
        expect[layer, METHODS.index(m)] = 1.0
    for temperature in (0.1, 1.0, 50.0):
        pi = gates.mixture(temperature, **kw)
        assert torch.equal(pi, expect)
        assert not pi.requires_grad
