#!/usr/bin/env bash
# Regenerate the emulated-cluster report: benchmarks/results/cluster_report.md (+ cluster_*.png/jsonl).
#
#   sudo bash benchmarks/run_cluster_report.sh            # everything (~40-60 min on the 2-core box)
#   STAGES="comm overhead report" bash benchmarks/run_cluster_report.sh   # a subset
#
# Stages (in this order; each lab command stays under 10 minutes):
#   traces   record real gradient traces of the recipe pipeline (DGC 1 %, DGC 5 %, natural rows); cached
#            in $WORK/traces, re-recorded only with FORCE_TRACES=1
#   comm     bench_comm on 4 emulated hosts at each rate of $RATES: recorded traces + the calibrated
#            synthetic workloads, every scheme, $REPS interleaved repeats; then the cost model's bytes
#            per rank of the synthetic workloads at 4-32 hosts (more than the lab can hold)
#   e2e      bench_e2e: tokens/s of the fine-tuning recipe, dense vs ZEN, 4 hosts at $E2E_RATE
#   overhead bench_overhead: hashing/encoding/aggregation compute vs the time saved in `comm`
#   report   cluster_report.py renders the markdown and the plots
#
# Env: WORK (scratch, default /tmp/zen_cluster), RATES (default "1gbit 2500mbit"), E2E_RATE (1gbit),
# REPS (5), QUIET_WAIT (s to wait for an idle machine before each point, default 45), QUIET_LEVEL (0.3),
# RESULTS (where the report goes, default benchmarks/results).
# Needs root and `ip netns` (launch/netlab/README.md). Results are written to $WORK/results first and
# copied into benchmarks/results/ stage by stage, so a failed stage keeps the previous files of the others.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${NETLAB_PYTHON:-$ROOT/.venv/bin/python}
WORK=${WORK:-/tmp/zen_cluster}
export WORK  # results record scratch paths as $WORK/... (benchmarks/cluster_common.py portable_path)
RATES=${RATES:-"1gbit 2500mbit"}
E2E_RATE=${E2E_RATE:-1gbit}
REPS=${REPS:-5}
QUIET_WAIT=${QUIET_WAIT:-45}
QUIET_LEVEL=${QUIET_LEVEL:-0.3}
STAGES=${STAGES:-"traces comm e2e overhead report"}
LAUNCH="$ROOT/launch/netlab/launch.sh"
RES=${RESULTS:-$ROOT/benchmarks/results}
OUT="$WORK/results"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

[[ $EUID -eq 0 ]] || { echo "run_cluster_report.sh: needs root (network namespaces)" >&2; exit 1; }
[[ -x "$PY" ]] || { echo "run_cluster_report.sh: no python at $PY (bash launch/setup.sh)" >&2; exit 1; }
mkdir -p "$WORK" "$OUT" "$RES"
has() { [[ " $STAGES " == *" $1 "* ]]; }
# Each stage's time window goes into the report with the load seen in it (a stage re-run alone
# replaces only its own entry).
: >"$WORK/stages.txt"
stage_begin() { STAGE_T0=$(date +%s); }
stage_end() { echo "$1 $STAGE_T0 $(date +%s)" >>"$WORK/stages.txt"; }
log() { echo "[cluster +$((SECONDS / 60))m$((SECONDS % 60))s] $*" >&2; }

# The machine's load during the run goes into the report (the cores are shared).
: >"$WORK/loadavg.txt"
( while :; do echo "$(date +%s) $(cut -d' ' -f1-3 /proc/loadavg)" >>"$WORK/loadavg.txt"; sleep 15; done ) &
SAMPLER=$!
trap 'kill $SAMPLER 2>/dev/null || true' EXIT

TRACES="$WORK/traces"
WORKLOADS=(trace_dgc1="$TRACES/dgc1" trace_dgc5="$TRACES/dgc5" trace_natural="$TRACES/natural")
SYNTH=(synth_dgc1="$WORK/workloads/synth_dgc1" synth_dgc5="$WORK/workloads/synth_dgc5"
       synth_embedding="$WORK/workloads/synth_embedding")

if has traces; then
  stage_begin
  if [[ -n "${FORCE_TRACES:-}" || ! -f "$TRACES/natural/losses.json" ]]; then
    log "recording gradient traces -> $TRACES"
    timeout 1800 "$PY" benchmarks/record_traces.py --out "$TRACES"
  else
    log "gradient traces cached in $TRACES (FORCE_TRACES=1 re-records)"
  fi
  stage_end traces
fi

if has comm; then
  stage_begin
  [[ -f "$WORK/workloads/synth_embedding/step_00000000.pt" ]] || \
    timeout 600 "$PY" benchmarks/bench_comm.py prepare --work "$WORK/workloads"
  rm -f "$OUT/cluster_comm.jsonl"
  for rate in $RATES; do
    for group in WORKLOADS SYNTH; do
      declare -n specs=$group
      args=(); for s in "${specs[@]}"; do args+=(--workload "$s"); done
      log "comm: 4 hosts at $rate, ${specs[*]%%=*}"
      timeout 620 "$LAUNCH" -n 4 -r "$rate" --timeout 590 --logdir "$WORK/logs/comm-$rate-$group" -- \
        benchmarks/bench_comm.py run "${args[@]}" --reps "$REPS" --quiet-wait "$QUIET_WAIT" \
        --quiet-level "$QUIET_LEVEL" --out "$OUT/cluster_comm.jsonl"
    done
  done
  log "comm: bytes per rank at 4-32 hosts (cost model, synthetic workloads)"
  rm -f "$OUT/cluster_scale.jsonl"
  timeout 900 "$PY" benchmarks/bench_comm.py scale --ranks 4,8,16,32 --out "$OUT/cluster_scale.jsonl"
  cp "$OUT/cluster_comm.jsonl" "$OUT/cluster_scale.jsonl" "$RES/"
  stage_end comm
fi

if has e2e; then
  stage_begin
  rm -f "$OUT/cluster_e2e.jsonl"
  log "e2e: 4 hosts at $E2E_RATE"
  "$PY" benchmarks/bench_e2e.py --rate "$E2E_RATE" --work "$WORK/e2e" --reps "$REPS" \
    --quiet-wait "$QUIET_WAIT" --quiet-level "$QUIET_LEVEL" --out "$OUT/cluster_e2e.jsonl"
  cp "$OUT/cluster_e2e.jsonl" "$RES/"
  stage_end e2e
fi

if has overhead; then
  stage_begin
  rm -f "$OUT/cluster_overhead.jsonl"
  args=(); for s in "${WORKLOADS[@]}" "${SYNTH[@]}"; do args+=(--workload "$s"); done
  log "overhead: compute replayed alone vs the time saved"
  timeout 900 "$PY" benchmarks/bench_overhead.py "${args[@]}" --reps "$REPS" --rates "${RATES// /,}" \
    --comm "$RES/cluster_comm.jsonl" --out "$OUT/cluster_overhead.jsonl"
  cp "$OUT/cluster_overhead.jsonl" "$RES/"
  stage_end overhead
fi

if has report; then
  "$PY" - "$WORK/loadavg.txt" "$WORK/stages.txt" "$RES/cluster_run.json" "$RATES" <<'EOF'
import datetime, json, os, platform, statistics, subprocess, sys
load_path, stages_path, out, rates = sys.argv[1:5]
samples = [tuple(float(x) for x in line.split()[:2]) for line in open(load_path) if line.strip()]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
utc = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
run = json.load(open(out)) if os.path.isfile(out) else {}
stages = run.get("stages", {})
for line in open(stages_path):
    name, t0, t1 = line.split()
    t0, t1 = float(t0), float(t1)
    loads = [v for t, v in samples if t0 <= t <= t1]
    stages[name] = dict(started=utc(t0), duration_s=int(t1 - t0), commit=commit, loadavg=loads,
                        loadavg_summary=(f"min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
                                         f"max {max(loads):.1f}") if loads else "not sampled")
run = dict(stages=stages, machine=f"{platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}",
           lab=f"4 network namespaces behind a bridge, tbf per host and direction ({rates}), MTU 1500, gloo over "
               f"TCP (launch/netlab)")
json.dump(run, open(out, "w"), indent=1)
EOF
  log "report"
  "$PY" benchmarks/cluster_report.py --results "$RES" >/dev/null
  log "done: $RES/cluster_report.md"
fi
