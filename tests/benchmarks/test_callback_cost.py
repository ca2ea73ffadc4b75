"""benchmarks.callback_cost: the cost model's figures, and a model that contradicts itself reported as problems."""

from __future__ import annotations

import pytest

from benchmarks import callback_cost


def test_the_default_rates_give_the_headline_figures() -> None:
    result = callback_cost.run()

    assert result["problems"] == []
    assert 0 < result["callback_cost_usd_per_vm_month"] < result["callback_cost_usd_per_vm_month_always_on"]
    assert result["callback_cost_usd_per_vm_month_whole_hours"] >= result["callback_cost_usd_per_vm_month"]


def test_arguments_ops_cost_refuses_are_a_problem() -> None:
    result = callback_cost.run("--price", "0")

    assert any("ops.cost --price 0 exited 2" in problem for problem in result["problems"]), result


def test_a_model_without_a_positive_figure_or_contradicting_itself_is_a_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def model(argv: list[str]) -> int:
        print('{"on_demand": {"usd_per_vm_month": 12.0, "listener_hours_per_vm_month": 0}, '
              '"always_on": {"usd_per_vm_month": 9.78}}')  # fmt: skip
        return 0

    monkeypatch.setattr(callback_cost, "cost", model)

    problems = callback_cost.run()["problems"]
    assert any("no positive on_demand.listener_hours_per_vm_month" in problem for problem in problems), problems
    assert any("on-demand listener costs more than an always-on one" in problem for problem in problems), problems


def test_ops_cost_failing_is_a_problem_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(callback_cost, "cost", lambda argv: 2)

    assert callback_cost.main() == 1
    assert "ops.cost  exited 2" in capsys.readouterr().out
