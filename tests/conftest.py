"""Suite-wide fixtures: the local Kubernetes control plane (see graphserving.dev.pytest_fixtures)."""

pytest_plugins = ["graphserving.dev.pytest_fixtures"]
