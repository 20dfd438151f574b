"""Pinned control-plane binaries, built from Go modules and cached by version.

Machines without Docker and without internet still reach the Go module proxy, so the local
control plane is built from source once and reused:

* ``etcd`` from ``go.etcd.io/etcd/server/v3``: its go.mod has local ``replace`` directives, so
  ``go install`` refuses it; a tiny module of our own calls ``etcdmain.Main``.
* ``kube-apiserver``, ``kube-controller-manager``, ``kube-scheduler``, ``kubectl`` from
  ``k8s.io/kubernetes``: it requires every staging module (``k8s.io/api``, ``k8s.io/client-go``...)
  at ``v0.0.0`` and replaces them with ``./staging`` paths, which a dependency cannot use. A
  throwaway module requires ``k8s.io/kubernetes vX.Y.Z`` and replaces each staging module with its
  published ``v0.Y.Z`` tag; the list is parsed from that release's own go.mod.
* ``helm`` and ``kwok`` with ``go install`` semantics (their go.mod files have no replaces).
* ``promtool`` and ``prometheus`` the same way, from ``github.com/prometheus/prometheus`` (the
  metric-name tests run ``promtool check metrics``; the dev cluster runs ``prometheus``): Prometheus
  ``v3.Y.Z`` is on the module proxy as ``v0.3YY.Z``, its module path having no ``/v3``.
* ``traefik`` (the dev cluster's Gateway API implementation) from ``github.com/traefik/traefik/v3``:
  its go.mod replaces modules with Containous forks, which ``go install`` refuses, so a
  throwaway module requires the release and repeats its versioned ``replace`` and ``exclude``
  directives. Traefik v3.7 also replaces ``github.com/traefik/traefik/dynamic/ext`` with a local
  folder that neither the module zip nor the proxy has, and requires module versions this proxy
  refuses (403): v3.6.12 is the newest release that builds here (docs/gateway.md).

The version is stamped with ``-ldflags -X`` like Kubernetes' ``hack/lib/version.sh`` does, so
``/version`` (and ``kubectl version``, which helm reads) report the real release.

Binaries live under ``${GRAPHSERVING_CACHE_DIR:-~/.cache/graphserving}/bin/<component>-<version>/``;
the generated Go modules live under ``.../gomod/``. The Go module and build caches are Go's own
(``go env GOMODCACHE GOCACHE``). ``KUBEBUILDER_ASSETS`` (the envtest convention: a folder with
``etcd``, ``kube-apiserver`` and ``kubectl``) replaces building those three when it is set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
HELM_VERSION = "v3.22.0"
KWOK_VERSION = "v0.8.0"
PROMETHEUS_VERSION = "v3.16.0"
TRAEFIK_VERSION = "v3.6.12"

KUBERNETES_COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
ALL_COMPONENTS = ("etcd", *KUBERNETES_COMPONENTS, "helm", "kwok", "promtool", "prometheus", "traefik")
#: Components built with ``go install module/cmd@version``.
GO_INSTALL_COMPONENTS = ("helm", "kwok", "promtool", "prometheus")
#: The components ``KUBEBUILDER_ASSETS`` may provide (envtest ships exactly these).
KUBEBUILDER_COMPONENTS = ("etcd", "kube-apiserver", "kubectl")

#: Parallelism for ``go build -p``: compiling Kubernetes uses ~1 GiB per compile job at peak,
#: so more jobs than cores only costs memory.
DEFAULT_BUILD_JOBS = max(1, min(os.cpu_count() or 2, 4))


class BinaryError(RuntimeError):
    """A binary is missing and cannot be built (no Go toolchain, no module proxy, build failure)."""


def cache_dir() -> Path:
    """The root of everything this module caches: ``$GRAPHSERVING_CACHE_DIR`` or ``~/.cache/graphserving``."""
    return Path(os.environ.get("GRAPHSERVING_CACHE_DIR") or Path.home() / ".cache" / "graphserving")


def component_version(component: str) -> str:
    """The pinned version of ``component`` (one of :data:`ALL_COMPONENTS`)."""
    if component == "etcd":
        return ETCD_VERSION
    if component in KUBERNETES_COMPONENTS:
        return KUBERNETES_VERSION
    if component == "helm":
        return HELM_VERSION
    if component == "kwok":
        return KWOK_VERSION
    if component in ("promtool", "prometheus"):
        return PROMETHEUS_VERSION
    if component == "traefik":
        return TRAEFIK_VERSION
    raise ValueError(f"unknown component {component!r}; known: {', '.join(ALL_COMPONENTS)}")


def cached_path(component: str) -> Path:
    """Where the cached build of ``component`` lives (whether or not it exists yet)."""
    return cache_dir() / "bin" / f"{component}-{component_version(component)}" / component


def binary_path(component: str) -> Path | None:
    """The binary to run for ``component``: ``KUBEBUILDER_ASSETS`` first, then the cache.

    Returns None when neither has it; :func:`ensure_binaries` builds it.
    """
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and component in KUBEBUILDER_COMPONENTS:
        candidate = Path(assets) / component
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    candidate = cached_path(component)
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return candidate
    return None


def missing_components(components: Iterable[str] = ALL_COMPONENTS) -> list[str]:
    """The components among ``components`` that have no usable binary yet."""
    return [c for c in components if binary_path(c) is None]


# ---------------------------------------------------------------------------------------------
# Go module files (pure functions: text in, text out)
# ---------------------------------------------------------------------------------------------

_REPLACE_BLOCK = re.compile(r"^replace\s*\((.*?)^\)", re.MULTILINE | re.DOTALL)
_REPLACE_LINE = re.compile(r"^\s*(?:replace\s+)?(k8s\.io/[\w.\-/]+)\s*=>\s*\./staging/", re.MULTILINE)


def staging_modules(kubernetes_go_mod: str) -> list[str]:
    """The staging module paths that ``k8s.io/kubernetes``' go.mod replaces with ``./staging/...``.

    Parses both ``replace ( ... )`` blocks and single-line ``replace`` directives. Raises
    :class:`BinaryError` if none is found (the go.mod layout changed).
    """
    text = "\n".join(m.group(1) for m in _REPLACE_BLOCK.finditer(kubernetes_go_mod))
    single = [ln for ln in kubernetes_go_mod.splitlines() if ln.startswith("replace ") and "(" not in ln]
    modules = sorted(set(_REPLACE_LINE.findall(text + "\n" + "\n".join(single))))
    if not modules:
        raise BinaryError("k8s.io/kubernetes go.mod has no './staging/' replace directives; layout changed?")
    return modules


def go_line(go_mod: str) -> str:
    """The ``go`` directive of a go.mod (e.g. ``1.26.0``)."""
    match = re.search(r"^go\s+(\S+)", go_mod, re.MULTILINE)
    if not match:
        raise BinaryError("go.mod has no 'go' directive")
    return match.group(1)


def staging_version(kubernetes_version: str) -> str:
    """Kubernetes ``v1.Y.Z`` publishes its staging modules as ``v0.Y.Z``."""
    match = re.fullmatch(r"v1\.(\d+\.\d+.*)", kubernetes_version)
    if not match:
        raise ValueError(f"Kubernetes version {kubernetes_version!r} is not of the form v1.Y.Z")
    return "v0." + match.group(1)


def kubernetes_module_go_mod(kubernetes_version: str, kubernetes_go_mod: str) -> str:
    """go.mod of the throwaway module that builds the Kubernetes commands from the proxy."""
    tag = staging_version(kubernetes_version)
    lines = [
        "module graphserving.dev/kubernetes-build",
        "",
        f"go {go_line(kubernetes_go_mod)}",
        "",
        f"require k8s.io/kubernetes {kubernetes_version}",
        "",
        "replace (",
    ]
    lines += [f"\t{module} => {module} {tag}" for module in staging_modules(kubernetes_go_mod)]
    lines += [")", ""]
    lines += [f"tool k8s.io/kubernetes/cmd/{c}" for c in KUBERNETES_COMPONENTS]
    return "\n".join(lines) + "\n"


def prometheus_module_version(prometheus_version: str) -> str:
    """The module-proxy version of a Prometheus release: ``v3.Y.Z`` is published as ``v0.3YY.Z``
    (e.g. ``v3.5.0`` as ``v0.305.0``), because its module path has no major-version suffix."""
    match = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", prometheus_version)
    if not match or int(match.group(1)) < 2:
        raise ValueError(f"Prometheus version {prometheus_version!r} is not of the form vX.Y.Z with X >= 2")
    major, minor, patch = (int(g) for g in match.groups())
    return f"v0.{major * 100 + minor}.{patch}"


def etcd_module_go_mod(etcd_version: str, go_version: str) -> str:
    """go.mod of the tiny module whose ``main`` is etcd's ``etcdmain.Main``."""
    return (
        "module graphserving.dev/etcd-build\n\n"
        f"go {go_version}\n\n"
        f"require go.etcd.io/etcd/server/v3 {etcd_version}\n"
    )


ETCD_MAIN_GO = """\
// Command etcd: etcd's own entry point, built from the published server module.
package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
\tetcdmain.Main(os.Args)
}
"""


def go_mod_directives(go_mod: str, verb: str) -> list[str]:
    """The bodies of every ``verb`` directive of a go.mod (``replace``, ``exclude``...), single-line
    and ``verb ( ... )`` blocks alike, without comments: ``"a/b => c/d v1.2.3"``."""
    bodies: list[str] = []
    in_block = False
    for raw in go_mod.splitlines():
        line = raw.split("//", 1)[0].strip()
        if in_block:
            if line == ")":
                in_block = False
            elif line:
                bodies.append(line)
        elif re.fullmatch(rf"{verb}\s*\(", line):
            in_block = True
        elif line.startswith(verb + " "):
            bodies.append(line[len(verb):].strip())
    return bodies


def traefik_module_go_mod(traefik_version: str, traefik_go_mod: str) -> str:
    """go.mod of the throwaway module that builds ``cmd/traefik`` from the proxy.

    Repeats the release's versioned ``replace`` and its ``exclude`` directives (they act only in
    the main module). Raises :class:`BinaryError` for a ``replace`` by a local folder: the module
    zip leaves out nested modules, so such a release cannot be built from the proxy.
    """
    replaces = go_mod_directives(traefik_go_mod, "replace")
    local = [r for r in replaces if re.search(r"=>\s*(\.{1,2}/|/)", r)]
    if local:
        raise BinaryError(f"traefik {traefik_version} replaces modules with local folders that its module zip "
                          f"lacks ({'; '.join(local)}); pin a release without them")
    lines = ["module graphserving.dev/traefik-build", "", f"go {go_line(traefik_go_mod)}", "",
             f"require github.com/traefik/traefik/v3 {traefik_version}", ""]
    if replaces:
        lines += ["replace (", *(f"\t{r}" for r in replaces), ")", ""]
    lines += [f"exclude {e}" for e in go_mod_directives(traefik_go_mod, "exclude")]
    lines += ["", "tool github.com/traefik/traefik/v3/cmd/traefik"]
    return "\n".join(lines) + "\n"


def kubernetes_ldflags(kubernetes_version: str, build_date: str) -> str:
    """``-ldflags`` stamping the version the way ``hack/lib/version.sh`` does."""
    match = re.fullmatch(r"v(\d+)\.(\d+)\..*", kubernetes_version)
    if not match:
        raise ValueError(f"Kubernetes version {kubernetes_version!r} is not of the form vX.Y.Z")
    values = {
        "gitVersion": kubernetes_version,
        "gitMajor": match.group(1),
        "gitMinor": match.group(2),
        "gitTreeState": "clean",
        "buildDate": build_date,
    }
    flags = ["-s", "-w"]
    for package in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version"):
        flags += [f"-X {package}.{key}={value}" for key, value in values.items()]
    return " ".join(flags)


# ---------------------------------------------------------------------------------------------
# Building (side effects)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class BuildReport:
    """What :func:`ensure_binaries` did: per component, the path and the seconds spent building."""

    paths: dict[str, Path]
    built: dict[str, float]


def _go_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env["GOTOOLCHAIN"] = "local"
    env["GOWORK"] = "off"
    env.setdefault("CGO_ENABLED", "0")
    env.setdefault("GOFLAGS", "-buildvcs=false")
    return env


def _find_go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BinaryError(
            "the Go toolchain is not on PATH: install Go >= 1.26 (e.g. from go.dev/dl or your "
            "distribution), or set KUBEBUILDER_ASSETS to a folder holding etcd, kube-apiserver "
            "and kubectl"
        )
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, env=_go_env())
    match = re.match(r"go(\d+)\.(\d+)", out.stdout.strip())
    if not match or (int(match.group(1)), int(match.group(2))) < (1, 26):
        raise BinaryError(f"Go >= 1.26 is needed to build Kubernetes 1.36, found {out.stdout.strip()!r} at {go}")
    return go


def _run_go(args: list[str], cwd: Path, what: str, log: Callable[[str], None], progress: bool = False,
            extra_env: dict[str, str] | None = None) -> None:
    """Run a go command; on failure raise BinaryError with the tail of its output.

    With ``progress``, ``-v`` package lines are counted and reported every few seconds.
    """
    cmd = [_find_go(), *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=_go_env(extra_env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    tail: list[str] = []
    packages = 0
    started = last = time.monotonic()
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail = (tail + [line])[-40:]
        if progress and line and not line.startswith(("go: ", "#")) and " " not in line:
            packages += 1
        now = time.monotonic()
        if progress and now - last >= 15:
            log(f"  {what}: {packages} packages compiled, {now - started:.0f}s elapsed (last: {line[:80]})")
            last = now
    if proc.wait() != 0:
        joined = "\n".join(tail)
        hint = ""
        if re.search(r"proxy|dial tcp|no such host|i/o timeout|connection refused|404 Not Found", joined):
            hint = (f"\nThe Go module proxy ({os.environ.get('GOPROXY') or 'https://proxy.golang.org'}) "
                    "could not be reached or does not serve this version: set GOPROXY to a reachable "
                    "proxy, or set KUBEBUILDER_ASSETS to prebuilt binaries.")
        raise BinaryError(f"{what} failed: {' '.join(cmd)} (in {cwd})\n{joined}{hint}")


def download_module(module: str, version: str, workdir: Path) -> dict:
    """``go mod download -json module@version`` (run in ``workdir``): its ``Dir``, ``GoMod``, ``Zip``...

    Raises :class:`BinaryError` naming the proxy when the module cannot be downloaded.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [_find_go(), "mod", "download", "-json", f"{module}@{version}"]
    out = subprocess.run(cmd, cwd=workdir, env=_go_env(), capture_output=True, text=True)
    info = json.loads(out.stdout) if out.stdout.strip().startswith("{") else {}
    if out.returncode != 0 or "Error" in info:
        detail = info.get("Error") or out.stderr.strip()
        raise BinaryError(
            f"cannot download {module}@{version} from the Go module proxy "
            f"({os.environ.get('GOPROXY') or 'https://proxy.golang.org'}): {detail}"
        )
    return info


def _install(built: Path, component: str) -> Path:
    target = cached_path(component)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    shutil.move(built, tmp)  # build outputs are not kept twice
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def _build_kubernetes(components: list[str], jobs: int, log: Callable[[str], None]) -> None:
    moddir = cache_dir() / "gomod" / f"kubernetes-{KUBERNETES_VERSION}"
    moddir.mkdir(parents=True, exist_ok=True)
    info = download_module("k8s.io/kubernetes", KUBERNETES_VERSION, moddir)
    upstream = Path(info["GoMod"]).read_text()
    go_mod = kubernetes_module_go_mod(KUBERNETES_VERSION, upstream)
    if not (moddir / "go.mod").exists() or (moddir / "go.mod").read_text() != go_mod:
        (moddir / "go.mod").write_text(go_mod)
        (moddir / "go.sum").unlink(missing_ok=True)
    log(f"  kubernetes {KUBERNETES_VERSION}: resolving modules ({len(staging_modules(upstream))} staging modules "
        f"replaced by {staging_version(KUBERNETES_VERSION)})")
    _run_go(["mod", "tidy"], moddir, "go mod tidy (kubernetes)", log)
    outdir = moddir / "out"
    outdir.mkdir(exist_ok=True)
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    packages = [f"k8s.io/kubernetes/cmd/{c}" for c in components]
    log(f"  kubernetes {KUBERNETES_VERSION}: compiling {', '.join(components)} with -p {jobs}")
    _run_go(["build", "-v", f"-p={jobs}", "-trimpath", "-tags=providerless",
             f"-ldflags={kubernetes_ldflags(KUBERNETES_VERSION, date)}", "-o", str(outdir) + "/", *packages],
            moddir, f"build of {', '.join(components)}", log, progress=True)
    for c in components:
        _install(outdir / c, c)


def _build_etcd(jobs: int, log: Callable[[str], None]) -> None:
    moddir = cache_dir() / "gomod" / f"etcd-{ETCD_VERSION}"
    moddir.mkdir(parents=True, exist_ok=True)
    info = download_module("go.etcd.io/etcd/server/v3", ETCD_VERSION, moddir)
    go_version = go_line(Path(info["GoMod"]).read_text())
    (moddir / "go.mod").write_text(etcd_module_go_mod(ETCD_VERSION, go_version))
    (moddir / "main.go").write_text(ETCD_MAIN_GO)
    _run_go(["mod", "tidy"], moddir, "go mod tidy (etcd)", log)
    log(f"  etcd {ETCD_VERSION}: compiling")
    _run_go(["build", "-v", f"-p={jobs}", "-trimpath", "-ldflags=-s -w", "-o", str(moddir / "out" / "etcd"), "."],
            moddir, "build of etcd", log, progress=True)
    _install(moddir / "out" / "etcd", "etcd")


def _build_traefik(jobs: int, log: Callable[[str], None]) -> None:
    moddir = cache_dir() / "gomod" / f"traefik-{TRAEFIK_VERSION}"
    moddir.mkdir(parents=True, exist_ok=True)
    info = download_module("github.com/traefik/traefik/v3", TRAEFIK_VERSION, moddir)
    go_mod = traefik_module_go_mod(TRAEFIK_VERSION, Path(info["GoMod"]).read_text())
    if not (moddir / "go.mod").exists() or (moddir / "go.mod").read_text() != go_mod:
        (moddir / "go.mod").write_text(go_mod)
        (moddir / "go.sum").unlink(missing_ok=True)
    _run_go(["mod", "tidy"], moddir, "go mod tidy (traefik)", log)
    log(f"  traefik {TRAEFIK_VERSION}: compiling")
    ldflags = f"-s -w -X github.com/traefik/traefik/v3/pkg/version.Version={TRAEFIK_VERSION.lstrip('v')}"
    _run_go(["build", "-v", f"-p={jobs}", "-trimpath", f"-ldflags={ldflags}", "-o", str(moddir / "out" / "traefik"),
             "github.com/traefik/traefik/v3/cmd/traefik"], moddir, "build of traefik", log, progress=True)
    _install(moddir / "out" / "traefik", "traefik")


def go_install_target(component: str) -> tuple[str, str]:
    """``(package@version, -ldflags)`` of a :data:`GO_INSTALL_COMPONENTS` component; the flags
    stamp the version its ``version`` command prints."""
    version = component_version(component)
    if component == "helm":
        return f"helm.sh/helm/v3/cmd/helm@{version}", f"-s -w -X helm.sh/helm/v3/internal/version.version={version}"
    if component == "kwok":
        return (f"sigs.k8s.io/kwok/cmd/kwok@{version}",
                f"-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={version.lstrip('v')}")
    if component in ("promtool", "prometheus"):
        return (f"github.com/prometheus/prometheus/cmd/{component}@{prometheus_module_version(version)}",
                f"-s -w -X github.com/prometheus/common/version.Version={version.lstrip('v')}")
    raise ValueError(f"{component!r} is not built with go install; those are: {', '.join(GO_INSTALL_COMPONENTS)}")


def _build_go_install(component: str, jobs: int, log: Callable[[str], None]) -> None:
    """helm, kwok, promtool and prometheus: ``go install module/cmd@version`` into a private GOBIN."""
    version = component_version(component)
    target, ldflags = go_install_target(component)
    gobin = cache_dir() / "gomod" / f"{component}-{version}" / "bin"
    gobin.mkdir(parents=True, exist_ok=True)
    log(f"  {component} {version}: compiling")
    _run_go(["install", "-v", f"-p={jobs}", "-trimpath", f"-ldflags={ldflags}", target],
            gobin.parent, f"build of {component}", log, progress=True, extra_env={"GOBIN": str(gobin)})
    _install(gobin / component, component)


def ensure_binaries(
    components: Iterable[str] = ALL_COMPONENTS,
    jobs: int = DEFAULT_BUILD_JOBS,
    log: Callable[[str], None] | None = None,
) -> BuildReport:
    """Make sure every component in ``components`` has a binary; build the missing ones.

    Returns the path of each component and the build seconds of those built now. Raises
    :class:`BinaryError` with a clear message when Go or the module proxy is missing or a build
    fails. Safe to call again: cached binaries are reused.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    wanted = list(dict.fromkeys(components))
    for c in wanted:
        component_version(c)  # validates the name
    missing = missing_components(wanted)
    built: dict[str, float] = {}
    if missing:
        log(f"building {', '.join(missing)} into {cache_dir() / 'bin'} (cold builds take many minutes)")
    kube = [c for c in missing if c in KUBERNETES_COMPONENTS]
    if "etcd" in missing:
        t0 = time.monotonic()
        _build_etcd(jobs, log)
        built["etcd"] = time.monotonic() - t0
        log(f"  etcd ready in {built['etcd']:.0f}s")
    if kube:
        t0 = time.monotonic()
        _build_kubernetes(kube, jobs, log)
        seconds = time.monotonic() - t0
        for c in kube:
            built[c] = seconds
        log(f"  {', '.join(kube)} ready in {seconds:.0f}s")
    if "traefik" in missing:
        t0 = time.monotonic()
        _build_traefik(jobs, log)
        built["traefik"] = time.monotonic() - t0
        log(f"  traefik ready in {built['traefik']:.0f}s")
    for c in GO_INSTALL_COMPONENTS:
        if c in missing:
            t0 = time.monotonic()
            _build_go_install(c, jobs, log)
            built[c] = time.monotonic() - t0
            log(f"  {c} ready in {built[c]:.0f}s")
    paths = {}
    for c in wanted:
        path = binary_path(c)
        if path is None:
            raise BinaryError(f"{c} was built but {cached_path(c)} is not executable")
        paths[c] = path
    return BuildReport(paths=paths, built=built)


def main(argv: list[str] | None = None) -> int:
    """``python -m graphserving.dev.binaries [component...]``: build what is missing, print paths."""
    components = (argv if argv is not None else sys.argv[1:]) or list(ALL_COMPONENTS)
    try:
        report = ensure_binaries(components)
    except BinaryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for c, path in report.paths.items():
        print(f"{c}\t{component_version(c)}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
