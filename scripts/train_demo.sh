#!/usr/bin/env bash
# Build the bundled demo pair from scratch, offline, on CPU, with fixed seeds:
#   1. byte-level BPE tokenizer   -> $RUN/tokenizer
#   2. target pretraining (Qwen3) -> $RUN/target   (resumes from $RUN/target_ckpt if present)
#   3. copy tokenizer + target    -> src/ddscope/assets/demo/target
# Needs: pip install -e '.[data]'  and  apt-get install python3.11-doc (docs corpus).
# Env: RUN (default runs/demo), TARGET_MIN (target wall-clock budget, minutes, default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/demo}
TARGET_MIN=${TARGET_MIN:-60}
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
resume=()
[ -f "$RUN/target_ckpt/ckpt.pt" ] && resume=(--resume)
python -m ddscope.training.pretrain --tokenizer "$RUN/tokenizer" --run-dir "$RUN" \
  --out "$RUN/target" --time-budget-min "$TARGET_MIN" --seed "$SEED" --threads 2 --bf16 "${resume[@]}"

echo "[$(date -u +%T)] bundling target into $ASSETS/target"
rm -rf "$ASSETS/target"
mkdir -p "$ASSETS/target"
install -m 644 "$RUN"/target/*.json "$RUN"/target/*.jinja "$RUN"/target/model.safetensors "$ASSETS/target/"
du -sh "$ASSETS/target"

# Drafter distillation/training steps are appended here (issue 6, drafter part).
echo "[$(date -u +%T)] done"
