"""ReBRAC: its penalties by hand, LayerNorm critics, next dataset actions, CLI and workflow.

The generic learner checks (finite metrics, round trips, all-ones weights, seeds, the training
loop) run for ReBRAC in ``test_shared.py``; here are the checks specific to ReBRAC.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from offaug.algorithms.base import config_from_json, config_to_json
from offaug.algorithms.learners.rebrac import (
    PAPER_PENALTIES,
    ReBRAC,
    ReBRACConfig,
    penalised_next_values,
    rebrac_actor_loss,
    squared_distance,
)
from offaug.algorithms.nn.networks import CriticEnsemble, EnsembleLayerNorm, EnsembleMLP
from offaug.algorithms.training.checkpoints import load_trainer
from offaug.cli import app
from offaug.datasets import MixtureSampler, Transitions
from tests.algorithms.learner_stages import SMALL, sample_batches, spaces_of, train_and_diagnose


def _trainer(data: Transitions, seed: int = 0, **overrides: object) -> ReBRAC:
    torch.manual_seed(seed)
    config = dataclasses.replace(ReBRACConfig(), **{**SMALL, **overrides})
    return ReBRAC(spaces_of(data), config, device="cpu")


def test_defaults_are_the_paper_locomotion_settings() -> None:
    config = ReBRACConfig()
    assert config.batch_size == 1024 and config.hidden == (256, 256, 256)
    assert config.actor_learning_rate == config.critic_learning_rate == 1e-3
    assert config.critic_layer_norm and not config.actor_layer_norm
    assert (config.actor_bc_coef, config.critic_bc_coef) == (0.01, 0.01)
    assert (config.policy_noise, config.noise_clip, config.policy_freq) == (0.2, 0.5, 2)


def test_paper_penalties_set_both_coefficients_and_survive_a_json_round_trip() -> None:
    config = config_from_json(ReBRACConfig, {"penalties": "walker2d-medium-v2"})
    assert (config.actor_bc_coef, config.critic_bc_coef) == (0.05, 0.1)
    assert config_from_json(ReBRACConfig, config_to_json(config)) == config
    assert len(PAPER_PENALTIES) == 15  # 3 locomotion tasks x 5 levels
    with pytest.raises(ValueError, match="hopper-medium-v2"):
        ReBRACConfig(penalties="hopper-medium")  # the known names are listed
    with pytest.raises(ValueError, match="not both"):
        ReBRACConfig(penalties="hopper-expert-v2", actor_bc_coef=0.3)


def test_penalties_against_hand_computations() -> None:
    a = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    b = torch.tensor([[0.0, 0.0], [0.5, -0.5]])
    torch.testing.assert_close(squared_distance(a, b), torch.tensor([1.0, 0.5]))
    q_next = torch.tensor([[3.0, 1.0], [2.0, 4.0]])  # (E, B)
    # min over critics (2, 1) minus 0.1 * (1.0, 0.5).
    torch.testing.assert_close(
        penalised_next_values(q_next, a, b, 0.1), torch.tensor([2.0 - 0.1, 1.0 - 0.05])
    )
    q_policy = torch.tensor([[2.0, -4.0], [3.0, -6.0]])  # min: (2, -6), mean |.| 4
    loss, distance = rebrac_actor_loss(q_policy, a, b, 0.5, True, None)
    assert distance.item() == pytest.approx(0.75)
    assert loss.item() == pytest.approx(((0.5 * 1.0 - 2.0 / 4) + (0.5 * 0.5 + 6.0 / 4)) / 2)
    raw, _ = rebrac_actor_loss(q_policy, a, b, 0.5, False, None)
    assert raw.item() == pytest.approx(((0.5 - 2.0) + (0.25 + 6.0)) / 2)


def test_critics_carry_layer_norm_and_the_edac_initialisation(hopper: Transitions) -> None:
    trainer = _trainer(hopper)
    norms = [m for m in trainer.critic.modules() if isinstance(m, EnsembleLayerNorm)]
    assert len(norms) == 2  # one per hidden layer
    assert not any(isinstance(m, nn.LayerNorm) for m in trainer.actor.modules())
    first = trainer.critic.net.layers[0]
    assert torch.all(first.bias == 0.1)
    assert trainer.critic.net.layers[-1].weight.abs().max() <= 3e-3
    assert trainer.actor.net.net[-1].weight.abs().max() <= 1e-3
    with_norm = _trainer(hopper, actor_layer_norm=True)
    assert sum(isinstance(m, nn.LayerNorm) for m in with_norm.actor.modules()) == 2


def test_ensemble_layer_norm_normalises_each_member_with_its_own_affine() -> None:
    torch.manual_seed(0)
    mlp = EnsembleMLP(2, 3, (8, 8), 1, layer_norm=True)
    assert mlp.norms is not None
    with torch.no_grad():
        for norm in mlp.norms:
            norm.weight.uniform_(0.5, 2.0)
            norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(5, 3)

    def reference() -> torch.Tensor:
        # Member by member, LayerNorm with its own affine after every hidden ReLU.
        assert mlp.norms is not None
        hidden = x.expand(2, -1, -1)
        for i, layer in enumerate(mlp.layers):
            hidden = torch.baddbmm(layer.bias, hidden, layer.weight)
            if i < len(mlp.norms):
                hidden = torch.stack(
                    [
                        torch.nn.functional.layer_norm(
                            h.relu(), (8,), mlp.norms[i].weight[m, 0], mlp.norms[i].bias[m, 0]
                        )
                        for m, h in enumerate(hidden)
                    ]
                )
        return hidden

    out = reference()
    torch.testing.assert_close(mlp(x), out)
    # The folded affine's gradients are the per-member LayerNorm's.
    upstream = torch.randn_like(out)
    expected = torch.autograd.grad((out * upstream).sum(), list(mlp.parameters()))
    actual = torch.autograd.grad((mlp(x) * upstream).sum(), list(mlp.parameters()))
    for want, got in zip(expected, actual, strict=True):
        torch.testing.assert_close(got, want)
    # One member alone (TD3+BC's actor scores with Q_1) is that member of the batched pass.
    torch.testing.assert_close(mlp.member(1, x), out[1])
    # The module on its own applies the same per-member LayerNorm.
    norm, rows = mlp.norms[0], torch.randn(2, 5, 8)
    torch.testing.assert_close(norm(rows), torch.stack([norm.member(m, rows[m]) for m in range(2)]))
    critic = CriticEnsemble(3, 2, (8,), 2, layer_norm=True)
    obs, act = torch.randn(5, 3), torch.randn(5, 2)
    torch.testing.assert_close(critic.member(0, obs, act), critic(obs, act)[0])
    # Without the option the state_dict keys are the plain critic's.
    plain = CriticEnsemble(3, 1, (8,), 2)
    assert all(not k.startswith("net.norms") for k in plain.state_dict())


def test_sampler_next_actions_are_the_following_row_in_the_same_episode(
    hopper: Transitions,
) -> None:
    sampler = MixtureSampler([hopper], 512, seed=0, next_actions=True)
    batch = sampler.sample()
    assert batch.next_actions is not None
    observations = np.asarray(hopper.observations)
    for row in range(len(batch)):
        (index,) = np.flatnonzero(
            np.all(observations == batch.observations[row], axis=1)
            & np.all(np.asarray(hopper.actions) == batch.actions[row], axis=1)
        )[:1]
        last = (
            index + 1 == len(hopper) or hopper.episode_ids[index + 1] != hopper.episode_ids[index]
        )
        expected = hopper.actions[index] if last else hopper.actions[index + 1]
        np.testing.assert_array_equal(batch.next_actions[row], expected)
    assert MixtureSampler([hopper], 8).sample().next_actions is None


def test_update_needs_next_actions(hopper: Transitions) -> None:
    trainer = _trainer(hopper)
    batch = dataclasses.replace(sample_batches(hopper, 1, next_actions=True)[0], next_actions=None)
    with pytest.raises(ValueError, match="next_actions=True"):
        trainer.update(batch)


def test_critic_penalty_moves_the_target_towards_the_dataset_next_action(
    hopper: Transitions,
) -> None:
    batch = sample_batches(hopper, 1, next_actions=True)[0]
    losses = []
    for coef in (0.0, 10.0):
        trainer = _trainer(hopper, seed=2, critic_bc_coef=coef)
        torch.manual_seed(5)
        losses.append(trainer.update(batch)["critic_loss"])
    # A large penalty lowers every target by beta_2 * ||a' - a'_data||^2 > 0: a different loss.
    assert not torch.equal(losses[0], losses[1])


def test_cli_trains_rebrac(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    config = tmp_path / "rebrac.yaml"
    config.write_text("hidden: [32, 32]\nbatch_size: 64\nactor_bc_coef: 0.05\n")
    out = tmp_path / "run"
    args = ["train", "rebrac", dataset, "--steps", "10", "--log-every", "5", "--eval-every", "0"]
    result = CliRunner().invoke(app, [*args, "--config", str(config), "--out", str(out)])
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["config"]["actor_bc_coef"] == 0.05
    assert recorded["config"]["critic_layer_norm"] is True
    assert isinstance(load_trainer(out / "checkpoint.pt"), ReBRAC)


def test_workflow_stages_train_and_diagnose_rebrac(make_test_dataset, tmp_path: Path) -> None:
    dataset = make_test_dataset("hopper", "hdf5").dataset_id
    part = train_and_diagnose("rebrac", {"hidden": [32, 32], "batch_size": 32}, dataset, tmp_path)
    assert part["name"] == "rebrac-original"
    assert part["value"] is not None and part["ope"] is not None
