"""Environments and tools for multi-turn episodes: the public interface third-party environments are written
against (:class:`shifu.envs.base.Step`, an object with ``reset(row)`` and ``step(action)``, loaded by
``package.module:Name`` from ``ppo.env.factory``), the checks that turn a misbehaving environment into a clear
error naming it, the row and the turn, :class:`shifu.envs.tool.ToolEnv`, typed Python functions offered
to the policy as tools, and :mod:`shifu.envs.openenv`, OpenEnv environments (servers run as local processes) as
environments. No torch here: the episode source itself is :mod:`shifu.rollout.episodes`."""
