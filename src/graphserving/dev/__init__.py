"""Development tooling: a local Kubernetes control plane and node agent for tests and demos."""
