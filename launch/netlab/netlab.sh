#!/usr/bin/env bash
# netlab.sh - emulate N hosts with per-host rate-limited NICs on one Linux box (zen_ext's emulated
# cluster; docs/benchmarks.md has the measured limits, launch/netlab/README.md the usage).
#
# Topology (everything lives in network namespaces this script creates; the root namespace is
# never touched: no address, route, qdisc or sysctl there, and no route leaves the lab):
#
#   ${PREFIX}h0 [zeth 10.77.0.1] --veth-- p0 \
#   ${PREFIX}h1 [zeth 10.77.0.2] --veth-- p1  +-- br0 (bridge inside ${PREFIX}sw)
#   ...                                      /
#
#   * host TX limit : tbf on zeth (egress of each host namespace)
#   * host RX limit : tbf on pK   (egress of the switch port towards host K)
#   => every host has a full-duplex "NIC" of RATE behind a non-blocking switch.
#
# Usage:
#   netlab.sh up   -n N -r RATE [--burst-ms MS | --burst BYTES] [--limit-ms MS]
#                  [--mtu BYTES] [--cc bbr|cubic|reno] [--no-rx] [--tso on|off]
#   netlab.sh rate -r RATE [same shaping options]   # re-shape a running lab
#   netlab.sh down                                  # remove everything (idempotent)
#   netlab.sh status                                # tc stats (bytes, drops)
#   netlab.sh counters                              # "K tx_bytes tx_drops rx_bytes rx_drops"
#   netlab.sh exec K CMD...                         # run CMD in host K's namespace
#   netlab.sh hosts                                 # print "K ADDR NS" per host
#
# RATE is a tc rate ("1gbit", "2500mbit", "10gbit") or "none" (no shaping).
# Env: NETLAB_PREFIX (default "zenb-": letters, digits, '-', at most 12 characters; every
# namespace and state file of the lab starts with it, and `down` removes only those),
# NETLAB_SUBNET (default "10.77.0"; must be a private A.B.C range the root namespace does not route).
set -euo pipefail

PREFIX=${NETLAB_PREFIX:-zenb-}
SUBNET=${NETLAB_SUBNET:-10.77.0}
IFNAME=zeth           # interface name inside every host namespace
SW=${PREFIX}sw        # switch namespace

die() { echo "netlab: $*" >&2; exit 1; }
log() { [[ -n "${NETLAB_QUIET:-}" ]] || echo "netlab: $*" >&2; }

# --- safety: names we own, and a private subnet that cannot shadow anything of the root namespace.
[[ "$PREFIX" =~ ^[A-Za-z0-9][A-Za-z0-9-]{0,11}$ ]] || die "NETLAB_PREFIX ($PREFIX) must be 1-12 letters, digits or '-'"
case "$SUBNET" in
  10.*|192.168.*|172.1[6-9].*|172.2[0-9].*|172.3[01].*) ;;
  *) die "NETLAB_SUBNET ($SUBNET) must be a private range (10.x, 172.16-31.x, 192.168.x)";;
esac
[[ "$SUBNET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "NETLAB_SUBNET ($SUBNET) must look like A.B.C"
STATE_DIR=/run/netlab-${PREFIX%-}

# Our namespaces only: exact prefix match on the name column of `ip netns list`.
our_namespaces() { ip netns list 2>/dev/null | awk -v p="$PREFIX" 'index($1, p) == 1 {print $1}'; }

# rate string -> bits/s (integer); "none" -> 0. %.0f, not %d: mawk clips %d at 2^31-1.
rate_bps() {
  local r=${1,,}
  [[ "$r" == none || "$r" == 0 ]] && { echo 0; return; }
  awk -v r="$r" 'BEGIN{
    if (match(r,/^[0-9.]+/)==0) { print "ERR"; exit }
    v=substr(r,1,RLENGTH); u=substr(r,RLENGTH+1);
    m["bit"]=1; m["kbit"]=1e3; m["mbit"]=1e6; m["gbit"]=1e9; m["tbit"]=1e12; m[""]=8;
    m["bps"]=8; m["kbps"]=8e3; m["mbps"]=8e6; m["gbps"]=8e9;
    if (!(u in m)) { print "ERR"; exit }
    printf "%.0f\n", v*m[u] }'
}

nhosts() { cat "$STATE_DIR/n" 2>/dev/null || echo 0; }

# ---------------------------------------------------------------- shaping
SHAPE_RATE=""; BURST_MS=1; BURST_BYTES=""; LIMIT_MS=20; MTU=1500; CC=""; RX=1; TSO=""
parse_shape_opts() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      -n) N=$2; shift 2;;
      -r|--rate) SHAPE_RATE=$2; shift 2;;
      --burst-ms) BURST_MS=$2; shift 2;;
      --burst) BURST_BYTES=$2; shift 2;;
      --limit-ms) LIMIT_MS=$2; shift 2;;
      --mtu) MTU=$2; shift 2;;
      --cc) CC=$2; shift 2;;
      --no-rx) RX=0; shift;;
      --tso) TSO=$2; shift 2;;
      *) die "unknown option $1 (valid: -n -r --burst-ms --burst --limit-ms --mtu --cc --no-rx --tso)";;
    esac
  done
}

apply_shaping() {   # uses SHAPE_RATE BURST_* LIMIT_MS RX, for hosts 0..n-1
  local n; n=$(nhosts)
  local bps; bps=$(rate_bps "$SHAPE_RATE")
  [[ "$bps" != ERR ]] || die "rate ($SHAPE_RATE) must be a tc rate such as 1gbit, 2500mbit, or none"
  local k
  if [[ "$bps" == 0 ]]; then
    for ((k = 0; k < n; k++)); do
      tc -n "${PREFIX}h$k" qdisc del dev $IFNAME root 2>/dev/null || true
      tc -n "$SW" qdisc del dev "p$k" root 2>/dev/null || true
    done
    echo none > "$STATE_DIR/rate"; log "shaping removed (unlimited)"; return
  fi
  # burst: tokens that may accumulate. Must hold two 64 KiB GSO super-packets (else tbf segments
  # them in software and starves the flow) and ride over timer latency on a busy CPU; measured in
  # shared/research/netlab.md: 4 KB at 1 Gbit/s gave 0.46 Gbit/s, 128 KiB 0.946.
  local burst
  if [[ -n "$BURST_BYTES" ]]; then burst=$BURST_BYTES
  else burst=$(awk -v b="$bps" -v ms="$BURST_MS" 'BEGIN{x=b/8*ms/1000; if (x<131072) x=131072; printf "%.0f", x}')
  fi
  # queue limit in bytes: LIMIT_MS of line rate, at least 1 MiB
  local limit; limit=$(awk -v b="$bps" -v ms="$LIMIT_MS" 'BEGIN{x=b/8*ms/1000; if (x<1048576) x=1048576; printf "%.0f", x}')
  for ((k = 0; k < n; k++)); do
    tc -n "${PREFIX}h$k" qdisc replace dev $IFNAME root tbf rate "$SHAPE_RATE" burst "$burst" limit "$limit"
    if [[ $RX == 1 ]]; then
      tc -n "$SW" qdisc replace dev "p$k" root tbf rate "$SHAPE_RATE" burst "$burst" limit "$limit"
    else
      tc -n "$SW" qdisc del dev "p$k" root 2>/dev/null || true
    fi
  done
  echo "$SHAPE_RATE" > "$STATE_DIR/rate"
  log "shaped $n hosts: rate=$SHAPE_RATE burst=${burst}B limit=${limit}B rx_shaping=$RX"
}

# ---------------------------------------------------------------- commands
cmd_down() {
  local ns pid
  for ns in $(our_namespaces); do
    # stop only processes still living inside our own namespaces
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill "$pid" 2>/dev/null || true; done
  done
  sleep 0.2
  for ns in $(our_namespaces); do
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$STATE_DIR"
  log "down (prefix $PREFIX)"
}

cmd_up() {
  N=""; parse_shape_opts "$@"
  [[ -n "$N" ]] || die "up needs -n N"
  [[ -n "$SHAPE_RATE" ]] || die "up needs -r RATE (or -r none)"
  [[ "$N" =~ ^[0-9]+$ ]] && (( N >= 1 && N <= 250 )) || die "-n ($N) must be an integer in 1..250"
  if [[ -n "$(our_namespaces)" ]]; then
    log "existing ${PREFIX}* namespaces found, tearing them down first"; cmd_down
  fi
  # refuse to shadow anything the root namespace already routes
  if ip -4 route show | grep -q "^${SUBNET}\."; then die "root namespace already has routes in ${SUBNET}.0/24"; fi
  mkdir -p "$STATE_DIR"
  echo "$N" > "$STATE_DIR/n"
  # A failure half-way leaves no half-built lab behind.
  trap 'rc=$?; if [[ $rc -ne 0 ]]; then NETLAB_QUIET=1 cmd_down; fi' EXIT

  ip netns add "$SW"
  ip -n "$SW" link set lo up
  ip -n "$SW" link add br0 type bridge stp_state 0 forward_delay 0
  # bridged frames must not traverse netfilter (per-netns sysctl; root untouched)
  for f in bridge-nf-call-iptables bridge-nf-call-ip6tables bridge-nf-call-arptables; do
    ip netns exec "$SW" sh -c "[ -w /proc/sys/net/bridge/$f ] && echo 0 > /proc/sys/net/bridge/$f" 2>/dev/null || true
  done
  ip -n "$SW" link set br0 mtu "$MTU" up
  local k ns
  for ((k = 0; k < N; k++)); do
    ns=${PREFIX}h$k
    ip netns add "$ns"
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 || true
    ip -n "$SW" link add "p$k" type veth peer name $IFNAME netns "$ns"
    ip -n "$SW" link set "p$k" mtu "$MTU" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" link set $IFNAME mtu "$MTU" up
    ip -n "$ns" addr add "${SUBNET}.$((k + 1))/24" dev $IFNAME
    if [[ -n "$CC" ]]; then
      # a non-initial namespace may only pick algorithms listed in the (global)
      # net.ipv4.tcp_allowed_congestion_control; the lab does not change that
      ip netns exec "$ns" sysctl -qw net.ipv4.tcp_congestion_control="$CC" 2>/dev/null \
        || die "--cc ($CC) must be one of the allowed: $(sysctl -n net.ipv4.tcp_allowed_congestion_control)"
    fi
    if [[ -n "$TSO" ]]; then
      command -v ethtool >/dev/null || die "--tso needs ethtool (apt-get install ethtool)"
      ip netns exec "$ns" ethtool -K $IFNAME tso "$TSO" gso "$TSO" >/dev/null
      ip netns exec "$SW" ethtool -K "p$k" tso "$TSO" gso "$TSO" >/dev/null
    fi
    # The lab's only route is its own /24: any other destination is unreachable from a host.
    [[ -z "$(ip -n "$ns" route show default)" ]] || die "host namespace $ns has a default route"
  done
  apply_shaping
  # check every host reaches host 0 (bridge ports forwarding, ARP ok); ping is optional
  if command -v ping >/dev/null; then
    for ((k = 1; k < N; k++)); do
      ip netns exec "${PREFIX}h$k" ping -c1 -W2 "${SUBNET}.1" >/dev/null 2>&1 \
        || ip netns exec "${PREFIX}h$k" ping -c1 -W2 "${SUBNET}.1" >/dev/null 2>&1 \
        || die "host $k cannot reach ${SUBNET}.1"
    done
  fi
  trap - EXIT
  log "up: $N hosts ${SUBNET}.1-${SUBNET}.$N, ifname=$IFNAME, mtu=$MTU, namespaces ${PREFIX}h0..${PREFIX}h$((N - 1)) + $SW"
}

cmd_rate() { N=""; parse_shape_opts "$@"; [[ $(nhosts) -gt 0 ]] || die "lab is not up"; [[ -n "$SHAPE_RATE" ]] || die "rate needs -r"; apply_shaping; }

cmd_status() {
  local n k; n=$(nhosts)
  [[ $n -gt 0 ]] || { echo "netlab: not up (prefix $PREFIX)"; return 0; }
  echo "hosts=$n rate=$(cat "$STATE_DIR/rate" 2>/dev/null)"
  for ((k = 0; k < n; k++)); do
    echo "--- host $k TX (${PREFIX}h$k $IFNAME)"; tc -s -n "${PREFIX}h$k" qdisc show dev $IFNAME | sed -n '1,3p'
    echo "--- host $k RX (switch port p$k)";     tc -s -n "$SW" qdisc show dev "p$k" | sed -n '1,3p'
  done
}

# machine-readable counters: "k tx_bytes tx_drops rx_bytes rx_drops" from tc
cmd_counters() {
  local n k; n=$(nhosts)
  for ((k = 0; k < n; k++)); do
    local a b
    a=$(tc -s -n "${PREFIX}h$k" qdisc show dev $IFNAME | awk '/Sent/{print $2, $7+0; exit}')
    b=$(tc -s -n "$SW" qdisc show dev "p$k" | awk '/Sent/{print $2, $7+0; exit}')
    echo "$k ${a:-0 0} ${b:-0 0}"
  done
}

cmd_hosts() { local n k; n=$(nhosts); for ((k = 0; k < n; k++)); do echo "$k ${SUBNET}.$((k + 1)) ${PREFIX}h$k"; done; }

cmd_exec() {
  local k=${1:-}
  [[ "$k" =~ ^[0-9]+$ ]] && (( k < $(nhosts) )) || die "exec host ($k) must be one of 0..$(( $(nhosts) - 1 ))"
  shift; exec ip netns exec "${PREFIX}h$k" "$@"
}

[[ $EUID -eq 0 ]] || die "must run as root (network namespaces and tc need CAP_NET_ADMIN)"
sub=${1:-}; shift || true
case "$sub" in
  up) cmd_up "$@";;
  down) cmd_down;;
  rate) cmd_rate "$@";;
  status) cmd_status;;
  counters) cmd_counters;;
  hosts) cmd_hosts;;
  exec) cmd_exec "$@";;
  *) awk 'NR>1 && /^#/{sub(/^# ?/,"");print;next} NR>1{exit}' "$0"; exit 2;;
esac
