"""The ensemble contract that TensorRT-LLM's clients and Triton's OpenAI frontend rely on (no server)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import yaml
from specdec.params import ServerLimits, parse_request
from specdec_triton import contract as c

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "build"))

import render_configs  # noqa: E402


def names(specs) -> set[str]:
    return {spec.name for spec in specs}


def test_the_ensemble_declares_what_those_clients_send_and_read():
    sent = {"text_input", "max_tokens", "stream", "beam_width", "temperature", "exclude_input_in_output",
            "num_return_sequences", "stop_words", "bad_words", "top_p", "seed", "frequency_penalty",
            "presence_penalty", "repetition_penalty", "return_num_input_tokens", "return_num_output_tokens"}
    assert sent <= names(c.PUBLIC_INPUTS)
    read = {"text_output", "batch_index", "sequence_index", "num_input_tokens", "num_output_tokens",
            "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"}
    assert read <= names(c.PUBLIC_OUTPUTS)
    assert c.TEXT_OUTPUT.dims == (-1,)  # flattened, as TensorRT-LLM's postprocessing returns it


def test_return_num_output_tokens_switches_to_per_response_counts():
    base = {"max_tokens": np.array([[4]], np.int32)}
    assert not parse_request(base, ServerLimits()).output_tokens_per_response
    flagged = {**base, "return_num_output_tokens": np.array([[True]])}
    assert parse_request(flagged, ServerLimits()).output_tokens_per_response


def test_the_deployment_sets_the_echo_default():
    request = {"max_tokens": np.array([[4]], np.int32)}
    assert not parse_request(request, ServerLimits()).exclude_input_in_output
    assert parse_request(request, ServerLimits(exclude_input_in_output=True)).exclude_input_in_output
    explicit = {**request, "exclude_input_in_output": np.array([[False]])}
    assert not parse_request(explicit, ServerLimits(exclude_input_in_output=True)).exclude_input_in_output

    deployment = yaml.safe_load((REPO / "build" / "deployments" / "cpu.yaml").read_text())
    params = render_configs.speculative_config(deployment).parameters
    assert params["default_exclude_input_in_output"].string_value == "false"
    deployment["request_defaults"] = {"exclude_input_in_output": True}
    params = render_configs.speculative_config(deployment).parameters
    assert params["default_exclude_input_in_output"].string_value == "true"


def test_tensorrt_llm_sampling_semantics():
    """top_k 0 and top_p 0 (or absent) are greedy search whatever the temperature; either set samples at the
    temperature (1.0 when absent); runtime_top_k / runtime_top_p are the same inputs under TensorRT-LLM's other
    names, and two disagreeing values are refused naming them."""
    import pytest
    from specdec.errors import InvalidRequestError
    from specdec.params import parse_sampling

    def sampling(**values: float):
        return parse_sampling({name: np.array([[value]]) for name, value in values.items()})

    assert sampling(temperature=1.0).greedy  # what end_to_end_grpc_client.py sends by default
    assert sampling(temperature=0.7, top_k=0, top_p=0.0).greedy
    assert sampling(temperature=0.0, top_p=0.9).greedy  # temperature 0 is greedy too
    assert sampling().greedy
    by_p = sampling(temperature=0.7, top_p=0.95)
    assert (by_p.greedy, by_p.temperature, by_p.top_k, by_p.top_p) == (False, 0.7, 0, 0.95)
    by_k = sampling(runtime_top_k=40)
    assert (by_k.greedy, by_k.temperature, by_k.top_k, by_k.top_p) == (False, 1.0, 40, 1.0)
    assert sampling(runtime_top_p=0.5, top_p=0.5).top_p == 0.5  # the same value under both names
    with pytest.raises(InvalidRequestError, match="runtime_top_p"):
        sampling(top_p=0.5, runtime_top_p=0.9)
    with pytest.raises(InvalidRequestError, match="top_p"):
        sampling(top_p=1.5)
    assert {"runtime_top_k", "runtime_top_p"} <= names(c.PUBLIC_INPUTS)
