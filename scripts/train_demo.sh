#!/usr/bin/env bash
# Build the bundled demo pair from scratch, offline, on CPU, with fixed seeds:
#   1. byte-level BPE tokenizer   -> $RUN/tokenizer
#   2. target pretraining (Qwen3) -> $RUN/target   (resumes from $RUN/target_ckpt if present)
#   3. copy tokenizer + target    -> src/ddscope/assets/demo/target
# Needs: pip install -e '.[data]'  and  apt-get install python3.11-doc (docs corpus).
#   4. short-context drafter: self-distillation + training -> src/ddscope/assets/demo/drafter-short
#      (resumes from $RUN/drafter.work)
#   5. long-context drafter: stage 4's drafter fine-tuned on continuations distilled at prompt lengths
#      spread up to 5.9k tokens -> $RUN/drafter-long (resumes from $RUN/drafter-long.work)
#   6. windowed long-context drafter: stage 5's drafter fine-tuned with --sliding-window 512 on stage 5's
#      distilled set, weighted to prompts of 1.5k+ tokens -> $RUN/drafter-window
#      (resumes from $RUN/drafter-window.work)
#   7. far-context drafter: padding-like prompts of 3k-5.9k tokens distilled (stage 6's drafter drafts,
#      losslessly), then stage 6's drafter fine-tuned on them plus stage 5's set, weighted to 1.5k+
#      -> $RUN/drafter-far (resumes from $RUN/drafter-far.work)
#   8. a second pass over stage 7's data, weighted further to 1.5k+, to sharpen the drafter's confidence
#      deep in the block at long context -> $RUN/drafter-far2 (resumes from $RUN/drafter-far2.work)
#   9. portable drafter: stage 8's drafter moved off the target's last layer (target layers 1, 2), fine-tuned
#      on code-heavy continuations at 16-5.9k tokens with features from a real vLLM (`ddscope features-server`),
#      the trainer seeing a copy of the target without its decoder -> $RUN/drafter-portable
#      (resumes from $RUN/drafter-portable.work)
#  10. long-code drafter: code prompts of 1.5k-4.6k tokens distilled (stage 9's drafter drafts), then stage 9's
#      drafter fine-tuned the same way on them plus stage 9's records -> src/ddscope/assets/demo/drafter
#      (resumes from $RUN/drafter-code.work)
# Env: RUN (default runs/demo), TARGET_MIN (target budget, minutes, default 60), DISTILL_MIN (12),
#      DRAFTER_MIN (28), LONG_DISTILL_MIN (25), LONG_DRAFTER_MIN (35), WINDOW_DRAFTER_MIN (25),
#      FAR_DISTILL_MIN (15), FAR_DRAFTER_MIN (30), FAR2_DRAFTER_MIN (35), PORTABLE_DISTILL_MIN (14),
#      PORTABLE_DRAFTER_MIN (40), CODE_DISTILL_MIN (16), CODE_DRAFTER_MIN (40), FEATURES_PORT (8123).
#      A finished stage is skipped on a rerun (delete its output to redo it).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/demo}
TARGET_MIN=${TARGET_MIN:-60}
DISTILL_MIN=${DISTILL_MIN:-12}
DRAFTER_MIN=${DRAFTER_MIN:-28}
LONG_DISTILL_MIN=${LONG_DISTILL_MIN:-25}
LONG_DRAFTER_MIN=${LONG_DRAFTER_MIN:-35}
WINDOW_DRAFTER_MIN=${WINDOW_DRAFTER_MIN:-25}
FAR_DISTILL_MIN=${FAR_DISTILL_MIN:-15}
FAR_DRAFTER_MIN=${FAR_DRAFTER_MIN:-30}
FAR2_DRAFTER_MIN=${FAR2_DRAFTER_MIN:-35}
PORTABLE_DISTILL_MIN=${PORTABLE_DISTILL_MIN:-14}
PORTABLE_DRAFTER_MIN=${PORTABLE_DRAFTER_MIN:-40}
CODE_DISTILL_MIN=${CODE_DISTILL_MIN:-16}
CODE_DRAFTER_MIN=${CODE_DRAFTER_MIN:-40}
FEATURES_PORT=${FEATURES_PORT:-8123}
ASSETS=src/ddscope/assets/demo
SEED=1234
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONHASHSEED=0
mkdir -p "$RUN"

echo "[$(date -u +%T)] tokenizer"
if [ ! -f "$RUN/tokenizer/tokenizer.json" ]; then
  python -m ddscope.training.tokenizer --out "$RUN/tokenizer"
fi

echo "[$(date -u +%T)] target pretraining (${TARGET_MIN} min budget)"
if [ ! -f "$RUN/target/model.safetensors" ]; then
  resume=()
  [ -f "$RUN/target_ckpt/ckpt.pt" ] && resume=(--resume)
  python -m ddscope.training.pretrain --tokenizer "$RUN/tokenizer" --run-dir "$RUN" \
    --out "$RUN/target" --time-budget-min "$TARGET_MIN" --seed "$SEED" --threads 2 --bf16 "${resume[@]}"
fi

echo "[$(date -u +%T)] bundling target into $ASSETS/target"
rm -rf "$ASSETS/target"
mkdir -p "$ASSETS/target"
install -m 644 "$RUN"/target/*.json "$RUN"/target/*.jinja "$RUN"/target/model.safetensors "$ASSETS/target/"
du -sh "$ASSETS/target"

echo "[$(date -u +%T)] short-context drafter: self-distillation (${DISTILL_MIN} min) and training (${DRAFTER_MIN} min)"
resume=()
[ -f "$RUN/drafter.work/ckpt.pt" ] && resume=(--resume)
[ -f "$RUN/drafter/model.safetensors" ] || python -m ddscope.cli train-drafter --target "$ASSETS/target" --out "$RUN/drafter" --work-dir "$RUN/drafter.work" \
  --prompts 4000 --distill-min "$DISTILL_MIN" --distill-workers 2 --sampled-frac 0.3 --max-new-tokens 256 \
  --layers 2 --block-size 16 --time-budget-min "$DRAFTER_MIN" --threads "${DRAFTER_THREADS:-2}" --seed "$SEED" "${resume[@]}"
bundle() {  # bundle RUN_DIR ASSET_NAME
  rm -rf "$ASSETS/$2"
  mkdir -p "$ASSETS/$2"
  install -m 644 "$1"/config.json "$1"/model.safetensors "$ASSETS/$2/"
}
echo "[$(date -u +%T)] bundling it into $ASSETS/drafter-short"
bundle "$RUN/drafter" drafter-short

echo "[$(date -u +%T)] long-context drafter: distillation (${LONG_DISTILL_MIN} min) and fine-tuning (${LONG_DRAFTER_MIN} min)"
resume=()
[ -f "$RUN/drafter-long.work/ckpt.pt" ] && resume=(--resume)
[ -f "$RUN/drafter-long/model.safetensors" ] || python -m ddscope.cli train-drafter --target "$ASSETS/target" \
  --out "$RUN/drafter-long" --work-dir "$RUN/drafter-long.work" --init-drafter "$ASSETS/drafter-short" \
  --data code:0.35,docs:0.15,chat:0.25,padding:0.25 --context-lengths 16-512:0.35,512-2048:0.3,2048-5888:0.35 \
  --prompts 2400 --distill-min "$LONG_DISTILL_MIN" --distill-workers 2 --sampled-frac 0.3 --max-new-tokens 256 \
  --layers 2 --block-size 16 --lr 4e-4 --time-budget-min "$LONG_DRAFTER_MIN" --feature-cache-gb 8 \
  --threads "${DRAFTER_THREADS:-2}" --seed "$SEED" "${resume[@]}"

echo "[$(date -u +%T)] windowed long-context drafter: fine-tuning (${WINDOW_DRAFTER_MIN} min) on stage 5's data"
mkdir -p "$RUN/drafter-window.work"
ln -sf "$(realpath "$RUN/drafter-long.work")"/distill.* "$RUN/drafter-window.work/"  # the data, not the checkpoint
finetune() {  # finetune OUT INIT MIX MINUTES CACHE_GB: windowed fine-tune of INIT on OUT.work's distilled data
  local resume=()
  [ -f "$1.work/ckpt.pt" ] && resume=(--resume)
  [ -f "$1/model.safetensors" ] || python -m ddscope.training.train --target "$ASSETS/target" \
    --out "$1" --work-dir "$1.work" --init-drafter "$2" --train-context-lengths "$3" --sliding-window 512 \
    --layers 2 --block-size 16 --lr 3e-4 --time-budget-min "$4" --feature-cache-gb "$5" \
    --threads "${DRAFTER_THREADS:-2}" --seed "$SEED" "${resume[@]}"
}
finetune "$RUN/drafter-window" "$RUN/drafter-long" 16-1536:0.28,1536-6144:0.72 "$WINDOW_DRAFTER_MIN" 8

echo "[$(date -u +%T)] far-context drafter: padding distillation at 3k-5.9k (${FAR_DISTILL_MIN} min)"
# The target falls into short loops deep in repetitive text, where its features drift from those at 3k:
# stage 6 drafts these at 5.5k tokens as badly as at 1.6k, though it has learnt the same loops at 3.3k.
[ -f "$RUN/drafter-far/model.safetensors" ] || python -m ddscope.cli train-drafter --target "$ASSETS/target" \
  --out "$RUN/drafter-far" --work-dir "$RUN/drafter-far.data" --distill-only --data padding:1 --context-lengths 3072-5888:1 \
  --prompts 600 --distill-min "$FAR_DISTILL_MIN" --distill-workers 2 --sampled-frac 0.3 --max-new-tokens 256 \
  --distill-method ddtree --distill-drafter "$RUN/drafter-window" --seed 4321
echo "[$(date -u +%T)] far-context drafter: fine-tuning (${FAR_DRAFTER_MIN} min) on stages 5 and 7's data"
mkdir -p "$RUN/drafter-far.work"
for f in "$RUN"/drafter-long.work/distill.*.jsonl; do ln -sf "$(realpath "$f")" "$RUN/drafter-far.work/distill.long-$(basename "$f" | cut -d. -f2).jsonl"; done
for f in "$RUN"/drafter-far.data/distill.*.jsonl; do ln -sf "$(realpath "$f")" "$RUN/drafter-far.work/distill.far-$(basename "$f" | cut -d. -f2).jsonl"; done
finetune "$RUN/drafter-far" "$RUN/drafter-window" 16-1536:0.2,1536-6144:0.8 "$FAR_DRAFTER_MIN" 11
# Stage 7 drafts the long loops right but unsure (about 0.65 per slot, against 0.96 at 13 tokens), so a
# budget-32 tree stops near depth 10: a second pass sharpens it.
echo "[$(date -u +%T)] far-context drafter, second pass (${FAR2_DRAFTER_MIN} min)"
mkdir -p "$RUN/drafter-far2.work"
ln -sf "$(realpath "$RUN/drafter-far.work")"/distill.* "$RUN/drafter-far2.work/"
finetune "$RUN/drafter-far2" "$RUN/drafter-far" 16-1536:0.15,1536-6144:0.85 "$FAR2_DRAFTER_MIN" 11

echo "[$(date -u +%T)] portable drafter: distillation (${PORTABLE_DISTILL_MIN} min), code-heavy, 16-5.9k tokens"
P="$RUN/drafter-portable"
[ -f "$P/model.safetensors" ] || python -m ddscope.cli train-drafter --target "$ASSETS/target" --out "$P" \
  --work-dir "$P.work" --distill-only --data code:0.5,chat:0.2,docs:0.1,padding:0.2 \
  --context-lengths 16-512:0.3,512-2048:0.25,2048-4096:0.3,4096-5888:0.15 --prompts 1500 \
  --distill-min "$PORTABLE_DISTILL_MIN" --distill-workers 2 --sampled-frac 0.3 --max-new-tokens 256 \
  --distill-method ddtree --distill-drafter "$RUN/drafter-far2" --seed 31
server=""
features_up() {  # a features server of the whole target (real vLLM), started once, stopped at exit
  [ -n "$server" ] && return
  python -m ddscope.cli features-server --target "$ASSETS/target" --port "$FEATURES_PORT" --layer-ids 0,1,2 \
    -- --dtype float32 --enforce-eager --max-num-seqs 8 > "$RUN/features-server.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null' EXIT
  for _ in $(seq 600); do
    kill -0 $server 2>/dev/null || { echo "the features server died: $RUN/features-server.log" >&2; exit 1; }
    curl -sf "http://127.0.0.1:$FEATURES_PORT/v1/models" > /dev/null && break; sleep 1
  done
}
# what a trainer beside a sharded 1T target has: no decoder
[ -d "$RUN/target-head" ] || python -c "import sys; from pathlib import Path; from ddscope.training.head import head_only; \
head_only(Path(sys.argv[1]), Path(sys.argv[2]))" "$ASSETS/target" "$RUN/target-head"
portable() {  # portable OUT WORK INIT MIX MINUTES LR SEED: fine-tune INIT on WORK's records from vLLM's features
  local resume=()
  [ -f "$1/model.safetensors" ] && return
  features_up
  [ -f "$2/ckpt.pt" ] && resume=(--resume)
  python -m ddscope.cli train-drafter --target "$RUN/target-head" --features-url "http://127.0.0.1:$FEATURES_PORT" \
    --out "$1" --work-dir "$2" --init-drafter "$3" --target-layer-ids 1,2 --sliding-window 512 \
    --train-context-lengths "$4" --layers 2 --block-size 16 --lr "$6" --time-budget-min "$5" \
    --feature-cache-gb 10 --threads "${DRAFTER_THREADS:-2}" --seed "$7" "${resume[@]}"
}
echo "[$(date -u +%T)] portable drafter: fine-tuning (${PORTABLE_DRAFTER_MIN} min) from vLLM's features"
portable "$P" "$P.work" "$RUN/drafter-far2" 16-1536:0.3,1536-6144:0.7 "$PORTABLE_DRAFTER_MIN" 4e-4 31

# Stage 9 drafts long code at 0.63x its short-context tau: the target cycles there, and few records were long code.
echo "[$(date -u +%T)] long-code drafter: distillation (${CODE_DISTILL_MIN} min), code at 1.5k-4.6k tokens"
Q="$RUN/drafter-code"
[ -f "$Q/model.safetensors" ] || python -m ddscope.cli train-drafter --target "$ASSETS/target" --out "$Q" \
  --work-dir "$Q.data" --distill-only --data code:1 --context-lengths 1536-4608:1 --prompts 600 \
  --distill-min "$CODE_DISTILL_MIN" --distill-workers 2 --sampled-frac 0.2 --max-new-tokens 256 \
  --distill-method ddtree --distill-drafter "$P" --seed 32
echo "[$(date -u +%T)] long-code drafter: fine-tuning (${CODE_DRAFTER_MIN} min) on stages 9 and 10's records"
mkdir -p "$Q.work"
for f in "$Q.data"/distill.*.jsonl; do ln -sf "$(realpath "$f")" "$Q.work/"; done
for f in "$P.work"/distill.*.jsonl; do ln -sf "$(realpath "$f")" "$Q.work/stage9-$(basename "$f")"; done
portable "$Q" "$Q.work" "$P" 16-1536:0.25,1536-6144:0.75 "$CODE_DRAFTER_MIN" 3e-4 32
[ -z "$server" ] || kill $server
echo "[$(date -u +%T)] bundling it into $ASSETS/drafter"
bundle "$Q" drafter
du -sh "$ASSETS"
echo "[$(date -u +%T)] done"
