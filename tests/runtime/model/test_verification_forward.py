"""A verification batch through the whole model equals the same tokens as a chunked-prefill batch.

Speculative decoding verifies ``k`` draft tokens per request in one forward pass of ``k + 1``
query rows each, every row producing logits (ForwardMetadata ``uniform_query_len = k + 1``). The
model then runs each layer's attention as ``R * (k + 1)`` decode rows (runtime/model/verify_attention.py),
the computation a FULL graph captures; the reference is the general (chunked-prefill) path on the
same batch with ``uniform_query_len`` unset. Two paged runners with the same block allocation hold
the same prompts; each step runs once per path and the logits and KV caches are compared.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from graphserving.runtime.model.config import ModelConfig  # noqa: E402
from graphserving.runtime.model.kv_cache import allocate_kv_cache  # noqa: E402
from graphserving.runtime.model.kv_layout import NULL_BLOCK, PAD_SLOT_ID  # noqa: E402
from graphserving.runtime.model.llama import LlamaForCausalLM  # noqa: E402
from graphserving.runtime.model.loader import load_model  # noqa: E402

PROMPTS = [[5, 9, 13, 2, 7], list(range(40, 63)), [101], list(range(300, 311))]


@pytest.fixture(scope="module", params=["llama3_rope", "qwen3"])
def tiny(request, tiny_model_dir):
    return load_model(tiny_model_dir(request.param), revision=None, dtype=torch.float32, device="cpu").model


def every_row(meta, **changes):
    """``meta`` with logits for every token row (what a verification step samples)."""
    return dataclasses.replace(meta, logits_indices=torch.arange(meta.num_tokens), **changes)


def with_padded_requests(meta, count: int, q: int):
    """``meta`` plus ``count`` padded requests of ``q`` token rows each: ``seq_lens`` 0, slot
    ``PAD_SLOT_ID``, position 0, a ``NULL_BLOCK`` block-table row (what a graph's padding holds)."""
    t, r, width = meta.num_tokens, meta.num_reqs, meta.block_table.shape[1]
    pad_tokens, pad_reqs = count * q, count

    def grow(tensor, value, rows):
        return torch.cat([tensor, torch.full((rows, *tensor.shape[1:]), value, dtype=tensor.dtype)])

    return dataclasses.replace(
        meta,
        input_ids=grow(meta.input_ids, 0, pad_tokens),
        positions=grow(meta.positions, 0, pad_tokens),
        slot_mapping=grow(meta.slot_mapping, PAD_SLOT_ID, pad_tokens),
        seq_lens=grow(meta.seq_lens, 0, pad_reqs),
        query_lens=grow(meta.query_lens, q, pad_reqs),
        query_start_loc=torch.arange(r + pad_reqs + 1, dtype=torch.int32) * q,
        block_table=torch.cat([meta.block_table, torch.full((pad_reqs, width), NULL_BLOCK, dtype=torch.int32)]),
        logits_indices=torch.arange(t + pad_tokens),
        query_lens_cpu=None, seq_lens_cpu=None,
    )


def prefilled(model, paged_runner):
    """Two paged runners over identical block tables, both holding :data:`PROMPTS`."""
    runners = [paged_runner(model, num_blocks=128, block_size=4, table_width=16, seed=3) for _ in range(2)]
    for runner in runners:
        for seq, prompt in enumerate(PROMPTS):
            runner.step([(seq, prompt)])
    return runners


def forward_logits(model, meta, kv_caches):
    hidden = model(meta, kv_caches)
    return model.compute_logits(hidden[meta.logits_indices])


def assert_same_caches(ours, reference):
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine[:, NULL_BLOCK + 1:], theirs[:, NULL_BLOCK + 1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 7])
@torch.inference_mode()
def test_verification_logits_of_every_row_equal_the_chunked_prefill_path(tiny, paged_runner, k):
    spec, prefill = prefilled(tiny, paged_runner)
    g = torch.Generator().manual_seed(k)
    for _ in range(2):  # a second step reads the first step's K/V
        batch = [(seq, torch.randint(0, 49152, (k + 1,), generator=g).tolist()) for seq in range(len(PROMPTS))]
        ours = forward_logits(tiny, every_row(spec.metadata(batch), uniform_query_len=k + 1), spec.kv_caches)
        reference = forward_logits(tiny, every_row(prefill.metadata(batch)), prefill.kv_caches)
        assert ours.shape == (len(PROMPTS) * (k + 1), tiny.config.vocab_size)
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
        assert_same_caches(spec.kv_caches, prefill.kv_caches)


@torch.inference_mode()
def test_padded_requests_of_a_verification_batch_change_no_real_row(tiny, paged_runner):
    spec, prefill = prefilled(tiny, paged_runner)
    q = 4
    batch = [(seq, [11 + seq, 12, 13, 14]) for seq in (0, 2, 3)]
    padded = with_padded_requests(spec.metadata(batch), 2, q)
    ours = forward_logits(tiny, dataclasses.replace(padded, uniform_query_len=q), spec.kv_caches)
    reference = forward_logits(tiny, every_row(prefill.metadata(batch)), prefill.kv_caches)
    assert ours.shape[0] == 5 * q and torch.isfinite(ours).all()
    torch.testing.assert_close(ours[: 3 * q], reference, rtol=1e-5, atol=1e-5)
    assert_same_caches(spec.kv_caches, prefill.kv_caches)


@torch.inference_mode()
def test_a_verification_batch_with_the_wrong_row_count_is_refused(tiny, paged_runner):
    spec, _ = prefilled(tiny, paged_runner)
    meta = every_row(spec.metadata([(0, [1, 2, 3]), (1, [4, 5, 6])]), uniform_query_len=2)  # 6 rows, 2 x 2 expected
    with pytest.raises(ValueError, match="expand_for_verification"):
        tiny(meta, spec.kv_caches)


CONFIG = ModelConfig.from_hf_config({
    "model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
})


def test_a_verification_forward_pass_reads_no_tensor_data(paged_runner):
    """On the meta device any host read raises (tests/runtime/graphs/test_model_graph_safety.py):
    the verification path has no host lengths to read, unlike the general path on the same batch."""
    cpu = LlamaForCausalLM(CONFIG, device="cpu")
    with torch.no_grad():
        for param in cpu.parameters():
            param.normal_(0.0, 0.1)
    runner = paged_runner(cpu)
    runner.step([("a", [1, 2, 3]), ("b", [4, 5])])
    batch = with_padded_requests(runner.metadata([("a", [6, 7, 8]), ("b", [9, 10, 11])]), 2, 3)
    on_meta = dataclasses.replace(batch, **{name: t.to("meta") for name, t in batch.tensors().items()})
    model = LlamaForCausalLM(CONFIG, device="meta")
    kv_caches = allocate_kv_cache(CONFIG, 16, 4, torch.float32, "meta")
    hidden = model(dataclasses.replace(on_meta, uniform_query_len=3), kv_caches)
    assert hidden.shape == (12, CONFIG.hidden_size) and hidden.device.type == "meta"
    with pytest.raises((NotImplementedError, RuntimeError)):
        model(on_meta, kv_caches)  # the general path reads the query lengths on the host
