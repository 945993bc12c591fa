"""Networks shared by every offaug learner.

* :class:`MLP` and :class:`EnsembleMLP` (``E`` independent MLPs evaluated in one batched
  matrix multiply per layer, :func:`~offaug.algorithms.nn.kernels.batched_affine`, no Python loop
  over members), each with an optional LayerNorm after every hidden layer
  (:class:`EnsembleLayerNorm` per member);
* :class:`CriticEnsemble` (continuous Q(s, a), ``E`` critics at once) and
  :class:`DiscreteCriticEnsemble` (Q(s, .) for every discrete action);
* :class:`TanhGaussianActor` (SAC/CQL), :class:`DeterministicActor`,
  :class:`TruncatedGaussianActor` (the behaviour model beta_hat(a|s): a Gaussian renormalised on
  the action box, so its log-density is a proper density over the actions the data can hold);
* :class:`VAE` (BCQ's generative model of dataset actions);
* :class:`LearnedScalar` (one learned number: a temperature's or a multiplier's log).

All actors work in the normalised action box ``[-1, 1]^d``;
:class:`~offaug.algorithms.nn.distributions.ActionNormaliser` maps to and from the environment's
bounds.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from offaug.algorithms.nn.distributions import (
    ActionNormaliser,
    tanh_gaussian,
    tanh_gaussian_log_prob,
    truncated_normal_log_prob,
)
from offaug.algorithms.nn.kernels import Affine, affine_mlp, batched_affine, ensemble_mlp

LOG_STD_MIN = -5.0
LOG_STD_MAX = 2.0


def _layer_sizes(inputs: int, hidden: Sequence[int], outputs: int) -> list[tuple[int, int]]:
    sizes = [inputs, *hidden, outputs]
    return list(itertools.pairwise(sizes))


class MLP(nn.Module):
    """A ReLU multi-layer perceptron with a linear output layer.

    ``layer_norm`` puts a LayerNorm after every hidden ReLU (ReBRAC's networks); without it the
    layers (and state_dict keys) are the plain ``Linear, ReLU, ..., Linear``.
    """

    def __init__(
        self, inputs: int, hidden: Sequence[int], outputs: int, *, layer_norm: bool = False
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(_layer_sizes(inputs, hidden, outputs)):
            layers.append(nn.Linear(n_in, n_out))
            if i < len(hidden):
                layers.append(nn.ReLU())
                if layer_norm:
                    layers.append(nn.LayerNorm(n_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The layers of ``net`` (which keeps the state_dict keys) applied directly: each ReLU
        # runs in place on its linear layer's fresh output (the linear backward needs its input,
        # not its output), sparing an activation buffer per layer: on the CPU this trains faster
        # than nn.Sequential with out-of-place ReLUs.
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                x = _linear(x, layer.weight, layer.bias)
            elif isinstance(layer, nn.ReLU):
                x = x.relu_()
            elif isinstance(layer, nn.LayerNorm) and layer.weight.dim() == 2:
                # A stacked run's per-member affine (K, d) on (K, B, d) rows.
                x = F.layer_norm(x, layer.normalized_shape, eps=layer.eps)
                x = torch.addcmul(layer.bias.unsqueeze(1), x, layer.weight.unsqueeze(1))
            else:
                x = layer(x)
        return x


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``nn.Linear``'s map; with a stacked run's weights ``(K, out, in)`` (a fused trainer's
    ``stacked`` losses) member ``k``'s layer on rows ``x[k]``: one batched multiply."""
    if weight.dim() == 2:
        return F.linear(x, weight, bias)
    return batched_affine(x, weight.transpose(1, 2), bias.unsqueeze(1))


class EnsembleLinear(nn.Module):
    """``E`` linear layers applied at once: ``(E, B, in) -> (E, B, out)``."""

    def __init__(self, members: int, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(members, inputs, outputs))
        self.bias = nn.Parameter(torch.empty(members, 1, outputs))
        # The same initialisation as nn.Linear, member by member.
        bound = 1.0 / math.sqrt(inputs)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batched_affine(x, self.weight, self.bias)


class EnsembleLayerNorm(nn.Module):
    """LayerNorm over the last axis with each member's own scale and shift: ``(E, B, d)``."""

    def __init__(self, members: int, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(members, 1, features))
        self.bias = nn.Parameter(torch.zeros(members, 1, features))
        # A constant unit affine for the shared normalisation: torch's CPU layer_norm without
        # an affine takes a slower path (torch 2.13, one thread; a few % of ReBRAC's step).
        self.unit_weight: torch.Tensor
        self.unit_bias: torch.Tensor
        self.register_buffer("unit_weight", torch.ones(features), persistent=False)
        self.register_buffer("unit_bias", torch.zeros(features), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.bias, self.normalise(x), self.weight)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """The normalisation alone (no member's affine), over every member's rows at once."""
        return F.layer_norm(x, x.shape[-1:], self.unit_weight, self.unit_bias)

    def fold(self, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next layer's ``(weight, bias)`` with this affine folded in.

        ``(n * g + b) @ W + c == n @ (g^T * W) + (b @ W + c)``: the affine then costs a few
        weight-sized ops instead of activation-sized ones forward and backward.
        """
        return self.weight.transpose(1, 2) * weight, torch.baddbmm(bias, self.bias, weight)

    def member(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s LayerNorm alone: ``(B, d) -> (B, d)``."""
        features = x.shape[-1:]
        return F.layer_norm(x, features, self.weight[index, 0], self.bias[index, 0])


class EnsembleMLP(nn.Module):
    """``E`` independent MLPs evaluated together: ``(B, in)`` or ``(E, B, in) -> (E, B, out)``.

    ``layer_norm`` puts an :class:`EnsembleLayerNorm` after every hidden ReLU (ReBRAC's critics);
    the linear layers keep their state_dict keys either way.
    """

    def __init__(
        self,
        members: int,
        inputs: int,
        hidden: Sequence[int],
        outputs: int,
        *,
        layer_norm: bool = False,
    ) -> None:
        super().__init__()
        self.members = members
        self.layers = nn.ModuleList(
            EnsembleLinear(members, n_in, n_out)
            for n_in, n_out in _layer_sizes(inputs, hidden, outputs)
        )
        self.norms = (
            nn.ModuleList(EnsembleLayerNorm(members, width) for width in hidden)
            if layer_norm
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        affines = self.affines()
        if affines[0][0].dim() == 4:
            return self._stacked(affines, x)
        if x.dim() == 2:
            x = x.unsqueeze(0).expand(self.members, -1, -1)  # (B, in) -> (E, B, in)
        if self.norms is None:
            return ensemble_mlp(affines, x)
        # LayerNorm between layers (ReBRAC critics): one normalisation over every member's
        # rows, each member's affine folded into the layer after it.
        norms = [n for n in self.norms if isinstance(n, EnsembleLayerNorm)]
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, EnsembleLinear)
            weight: torch.Tensor = layer.weight
            bias: torch.Tensor = layer.bias
            if i > 0:
                weight, bias = norms[i - 1].fold(weight, bias)
            x = batched_affine(x, weight, bias)
            if i < len(norms):
                x = norms[i].normalise(x.relu_())  # in place on the multiply's fresh output
        return x

    def _stacked(
        self, affines: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor
    ) -> torch.Tensor:
        """A stacked fused run's K ensembles (weights ``(K, E, in, out)``) on each member's rows
        ``(K, B, in)``, or ``(K, E, B, in)`` per critic: ``-> (K, E, B, out)``, the K * E
        networks as one batched multiply per layer."""
        if self.norms is not None:
            raise ValueError("a stacked run cannot evaluate LayerNorm ensembles")
        members, critics = affines[0][0].shape[:2]
        if x.dim() == 3:
            x = x.unsqueeze(1).expand(-1, critics, -1, -1)
        layers = [(w.flatten(0, 1), b.flatten(0, 1)) for w, b in affines]
        out = ensemble_mlp(layers, x.flatten(0, 1))
        return out.view(members, critics, *out.shape[1:])

    def affines(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``(weight (E, in, out), bias (E, 1, out))``, input layer first."""
        return [
            (layer.weight, layer.bias) for layer in self.layers if isinstance(layer, EnsembleLinear)
        ]

    def member(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index`` alone: ``(B, in) -> (B, out)``, one ``addmm`` per layer (a stacked
        run's ``(K, B, in) -> (K, B, out)``, one batched multiply)."""
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, EnsembleLinear)
            # The ensemble axis is third from the end: (E, in, out), stacked (K, E, in, out).
            weight, bias = layer.weight.select(-3, index), layer.bias.select(-3, index)
            x = (
                torch.addmm(bias, x, weight)
                if weight.dim() == 2
                else batched_affine(x, weight, bias)
            )
            if i < last:
                x = x.relu_()
                if self.norms is not None:
                    norm = self.norms[i]
                    assert isinstance(norm, EnsembleLayerNorm)
                    x = norm.member(index, x)
        return x


class CriticEnsemble(nn.Module):
    """``E`` continuous critics Q_e(s, a): ``(B, obs), (B, act) -> (E, B)``.

    Inputs may carry a leading ``E`` axis (``(E, B, .)``) when every member scores its own batch.
    """

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        hidden: Sequence[int],
        members: int = 2,
        *,
        layer_norm: bool = False,
    ) -> None:
        super().__init__()
        self.members = members
        self.net = EnsembleMLP(
            members, observation_dim + action_dim, hidden, 1, layer_norm=layer_norm
        )

    def forward(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([observations, actions], dim=-1)).squeeze(-1)

    def member(self, index: int, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Critic ``index`` alone: ``(B, obs), (B, act) -> (B,)`` (TD3's actor uses Q_1)."""
        return self.net.member(index, torch.cat([observations, actions], dim=-1)).squeeze(-1)


class DiscreteCriticEnsemble(nn.Module):
    """``E`` discrete critics: ``(B, obs) -> (E, B, n_actions)``."""

    def __init__(
        self, observation_dim: int, n_actions: int, hidden: Sequence[int], members: int = 1
    ) -> None:
        super().__init__()
        self.members = members
        self.net = EnsembleMLP(members, observation_dim, hidden, n_actions)

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        return self.net(observations)


@dataclasses.dataclass(frozen=True)
class ActionSample:
    """Actions drawn from a stochastic policy with their log-density."""

    actions: torch.Tensor  # (B, act) in [-1, 1]
    log_prob: torch.Tensor  # (B,)


class TanhGaussianActor(nn.Module):
    """A Gaussian squashed by tanh (SAC): samples lie in ``(-1, 1)^d``."""

    def __init__(self, observation_dim: int, action_dim: int, hidden: Sequence[int]) -> None:
        super().__init__()
        if not hidden:
            raise ValueError("TanhGaussianActor needs at least one hidden layer")
        self.trunk = nn.Sequential(
            MLP(observation_dim, hidden[:-1], hidden[-1]), nn.ReLU(inplace=True)
        )
        self.head = nn.Linear(hidden[-1], 2 * action_dim)
        self.action_dim = action_dim

    def mean_log_std(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Gaussian's mean and log std before squashing: ``(..., act)`` each."""
        mean, log_std = self.head(self.trunk(observations)).chunk(2, dim=-1)
        return mean, log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)

    def forward(self, observations: torch.Tensor) -> ActionSample:
        """Reparameterised sample and its log-density (tanh change of variables)."""
        mean, log_std = self.mean_log_std(observations)
        actions, log_prob = tanh_gaussian(mean, log_std, torch.randn_like(mean))
        return ActionSample(actions, log_prob)

    def sample_n(self, observations: torch.Tensor, n: int) -> ActionSample:
        """``n`` samples per observation: ``(B, obs) -> actions (n, B, act), log_prob (n, B)``."""
        repeated = observations.unsqueeze(0).expand(n, *observations.shape)  # (n, B, obs)
        return self(repeated)

    def deterministic(self, observations: torch.Tensor) -> torch.Tensor:
        """The squashed mean action."""
        mean, _ = self.mean_log_std(observations)
        return torch.tanh(mean)

    def log_prob(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Log-density of given actions in ``[-1, 1]^d``: ``(B, obs), (B, act) -> (B,)``."""
        mean, log_std = self.mean_log_std(observations)
        return tanh_gaussian_log_prob(actions, mean, log_std)

    def env_log_prob(
        self, observations: torch.Tensor, actions: torch.Tensor, normaliser: ActionNormaliser
    ) -> torch.Tensor:
        """``log pi(a|s)`` of environment-space actions: a density over the environment's box.

        The density over the open normalised box (an action on a face is moved just inside:
        :func:`~offaug.algorithms.nn.distributions.tanh_gaussian_log_prob`) plus the box's
        ``log |det|``, so it compares with ``log mu``.
        """
        return self.log_prob(observations, normaliser(actions)) + normaliser.log_abs_det


class DeterministicActor(nn.Module):
    """``a = tanh(MLP(s))``: deterministic BC and TD3-style actors."""

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        hidden: Sequence[int],
        *,
        layer_norm: bool = False,
    ) -> None:
        super().__init__()
        self.net = MLP(observation_dim, hidden, action_dim, layer_norm=layer_norm)

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(observations))


class TruncatedGaussianActor(nn.Module):
    """beta_hat(a|s): a Gaussian with state-dependent mean and std, truncated to ``[-1, 1]^d``.

    Truncation keeps the density proper on the action box that dataset actions live in, so
    ``log_prob`` can be compared with a rollout policy's density for importance weights.
    """

    def __init__(self, observation_dim: int, action_dim: int, hidden: Sequence[int]) -> None:
        super().__init__()
        self.net = MLP(observation_dim, hidden, 2 * action_dim)

    def mean_log_std(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The untruncated Gaussian's mean (inside the box) and log std."""
        mean, log_std = self.net(observations).chunk(2, dim=-1)
        return torch.tanh(mean), log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)

    def log_prob(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``log beta_hat(a|s)``: ``(B, obs), (B, act) -> (B,)``."""
        mean, log_std = self.mean_log_std(observations)
        return truncated_normal_log_prob(actions, mean, log_std)

    def deterministic(self, observations: torch.Tensor) -> torch.Tensor:
        """The mean action."""
        return self.mean_log_std(observations)[0]


class VAE(nn.Module):
    """BCQ's conditional VAE of dataset actions (Fujimoto et al. 2019, appendix D)."""

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        hidden: Sequence[int],
        latent_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.latent_dim = latent_dim or 2 * action_dim
        self.encoder = MLP(observation_dim + action_dim, hidden, 2 * self.latent_dim)
        self.decoder = MLP(observation_dim + self.latent_dim, hidden, action_dim)

    def forward(
        self, observations: torch.Tensor, actions: torch.Tensor, noise: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reconstruction, latent mean and latent log std.

        ``noise`` ``(B, latent)``: the standard normal draw of the reparameterised latent
        (drawn from the global generator when not given).
        """
        mean, log_std = self.encoder(torch.cat([observations, actions], -1)).chunk(2, dim=-1)
        log_std = log_std.clamp(-4.0, 15.0)
        if noise is None:
            noise = torch.randn_like(mean)
        latent = mean + log_std.exp() * noise
        return self.decode(observations, latent), mean, log_std

    def decode(
        self, observations: torch.Tensor, latent: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Actions for ``observations``; without ``latent``, from the clipped prior."""
        if latent is None:
            shape = (*observations.shape[:-1], self.latent_dim)
            latent = torch.randn(shape, device=observations.device).clamp(-0.5, 0.5)
        return torch.tanh(self.decoder(torch.cat([observations, latent], -1)))


class LearnedScalar(nn.Module):
    """One learned number (a log temperature, a log multiplier) as a module of its own, so that
    it is stacked, stepped and checkpointed as a network's parameters are."""

    def __init__(self, value: float, *, requires_grad: bool = True) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.tensor(value), requires_grad=requires_grad)


# -- the modules' layers as affine maps, for the hand-written forwards of kernels --------------

CPU_BLOCK_ROWS = 2048
"""Rows per matrix multiply when critics are evaluated on the CPU (see :func:`ensemble_values`)."""


def mlp_affines(mlp: MLP) -> list[Affine]:
    """The layers of an :class:`MLP` (``nn.Linear`` stores its weight as ``(out, in)``)."""
    return [(layer.weight.t(), layer.bias) for layer in mlp.net if isinstance(layer, nn.Linear)]


def ensemble_affines(net: EnsembleMLP, member: int) -> list[Affine]:
    """The layers of one member of an :class:`EnsembleMLP` (weights ``(E, in, out)``)."""
    return [(weight[member], bias[member, 0]) for weight, bias in net.affines()]


def ensemble_values(
    critic: CriticEnsemble,
    observations: torch.Tensor,
    actions: torch.Tensor,
    *,
    frozen: bool = False,
    batched: bool | None = None,
) -> torch.Tensor:
    """``Q_e(s, a)`` of every critic: ``(N, obs), (N, act) -> (E, N)``, from ``critic``'s weights.

    ``frozen`` records no gradient for the weights (the inputs keep theirs): an actor's loss
    reaches the actor through the actions without touching the critics.

    ``batched`` (the default off the CPU) runs the module's own forward, :func:`ensemble_mlp`:
    the ``E`` critics as one batched multiply per layer. On the CPU the default applies the
    same weights member by member (:func:`affine_mlp`) to blocks of at most
    :data:`CPU_BLOCK_ROWS` rows, which is faster on CQL's thousands of rows a step, as a
    block's activations stay in cache.
    """
    if batched is None:
        batched = observations.device.type != "cpu"
    inputs = torch.cat([observations, actions], dim=-1)  # (N, obs + act)
    if batched:
        layers = critic.net.affines()
        if frozen:
            layers = [(weight.detach(), bias.detach()) for weight, bias in layers]
        expanded = inputs.unsqueeze(0).expand(critic.members, -1, -1)  # (N, in) -> (E, N, in)
        return ensemble_mlp(layers, expanded).squeeze(-1)  # (E, N, 1) -> (E, N)
    members = []
    for member in range(critic.members):
        affines = ensemble_affines(critic.net, member)
        if frozen:
            affines = [(weight.detach(), bias.detach()) for weight, bias in affines]
        blocks = [affine_mlp(affines, block) for block in inputs.split(CPU_BLOCK_ROWS)]
        members.append(torch.cat(blocks) if len(blocks) > 1 else blocks[0])
    return torch.stack(members).squeeze(-1)  # (E, N, 1) -> (E, N)
