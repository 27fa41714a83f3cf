#!/usr/bin/env bash
# The diagnose -> retrain -> verify loop on the bundled demo pair (docs/lever.md), old drafter vs new:
#   1. padding and code sweeps on the embedded server, and diagnose's attribution, per drafter;
#   2. the two padding sweeps overlaid on one figure (bench analyze old new);
#   3. tau per context bucket (eval-acceptance --contexts);
#   4. wall-clock speed of both drafters interleaved in one process against ar (speed.py --compare-drafter).
# Env: OUT (default bench-out/lever), BUDGET (32), REPEATS (3). About 10 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench-out/lever}
BUDGET=${BUDGET:-32}
REPEATS=${REPEATS:-3}
ASSETS=src/ddscope/assets/demo
declare -A DRAFTER=([old]="$ASSETS/drafter-short" [new]="$ASSETS/drafter")

for name in old new; do
  echo "[$(date -u +%T)] $name drafter: padding and code sweeps, then diagnose"
  ddscope bench sweep --target "$ASSETS/target" --drafter "${DRAFTER[$name]}" --budget "$BUDGET" --repeats "$REPEATS" --out "$OUT/$name"
  ddscope bench sweep --target "$ASSETS/target" --drafter "${DRAFTER[$name]}" --budget "$BUDGET" --repeats "$REPEATS" --workload code \
    --out "$OUT/$name-code"
  ddscope bench diagnose --load "$OUT/$name/results.json" "$OUT/$name-code/results.json" --out "$OUT/$name-diagnosis"
  echo "[$(date -u +%T)] $name drafter: tau per context bucket"
  ddscope eval-acceptance --target "$ASSETS/target" --drafter "${DRAFTER[$name]}" --workloads code --contexts 0,1024,4096 --temperatures 0 \
    --methods ar,ddtree:auto,ddtree:32 --prompts 5 --max-tokens 256 --json "$OUT/$name-tau.json"
done

echo "[$(date -u +%T)] overlay of the padding sweeps"
ddscope bench analyze "$OUT/old/results.json" "$OUT/new/results.json" --out "$OUT/overlay"

echo "[$(date -u +%T)] speed: new drafter (arms) vs old (B: arms) vs ar, interleaved"
python benchmarks/engine/speed.py --target "$ASSETS/target" --drafter "${DRAFTER[new]}" --compare-drafter "${DRAFTER[old]}" --no-hf --workloads code \
  --temperatures 0 --contexts 0,1024,4096 --budgets "$BUDGET" --repeats "$REPEATS" --prompts 3 \
  --arms ar,ddtree-auto,ddtree-$BUDGET,B:ddtree-auto,B:ddtree-$BUDGET --out "$OUT/speed.json"
echo "[$(date -u +%T)] done: $OUT"
