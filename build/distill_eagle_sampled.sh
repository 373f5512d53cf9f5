#!/usr/bin/env bash
# Train the installed EAGLE head further on the target's *sampled* answers, at the temperature each was sampled
# at, with the total variation (1 - sum min(p, q), the rejection rate of speculative sampling) beside the soft
# cross-entropy, and keep the head that is best on greedy agreement and sampled overlap together (docs/MODELS.md,
# "Stage 10"). Every step is resumable: run it again after a stop and it goes on where it was.
#
#   bash build/distill_eagle_sampled.sh          # after `make setup`; INSTALL=1 installs the best head
#
# 1. build/target_answers.py: the served target (its onnxruntime graph, the GGUF file's blocks) answers the
#    prompts of PROMPTS (an answers file: the committed greedy answers to seed 2033's requests by default) once at
#    temperature 0.7 / top_p 0.95 and once at 1.0, 128 new tokens, a seed per answer, until ANSWERS are made;
# 2. build/eagle_features.py records the target's features (and layers 2, 15, 26) of those answers and of
#    GREEDY_EXAMPLES of PROMPTS' greedy answers;
# 3. build/train_eagle.py trains the installed head STEPS steps over its proposal vocabulary widened by the tokens
#    among the PROPOSAL_ADD most frequent of the training answers (at temperature 1, 18% of the target's mass lies
#    outside the installed 4,096 tokens); 10% of the requests (by a hash of the request id, greedy and sampled
#    answers alike) are held out and scored at step 0 (the installed head) and every 50 steps.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
TARGET=${TARGET:-model_repository/target_model/1}
HEAD=${HEAD:-model_repository/eagle_draft/1}
PROMPTS=${PROMPTS:-build/answers/chat2033-cpu.jsonl.gz}
DATA=${DATA:-data/sampled}
FEATURES=${FEATURES:-data/eagle-sampled}
RUN=${RUN:-runs/eagle-sampled}
ANSWERS=${ANSWERS:-2000}
GREEDY_EXAMPLES=${GREEDY_EXAMPLES:-1000}
STEPS=${STEPS:-300}
TV_WEIGHT=${TV_WEIGHT:-1.0}
PROPOSAL_ADD=${PROPOSAL_ADD:-8192}   # the head's proposal vocabulary, plus the tokens among the N most frequent of
                                     # the training answers (0: the head's own)
SEED=${SEED:-3301}
THREADS=${THREADS:-2}
INSTALL=${INSTALL:-0}

mkdir -p "$DATA" "$FEATURES" "$(dirname "$RUN")"
answers="$DATA/answers.jsonl"
made=$( [ -f "$answers" ] && wc -l < "$answers" || echo 0 )
if [ "$made" -lt "$ANSWERS" ]; then
    echo "[sampled] $made answers made; the served target writes $((ANSWERS - made)) more -> $answers"
    "$PY" build/target_answers.py --target "$TARGET" --prompts-from "$PROMPTS" --sampling t0.7,t1.0 --max-new 128 \
        --runtime served --slots 48 --threads "$THREADS" --limit $((ANSWERS - made)) --out "$answers" \
        >> "$DATA/answers.log" 2>&1
fi

echo "[sampled] recording the target's features -> $FEATURES"
"$PY" build/eagle_features.py --target "$TARGET" --answers "$answers" --out "$FEATURES" --aux-layers 2,15,26 \
    --threads "$THREADS" --no-progress >> "$FEATURES/features.log" 2>&1
greedy=$(cat "$FEATURES"/index_*.jsonl 2>/dev/null | grep -c '"mode": "greedy"' || true)
if [ "$greedy" -lt "$GREEDY_EXAMPLES" ]; then
    "$PY" build/eagle_features.py --target "$TARGET" --answers "$PROMPTS" --out "$FEATURES" --aux-layers 2,15,26 \
        --threads "$THREADS" --limit $((GREEDY_EXAMPLES - greedy)) --no-progress >> "$FEATURES/features.log" 2>&1
fi

resume=()
[ -f "$RUN/state.pt" ] && resume=(--resume)
echo "[sampled] training $STEPS steps -> $RUN (log $RUN.log)"
"$PY" build/train_eagle.py --target "$TARGET" --features "$FEATURES" --out "$RUN" --aux \
    --init-from "$HEAD" --proposal-vocab-file "$HEAD/proposal_vocab.json" --proposal-vocab-add "$PROPOSAL_ADD" \
    --fc-init embedding --fc-lr-scale 1.0 \
    --lr 3e-4 --warmup 20 --steps "$STEPS" --tokens-per-batch 8192 --eval-every 50 --ckpt-every 50 \
    --valid-frac 0.1 --eval-examples 0 --answer-temperatures --tv-weight "$TV_WEIGHT" --select both \
    --threads "$THREADS" --seed "$SEED" --no-progress "${resume[@]}" 2>> "$RUN.log"
if [ "$INSTALL" = 1 ]; then
    cp "$RUN/best/config.json" "$RUN/best/eagle_layers.safetensors" "$RUN/best/proposal_vocab.json" "$HEAD/"
    "$PY" build/default_model.py
    echo "[sampled] installed $RUN/best ($(cat "$RUN/best/agreement.json")); now: make onnx-exports"
fi
