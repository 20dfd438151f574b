"""The Dockerfiles parse, pin their bases, run as non-root, and name entrypoints that start.

There is no container engine here: the files are parsed with BuildKit's own parser (the
``dockerfile`` package), and each entrypoint is started with ``--help`` as a console script of
this distribution. The operator's is started with only the operator extra's dependency closure
importable, as in its image (everything else installed here is hidden from the import system).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata

import dockerfile
import pytest
from chart_helpers import REPO, one, render
from packaging.requirements import Requirement

IMAGES = {"operator": REPO / "images" / "operator.Dockerfile", "worker": REPO / "images" / "worker.Dockerfile"}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
PINNED = re.compile(r"^[\w./-]+(:[\w.-]*\d+\.\d+[\w.-]*)?(@sha256:[0-9a-f]{64})?$")


def commands(name: str) -> list:
    return list(dockerfile.parse_file(str(IMAGES[name])))


def stages(name: str) -> list[list]:
    out: list[list] = []
    for c in commands(name):
        if c.cmd == "FROM":
            out.append([])
        out[-1].append(c)
    return out


def final(name: str, cmd: str):
    found = [c for c in stages(name)[-1] if c.cmd == cmd]
    assert found, f"{name}: the final stage has no {cmd}"
    return found[-1]


def _closure(extra: str) -> set[str]:
    """Normalised names of the distributions ``graphserving[extra]`` installs (per installed metadata)."""
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    seen: set[str] = set()
    todo = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"][extra]]
    while todo:
        req = todo.pop()
        if norm(req.name) in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(norm(req.name))
        try:
            requires = metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            sub = Requirement(text)
            if not sub.marker or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(sub)
    return seen


def hidden_modules(extra: str) -> set[str]:
    """Top-level modules installed here that ``graphserving[extra]`` would not install."""
    keep = _closure(extra) | {"graphserving"}
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    hidden = set()
    for module, dists in metadata.packages_distributions().items():
        if not any(norm(d) in keep for d in dists) and module.isidentifier():
            hidden.add(module)
    return hidden - set(sys.stdlib_module_names)


_RUN_HIDDEN = """
import importlib.abc, sys
from importlib import metadata
HIDDEN = set(sys.argv[1].split(","))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (not in this image)", name=name)
sys.meta_path.insert(0, Hide())
script = sys.argv[2]
(entry,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == script]
sys.argv = [script, *sys.argv[3:]]
sys.exit(entry.load()())
"""


def start(script: str, *args: str, extra: str | None = None) -> subprocess.CompletedProcess:
    """Run console script ``script`` (from this distribution's entry points) with ``args``."""
    hidden = ",".join(sorted(hidden_modules(extra))) if extra else ""
    return subprocess.run([sys.executable, "-c", _RUN_HIDDEN, hidden, script, *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO / "tests")


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_dockerfile_parses_with_buildkits_parser(name):
    assert [c.cmd for c in commands(name)][0] == "FROM"
    assert len(stages(name)) == 2


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_every_base_image_is_pinned_to_an_exact_version_or_digest(name):
    for c in commands(name):
        if c.cmd == "FROM" and c.value[0] not in {"build"}:
            assert PINNED.match(c.value[0]) and ":" in c.value[0] or "@sha256:" in c.value[0], c.original
            assert not c.value[0].endswith(":latest"), c.original


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_image_runs_as_a_numeric_non_root_user(name):
    user, _, group = final(name, "USER").value[0].partition(":")
    assert user.isdigit() and int(user) != 0 and (not group or int(group) != 0)


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_every_copied_path_exists_in_the_repository(name):
    ignore = (IMAGES[name].parent / f"{IMAGES[name].name}.dockerignore").read_text()
    for c in commands(name):
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags):
            for source in c.value[:-1]:
                assert (REPO / source).exists(), f"{name}: COPY {source}: no such path in the repository"
                assert f"!{source.rstrip('/')}" in ignore.replace("/\n", "\n"), f"{name}: {source} is excluded by its .dockerignore"


def test_the_operator_image_installs_the_operator_extra_without_torch():
    text = IMAGES["operator"].read_text()
    assert 'pip install ".[operator]"' in text
    assert "torch" not in _closure("operator")
    assert re.search(r'! \S+python -c "import torch"', text), "the build must prove torch is absent"
    assert not any("runtime]" in c.original for c in commands("operator") if c.cmd == "RUN")


def test_the_worker_image_installs_the_runtime_extra_on_a_cuda_base():
    assert commands("worker")[0].value[0].startswith("nvidia/cuda:")
    assert final("worker", "FROM").value[0].startswith("nvidia/cuda:")
    assert 'pip install ".[runtime]"' in IMAGES["worker"].read_text()
    assert "torch" in _closure("runtime")


@pytest.mark.parametrize("name, script", [("operator", "graphserving-operator"), ("worker", "graphserving-worker")])
def test_the_entrypoint_is_a_console_script_of_the_distribution(name, script):
    entrypoint = final(name, "ENTRYPOINT")
    assert entrypoint.json and list(entrypoint.value) == [script]
    assert script in SCRIPTS


def test_the_chart_runs_the_operator_images_entrypoint():
    container = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == list(final("operator", "ENTRYPOINT").value)
    assert container["args"][0] == final("operator", "CMD").value[0]
    assert "graphserving" in SCRIPTS  # the helm test Pod's command, from the same image


@pytest.mark.parametrize("args", [("--help",), ("run", "--help")])
def test_the_operator_entrypoint_starts_with_only_the_operator_extra(args):
    hidden = hidden_modules("operator")
    assert {"torch", "transformers", "cryptography", "matplotlib"} <= hidden
    proc = start("graphserving-operator", *args, extra="operator")
    assert proc.returncode == 0, proc.stderr
    assert "usage: graphserving-operator" in proc.stdout


def test_the_helm_test_command_starts_in_the_operator_image():
    proc = start("graphserving", "canary-prompt", "--help", extra="operator")
    assert proc.returncode == 0, proc.stderr
    assert "--resolve {dns,endpointslices}" in proc.stdout


def test_a_hidden_module_really_is_unimportable_in_the_image_simulation():
    proc = start("graphserving", "dev", "cluster", "up", extra="operator")
    assert proc.returncode == 2
    assert "needs the Python package 'cryptography'" in proc.stderr


def test_the_worker_entrypoint_starts_with_help():
    proc = start("graphserving-worker", "--help", extra="runtime")
    assert proc.returncode == 0, proc.stderr
    assert "--model" in proc.stdout and "--revision" in proc.stdout
