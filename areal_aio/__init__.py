"""areal_aio: asynchronous RL for language models on one machine.

    from areal_aio import Orchestrator, load_settings
    summary = await Orchestrator(load_settings("settings.toml")).run()

Names are imported on first use, so a worker that needs only `areal_aio.wire`
does not import the controller.
"""

from typing import Any

__all__ = ["AnswerReward", "Model", "Orchestrator", "Reward", "Score", "Settings", "SettingsError", "Task", "load_settings"]
_HOME = {"Orchestrator": "control.controller", "Model": "agents.model", "AnswerReward": "rewards.scoring", "Reward": "rewards.scoring",
         "Score": "rewards.scoring", "Settings": "settings", "SettingsError": "settings",
         "load_settings": "settings", "Task": "tasks.task"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'areal_aio' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"areal_aio.{_HOME[name]}"), name)
