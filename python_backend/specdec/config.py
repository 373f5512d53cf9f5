"""Speculation profiles (YAML) and how a request's settings are resolved from a profile plus overrides.

The dataclasses' defaults are the shipped profile's values (model_repository/speculative_decoding/1/profiles.yaml
states each of them, with why; a unit test checks the two agree): a profiles file that leaves a key out gets the
shipped value. docs/SPECULATION.md describes every key:

    speculative_decoding:
      base_length: {json: 4, code: 3, text: 1}   # a range [min, max] means adaptive
      candidate_num: {default: 1}
      drafter: {json: eagle+ngram, code: eagle+ngram, text: eagle+ngram}
      dynamic_tree: {nodes: {json: 0, code: 8, text: 8}, depth: 5, width: 2, min_probability: 0.1,
                     max_sequences: 2}   # above 2 sequences generating: chains
      max_sequences: 2
      fallback: {min_acceptance_rate: 0.20, window_s: 300}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from specdec.acceptance import ACCEPTANCE_MODES
from specdec.drafting.ngram import PromptLookup
from specdec.drafting.spec import DRAFTERS, LOOKUP, MODEL_DRAFTERS, DrafterSpec
from specdec.errors import InvalidRequestError

TASKS = ("json", "code", "text")


def drafters_served(eagle_head: bool, draft_model: bool = True) -> tuple[str, ...]:
    """The drafter names a deployment can honour: all of them, less those of a drafter model it does not
    load (a repository made for other checkpoints has no EAGLE head; one that serves only the head leaves the
    standalone draft model out, which saves that process's memory)."""
    loaded = {"eagle": eagle_head, "model": draft_model}
    return tuple(d for d in DRAFTERS if (model := DrafterSpec.parse(d).model) is None or loaded[model])


@dataclass(frozen=True)
class FallbackConfig:
    """Plain decoding for a task whose acceptance rate stayed below `min_acceptance_rate` for a window."""

    min_acceptance_rate: float = 0.20  # break-even of a one-token draft is ~0.15 here
    window_s: float = 300.0
    min_draft_tokens: int = 256  # evidence needed before the window's rate is trusted
    probe_interval_s: float = 30.0  # while fallen back, one request in this interval speculates


@dataclass(frozen=True)
class DynamicTree:
    """The EAGLE head's dynamic draft tree (EAGLE-2; specdec.engines._DynamicTree, docs/SPECULATION.md): at most
    `nodes` nodes, `depth` levels, the children of `width` nodes scored per level, no node whose path probability
    under the head is below `min_probability`. Used for greedy drafting with the head; a sampled request (which
    needs one distribution per branch to stay lossless) and the draft model keep the profile's chains.

    `max_sequences` (0: no limit): trees only while at most that many sequences are generating on the instance;
    above it the profile's chains. A tree verifies its nodes for a few more accepted tokens, which pays while the
    target's step is bound by reading its weights (few sequences) and not once a batched step is bound by its
    rows (docs/SPECULATION.md, "Trees under load")."""

    nodes: int
    depth: int = 5
    width: int = 2
    min_probability: float = 0.1
    max_sequences: int = 2

    def __post_init__(self) -> None:
        if not (self.nodes >= 1 and self.depth >= 1 and self.width >= 1 and 0.0 <= self.min_probability < 1.0
                and self.max_sequences >= 0):
            raise ValueError("dynamic_tree needs nodes, depth, width >= 1, min_probability in [0, 1) and "
                             f"max_sequences >= 0: {self}")

    def serves(self, sequences: int) -> bool:
        """Whether a tree is drafted while `sequences` sequences are generating."""
        return not self.max_sequences or sequences <= self.max_sequences

    @classmethod
    def for_task(cls, raw: dict[str, Any], task: str) -> DynamicTree | None:
        """The profile's `dynamic_tree` for one task (`nodes` one value or per task; 0 or absent: none)."""
        nodes = raw.get("nodes", 0)
        nodes = int(nodes.get(task, 0) if isinstance(nodes, dict) else nodes)
        if nodes < 0:
            raise ValueError(f"dynamic_tree nodes of {task} must be >= 0, got {nodes}")
        if not nodes:
            return None
        return cls(nodes, int(raw.get("depth", cls.depth)), int(raw.get("width", cls.width)),
                   float(raw.get("min_probability", cls.min_probability)),
                   int(raw.get("max_sequences", cls.max_sequences)))


# The keys of a profiles file's `speculative_decoding` mapping (SpeculationConfig.from_dict), and keys it no
# longer takes, with why (a file that still sets one is refused, not silently changed).
PROFILE_KEYS = frozenset({
    "base_length", "candidate_num", "drafter", "acceptance", "dynamic_tree", "max_sequences", "plain_steps",
    "speculate_sampled",
    "grammar_drafting", "constrained_drafter", "verify_threshold", "prompt_lookup", "fallback",
})
REMOVED_PROFILE_KEYS = {
    "draft_confidence": "removed: stopping a chain where the drafter is unsure did not pay (docs/SPECULATION.md)",
}


@dataclass(frozen=True)
class TaskProfile:
    """The speculation settings of one task."""

    min_length: int
    max_length: int  # equal to min_length: fixed; larger: adaptive within [min, max]
    num_candidates: int = 1
    drafter: str = "eagle+ngram"
    acceptance: str = "greedy"
    tree: DynamicTree | None = None  # the EAGLE head's dynamic tree, where it can draft one

    @property
    def adaptive(self) -> bool:
        return self.max_length > self.min_length


def shipped_profiles() -> dict[str, TaskProfile]:
    """The shipped task profiles: the EAGLE head behind prompt lookup, chains of 4 (JSON), 3 (code) and 1 (prose)
    tokens, and dynamic trees of 8 nodes for code and prose while at most 2 sequences generate."""
    return {"json": TaskProfile(4, 4), "code": TaskProfile(3, 3, tree=DynamicTree(8)),
            "text": TaskProfile(1, 1, tree=DynamicTree(8))}


@dataclass(frozen=True)
class SpeculationConfig:
    profiles: dict[str, TaskProfile] = field(default_factory=shipped_profiles)
    verify_threshold: float = 0.7
    fallback: FallbackConfig = field(default_factory=FallbackConfig)
    prompt_lookup: PromptLookup = field(default_factory=PromptLookup)  # for `model+ngram` and `eagle+ngram`
    served_drafters: tuple[str, ...] = DRAFTERS  # the drafters whose models this deployment serves
    # Speculate only while at most this many sequences generate on the instance (0: at any load); above it a
    # request whose text does not depend on the load decodes plain: a batched verification is bound by its
    # rows on a CPU, and every draft row then costs what it saves (docs/BENCHMARKS.md, "Under load").
    max_sequences: int = 2
    # Tokens a plain call to the target picks when speculation is off (above max_sequences, sampled requests,
    # fallback): the target runs that many one-token steps in one call, so the round trip between
    # speculative_decoding and the target (and the wave's gathering) is paid once per that many tokens. 4 on this
    # CPU: greedy c=64 1.25-1.34x, c=16 1.17-1.35x against 1; 8 gained less and doubled the time to first token
    # (docs/BENCHMARKS.md "Under load").
    plain_steps: int = 4
    # Whether a sampled request (temperature > 0) that sets no speculation option of its own speculates. Off: with
    # this head, sampled speculation gained 1.02x at concurrency 1 and lost at 4 and 16 (0.75x, 0.60x), and a
    # seeded request cannot follow the load (its text would change with it) (docs/BENCHMARKS.md, "Under load").
    speculate_sampled: bool = False
    # Whether a constrained request (a guided_decoding guide) drafts the tokens its grammar forces, at no model
    # cost, in front of the profile's drafters, at any load and temperature (the grammar's drafts are one-hot and
    # do not depend on the load: lossless and reproducible). Off where the request sets num_draft_tokens 0.
    grammar_drafting: bool = True
    # The drafter of a constrained request that names none, at any temperature (a sampled one speculates too):
    # the grammar drafts a schema's structure, and what is left (its values) the EAGLE head drafted too poorly
    # to pay for its forwards: on held-out schemas prompt lookup alone gave 2.33x against the head's 2.07x, greedy
    # (docs/STRUCTURED_OUTPUTS.md). Empty: the task profile's drafter.
    constrained_drafter: str = "ngram"

    def serving(self, served_drafters: tuple[str, ...]) -> SpeculationConfig:
        """This config for a deployment that serves only `served_drafters`: a profile whose drafter is not
        served drafts with the other drafter model (the draft model where the EAGLE head is absent, and the
        reverse), or by prompt lookup alone where neither is loaded."""
        def served(drafter: str) -> str:
            spec = DrafterSpec.parse(drafter)
            for model in (spec.model, *MODEL_DRAFTERS):
                candidate = spec.with_model(model).name if model else drafter
                if candidate in served_drafters:
                    return candidate
            return LOOKUP

        profiles = {task: replace(profile, drafter=served(profile.drafter)) for task, profile in self.profiles.items()}
        return replace(self, profiles=profiles, served_drafters=served_drafters)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculationConfig:
        """The config a profiles file describes; every key it leaves out keeps the shipped default."""
        spec = raw.get("speculative_decoding", raw)
        unknown = sorted(set(spec) - PROFILE_KEYS)
        if unknown:
            removed = [f"{key} ({REMOVED_PROFILE_KEYS[key]})" for key in unknown if key in REMOVED_PROFILE_KEYS]
            raise ValueError(f"unknown speculation profile keys: {', '.join(removed or unknown)}; "
                             f"known: {', '.join(sorted(PROFILE_KEYS))}")
        default = cls()

        def per_task(key: str, task: str, value: Any) -> Any:
            given = spec.get(key, {})
            return given.get(task, value) if isinstance(given, dict) else given

        profiles = {}
        for task in TASKS:
            shipped = default.profiles[task]
            length = per_task("base_length", task, [shipped.min_length, shipped.max_length])
            lo, hi = (int(length[0]), int(length[1])) if isinstance(length, list) else (int(length), int(length))
            if not 1 <= lo <= hi:
                raise ValueError(f"base_length of {task} must be a positive length or [min, max]")
            drafter = str(per_task("drafter", task, shipped.drafter))
            mode = str(per_task("acceptance", task, shipped.acceptance))
            if drafter not in DRAFTERS or mode not in ACCEPTANCE_MODES:
                raise ValueError(f"profile {task}: drafter must be in {DRAFTERS}, acceptance in {ACCEPTANCE_MODES}")
            tree = DynamicTree.for_task(spec["dynamic_tree"] or {}, task) if "dynamic_tree" in spec else shipped.tree
            candidates = int(spec.get("candidate_num", {}).get("default", shipped.num_candidates))
            profiles[task] = TaskProfile(lo, hi, candidates, drafter, mode, tree)
        fb = spec.get("fallback", {})
        window_s = float(fb.get("window_s", default.fallback.window_s))
        pl = spec.get("prompt_lookup", {})
        adaptive = pl.get("adaptive", default.prompt_lookup.adaptive)
        if not isinstance(adaptive, bool):
            raise ValueError(f"prompt_lookup.adaptive must be true or false, got {adaptive!r}")
        lookup = PromptLookup(length=int(pl.get("length", default.prompt_lookup.length)),
                              min_ngram=int(pl.get("min_ngram", default.prompt_lookup.min_ngram)),
                              max_ngram=int(pl.get("max_ngram", default.prompt_lookup.max_ngram)), adaptive=adaptive)
        max_sequences = int(spec.get("max_sequences", cls.max_sequences))
        if max_sequences < 0:
            raise ValueError(f"max_sequences must be >= 0 (0: speculate at any load), got {max_sequences}")
        plain_steps = int(spec.get("plain_steps", cls.plain_steps))
        if plain_steps < 1:
            raise ValueError(f"plain_steps must be >= 1, got {plain_steps}")
        speculate_sampled = spec.get("speculate_sampled", cls.speculate_sampled)
        if not isinstance(speculate_sampled, bool):
            raise ValueError(f"speculate_sampled must be true or false, got {speculate_sampled!r}")
        grammar_drafting = spec.get("grammar_drafting", cls.grammar_drafting)
        if not isinstance(grammar_drafting, bool):
            raise ValueError(f"grammar_drafting must be true or false, got {grammar_drafting!r}")
        constrained_drafter = spec.get("constrained_drafter", cls.constrained_drafter) or ""
        if constrained_drafter and constrained_drafter not in DRAFTERS:
            raise ValueError(f"constrained_drafter must be one of {DRAFTERS} or empty, got {constrained_drafter!r}")
        return cls(
            profiles=profiles,
            max_sequences=max_sequences,
            plain_steps=plain_steps,
            speculate_sampled=speculate_sampled,
            grammar_drafting=grammar_drafting,
            constrained_drafter=constrained_drafter,
            verify_threshold=float(spec.get("verify_threshold", cls.verify_threshold)),
            fallback=FallbackConfig(
                min_acceptance_rate=float(fb.get("min_acceptance_rate", default.fallback.min_acceptance_rate)),
                window_s=window_s,
                min_draft_tokens=int(fb.get("min_draft_tokens", default.fallback.min_draft_tokens)),
                # a short window probes more often (a tenth of it), at most every probe_interval_s
                probe_interval_s=float(fb.get("probe_interval_s",
                                              min(default.fallback.probe_interval_s, window_s / 10))),
            ),
            prompt_lookup=lookup,
        )

    @classmethod
    def load(cls, path: str | Path) -> SpeculationConfig:
        return cls.from_dict(yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {})


@dataclass(frozen=True)
class SpeculationSettings:
    """What one request does, after its profile and its overrides."""

    task: str
    drafter: str
    min_length: int
    max_length: int
    num_candidates: int
    acceptance: str
    verify_threshold: float
    explicit_length: bool = False  # the request fixed num_draft_tokens: the profile's fallback does not apply
    prompt_lookup: PromptLookup = PromptLookup(adaptive=False)  # how `model+ngram` / `eagle+ngram` look up
    tree: DynamicTree | None = None  # greedy drafting with the EAGLE head: this dynamic tree instead of chains
    max_sequences: int = 0  # SpeculationConfig.max_sequences (0: speculate at any load)
    plain_steps: int = 1  # SpeculationConfig.plain_steps: tokens a plain call picks where speculation is off
    # A constrained request drafts the tokens its grammar forces, at no model cost, in front of its drafters
    # (SpeculationConfig.grammar_drafting; off where the request asked for plain decoding, num_draft_tokens 0).
    grammar_drafting: bool = False

    @property
    def adaptive(self) -> bool:
        return self.max_length > self.min_length

    @cached_property
    def drafter_spec(self) -> DrafterSpec:
        """`drafter` parsed (its model drafter, whether prompt lookup proposes first)."""
        return DrafterSpec.parse(self.drafter)

    def speculates_under(self, sequences: int) -> bool:
        """Whether the profile speculates with `sequences` generating on the instance."""
        return not self.max_sequences or sequences <= self.max_sequences

    @property
    def enabled(self) -> bool:
        return self.max_length > 0


# A chat request names its task in words ("Return a JSON object...", "Write a Python function...").
_JSON_WORDS = re.compile(r"\bjson\b", re.IGNORECASE)
_CODE_WORDS = re.compile(r"\b(python|function|code|script|class|program)\b|```", re.IGNORECASE)


def detect_task(text: str) -> str:
    """`task=auto`: JSON when the prompt opens or continues a JSON value or asks for JSON, code when it looks
    like source code or asks for code, text otherwise. Cheap and predictable, on purpose."""
    stripped = text.lstrip()
    if stripped[:1] in "{[" or '":' in text or '": ' in text or _JSON_WORDS.search(text):
        return "json"
    code_markers = ("def ", "class ", "import ", "return ", "#include", "function ", "=> ", "){", "self.", "    ")
    if any(marker in text for marker in code_markers) or text.rstrip().endswith((":", "{", ";")):
        return "code"
    if _CODE_WORDS.search(text):
        return "code"
    return "text"


def resolve(config: SpeculationConfig, task: str, prompt_text: str | None, *, num_draft_tokens: int | None,
            num_candidates: int | None, acceptance: str | None, verify_threshold: float | None,
            drafter: str | None, sampling: bool, constrained: bool = False) -> SpeculationSettings:
    """Profile of the task (auto-detected from the prompt if asked), with the request's overrides. A constrained
    request (structured output) drafts with the config's constrained_drafter unless it names one."""
    if constrained and drafter is None and config.constrained_drafter in config.served_drafters:
        drafter = config.constrained_drafter
    if task == "auto":
        task = detect_task(prompt_text or "")
    profile = config.profiles[task]
    settings = SpeculationSettings(
        task=task, drafter=profile.drafter, min_length=profile.min_length, max_length=profile.max_length,
        num_candidates=profile.num_candidates, acceptance=profile.acceptance,
        verify_threshold=config.verify_threshold, prompt_lookup=config.prompt_lookup,
        tree=profile.tree, max_sequences=config.max_sequences, plain_steps=config.plain_steps,
        grammar_drafting=config.grammar_drafting and num_draft_tokens != 0,
    )
    asked = (num_draft_tokens, num_candidates, acceptance, verify_threshold, drafter)
    if sampling and not config.speculate_sampled and all(option is None for option in asked):
        settings = replace(settings, min_length=0, max_length=0)  # plain decoding (speculate_sampled)
    if sampling and acceptance is None and settings.acceptance == "greedy":
        settings = replace(settings, acceptance="rejection")  # the lossless rule for sampled decoding
    if num_draft_tokens is not None:
        # A request that fixes its length speculates at any load (it asked for exactly this).
        settings = replace(settings, min_length=num_draft_tokens, max_length=num_draft_tokens, explicit_length=True,
                           max_sequences=0)
        if settings.tree is not None and num_draft_tokens > 0:  # a dynamic tree's k is its depth
            settings = replace(settings, tree=replace(settings.tree, depth=num_draft_tokens))
    if num_candidates is not None:
        settings = replace(settings, num_candidates=num_candidates)
        if settings.tree is not None:  # and its width
            settings = replace(settings, tree=replace(settings.tree, width=num_candidates))
    if acceptance is not None:
        if acceptance == "greedy" and sampling:
            raise InvalidRequestError("acceptance", "greedy acceptance needs temperature 0; use rejection or typical")
        settings = replace(settings, acceptance=acceptance)
    if verify_threshold is not None:
        if not 0.0 < verify_threshold <= 1.0:
            raise InvalidRequestError("verify_threshold", f"must be in (0, 1], got {verify_threshold}")
        settings = replace(settings, verify_threshold=verify_threshold)
    if drafter is not None:
        if drafter not in DRAFTERS:
            raise InvalidRequestError("drafter", f"{drafter!r} is not a drafter (one of {', '.join(DRAFTERS)})")
        if drafter not in config.served_drafters:
            raise InvalidRequestError("drafter", f"{drafter!r} is not served here (served: "
                                                 f"{', '.join(config.served_drafters)})")
        settings = replace(settings, drafter=drafter)
    if settings.drafter == LOOKUP:
        settings = replace(settings, num_candidates=1)  # prompt lookup proposes one continuation
    return settings
