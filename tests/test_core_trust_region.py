"""Conjugate gradient: exact on an n x n SPD system in n steps, safe past convergence, and TRPO's use with a
Fisher-vector product by double backward."""

import pytest
import torch

from shifu.core import conjugate_gradient

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def spd(n, seed):
    m = torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return m @ m.T + torch.eye(n, dtype=torch.float64)


def test_solves_an_spd_system_in_n_steps():
    a = spd(6, 0)
    b = torch.arange(1.0, 7.0, dtype=torch.float64)
    x = conjugate_gradient(lambda v: a @ v, b, iters=6)
    torch.testing.assert_close(x, torch.linalg.solve(a, b))
    # one step is the steepest-descent step: x = (b.b / b.Ab) b
    torch.testing.assert_close(conjugate_gradient(lambda v: a @ v, b, iters=1), (b @ b) / (b @ a @ b) * b)


def test_iterating_past_convergence_stays_finite():
    a = torch.diag(torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64))  # 3 distinct eigenvalues
    b = torch.ones(3, dtype=torch.float64)
    x = conjugate_gradient(lambda v: a @ v, b, iters=20)
    torch.testing.assert_close(x, torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64))
    zero = conjugate_gradient(lambda v: a @ v, torch.zeros(3, dtype=torch.float64), iters=5)
    assert torch.equal(zero, torch.zeros(3, dtype=torch.float64))


def test_fisher_vector_product_by_autograd_solves_the_natural_gradient():
    """TRPO's use: F = Hessian of KL(p_old || softmax(theta)) at theta_old = diag(p) - p p^T (+ damping)."""
    theta = torch.tensor([0.3, -0.2, 1.0, 0.0], dtype=torch.float64, requires_grad=True)
    p_old = torch.softmax(theta, 0).detach()
    damping = 0.1

    def fvp(v):
        kl = (p_old * (p_old.log() - torch.log_softmax(theta, 0))).sum()
        (grad,) = torch.autograd.grad(kl, theta, create_graph=True)
        (hv,) = torch.autograd.grad(grad @ v, theta)
        return hv + damping * v

    fisher = torch.diag(p_old) - torch.outer(p_old, p_old) + damping * torch.eye(4, dtype=torch.float64)
    g = torch.tensor([0.5, -1.0, 0.25, 0.25], dtype=torch.float64)
    torch.testing.assert_close(conjugate_gradient(fvp, g, iters=4), torch.linalg.solve(fisher, g))


@pytest.mark.parametrize(
    ("b", "iters", "match"), [(torch.ones(2, 2), 3, "flat vector"), (torch.ones(2), 0, "iters >= 1")]
)
def test_bad_arguments_raise(b, iters, match):
    with pytest.raises(ValueError, match=match):
        conjugate_gradient(lambda v: v, b, iters)
