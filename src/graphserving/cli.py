"""The `graphserving` command: tools around the worker and the operator.

Each subcommand lives in the module that owns its concept and registers itself here through
``SUBCOMMANDS``: ``name -> "module:function"``, where the function takes the argparse
subparsers action and adds a parser whose ``func`` default runs the command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, str] = {
    "dev": "graphserving.dev.cli:add_parser",
    "plan-buckets": "graphserving.planner.cli:add_plan_parser",
    "replay-trace": "graphserving.planner.cli:add_replay_parser",
    "demo": "graphserving.dev.demo:add_parser",
    "operator": "graphserving.operator.main:add_parser",
    "canary-prompt": "graphserving.canary_prompt:add_parser",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphserving", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, target in SUBCOMMANDS.items():
        module_name, func_name = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("graphserving"):
                continue  # subcommand not built yet
            _add_unavailable(sub, name, exc.name or str(exc))
            continue
        getattr(module, func_name)(sub)
    return parser


def _add_unavailable(sub: argparse._SubParsersAction, name: str, missing: str) -> None:
    """Keep a subcommand whose optional dependency is absent (``dev`` needs ``cryptography``, which
    the operator image does not install) listed, failing with what to install when it is used,
    instead of breaking every other subcommand."""

    def fail(args: argparse.Namespace) -> int:
        print(f"graphserving {name}: needs the Python package {missing!r}, which is not installed "
              "(pip install 'graphserving[all]')", file=sys.stderr)
        return 2

    parser = sub.add_parser(name, help=f"(unavailable here: needs {missing})", add_help=False)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    parser.set_defaults(func=fail)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
