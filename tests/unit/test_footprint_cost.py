"""The device footprint benchmark's agent cost: the agent's own CPU a frame is its CPU less the
model's, and a difference the model's noise swamps (below zero) is recorded as not resolved."""

from __future__ import annotations

from ddnn.benchmarks.device_footprint import cost_medians


def _run(agent: float, model: float, share: float = 0.8) -> dict:
    return {"agent_cpu_ms": agent, "model_cpu_ms": model, "present_share": share,
            "wall_ms": agent * 1.5}


def test_the_agents_own_cost_is_its_cpu_less_the_models_on_the_frames_with_a_view():
    out = cost_medians([_run(1.0, 0.5), _run(1.2, 0.5), _run(0.9, 0.5)])
    assert out["own_cpu_ms"] == 0.6  # median of 0.6, 0.8 and 0.5
    assert out["agent_cpu_ms"] == 1.0 and out["model_cpu_ms"] == 0.5


def test_a_negative_difference_is_not_a_measurement():
    """pi under emulation: 126 ms of model a frame against the agent's 99.7 ms over frames of
    which 80 % had a view: the difference is noise, not a negative cost."""
    out = cost_medians([_run(99.7, 125.9), _run(98.0, 126.5), _run(101.0, 125.0)])
    assert out["own_cpu_ms"] is None
    assert out["agent_cpu_ms"] == 99.7
