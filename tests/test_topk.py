"""Differentiable top-k relaxations (learnroute.gates.topk) against references computed here.

Every reference below is independent of the module: the sigmoid threshold comes from a plain
bisection in numpy, the Sinkhorn plan from a literal numpy transcription of Xie et al. 2020
(cost |s - a|^2, anchors {0, 1}, g = 0 start), the hard mask from Python's ``sorted``, and the
gradients from central finite differences of those references (or ``gradcheck`` on the
module's own forward, which checks its hand-written backward).
"""

from __future__ import annotations

import math

import numpy as np
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


# ---------------------------------------------------------------- independent references (numpy / Python)


def _np_sigmoid(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _ref_threshold_row(s: np.ndarray, k: float, tau: float) -> float:
    """t with sum_i sigmoid((s_i - t)/tau) = k for one row (0 < k < n): bracket expansion, then
    bisection down to adjacent floats. The sum decreases in t from n (t -> -inf) to 0 (t -> +inf)."""
    n = s.shape[-1]
    assert 0 < k < n

    def f(t: float) -> float:
        return float(_np_sigmoid((s - t) / tau).sum()) - k

    lo, hi = float(s.min()) - tau, float(s.max()) + tau
    width = hi - lo
    while f(lo) < 0:
        lo -= width
        width *= 2
    while f(hi) > 0:
        hi += width
        width *= 2
    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _ref_threshold(s: np.ndarray, k, tau) -> np.ndarray:
    """Per-row thresholds for s (..., n), k and tau broadcast to s.shape[:-1]."""
    lead = s.shape[:-1]
    k = np.broadcast_to(np.asarray(k, dtype=np.float64), lead)
    tau = np.broadcast_to(np.asarray(tau, dtype=np.float64), lead)
    out = np.empty(lead)
    for idx in np.ndindex(*lead):
        out[idx] = _ref_threshold_row(s[idx], float(k[idx]), float(tau[idx]))
    return out


def _ref_sigmoid_mask(s: np.ndarray, k, tau) -> np.ndarray:
    lead = s.shape[:-1]
    tau_b = np.broadcast_to(np.asarray(tau, dtype=np.float64), lead)
    t = _ref_threshold(s, k, tau)
    return _np_sigmoid((s - t[..., None]) / tau_b[..., None])


def _np_logsumexp(a: np.ndarray, axis: int) -> np.ndarray:
    m = a.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(a - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def _ref_sinkhorn_row(s: np.ndarray, k: float, tau: float, iters: int) -> np.ndarray:
    """Literal log-domain Sinkhorn of Xie et al. 2020 for one row: mass 1/n per score, anchors
    {0, 1} with masses ((n - k)/n, k/n), cost |s - a|^2, eps = 2 tau, duals start at g = 0;
    after the iterations one more row update, and the mask is n * Gamma[:, 1]."""
    n = s.shape[-1]
    eps = 2.0 * tau
    cost = np.stack([s**2, (s - 1.0) ** 2], axis=-1)  # (n, 2)
    log_mu = np.full(n, -math.log(n))
    log_nu = np.log(np.array([(n - k) / n, k / n]))
    g = np.zeros(2)
    for _ in range(iters):
        f = eps * (log_mu - _np_logsumexp((g[None, :] - cost) / eps, axis=1))
        g = eps * (log_nu - _np_logsumexp((f[:, None] - cost) / eps, axis=0))
    f = eps * (log_mu - _np_logsumexp((g[None, :] - cost) / eps, axis=1))
    return n * np.exp((f[:, None] + g[None, :] - cost) / eps)[:, 1]


def _ref_sinkhorn(s: np.ndarray, k, tau: float, iters: int) -> np.ndarray:
    lead = s.shape[:-1]
    k = np.broadcast_to(np.asarray(k, dtype=np.float64), lead)
    out = np.empty_like(s)
    for idx in np.ndindex(*lead):
        out[idx] = _ref_sinkhorn_row(s[idx], float(k[idx]), tau, iters)
    return out


def _ref_hard_row(s: list[float], k: float) -> list[float]:
    """round(k) (Python's half-to-even) largest, clamped to [0, n]; equal scores: lower index first."""
    n = len(s)
    kk = min(max(round(k), 0), n)
    keep = sorted(range(n), key=lambda i: (-s[i], i))[:kk]
    return [1.0 if i in keep else 0.0 for i in range(n)]


def _central_diff(fn, x: np.ndarray, h: float) -> np.ndarray:
    """d fn / d x by central differences; fn maps an array like x to a scalar."""
    grad = np.empty_like(x)
    for idx in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        grad[idx] = (fn(xp) - fn(xm)) / (2 * h)
    return grad


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


def test_references_themselves():
    """The test's references on hand-checkable inputs (so a broken reference cannot pass silently)."""
    # equal scores: t = s - tau * logit(k / n)
    s = np.full(8, 0.3)
    assert abs(_ref_threshold_row(s, 2.0, 0.1) - (0.3 - 0.1 * math.log(2 / 6))) < 1e-14
    # two scores, k = 1: by symmetry t is the midpoint
    assert abs(_ref_threshold_row(np.array([0.2, 0.9]), 1.0, 0.05) - 0.55) < 1e-14
    # literal Sinkhorn, one row update only, is the row-normalised Gibbs kernel with g = 0
    s = np.array([0.1, 0.7, 0.4])
    c0, c1 = s**2, (s - 1) ** 2
    expect = 1.0 / (1.0 + np.exp(-(c0 - c1) / 0.2))
    np.testing.assert_allclose(_ref_sinkhorn_row(s, 1.0, 0.1, 0), expect, atol=1e-15, rtol=0)
    assert _ref_hard_row([1.0, 2.0, 2.0, 0.0], 2.5) == [0.0, 1.0, 1.0, 0.0]


# ---------------------------------------------------------------- sum, range, order (all relaxations)


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


# ---------------------------------------------------------------- sigmoid threshold vs a bisected threshold


@pytest.mark.parametrize(
    ("scale", "tau"), [("ranks", 0.3), ("ranks", 0.05), ("ranks", 1e-3), ("raw", 20.0), ("raw", 1.0)]
)
def test_sigmoid_mask_is_sigmoid_of_bisected_threshold(scale, tau):
    """m = sigmoid((s - t)/tau) with t from an independent bisection; sum = k."""
    s = _scores(11, (3, 4, 33), scale, torch.float64)
    k = _budget(11, (3, 4), 33, torch.float64)
    m = soft_topk("sigmoid", s, k, tau)
    ref = _ref_sigmoid_mask(s.numpy(), k.numpy(), tau)
    np.testing.assert_allclose(m.numpy(), ref, atol=1e-9, rtol=0)
    np.testing.assert_allclose(m.sum(-1).numpy(), k.numpy(), atol=1e-9, rtol=1e-12)
    # float32 output: same mask up to float32 rounding
    s32, k32 = s.float(), k.float()
    ref32 = _ref_sigmoid_mask(s32.double().numpy(), k32.double().numpy(), tau)
    np.testing.assert_allclose(sigmoid_topk(s32, k32, tau).double().numpy(), ref32, atol=2e-6, rtol=0)


def test_sigmoid_per_row_tau_and_broadcast_k():
    """A tau per row and one scalar k for every row: each row solved with its own temperature."""
    s = _scores(12, (3, 10), "ranks", torch.float64)
    tau = torch.tensor([0.02, 0.1, 1.0], dtype=torch.float64)
    m = sigmoid_topk(s, 3.7, tau)
    np.testing.assert_allclose(m.numpy(), _ref_sigmoid_mask(s.numpy(), 3.7, tau.numpy()), atol=1e-10, rtol=0)


def test_sigmoid_tiny_tau_raw_scale_float32():
    """Raw-scale float32 scores with tau = 1e-4 still hit the budget (the search runs in float64)."""
    g = torch.Generator().manual_seed(5)
    s = (torch.randn(4, 3, 1000, generator=g) * 1000.0).float()
    k = torch.tensor([1.0, 17.3, 500.5, 999.9]).unsqueeze(-1)  # (4, 1) broadcast over heads
    m = sigmoid_topk(s, k, 1e-4)
    assert ((m.double().sum(-1) - k.double()).abs() <= 1e-5 * k.double().clamp(min=1)).all()


# ---------------------------------------------------------------- sigmoid gradients


def _gc_inputs(seed: int, shape=(2, 3, 7), scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    s = (torch.rand(shape, generator=g, dtype=torch.float64) * scale).requires_grad_()
    k = (torch.rand(shape[:-1], generator=g, dtype=torch.float64) * (shape[-1] - 1) + 0.5).requires_grad_()
    return s, k


@pytest.mark.parametrize(("tau", "scale"), [(0.3, 1.0), (0.05, 1.0), (20.0, 300.0)])
def test_sigmoid_gradcheck_scores_k_tau(tau, scale):
    """The implicit backward against finite differences of the module's own forward (float64)."""
    s, k = _gc_inputs(0, scale=scale)
    t = torch.full(s.shape[:-1], tau, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, k, t: sigmoid_topk(s, k, t, tol=1e-14), (s, k, t))


def test_sigmoid_gradcheck_broadcast_k():
    """One scalar k shared by every row: its gradient is the sum over rows."""
    s, _ = _gc_inputs(1)
    k = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, k: sigmoid_topk(s, k, 0.2, tol=1e-14), (s, k))


@pytest.mark.parametrize("tau", [0.3, 0.05])
def test_sigmoid_grad_matches_finite_differences_of_reference(tau):
    """d/d(s, k, tau) of sum_i w_i m_i: autograd through the module vs central differences of the
    bisection reference."""
    g = torch.Generator().manual_seed(13)
    s = torch.rand(2, 7, generator=g, dtype=torch.float64)
    k = torch.tensor([1.3, 4.6], dtype=torch.float64)
    t = torch.tensor([tau, 1.5 * tau], dtype=torch.float64)
    w = torch.randn(2, 7, generator=g, dtype=torch.float64)
    sv, kv, tv = (x.clone().requires_grad_() for x in (s, k, t))
    ds, dk, dt = torch.autograd.grad((sigmoid_topk(sv, kv, tv, tol=1e-14) * w).sum(), (sv, kv, tv))

    s_np, k_np, t_np, w_np = s.numpy(), k.numpy(), t.numpy(), w.numpy()
    h = 1e-5 * tau
    ref_ds = _central_diff(lambda x: float((_ref_sigmoid_mask(x, k_np, t_np) * w_np).sum()), s_np, h)
    ref_dk = _central_diff(lambda x: float((_ref_sigmoid_mask(s_np, x, t_np) * w_np).sum()), k_np, 1e-5)
    ref_dt = _central_diff(lambda x: float((_ref_sigmoid_mask(s_np, k_np, x) * w_np).sum()), t_np, h)
    for got, ref in ((ds, ref_ds), (dk, ref_dk), (dt, ref_dt)):
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(got.numpy(), ref, atol=1e-6 * scale, rtol=1e-6)


@pytest.mark.parametrize("tau", [0.2, 0.03])
def test_sigmoid_implicit_threshold_gradient_formula(tau):
    """background.md §4: dt/ds_j = sigma'_j / sum sigma' (and dt/dk = -tau / sum sigma').

    The formula is checked against finite differences of the bisected threshold, and the module's
    backward against the formula: t is read back from the module's mask as
    t = s_i - tau * logit(m_i) at the entry nearest 0.5, and differentiated through autograd."""
    g = torch.Generator().manual_seed(14)
    s = torch.rand(9, generator=g, dtype=torch.float64)
    k = 3.4
    s_np = s.numpy()
    t_ref = _ref_threshold_row(s_np, k, tau)
    x = (s_np - t_ref) / tau
    dsig = _np_sigmoid(x) * _np_sigmoid(-x)  # sigma'(x_j)
    formula_ds = dsig / dsig.sum()
    formula_dk = -tau / dsig.sum()

    # the formula against the independent solver
    fd_ds = _central_diff(lambda v: _ref_threshold_row(v, k, tau), s_np, 1e-6 * tau)
    fd_dk = (_ref_threshold_row(s_np, k + 1e-6, tau) - _ref_threshold_row(s_np, k - 1e-6, tau)) / 2e-6
    np.testing.assert_allclose(fd_ds, formula_ds, atol=1e-6, rtol=0)
    assert abs(fd_dk - formula_dk) < 1e-6 * abs(formula_dk)

    # the module's backward against the formula
    sv = s.clone().requires_grad_()
    kv = torch.tensor(k, dtype=torch.float64, requires_grad=True)
    m = sigmoid_topk(sv, kv, tau, tol=1e-14)
    i = int((m.detach() - 0.5).abs().argmin())
    t_mod = sv[i] - tau * torch.log(m[i] / (1.0 - m[i]))
    assert abs(t_mod.item() - t_ref) < 1e-10
    got_ds, got_dk = torch.autograd.grad(t_mod, (sv, kv))
    np.testing.assert_allclose(got_ds.numpy(), formula_ds, atol=1e-9, rtol=0)
    assert abs(got_dk.item() - formula_dk) < 1e-9 * abs(formula_dk)


def test_sigmoid_grad_k_distributes_one_unit():
    """d(sum m)/dk = 1 exactly, also for a near-hard mask where every sigma' underflows."""
    s = torch.linspace(0, 1, 11, dtype=torch.float64)
    for tau, k0 in ((0.1, 3.0), (1e-5, 3.0), (1e-5, 3.4)):  # 1e-5: |x| >= 5000, sigma' = 0
        k = torch.tensor(k0, dtype=torch.float64, requires_grad=True)
        (dk,) = torch.autograd.grad(sigmoid_topk(s, k, tau).sum(), k)
        assert abs(dk.item() - 1.0) < 1e-9, (tau, k0, dk.item())


# ---------------------------------------------------------------- Sinkhorn (Xie et al. 2020) vs literal numpy


@pytest.mark.parametrize("iters", [1, 5, 40])
def test_sinkhorn_zero_init_is_the_papers_iteration(iters):
    """init="zero" after any number of iterations: the literal paper iteration's plan, row by row."""
    g = torch.Generator().manual_seed(4)
    s = torch.rand(3, 25, dtype=torch.float64, generator=g)
    k = torch.tensor([6.5, 1.2, 20.0], dtype=torch.float64)
    ref = _ref_sinkhorn(s.numpy(), k.numpy(), 0.05, iters)
    np.testing.assert_allclose(sinkhorn_topk(s, k, 0.05, iters=iters, init="zero").numpy(), ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("init", ["sigmoid", "zero"])
def test_sinkhorn_converged_is_bisected_sigmoid_and_sums_to_k(init):
    """At convergence the entropic-OT mask (eps = 2 tau) is sigmoid((s - t)/tau) with the bisected t,
    lies in [0, 1] and sums to k; the literal reference converges to the same mask."""
    s = torch.rand(3, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    k = torch.tensor([2.0, 7.25, 29.5], dtype=torch.float64)
    m = sinkhorn_topk(s, k, 0.1, iters=300, init=init)
    ref = _ref_sigmoid_mask(s.numpy(), k.numpy(), 0.1)
    np.testing.assert_allclose(m.numpy(), ref, atol=1e-9, rtol=0)
    np.testing.assert_allclose(_ref_sinkhorn(s.numpy(), k.numpy(), 0.1, 300), ref, atol=1e-9, rtol=0)
    assert (m >= 0).all() and (m <= 1).all()
    np.testing.assert_allclose(m.sum(-1).numpy(), k.numpy(), atol=1e-9 * 30, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_integer_k_small_tau_is_hard_topk(name):
    """Distinct scores with gaps 1/n, integer k, tau << gap: the soft mask is the sorted top-k."""
    g = torch.Generator().manual_seed(3)
    L, H, n = 2, 3, 40
    s = torch.stack([torch.randperm(n, generator=g) for _ in range(L * H)]).reshape(L, H, n).double() / n
    k = torch.randint(1, n, (L, H), generator=g)
    ref = torch.tensor(
        [[_ref_hard_row(s[i, j].tolist(), int(k[i, j])) for j in range(H)] for i in range(L)], dtype=torch.float64
    )
    for tau in (1.0 / n / 40, 1.0 / n / 200):
        m = soft_topk(name, s, k.double(), tau)
        assert (m >= 0).all() and (m <= 1).all()
        torch.testing.assert_close(m, ref, atol=1e-6, rtol=0)
    # and it is not hard at a large tau (the test can tell the difference)
    assert (soft_topk(name, s, k.double(), 0.2) - ref).abs().max() > 0.1


@pytest.mark.parametrize("init", ["sigmoid", "zero"])
def test_sinkhorn_gradcheck_scores_k(init):
    s, k = _gc_inputs(2, shape=(2, 6))
    assert torch.autograd.gradcheck(lambda s, k: sinkhorn_topk(s, k, 0.2, iters=30, init=init), (s, k))


def test_sinkhorn_unrolled_grad_matches_finite_differences_of_literal_reference():
    """init="zero", 30 iterations: the unrolled autograd gradient is the derivative of the literal
    30-iteration map (central differences of the numpy reference)."""
    g = torch.Generator().manual_seed(15)
    s = torch.rand(2, 6, generator=g, dtype=torch.float64)
    k = torch.tensor([1.7, 3.2], dtype=torch.float64)
    w = torch.randn(2, 6, generator=g, dtype=torch.float64)
    sv, kv = s.clone().requires_grad_(), k.clone().requires_grad_()
    ds, dk = torch.autograd.grad((sinkhorn_topk(sv, kv, 0.2, iters=30, init="zero") * w).sum(), (sv, kv))
    s_np, k_np, w_np = s.numpy(), k.numpy(), w.numpy()
    ref_ds = _central_diff(lambda x: float((_ref_sinkhorn(x, k_np, 0.2, 30) * w_np).sum()), s_np, 1e-6)
    ref_dk = _central_diff(lambda x: float((_ref_sinkhorn(s_np, x, 0.2, 30) * w_np).sum()), k_np, 1e-6)
    np.testing.assert_allclose(ds.numpy(), ref_ds, atol=1e-7, rtol=1e-6)
    np.testing.assert_allclose(dk.numpy(), ref_dk, atol=1e-7, rtol=1e-6)


def test_sinkhorn_grad_at_moderate_tau_matches_finite_differences_of_bisected_sigmoid():
    """Default init, 100 iterations, tau = 0.1: the unrolled gradient has converged to the derivative
    of the fixed point, i.e. of the bisected sigmoid mask."""
    g = torch.Generator().manual_seed(3)
    s = torch.rand(3, 12, generator=g, dtype=torch.float64)
    k = torch.tensor([2.5, 6.0, 9.75], dtype=torch.float64)
    w = torch.randn(3, 12, generator=g, dtype=torch.float64)
    sv, kv = s.clone().requires_grad_(), k.clone().requires_grad_()
    ds, dk = torch.autograd.grad((sinkhorn_topk(sv, kv, 0.1) * w).sum(), (sv, kv))
    s_np, k_np, w_np = s.numpy(), k.numpy(), w.numpy()
    ref_ds = _central_diff(lambda x: float((_ref_sigmoid_mask(x, k_np, 0.1) * w_np).sum()), s_np, 1e-6)
    ref_dk = _central_diff(lambda x: float((_ref_sigmoid_mask(s_np, x, 0.1) * w_np).sum()), k_np, 1e-5)
    np.testing.assert_allclose(ds.numpy(), ref_ds, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(dk.numpy(), ref_dk, atol=1e-6, rtol=1e-6)


def test_sinkhorn_rejects_unknown_init():
    with pytest.raises(ValueError, match="init"):
        sinkhorn_topk(torch.rand(5), 2, 0.1, init="warm")


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", NAMES)
def test_edge_budgets(name):
    """k <= 0: zeros, k >= n: ones, with zero (finite) gradient; interior rows are the reference mask."""
    n = 6
    s = torch.rand(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).requires_grad_()
    k = torch.tensor([0.0, -2.0, float(n), n + 3.5, 2.5], dtype=torch.float64, requires_grad=True)
    m = soft_topk(name, s, k, 0.1)
    assert (m[:2] == 0).all() and (m[2:4] == 1).all()
    ref = _ref_sigmoid_mask(s[4].detach().numpy(), 2.5, 0.1)
    np.testing.assert_allclose(m[4].detach().numpy(), ref, atol=1e-9, rtol=0)
    w = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    ds, dk = torch.autograd.grad((m * w).sum(), (s, k))
    assert torch.isfinite(ds).all() and torch.isfinite(dk).all()
    assert (ds[:4] == 0).all() and (dk[:4] == 0).all()
    assert ds[4].abs().sum() > 0 and dk[4].abs() > 0


@pytest.mark.parametrize("name", NAMES)
def test_equal_scores_share_the_budget(name):
    s = torch.full((2, 8), 0.3, dtype=torch.float64)
    m = soft_topk(name, s, torch.tensor([2.0, 5.5], dtype=torch.float64), 1e-3)
    torch.testing.assert_close(m, torch.tensor([[2 / 8] * 8, [5.5 / 8] * 8], dtype=torch.float64))


def test_unknown_relaxation_lists_valid_names():
    assert set(RELAXATIONS) == {"sigmoid", "sinkhorn"}  # the documented registry
    with pytest.raises(ValueError) as e:
        soft_topk("gumbel", torch.rand(4), 2, 0.1)
    msg = str(e.value)
    assert "'gumbel'" in msg and "'sigmoid'" in msg and "'sinkhorn'" in msg, msg


@pytest.mark.parametrize("name", NAMES)
def test_bad_arguments(name):
    with pytest.raises(ValueError, match="tau"):
        soft_topk(name, torch.rand(4), 2, 0.0)
    with pytest.raises(ValueError, match="broadcast"):
        soft_topk(name, torch.rand(2, 3, 5), torch.ones(4), 0.1)
    with pytest.raises(TypeError):
        soft_topk(name, torch.arange(5), 2, 0.1)


# ---------------------------------------------------------------- hard top-k vs Python's sorted


@settings(max_examples=60, deadline=None)
@given(
    shape=shape_st,
    seed=st.integers(0, 10_000),
    levels=st.sampled_from([3, 10, 0]),  # 3, 10: many ties; 0: continuous scores
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_hard_topk_matches_sorted_reference(shape, seed, levels, dtype):
    """Ties go to the lower index; k rounds half-to-even (Python's round) and clamps into [0, n]."""
    g = torch.Generator().manual_seed(seed)
    if levels:
        s = torch.randint(0, levels, shape, generator=g).to(dtype)
    else:
        s = torch.randn(shape, generator=g, dtype=dtype)
    n = shape[-1]
    # integers, exact halves and arbitrary fractions, some outside [0, n]
    k = (torch.randint(-4, 2 * n + 5, shape[:-1], generator=g).double() / 2).to(torch.float64)
    k = torch.where(torch.rand(shape[:-1], generator=g) < 0.3, k + 0.3, k)
    m = hard_topk_mask(s, k)
    assert m.dtype == dtype and m.shape == s.shape
    flat_s, flat_k = s.reshape(-1, n).tolist(), k.reshape(-1).tolist()
    ref = torch.tensor([_ref_hard_row(row, kk) for row, kk in zip(flat_s, flat_k, strict=True)], dtype=dtype)
    assert torch.equal(m.reshape(-1, n), ref)


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
    # integer scores: a float32 mask
    assert torch.equal(hard_topk_mask(torch.tensor([3, 1, 3, 2]), 2), torch.tensor([1.0, 0, 1, 0]))
