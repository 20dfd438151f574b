"""The wheel holds every subpackage: built from this checkout and imported from the wheel alone.

pyproject.toml lists the packages and maps the top-level folders (runtime/, operator/) into the
``graphserving`` namespace; a stage folder missing from that list would import in the editable
install and be absent from the wheel (the worker and operator images install the wheel).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = {"graphserving.runtime": ROOT / "runtime", "graphserving.operator": ROOT / "operator",
                  "graphserving": ROOT / "src" / "graphserving"}

# Imports every module named on argv from the wheel's folder, with the editable install's finders
# (added by its .pth file) never installed: the interpreter runs without site, and sys.path holds
# the wheel's folder and the site-packages folders of this interpreter (the dependencies).
_IMPORT_ALL = """
import importlib, json, sys
wheel, names = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [wheel]
failed = {}
for name in names:
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
        continue
    origin = getattr(module, "__file__", None) or ""
    if not origin.startswith(wheel):
        failed[name] = f"imported from {origin}, not the wheel"
print(json.dumps(failed))
"""


def _modules_in_checkout() -> list[str]:
    names = []
    for package, folder in SOURCE_FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            if package == "graphserving" and rel.parts[0] in ("runtime", "operator"):
                continue
            if rel.name == "__main__":
                continue  # running it is its import
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            names.append(".".join((package, *parts)))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (a build folder left in the checkout by an
    earlier build could otherwise bring back modules that no longer exist)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("src", "runtime", "operator"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (built,) = out.glob("graphserving-*.whl")
    return built


def test_the_wheel_lists_every_module_of_the_checkout(wheel):
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
                    for n in z.namelist() if n.endswith(".py")}
    missing = sorted(set(_modules_in_checkout()) - in_wheel)
    assert missing == []
    assert "graphserving.runtime.model.kernels.decode_attention" in in_wheel


def test_every_module_imports_from_the_wheel(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path)
    site = [p for p in sys.path if p.endswith("site-packages")]
    names = _modules_in_checkout()
    result = subprocess.run(
        [sys.executable, "-S", "-c", _IMPORT_ALL, str(tmp_path), json.dumps(names)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={"PYTHONPATH": ":".join(site), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {}
    assert len(names) > 80
