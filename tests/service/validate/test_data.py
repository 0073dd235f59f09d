"""Sliding windows, task files and specs: the bookkeeping every accuracy number rests on."""

from __future__ import annotations

import pytest

from squeezeserve.service.validate.data import read_task, sliding_windows
from squeezeserve.service.validate.specs import UsageError, parse_spec


@pytest.mark.parametrize(
    ("n", "window", "stride"), [(10, 4, 2), (1000, 128, 64), (7, 16, 8), (100, 10, 9), (33, 8, 3)]
)
def test_every_token_after_the_first_is_scored_exactly_once(n, window, stride):
    ids = list(range(n))

    windows = sliding_windows(ids, window, stride)

    scored = [t for w in windows for t in w.ids[len(w.ids) - w.scored :]]
    assert scored == ids[1:]
    assert all(len(w.ids) <= window and w.ids == ids[w.begin : w.begin + len(w.ids)] for w in windows)
    assert all(0 < w.scored < len(w.ids) for w in windows)  # each scored token has context


def test_windows_carry_context_of_window_minus_stride():
    windows = sliding_windows(list(range(20)), 8, 4)

    assert [(w.begin, len(w.ids), w.scored) for w in windows] == [(0, 8, 7), (4, 8, 4), (8, 8, 4), (12, 8, 4)]


@pytest.mark.parametrize(("window", "stride"), [(1, 1), (8, 0), (8, 8), (8, 9)])
def test_bad_window_settings_are_usage_errors(window, stride):
    with pytest.raises(UsageError):
        sliding_windows(list(range(50)), window, stride)


def test_task_file_rejects_an_answer_outside_the_choices(tmp_path):
    bad = tmp_path / "task.jsonl"
    bad.write_text('{"context": "a", "choices": [" b", " c"], "answer": 2}\n')

    with pytest.raises(UsageError, match=":1:"):
        read_task(str(bad))


def test_endpoint_spec_gets_v1_and_model():
    spec = parse_spec("http://127.0.0.1:8000#smol", "--baseline")

    assert (spec.base_url, spec.model, spec.is_local) == ("http://127.0.0.1:8000/v1", "smol", False)


@pytest.mark.parametrize("raw", ["http://127.0.0.1:8000/v1", "/no/such/checkpoint"])
def test_bad_specs_are_usage_errors(raw):
    with pytest.raises(UsageError):
        parse_spec(raw, "--candidate")
