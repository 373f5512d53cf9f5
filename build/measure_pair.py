"""Measure a target/draft pair for greedy speculative decoding (issue 3): alpha, c, v(k), predicted speedup.

- ``alpha`` (per domain) = fraction of positions where the draft's argmax equals the target's argmax given
  the same prefix, measured (a) on real held-out text (teacher forcing over held-out windows) and (b) on the
  target's own greedy continuations of prompts (held-out document openings, and the client's smoke prompts
  when present). For (b) the empirical tau(k) of greedy speculation is also simulated from the match
  pattern (runs of accepted tokens, capped at k, plus the bonus token).
- ``c`` = draft single-token step / target single-token step, ``v(k)`` = target pass over k+1 tokens / target
  single-token step; both measured interleaved in one process with a KV cache (HF ``DynamicCache``).
- predicted speedup = tau / (k*c + v(k)) with tau = (1 - alpha^(k+1)) / (1 - alpha), per domain, best k.
- three sample outputs per domain, JSON validity of finished JSON generations, distinct-4-gram ratio.

Usage: ``python build/measure_pair.py [--target DIR --draft DIR] --out checkpoints/measure.json``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))

from corpora import DOMAINS, read_jsonl  # noqa: E402
from specdec.checkpoint import read_proposal_vocab  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GEN_TOKENS = {"json": 128, "code": 256, "prose": 512}
SMOKE_KEYS = {"json": "json", "code": "code", "prose": "text"}


class SubsetHead(torch.nn.Module):
    """An output layer restricted to a draft's proposal vocabulary, as the serving runtimes compute it, its
    logits spread over the whole vocabulary (-inf outside the subset) for Hugging Face's generate."""

    def __init__(self, weight: torch.Tensor, proposal_ids: list[int]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight[torch.as_tensor(proposal_ids)].clone(), requires_grad=False)
        self.register_buffer("ids", torch.as_tensor(proposal_ids, dtype=torch.long))
        self.vocab_size = weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        subset = torch.nn.functional.linear(hidden, self.weight)
        full = subset.new_full((*subset.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(-1, self.ids, subset)


def load(path: Path, dtype: torch.dtype):
    """Load a causal LM and its tokenizer from a local folder (a draft's proposal vocabulary applied)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    model.checkpoint_params = sum(p.numel() for p in model.parameters())  # before the head is swapped
    proposal_ids = read_proposal_vocab(path, model.config.vocab_size)
    if proposal_ids is not None:
        model.lm_head = SubsetHead(model.lm_head.weight.detach(), proposal_ids)
    return model, AutoTokenizer.from_pretrained(str(path))


@torch.no_grad()
def greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    """Greedy continuation of ``ids`` (up to ``n`` tokens, stops after EOS) with a KV cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
    out: list[int] = []
    for _ in range(n):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos:
            break
        logits = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits
    return out


@torch.no_grad()
def matches(target, draft, ids: list[int], start: int) -> list[bool]:
    """For positions ``start..len(ids)-2``: does the draft's argmax equal the target's argmax?"""
    x = torch.tensor([ids])
    t = target(input_ids=x).logits[0, start:-1].argmax(-1)
    d = draft(input_ids=x).logits[0, start:-1].argmax(-1)
    return (t == d).tolist()


def tau_formula(alpha: float, k: int) -> float:
    """Expected tokens per verification pass for i.i.d. acceptance ``alpha`` and ``k`` draft tokens."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def tau_simulated(runs: list[list[bool]], k: int) -> float:
    """Tokens per verification pass of greedy speculation with ``k`` draft tokens, replayed on match patterns.

    ``runs[i][p]`` says whether the draft's next token equals the target's at position ``p`` of the i-th
    greedy continuation (prefixes are the same, since greedy speculation keeps the target's sequence).
    """
    tokens = passes = 0
    for m in runs:
        i = 0
        while i < len(m):
            j = 0
            while j < k and i + j < len(m) and m[i + j]:
                j += 1
            step = min(j + 1, len(m) - i)
            tokens += step
            passes += 1
            i += step
    return tokens / max(passes, 1)


@torch.no_grad()
def step_times(target, draft, ctx: list[int], ks: list[int], rounds: int, burst: int = 4) -> dict[str, float]:
    """Median times (ms) of target/draft single-token steps and target (k+1)-token passes, interleaved.

    ``draft`` is one draft step right after a target pass (cold caches: the target's weights have just
    streamed through L3); ``draft_burst`` is the mean step of ``burst`` consecutive draft steps, which is
    how a speculation iteration runs the draft (the drafter loops k times inside one call).
    """
    from transformers import DynamicCache

    tc, dc = DynamicCache(), DynamicCache()
    x = torch.tensor([ctx])
    target(input_ids=x, past_key_values=tc, use_cache=True)
    draft(input_ids=x, past_key_values=dc, use_cache=True)
    names = ["target", "draft", "draft_burst", *(f"verify{k}" for k in ks)]
    samples: dict[str, list[float]] = {n: [] for n in names}
    one = torch.tensor([[ctx[-1]]])
    for r in range(rounds + 3):
        plan = [("target", target, tc, one, 1), ("draft", draft, dc, one, 1), ("draft_burst", draft, dc, one, burst)]
        plan += [(f"verify{k}", target, tc, torch.tensor([ctx[-k - 1:]]), 1) for k in ks]
        if r % 2:
            plan.reverse()
        for name, model, cache, inp, reps in plan:
            t0 = time.perf_counter()
            for _ in range(reps):
                model(input_ids=inp, past_key_values=cache, use_cache=True)
            dt = (time.perf_counter() - t0) / reps
            cache.crop(-inp.shape[1] * reps)
            if r >= 3:  # warm-up rounds
                samples[name].append(dt * 1e3)
    out = {name: statistics.median(v) for name, v in samples.items()}
    out.update({f"{name}_min": min(v) for name, v in samples.items()})
    return out


def distinct4(ids: list[int]) -> float:
    """Distinct 4-gram ratio of a token list (1.0 = no repetition; loops push it towards 0)."""
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / max(1, len(grams))


def json_valid(text: str) -> bool:
    """Whether ``text`` is one JSON value or JSON Lines."""
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            for line in lines:
                json.loads(line)
        except json.JSONDecodeError:
            return False
        return bool(lines)


def prompts_for(domain: str, corpora: Path, tok, n: int, prompt_tokens: int, smoke: dict | None) -> list[dict]:
    """Held-out document openings (``prompt_tokens`` tokens; ``rest``: the document's own continuation) and the
    smoke prompts of the client, if any."""
    docs = read_jsonl(corpora / domain / "valid.jsonl")
    step = max(1, len(docs) // n)
    out = []
    for d in docs[::step][:n]:
        ids = tok(d["text"])["input_ids"]
        out.append({"set": "held-out", "ids": ids[:prompt_tokens], "rest": ids[prompt_tokens:]})
    for text in (smoke or {}).get(SMOKE_KEYS[domain], []):
        out.append({"set": "smoke", "ids": tok(text)["input_ids"]})
    return out


def measure(args: argparse.Namespace) -> dict:
    """Run all measurements and return them as a dict."""
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, tok = load(args.target, dtype)
    draft, dtok = load(args.draft, dtype)
    assert tok.get_vocab() == dtok.get_vocab(), "draft and target tokenizers differ"
    eos = tok.eos_token_id
    smoke = json.loads(args.smoke.read_text()) if args.smoke and args.smoke.exists() else None
    ks = list(range(1, args.k_max + 1))
    res: dict = {"target": str(args.target), "draft": str(args.draft), "dtype": args.dtype, "threads": args.threads,
                 "target_params": target.checkpoint_params, "draft_params": draft.checkpoint_params,
                 "draft_proposal_vocab": len(draft.lm_head.weight) if isinstance(draft.lm_head, SubsetHead) else None,
                 "domains": {}}

    # timing first, on a quiet process: context of ~prompt + half a generation
    ctx = tok(read_jsonl(args.corpora / "prose" / "valid.jsonl")[0]["text"])["input_ids"][:args.time_ctx]
    times = step_times(target, draft, ctx, ks, args.rounds)
    c = times["draft"] / times["target"]
    v = {k: times[f"verify{k}"] / times["target"] for k in ks}
    res["timing_ms"] = {k: round(x, 3) for k, x in times.items()}
    res["c"] = round(c, 4)
    res["c_burst"] = round(times["draft_burst"] / times["target"], 4)
    res["v"] = {k: round(x, 3) for k, x in v.items()}
    # minima: the least disturbed sample of each variant (a quiet machine's figure on a shared one)
    res["c_min"] = round(times["draft_min"] / times["target_min"], 4)
    res["v_min"] = {k: round(times[f"verify{k}_min"] / times["target_min"], 3) for k in ks}
    print(f"target step {times['target']:.2f} ms, draft step {times['draft']:.2f} ms, c={c:.3f}, "
          f"v={ {k: round(x, 2) for k, x in v.items()} }", file=sys.stderr)

    if args.timing_only:
        return res
    for dom in args.domains:
        r: dict = {}
        # (a) real held-out text
        ids = []
        for d in read_jsonl(args.corpora / dom / "valid.jsonl"):
            ids += tok(d["text"])["input_ids"] + [eos]
        m: list[bool] = []
        for w in range(args.windows):
            off = w * (len(ids) - args.window_len - 1) // max(1, args.windows - 1)
            m += matches(target, draft, ids[off:off + args.window_len], 0)
        r["alpha_heldout"] = round(sum(m) / len(m), 4)
        # (b) target's own greedy continuations
        runs: dict[str, list[list[bool]]] = {"held-out": [], "smoke": []}
        samples, div, valid, finished = [], [], 0, 0
        for p in prompts_for(dom, args.corpora, tok, args.prompts, args.prompt_tokens, smoke):
            cont = greedy(target, p["ids"], args.gen_tokens or GEN_TOKENS[dom], eos)
            full = p["ids"] + cont
            runs[p["set"]].append(matches(target, draft, full, len(p["ids"]) - 1))
            div.append(distinct4(cont))
            if dom == "json" and cont and cont[-1] == eos:
                finished += 1
                valid += json_valid(tok.decode(full, skip_special_tokens=True))
            if len(samples) < (3 if p["set"] == "held-out" else 6):
                samples.append({"set": p["set"], "prompt": tok.decode(p["ids"], skip_special_tokens=True),
                                "output": tok.decode(cont, skip_special_tokens=True)})
        for name, rr in runs.items():
            if rr:
                flat = [x for run in rr for x in run]
                r[f"alpha_greedy_{name}"] = round(sum(flat) / len(flat), 4)
                r[f"tau_sim_{name}"] = {k: round(tau_simulated(rr, k), 3) for k in ks}
        a = r["alpha_greedy_held-out"]
        r["speedup_pred"] = {k: round(tau_formula(a, k) / (k * c + v[k]), 3) for k in ks}
        r["speedup_sim"] = {k: round(r["tau_sim_held-out"][k] / (k * c + v[k]), 3) for k in ks}
        cb = res["c_burst"]
        r["speedup_pred_burst"] = {k: round(tau_formula(a, k) / (k * cb + v[k]), 3) for k in ks}
        if "tau_sim_smoke" in r:
            r["speedup_sim_smoke"] = {k: round(r["tau_sim_smoke"][k] / (k * c + v[k]), 3) for k in ks}
        r["best_k"] = max(ks, key=lambda k: r["speedup_pred"][k])
        r["distinct4_mean"] = round(statistics.mean(div), 3)
        if dom == "json":
            r["json_finished"] = finished
            r["json_valid_of_finished"] = valid
        r["samples"] = samples
        res["domains"][dom] = r
        print(f"{dom}: alpha held-out {r['alpha_heldout']}, greedy {a}, smoke {r.get('alpha_greedy_smoke')}, "
              f"best k {r['best_k']} -> {r['speedup_pred'][r['best_k']]}x (sim {r['speedup_sim'][r['best_k']]}x)",
              file=sys.stderr)
    return res


def _clip(text: str, n: int = 700) -> str:
    return text if len(text) <= n else text[:n] + " [...]"


def _g(d: dict, k: int):
    """``d[k]`` whether the keys are ints or (after a JSON round trip) strings."""
    return d.get(str(k), d.get(k))


def render_markdown(res: dict, ks_shown: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10)) -> str:
    """Markdown tables of a :func:`measure` result (pasted into docs/MODELS.md)."""
    doms = list(res["domains"])
    t = res["timing_ms"]
    head = "| k | " + " | ".join(str(k) for k in ks_shown) + " |"
    rule = "| --- |" + " --- |" * len(ks_shown)
    pv = res.get("draft_proposal_vocab")
    lines = [f"Target {res['target_params']:,} parameters, draft {res['draft_params']:,}"
             + (f" (output layer restricted to {pv:,} proposal tokens)" if pv else "")
             + f"; {res['dtype']}, {res['threads']} thread(s).", "",
             f"Step times, median ms: target {t['target']}, draft {t['draft']}, **c = {res['c']}**; "
             f"minimum ms: target {t.get('target_min')}, draft {t.get('draft_min')}, c_min = {res.get('c_min')}; "
             f"draft step inside a burst of 4 (median): {t.get('draft_burst')} ms, c_burst = {res.get('c_burst')}.",
             "", head, rule,
             "| v(k) | " + " | ".join(str(_g(res["v"], k)) for k in ks_shown) + " |",
             "| v_min(k) | " + " | ".join(str(_g(res.get("v_min", {}), k)) for k in ks_shown) + " |", "",
             "| domain | α held-out text | α target greedy (held-out prompts) | α target greedy (smoke prompts) "
             "| best k | predicted speedup (i.i.d.) | simulated speedup (its best) | simulated, smoke prompts |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dom in doms:
        r = res["domains"][dom]
        k = r["best_k"]
        sim_best = max(r["speedup_sim"].values())
        smoke = r.get("speedup_sim_smoke")
        lines.append(f"| {dom} | {r['alpha_heldout']} | {r['alpha_greedy_held-out']} | "
                     f"{r.get('alpha_greedy_smoke', '-')} | {k} | {_g(r['speedup_pred'], k)} | "
                     f"{_g(r['speedup_sim'], k)} ({sim_best}) | {max(smoke.values()) if smoke else '-'} |")
    lines += ["", "Predicted speedup τ/(k·c+v(k)) by k (i.i.d. τ from α on the target's greedy text):", "",
              "| domain | " + " | ".join(f"k={k}" for k in ks_shown) + " |", rule]
    for dom in doms:
        r = res["domains"][dom]
        lines.append(f"| {dom} | " + " | ".join(str(_g(r["speedup_pred"], k)) for k in ks_shown) + " |")
    if all("speedup_pred_burst" in res["domains"][d] for d in doms):
        lines += ["", "The same with c_burst (the draft's step inside a burst, as a drafter runs it):", "",
                  "| domain | " + " | ".join(f"k={k}" for k in ks_shown) + " |", rule]
        for dom in doms:
            r = res["domains"][dom]
            lines.append(f"| {dom} | " + " | ".join(str(_g(r["speedup_pred_burst"], k)) for k in ks_shown) + " |")
    lines += ["", "Distinct-4-gram ratio of the target's greedy continuations (1 = no repeats):"]
    for dom in doms:
        r = res["domains"][dom]
        extra = ""
        if "json_finished" in r:
            extra = (f"; {r['json_finished']} JSON continuations ended with `</s>`, "
                     f"{r['json_valid_of_finished']} of those parse")
        lines.append(f"- {dom}: {r['distinct4_mean']}{extra}")
    lines += ["", "### Sample outputs (target, greedy; ⟨⟩ marks where the prompt ends)", ""]
    for dom in doms:
        lines.append(f"#### {dom}")
        for smp in res["domains"][dom]["samples"]:
            lines += ["", f"({smp['set']} prompt)", "", "```text", smp["prompt"] + "⟨⟩" + _clip(smp["output"]), "```"]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "model_repository" / "target_model" / "1")
    ap.add_argument("--draft", type=Path, default=ROOT / "model_repository" / "draft_model" / "1")
    ap.add_argument("--corpora", type=Path, default=ROOT / "data" / "corpora")
    ap.add_argument("--smoke", type=Path, default=ROOT / "client" / "specdec_client" / "prompts" / "smoke.json")
    ap.add_argument("--domains", default=",".join(DOMAINS))
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts per domain")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--gen-tokens", type=int, default=0, help="tokens per greedy continuation (0: per domain)")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows per domain for alpha on real text")
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--k-max", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=60, help="timing rounds")
    ap.add_argument("--time-ctx", type=int, default=200, help="context length for timing")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", help="runtime dtype (the CPU runtime uses float32)")
    ap.add_argument("--timing-only", action="store_true", help="only c and v(k)")
    ap.add_argument("--out", type=Path, default=ROOT / "checkpoints" / "measure.json")
    args = ap.parse_args(argv)
    args.domains = args.domains.split(",")
    res = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, ensure_ascii=False) + "\n")
    if not args.timing_only:
        args.out.with_suffix(".md").write_text(render_markdown(json.loads(json.dumps(res))))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
