"""The plainest eager PyTorch versions of IQL's and TD3+BC's update, for bench_algorithms.

Plain ``nn.Sequential`` networks, one module per critic, fused Adam, the losses written as the
papers (and CORL) write them; no observation or reward normalisation, no per-sample weights,
no metrics. What eager PyTorch itself reaches on this core for the same update, so offaug's
trainer can be held against it.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _common import interleave
from torch import nn
from torch.nn import functional as F

from offaug.algorithms.batch import TorchBatch

MINIMAL_LOOP_GOAL = 0.95
"""offaug's steps/s over the plainest eager loop's (IQL and TD3+BC, 256x256)."""


def _mlp(inputs: int, hidden: int, outputs: int, *, tanh: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Linear(inputs, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, outputs),
    ]
    if tanh:
        layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _adam(module: nn.Module | list[nn.Parameter], lr: float) -> torch.optim.Adam:
    params = list(module.parameters()) if isinstance(module, nn.Module) else module
    return torch.optim.Adam(params, lr=lr, fused=True)


def _lerp(target: nn.Module, source: nn.Module, tau: float) -> None:
    with torch.no_grad():
        torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


def td3bc_step(spaces: Any, hidden: int, device: str = "cpu") -> Callable[[Any], None]:
    """One TD3+BC update per call (Fujimoto and Gu's reference loop, in plain PyTorch)."""
    obs_dim, act_dim = spaces.observation_dim, spaces.action_dim
    actor = _mlp(obs_dim, hidden, act_dim, tanh=True).to(device)
    q1 = _mlp(obs_dim + act_dim, hidden, 1).to(device)
    q2 = _mlp(obs_dim + act_dim, hidden, 1).to(device)
    actor_target, q1_target, q2_target = (copy.deepcopy(m) for m in (actor, q1, q2))
    actor_optimizer = _adam(actor, 3e-4)
    critic_optimizer = _adam([*q1.parameters(), *q2.parameters()], 3e-4)
    step = [0]

    def update(batch: Any) -> None:
        obs, actions, next_obs = batch.observations, batch.actions, batch.next_observations
        with torch.no_grad():
            noise = (torch.randn_like(actions) * 0.2).clamp(-0.5, 0.5)
            next_actions = (actor_target(next_obs) + noise).clamp(-1.0, 1.0)
            next_in = torch.cat([next_obs, next_actions], -1)
            next_q = torch.min(q1_target(next_in), q2_target(next_in)).squeeze(-1)
            target = batch.rewards + 0.99 * (1.0 - batch.terminals) * next_q
        data_in = torch.cat([obs, actions], -1)
        critic_loss = F.mse_loss(q1(data_in).squeeze(-1), target) + F.mse_loss(
            q2(data_in).squeeze(-1), target
        )
        critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        critic_optimizer.step()
        if step[0] % 2 == 0:
            policy_actions = actor(obs)
            q = q1(torch.cat([obs, policy_actions], -1))
            lam = 2.5 / q.abs().mean().detach()
            actor_loss = -lam * q.mean() + F.mse_loss(policy_actions, actions)
            actor_optimizer.zero_grad(set_to_none=True)
            actor_loss.backward()
            actor_optimizer.step()
            _lerp(q1_target, q1, 0.005)
            _lerp(q2_target, q2, 0.005)
            _lerp(actor_target, actor, 0.005)
        step[0] += 1

    return update


def iql_step(
    spaces: Any, hidden: int, decay_steps: int = 1_000_000, device: str = "cpu"
) -> Callable[[Any], None]:
    """One IQL update per call (the paper's losses as CORL's loop writes them)."""
    obs_dim, act_dim = spaces.observation_dim, spaces.action_dim
    actor = _mlp(obs_dim, hidden, act_dim, tanh=True).to(device)
    log_std = nn.Parameter(torch.zeros(act_dim, device=device))
    q1 = _mlp(obs_dim + act_dim, hidden, 1).to(device)
    q2 = _mlp(obs_dim + act_dim, hidden, 1).to(device)
    q1_target, q2_target = copy.deepcopy(q1), copy.deepcopy(q2)
    value = _mlp(obs_dim, hidden, 1).to(device)
    actor_optimizer = _adam([*actor.parameters(), log_std], 3e-4)
    critic_optimizer = _adam([*q1.parameters(), *q2.parameters()], 3e-4)
    value_optimizer = _adam(value, 3e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(actor_optimizer, decay_steps)

    def update(batch: Any) -> None:
        obs, actions = batch.observations, batch.actions
        data_in = torch.cat([obs, actions], -1)
        with torch.no_grad():
            target_q = torch.min(q1_target(data_in), q2_target(data_in)).squeeze(-1)
            next_v = value(batch.next_observations).squeeze(-1)
        v = value(obs).squeeze(-1)
        advantage = target_q - v
        value_loss = (torch.abs(0.7 - (advantage < 0).float()) * advantage.pow(2)).mean()
        value_optimizer.zero_grad(set_to_none=True)
        value_loss.backward()
        value_optimizer.step()
        target = batch.rewards + 0.99 * (1.0 - batch.terminals) * next_v
        critic_loss = (
            F.mse_loss(q1(data_in).squeeze(-1), target)
            + F.mse_loss(q2(data_in).squeeze(-1), target)
        ) / 2
        critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        critic_optimizer.step()
        _lerp(q1_target, q1, 0.005)
        _lerp(q2_target, q2, 0.005)
        weight = torch.exp(3.0 * advantage.detach()).clamp(max=100.0)
        std = log_std.clamp(-5.0, 2.0).exp()
        mean = actor(obs)
        log_prob = (
            -0.5 * ((actions - mean) / std).pow(2) - std.log() - 0.5 * math.log(2 * math.pi)
        ).sum(-1)
        actor_loss = (weight * -log_prob).mean()
        actor_optimizer.zero_grad(set_to_none=True)
        actor_loss.backward()
        actor_optimizer.step()
        schedule.step()

    return update


PLAIN_STEPS: dict[str, Callable[[Any, int], Callable[[Any], None]]] = {
    "td3bc": td3bc_step,
    "iql": iql_step,
}
"""Learner name -> builder of its plain update."""


def plain_loop(
    name: str,
    hidden: int,
    spaces: Any,
    sampler: Any,
    offaug_block: Callable[[], float],
    steps: int,
    repeats: int,
) -> dict[str, Any]:
    """The plain loop of ``name``'s update on the same batches, interleaved with offaug's."""
    torch.manual_seed(0)
    update = PLAIN_STEPS[name](spaces, hidden)

    def plain_block() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            update(TorchBatch.from_batch(sampler.sample()))
        return time.perf_counter() - start

    plain_block()
    plain, mine = interleave(plain_block, offaug_block, repeats)
    ratio = float(np.median(plain) / np.median(mine))
    return {
        "minimal_loop": f"_plain_loops.{name}_step: nn.Sequential nets, fused Adam, same batches",
        "minimal_loop_steps_per_s": steps / float(np.median(plain)),
        "offaug_vs_minimal_loop": ratio,
        "minimal_loop_goal": MINIMAL_LOOP_GOAL,
        "minimal_loop_goal_met": ratio >= MINIMAL_LOOP_GOAL,
    }
