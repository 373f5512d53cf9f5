"""Train a Llama-architecture causal LM (the default target or draft) on the offline corpora.

Next-token training on random windows of the concatenated ``<s> doc </s>`` token streams of each domain,
domains mixed by ``--mix``. Fixed seeds (the batch of step ``i`` depends only on the seed and ``i``, so a
resumed run sees the same data), bf16 autocast on CPUs with native bf16 (fp32 elsewhere), tqdm progress
bar, a resumable checkpoint (``state.pt``) every ``--ckpt-every`` steps, held-out loss per domain every
``--eval-every`` steps, logged to ``<out>/log.jsonl``. The final model is saved in Hugging Face format
(bf16 safetensors + tokenizer) to ``<out>/hf``.

Examples::

    python build/train.py --out checkpoints/target --layers 12 --hidden 256 --heads 4 --kv-heads 4 \\
        --intermediate 704 --steps 6000 --threads 1
    python build/train.py --out checkpoints/draft --layers 1 --hidden 256 --steps 3000 --resume
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora import read_jsonl  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with native bf16 arithmetic


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bf16 natively. Without it (e.g. an AVX2-only EPYC) torch emulates bf16:
    measured there, forward + backward of the 12-layer target on 2 x 512 tokens took 23 s under bf16 autocast
    against 1 s in fp32."""
    try:
        flags = cpuinfo.read_text().split()
    except OSError:
        return False
    return any(f in flags for f in BF16_CPU_FLAGS)


USE_BF16 = cpu_has_native_bf16()


def bf16_autocast() -> torch.autocast:
    """bf16 autocast where the CPU has native bf16 (2x faster than fp32 there), else a no-op (fp32)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=USE_BF16)


# --------------------------------------------------------------------------------------------- data
def tokenize_split(tokenizer, path: Path, cache_dir: Path) -> np.ndarray:
    """Return the ``<s> doc </s>`` token stream of a JSONL split as uint16, cached by content hash.

    Documents with an ``ids`` field are taken as already tokenised."""
    tok_json = Path(tokenizer.name_or_path) / "tokenizer.json"
    h = hashlib.sha256(path.read_bytes())
    if tok_json.exists():
        h.update(tok_json.read_bytes())
    cache = cache_dir / f"{path.parent.name}-{path.stem}-{h.hexdigest()[:16]}.npy"
    if cache.exists():
        return np.load(cache)
    docs = read_jsonl(path)
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for start in range(0, len(docs), 256):
        chunk = docs[start:start + 256]
        if all("ids" in d for d in chunk):  # pre-tokenised (build/greedy_corpus.py)
            enc = [list(d["ids"]) for d in chunk]
        else:
            enc = tokenizer([d["text"] for d in chunk], add_special_tokens=True)["input_ids"]
        for seq in enc:
            ids.extend(seq)
            if not seq or seq[-1] != eos:
                ids.append(eos)
    arr = np.asarray(ids, dtype=np.uint16)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(cache, arr)
    return arr


class Batches:
    """Deterministic sampler of training windows over several domain streams."""

    def __init__(self, streams: dict[str, np.ndarray], mix: dict[str, float], seq_len: int, batch: int,
                 seed: int) -> None:
        self.names = [n for n in streams if mix.get(n, 0) > 0]
        w = np.asarray([mix[n] for n in self.names], dtype=np.float64)
        self.p = w / w.sum()
        self.streams, self.seq_len, self.batch, self.seed = streams, seq_len, batch, seed

    def get(self, step: int) -> torch.Tensor:
        """The batch of ``step`` (shape ``[batch, seq_len + 1]``), a function of seed and step only."""
        rng = np.random.default_rng([self.seed, step])
        doms = rng.choice(len(self.names), size=self.batch, p=self.p)
        rows = []
        for d in doms:
            s = self.streams[self.names[d]]
            off = int(rng.integers(0, len(s) - self.seq_len - 1))
            rows.append(s[off:off + self.seq_len + 1].astype(np.int64))
        return torch.from_numpy(np.stack(rows))


def eval_windows(stream: np.ndarray, seq_len: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced windows of a held-out stream (fixed, so losses are comparable over time)."""
    n = max(1, min(n, (len(stream) - 1) // (seq_len + 1)))
    offs = np.linspace(0, len(stream) - seq_len - 2, n).astype(np.int64)
    return torch.from_numpy(np.stack([stream[o:o + seq_len + 1].astype(np.int64) for o in offs]))


# -------------------------------------------------------------------------------------------- model
def make_config(args: argparse.Namespace, tokenizer):
    """A ``LlamaConfig`` from the command line size flags."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, rope_theta=args.rope_theta, rms_norm_eps=1e-5,
        tie_word_embeddings=args.tie, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, attention_bias=False, mlp_bias=False, hidden_act="silu",
        initializer_range=0.02,
    )


def lm_loss(model, batch: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross entropy of ``batch`` (``[B, T+1]``) against the next tokens, or against ``labels`` (``[B, T]``)."""
    logits = model(input_ids=batch[:, :-1]).logits
    target = batch[:, 1:] if labels is None else labels
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


@torch.no_grad()
def teacher_labels(teacher, batch: torch.Tensor, micro: int) -> torch.Tensor:
    """The teacher's argmax at every position of ``batch[:, :-1]`` (hard distillation labels)."""
    out = []
    for i in range(0, len(batch), micro):
        with bf16_autocast():
            out.append(teacher(input_ids=batch[i:i + micro, :-1]).logits.argmax(-1))
    return torch.cat(out)


def repeated_ngram_mask(seq: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Bool ``[B, T]``: positions ``t >= start`` whose ``n``-gram ending at ``t`` already occurred in the row."""
    mask = torch.zeros_like(seq, dtype=torch.bool)
    for b, row in enumerate(seq.tolist()):
        seen: set[tuple[int, ...]] = set()
        for t in range(n - 1, len(row)):
            gram = tuple(row[t - n + 1:t + 1])
            if t >= start and gram in seen:
                mask[b, t] = True
            seen.add(gram)
    return mask


@torch.no_grad()
def greedy_rollouts(model, prefixes: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``prefixes`` (``[B, P]``) continued greedily by ``model`` for ``new_tokens`` tokens (``[B, P + new]``)."""
    from transformers import DynamicCache

    model.eval()
    cache = DynamicCache()
    with bf16_autocast():
        logits = model(input_ids=prefixes, past_key_values=cache, use_cache=True).logits[:, -1]
        out = [prefixes]
        for _ in range(new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
    model.train()
    return torch.cat(out, dim=1)


def unlikelihood_loss(model, seq: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """Sequence-level unlikelihood (Welleck et al., 2020): ``-log(1 - p(x_t | x_<t))`` at the ``mask``ed
    positions of the model's own continuation, summed and divided by the continuation's length."""
    logits = model(input_ids=seq[:, :-1]).logits.float()
    p_tok = torch.softmax(logits, dim=-1).gather(-1, seq[:, 1:, None]).squeeze(-1)
    penalty = -torch.log1p(-p_tok.clamp(max=1 - 1e-6)) * mask[:, 1:]
    return penalty.sum() / (seq.shape[0] * (seq.shape[1] - start))


@torch.no_grad()
def evaluate(model, windows: dict[str, torch.Tensor], micro: int, teacher=None) -> dict[str, float]:
    """Held-out next-token loss per domain (and, with a teacher, argmax agreement ``<domain>_agree``)."""
    model.eval()
    out = {}
    for name, w in windows.items():
        tot, n, agree, seen = 0.0, 0, 0, 0
        for i in range(0, len(w), micro):
            mb = w[i:i + micro]
            with bf16_autocast():
                logits = model(input_ids=mb[:, :-1]).logits
                if teacher is not None:
                    t = teacher(input_ids=mb[:, :-1]).logits.argmax(-1)
                    agree += int((logits.argmax(-1) == t).sum())
                    seen += t.numel()
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     mb[:, 1:].reshape(-1))
            tot += float(loss) * len(mb)
            n += len(mb)
        out[name] = round(tot / n, 4)
        if teacher is not None:
            out[f"{name}_agree"] = round(agree / seen, 4)
    model.train()
    return out


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup then cosine decay to ``lr * min_lr_frac``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def save_hf(model, tokenizer, out: Path) -> None:
    """Save ``model`` (in bf16) and ``tokenizer`` in Hugging Face format into ``out``."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16)
    m.generation_config.bos_token_id = tokenizer.bos_token_id
    m.generation_config.eos_token_id = tokenizer.eos_token_id
    m.generation_config.pad_token_id = tokenizer.pad_token_id
    m.save_pretrained(str(out), safe_serialization=True)
    tok_src = Path(tokenizer.name_or_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_src / name).exists():
            (out / name).write_bytes((tok_src / name).read_bytes())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    ap.add_argument("--tokenizer", type=Path, default=Path("checkpoints/tokenizer"))
    ap.add_argument("--out", type=Path, required=True, help="run folder: state.pt, log.jsonl, hf/")
    ap.add_argument("--cache", type=Path, default=Path("data/tokens"), help="token stream cache")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--no-tie", dest="tie", action="store_false", help="untie input/output embeddings")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="HF folder to initialise from (same shapes; or embeddings only with --init-embed-only)")
    ap.add_argument("--init-embed-only", action="store_true")
    ap.add_argument("--teacher", type=Path, default=None,
                    help="HF folder of a teacher (the target): train on its argmax instead of the next token")
    ap.add_argument("--teacher-frac", type=float, default=1.0,
                    help="with --teacher: weight of the teacher-argmax loss (the rest is next-token loss)")
    ap.add_argument("--ul-every", type=int, default=0,
                    help="every N steps also penalise the model's repeated n-grams in its own greedy continuations "
                         "(sequence-level unlikelihood, against greedy loops); 0: off")
    ap.add_argument("--ul-batch", type=int, default=4, help="continuations per unlikelihood step")
    ap.add_argument("--ul-mix", default="code=1,prose=1.3",
                    help="domains of the unlikelihood prefixes (JSON legitimately repeats long n-grams)")
    ap.add_argument("--ul-prefix", type=int, default=64, help="prefix tokens (the start of training windows)")
    ap.add_argument("--ul-tokens", type=int, default=128, help="greedy tokens generated after each prefix")
    ap.add_argument("--ul-ngram", type=int, default=8, help="a token is penalised when its n-gram repeats")
    ap.add_argument("--ul-weight", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--micro", type=int, default=16, help="sequences per forward (gradient accumulation)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mix", default="code=1,json=1,prose=1.2", help="domain sampling weights")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows per domain")
    ap.add_argument("--ckpt-every", type=int, default=250)
    ap.add_argument("--resume", action="store_true", help="continue from <out>/state.pt if present")
    ap.add_argument("--bf16", choices=("auto", "on", "off"), default="auto",
                    help="bf16 autocast: auto = where the CPU has native bf16 (avx512_bf16 / amx_bf16)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_const", const="off", help="same as --bf16 off")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Train; returns the final held-out losses."""
    from tqdm import tqdm
    from transformers import AutoTokenizer, LlamaForCausalLM

    global USE_BF16
    args = parse_args(argv)
    USE_BF16 = cpu_has_native_bf16() if args.bf16 == "auto" else args.bf16 == "on"
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
    train_streams = {d: tokenize_split(tokenizer, args.corpora / d / "train.jsonl", args.cache) for d in mix}
    valid = {d: eval_windows(tokenize_split(tokenizer, args.corpora / d / "valid.jsonl", args.cache),
                             args.seq_len, args.eval_windows) for d in mix}
    batches = Batches(train_streams, mix, args.seq_len, args.batch, args.seed)
    ul_prefixes = None
    if args.ul_every:
        ul_mix = {k: float(v) for k, v in (kv.split("=") for kv in args.ul_mix.split(","))}
        ul_prefixes = Batches(train_streams, ul_mix, args.ul_prefix - 1, args.ul_batch, args.seed + 1)

    config = make_config(args, tokenizer)
    model = LlamaForCausalLM(config)
    if args.init_from is not None:
        src = LlamaForCausalLM.from_pretrained(str(args.init_from), dtype=torch.float32)
        if args.init_embed_only:
            model.get_input_embeddings().weight.data.copy_(src.get_input_embeddings().weight.data)
            if not config.tie_word_embeddings:
                model.get_output_embeddings().weight.data.copy_(src.get_output_embeddings().weight.data)
        else:
            model.load_state_dict(src.state_dict())
    model.float().train()
    teacher = None
    if args.teacher is not None:
        teacher = LlamaForCausalLM.from_pretrained(str(args.teacher), dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step, elapsed, tokens_seen = 0, 0.0, 0
    state_path = args.out / "state.pt"
    log_path = args.out / "log.jsonl"
    if args.resume and state_path.exists():
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed, tokens_seen = st["step"], st["elapsed"], st["tokens_seen"]
        torch.set_rng_state(st["torch_rng"])
        print(f"resumed from {state_path} at step {step}", file=sys.stderr)
    elif log_path.exists():
        log_path.unlink()
    (args.out / "args.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}, indent=2) + "\n")

    def log(rec: dict) -> None:
        with log_path.open("a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def checkpoint() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                    "tokens_seen": tokens_seen, "torch_rng": torch.get_rng_state(),
                    "config": config.to_dict()}, tmp)
        os.replace(tmp, state_path)

    if step == 0:
        first = evaluate(model, valid, args.micro, teacher)
        log({"step": 0, "params": n_params, "config": config.to_dict(), "eval": first})
    bar = tqdm(total=args.steps, initial=step, disable=not args.progress, dynamic_ncols=True, mininterval=2)
    loss_ema = None
    ul_sums = [0.0, 0.0, 0]  # unlikelihood: penalty, repeated share, steps
    while step < args.steps:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        batch = batches.get(step)
        labels = teacher_labels(teacher, batch, args.micro) if teacher is not None else None
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, args.batch, args.micro):
            mb = batch[i:i + args.micro]
            with bf16_autocast():
                if labels is None:
                    loss = lm_loss(model, mb)
                else:
                    w = args.teacher_frac
                    loss = w * lm_loss(model, mb, labels[i:i + args.micro])
                    if w < 1.0:
                        loss = loss + (1 - w) * lm_loss(model, mb)
            (loss * len(mb) / args.batch).backward()
            total += float(loss.detach()) * len(mb) / args.batch
        if ul_prefixes is not None and step % args.ul_every == 0:
            seq = greedy_rollouts(model, ul_prefixes.get(step), args.ul_tokens)
            mask = repeated_ngram_mask(seq, args.ul_prefix, args.ul_ngram)
            with bf16_autocast():
                ul = unlikelihood_loss(model, seq, mask, args.ul_prefix)
            (args.ul_weight * ul).backward()
            repeated = float(mask.sum()) / mask[:, args.ul_prefix:].numel()
            ul_sums = [ul_sums[0] + float(ul.detach()), ul_sums[1] + repeated, ul_sums[2] + 1]
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        step += 1
        tokens_seen += batch.shape[0] * args.seq_len
        elapsed += time.perf_counter() - t0
        loss_ema = total if loss_ema is None else 0.98 * loss_ema + 0.02 * total
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}")
        rec: dict = {}
        if step % args.eval_every == 0 or step == args.steps:
            rec["eval"] = evaluate(model, valid, args.micro, teacher)
        if step % 50 == 0 or rec:
            rec.update(step=step, loss=round(total, 4), loss_ema=round(loss_ema, 4), lr=lr_at(step - 1, args),
                       grad_norm=round(gnorm, 3), tokens_seen=tokens_seen, elapsed_s=round(elapsed, 1))
            if ul_sums[2]:  # means since the last record: the penalty and the share of repeated positions
                rec.update(ul_loss=round(ul_sums[0] / ul_sums[2], 4), ul_repeated=round(ul_sums[1] / ul_sums[2], 3))
                ul_sums = [0.0, 0.0, 0]
            log(rec)
            if "eval" in rec:
                bar.write(f"step {step} loss {loss_ema:.3f} held-out {rec['eval']}")
        if step % args.ckpt_every == 0 or step == args.steps:
            checkpoint()
    bar.close()
    final = evaluate(model, valid, args.micro, teacher)
    save_hf(model, tokenizer, args.out / "hf")
    summary = {"params": n_params, "steps": step, "tokens_seen": tokens_seen, "train_time_s": round(elapsed, 1),
               "held_out_loss": final, "config": config.to_dict()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("params", "steps", "tokens_seen", "train_time_s", "held_out_loss")}),
          file=sys.stderr)
    return final


if __name__ == "__main__":
    main()
