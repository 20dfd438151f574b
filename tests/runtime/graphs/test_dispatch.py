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
