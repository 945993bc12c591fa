"""The hand-written CPU paths and the tanh-Gaussian against the modules they stand in for."""

from __future__ import annotations

import pytest
import torch

from offaug.algorithms.nn.distributions import tanh_gaussian
from offaug.algorithms.nn.kernels import batched_affine
from offaug.algorithms.nn.networks import CriticEnsemble, TanhGaussianActor, ensemble_values

# (members, rows, inputs, outputs): one-unit and narrowing layers take the hand-laid products,
# widening ones baddbmm itself.
AFFINE_SHAPES = [(3, 7, 5, 1), (3, 7, 5, 4), (2, 6, 4, 9), (1, 5, 3, 3)]


def test_tanh_gaussian_matches_the_actor() -> None:
    torch.manual_seed(0)
    actor = TanhGaussianActor(5, 3, (16, 16))
    obs = torch.randn(7, 5)
    torch.manual_seed(1)
    expected = actor(obs)
    torch.manual_seed(1)
    noise = torch.randn(1, 7, 3)
    mean, log_std = actor.mean_log_std(obs)
    actions, log_prob = tanh_gaussian(mean, log_std, noise)
    torch.testing.assert_close(actions[0], expected.actions)
    torch.testing.assert_close(log_prob[0], expected.log_prob)


@pytest.mark.parametrize("batched", [False, True], ids=["per-member-blocks", "batched"])
def test_ensemble_values_match_the_critic_module_and_freeze_weights(batched: bool) -> None:
    torch.manual_seed(0)
    critic = CriticEnsemble(5, 2, (16, 16), members=3)
    obs, actions = torch.randn(5000, 5), torch.rand(5000, 2) * 2 - 1  # several CPU blocks
    values = ensemble_values(critic, obs, actions, batched=batched)
    torch.testing.assert_close(values, critic(obs, actions))
    values.sum().backward()
    gradients = [p.grad for p in critic.parameters()]
    critic.zero_grad()
    critic(obs, actions).sum().backward()
    for got, expected in zip(gradients, [p.grad for p in critic.parameters()], strict=True):
        assert got is not None and expected is not None
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # sums of 5000 rows
    critic.zero_grad(set_to_none=True)
    actions.requires_grad_(True)
    ensemble_values(critic, obs, actions, frozen=True, batched=batched).sum().backward()
    assert actions.grad is not None
    assert all(p.grad is None for p in critic.parameters())


@pytest.mark.parametrize("shape", AFFINE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["in-out", "out-in"])
def test_batched_affine_is_baddbmm_forward_and_backward(
    shape: tuple[int, int, int, int], layout: str
) -> None:
    members, rows, inputs, outputs = shape
    generator = torch.Generator().manual_seed(0)

    def leaf(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, dtype=torch.float64).requires_grad_()

    x, bias = leaf(members, rows, inputs), leaf(members, 1, outputs)
    # An nn.Linear-layout stack (E, out, in) reaches the function as a transposed view.
    stored = (
        leaf(members, inputs, outputs) if layout == "in-out" else leaf(members, outputs, inputs)
    )

    def weight() -> torch.Tensor:
        return stored if layout == "in-out" else stored.transpose(1, 2)

    assert torch.autograd.gradcheck(
        lambda x, w, b: batched_affine(x, weight(), b), (x, stored, bias)
    )
    got = batched_affine(x, weight(), bias)
    torch.testing.assert_close(got, torch.baddbmm(bias, x, weight()))
    assert got.is_contiguous()
    # Only the inputs that need a gradient get one (an actor's loss through frozen critics).
    frozen = batched_affine(x, weight().detach(), bias.detach())
    (grad_x,) = torch.autograd.grad(frozen.sum(), [x])
    (expected,) = torch.autograd.grad(torch.baddbmm(bias, x, weight()).sum(), [x])
    torch.testing.assert_close(grad_x, expected)


def test_batched_affine_under_vmap_matches_each_member() -> None:
    torch.manual_seed(0)
    x, weight, bias = torch.randn(4, 3, 7, 5), torch.randn(4, 3, 5, 1), torch.randn(4, 3, 1, 1)

    def loss(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return batched_affine(x, w, b).pow(2).sum()

    grads = torch.func.vmap(torch.func.grad(loss))(weight, x, bias)
    for k in range(4):
        member = (bias[k], x[k])
        expected = torch.func.grad(lambda w, m=member: torch.baddbmm(m[0], m[1], w).pow(2).sum())(
            weight[k]
        )
        torch.testing.assert_close(grads[k], expected)
