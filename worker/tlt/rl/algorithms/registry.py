"""The algorithm registry: a job spec names its RL algorithm (`algorithm.name`, or the older `algorithm.loss_type`);
the worker resolves the name here. Only code installed on the worker runs: the built-ins below, plus algorithms other
installed packages declare under the `tlt.algorithms` entry-point group (pyproject's
`[project.entry-points."tlt.algorithms"]`, each pointing at an `Algorithm`, rl/algorithms/base.py). No user code.

This module imports no torch and loads nothing to list the names, so the control plane checks a spec's name at submit
(backend/admission.py) from the same registry the worker runs.

    registered_names()          # ["dapo", "dr_grpo", "grpo", "gspo", "reinforce_plus_plus", "rloo", ...installed]
    algo = resolve("gspo")      # the Algorithm (imports its module)
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.tlt.rl.algorithms.base import Algorithm

ENTRY_POINT_GROUP = "tlt.algorithms"
_BUILTIN = "worker.tlt.rl.algorithms.builtin"
# name -> "module:attribute"; the names are TRL's loss_type / verl's adv_estimator and loss mode names
BUILTIN_ALGORITHMS: dict[str, str] = {
    "grpo": f"{_BUILTIN}:GRPO",  # group-normalised advantages, each response's token mean, then the mean
    "dapo": f"{_BUILTIN}:DAPO",  # group-normalised advantages, token losses averaged over the batch's tokens
    "dr_grpo": f"{_BUILTIN}:DR_GRPO",  # token losses summed over (responses x max_completion_length)
    "gspo": f"{_BUILTIN}:GSPO",  # sequence-level importance ratio and clipping
    "rloo": f"{_BUILTIN}:RLOO",  # leave-one-out baseline within the group
    "reinforce_plus_plus": f"{_BUILTIN}:REINFORCE_PLUS_PLUS",  # advantages whitened over the whole batch
}


def _installed() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def registered_names() -> list[str]:
    """Every algorithm name the worker can run, sorted (built-ins and installed entry points; nothing is loaded)."""
    return sorted({*BUILTIN_ALGORITHMS, *_installed()})


def resolve(name: str) -> Algorithm:
    """The Algorithm registered as `name` (KeyError listing the registered names when none is). An entry point that
    reuses a built-in name must point at the same object."""
    from worker.tlt.rl.algorithms import base  # torch: only where an algorithm is run

    installed = _installed()
    if name in BUILTIN_ALGORITHMS:
        module, attr = BUILTIN_ALGORITHMS[name].split(":")
        algo = getattr(import_module(module), attr)
        if name in installed and installed[name].load() is not algo:
            raise ValueError(f"algorithm entry point {name!r} ({installed[name].value}) shadows a built-in")
    elif name in installed:
        algo = installed[name].load()
    else:
        raise KeyError(f"unknown algorithm {name!r}; registered: {', '.join(registered_names())}")
    if not isinstance(algo, base.Algorithm):
        raise TypeError(f"algorithm {name!r} is a {type(algo).__name__}, not an Algorithm (rl/algorithms/base.py)")
    return algo
