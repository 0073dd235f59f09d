"""Gate expressions, gate files, and their verdicts over the flat metrics."""

from __future__ import annotations

import pytest

from squeezeserve.service.validate.gates import check_names, evaluate, parse_gate, read_gates_file
from squeezeserve.service.validate.metrics import Plan, planned_names
from squeezeserve.service.validate.specs import UsageError


def test_gate_expression_parses():
    gate = parse_gate(" tpot_p50_ratio@c4 <= 0.8 ")

    assert (gate.metric, gate.op, gate.threshold) == ("tpot_p50_ratio@c4", "<=", 0.8)


@pytest.mark.parametrize("text", ["ppl_ratio", "ppl_ratio=<1", "ppl_ratio<=x", "<=1.0"])
def test_malformed_gates_are_usage_errors(text):
    with pytest.raises(UsageError):
        parse_gate(text)


def test_verdicts_and_margins():
    gates = [parse_gate("ppl_ratio<=1.03"), parse_gate("top1_agreement>=0.95"), parse_gate("kl_mean<0.01")]

    results = evaluate(gates, {"ppl_ratio": 1.05, "top1_agreement": 0.97, "kl_mean": None})

    assert [r["passed"] for r in results] == [False, True, False]
    assert results[0]["margin"] == pytest.approx(0.02)
    assert results[2]["note"].startswith("not measured")


def test_gate_file_as_list_and_as_mapping(tmp_path):
    as_list = tmp_path / "list.yaml"
    as_list.write_text("gates:\n  - ppl_ratio<=1.03\n  - top1_agreement>=0.9\n")
    as_map = tmp_path / "map.yaml"
    as_map.write_text('ppl_ratio: "<=1.03"\ntop1_agreement: ">=0.9"\n')

    assert read_gates_file(str(as_list)) == read_gates_file(str(as_map))


def test_gates_on_what_a_run_does_not_measure_are_usage_errors():
    endpoint_run = Plan(True, False, False, True, (1, 4), False, (False, True))
    names = planned_names(endpoint_run)

    check_names([parse_gate("tpot_p50_ratio@c4<=1"), parse_gate("ppl_ratio<=1.1")], names)
    for missing in (
        "kl_mean<=0.01",
        "ttft_p50_ratio@c16<=1",
        "goodput_ratio>=1",
        "checkpoint_bytes_ratio<=1",
    ):
        with pytest.raises(UsageError):
            check_names([parse_gate(missing)], names)
