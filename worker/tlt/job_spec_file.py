"""A `JobSpec` from a YAML file, a named preset (config.PRESETS), or the file's keys on top of the preset
(`load_spec`); `merge_spec` lays one spec dict over another section by section (the benches' overrides use it too).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from worker.tlt.config import PRESETS, JobSpec


def merge_spec(base: dict, over: dict) -> dict:
    """`over` on top of `base`, section by section (a spec file's `algorithm:` keeps the preset's other keys)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_spec(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_spec(path: str | None, preset_name: str | None) -> JobSpec:
    """A spec from a YAML file, a named preset, or the file's keys on top of the preset."""
    if preset_name and preset_name not in PRESETS:
        raise KeyError(f"unknown preset {preset_name!r}; known: {', '.join(PRESETS)}")
    data: dict = dict(PRESETS[preset_name]) if preset_name else {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a job spec is a mapping of JobSpec fields")
        data = merge_spec(data, loaded)
    return JobSpec.model_validate(data)
