"""The evaluation chart's pick: the cheapest variant within a chosen accuracy of the best."""

from __future__ import annotations

from dbt_llm_batch.ops.report import Evaluation

POINTS = [("big", 0.90, 0.010), ("mid", 0.89, 0.004), ("small", 0.80, 0.001), ("tie", 0.89, 0.004)]


def test_the_cheapest_within_the_margin_of_the_best_is_named():
    assert Evaluation("t", "a_accuracy", POINTS, within=0.0).cheapest_near_best[0] == "big"
    assert Evaluation("t", "a_accuracy", POINTS, within=0.02).cheapest_near_best[0] in {"mid", "tie"}
    assert Evaluation("t", "a_accuracy", POINTS, within=0.10).cheapest_near_best[0] == "small"
    assert Evaluation("t", "a_accuracy", POINTS, within=0.02).best[0] == "big"
