"""Settings: environment, YAML file, CLI flags, and one-sentence errors for bad values."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import pytest

from squeezeserve.service.gateway import command
from squeezeserve.service.gateway.config import GatewaySettings, SettingsError, build_settings, get_settings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults():
    settings = GatewaySettings(upstreams=["http://w:8001/"])

    assert settings.upstreams == ["http://w:8001"]  # trailing slash dropped: paths are appended
    assert (settings.host, settings.port, settings.routing) == ("127.0.0.1", 8000, "least_outstanding")
    assert settings.api_keys == []


@pytest.mark.parametrize("value", ["http://a:1,http://b:2", '["http://a:1", "http://b:2"]'])
def test_env_lists_accept_commas_or_json(monkeypatch, value):
    monkeypatch.setenv("SQUEEZESERVE_GATEWAY_UPSTREAMS", value)
    monkeypatch.setenv("SQUEEZESERVE_GATEWAY_API_KEYS", "k1,k2")
    monkeypatch.setenv("SQUEEZESERVE_GATEWAY_ROUTING", "round_robin")

    settings = GatewaySettings()

    assert settings.upstreams == ["http://a:1", "http://b:2"]
    assert [entry.key for entry in settings.api_keys] == ["k1", "k2"]
    assert settings.routing == "round_robin"


def test_get_settings_reads_the_environment_once(monkeypatch):
    monkeypatch.setenv("SQUEEZESERVE_GATEWAY_UPSTREAMS", "http://a:1")
    get_settings.cache_clear()
    try:
        assert get_settings() is get_settings()
        assert get_settings().upstreams == ["http://a:1"]
    finally:
        get_settings.cache_clear()


def test_yaml_file_sits_under_cli_flags_and_over_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SQUEEZESERVE_GATEWAY_PORT", "7000")
    monkeypatch.setenv("SQUEEZESERVE_GATEWAY_HEALTH_INTERVAL", "9")
    config = tmp_path / "gateway.yaml"
    config.write_text("upstreams: [http://a:1]\nport: 8100\nrequest-timeout: 30\nrouting: round_robin\n")

    settings = build_settings(config, port=8200, routing=None)

    assert settings.port == 8200  # flag over file
    assert settings.request_timeout == 30  # file over default
    assert settings.routing == "round_robin"  # an unset flag (None) leaves the file's value
    assert settings.health_interval == 9  # env where neither file nor flag says


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"upstreams": []}, "upstreams: List should have at least 1 item"),
        ({"upstreams": ["w:8001"]}, "upstreams: upstream 'w:8001' is not an http(s) URL"),
        ({"upstreams": ["http://a:1", "http://a:1/"]}, "upstreams: each upstream may be listed only once"),
        ({"upstreams": ["http://a:1"], "routing": "random"}, "routing: Input should be 'least_outstanding'"),
        (
            {"upstreams": ["http://a:1"], "request_timeout": 0},
            "request_timeout: Input should be greater than 0",
        ),
        (
            {"upstreams": ["http://a:1"], "api_keys": ["k", ""]},
            "api_keys: API keys must not be empty strings",
        ),
        (
            {"upstreams": ["http://a:1"], "api_keys": ["k", "k"]},
            "api_keys: each API key may be listed only once",
        ),
        (
            {"upstreams": ["http://a:1"], "api_keys": [{"key": "k", "requests_per_minute": 0}]},
            "api_keys.0.requests_per_minute: Input should be greater than 0",
        ),
        (
            {"upstreams": ["http://a:1"], "api_keys": [{"key": "k", "tokens_per_min": 5}]},
            "api_keys.0.tokens_per_min: Extra inputs are not permitted",
        ),
        (
            {"upstreams": ["http://a:1"], "requests_per_minute": 60},
            "settings: requests_per_minute and tokens_per_minute are limits per API key: set api_keys",
        ),
        ({"upstreams": ["http://a:1"], "retries": 3}, "retries: Extra inputs are not permitted"),
    ],
)
def test_bad_settings_fail_with_a_sentence_naming_the_field(values, message):
    with pytest.raises(SettingsError) as caught:
        build_settings(**values)

    assert str(caught.value).startswith(message)


def test_keys_take_limits_of_their_own_in_the_config_file(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "upstreams: [http://a:1]\n"
        "tokens-per-minute: 1000\n"
        "api-keys:\n"
        "  - plain\n"
        "  - {key: batch, requests_per_minute: 10, tokens_per_minute: 50000}\n"
    )

    settings = build_settings(config)

    plain, batch = settings.api_keys
    assert (plain.key, plain.requests_per_minute, plain.tokens_per_minute) == ("plain", None, None)
    assert (batch.key, batch.requests_per_minute, batch.tokens_per_minute) == ("batch", 10, 50000)
    assert settings.tokens_per_minute == 1000  # the default for keys without their own (plain)
    assert "batch" not in repr(settings) and "plain" not in repr(settings)


def test_keys_with_limits_come_through_the_environment_as_json(monkeypatch):
    monkeypatch.setenv("SQUEEZESERVE_GATEWAY_API_KEYS", '["k1", {"key": "k2", "requests_per_minute": 3}]')

    settings = GatewaySettings(upstreams=["http://a:1"])

    assert [(e.key, e.requests_per_minute) for e in settings.api_keys] == [("k1", None), ("k2", 3)]


def test_keys_file_adds_its_keys_and_an_empty_one_none(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("k2, k3\nk1\n\n")

    settings = build_settings(upstreams=["http://a:1"], api_keys=["k1"], api_keys_file=keys)
    empty = build_settings(upstreams=["http://a:1"], api_keys_file="/dev/null")

    assert [entry.key for entry in settings.api_keys] == ["k1", "k2", "k3"]
    assert empty.api_keys == []
    assert "k2" not in repr(settings)


def test_unreadable_keys_file_is_a_clear_error(tmp_path):
    with pytest.raises(
        SettingsError, match=r"api_keys_file: cannot read API keys file .*missing: No such file"
    ):
        build_settings(upstreams=["http://a:1"], api_keys_file=tmp_path / "missing")


def test_bad_config_file_is_a_clear_error(tmp_path):
    missing, not_a_mapping = tmp_path / "missing.yaml", tmp_path / "list.yaml"
    not_a_mapping.write_text("- a\n- b\n")

    with pytest.raises(SettingsError, match="cannot read config file"):
        build_settings(missing)
    with pytest.raises(SettingsError, match="must hold a mapping"):
        build_settings(not_a_mapping)


def test_cli_flags_map_onto_the_settings():
    args = parse(
        "--upstream",
        "http://a:1",
        "--upstream",
        "http://b:2",
        "--port",
        "9000",
        "--routing",
        "round_robin",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--request-timeout",
        "12.5",
        "--max-inflight-per-upstream",
        "4",
    )

    settings = build_settings(args.config, **{name: getattr(args, name) for name in command.SETTINGS_FLAGS})

    assert settings.upstreams == ["http://a:1", "http://b:2"]
    assert (settings.port, settings.routing) == (9000, "round_robin")
    assert [entry.key for entry in settings.api_keys] == ["k1", "k2"]
    assert (settings.request_timeout, settings.max_inflight_per_upstream) == (12.5, 4)


def test_every_setting_has_a_flag():
    assert set(command.SETTINGS_FLAGS) == set(GatewaySettings.model_fields)


def test_cli_rejects_bad_settings_with_exit_code_2():
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from squeezeserve.service.cli import main; sys.exit(main(sys.argv[1:]))",
            "gateway",
            "--upstream",
            "not-a-url",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 2
    assert "upstreams: upstream 'not-a-url' is not an http(s) URL" in result.stderr


@pytest.mark.slow
def test_cli_serves_with_a_config_file_and_stops_on_sigterm(
    fake_upstream, cli_gateway, tmp_path, openai_client
):
    config = tmp_path / "gateway.yaml"
    config.write_text("routing: round_robin\napi-keys: [from-file]\n")
    url, process = cli_gateway("--upstream", fake_upstream().url, "--config", str(config))

    reply = openai_client(url, api_key="from-file").completions.create(model="fake-model", prompt="x")
    process.send_signal(signal.SIGTERM)

    assert reply.choices[0].text == "w0 w1 w2 "
    # uvicorn shuts down gracefully, then re-raises the captured SIGTERM (exit by that signal).
    assert process.wait(timeout=30) in (0, -signal.SIGTERM)
