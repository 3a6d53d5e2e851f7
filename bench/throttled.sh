#!/usr/bin/env bash
# Run a command with the loopback shaped to RATE, to see the collectives on a slow link (issue 31's int8 row).
# A private network namespace (unshare -n: needs root or CAP_NET_ADMIN) whose lo gets a token-bucket filter;
# the gloo ranks of the command talk over that lo. Nothing outside the namespace is touched.
#
#   bash bench/throttled.sh 1gbit python bench/peers.py --rounds 3 --steps 6 --methods ddp,zero2,zero2_q,zero3,zero3_q
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash bench/throttled.sh RATE COMMAND...   (RATE as tc writes it: 1gbit, 500mbit, 10gbit)" >&2
  exit 2
fi
rate=$1
shift
exec unshare -n bash -c 'ip link set lo up && tc qdisc add dev lo root tbf rate "$0" burst 1mb latency 100ms && exec "$@"' \
  "$rate" "$@"
