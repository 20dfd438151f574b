"""GraphServing: CUDA-Graph-accelerated LLM decode workers and their Kubernetes operator."""

__version__ = "0.1.0"
