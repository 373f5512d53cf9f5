"""Write tests/data/hostile_requests.jsonl, the hostile-input corpus (replayed by test_hostile_inputs.py).

One JSON object per line:
  id         unique name, "<transport>/<what>/<case>"
  kind       the family of the fault (range, type, shape, missing, encoding, size, unsupported, malformed, ...)
  transport  "http" (JSON body to /v2/models/<model>/generate), "http_raw" (raw bytes to the same endpoint),
             "grpc" (a gRPC stream to a decoupled model), "grpc_infer" (unary gRPC to a non-decoupled model)
  model      ensemble | speculative_decoding | target_model | draft_model
  body / raw / inputs   the request; a value {"$repeat": [unit, count]} stands for unit * count (10 MB bodies
             stay out of the file); "raw_b64" is raw bytes in base64; gRPC inputs are
             {"name", "datatype", "shape", "data"} or {..., "data_b64": [...]} for BYTES
  sequence   (grpc_infer) {"id", "start", "end"} sequence-batcher controls
  expect     outcome "rejected" (our validation: HTTP 400 / an error naming `field`), "frontend" (Triton 2.51's
             own HTTP front end answers: its status and message, see docs/SECURITY.md), "core" (Triton's core
             rejects before any model runs, naming `field`), or "ok" (accepted under the documented `policy`)

Regenerate with `python tests/reliability/make_hostile_corpus.py` (deterministic; the test checks the file is fresh).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "data" / "hostile_requests.jsonl"
BASE = {"text_input": "def add(a, b):", "max_tokens": 4}
TEN_MB = 10 * 1024 * 1024
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
OUT_OF_VOCAB = (-1, 1_000_000, INT32_MAX)


def rejected(field: str, status: int = 400) -> dict:
    return {"outcome": "rejected", "field": field, "http_status": status}


def frontend(message: str, status: int = 500) -> dict:
    return {"outcome": "frontend", "message": message, "http_status": status}


def core(field: str, message: str = "") -> dict:
    return {"outcome": "core", "field": field, "message": message, "http_status": 400}


def ok(policy: str) -> dict:
    return {"outcome": "ok", "policy": policy}


def http(case_id: str, kind: str, body: dict, expect: dict, model: str = "ensemble") -> dict:
    return {"id": f"http/{case_id}", "kind": kind, "transport": "http", "model": model, "body": body,
            "expect": expect}


def raw(case_id: str, kind: str, data: bytes | str | list, expect: dict,
        content_type: str = "application/json") -> dict:
    """`data` as bytes, text, or a list of [unit, count] parts (kept compact: {"$concat": parts})."""
    entry = {"id": f"http_raw/{case_id}", "kind": kind, "transport": "http_raw", "model": "ensemble",
             "content_type": content_type, "expect": expect}
    if isinstance(data, bytes):
        entry["raw_b64"] = base64.b64encode(data).decode()
    elif isinstance(data, list):
        entry["raw"] = {"$concat": data}
    else:
        entry["raw"] = data
    return entry


def tensor(name: str, datatype: str, value: Any, shape: list[int] | None = None) -> dict:
    """A gRPC input; scalars get the contract's [1, 1] shape."""
    values = value if isinstance(value, list) else [value]
    shape = shape if shape is not None else [1, 1]
    if datatype == "BYTES":
        if isinstance(value, dict):  # {"$repeat": [unit, count]}: expanded by the replayer
            return {"name": name, "datatype": datatype, "shape": shape, "data": [value]}
        return {"name": name, "datatype": datatype, "shape": shape,
                "data_b64": [base64.b64encode(v if isinstance(v, bytes) else v.encode()).decode() for v in values]}
    return {"name": name, "datatype": datatype, "shape": shape, "data": values}


GOOD_GRPC = [tensor("text_input", "BYTES", "def add(a, b):"), tensor("max_tokens", "INT32", 4)]


def grpc(case_id: str, kind: str, inputs: list[dict], expect: dict, model: str = "ensemble") -> dict:
    return {"id": f"grpc/{model}/{case_id}", "kind": kind, "transport": "grpc", "model": model, "inputs": inputs,
            "expect": expect}


def with_input(inputs: list[dict], replacement: dict) -> list[dict]:
    return [t for t in inputs if t["name"] != replacement["name"]] + [replacement]


def http_cases() -> Iterator[dict]:
    for value in (0, -1, -100, 8193, 10**6, INT32_MAX, INT32_MIN, 2**31):  # 8193: over limits.max_tokens
        # 2**31 wraps to INT32_MIN in Triton's JSON-to-INT32 conversion: still named and rejected.
        yield http(f"max_tokens/{value}", "range", {**BASE, "max_tokens": value}, rejected("max_tokens"))
    for label, value in (("float", 1.5), ("string", "8"), ("word", "eight"), ("bool", True), ("null", None),
                         ("object", {"v": 8}), ("huge_float", 1e300), ("empty_list", [])):
        yield http(f"max_tokens/type_{label}", "type", {**BASE, "max_tokens": value},
                   frontend("Unable to parse 'data'") if label != "empty_list"
                   else core("max_tokens", "batch size does not match"))
    for label, value in (("list", [4]), ("nested_list", [[4]])):
        yield http(f"max_tokens/{label}", "shape", {**BASE, "max_tokens": value},
                   ok("a JSON list is tensor data: [4] and [[4]] are the value 4"))
    yield http("missing/max_tokens", "missing", {"text_input": "hi"}, core("max_tokens", "missing required input"))
    yield http("missing/text_input", "missing", {"max_tokens": 4}, core("text_input", "missing required input"))
    yield http("missing/everything", "missing", {}, core("text_input", "missing required input"))

    yield http("text_input/empty", "empty", {**BASE, "text_input": ""}, rejected("text_input"))
    yield http("text_input/over_64KiB", "size", {**BASE, "text_input": {"$repeat": ["a", 65537]}},
               rejected("text_input"))
    yield http("text_input/10MB", "size", {**BASE, "text_input": {"$repeat": ["x", TEN_MB]}}, rejected("text_input"))
    yield http("text_input/10MB_multibyte", "size", {**BASE, "text_input": {"$repeat": ["\u00e9", TEN_MB // 2]}},
               rejected("text_input"))
    for words in (2500, 5000, 9000):  # beyond the fixture pair's 2,048-token context, under 64 KiB
        yield http(f"text_input/beyond_context_{words}_words", "context",
                   {**BASE, "text_input": {"$repeat": ["hello ", words]}}, rejected("max_tokens"))
    yield http("text_input/fits_but_max_tokens_does_not", "context",
               {"text_input": {"$repeat": ["hello ", 300]}, "max_tokens": 1900}, rejected("max_tokens"))
    for label, text in (("nul", "a\u0000b"), ("escape_sequences", "\u001b[31mred\u001b[0m"), ("bell", "\u0007" * 8),
                        ("only_nul", "\u0000"), ("crlf", "line\r\nline\r\n"), ("tabs", "\t\t\t"),
                        ("del", "\u007f\u007f"), ("c1_controls", "\u0085\u009b"), ("bidi_override", "\u202eabc"),
                        ("zero_width", "a\u200bb\u200dc\ufeff"), ("whitespace_only", "   "),
                        ("emoji", "\U0001f600 \U0001f680"), ("cjk", "\u4f60\u597d\u4e16\u754c"),
                        ("combining", "e\u0301\u0301\u0301"), ("private_use", "\ue000\U000f0000"),
                        ("noncharacter", "\ufffe\uffff"), ("replacement_char", "\ufffd" * 4)):
        yield http(f"text_input/{label}", "encoding", {**BASE, "text_input": text},
                   ok("any valid UTF-8 text is a prompt; control characters are ordinary tokens"))
    for label, text in (("lone_high_surrogate", "\ud800"), ("reversed_surrogates", "\udc00\ud800")):
        yield http(f"text_input/{label}", "encoding", {**BASE, "text_input": text},
                   frontend("failed to parse the request JSON"))
    # Triton's parser lets a lone low surrogate through as bytes that are not UTF-8: preprocessing rejects them.
    yield http("text_input/lone_low_surrogate", "encoding", {**BASE, "text_input": "\udfff"}, rejected("text_input"))
    for label, value in (("number", 5), ("bool", True), ("null", None), ("object", {"a": 1})):
        yield http(f"text_input/type_{label}", "type", {**BASE, "text_input": value},
                   frontend("Unable to parse JSON bytes array"))
    yield http("text_input/two_prompts", "shape", {**BASE, "text_input": ["a", "b"]},
               core("max_tokens", "batch size does not match"))
    yield http("text_input/two_prompts_two_lengths", "shape", {"text_input": ["a", "b"], "max_tokens": [4, 4]},
               rejected("text_input"))

    for value in (-1, -0.001, -1e30, math.nan, math.inf, -math.inf, 1e39):
        yield http(f"temperature/{value}", "range", {**BASE, "temperature": value}, rejected("temperature"))
    yield http("temperature/string", "type", {**BASE, "temperature": "hot"}, frontend("Unable to parse 'data'"))
    for value in (-0.1, 1.0001, 2, 1e10, math.nan, -math.inf):  # 0 is valid: no nucleus (TensorRT-LLM)
        yield http(f"top_p/{value}", "range", {**BASE, "top_p": value}, rejected("top_p"))
    for value in (-1, INT32_MIN, 2**30 + 1, INT32_MAX):
        yield http(f"top_k/{value}", "range", {**BASE, "top_k": value}, rejected("top_k"))

    for value in ("poetry", "JSON", " json", "json\u0000", "a" * 1000, "\U0001f642", "auto;drop table", "code\n"):
        yield http(f"task/{value[:24]!r}", "choice", {**BASE, "task": value}, rejected("task"))
    yield http("task/empty", "choice", {**BASE, "task": ""}, ok("an empty task means the default, auto"))
    for value in ("bogus", "GREEDY", "greedy ", "a" * 1000, "\u0001", "lossless"):
        yield http(f"acceptance/{value[:24]!r}", "choice", {**BASE, "acceptance": value}, rejected("acceptance"))
    yield http("acceptance/empty", "choice", {**BASE, "acceptance": ""}, ok("an empty acceptance means greedy"))

    for value in (-1, INT32_MIN, 17, 100, INT32_MAX):
        yield http(f"num_draft_tokens/{value}", "range", {**BASE, "num_draft_tokens": value},
                   rejected("num_draft_tokens"))
    for value in (0, -1, 9, 1000, INT32_MAX):
        yield http(f"num_candidates/{value}", "range", {**BASE, "num_candidates": value}, rejected("num_candidates"))
    for value in (2, 8, 0, -1):
        yield http(f"beam_width/{value}", "unsupported", {**BASE, "beam_width": value}, rejected("beam_width"))
    for value in (2, 0):
        yield http(f"num_return_sequences/{value}", "unsupported", {**BASE, "num_return_sequences": value},
                   rejected("num_return_sequences"))
    for name in ("return_context_logits", "return_generation_logits"):
        yield http(f"{name}/true", "unsupported", {**BASE, name: True}, rejected(name))
    yield http("return_log_probs/true", "range", {**BASE, "return_log_probs": True},
               ok("log-probabilities are returned"))
    for value in (-0.1, 1.5, math.nan):
        yield http(f"min_p/{value}", "range", {**BASE, "temperature": 0.7, "top_p": 0.9, "min_p": value},
                   rejected("min_p"))
    for value in (-1, 21, INT32_MAX):
        yield http(f"num_top_log_probs/{value}", "range", {**BASE, "return_log_probs": True,
                                                           "num_top_log_probs": value}, rejected("num_top_log_probs"))
    for name, value in (("guided_decoding_guide", "(unclosed"), ("guided_decoding_guide", "[a-")):
        yield http(f"guided_regex/{value}", "range", {**BASE, "guided_decoding_guide_type": "regex", name: value},
                   rejected(name))
    yield http("guided_json_schema/not_json", "range",
               {**BASE, "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{"},
               rejected("guided_decoding_guide"))
    yield http("guided_type/xml", "range", {**BASE, "guided_decoding_guide_type": "xml"},
               rejected("guided_decoding_guide_type"))
    for name, value in (("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.nan),
                        ("presence_penalty", 1e9), ("frequency_penalty", -1e9), ("frequency_penalty", math.inf)):
        yield http(f"{name}/{value}", "range", {**BASE, name: value}, rejected(name))
    for name, value in (("repetition_penalty", 1.5), ("presence_penalty", -0.5), ("frequency_penalty", 1.0)):
        yield http(f"{name}/{value}", "range", {**BASE, name: value}, ok("a penalty reshapes the logits"))
    yield http("length_penalty/2.0", "unsupported", {**BASE, "length_penalty": 2.0}, rejected("length_penalty"))
    for name, value in (("stop_words", ["x"]), ("stop_words", ["a", "b", "c"]), ("bad_words", ["y"])):
        yield http(f"{name}/{len(value)}", "range", {**BASE, name: value}, ok(f"{name} are honoured"))
    yield http("bad_words/empty", "range", {**BASE, "bad_words": [""]}, ok("empty words are ignored"))
    yield http("bad_words/too_many", "size", {**BASE, "bad_words": [f"w{i}" for i in range(65)]},
               rejected("bad_words"))
    yield http("logit_bias/unpaired", "range", {**BASE, "logit_bias_ids": [1, 2], "logit_bias_values": [1.0]},
               rejected("logit_bias_values"))
    yield http("logit_bias/beyond_vocabulary", "range", {**BASE, "logit_bias_ids": [INT32_MAX],
                                                         "logit_bias_values": [1.0]}, rejected("logit_bias_ids"))
    for value in (-2, INT32_MIN):
        yield http(f"end_id/{value}", "range", {**BASE, "end_id": value}, rejected("end_id"))
    yield http("end_id/beyond_vocabulary", "range", {**BASE, "end_id": INT32_MAX},
               ok("an end_id no token can match never stops the generation; max_tokens does"))
    for value in (-1, 5000):
        yield http(f"min_length/{value}", "range", {**BASE, "min_length": value}, rejected("min_length"))
    for label, value in (("negative", -1), ("too_big", 2**64), ("string", "x")):
        yield http(f"seed/{label}", "type", {**BASE, "seed": value}, frontend("Unable to parse 'data'"))
    for name, value in (("stream", "yes"), ("stream", 1), ("exclude_input_in_output", "no")):
        yield http(f"{name}/type_{type(value).__name__}", "type", {**BASE, name: value},
                   frontend("Unable to parse 'data'"))
    yield http("stream/true_on_generate", "protocol", {**BASE, "stream": True},
               frontend("generate expects model to produce exactly 1 response", status=200))

    for label, value in (("int", 1), ("string", "bar"), ("bool", True)):
        yield http(f"unknown_field/{label}", "unknown", {**BASE, "foo": value},
                   ok("an unknown JSON key is a request parameter, which no model reads"))
    yield http("unknown_field/object", "unknown", {**BASE, "foo": {"a": 1}},
               frontend("parameter 'foo' has invalid type", status=400))
    yield http("unknown_field/10MB_string", "size", {**BASE, "padding": {"$repeat": [" ", TEN_MB]}},
               ok("tritonserver 2.51 has no HTTP body limit: cap bodies in the proxy (docs/SECURITY.md)"))
    yield http("model/not_there", "routing", BASE, frontend("Request for unknown model", status=404),
               model="no_such_model")


def raw_cases() -> Iterator[dict]:
    parse = frontend("failed to parse the request JSON")
    for label, data in (("open_brace", "{"), ("empty", ""), ("unterminated_string", '{"text_input": "hi'),
                        ("missing_value", '{"text_input": }'),
                        ("trailing_comma", '{"text_input": "hi", "max_tokens": 4,}'),
                        ("single_quotes", "{'text_input': 'hi', 'max_tokens': 4}"),
                        ("comment", '{"text_input": "hi", /* c */ "max_tokens": 4}'),
                        ("trailing_garbage", '{"text_input": "hi", "max_tokens": 4} trailing'),
                        ("two_documents", '{"max_tokens": 4}{"max_tokens": 4}'), ("bare_word", "hello"),
                        ("hex_number", '{"text_input": "hi", "max_tokens": 0x10}'),
                        ("leading_zero", '{"text_input": "hi", "max_tokens": 04}'),
                        ("unquoted_key", '{text_input: "hi", max_tokens: 4}'),
                        ("bad_escape", '{"text_input": "\\q", "max_tokens": 4}'),
                        ("raw_newline_in_string", '{"text_input": "a\nb", "max_tokens": 4}')):
        yield raw(f"malformed/{label}", "malformed", data, parse)
    for label, data in (("array", "[]"), ("null", "null"), ("number", "1"), ("string", '"str"'),
                        ("nested_arrays_1000", [["[", 1000], ["]", 1000]]),
                        # tritonserver 2.51 parses recursively: 150000 levels crash it on an 8 MiB stack; the
                        # launcher's 64 MiB stack (specdec_client.server) must survive them.
                        ("nested_arrays_150000", [["[", 150_000], ["]", 150_000]])):
        yield raw(f"not_an_object/{label}", "malformed", data, frontend("attempt to get members for non-object"))
    yield raw("nested_objects_150000", "malformed", [['{"a":', 150_000], ["1", 1], ["}", 150_000]],
              frontend("parameter 'a' has invalid type", status=400))
    body = json.dumps(BASE)
    yield raw("binary/garbage", "malformed", bytes(range(256)), parse)
    yield raw("binary/utf16", "encoding", body.encode("utf-16"), parse)
    yield raw("binary/invalid_utf8_in_string", "encoding", b'{"text_input": "\xff\xfe", "max_tokens": 4}',
              rejected("text_input"))
    yield raw("binary/utf8_bom", "encoding", b"\xef\xbb\xbf" + body.encode(),
              ok("a UTF-8 byte-order mark before the JSON is skipped"))
    yield raw("duplicate_keys", "malformed", '{"text_input": "hi", "max_tokens": 4, "max_tokens": 0}',
              rejected("max_tokens"))
    yield raw("nan_literal", "range", '{"text_input": "hi", "max_tokens": 4, "temperature": NaN}',
              rejected("temperature"))
    yield raw("content_type/text_plain", "protocol", body, ok("the body is JSON whatever the Content-Type says"),
              content_type="text/plain")
    yield raw("content_type/form", "protocol", "text_input=hi&max_tokens=4", parse,
              content_type="application/x-www-form-urlencoded")
    yield raw("max_tokens/1MB_of_digits", "size", [['{"text_input": "hi", "max_tokens": ', 1], ["9", 1_000_000],
                                                    ["}", 1]],
              frontend("failed to parse the request JSON"))


def grpc_cases() -> Iterator[dict]:
    for dtype, value in (("FP32", 8.5), ("FP64", 8.0), ("INT64", 8), ("INT16", 8), ("UINT32", 8), ("BOOL", True),
                         ("BYTES", "8")):
        yield grpc(f"max_tokens/dtype_{dtype}", "type", with_input(GOOD_GRPC, tensor("max_tokens", dtype, value)),
                   core("max_tokens", "data-type is"))
    for dtype, value in (("INT32", 7), ("FP32", 1.0), ("BOOL", True)):
        yield grpc(f"text_input/dtype_{dtype}", "type", with_input(GOOD_GRPC, tensor("text_input", dtype, value)),
                   core("text_input", "data-type is"))
    for name, dtype, value in (("stream", "INT32", 1), ("temperature", "FP64", 0.0), ("num_draft_tokens", "INT64", 4),
                               ("task", "INT32", 1), ("seed", "INT64", 1)):
        yield grpc(f"{name}/dtype_{dtype}", "type", GOOD_GRPC + [tensor(name, dtype, value)],
                   core(name, "data-type is"))
    yield grpc("text_input/shape_1x2", "shape",
               with_input(GOOD_GRPC, tensor("text_input", "BYTES", ["a", "b"], [1, 2])), rejected("text_input"))
    yield grpc("batch_of_2", "shape", [tensor("text_input", "BYTES", ["a", "b"], [2, 1]),
                                       tensor("max_tokens", "INT32", [4, 4], [2, 1])], rejected("text_input"))
    yield grpc("batch_of_65", "shape", [tensor("text_input", "BYTES", ["a"] * 65, [65, 1]),
                                        tensor("max_tokens", "INT32", [4] * 65, [65, 1])],
               core("ensemble", "batch-size must be <= 64"))
    yield grpc("text_input/shape_no_batch", "shape",
               with_input(GOOD_GRPC, tensor("text_input", "BYTES", ["a"], [1])), core("text_input"))
    yield grpc("text_input/shape_1x1x1", "shape",
               with_input(GOOD_GRPC, tensor("text_input", "BYTES", ["a"], [1, 1, 1])), core("text_input"))
    yield grpc("text_input/empty_batch", "shape",
               [tensor("text_input", "BYTES", [], [0, 1]), tensor("max_tokens", "INT32", [], [0, 1])],
               core("max_tokens", "byte size mismatch"))
    yield grpc("max_tokens/shape_1x2", "shape", with_input(GOOD_GRPC, tensor("max_tokens", "INT32", [4, 4], [1, 2])),
               core("max_tokens"))
    yield grpc("missing/max_tokens", "missing", GOOD_GRPC[:1], core("max_tokens", "missing required input"))
    yield grpc("missing/text_input", "missing", GOOD_GRPC[1:], core("text_input", "missing required input"))
    yield grpc("missing/everything", "missing", [], core("text_input", "missing required input"))
    yield grpc("unknown_input", "unknown", GOOD_GRPC + [tensor("foo", "INT32", 1)], core("foo"))
    for label, data in (("lone_continuation", b"\x80"), ("ff_fe", b"\xff\xfe bad"), ("truncated_2byte", b"\xc3"),
                        ("bad_continuation", b"\xc3\x28"), ("overlong_slash", b"\xc0\xaf"),
                        ("surrogate_cesu", b"\xed\xa0\x80"), ("truncated_3byte", b"ok \xe2\x82"),
                        ("beyond_unicode", b"\xf4\x90\x80\x80"), ("latin1", "caf\u00e9".encode("latin-1"))):
        yield grpc(f"text_input/invalid_utf8_{label}", "encoding",
                   with_input(GOOD_GRPC, tensor("text_input", "BYTES", data)), rejected("text_input"))
    for name in ("task", "acceptance"):
        yield grpc(f"{name}/invalid_utf8", "encoding", GOOD_GRPC + [tensor(name, "BYTES", b"\xff")], rejected(name))
    yield grpc("text_input/nul_bytes", "encoding", with_input(GOOD_GRPC, tensor("text_input", "BYTES", b"a\x00b\x00")),
               ok("NUL is a character like any other"))
    for name, value in (("temperature", "nan"), ("temperature", "inf"), ("top_p", "nan"), ("top_p", "-inf"),
                        ("verify_threshold", "nan"), ("verify_threshold", "inf")):
        yield grpc(f"{name}/{value}", "range", GOOD_GRPC + [tensor(name, "FP32", value)], rejected(name))
    yield grpc("text_input/over_64KiB", "size",
               with_input(GOOD_GRPC, tensor("text_input", "BYTES", {"$repeat": ["a", 65537]})), rejected("text_input"))
    yield grpc("text_input/10MB", "size",
               with_input(GOOD_GRPC, tensor("text_input", "BYTES", {"$repeat": ["z", TEN_MB]})), rejected("text_input"))
    for value in (0, -7, 8193, INT32_MAX):
        yield grpc(f"max_tokens/{value}", "range", with_input(GOOD_GRPC, tensor("max_tokens", "INT32", value)),
                   rejected("max_tokens"))
    for name, value in (("num_draft_tokens", 17), ("num_candidates", 0), ("beam_width", 4), ("top_k", -3)):
        yield grpc(f"{name}/{value}", "range", GOOD_GRPC + [tensor(name, "INT32", value)], rejected(name))
    yield grpc("stop_words/one", "range", GOOD_GRPC + [tensor("stop_words", "BYTES", ["x"], [1, 1])],
               ok("stop_words are honoured"))
    yield grpc("bad_words/invalid_utf8", "encoding", GOOD_GRPC + [tensor("bad_words", "BYTES", [b"\xff"], [1, 1])],
               rejected("bad_words"))

    def direct(ids: list[int], max_tokens: int = 4, shape: list[int] | None = None) -> list[dict]:
        return [tensor("input_ids", "INT32", ids, shape or [1, len(ids)]),
                tensor("input_lengths", "INT32", len(ids)), tensor("max_tokens", "INT32", max_tokens)]

    model = "speculative_decoding"
    for value in OUT_OF_VOCAB:
        yield grpc(f"input_ids/out_of_vocabulary_{value}", "range", direct([5, value, 7]), rejected("input_ids"),
                   model=model)
    yield grpc("input_ids/empty", "empty", direct([], shape=[1, 0]), rejected("text_input"), model=model)
    yield grpc("input_ids/beyond_context", "context", direct([5] * 2100), rejected("max_tokens"), model=model)
    yield grpc("missing/input_lengths", "missing", direct([5, 6])[::2], core("input_lengths"), model=model)
    yield grpc("input_ids/dtype_FP32", "type", [tensor("input_ids", "FP32", [5.0], [1, 1])] + direct([5])[1:],
               core("input_ids", "data-type is"), model=model)


def decoder_cases() -> Iterator[dict]:
    """Direct calls of the internal decoders (reachable unless the proxy restricts routes; docs/SECURITY.md).

    Every case that STARTs a sequence also ENDs it, so the corpus itself never holds a KV slot.
    """

    def call(case_id: str, kind: str, model: str, inputs: list[dict], sequence: dict | None, expect: dict) -> dict:
        return {"id": f"grpc_infer/{model}/{case_id}", "kind": kind, "transport": "grpc_infer", "model": model,
                "inputs": inputs, "sequence": sequence, "expect": expect}

    def ids(values: list[int]) -> dict:
        return tensor("input_ids", "INT32", values, [1, len(values)])

    past0 = tensor("past_length", "INT32", 0)
    once = {"id": 4242, "start": True, "end": True}
    for model in ("target_model", "draft_model"):
        for value in OUT_OF_VOCAB:
            yield call(f"input_ids/out_of_vocabulary_{value}", "range", model, [ids([5, value]), past0], once,
                       rejected("input_ids"))
        yield call("no_correlation_id", "missing", model, [ids([5]), past0], None,
                   core(model, "correlation ID"))
        yield call("past_length/negative", "range", model, [ids([5]), tensor("past_length", "INT32", -1)], once,
                   rejected("past_length"))
        yield call("past_length/beyond_cache", "range", model, [ids([5]), tensor("past_length", "INT32", 10**6)],
                   once, rejected("past_length"))
        yield call("step_without_start", "sequence", model, [ids([5]), past0], {"id": 4243, "start": False,
                                                                                "end": True},
                   core("START", "must specify the START flag"))
    yield call("num_logits/zero", "range", "target_model",
               [ids([5, 6]), past0, tensor("num_logits", "INT32", 0)], once, rejected("num_logits"))
    yield call("num_logits/too_many", "range", "target_model",
               [ids([5, 6]), past0, tensor("num_logits", "INT32", 1000)], once, rejected("num_logits"))
    yield call("num_draft_tokens/negative", "range", "draft_model",
               [ids([5, 6]), past0, tensor("num_draft_tokens", "INT32", -1)], once, rejected("num_draft_tokens"))
    yield call("num_draft_tokens/beyond_cache", "range", "draft_model",
               [ids([5, 6]), past0, tensor("num_draft_tokens", "INT32", 10**6)], once, rejected("input_ids"))
    yield call("commit_rows/beyond_cache", "range", "target_model",
               [ids([5]), past0, tensor("commit_base", "INT32", 0),
                tensor("commit_rows", "INT32", [500, 501], [1, 2])], once, rejected("commit_rows"))


def corpus() -> list[dict]:
    entries = [*http_cases(), *raw_cases(), *grpc_cases(), *decoder_cases()]
    ids = [e["id"] for e in entries]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise ValueError(f"duplicate ids: {sorted(duplicates)}")
    return entries


def render() -> str:
    return "".join(json.dumps(entry, sort_keys=True, allow_nan=True) + "\n" for entry in corpus())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="fail if the file on disk differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {len(text.splitlines())} requests to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
