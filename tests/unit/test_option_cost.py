"""specdec_client.option_cost: every option it measures is an input the ensemble accepts, as the client sends it."""

from __future__ import annotations

from specdec.params import ServerLimits, parse_request
from specdec_client.api import input_array
from specdec_client.option_cost import OPTIONS


def test_every_measured_option_parses_and_changes_the_request():
    for name, extra in OPTIONS.items():
        inputs = {key: input_array(key, value) for key, value in {"max_tokens": 8, **extra}.items()}
        options = parse_request(inputs, ServerLimits())
        changed = (options.logits.active or options.bad_words or options.stop_words or options.logprobs is not None
                   or options.sampling.min_p)
        assert bool(changed) == (name != "none"), name
