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
