"""Schemathesis against the gateway's own OpenAPI schema, in front of the fake upstream (fast) and the real
embedded worker (slow): no 5xx, and every answer within the documented statuses and shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.feedback import FeedbackSources
from schemathesis.pytest._test_builder import build_operation_test
from schemathesis.python._constants.orchestrator import make_constants_value_source
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from squeezeserve.service.gateway.app import create_app
from squeezeserve.service.gateway.config import GatewaySettings

# The schema is the app's, taken without serving it; the servers the cases go to are started per test.
SCHEMA = schemathesis.openapi.from_dict(
    create_app(GatewaySettings(upstreams=["http://127.0.0.1:9"], port=0)).openapi()
)
# Routes whose answer is not JSON-shaped or that the fuzzing says nothing about.
FUZZED = SCHEMA.include(path_regex="^/v1/")
# What the issue asks: no server error, no answer outside the documented statuses, types, headers and
# bodies. (Schemathesis's positive_data_acceptance is left out: the schema cannot say every rule the
# validator applies, such as "prompt must not be an empty list", and those answers are documented 400s.)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
FUZZ_SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,  # the same cases every run: a failure is reproducible, CI time is stable
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture
def fake_gateway(fake_upstream: Callable[..., Any], start_gateway: Callable[..., str]) -> str:
    """A gateway in front of one fake upstream serving ``fake-model``, for one operation's cases."""
    return start_gateway([fake_upstream().url])


# Every operation the fuzzing covers, a test each. Parametrized here rather than by FUZZED.parametrize():
# under pytest-xdist (the README's test command) Schemathesis's own parametrize ran one of them. Each test is
# the Hypothesis test that parametrize builds for its operation (Schemathesis's builder, as its pytest
# plugin calls it: the examples, coverage and fuzzing phases, positive and negative data), so the cases are
# the same. (Schemathesis is pinned in pyproject.toml: the builder is its own module's, not public API.)
OPERATIONS = [f"{op.method.upper()} {op.path}" for op in (r.ok() for r in FUZZED.get_all_operations())]
FEEDBACK = FeedbackSources(constants_value_source=make_constants_value_source(FUZZED))


def fuzz(label: str, base_url: str) -> None:
    """Schemathesis's cases of one operation (``METHOD /path``) against ``base_url``, CHECKS on each."""
    method, path = label.split(" ", 1)

    @FUZZ_SETTINGS
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=base_url, checks=CHECKS)

    operation = FUZZED[path][method]
    build_operation_test(config=FUZZED.config, operation=operation, test_func=check, given_kwargs={},
                         feedback=FEEDBACK)()  # fmt: skip


def test_every_v1_operation_is_fuzzed() -> None:
    assert sorted(OPERATIONS) == [
        "GET /v1/models",
        "GET /v1/models/{model_id}",
        "POST /v1/chat/completions",
        "POST /v1/completions",
    ]


@pytest.mark.parametrize("operation", OPERATIONS)
def test_gateway_in_front_of_the_fake_upstream(operation: str, fake_gateway: str) -> None:
    fuzz(operation, fake_gateway)


@pytest.mark.slow
@pytest.mark.parametrize("operation", OPERATIONS)
def test_gateway_in_front_of_the_real_worker(operation: str, worker_gateway: str) -> None:
    fuzz(operation, worker_gateway)
