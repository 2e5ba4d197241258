"""Differentiable top-k relaxations (learnroute.gates.topk): budget, range, order, limits, gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learnroute.gates.topk import RELAXATIONS, hard_topk_mask, sigmoid_topk, sinkhorn_topk, soft_topk

NAMES = sorted(RELAXATIONS)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: with 2 intra-op threads on a loaded 2-core machine every small op waits
    for a descheduled worker (measured: a 100-iteration Sinkhorn 6 ms on 1 thread, 2-4 s on 2)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

FAST = settings(max_examples=40, deadline=None)

# The stated sum tolerances, relative to max(1, k): the search runs in float64 either way.
SUM_TOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def _scores(seed: int, shape: tuple[int, ...], scale: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if scale == "ranks":  # per-row ranks scaled to [0, 1], as the gates mix them
        s = torch.rand(shape, generator=g, dtype=torch.float64).argsort(-1).argsort(-1).double() / max(shape[-1] - 1, 1)
    else:  # raw attention-like scores on an arbitrary scale
        s = torch.randn(shape, generator=g, dtype=torch.float64) * 300.0 + 50.0
    return s.to(dtype)


def _budget(seed: int, lead: tuple[int, ...], n: int, dtype: torch.dtype) -> torch.Tensor:
    """Fractional per-row budgets in (0, n), some close to the ends."""
    g = torch.Generator().manual_seed(seed + 1)
    u = torch.rand(lead, generator=g, dtype=torch.float64)
    return (u**2 * n).clamp(1e-3, n - 1e-3).to(dtype)


shape_st = st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(2, 48))
tau_st = st.floats(-4.0, 1.0).map(lambda e: 10.0**e)  # 1e-4 .. 10


@FAST
@given(
    name=st.sampled_from(NAMES),
    shape=shape_st,
    log_tau=tau_st,
    scale=st.sampled_from(["ranks", "raw"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 10_000),
)
def test_sum_range_and_order(name, shape, log_tau, scale, dtype, seed):
    """Rows sum to their own fractional k, values lie in [0, 1], and a higher score never gets less mask."""
    s = _scores(seed, shape, scale, dtype)  # (L, H, n)
    n = shape[-1]
    k = _budget(seed, shape[:-1], n, dtype)  # (L, H)
    tau = log_tau * (1.0 if scale == "ranks" else 300.0)  # tau in score units
    m = soft_topk(name, s, k, tau)
    assert m.shape == s.shape and m.dtype == dtype
    assert torch.isfinite(m).all()
    assert (m >= 0).all() and (m <= 1).all()
    err = (m.double().sum(-1) - k.double()).abs() / k.double().clamp(min=1)
    assert err.max().item() <= SUM_TOL[dtype], err.max().item()
    # monotone within a row: mask sorted by score is non-decreasing (ties in score give equal mask)
    order = s.argsort(-1)
    ms = m.gather(-1, order).double()
    slack = 1e-12 if dtype == torch.float64 else 1e-6
    assert (ms[..., 1:] - ms[..., :-1] >= -slack).all()


@pytest.mark.parametrize("name", NAMES)
def test_integer_k_small_tau_is_hard_topk(name):
    """Distinct scores with gaps, integer k, tau << gap: the soft mask is torch.topk's mask."""
    g = torch.Generator().manual_seed(3)
    L, H, n = 2, 3, 40
    s = torch.stack([torch.randperm(n, generator=g) for _ in range(L * H)]).reshape(L, H, n).double() / n  # gap 1/n
    k = torch.randint(1, n, (L, H), generator=g)
    ref = torch.zeros(L, H, n, dtype=torch.float64)
    for idx in torch.cartesian_prod(torch.arange(L), torch.arange(H)).tolist():
        ref[idx[0], idx[1], torch.topk(s[idx[0], idx[1]], int(k[idx[0], idx[1]])).indices] = 1.0
    for tau in (1.0 / n / 40, 1.0 / n / 200):
        m = soft_topk(name, s, k.double(), tau)
        torch.testing.assert_close(m, ref, atol=1e-6, rtol=0)
    # and it is not hard at a large tau (the test can tell the difference)
    assert (soft_topk(name, s, k.double(), 0.2) - ref).abs().max() > 0.1


def test_sigmoid_tiny_tau_raw_scale_float32():
    """Raw-scale float32 scores with tau = 1e-4 still hit the budget (the search runs in float64)."""
    g = torch.Generator().manual_seed(5)
    s = (torch.randn(4, 3, 1000, generator=g) * 1000.0).float()
    k = torch.tensor([1.0, 17.3, 500.5, 999.9]).unsqueeze(-1)  # (4, 1) broadcast over heads
    m = sigmoid_topk(s, k, 1e-4)
    assert ((m.double().sum(-1) - k.double()).abs() <= 1e-5 * k.double().clamp(min=1)).all()


# ---------------------------------------------------------------- gradients


def _gc_inputs(seed: int, shape=(2, 3, 7), scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    s = (torch.rand(shape, generator=g, dtype=torch.float64) * scale).requires_grad_()
    k = (torch.rand(shape[:-1], generator=g, dtype=torch.float64) * (shape[-1] - 1) + 0.5).requires_grad_()
    return s, k


@pytest.mark.parametrize(("tau", "scale"), [(0.3, 1.0), (0.05, 1.0), (20.0, 300.0)])
def test_sigmoid_gradcheck_scores_k_tau(tau, scale):
    s, k = _gc_inputs(0, scale=scale)
    t = torch.full(s.shape[:-1], tau, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, k, t: sigmoid_topk(s, k, t, tol=1e-14), (s, k, t))


def test_sigmoid_gradcheck_broadcast_k():
    """One scalar k shared by every row: its gradient is the sum over rows."""
    s, _ = _gc_inputs(1)
    k = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, k: sigmoid_topk(s, k, 0.2, tol=1e-14), (s, k))


def test_sigmoid_grad_k_distributes_one_unit():
    """d(sum m)/dk = 1 exactly, also for a near-hard mask where every sigma' underflows."""
    s = torch.linspace(0, 1, 11, dtype=torch.float64)
    for tau, k0 in ((0.1, 3.0), (1e-5, 3.0), (1e-5, 3.4)):  # 1e-5: |x| >= 5000, sigma' = 0
        k = torch.tensor(k0, dtype=torch.float64, requires_grad=True)
        (dk,) = torch.autograd.grad(sigmoid_topk(s, k, tau).sum(), k)
        assert abs(dk.item() - 1.0) < 1e-9, (tau, k0, dk.item())


@pytest.mark.parametrize("init", ["sigmoid", "zero"])
def test_sinkhorn_gradcheck_scores_k(init):
    s, k = _gc_inputs(2, shape=(2, 6))
    assert torch.autograd.gradcheck(lambda s, k: sinkhorn_topk(s, k, 0.2, iters=30, init=init), (s, k))


def test_sinkhorn_unrolled_grad_matches_implicit_at_moderate_tau():
    """Same fixed point, so the unrolled gradient converges to the sigmoid's implicit one."""
    s, k = _gc_inputs(3, shape=(3, 20))
    w = torch.randn(3, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = [torch.autograd.grad((f(s, k, 0.1) * w).sum(), (s, k)) for f in (sinkhorn_topk, sigmoid_topk)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-6)


# ---------------------------------------------------------------- Sinkhorn faithfulness


def _literal_sinkhorn(s: torch.Tensor, k: float, eps: float, iters: int) -> torch.Tensor:
    """Textbook log-domain Sinkhorn of Xie et al. 2020: cost |s - a|^2, anchors {0, 1}, g = 0 start."""
    n = s.shape[-1]
    cost = torch.stack([s**2, (s - 1.0) ** 2], dim=-1)  # (n, 2)
    log_mu = torch.full((n,), -math.log(n), dtype=s.dtype)
    log_nu = torch.log(torch.tensor([(n - k) / n, k / n], dtype=s.dtype))
    f, g = torch.zeros(n, dtype=s.dtype), torch.zeros(2, dtype=s.dtype)
    for _ in range(iters):
        f = eps * (log_mu - torch.logsumexp((g - cost) / eps, dim=-1))
        g = eps * (log_nu - torch.logsumexp((f[:, None] - cost) / eps, dim=0))
    f = eps * (log_mu - torch.logsumexp((g - cost) / eps, dim=-1))
    return n * torch.exp((f[:, None] + g - cost) / eps)[:, 1]


@pytest.mark.parametrize("iters", [1, 5, 40])
def test_sinkhorn_zero_init_is_the_papers_iteration(iters):
    """The centred cost used internally gives the same plan as the literal one after every iteration."""
    s = torch.rand(25, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref = _literal_sinkhorn(s, 6.5, eps=0.1, iters=iters)
    torch.testing.assert_close(sinkhorn_topk(s, 6.5, 0.05, iters=iters, init="zero"), ref, atol=1e-10, rtol=0)


def test_sinkhorn_zero_init_converges_to_sigmoid():
    s = torch.rand(3, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    k = torch.tensor([2.0, 7.25, 29.5], dtype=torch.float64)
    m = sinkhorn_topk(s, k, 0.1, iters=300, init="zero")
    torch.testing.assert_close(m, sigmoid_topk(s, k, 0.1), atol=1e-9, rtol=0)
    assert ((m.sum(-1) - k).abs() <= 1e-9 * k).all()


def test_sinkhorn_rejects_unknown_init():
    with pytest.raises(ValueError, match="init"):
        sinkhorn_topk(torch.rand(5), 2, 0.1, init="warm")


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", NAMES)
def test_edge_budgets(name):
    """k <= 0: zeros, k >= n: ones, with zero (finite) gradient; interior rows are untouched."""
    n = 6
    s = torch.rand(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).requires_grad_()
    k = torch.tensor([0.0, -2.0, float(n), n + 3.5, 2.5], dtype=torch.float64, requires_grad=True)
    m = soft_topk(name, s, k, 0.1)
    assert (m[:2] == 0).all() and (m[2:4] == 1).all()
    assert abs(m[4].sum().item() - 2.5) < 1e-9
    w = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    ds, dk = torch.autograd.grad((m * w).sum(), (s, k))
    assert torch.isfinite(ds).all() and torch.isfinite(dk).all()
    assert (ds[:4] == 0).all() and (dk[:4] == 0).all()
    assert ds[4].abs().sum() > 0 and dk[4].abs() > 0
    torch.testing.assert_close(m[4], soft_topk(name, s[4], k[4], 0.1))


@pytest.mark.parametrize("name", NAMES)
def test_equal_scores_share_the_budget(name):
    s = torch.full((2, 8), 0.3, dtype=torch.float64)
    m = soft_topk(name, s, torch.tensor([2.0, 5.5], dtype=torch.float64), 1e-3)
    torch.testing.assert_close(m, torch.tensor([[2 / 8] * 8, [5.5 / 8] * 8], dtype=torch.float64))


def test_unknown_relaxation_lists_valid_names():
    with pytest.raises(ValueError, match="sigmoid") as e:
        soft_topk("gumbel", torch.rand(4), 2, 0.1)
    assert "sinkhorn" in str(e.value) and "gumbel" in str(e.value)


@pytest.mark.parametrize("name", NAMES)
def test_bad_arguments(name):
    with pytest.raises(ValueError, match="tau"):
        soft_topk(name, torch.rand(4), 2, 0.0)
    with pytest.raises(ValueError, match="broadcast"):
        soft_topk(name, torch.rand(2, 3, 5), torch.ones(4), 0.1)
    with pytest.raises(TypeError):
        soft_topk(name, torch.arange(5), 2, 0.1)


def test_registry_dispatch_is_the_function():
    s = torch.rand(3, 9)
    torch.testing.assert_close(soft_topk("sigmoid", s, 4, 0.05), sigmoid_topk(s, 4, 0.05))
    torch.testing.assert_close(soft_topk("sinkhorn", s, 4, 0.05, iters=7), sinkhorn_topk(s, 4, 0.05, iters=7))


# ---------------------------------------------------------------- hard top-k


@settings(max_examples=30, deadline=None)
@given(shape=shape_st, seed=st.integers(0, 10_000))
def test_hard_topk_matches_torch_topk(shape, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(shape, generator=g)  # distinct almost surely
    k = torch.randint(0, shape[-1] + 1, shape[:-1], generator=g)
    m = hard_topk_mask(s, k)
    assert m.dtype == s.dtype
    flat_s, flat_k, flat_m = s.reshape(-1, shape[-1]), k.reshape(-1), m.reshape(-1, shape[-1])
    for row, kk, mm in zip(flat_s, flat_k, flat_m, strict=True):
        ref = torch.zeros_like(row)
        ref[torch.topk(row, int(kk)).indices] = 1.0
        assert torch.equal(mm, ref)


def test_hard_topk_ties_rounding_and_clamping():
    s = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]] * 5)
    k = torch.tensor([2.0, 2.5, 3.5, -1.0, 9.0])  # round half to even: 2, 2, 4; clamp: 0, 5
    m = hard_topk_mask(s, k)
    expect = torch.tensor(
        [
            [0, 1, 1, 0, 0],  # ties 2.0 at indices 1..3: the lower indices win
            [0, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.float32,
    )
    assert torch.equal(m, expect)
    assert torch.equal(hard_topk_mask(s[0], 3), torch.tensor([0.0, 1, 1, 1, 0]))  # plain int k, 1-D scores


def test_straight_through_with_hard_mask():
    """hard + soft - soft.detach(): the forward is the hard mask, the backward the soft relaxation's."""
    s = torch.rand(2, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).requires_grad_()
    soft = sigmoid_topk(s, 3, 0.1)
    ste = hard_topk_mask(s, 3) + soft - soft.detach()
    torch.testing.assert_close(ste.detach(), hard_topk_mask(s, 3), atol=1e-12, rtol=0)
    w = torch.randn(2, 10, dtype=torch.float64)
    (via_ste,) = torch.autograd.grad((ste * w).sum(), s, retain_graph=True)
    torch.testing.assert_close(via_ste, torch.autograd.grad((soft * w).sum(), s)[0])
