"""The dispatch decision: a pure function from a batch to a graph key or eager with a reason."""

import pytest

from graphserving.contract.graph_policy import GraphMode
from graphserving.runtime.graphs.key import (
    FallbackReason,
    GraphKeyContract,
    GraphRuntimeMode,
    configured_keys,
    dispatch,
    full_key,
    piecewise_key,
)

C = GraphKeyContract(model_revision="abc", dtype="float32")
FULL = [1, 2, 4, 8, 16, 24, 32]
PIECE = [1, 2, 4, 8, 16, 32, 64, 128]
ALL = set(configured_keys(GraphMode.FULL_AND_PIECEWISE, FULL, PIECE, C))


def run(tokens, reqs, qlen, mode=GraphMode.FULL_AND_PIECEWISE, captured=ALL):
    return dispatch(
        num_tokens=tokens, num_reqs=reqs, max_query_len=qlen, mode=mode,
        full_sizes=FULL, piecewise_sizes=PIECE, contract=C, captured=captured,
    )


def test_uniform_decode_of_19_pads_to_full_24():
    d = run(19, 19, 1)
    assert d.key == full_key(24, C)
    assert d.runtime_mode is GraphRuntimeMode.FULL


def test_exact_size_needs_no_padding():
    assert run(32, 32, 1).key == full_key(32, C)


def test_prefill_batch_pads_tokens_to_piecewise():
    d = run(100, 3, 64)
    assert d.key == piecewise_key(128, C)


def test_decode_beyond_largest_full_size_uses_piecewise():
    assert run(40, 40, 1).key == piecewise_key(64, C)


def test_too_many_tokens_falls_back_with_reason():
    d = run(129, 2, 100)
    assert d.key is None and d.reason is FallbackReason.TOO_MANY_TOKENS


def test_full_only_mode_runs_prefill_eagerly():
    d = run(100, 3, 64, mode=GraphMode.FULL)
    assert d.key is None and d.reason is FallbackReason.NOT_UNIFORM_DECODE


def test_full_only_mode_too_many_requests():
    d = run(33, 33, 1, mode=GraphMode.FULL_DECODE_ONLY)
    assert d.reason is FallbackReason.TOO_MANY_REQUESTS


def test_mode_none_is_always_eager():
    assert run(1, 1, 1, mode=GraphMode.NONE).reason is FallbackReason.MODE_NONE


def test_uncaptured_key_falls_back_to_piecewise_then_reports_not_captured():
    captured = ALL - {full_key(8, C)}
    assert run(5, 5, 1, captured=captured).key == piecewise_key(8, C)
    d = run(5, 5, 1, mode=GraphMode.FULL, captured=captured)
    assert d.reason is FallbackReason.NOT_CAPTURED


def test_key_of_another_contract_never_matches():
    other = GraphKeyContract(model_revision="def", dtype="float32")
    captured = set(configured_keys(GraphMode.FULL, FULL, [], other))
    assert run(4, 4, 1, mode=GraphMode.FULL, captured=captured).reason is FallbackReason.NOT_CAPTURED


def test_keys_are_captured_largest_first_full_before_piecewise():
    keys = configured_keys(GraphMode.FULL_AND_PIECEWISE, [1, 8], [4, 16], C)
    assert [k.label() for k in keys] == ["full-t8-r8", "full-t1-r1", "piecewise-t16", "piecewise-t4"]


def test_empty_batch_is_an_error():
    with pytest.raises(ValueError):
        run(0, 0, 1)


def test_contract_digest_changes_with_revision():
    assert C.digest() != GraphKeyContract(model_revision="x", dtype="float32").digest()


# ---------------------------------------------------------------------- speculative decoding keys

SPEC = set(configured_keys(GraphMode.FULL_AND_PIECEWISE, FULL, PIECE, C, uniform_query_lens=(1, 3)))


def run_spec(tokens, reqs, qlen, samples=True, captured=SPEC, mode=GraphMode.FULL_AND_PIECEWISE):
    return dispatch(
        num_tokens=tokens, num_reqs=reqs, max_query_len=qlen, mode=mode, full_sizes=FULL,
        piecewise_sizes=PIECE, contract=C, captured=captured, samples_every_row=samples,
        uniform_query_lens=(1, 3),
    )


def test_spec_key_has_k_plus_1_rows_per_request_and_its_own_label():
    key = full_key(8, C, query_len=3)
    assert (key.num_tokens, key.num_reqs, key.uniform_query_len) == (24, 8, 3)
    assert key.label() == "full-t24-r8-q3"
    assert full_key(8, C).label() == "full-t8-r8"


def test_a_query_length_below_one_is_refused():
    with pytest.raises(ValueError, match="query length"):
        full_key(4, C, query_len=0)


def test_spec_workers_capture_both_query_lengths_largest_token_count_first():
    keys = configured_keys(GraphMode.FULL_AND_PIECEWISE, [1, 8], [16], C, uniform_query_lens=(1, 3))
    assert [k.label() for k in keys] == ["full-t24-r8-q3", "full-t8-r8", "full-t3-r1-q3", "full-t1-r1",
                                         "piecewise-t16"]


def test_verification_batch_of_5_requests_pads_to_the_q3_key_of_size_8():
    d = run_spec(15, 5, 3)
    assert d.key == full_key(8, C, query_len=3)
    assert d.runtime_mode is GraphRuntimeMode.FULL


def test_decode_batch_on_a_spec_worker_takes_the_q1_key():
    assert run_spec(5, 5, 1).key == full_key(8, C)


def test_uniform_prefill_whose_rows_do_not_all_sample_is_not_a_spec_batch():
    # 5 prompts of 3 tokens: only the last row of each samples
    assert run_spec(15, 5, 3, samples=False).key == piecewise_key(16, C)


def test_mixed_query_lengths_are_not_uniform():
    # 4 requests, max query length 3, 10 rows: lengths differ
    d = run_spec(10, 4, 3, mode=GraphMode.FULL)
    assert d.key is None and d.reason is FallbackReason.NOT_UNIFORM_DECODE


def test_a_query_length_without_full_keys_falls_back_to_piecewise():
    # q = 2 is uniform, but only q = 1 and q = 3 were captured
    assert run_spec(10, 5, 2).key == piecewise_key(16, C)
    assert run_spec(10, 5, 2, mode=GraphMode.FULL).reason is FallbackReason.NOT_UNIFORM_DECODE


def test_a_worker_without_spec_keys_never_dispatches_a_uniform_batch_of_q3_to_full():
    d = run(15, 5, 3, mode=GraphMode.FULL)
    assert d.key is None and d.reason is FallbackReason.NOT_UNIFORM_DECODE


def test_verification_beyond_the_largest_full_size_pads_its_tokens_to_piecewise():
    assert run_spec(99, 33, 3).key == piecewise_key(128, C)
    assert run_spec(99, 33, 3, mode=GraphMode.FULL).reason is FallbackReason.TOO_MANY_REQUESTS


def test_an_uncaptured_spec_key_reports_not_captured():
    d = run_spec(15, 5, 3, captured=SPEC - {full_key(8, C, 3)}, mode=GraphMode.FULL)
    assert d.reason is FallbackReason.NOT_CAPTURED


def test_a_key_hashes_and_labels_once_and_pickles_without_its_cached_hash():
    """Keys cache their hash and label (asked several times a step); a pickled key (a tensor-parallel
    follower gets rank 0's) carries neither, since string hashes differ between processes."""
    import os
    import pickle
    import subprocess
    import sys

    key = full_key(8, C)
    assert hash(key) == hash(full_key(8, C)) and key.label() == "full-t8-r8" and key.label() is key.label()
    assert {"_hash", "_label"} <= set(key.__dict__)
    copy = pickle.loads(pickle.dumps(key))
    assert copy == key and not {"_hash", "_label"} & set(copy.__dict__)
    # another interpreter (another string-hash seed) finds the unpickled key in its own dict
    code = ("import pickle, sys; from graphserving.runtime.graphs.key import GraphKeyContract, full_key; "
            "k = pickle.loads(bytes.fromhex(sys.stdin.read())); "
            "print({full_key(8, GraphKeyContract(model_revision='abc', dtype='float32')): 'found'}.get(k))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(key).hex(), capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == "found"
