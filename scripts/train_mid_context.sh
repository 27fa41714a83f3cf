#!/usr/bin/env bash
# Stage 9 of the demo pair: the bundled drafter fine-tuned where it was weakest, 1k-3k tokens of context.
# There the target falls into short loops on code (`"""\n    """` over and over) that stage 8's drafter
# commits only about 2 tokens a step on, while it drafts the same loops well at 3k-5.9k. Continuations are
# distilled at 1k-3k mostly (code, padding, chat; 30 % sampled at T=0.7), drafted losslessly by the bundled
# drafter, then the bundled drafter is fine-tuned on them with a share of short and far contexts kept.
#   -> $RUN/drafter-mid  (resumes from $RUN/drafter-mid.data and $RUN/drafter-mid.work)
# Env: RUN (default runs/demo), MID_DISTILL_MIN (18), MID_DRAFTER_MIN (30), DRAFTER_THREADS (2).
# Bundle it with: install -m 644 $RUN/drafter-mid/{config.json,model.safetensors} src/ddscope/assets/demo/drafter/
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/demo}
ASSETS=src/ddscope/assets/demo
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONHASHSEED=0
mkdir -p "$RUN/drafter-mid.work"
echo "[$(date -u +%T)] mid-context drafter: distillation at 1k-3k (${MID_DISTILL_MIN:-18} min)"
[ -f "$RUN/drafter-mid/model.safetensors" ] || python -m ddscope.cli train-drafter --target "$ASSETS/target" \
  --out "$RUN/drafter-mid" --work-dir "$RUN/drafter-mid.data" --distill-only \
  --data code:0.5,padding:0.25,chat:0.25 --context-lengths 16-1024:0.2,1024-3072:0.55,3072-5888:0.25 \
  --prompts 900 --distill-min "${MID_DISTILL_MIN:-18}" --distill-workers 2 --sampled-frac 0.3 --max-new-tokens 256 \
  --distill-method ddtree --distill-drafter "$ASSETS/drafter" --seed 5678
for f in "$RUN"/drafter-mid.data/distill.*.jsonl; do ln -sf "$(realpath "$f")" "$RUN/drafter-mid.work/$(basename "$f")"; done
echo "[$(date -u +%T)] mid-context drafter: fine-tuning (${MID_DRAFTER_MIN:-30} min)"
resume=()
[ -f "$RUN/drafter-mid.work/ckpt.pt" ] && resume=(--resume)
[ -f "$RUN/drafter-mid/model.safetensors" ] || python -m ddscope.training.train --target "$ASSETS/target" \
  --out "$RUN/drafter-mid" --work-dir "$RUN/drafter-mid.work" --init-drafter "$ASSETS/drafter" \
  --train-context-lengths 16-1024:0.2,1024-3072:0.55,3072-6144:0.25 --sliding-window 512 \
  --layers 2 --block-size 16 --lr 2e-4 --time-budget-min "${MID_DRAFTER_MIN:-30}" --feature-cache-gb 8 \
  --threads "${DRAFTER_THREADS:-2}" --seed 5678 "${resume[@]}"
echo "[$(date -u +%T)] done: $RUN/drafter-mid"
