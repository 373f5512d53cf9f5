"""Train an EAGLE draft head for a pretrained target on its recorded features (``build/eagle_features.py``).

The head, for a sequence x_0..x_{T-1} whose target features f_0..f_{T-1} are known (f_t: the target's
final-normed hidden state, ``logits_t = f_t @ E^T``):

* input row j = 0..T-2: ``z_j = fc([E[x_{j+1}], f_j])`` (``eagle.fc``, no bias, embedding half first), at
  RoPE position j;
* one Llama decoder layer (pre-norm, GQA attention with RoPE, SwiGLU MLP), causal over the rows: h_j;
* its own final RMSNorm: ``g_j = norm(h_j)``, the predicted feature (it regresses f_{j+1}); logits
  ``g_j @ E_p^T`` over the proposal vocabulary E_p (FR-Spec) predict x_{j+2}.

EAGLE-3's multi-layer fusion (``--aux``, features recorded with ``--aux-layers``): true rows add
``fc_aux(a_j)``, a_j the outputs of lower target layers at position j, each RMS-normalized without weights
(their scales differ by orders of magnitude between layers and tokens); ``fc_aux`` starts at zero, so a head
trained further starts exactly as it was. Drafted rows have no such outputs (the target has not run on their
tokens): they add nothing, in training (the unrolled step) as in inference.

Drafting, the head's row after the last true one reads its own g as the feature and the drafted token. The
training-time test trains that second step: unrolled row j (j >= 1) reads ``g_{j-1}`` (its prediction of
f_j) and x_{j+1}, attends to the true rows' keys i < j and to its own key (what inference's cache holds then)
and predicts x_{j+2}, i.e. the second draft token after the true row j-1.

Losses, on answer positions of chat answers (x_{j+2} in the answer) and every position of text windows: soft
cross-entropy against the target's distribution restricted to the proposal vocabulary (``softmax(f_{j+1} @
E_p^T)``) plus ``--feature-weight`` x smooth L1 between g_j and f_{j+1}; the unrolled step's losses weigh
``--ttt-weight``. For sampled decoding (answers of ``target_answers --sampling``): ``--answer-temperatures``
compares a sampled answer's rows at its own temperature, and ``--tv-weight`` adds the total variation ``1 - sum
min(p, q)``, the rejection rate of speculative sampling. E is frozen (shared with the target, not saved); fc, the
layer and the norm are trained. The layer starts from target layer ``--init-layer`` or, with ``--init-from``, from
a trained 1-layer draft (``build/train_draft.py``: with ``--fc-init embedding`` the head then starts as that
draft, which reads the tokens only); fc learns at ``--fc-lr-scale`` times the layer's rate (``ScaledLinear``).
Held-out examples (a hash of the id) give the top-1 agreement with the target's argmax per domain (step 1: alpha
at k = 1 for greedy speculation; step 2: the unrolled step) and, on sampled answers, ``sum min(p, q)`` at the
answer's temperature and top_p (``overlap``: alpha for speculative sampling); ``<out>/best`` keeps the head of the
best held-out figure (``--select``) as an installable folder (config.json, eagle_layers.safetensors,
proposal_vocab.json, agreement.json). Resumable (``<out>/state.pt``). Usage::

    python build/train_eagle.py --target model_repository/target_model/1 --features data/eagle \\
        --out runs/eagle --steps 2000 --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))

from eagle_features import AUX, AUX_LAYERS_FILE, FEATURES, read_index  # noqa: E402
from specdec.checkpoint import (  # noqa: E402
    EAGLE_AUX_LAYERS,
    EAGLE_CONFIG_KEY,
    EAGLE_FC_WEIGHT,
    FEATURE_LAYERS_KEY,
    PROPOSAL_VOCAB_FILE,
    load_state_dict,
)
from specdec.runtime.torch_llama import rms_norm, rotate_half, unit_rms  # noqa: E402
from specdec.sampling import NUCLEUS_CANDIDATES  # noqa: E402
from specdec_client.bench_prompts import SAMPLINGS  # noqa: E402
from train import cpu_has_native_bf16  # noqa: E402
from train_draft import EMBED_KEY, _held_out, batches, choose_proposal_vocab  # noqa: E402

EAGLE_WEIGHTS = "eagle_layers.safetensors"
EAGLE_FC_AUX_WEIGHT = "eagle.fc_aux.weight"  # read from heads saved before the servable form (one wider fc)
AGREEMENT_FILE = "agreement.json"
LAYER_KEYS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
FC_INITS = ("feature", "embedding", "both")


# ----------------------------------------------------------------------------------------------------- data

def sampling_of(row: dict) -> str:
    """The decoding mode an answer was written in: ``<request id>@<mode>`` (``target_answers --sampling``),
    else its ``mode`` (``greedy``, ``text``, or ``sampled``: t0.7, the share ``--sampled-frac`` sampled)."""
    if "@" in row["id"]:
        return row["id"].split("@", 1)[1]
    return "t0.7" if row["mode"] == "sampled" else row["mode"]


def answer_temperature(example: dict) -> float:
    """The temperature an answer was sampled at (1.0 for greedy answers and text windows)."""
    return float(SAMPLINGS.get(example.get("sampling", ""), {}).get("temperature") or 1.0)


def load_features(dirs: list[Path], valid_frac: float, max_len: int,
                  aux: bool = False) -> tuple[list[dict], list[dict], dict]:
    """(train, valid, arrays): examples ``{"id", "ids", "start", "domain", "mode", "kind", "src", "offset"}``
    (``start``: first answer position, 0 for text windows; ``src``: key of its features in ``arrays``, the
    memory-mapped float16 shards; with ``aux``, ``(*src, "aux")`` keys its aux layers' shard)."""
    train, valid, arrays, seen = [], [], {}, set()
    for d, folder in enumerate(dirs):
        for row in read_index(folder):
            # A duplicate is the same token sequence, not the same id: folders of different stages reuse ids
            # (request ids of another seed, text windows of another seed) for different examples.
            sequence = tuple(row["ids"])
            if sequence in seen:
                continue
            seen.add(sequence)
            src = (d, row["shard"])
            if src not in arrays:
                arrays[src] = np.load(folder / FEATURES.format(row["shard"]), mmap_mode="r")
                if aux:
                    arrays[(*src, "aux")] = np.load(folder / AUX.format(row["shard"]), mmap_mode="r")
            text = row["mode"] == "text"
            example = {"id": row["id"], "ids": row["ids"][:max_len], "start": 0 if text else row["prompt_len"],
                       "domain": row["domain"], "mode": row["mode"], "kind": row.get("kind", ""), "src": src,
                       "offset": row["offset"], "sampling": sampling_of(row)}
            if len(example["ids"]) - 2 < max(example["start"] - 2, 0) + 1:
                continue  # no position to learn from (an answer cut off by max_len)
            (valid if _held_out(row["id"], valid_frac) else train).append(example)
    return train, valid, arrays


def loss_rows(batch: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` [B, W]: the head rows computed in full (first answer row - 3 onward: one row before the first
    loss row, whose g the unrolled step reads); ``mask`` [B, W]: rows j with x_{j+2} on the answer (or text)."""
    width = max(len(ex["ids"]) for ex in batch)
    first = [max(ex["start"] - 3, 0) for ex in batch]
    span = max(len(ex["ids"]) - 2 - f for ex, f in zip(batch, first, strict=True))
    rows = torch.zeros((len(batch), span), dtype=torch.long)
    mask = torch.zeros((len(batch), span), dtype=torch.bool)
    for b, (ex, f) in enumerate(zip(batch, first, strict=True)):
        j = torch.arange(f, f + span)
        rows[b] = j.clamp(max=width - 2)
        mask[b] = (j + 2 >= ex["start"]) & (j <= len(ex["ids"]) - 3)
    return rows, mask


def collate(batch: list[dict], arrays: dict) -> dict[str, torch.Tensor]:
    """Right-padded ``ids`` [B, T], ``feats`` [B, T, H] (fp32), where recorded ``aux`` [B, T, layers * H], the
    rows the losses read (``loss_rows``) and each example's sampling ``temperature`` [B]."""
    width = max(len(ex["ids"]) for ex in batch)
    hidden = arrays[batch[0]["src"]].shape[1]
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    feats = torch.zeros((len(batch), width, hidden), dtype=torch.float32)
    aux_key = (*batch[0]["src"], "aux")
    aux = None
    if aux_key in arrays:
        layers = arrays[aux_key].shape[1]
        aux = torch.zeros((len(batch), width, layers * hidden), dtype=torch.float32)
    for b, ex in enumerate(batch):
        n = len(ex["ids"])
        ids[b, :n] = torch.as_tensor(ex["ids"])
        feats[b, :n] = torch.from_numpy(np.asarray(arrays[ex["src"]][ex["offset"]:ex["offset"] + n],
                                                   dtype=np.float32))
        if aux is not None:
            aux[b, :n] = torch.from_numpy(np.asarray(arrays[(*ex["src"], "aux")][ex["offset"]:ex["offset"] + n],
                                                     dtype=np.float32).reshape(n, -1))
    rows, mask = loss_rows(batch)
    out = {"ids": ids, "feats": feats, "rows": rows, "mask": mask,
           "temperature": torch.tensor([answer_temperature(ex) for ex in batch], dtype=torch.float32)}
    if aux is not None:
        out["aux"] = aux
    return out


# ---------------------------------------------------------------------------------------------------- model

class EagleLayer(torch.nn.Module):
    """One Llama decoder layer under Hugging Face names, the math of ``specdec.runtime.torch_llama``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float):
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.ones(hidden))
        self.post_attention_layernorm = torch.nn.Module()
        self.post_attention_layernorm.weight = torch.nn.Parameter(torch.ones(hidden))
        self.self_attn = torch.nn.Module()
        self.self_attn.q_proj = lin(hidden, heads * head_dim)
        self.self_attn.k_proj = lin(hidden, kv_heads * head_dim)
        self.self_attn.v_proj = lin(hidden, kv_heads * head_dim)
        self.self_attn.o_proj = lin(heads * head_dim, hidden)
        self.mlp = torch.nn.Module()
        self.mlp.gate_proj = lin(hidden, intermediate)
        self.mlp.up_proj = lin(hidden, intermediate)
        self.mlp.down_proj = lin(intermediate, hidden)

    def _heads(self, x: torch.Tensor, n: int, cos: torch.Tensor, sin: torch.Tensor | None) -> torch.Tensor:
        """[B, R, n*D] -> [B, n, R, D], rotated when cos/sin [B, 1, R, D] are given."""
        x = x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)
        return x if sin is None else x * cos + rotate_half(x) * sin

    def keys_values(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed input, rotated keys and values of rows ``z`` [B, R, H]."""
        x = rms_norm(z, self.input_layernorm.weight, self.eps)
        k = self._heads(self.self_attn.k_proj(x), self.kv_heads, cos, sin)
        v = self._heads(self.self_attn.v_proj(x), self.kv_heads, None, None)
        return x, k, v

    def finish(self, z: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h of query rows ``z`` [B, W, H] (normed ``x``) over ``keys``/``values`` [B, kv, K, D] where ``mask``
        [B, 1, W, K] allows. Attention runs in fp32 (torch's CPU attention is several times slower in bf16)."""
        q = self._heads(self.self_attn.q_proj(x), self.heads, cos, sin)
        with torch.autocast(z.device.type, enabled=False):
            attn = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                                  scale=1.0 / math.sqrt(self.head_dim),
                                                  enable_gqa=self.heads != self.kv_heads)
        attn = attn.transpose(1, 2).reshape(*z.shape[:2], self.heads * self.head_dim)
        h = z + self.self_attn.o_proj(attn).float()
        y = rms_norm(h, self.post_attention_layernorm.weight, self.eps)
        return h + self.mlp.down_proj(F.silu(self.mlp.gate_proj(y)) * self.mlp.up_proj(y)).float()


class ScaledLinear(torch.nn.Module):
    """A bias-free linear layer learnt through per-input-column scales: ``weight = raw * scale``.

    Adam moves every raw entry by about the learning rate a step, so column i learns at ``lr * scale[i]``. fc
    needs that: its output is the residual stream at the embeddings' small scale, and its feature columns read
    inputs ~15x larger than the embedding columns (the target's final-normed states against its embeddings);
    at the layer's learning rate, its first steps swamp the rows (measured: a trained draft's KL 2.5 -> 4.5)."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.raw = torch.nn.Parameter(torch.zeros(outputs, inputs))
        self.register_buffer("scale", torch.ones(inputs))

    @property
    def weight(self) -> torch.Tensor:
        return self.raw * self.scale

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        if scale is not None:
            self.scale.copy_(scale)
        self.raw.copy_(weight / self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _take(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, R, ...] at rows [B, W] -> [B, W, ...]."""
    index = rows.view(*rows.shape, *([1] * (x.dim() - 2))).expand(*rows.shape, *x.shape[2:])
    return x.gather(1, index)


class EagleHead(torch.nn.Module):
    """fc + one decoder layer + final norm over frozen shared embeddings (see the module docstring)."""

    def __init__(self, target_dir: Path, proposal_ids: list[int], init_layer: int = 29,
                 fc_init: str = "embedding", fc_noise: float = 0.0, seed: int = 0,
                 init_from: Path | None = None, fc_lr_scale: float = 1.0, feature_rms: float | None = None,
                 aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        config = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
        self.config = config
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([EagleLayer(
            hidden, heads, int(config.get("num_key_value_heads") or heads), head_dim,
            int(config["intermediate_size"]), self.eps)])
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eagle = torch.nn.Module()
        self.eagle.fc = ScaledLinear(2 * hidden, hidden)
        self.aux_layers = tuple(aux_layers)
        if self.aux_layers:  # zero at the start: the head is what it was until the fusion learns something
            self.eagle.fc_aux = ScaledLinear(len(self.aux_layers) * hidden, hidden)
        state = load_state_dict(target_dir)
        embed = state[EMBED_KEY]
        self.register_buffer("embed", embed.to(torch.bfloat16), persistent=False)  # frozen, shared
        self.register_buffer("proposal", torch.as_tensor(proposal_ids, dtype=torch.long), persistent=False)
        self.register_buffer("head", embed[self.proposal].float(), persistent=False)  # E_p
        from specdec.checkpoint import read_spec

        cos, sin = read_spec(target_dir).rope_tables(int(config.get("max_position_embeddings", 2048)))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        with torch.no_grad():
            prefix = f"model.layers.{init_layer}."
            self.model.layers[0].load_state_dict({k: state[prefix + k].float() for k in LAYER_KEYS})
            self.model.norm.weight.copy_(state["model.norm.weight"].float())
            # Feature columns read inputs feature_rms / rms(E) times larger than the embedding columns: their
            # noise and learning rate are that much smaller, so both halves move the rows alike.
            ratio = torch.ones(2 * hidden)
            if feature_rms:
                ratio[hidden:] = float(embed.float().pow(2).mean().sqrt()) / feature_rms
            gen = torch.Generator().manual_seed(seed)
            w = torch.randn(hidden, 2 * hidden, generator=gen) * fc_noise * ratio
            eye = torch.eye(hidden)
            if fc_init in ("embedding", "both"):
                w[:, :hidden] = eye
            if fc_init in ("feature", "both"):
                w[:, hidden:] = eye
            self.eagle.fc.set_weight(w, fc_lr_scale * ratio)
            if self.aux_layers:  # inputs RMS-normalized to 1: learnt at the embeddings' scale, as the features
                embed_rms = float(embed.float().pow(2).mean().sqrt())
                self.eagle.fc_aux.scale.fill_(fc_lr_scale * embed_rms)
            if init_from is not None:  # a trained 1-layer draft (train_draft.py) or EAGLE head: its layer and norm
                start = load_state_dict(init_from)
                own = {k: v.float() for k, v in start.items() if k.startswith(("model.layers.0.", "model.norm."))
                       or k in (EAGLE_FC_WEIGHT, EAGLE_FC_AUX_WEIGHT)}
                missing = set(self.own_state()) - set(own) - {EAGLE_FC_WEIGHT, EAGLE_FC_AUX_WEIGHT}
                if missing:
                    raise KeyError(f"{init_from} has no {sorted(missing)}")
                self.load_own(own)

    @property
    def layer(self) -> EagleLayer:
        return self.model.layers[0]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]

    def fused(self, aux: torch.Tensor) -> torch.Tensor:
        """fc_aux's term of true rows from their aux layers' outputs [B, R, layers * H]."""
        blocks = unit_rms(aux.view(*aux.shape[:2], len(self.aux_layers), -1), self.eps)  # as the target does
        return self.eagle.fc_aux(blocks.flatten(2)).float()

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, rows: torch.Tensor, ttt: bool = True,
                detach: bool = False, aux: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(g [B, W, H] of the true rows ``rows``, g' [B, W-1, H] of the unrolled rows ``rows[:, 1:]`` or None).

        True rows 0..T-2 all give keys/values; only ``rows`` run the rest of the layer (nothing else reads it)."""
        batch, width = ids.shape
        n = width - 1
        # The residual stream stays fp32 under autocast (only the matmuls run in bf16).
        z = self.eagle.fc(torch.cat([self.embed[ids[:, 1:]].to(feats.dtype), feats[:, :-1]], dim=-1)).float()
        if self.aux_layers:
            if aux is None:
                raise ValueError("a fused head needs the aux layers' outputs (features recorded with --aux-layers)")
            z = z + self.fused(aux[:, :-1])
        cos, sin = self._rope(torch.arange(n, device=ids.device).expand(batch, n))
        x, k, v = self.layer.keys_values(z, cos, sin)
        cos_w, sin_w = self._rope(rows)
        keys = torch.arange(n, device=ids.device)
        causal = (keys[None, None, :] <= rows[:, :, None])[:, None]  # [B, 1, W, n]
        h = self.layer.finish(_take(z, rows), _take(x, rows), k, v, causal, cos_w, sin_w)
        g = rms_norm(h, self.model.norm.weight, self.eps)
        if not ttt or rows.shape[1] < 2:
            return g, None
        # The unrolled step: row j reads its own g_{j-1} and x_{j+1}; true keys i < j, then its own key.
        rows2 = rows[:, 1:]
        own = g[:, :-1].detach() if detach else g[:, :-1]
        z2 = self.eagle.fc(torch.cat([self.embed[ids.gather(1, rows2 + 1)].to(own.dtype), own], dim=-1)).float()
        cos2, sin2 = self._rope(rows2)
        x2, k2, v2 = self.layer.keys_values(z2, cos2, sin2)
        width2 = rows2.shape[1]
        earlier = (keys[None, None, :] < rows2[:, :, None])  # [B, W', n]
        diagonal = torch.eye(width2, dtype=torch.bool, device=ids.device).expand(batch, width2, width2)
        mask = torch.cat([earlier, diagonal], dim=-1)[:, None]
        h2 = self.layer.finish(z2, x2, torch.cat([k, k2], dim=2), torch.cat([v, v2], dim=2), mask, cos2, sin2)
        return g, rms_norm(h2, self.model.norm.weight, self.eps)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Proposal-vocabulary logits of predicted features."""
        return g @ self.head.to(g.dtype).T

    def own_state(self) -> dict[str, torch.Tensor]:
        """What the head commits, in bf16 under Hugging Face names: the layer, the norm, eagle.fc.weight. A fused
        head's fc is fc and fc_aux side by side, over [embedding, feature, normalized aux layers]: the servable
        form (specdec.checkpoint.FEATURE_LAYERS_KEY), the plain head's graph with a wider input."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("eagle.")}
        state[EAGLE_FC_WEIGHT] = self.eagle.fc.weight
        if self.aux_layers:
            state[EAGLE_FC_WEIGHT] = torch.cat([self.eagle.fc.weight, self.eagle.fc_aux.weight], dim=1)
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}

    def load_own(self, state: dict[str, torch.Tensor]) -> None:
        """Load tensors named as ``own_state`` names them (eagle.fc.weight optional: a draft has none)."""
        state = dict(state)
        if EAGLE_FC_WEIGHT in state:
            fc = state.pop(EAGLE_FC_WEIGHT).float()
            plain = self.eagle.fc.raw.shape[1]
            if fc.shape[1] > plain:  # the servable form of a fused head: fc, then fc_aux
                state[EAGLE_FC_AUX_WEIGHT], fc = fc[:, plain:], fc[:, :plain]
            self.eagle.fc.set_weight(fc)
        if EAGLE_FC_AUX_WEIGHT in state:
            aux = state.pop(EAGLE_FC_AUX_WEIGHT).float()
            if not self.aux_layers or aux.shape != self.eagle.fc_aux.raw.shape:
                raise KeyError(f"{EAGLE_FC_AUX_WEIGHT} {list(aux.shape)}: a fused head of other aux layers "
                               "(trained further only with --aux on features of the same layers)")
            self.eagle.fc_aux.set_weight(aux)
        result = self.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        if result.unexpected_keys:
            raise KeyError(f"not tensors of the head: {result.unexpected_keys}")


def _aux(batch: dict) -> dict[str, torch.Tensor]:
    """The head's ``aux`` argument where the batch carries the aux layers' outputs."""
    return {"aux": batch["aux"]} if "aux" in batch else {}


def losses(model: EagleHead, batch: dict, feature_weight: float, ttt_weight: float, detach: bool,
           bf16: bool, temperatures: bool = False, tv_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss of a batch and its parts (soft CE, its KL, smooth L1, total variation; 2: the unrolled
    step). With ``temperatures``, an answer's rows compare the distributions at the temperature it was sampled
    at (``batch["temperature"]``; greedy answers and text at 1): what speculative sampling at that temperature
    accepts. ``tv_weight`` adds the total variation ``1 - sum min(p, q)`` over the proposal vocabulary, the
    rejection rate itself (DistillSpec's objective for sampled decoding)."""
    device = batch["ids"].device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        g, g2 = model(batch["ids"], batch["feats"], batch["rows"], ttt=ttt_weight > 0, detach=detach,
                      **_aux(batch))
    mask = batch["mask"]
    parts: dict[str, float] = {}
    if not mask.any():
        return torch.zeros((), device=device), parts
    want = _take(batch["feats"][:, 1:], batch["rows"])[mask]  # f_{j+1} of the loss rows
    if temperatures and "temperature" in batch:
        temperature = batch["temperature"].to(device)[:, None].expand_as(mask)[mask][:, None]
    else:
        temperature = torch.ones((want.shape[0], 1), device=device)
    with torch.no_grad():  # the target's distribution over the proposal vocabulary, in fp32
        p_log = F.log_softmax(model.logits(want) / temperature, dim=-1)
        p = p_log.exp()
        neg_entropy = (p * p_log).sum(-1)
    steps = [("", g[mask], slice(None), 1.0)]
    if g2 is not None:
        later = mask.clone()
        later[:, 0] = False  # the unrolled rows: every loss row but a window's first
        steps.append(("2", g2[mask[:, 1:]], later[mask], ttt_weight))
    total = torch.zeros((), device=device)
    for name, pred, keep, weight in steps:
        if pred.shape[0] == 0:
            continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model.logits(pred)
        q_log = F.log_softmax(logits.float() / temperature[keep], dim=-1)
        ce = -(p[keep] * q_log).sum(-1).mean()
        reg = F.smooth_l1_loss(pred.float(), want[keep])
        total = total + weight * (ce + feature_weight * reg)
        if tv_weight:
            tv = 0.5 * (p[keep] - q_log.exp()).abs().sum(-1).mean()
            total = total + weight * tv_weight * tv
            parts[f"tv{name}"] = round(tv.item(), 4)
        parts[f"ce{name}"] = round(ce.item(), 4)
        parts[f"kl{name}"] = round(ce.item() + neg_entropy[keep].mean().item(), 4)
        parts[f"l1{name}"] = round(reg.item(), 4)
    return total, parts


def _where(example: dict) -> tuple:
    """Where an example's features are (unique; ids are not across folders)."""
    return (*example["src"], example["offset"])


@torch.no_grad()
def agreement(model: EagleHead, examples: list[dict], arrays: dict, tokens_per_batch: int,
              cache: dict, collate_fn=collate) -> tuple[dict[str, float], dict[str, float]]:
    """Per domain (``<domain>-text`` for text windows), the share of loss rows where the head's argmax is the
    target's (``argmax f_{j+1} @ E^T`` over the whole vocabulary): step 1 and the unrolled step 2.
    ``collate_fn(group, arrays)`` makes a batch (``collate``'s contract; the GPU driver's keeps its features on
    the GPU)."""
    model.eval()
    hits: dict[str, list[int]] = {}
    group, width = [], 0
    embed = model.embed.float() if any(_where(ex) not in cache for ex in examples) else None
    pending = sorted(examples, key=lambda e: len(e["ids"]))
    for i, ex in enumerate(pending):
        group.append(ex)
        width = max(width, len(ex["ids"]))
        last = i + 1 == len(pending)
        if not last and width * (len(group) + 1) <= tokens_per_batch:
            continue
        batch = collate_fn(group, arrays)
        g, g2 = model(batch["ids"], batch["feats"], batch["rows"], ttt=True, **_aux(batch))
        target = _take(batch["feats"][:, 1:], batch["rows"])
        for b, e in enumerate(group):
            if _where(e) not in cache:  # the target's own argmax at each row, over its whole vocabulary
                cache[_where(e)] = (target[b] @ embed.T).argmax(-1)
            want, mask = cache[_where(e)], batch["mask"][b]
            key = f"{e['domain']}-text" if e["mode"] == "text" else e["domain"]
            one = model.proposal[model.logits(g[b]).argmax(-1)] == want
            h = hits.setdefault(key, [0, 0, 0, 0])
            h[0] += int(one[mask].sum())
            h[1] += int(mask.sum())
            if g2 is not None:
                two = model.proposal[model.logits(g2[b]).argmax(-1)] == want[1:]
                h[2] += int(two[mask[1:]].sum())
                h[3] += int(mask[1:].sum())
        group, width = [], 0
    model.train()
    one = {k: round(h[0] / max(h[1], 1), 4) for k, h in sorted(hits.items())}
    two = {k: round(h[2] / max(h[3], 1), 4) for k, h in sorted(hits.items())}
    return one, two


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Rows of ``specdec.sampling.probabilities`` in torch (fp32): temperature, then the nucleus (the tokens
    up to and including the one whose cumulative mass reaches ``top_p``), renormalized."""
    probs = F.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    width = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    ranked, where = probs.topk(width, dim=-1)
    if not bool(((ranked.cumsum(-1) - ranked) >= top_p).any(-1).all()):  # a row whose nucleus is wider
        ranked, where = probs.sort(dim=-1, descending=True)
    ranked = ranked.masked_fill((ranked.cumsum(-1) - ranked) >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, where, ranked)
    return kept / kept.sum(-1, keepdim=True)


@torch.no_grad()
def overlap(model: EagleHead, examples: list[dict], arrays: dict, tokens_per_batch: int,
            collate_fn=collate, rows_per_chunk: int = 512) -> tuple[dict[str, float], dict[str, float]]:
    """Per ``<domain> <mode>``, the mean over the answers' rows of ``sum min(p, q)``: p the target's sampling
    distribution (its whole vocabulary) and q the head's (its proposal vocabulary), both at the temperature and
    top_p the answer was sampled with: the chance that speculative sampling accepts a drafted token at that
    row (step 1; step 2: the unrolled step's). Sampled answers only (``target_answers --sampling``)."""
    model.eval()
    sums: dict[str, list[float]] = {}
    embed = model.embed.float()  # stored in bf16; the proposal rows as the head's logits read them
    embed[model.proposal] = model.head.float()
    pending = sorted((ex for ex in examples if SAMPLINGS.get(ex.get("sampling", ""), {}).get("temperature")),
                     key=lambda e: len(e["ids"]))
    group, width = [], 0
    for i, ex in enumerate(pending):
        group.append(ex)
        width = max(width, len(ex["ids"]))
        if i + 1 < len(pending) and width * (len(group) + 1) <= tokens_per_batch:
            continue
        batch = collate_fn(group, arrays)
        g, g2 = model(batch["ids"], batch["feats"], batch["rows"], ttt=True, **_aux(batch))
        target = _take(batch["feats"][:, 1:], batch["rows"])
        for b, e in enumerate(group):
            mode = SAMPLINGS[e["sampling"]]
            t, top_p = float(mode["temperature"]), float(mode.get("top_p", 1.0))
            mask = batch["mask"][b]
            s = sums.setdefault(f"{e['domain']} {e['sampling']}", [0.0, 0, 0.0, 0])
            for step, (pred, rows) in enumerate([(g[b][mask], target[b][mask]),
                                                  (g2[b][mask[1:]] if g2 is not None else None,
                                                   target[b][1:][mask[1:]])]):
                if pred is None:
                    continue
                for at in range(0, pred.shape[0], rows_per_chunk):
                    p = sampling_probs(rows[at:at + rows_per_chunk] @ embed.T, t, top_p)[:, model.proposal]
                    q = sampling_probs(model.logits(pred[at:at + rows_per_chunk]), t, top_p)
                    s[2 * step] += float(torch.minimum(p, q).sum())
                    s[2 * step + 1] += p.shape[0]
        group, width = [], 0
    model.train()
    one = {k: round(s[0] / max(s[1], 1), 4) for k, s in sorted(sums.items())}
    two = {k: round(s[2] / max(s[3], 1), 4) for k, s in sorted(sums.items())}
    return one, two


def save_head(model: EagleHead, proposal_ids: list[int], out: Path, scores: dict | None = None) -> None:
    """The installable folder: config.json, eagle_layers.safetensors, proposal_vocab.json[, agreement.json]."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = dict(model.config)
    config.pop(FEATURE_LAYERS_KEY, None)  # the target's (what it returns for a fused head), not the head's
    config["num_hidden_layers"] = 1
    hidden = int(config["hidden_size"])
    config[EAGLE_CONFIG_KEY] = {"feature_size": hidden * (1 + len(model.aux_layers)), "feature": "final_norm"}
    if model.aux_layers:  # EAGLE-3 fusion: the target must list the same layers (FEATURE_LAYERS_KEY)
        config[EAGLE_CONFIG_KEY][EAGLE_AUX_LAYERS] = list(model.aux_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(model.own_state(), str(out / EAGLE_WEIGHTS), metadata={"format": "pt"})
    os.chmod(out / EAGLE_WEIGHTS, 0o644)  # safetensors writes 0600: readable where the folder is copied
    (out / PROPOSAL_VOCAB_FILE).write_text(json.dumps({"token_ids": proposal_ids}) + "\n", encoding="utf-8")
    if scores is not None:
        (out / AGREEMENT_FILE).write_text(json.dumps(scores) + "\n", encoding="utf-8")


def _mean_step1(scores: dict) -> float:
    values = [v for k, v in scores.items() if k not in ("step", "step2")]
    return sum(values) / max(len(values), 1)


def main(argv: list[str] | None = None) -> dict:
    """Command line entry point; returns the last evaluation's record."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("model_repository/target_model/1"))
    ap.add_argument("--features", type=Path, action="append", default=[],
                    help="feature folder of build/eagle_features.py (repeatable; default data/eagle)")
    ap.add_argument("--out", type=Path, required=True, help="run folder: state.pt, log.jsonl, best/, last/")
    ap.add_argument("--init-layer", type=int, default=29, help="target layer the head's layer starts from")
    ap.add_argument("--fc-init", choices=FC_INITS, default="embedding",
                    help="which half of fc starts as the identity (the other: noise of --fc-noise)")
    ap.add_argument("--fc-noise", type=float, default=0.0, help="std of fc's other half at the start (feature "
                    "columns: scaled as their learning rate)")
    ap.add_argument("--fc-lr-scale", type=float, default=0.1, help="fc learns at this times --lr (its feature "
                    "columns further scaled by the embeddings' RMS over the features'; see ScaledLinear)")
    ap.add_argument("--init-from", type=Path, help="start the layer and norm from this checkpoint folder (a trained "
                    "1-layer draft of train_draft.py, e.g. model_repository/draft_model/1, or an EAGLE head: "
                    "then fc too); --init-layer is then unused")
    ap.add_argument("--proposal-vocab", type=int, default=4096)
    ap.add_argument("--proposal-vocab-file", type=Path, help="take this proposal_vocab.json instead")
    ap.add_argument("--proposal-vocab-add", type=int, default=0, help="with --proposal-vocab-file: also the tokens "
                    "among the N most frequent of the training answers (sampled answers reach tokens greedy ones "
                    "do not: mass the head cannot propose is acceptance lost)")
    ap.add_argument("--feature-weight", type=float, default=0.5, help="weight of the smooth L1 feature loss")
    ap.add_argument("--ttt-weight", type=float, default=1.0, help="weight of the unrolled step (0: off)")
    ap.add_argument("--ttt-detach", action="store_true", help="no gradient through the unrolled step's feature")
    ap.add_argument("--answer-temperatures", action="store_true", help="compare a sampled answer's rows at the "
                    "temperature it was sampled at (greedy answers and text at 1)")
    ap.add_argument("--tv-weight", type=float, default=0.0, help="weight of the total variation 1 - sum min(p, q)")
    ap.add_argument("--select", choices=("agreement", "overlap", "both"), default="agreement",
                    help="the best head: held-out step-1 agreement (greedy), sum min(p, q) on held-out sampled "
                    "answers, or the mean of both")
    ap.add_argument("--aux", action="store_true", help="EAGLE-3 fusion: also read the aux layers the features "
                    "were recorded with (build/eagle_features.py --aux-layers)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--valid-frac", type=float, default=0.04)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-examples", type=int, default=160, help="held-out examples evaluated (0: all)")
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bfloat16 autocast (default: where the CPU computes bf16 natively)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--resume", action="store_true", help="continue from <out>/state.pt")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    bf16 = cpu_has_native_bf16() if args.bf16 is None else args.bf16
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    feature_dirs = args.features or [Path("data/eagle")]
    aux_layers: tuple[int, ...] = ()
    if args.aux:
        chosen = {tuple(json.loads((d / AUX_LAYERS_FILE).read_text(encoding="utf-8")))
                  if (d / AUX_LAYERS_FILE).exists() else () for d in feature_dirs}
        if len(chosen) != 1 or () in chosen:
            ap.error(f"--aux needs feature folders recorded with the same --aux-layers, not {sorted(chosen)}")
        aux_layers = chosen.pop()
    train, valid, arrays = load_features(feature_dirs, args.valid_frac, args.max_len, aux=bool(aux_layers))
    if not train:
        ap.error("no recorded features (build/eagle_features.py)")
    config = json.loads((args.target / "config.json").read_text(encoding="utf-8"))
    eos = config.get("eos_token_id")
    always = sorted({t for t in [config.get("bos_token_id"), config.get("pad_token_id"),
                                 *(eos if isinstance(eos, list) else [eos])] if t is not None})
    args.out.mkdir(parents=True, exist_ok=True)
    state_path = args.out / "state.pt"
    resumed = torch.load(state_path, weights_only=False) if args.resume and state_path.exists() else None
    if resumed:
        proposal = resumed["proposal"]
    elif args.proposal_vocab_file:
        given = json.loads(args.proposal_vocab_file.read_text(encoding="utf-8"))["token_ids"]
        added = choose_proposal_vocab(train, args.proposal_vocab_add, always) if args.proposal_vocab_add else []
        proposal = sorted({int(t) for t in given} | set(added) | set(always))
    else:
        proposal = choose_proposal_vocab(train, args.proposal_vocab, always)
    sample = [arrays[ex["src"]][ex["offset"]:ex["offset"] + len(ex["ids"])] for ex in train[:200]]
    feature_rms = float(np.sqrt(np.mean(np.concatenate(sample).astype(np.float32) ** 2)))
    model = EagleHead(args.target, proposal, args.init_layer, args.fc_init, args.fc_noise, args.seed,
                      args.init_from, args.fc_lr_scale, feature_rms, aux_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    step, best = 0, -1.0
    if resumed:
        model.load_state_dict(resumed["model"])
        opt.load_state_dict(resumed["opt"])
        step, best = resumed["step"], resumed.get("best", -1.0)
        torch.set_rng_state(resumed["torch_rng"])
    # Greedy answers and text windows: what the target's argmax is on, hence alpha for greedy speculation.
    scored = [ex for ex in valid if ex["mode"] in ("greedy", "text")]
    eval_set = scored[:args.eval_examples] if args.eval_examples else scored
    sampled = [ex for ex in valid if SAMPLINGS.get(ex["sampling"], {}).get("temperature")]
    sampled_set = sampled[:args.eval_examples] if args.eval_examples else sampled
    held = torch.as_tensor([t for ex in valid for t in ex["ids"][max(ex["start"], 2):]], dtype=torch.long)
    covered = float(torch.isin(held, model.proposal).float().mean()) if held.numel() else 0.0
    print(f"train {len(train)} examples ({sum(len(e['ids']) for e in train):,} tokens), valid {len(valid)} "
          f"({len(eval_set)} greedy and {len(sampled_set)} sampled evaluated); proposal vocabulary "
          f"{len(proposal)} covers {covered:.4f} of held-out answer tokens; bf16 {bf16}", file=sys.stderr)
    cache: dict = {}
    record: dict = {}

    def evaluate(at: int) -> tuple[dict, float]:
        """Held-out scores (``agreement``: greedy; ``overlap``: sum min(p, q) on sampled answers) and the
        figure ``--select`` keeps the best head by."""
        one, two = agreement(model, eval_set, arrays, args.tokens_per_batch, cache)
        scores = {"agreement": one, "agreement_step2": two}
        if sampled_set:
            scores["overlap"], scores["overlap_step2"] = overlap(model, sampled_set, arrays, args.tokens_per_batch)
        print(f"step {at} {json.dumps(scores)}", file=sys.stderr)
        figures = {"agreement": [_mean_step1(one)], "overlap": [_mean_step1(scores.get("overlap", {}))]}
        figures["both"] = figures["agreement"] + figures["overlap"]
        return scores, float(np.mean(figures[args.select]))

    if step == 0:
        scores, best = evaluate(0)  # the start (e.g. a trained draft, --init-from) is a candidate too
        record = {"step": 0, **scores}
        save_head(model, proposal, args.out / "best", {"step": 0, **scores})

    def lr_at(s: int) -> float:
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        t = (s - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    stream = batches(train, args.tokens_per_batch, rng)  # seeded: replayed to the same order after a resume
    for _ in range(step):
        next(stream)
    bar = tqdm(total=args.steps, initial=step, desc="eagle", disable=not args.progress)
    started = time.monotonic()
    with (args.out / "log.jsonl").open("a", encoding="utf-8") as log:
        while step < args.steps:
            batch = collate(next(stream), arrays)
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss, parts = losses(model, batch, args.feature_weight, args.ttt_weight, args.ttt_detach, bf16,
                                 args.answer_temperatures, args.tv_weight)
            opt.zero_grad(set_to_none=True)
            if loss.requires_grad:  # else a batch without a loss row
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            record = {"step": step, "loss": round(loss.item(), 4), **parts, "lr": lr_at(step - 1),
                      "elapsed_s": round(time.monotonic() - started, 1)}
            if step % args.eval_every == 0 or step == args.steps:
                scores, figure = evaluate(step)
                record.update(scores)
                if figure > best:  # the held-out figure --select names, all domains alike: the head to install
                    best = figure
                    save_head(model, proposal, args.out / "best", {"step": step, **scores})
            log.write(json.dumps(record) + "\n")
            log.flush()
            if step % args.ckpt_every == 0 or step == args.steps:
                tmp = state_path.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "best": best,
                            "torch_rng": torch.get_rng_state(), "proposal": proposal,
                            "args": {k: str(v) for k, v in vars(args).items()}}, tmp)
                os.replace(tmp, state_path)
                save_head(model, proposal, args.out / "last")
    bar.close()
    print(f"head in {args.out / 'last'}, the best held-out one in {args.out / 'best'}", file=sys.stderr)
    return record


if __name__ == "__main__":
    main()
