"""``--speculative ngram:K`` (runtime/worker.py) sets ``engine.speculative``; K outside 1..8, another
method, or a graph mode that captures no FULL graphs is refused at start-up, naming the flag."""

import json

import pytest

from graphserving.runtime.worker import StartupError, build_parser, resolve_config


def config_of(*flags: str, environ: dict | None = None):
    return resolve_config(build_parser().parse_args(["--model", "m.gguf", *flags]), environ=environ or {})


def test_without_the_flag_speculative_decoding_is_off():
    engine = config_of().engine
    assert (engine.speculative, engine.num_speculative_tokens) == (None, 0)


def test_the_flag_sets_k():
    engine = config_of("--speculative", "ngram:4").engine
    assert (engine.speculative, engine.num_speculative_tokens) == ("ngram:4", 4)


@pytest.mark.parametrize("value", ["ngram:0", "ngram:9", "eagle:4", "ngram", "ngram:x"])
def test_a_bad_value_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m.gguf", "--speculative", value])
    err = capsys.readouterr().err
    assert "--speculative" in err and "'ngram:K' with K in 1..8" in err and repr(value) in err


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE"])
def test_a_graph_mode_without_full_graphs_is_refused_naming_the_flag(mode):
    with pytest.raises(StartupError) as info:
        config_of("--speculative", "ngram:3", "--graph-mode", mode)
    assert "engine.speculative (--speculative ngram:3) needs a graph mode that captures FULL graphs" in str(info.value)
    assert f"graphs.mode is {mode}" in str(info.value)


def test_the_configuration_file_value_is_validated_naming_the_field():
    env = {"GRAPHSERVING_WORKER_CONFIG": json.dumps({"model_path": "m.gguf", "engine": {"speculative": "ngram:12"}})}
    with pytest.raises(StartupError) as info:
        config_of(environ=env)
    assert "engine.speculative" in str(info.value) and "ngram:12" in str(info.value)
