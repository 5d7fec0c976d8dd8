#!/usr/bin/env bash
# Nsight Compute profiles of the decode step at the memory-bound (s1) and compute-bound (s2)
# shapes; reports and text summaries go to ${1:-profiles/reports}. The summaries of the
# final kernel are copied into profiles/summary_*.txt (the .ncu-rep files stay out of git).
set -euo pipefail
exec python3 -m snapmla_cute.cli profile s1 s2 --out "${1:-profiles/reports}"
