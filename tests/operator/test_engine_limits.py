"""Engine limits have maxima: the worker contract, the GraphServing API and the API server refuse
larger values, naming the field (issue 19: ``maxNumSeqs: 100000`` was accepted and the worker was
killed for memory in warm-up)."""

from __future__ import annotations

import json

import pydantic
import pytest
from op_helpers import spec_dict

from graphserving.contract import graphserving_types as api
from graphserving.contract.worker_config import (
    MAX_BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS_LIMIT,
    MAX_NUM_SEQS_LIMIT,
    EngineLimits,
)
from graphserving.operator import crd


def _worker_error(**fields) -> str:
    with pytest.raises(pydantic.ValidationError) as info:
        EngineLimits(**fields)
    return str(info.value)


def test_the_maxima_are_the_documented_values():
    assert (MAX_NUM_SEQS_LIMIT, MAX_NUM_BATCHED_TOKENS_LIMIT, MAX_BLOCK_SIZE) == (4096, 131072, 256)


def test_the_worker_contract_refuses_limits_above_their_maxima_naming_the_field():
    assert "max_num_seqs\n  Input should be less than or equal to 4096" in _worker_error(
        max_num_seqs=100000, max_num_batched_tokens=100000)
    assert "max_num_batched_tokens\n  Input should be less than or equal to 131072" in _worker_error(
        max_num_batched_tokens=131073)
    assert "block_size\n  Input should be less than or equal to 256" in _worker_error(block_size=512)


def test_the_worker_contract_accepts_every_maximum():
    limits = EngineLimits(max_num_seqs=4096, max_num_batched_tokens=131072, block_size=256)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens, limits.block_size) == (4096, 131072, 256)


def test_the_graphserving_api_refuses_a_max_num_seqs_above_its_maximum_naming_the_camel_case_field():
    with pytest.raises(pydantic.ValidationError) as info:
        api.GraphServingSpec.model_validate(
            spec_dict(runtime={"engine": {"maxNumSeqs": 100000, "maxNumBatchedTokens": 100000}}))
    assert "runtime.engine.maxNumSeqs\n  Input should be less than or equal to 4096" in str(info.value)


def test_the_crd_schema_carries_the_maxima():
    engine = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "runtime"]["properties"]["engine"]["properties"]
    assert engine["maxNumSeqs"]["maximum"] == 4096
    assert engine["maxNumBatchedTokens"]["maximum"] == 131072
    assert engine["blockSize"]["maximum"] == 256


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("engine", "field", "maximum"),
    [
        ({"maxNumSeqs": 100000, "maxNumBatchedTokens": 100000}, "spec.runtime.engine.maxNumSeqs", 4096),
        ({"maxNumBatchedTokens": 1000000}, "spec.runtime.engine.maxNumBatchedTokens", 131072),
        ({"blockSize": 1024}, "spec.runtime.engine.blockSize", 256),
    ],
    ids=["max-num-seqs", "max-num-batched-tokens", "block-size"],
)
def test_the_api_server_rejects_engine_limits_above_their_maxima_naming_the_field(
    custom, namespace, tmp_path, engine, field, maximum
):
    from kubernetes.client.rest import ApiException
    from op_cluster import create_gs, standin_spec

    spec = standin_spec(tmp_path)
    spec["runtime"]["engine"] = engine
    with pytest.raises(ApiException) as info:
        create_gs(custom, namespace, "too-large", spec)
    message = json.loads(info.value.body)["message"]
    assert info.value.status == 422
    assert f"{field}: Invalid value" in message and f"should be less than or equal to {maximum}" in message
