"""Pass/fail gates over the flat metrics: ``NAME OP NUMBER`` with OP one of <=, >=, <, >, ==."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from squeezeserve.service.validate.specs import UsageError

_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq}
_GATE = re.compile(r"^\s*([A-Za-z0-9_@]+)\s*(<=|>=|==|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


@dataclass(frozen=True)
class Gate:
    metric: str
    op: str
    threshold: float

    @property
    def expression(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"


def parse_gate(text: str) -> Gate:
    match = _GATE.match(text)
    if not match:
        raise UsageError(f"gate {text!r} is not NAME OP NUMBER (OP one of <=, >=, <, >, ==)")
    return Gate(match[1], match[2], float(match[3]))


def read_gates_file(path: str) -> list[Gate]:
    """YAML: a list of expressions, ``{gates: [...]}``, or a mapping ``metric: "<=1.03"``."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"--gates {path}: cannot read it ({exc})") from exc
    if isinstance(data, dict) and "gates" in data:
        data = data["gates"]
    if isinstance(data, dict):
        return [parse_gate(f"{name}{condition}") for name, condition in data.items()]
    if isinstance(data, list) and all(isinstance(item, str) for item in data):
        return [parse_gate(item) for item in data]
    raise UsageError(f"--gates {path}: expected a list of 'NAME OP NUMBER' strings or a mapping")


def check_names(gates: list[Gate], planned: list[str]) -> None:
    known = set(planned)
    for gate in gates:
        if gate.metric not in known:
            close = [n for n in planned if gate.metric.split("@")[0] in n][:5]
            hint = f" (similar: {', '.join(close)})" if close else ""
            raise UsageError(
                f"gate {gate.expression!r}: this run does not measure {gate.metric!r}{hint}; "
                "see `squeezeserve validate --help` for the metric names"
            )


def evaluate(gates: list[Gate], metrics: dict[str, float | None]) -> list[dict]:
    """One result per gate: value, pass/fail, and the margin (value - threshold; negative = below)."""
    results = []
    for gate in gates:
        value = metrics.get(gate.metric)
        passed = value is not None and _OPS[gate.op](value, gate.threshold)
        results.append(
            {
                "gate": gate.expression,
                "metric": gate.metric,
                "op": gate.op,
                "threshold": gate.threshold,
                "value": value,
                "passed": passed,
                "margin": None if value is None else value - gate.threshold,
                "note": "not measured (no successful samples)" if value is None else None,
            }
        )
    return results
