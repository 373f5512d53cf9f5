"""A repository that leaves its drafter models out: a deployment that drafts only with the EAGLE head can
drop the standalone draft model (and its process's memory); here, with the 12M fixture pair (no EAGLE head)
and no draft model either, the server speculates by prompt lookup alone, refuses requests for a drafter model
it does not load with a clear error, and its greedy output stays equal to plain decoding's."""

from __future__ import annotations

import pytest
from repositories import build_repository, cpu_deployment
from specdec_client.api import GenerationError, generate_grpc
from specdec_client.scrape import scrape
from specdec_client.server import TritonServer, free_port

pytestmark = pytest.mark.integration
LEFT_OUT = ("draft_model",)  # the fixture pair has no EAGLE head either: no drafter model at all


@pytest.fixture(scope="module")
def lookup_only_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("no_draft_repo")
    repository = build_repository(root / "repo", cpu_deployment(), LEFT_OUT)
    server = TritonServer(model_repository=repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), log_file=root / "server.log")
    server.start(timeout_s=240)
    yield server
    server.stop()


def test_the_server_loads_no_drafter_model(lookup_only_server: TritonServer):
    repository = lookup_only_server.model_repository
    assert not (repository / "draft_model").exists() and not (repository / "eagle_draft").exists()
    metrics = scrape(lookup_only_server.metrics_url)
    assert metrics.total("specdec_unique_memory_bytes", model="target_model") > 0
    for drafter_model in ("draft_model", "eagle_draft"):
        assert metrics.total("specdec_unique_memory_bytes", model=drafter_model) == 0


def test_profiles_draft_by_prompt_lookup_and_greedy_output_equals_plain(lookup_only_server: TritonServer):
    prompt = "The cat sat on the mat. The dog sat on the log. The cat sat on the"
    url = lookup_only_server.grpc_url
    plain = generate_grpc(url, {"text_input": prompt, "max_tokens": 48, "num_draft_tokens": 0})
    speculative = generate_grpc(url, {"text_input": prompt, "max_tokens": 48, "task": "text"})
    assert speculative.text == plain.text
    assert speculative.drafter_used == "ngram"
    assert speculative.stats["total_draft_tokens"] > 0  # the profile speculated, by prompt lookup


@pytest.mark.parametrize("drafter", ["model", "model+ngram", "eagle"])
def test_a_request_for_a_drafter_model_not_loaded_gets_a_clear_error(lookup_only_server: TritonServer,
                                                                    drafter: str):
    with pytest.raises(GenerationError, match="not served here"):
        generate_grpc(lookup_only_server.grpc_url, {"text_input": "Hello", "max_tokens": 8, "drafter": drafter})
    ok = generate_grpc(lookup_only_server.grpc_url, {"text_input": "Hello", "max_tokens": 8, "drafter": "ngram"})
    assert ok.num_output_tokens == 8
