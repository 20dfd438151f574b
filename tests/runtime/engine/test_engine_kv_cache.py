"""The engine's KV cache and graph runner come from outside or are made by the engine:
the one sizing function (model/kv_cache.py), given caches, and the graph-runner seam."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from graphserving.contract.worker_config import EngineLimits  # noqa: E402
from graphserving.runtime.engine.core import LLMEngine  # noqa: E402
from graphserving.runtime.engine.sequence import SamplingParams  # noqa: E402
from graphserving.runtime.model.kv_cache import (  # noqa: E402
    CPU_DEFAULT_NUM_KV_BLOCKS,
    allocate_kv_cache,
    kv_blocks_for_memory,
    num_kv_blocks,
)
from graphserving.runtime.model.loader import load_model  # noqa: E402

PROMPTS = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3], [1000, 2000]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama3_rope"), revision=None, dtype=torch.float32, device="cpu")


# -- sizing (model/kv_cache.py) ------------------------------------------------------------------

def test_a_requested_block_count_is_used_as_is_and_the_cpu_default_is_512():
    assert num_kv_blocks(37, "cuda", 1024, 0.9) == 37
    assert num_kv_blocks(None, torch.device("cpu"), 1024, 0.9) == CPU_DEFAULT_NUM_KV_BLOCKS == 512


def test_on_cuda_the_blocks_fit_in_the_fraction_of_free_memory_less_the_reserve(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10_000, 20_000))
    assert num_kv_blocks(None, "cuda", 100, 0.5) == 50
    assert num_kv_blocks(None, "cuda", 100, 0.5, reserve_bytes=1_050) == 39
    assert kv_blocks_for_memory(10_000, 0.5, 100, 1_050) == 39
    with pytest.raises(RuntimeError, match="only 10000 bytes of device memory are free: not enough for 2 KV blocks of 3000 bytes"):
        num_kv_blocks(None, "cuda", 3_000, 0.5)
    with pytest.raises(RuntimeError, match="no room for the KV cache: 10000 bytes free, 4900 reserved for graphs"):
        num_kv_blocks(None, "cuda", 100, 0.5, reserve_bytes=4_900)
    # the lifecycle always passes its reserve, also when it is 0 (mode NONE): its message stays
    with pytest.raises(RuntimeError, match="no room for the KV cache: 10000 bytes free, 0 reserved for graphs"):
        num_kv_blocks(None, "cuda", 3_000, 0.5, reserve_bytes=0)


# -- given KV caches -----------------------------------------------------------------------------

def test_an_engine_over_given_kv_caches_uses_them_and_their_block_count(tiny):
    limits = EngineLimits(max_num_seqs=4, block_size=4)
    kv_caches = allocate_kv_cache(tiny.config, 40, 4, torch.float32, "cpu")
    engine = LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits, kv_caches=kv_caches)
    assert engine.kv_caches is kv_caches and engine.runner.kv_caches is kv_caches
    assert engine.num_kv_blocks == 40 and engine.block_manager.num_total_blocks == 39
    assert engine.max_model_len == min(tiny.config.max_model_len, 39 * 4)
    own = LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits.model_copy(update={"num_kv_blocks": 40}))
    assert [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)] == [
        c[0].token_ids for c in own.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("change, message", [
    (dict(num_blocks=40, block_size=8), "blocks of 8 tokens; limits.block_size is 4"),
    (dict(num_blocks=40, block_size=4, num_kv_blocks=64), "40 blocks; limits.num_kv_blocks is 64"),
    (dict(num_blocks=40, block_size=4, layers=1), "kv_caches has 1 tensors"),
], ids=["block-size", "block-count", "layers"])
def test_kv_caches_that_do_not_match_the_model_or_the_limits_are_refused(tiny, change, message):
    limits = EngineLimits(block_size=4, num_kv_blocks=change.get("num_kv_blocks"))
    kv_caches = allocate_kv_cache(tiny.config, change["num_blocks"], change["block_size"], torch.float32, "cpu")
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits, kv_caches=kv_caches[: change.get("layers")])


# -- the graph-runner seam -----------------------------------------------------------------------

class CountingExecutor:
    """A :class:`GraphExecutor` that runs every pass eagerly and counts them."""

    def __init__(self, model, kv_caches):
        self.model, self.kv_caches = model, kv_caches
        self.generation = 0
        self.passes = 0

    def execute(self, meta):
        self.passes += 1
        hidden = self.model.forward(meta, self.kv_caches)
        return self.model.compute_logits(hidden[meta.logits_indices]), None

    def resident_decode_view(self, meta):
        return None


def test_the_graph_runner_is_given_to_the_engine_and_cannot_be_replaced(tiny):
    limits = EngineLimits(max_num_seqs=4, num_kv_blocks=40, block_size=4, num_scheduler_steps=4)
    kv_caches = allocate_kv_cache(tiny.config, 40, 4, torch.float32, "cpu")
    executor = CountingExecutor(tiny.model, kv_caches)
    engine = LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits, kv_caches=kv_caches, graph_runner=executor)
    assert engine.runner.graph_runner is executor
    with pytest.raises(AttributeError):
        engine.runner.graph_runner = None
    eager = LLMEngine(tiny.model, tiny.config, tiny.tokenizer, limits)
    assert eager.runner.graph_runner is None
    assert [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)] == [
        c[0].token_ids for c in eager.generate(PROMPTS, GREEDY)]
    assert executor.passes > 0


def test_the_engine_package_does_not_import_the_graphs_package():
    code = (
        "import sys\n"
        "import graphserving.runtime.engine.core, graphserving.runtime.engine.async_engine\n"
        "import graphserving.runtime.engine.output, graphserving.runtime.engine.model_runner\n"
        "print(sorted(m for m in sys.modules if m.startswith('graphserving.runtime.graphs')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
