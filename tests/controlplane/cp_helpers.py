"""Helpers shared by the control-plane tests (raw-JSON reads, a sleeping container)."""

import json
import sys


def as_dict(response) -> dict:
    """The JSON body of a call made with ``_preload_content=False``."""
    return json.loads(response.data)


def read_pod(core, name: str, namespace: str) -> dict:
    return as_dict(core.read_namespaced_pod(name, namespace, _preload_content=False))


def sleeper_container(name: str = "main") -> dict:
    """A container whose process just sleeps (a real process on the local node)."""
    return {"name": name, "image": "python:3.11", "command": [sys.executable, "-c", "import time; time.sleep(3600)"]}
