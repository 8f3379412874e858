"""`rollout.sd_switch` in the job spec reaches the SD controller through job_spec_translate.controller: "step_costs" (the
default) builds a controller switched by measured step costs (CostSwitch), "active_batch" keeps TLT's threshold, and
an unknown value is a validation error. No model: the controller needs only the spec and the drafter kinds.
Run: python -m pytest tests/adaptive/test_spec_sd_switch.py -q"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from worker.tlt.config import JobSpec
from worker.tlt.job_spec_translate import controller
from worker.tlt.speculative.control.step_costs import CostSwitch
from worker.tlt.speculative.control.switch import SdSwitch


def _spec(**rollout: Any) -> JobSpec:
    return JobSpec.model_validate({
        "name": "sd-switch",
        "model": {"builtin": "tiny-llama"},
        "dataset": {"builtin": "toy-count"},
        "algorithm": {"reward_funcs": ["toy_count"]},
        "rollout": {"speculative": "adaptive", "sd_on_below": 4, "sd_patience": 1, **rollout},
    })


def test_default_switch_is_the_step_costs() -> None:
    spec = _spec()
    assert spec.rollout == _spec(sd_switch="step_costs").rollout
    ctl = controller(spec, drafters=["ngram"])
    assert isinstance(ctl.switch, CostSwitch) and ctl.costs is not None
    # no step measured yet: the cost switch keeps SD off where the threshold switch would turn it on
    assert ctl.switch.update(1) is False


def test_active_batch_switch_from_the_spec() -> None:
    ctl = controller(_spec(sd_switch="active_batch"), drafters=["ngram"])
    assert type(ctl.switch) is SdSwitch and ctl.costs is None
    assert ctl.switch.update(1) is True


def test_unknown_switch_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="sd_switch"):
        _spec(sd_switch="batch")
