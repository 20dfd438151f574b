"""Types shared by the worker and the operator. Pure pydantic: importable without torch."""
