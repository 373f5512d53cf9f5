#!/usr/bin/env bash
# Distil the 1-layer draft onto a finished target, restrict its output layer, install the pair and measure it
# (docs/MODELS.md §4). Run from the repository root after `build/train.py` has finished the target.
#
#   TARGET=checkpoints/target/hf INIT=model_repository/draft_model/1 bash build/distill_draft.sh
#
# 1. hard labels: the draft learns the target's argmax on real training text (--teacher), while the target
#    writes greedy continuations of training-document openings (build/greedy_corpus.py) on the other core;
# 2. the draft learns the target's greedy continuations (what it must predict when serving), then once more
#    with extra JSON continuations (JSON's α lags: its values are where draft and target disagree), then with
#    extra code and prose continuations (a target that does not loop needs more of them);
#    and then code-only rounds: code's alpha is the one that lags on a target whose code does not loop;
# 3. build/import_checkpoint.py installs both, build/draft_vocab.py writes the proposal vocabulary,
#    build/measure_pair.py measures alpha, c, v(k) and the predicted speedup.
set -euo pipefail

TARGET=${TARGET:-checkpoints/target/hf}
INIT=${INIT:-model_repository/draft_model/1}   # warm start; the next-token draft (checkpoints/draft/hf) works too
OUT=${OUT:-checkpoints/distill}
PY=${PY:-.venv/bin/python}
SEQUENCES=${SEQUENCES:-192}                     # greedy continuations per domain
REAL_STEPS=${REAL_STEPS:-100}
GREEDY_STEPS=${GREEDY_STEPS:-80}
EXTRA_JSON=${EXTRA_JSON:-320}                   # a third round on more JSON continuations (0: skip)
EXTRA_CODE=${EXTRA_CODE:-320}                   # a fourth round on more code and prose continuations (both 0: skip)
EXTRA_PROSE=${EXTRA_PROSE:-256}
MORE_STEPS=${MORE_STEPS:-100}                   # the fourth round's steps
MORE_MIX=${MORE_MIX:-code=1.3,json=1,prose=1.3}
CODE_ROUNDS=${CODE_ROUNDS:-"1280:200 2560:300 5120:400"}  # code-only rounds after it, COUNT:STEPS each ("": skip)
CODE_MIX=${CODE_MIX:-code=2,json=1,prose=1.2}
PROPOSAL_VOCAB=${PROPOSAL_VOCAB:-2048}          # 0: keep the draft's whole output layer
export MALLOC_MMAP_THRESHOLD_=1000000000 MALLOC_TRIM_THRESHOLD_=1000000000

mkdir -p "$OUT"
common=(--layers 1 --hidden 256 --heads 4 --kv-heads 4 --intermediate 704 --seq-len 512 --batch 8 --micro 2
        --warmup 5 --min-lr-frac 0.2 --teacher "$TARGET" --teacher-frac 1 --threads 1 --eval-windows 8
        --no-progress --tokenizer "$TARGET")

generate() {  # generate DOMAIN COUNT SEED NAME [THREADS]: COUNT greedy continuations of DOMAIN in $OUT/NAME
    "$PY" build/greedy_corpus.py --target "$TARGET" --out "$OUT/$4" --sequences "$2" --domains "$1" --seed "$3" \
        --threads "${5:-1}" > "$OUT/$4.log" 2>&1
}

echo "[distill] greedy continuations of $TARGET -> $OUT/greedy (log $OUT/greedy.log)"
"$PY" build/greedy_corpus.py --target "$TARGET" --out "$OUT/greedy" --sequences "$SEQUENCES" --threads 1 \
    > "$OUT/greedy.log" 2>&1 &
greedy_pid=$!
echo "[distill] $REAL_STEPS steps on the target's argmax over real text (log $OUT/real.log)"
"$PY" build/train.py --out "$OUT/real" "${common[@]}" --steps "$REAL_STEPS" --lr 8e-4 \
    --mix code=1,json=0.7,prose=1.3 --init-from "$INIT" --eval-every "$REAL_STEPS" --ckpt-every "$REAL_STEPS" \
    --seed 790 > "$OUT/real.log" 2>&1
wait "$greedy_pid"

echo "[distill] $GREEDY_STEPS steps on the target's greedy continuations (log $OUT/greedy_ft.log)"
"$PY" build/train.py --corpora "$OUT/greedy" --out "$OUT/greedy_ft" "${common[@]}" --threads 2 \
    --steps "$GREEDY_STEPS" --lr 5e-4 --mix code=1,json=1.2,prose=1.2 --init-from "$OUT/real/hf" \
    --eval-every "$GREEDY_STEPS" --ckpt-every "$GREEDY_STEPS" --seed 791 > "$OUT/greedy_ft.log" 2>&1

final="$OUT/greedy_ft"
corpus="$OUT/greedy"
if [ "$EXTRA_JSON" -gt 0 ]; then
    echo "[distill] $EXTRA_JSON more JSON continuations, then 60 steps on all of them (log $OUT/json_ft.log)"
    generate json "$EXTRA_JSON" 123 greedy_json 2
    corpus="$OUT/greedy_all"
    rm -rf "$corpus" && cp -r "$OUT/greedy" "$corpus"
    cat "$OUT/greedy_json/json/train.jsonl" >> "$corpus/json/train.jsonl"
    "$PY" build/train.py --corpora "$corpus" --out "$OUT/json_ft" "${common[@]}" --threads 2 --steps 60 \
        --lr 4e-4 --mix code=1,json=1.5,prose=1.2 --init-from "$final/hf" --eval-every 60 --ckpt-every 60 \
        --seed 792 > "$OUT/json_ft.log" 2>&1
    final="$OUT/json_ft"
fi

if [ "$EXTRA_CODE" -gt 0 ] || [ "$EXTRA_PROSE" -gt 0 ]; then
    # A target without greedy loops writes varied code and prose: 192 continuations per domain were too few
    # (this round raised alpha on its greedy text by 0.03 on each domain, docs/MODELS.md section 5).
    echo "[distill] $EXTRA_CODE code and $EXTRA_PROSE prose continuations more, then $MORE_STEPS steps (log $OUT/more_ft.log)"
    more="$OUT/greedy_more"
    rm -rf "$more" && cp -r "$corpus" "$more"
    extra() {  # extra DOMAIN COUNT SEED: COUNT more continuations of DOMAIN, appended to $more's train split
        [ "$2" -gt 0 ] || return 0
        generate "$1" "$2" "$3" "greedy_${1}2"
        cat "$OUT/greedy_${1}2/$1/train.jsonl" >> "$more/$1/train.jsonl"
    }
    extra code "$EXTRA_CODE" 321 & code_pid=$!
    extra prose "$EXTRA_PROSE" 322 & prose_pid=$!
    wait "$code_pid" && wait "$prose_pid"   # a failed generation stops the script (set -e)
    "$PY" build/train.py --corpora "$more" --out "$OUT/more_ft" "${common[@]}" --threads 2 \
        --steps "$MORE_STEPS" --lr 4e-4 --mix "$MORE_MIX" --init-from "$final/hf" --eval-every "$MORE_STEPS" \
        --ckpt-every "$MORE_STEPS" \
        --seed 793 > "$OUT/more_ft.log" 2>&1
    final="$OUT/more_ft"
    corpus="$more"
fi

# Code-only rounds: COUNT more code continuations (two generators, one per core), then STEPS steps on the
# whole corpus so far with code weighted up (docs/MODELS.md section 4, "Draft, sixth session").
round=0
for spec in $CODE_ROUNDS; do
    count=${spec%%:*} steps=${spec##*:} round=$((round + 1))
    echo "[distill] code round $round: $count more code continuations, then $steps steps (log $OUT/code_ft$round.log)"
    grow="$OUT/greedy_round$round"   # the corpus so far + this round's continuations
    rm -rf "$grow" && cp -r "$corpus" "$grow"
    seed=$((419 + 2 * round))
    generate code $((count / 2)) "$seed" "round${round}_$seed" & a_pid=$!
    generate code $((count / 2)) $((seed + 1)) "round${round}_$((seed + 1))" & b_pid=$!
    wait "$a_pid" && wait "$b_pid"
    cat "$OUT/round${round}_$seed/code/train.jsonl" "$OUT/round${round}_$((seed + 1))/code/train.jsonl" \
        >> "$grow/code/train.jsonl"
    "$PY" build/train.py --corpora "$grow" --out "$OUT/code_ft$round" "${common[@]}" --threads 2 \
        --steps "$steps" --lr 3e-4 --mix "$CODE_MIX" --init-from "$final/hf" --eval-every "$steps" \
        --ckpt-every "$steps" --seed $((793 + round)) > "$OUT/code_ft$round.log" 2>&1
    final="$OUT/code_ft$round"
    corpus="$grow"
done

if [ "$PROPOSAL_VOCAB" -gt 0 ]; then
    "$PY" build/draft_vocab.py --draft "$final/hf" --size "$PROPOSAL_VOCAB" --extra "$corpus"
fi
"$PY" build/import_checkpoint.py --target "$TARGET" --draft "$final/hf"
"$PY" build/measure_pair.py --out "$OUT/measure.json" > "$OUT/measure.log" 2>&1
tail -n 4 "$OUT/measure.log"
