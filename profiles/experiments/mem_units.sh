#!/usr/bin/env bash
# GPU: which memory unit is the "busiest" of ncu's speed-of-light at s1 (shared-memory banks,
# the L1/LSU data pipe, L2, DRAM), plus the tensor, XU and LSU pipes and the MIO stalls.
# Metrics the installed ncu does not know are left out (queried first).
#   bash profiles/experiments/mem_units.sh [s1|s2]   (the default kernel; results: profiles/NOTES.md, profiles/shared_memory.md)
set -euo pipefail
shape=${1:-s1}
ncu=$(python3 -c "from snapmla_cute.profiling import ncu_binary; print(ncu_binary() or 'ncu')")
want="dram__throughput l1tex__data_bank_reads l1tex__data_bank_writes l1tex__data_pipe_lsu_wavefronts
l1tex__data_pipe_lsu_wavefronts_mem_shared l1tex__lsuin_requests l1tex__m_xbar2l1tex_read_bytes
lts__t_sectors lts__t_sectors_srcunit_tex lts__d_sectors lts__t_tag_requests lts__lts2xbar_cycles_active
sm__pipe_tensor_op_gmma_cycles_active sm__inst_executed_pipe_lsu smsp__inst_executed_pipe_xu
l1tex__data_bank_conflicts_pipe_lsu_mem_shared smsp__average_warps_issue_stalled_mio_throttle_per_issue_active
smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active smsp__average_warps_issue_stalled_lg_throttle_per_issue_active
smsp__inst_executed gpc__cycles_elapsed sm__cycles_active"
have=$("$ncu" --query-metrics 2>/dev/null | awk '{print $1}')
list=""
for m in $want; do
  if grep -qx "$m" <<<"$have"; then
    case $m in
      *per_issue_active) list+="$m.ratio," ;;
      l1tex__data_bank_conflicts*|smsp__inst_executed|lts__t_sectors_srcunit_tex) list+="$m.sum,$m.avg.pct_of_peak_sustained_elapsed," ;;
      gpc__cycles_elapsed|sm__cycles_active) list+="$m.max,$m.avg," ;;
      *) list+="$m.avg.pct_of_peak_sustained_elapsed," ;;
    esac
  else
    echo "not known to this ncu: $m"
  fi
done
"$ncu" --clock-control none --profile-from-start off --metrics "${list%,}" python3 -m snapmla_cute.profiling "$shape" 2>&1 \
  | grep -v "^==PROF==" | sed -n '/DecodeKernel/,$p'
