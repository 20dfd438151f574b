"""``--prefix-caching`` / ``--no-prefix-caching`` (runtime/worker.py) set ``engine.prefix_caching``
over the configuration file or environment; default on."""

import json

from graphserving.runtime.worker import build_parser, resolve_config


def engine_of(*flags: str, environ: dict | None = None):
    return resolve_config(build_parser().parse_args(["--model", "m.gguf", *flags]), environ=environ or {}).engine


def test_without_a_flag_prefix_caching_is_left_unset_which_means_on():
    assert engine_of().prefix_caching is None  # EngineLimits: on unless False


def test_no_prefix_caching_turns_it_off():
    assert engine_of("--no-prefix-caching").prefix_caching is False


def test_the_flag_overrides_the_configuration_and_leaves_its_other_engine_fields():
    env = {"GRAPHSERVING_WORKER_CONFIG": json.dumps(
        {"model_name": "m", "model_path": "m.gguf", "engine": {"prefix_caching": False, "max_num_seqs": 8}})}
    assert engine_of(environ=env).prefix_caching is False
    engine = engine_of("--prefix-caching", environ=env)
    assert (engine.prefix_caching, engine.max_num_seqs) == (True, 8)
