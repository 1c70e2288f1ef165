#!/usr/bin/env bash
# launch.sh - run P processes (default 1) per emulated host (network namespace) with torch.distributed
# env:// variables set, then tear the lab down: on normal exit, on error, on Ctrl-C/TERM and on timeout.
#
#   launch.sh -n N -r RATE [-p P] [netlab up options] [launcher options] -- PROGRAM [ARGS...]
#
# netlab up options : --burst-ms MS --burst BYTES --limit-ms MS --mtu BYTES
#                     --cc bbr|cubic|reno --no-rx --tso on|off   (see netlab.sh)
# launcher options  : -p, --procs-per-host P
#                                     processes per emulated host (default 1): they share
#                                     the host's namespace, so their traffic to each other
#                                     goes over its loopback (as NVLink/PCIe inside a node)
#                                     and only cross-host traffic crosses the shaped links
#                     --python PY     interpreter for PROGRAM if it ends in .py (default:
#                                     $NETLAB_PYTHON, else the repo's .venv/bin/python, else python3)
#                     --port P        MASTER_PORT (default 29500)
#                     --timeout S     kill everything after S seconds (default 1800)
#                     --logdir DIR    per-rank logs (default: mktemp dir); rank 0 is
#                                     also echoed to stdout
#                     --threads T     OMP_NUM_THREADS per rank (default 1)
#                     --nice N        run ranks under nice -n N (e.g. -5 to shield the
#                                     measurement from other load; default 0)
#                     --reuse         use an already running lab (netlab.sh up),
#                                     do not create or destroy it
#                     --keep          leave the lab up afterwards
#
# Every rank gets: RANK WORLD_SIZE LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR (host 0's lab
# address) MASTER_PORT GLOO_SOCKET_IFNAME=zeth OMP_NUM_THREADS NETLAB_RATE NETLAB_NHOSTS
# NETLAB_IFNAME NETLAB_MTU, and for zen_ext: PYTHONPATH=<repo root> DS_ACCELERATOR=cpu
# PYTHONUNBUFFERED=1. With -p P > 1, local process l of host h gets RANK=h*P+l WORLD_SIZE=N*P
# LOCAL_RANK=l LOCAL_WORLD_SIZE=P LOCAL_SIZE=P (DeepSpeed's name) NETLAB_PROCS_PER_HOST=P and
# ZEN_EXT_HOST=<the host's namespace> (zen_ext's node hierarchy: zen_ext/reduction/hierarchy.py);
# -p 1 sets exactly the variables above. The program runs in the caller's working directory.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
NETLAB="$HERE/netlab.sh"
PREFIX=${NETLAB_PREFIX:-zenb-}
SUBNET=${NETLAB_SUBNET:-10.77.0}
DEFAULT_PY=python3
[[ -x "$ROOT/.venv/bin/python" ]] && DEFAULT_PY="$ROOT/.venv/bin/python"

N=""; RATE=""; UPOPTS=(); PY=${NETLAB_PYTHON:-$DEFAULT_PY}; PORT=29500; TIMEOUT=1800
LOGDIR=""; THREADS=1; REUSE=0; KEEP=0; MTU=1500; NICE=0; PPH=1
usage() { awk 'NR>1 && /^#/{sub(/^# ?/,"");print;next} NR>1{exit}' "$0" >&2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) N=$2; shift 2;;
    -r|--rate) RATE=$2; shift 2;;
    -p|--procs-per-host) PPH=$2; shift 2;;
    --burst-ms|--burst|--limit-ms|--cc|--tso) UPOPTS+=("$1" "$2"); shift 2;;
    --mtu) MTU=$2; UPOPTS+=("$1" "$2"); shift 2;;
    --no-rx) UPOPTS+=("$1"); shift;;
    --python) PY=$2; shift 2;;
    --port) PORT=$2; shift 2;;
    --timeout) TIMEOUT=$2; shift 2;;
    --logdir) LOGDIR=$2; shift 2;;
    --threads) THREADS=$2; shift 2;;
    --nice) NICE=$2; shift 2;;
    --reuse) REUSE=1; shift;;
    --keep) KEEP=1; shift;;
    -h|--help) usage; exit 0;;
    --) shift; break;;
    *) echo "launch.sh: unknown option $1" >&2; usage; exit 2;;
  esac
done
[[ $# -gt 0 ]] || { echo "launch.sh: missing '-- PROGRAM'" >&2; exit 2; }
if [[ $REUSE == 1 ]]; then
  N=${N:-$(cat "/run/netlab-${PREFIX%-}/n" 2>/dev/null || echo "")}
  RATE=${RATE:-$(cat "/run/netlab-${PREFIX%-}/rate" 2>/dev/null || echo "")}
  [[ -n "$N" ]] || { echo "launch.sh: --reuse but no lab is up (prefix $PREFIX)" >&2; exit 2; }
else
  [[ -n "$N" && -n "$RATE" ]] || { echo "launch.sh: need -n N and -r RATE" >&2; exit 2; }
fi
[[ "$PPH" =~ ^[0-9]+$ ]] && (( PPH >= 1 )) || { echo "launch.sh: -p ($PPH) must be an integer >= 1" >&2; exit 2; }
[[ "$1" == *.py ]] && set -- "$PY" "$@"
WORLD=$((N * PPH))
[[ -n "$LOGDIR" ]] || LOGDIR=$(mktemp -d /tmp/netlab-logs.XXXXXX)
mkdir -p "$LOGDIR"

PIDS=(); TAILPID=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  [[ -n "$TAILPID" ]] && kill "$TAILPID" 2>/dev/null
  sleep 0.3
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  if [[ $REUSE == 0 && $KEEP == 0 ]]; then NETLAB_QUIET=1 "$NETLAB" down || true; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [[ $REUSE == 0 ]]; then
  "$NETLAB" up -n "$N" -r "$RATE" "${UPOPTS[@]}" || exit 1
fi

for ((k = 0; k < WORLD; k++)); do : >"$LOGDIR/rank$k.log"; done
for ((h = 0; h < N; h++)); do
  for ((l = 0; l < PPH; l++)); do
    k=$((h * PPH + l))
    # -p 1: the variables of one process per host, unchanged; -p P: the node's local layout and its name
    NODE_ENV=(LOCAL_RANK=0 LOCAL_WORLD_SIZE=1)
    (( PPH > 1 )) && NODE_ENV=(LOCAL_RANK=$l LOCAL_WORLD_SIZE=$PPH LOCAL_SIZE=$PPH NETLAB_PROCS_PER_HOST=$PPH
                               ZEN_EXT_HOST="${PREFIX}h$h")
    ip netns exec "${PREFIX}h$h" env RANK=$k WORLD_SIZE=$WORLD "${NODE_ENV[@]}" \
      MASTER_ADDR="${SUBNET}.1" MASTER_PORT=$PORT GLOO_SOCKET_IFNAME=zeth \
      OMP_NUM_THREADS=$THREADS NETLAB_RATE="$RATE" NETLAB_NHOSTS=$N NETLAB_IFNAME=zeth NETLAB_MTU=$MTU \
      PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 \
      nice -n "$NICE" timeout --signal=TERM --kill-after=10 "$TIMEOUT" "$@" >"$LOGDIR/rank$k.log" 2>&1 &
    PIDS+=($!)
  done
done
tail -n +1 -f "$LOGDIR/rank0.log" --pid="${PIDS[0]}" 2>/dev/null &
TAILPID=$!

RC=0; LIVE=("${PIDS[@]}")
while (( ${#LIVE[@]} > 0 )); do
  done_pid=""
  wait -n -p done_pid "${LIVE[@]}"; r=$?
  [[ -z "$done_pid" ]] && break
  NEXT=(); for p in "${LIVE[@]}"; do [[ $p != "$done_pid" ]] && NEXT+=("$p"); done; LIVE=("${NEXT[@]}")
  if [[ $r -ne 0 ]]; then
    for ((k = 0; k < WORLD; k++)); do [[ ${PIDS[k]} == "$done_pid" ]] && break; done
    echo "launch.sh: rank $k exited with $r; stopping the others (logs in $LOGDIR)" >&2
    tail -n 20 "$LOGDIR/rank$k.log" >&2
    RC=$r; break
  fi
done
if [[ $RC -ne 0 ]]; then
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5; kill "$TAILPID" 2>/dev/null
fi
wait "$TAILPID" 2>/dev/null   # tail --pid exits by itself once rank 0 is gone
TAILPID=""
# tc counters of the run: drops on a shaped link mean TCP retransmissions
"$NETLAB" counters 2>/dev/null | awk '{tx+=$2; txd+=$3; rx+=$4; rxd+=$5}
  END{if (NR) printf "launch.sh: tc totals: host TX %.1f MB (%d dropped), host RX %.1f MB (%d dropped)\n", tx/1e6, txd, rx/1e6, rxd}' >&2
LAYOUT=""; (( PPH > 1 )) && LAYOUT=" ($N hosts × $PPH)"
[[ $RC -eq 0 ]] && echo "launch.sh: all $WORLD ranks$LAYOUT finished OK (logs in $LOGDIR)" >&2
exit $RC
