"""Structured output, logit_bias and min_tokens through the engine on the real SmolLM2 (CPU)."""

import json
import re

import jsonschema
import pytest

from graphserving.runtime.engine.sequence import SamplingParams, SamplingParamsError, StructuredOutput

PROMPT = "Here is a person described as JSON:"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ids(smollm2):
    return smollm2.tokenizer.encode(PROMPT)


def _one(engine, ids, params):
    return engine.generate([ids], params)[0][0]


def test_json_schema_output_parses_and_validates(make_engine, ids):
    params = SamplingParams(max_tokens=80, temperature=0,
                            structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    choice = _one(make_engine(), ids, params)
    assert choice.finish_reason == "stop", choice.text
    jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_sampled_json_object_is_a_json_object(make_engine, ids):
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=3, structured=StructuredOutput("json_object"))
    for choice in make_engine().generate([ids], SamplingParams(**{**params.__dict__, "n": 2}))[0]:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:  # cut by max_tokens: a prefix of a JSON object
            assert choice.text.lstrip().startswith("{")


def test_regex_and_choice(make_engine, ids):
    engine = make_engine()
    phone = _one(engine, ids, SamplingParams(max_tokens=20, temperature=0,
                                             structured=StructuredOutput("regex", r"\+1 [0-9]{3}-[0-9]{4}")))
    assert re.fullmatch(r"\+1 [0-9]{3}-[0-9]{4}", phone.text), phone.text
    assert phone.finish_reason == "stop"
    pick = _one(engine, ids, SamplingParams(max_tokens=10, temperature=0.8, seed=5,
                                            structured=StructuredOutput("choice", json.dumps(["yes", "no", "maybe"]))))
    assert pick.text in {"yes", "no", "maybe"}


def test_constrained_rows_do_not_change_unconstrained_rows_in_the_same_batch(make_engine, ids):
    free = SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True)
    alone = _one(make_engine(num_scheduler_steps=4), ids, free).token_ids
    constrained = SamplingParams(max_tokens=30, temperature=0,
                                 structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    engine = make_engine(num_scheduler_steps=4)
    out = engine.generate([ids, ids, ids], [free, constrained, free])
    assert out[0][0].token_ids == alone
    assert out[2][0].token_ids == alone
    if out[1][0].finish_reason == "stop":
        jsonschema.validate(json.loads(out[1][0].text), SCHEMA)
    else:  # cut by max_tokens: a prefix of the object
        assert out[1][0].text.startswith("{")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
        (StructuredOutput("json_schema", "[1, 2]"), "must be a JSON object"),
        (StructuredOutput("regex", "([0-9]", param="guided_regex"), "invalid regex"),
        (StructuredOutput("grammar", "start: undefined_rule", param="guided_grammar"), "invalid grammar"),
        (StructuredOutput("choice", "[]", param="guided_choice"), "non-empty strings"),
    ],
)
def test_a_spec_that_does_not_compile_names_its_field(make_engine, ids, spec, message):
    from graphserving.runtime.engine.core import RequestError

    engine = make_engine()
    with pytest.raises(RequestError) as err:
        engine.add_request("bad", ids, SamplingParams(max_tokens=4, structured=spec))
    assert err.value.param == spec.param
    assert str(err.value).startswith(f"{spec.param}: ")
    assert message in str(err.value)
    assert not engine.has_unfinished()  # nothing was queued


def test_logit_bias_moves_greedy_choices(make_engine, smollm2, ids):
    engine = make_engine()
    greedy = _one(engine, ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)).token_ids
    forced = smollm2.tokenizer.encode(" banana")[0]
    biased = _one(engine, ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                              logit_bias=((forced, 100.0),))).token_ids
    assert biased == [forced] * 3
    banned = _one(engine, ids, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                              logit_bias=((greedy[0], -100.0),))).token_ids
    assert banned[0] != greedy[0]


@pytest.mark.parametrize("steps", [1, 4])
def test_min_tokens_holds_back_eos(make_engine, smollm2, ids, steps):
    eos = smollm2.tokenizer.eos_token_ids[0]
    eager_eos = SamplingParams(max_tokens=10, temperature=0, logit_bias=((eos, 100.0),))
    engine = make_engine(num_scheduler_steps=steps)
    assert _one(engine, ids, eager_eos).token_ids == [eos]
    held = _one(engine, ids, SamplingParams(**{**eager_eos.__dict__, "min_tokens": 5}))
    assert len(held.token_ids) == 6 and held.token_ids[-1] == eos and eos not in held.token_ids[:5]
    assert held.finish_reason == "stop"


def test_logit_bias_token_outside_the_vocabulary_is_refused(make_engine, smollm2, ids):
    from graphserving.runtime.engine.core import RequestError

    with pytest.raises(RequestError) as err:
        make_engine().add_request("r", ids, SamplingParams(logit_bias=((smollm2.config.vocab_size, 1.0),)))
    assert err.value.param == "logit_bias"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_constrained_requests_are_served_by_full_graph_replays(tiny_model_dir, device):
    """The grammar mask is applied to the logits a FULL graph returns: a batch with a constrained
    row replays FULL keys (real CUDA graphs on a GPU, emulated on the CPU), gives the eager engine's
    tokens, and counts no eager pass."""
    import torch

    from graphserving.contract.graph_policy import GraphMode
    from graphserving.contract.worker_config import EngineLimits
    from graphserving.runtime.engine.core import LLMEngine
    from graphserving.runtime.graphs.key import FallbackReason, GraphKeyContract
    from graphserving.runtime.graphs.runner import GraphRunner
    from graphserving.runtime.model.kv_cache import allocate_kv_cache
    from graphserving.runtime.model.loader import load_model

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    tiny = load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device=device)
    limits = EngineLimits(max_num_seqs=8, num_kv_blocks=64, block_size=4, num_scheduler_steps=4)
    digits = SamplingParams(max_tokens=12, temperature=0, structured=StructuredOutput("regex", "[0-9]{4}-[a-z]{4}"))
    free = SamplingParams(max_tokens=12, temperature=0.7, seed=2, ignore_eos=True)
    prompts = [[5, 17, 300, 42], [9, 8, 7, 6, 5], [1000, 2000, 3]]
    params = [digits, free, digits]

    def engine(graphs: bool):
        kv = allocate_kv_cache(tiny.config, limits.num_kv_blocks, limits.block_size, torch.float32, device)
        runner = None
        if graphs:
            runner = GraphRunner(tiny.model, kv, mode=GraphMode.FULL, full_sizes=[1, 2, 4, 8], piecewise_sizes=[],
                                 contract=GraphKeyContract(model_revision="test", dtype="float32"),
                                 max_blocks_per_seq=64)
            with torch.inference_mode():
                runner.capture_all()
        return LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits, device=device, dtype=torch.float32,
                         kv_caches=kv, graph_runner=runner), runner

    eager, _ = engine(False)
    expected = [r[0].token_ids for r in eager.generate(prompts, params)]
    graphed, runner = engine(True)
    got = graphed.generate(prompts, params)
    assert [r[0].token_ids for r in got] == expected
    for r in (got[0][0], got[2][0]):
        assert re.fullmatch("[0-9]{4}-[a-z]{4}", r.text), r.text
    assert sum(runner.stats.replays.values()) >= 11  # every decode step of the batch
    # the one eager pass is the prefill (a FULL-only mode captures no prefill), none is for the grammar
    assert dict(runner.stats.eager) == {FallbackReason.NOT_UNIFORM_DECODE: 1}


def test_constrained_requests_and_their_steps_are_counted(make_engine, ids):
    engine = make_engine(metrics=True, num_scheduler_steps=4)
    out = engine.generate([ids, ids], [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                       SamplingParams(max_tokens=12, temperature=0,
                                                      structured=StructuredOutput("regex", "[a-z]{6}"))])
    text = engine.metrics.render().decode()
    assert 'graphserving_structured_output_requests_total{model_name="smollm2"} 1.0' in text
    # one step per token of the constrained row (the prefill's and each single-step decode's)
    steps = len(out[1][0].token_ids)
    assert f'graphserving_structured_output_steps_total{{model_name="smollm2"}} {steps}.0' in text


def test_a_tokenizer_the_grammar_library_cannot_read_is_a_clear_refusal():
    """The random-weight presets' word-level tokenizer has no byte-level decoder llguidance can read."""
    from graphserving.runtime.engine.structured import GrammarCompiler
    from graphserving.runtime.model.presets import preset_tokenizer

    compiler = GrammarCompiler(preset_tokenizer(64).hf_tokenizer, 64, (2,))
    with pytest.raises(SamplingParamsError) as err:
        compiler.compile(StructuredOutput("json_object"))
    assert str(err.value).startswith("response_format: structured output is not available for this model's tokenizer")


def test_a_gguf_tokenizer_with_a_sentencepiece_style_decoder_still_reads_as_byte_level(smollm2):
    """transformers 5.17 builds SmolLM2's GGUF tokenizer with a ``Sequence`` decoder (ByteFallback,
    Fuse, Replace, then ByteLevel); the grammar must still read ``Ġ"`` as ' "'."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders
    from transformers import PreTrainedTokenizerFast

    from graphserving.runtime.engine.structured import GrammarCompiler

    backend = Backend.from_str(smollm2.tokenizer.hf_tokenizer.backend_tokenizer.to_str())
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " "),
                                         decoders.ByteLevel()])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    compiler = GrammarCompiler(hf, smollm2.config.vocab_size, tuple(smollm2.tokenizer.eos_token_ids))
    matcher = compiler.matcher(compiler.compile(StructuredOutput("json_schema", json.dumps(SCHEMA))))
    text = json.dumps({"name": "Ada", "age": 36, "pet": "cat"})
    assert matcher.consume_tokens(hf.encode(text, add_special_tokens=False)), matcher.get_error()
    assert matcher.is_accepting()
