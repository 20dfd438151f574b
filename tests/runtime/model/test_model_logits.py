"""Our model's logits equal the transformers reference loaded from the same weights (float32).

Error measure: max |ours - reference| / max |reference| over the vocabulary, < 1e-4, for the
prefill and for each of 20 decode steps through our paged KV cache (the reference uses its own KV
cache). Decode tokens are the reference's greedy choices, fed to both models.
"""

from __future__ import annotations

import pytest
import torch

from graphserving.runtime.model.loader import load_model

TOLERANCE = 1e-4
DECODE_STEPS = 20


def _compare_prefill_and_decode(ours, reference, prompt, paged_runner, rel_err, **runner_kwargs):
    runner = paged_runner(ours, **runner_kwargs)
    with torch.no_grad():
        ref_out = reference(torch.tensor([prompt]), use_cache=True)
    ref_logits = ref_out.logits[0, -1]
    our_logits = runner.step([("seq", prompt)])[0]
    errors = [rel_err(our_logits, ref_logits)]
    cache = ref_out.cache
    for _ in range(DECODE_STEPS):
        token = int(ref_logits.argmax())
        with torch.no_grad():
            ref_out = reference(torch.tensor([[token]]), cache=cache, use_cache=True)
        cache = ref_out.cache
        ref_logits = ref_out.logits[0, -1]
        our_logits = runner.step([("seq", [token])])[0]
        errors.append(rel_err(our_logits, ref_logits))
    return errors


@pytest.mark.slow
def test_smollm2_prefill_and_20_decode_steps_match_transformers(smollm2, smollm2_reference, paged_runner, rel_err):
    prompt = smollm2.tokenizer.encode(
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colours."}])
    )
    errors = _compare_prefill_and_decode(smollm2.model, smollm2_reference, prompt, paged_runner, rel_err)
    assert len(errors) == 1 + DECODE_STEPS
    assert max(errors) < TOLERANCE, f"relative logit errors per step: {errors}"


@pytest.mark.parametrize("variant", ["llama3_rope", "llama_linear_rope", "mistral", "qwen2_bias",
                                     "tied_embeddings", "qwen2_yarn", "qwen3", "qwen3_moe", "qwen3_moe_softmax"])
def test_tiny_random_variant_matches_transformers(variant, tiny_model_dir, paged_runner, rel_err):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(variant)
    ours = load_model(path, revision=None, dtype=torch.float32, device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # Long enough that llama3 / yarn scaling (original context 32 / 64) affects the positions used.
    prompt = [(i * 7919) % ours.config.vocab_size for i in range(3, 60)]
    errors = _compare_prefill_and_decode(ours.model, reference, prompt, paged_runner, rel_err, block_size=8)
    assert max(errors) < TOLERANCE, f"relative logit errors per step: {errors}"


def test_piecewise_segments_compose_to_forward(tiny_model_dir, paged_runner):
    loaded = load_model(tiny_model_dir("qwen2_bias"), None, torch.float32, "cpu")
    model = loaded.model
    eager, piecewise = paged_runner(model, seed=1), paged_runner(model, seed=1)
    meta = eager.metadata([("a", [5, 6, 7, 8, 9]), ("b", [10, 11])])
    piecewise.metadata([("a", [5, 6, 7, 8, 9]), ("b", [10, 11])])  # same slots in its own cache
    with torch.inference_mode():
        expected = model(meta, eager.kv_caches)
        outs = model.run_segment(0, meta.input_ids, meta.positions, None, None)
        for i in range(model.num_segments - 1):
            q, k, v, residual = outs
            attn = model.run_attention(i, q, k, v, meta, piecewise.kv_caches[i])
            outs = model.run_segment(i + 1, meta.input_ids, meta.positions, attn, residual)
    assert model.num_segments == loaded.config.num_hidden_layers + 1
    assert len(outs) == 1
    assert torch.equal(outs[0], expected)
    assert all(torch.equal(a, b) for a, b in zip(eager.kv_caches, piecewise.kv_caches))


def test_padded_decode_rows_do_not_change_real_rows(tiny_model_dir, paged_runner):
    model = load_model(tiny_model_dir("llama3_rope"), None, torch.float32, "cpu").model
    plain, padded = paged_runner(model, seed=3), paged_runner(model, seed=3)
    for runner in (plain, padded):
        runner.step([("a", [3, 4, 5, 6, 7, 8]), ("b", [9, 10, 11])])
    expected = plain.step([("a", [12]), ("b", [13])])
    got = padded.step([("a", [12]), ("b", [13])], pad_reqs=3)
    # Not bitwise: BLAS may block a 5-row matmul differently from a 2-row one.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_stacked_expert_tensors_load_like_the_checkpoints_one_by_one_layout(tiny_model_dir):
    """transformers 5 holds a MoE layer's experts stacked ([E, 2I, H], [E, H, I]); its in-memory
    state dict loads to exactly the parameters the saved checkpoint (one tensor per expert) gives."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("qwen3_moe")
    from_checkpoint = load_model(path, revision=None, dtype=torch.float32, device="cpu").model
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    state = reference.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # the stacked layout is what we test
    from_stacked = load_model(path, revision=None, dtype=torch.float32, device="cpu").model
    for p in from_stacked.parameters():
        p.data.zero_()
    from_stacked.load_weights(state)
    for (name, a), (_, b) in zip(from_stacked.named_parameters(), from_checkpoint.named_parameters()):
        assert torch.equal(a, b), name


def test_compute_logits_writes_into_a_given_buffer(tiny_model_dir):
    """``out=`` (a FULL graph's static logits buffer): the same float32 logits, written in place."""
    model = load_model(tiny_model_dir("llama3_rope"), None, torch.float32, "cpu").model
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    buffer = torch.zeros(5, model.config.vocab_size)
    got = model.compute_logits(hidden, out=buffer[:3])
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(buffer[:3], model.compute_logits(hidden))
    assert buffer[3:].eq(0).all()
