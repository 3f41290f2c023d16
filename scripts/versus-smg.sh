#!/usr/bin/env bash
# End to end, one router at a time in front of four fresh sim-workers
# (--speedup 4 --num-blocks 4096): 1,500 turns of the bundled ShareGPT
# conversations at concurrency 16, figures from `switchyard loadgen`.
# Until `switchyard bench versus` exists, this is how docs/simulator.md's
# end-to-end table was made.
#
#   cargo build --release -p switchyard
#   python3 -m venv /tmp/venv-smg && /tmp/venv-smg/bin/pip install smg==1.13.0   # for `smg`
#   scripts/versus-smg.sh NAME ours [POLICY]    # switchyard serve [--policy POLICY]
#   scripts/versus-smg.sh NAME smg              # smg launch --policy cache_aware
#
# CONFIG=FILE passes `--config FILE` to serve; SMG=PATH names the smg binary;
# output in $OUT (default /tmp/versus). Ports 8201, 9101-9104, 5601-5614.
set -u
NAME=$1; KIND=$2; POLICY=${3:-}
cd "$(dirname "$0")/.."
SY=$PWD/target/release/switchyard
SMG=${SMG:-/tmp/venv-smg/bin/smg}
OUT=${OUT:-/tmp/versus}
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill $p 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
workers=(); metrics=()
for i in 1 2 3 4; do
  $SY sim-worker --port 910$i --speedup 4 --num-blocks 4096 --kv-events tcp://127.0.0.1:560$i --kv-replay tcp://127.0.0.1:561$i > $OUT/w$i.log 2>&1 &
  pids+=($!)
  workers+=(--worker "http://127.0.0.1:910$i,events=tcp://127.0.0.1:560$i,replay=tcp://127.0.0.1:561$i,name=w$i")
  metrics+=(--worker-metrics "http://127.0.0.1:910$i")
done
sleep 2
if [ "$KIND" = ours ]; then
  args=(); [ -n "$POLICY" ] && args=(--policy $POLICY)
  $SY serve --port 8201 ${CONFIG:+--config $CONFIG} "${args[@]}" "${workers[@]}" > $OUT/router_$NAME.log 2>&1 &
  pids+=($!)
else
  $SMG launch --port 8201 --policy cache_aware --worker-urls http://127.0.0.1:9101 http://127.0.0.1:9102 http://127.0.0.1:9103 http://127.0.0.1:9104 > $OUT/router_$NAME.log 2>&1 &
  pids+=($!)
fi
for t in $(seq 1 90); do curl -sf -o /dev/null http://127.0.0.1:8201/v1/completions -H 'content-type: application/json' -d '{"model":"switchyard-sim","prompt":"warm","max_tokens":1}' && break; sleep 1; done
sleep 2
$SY loadgen --url http://127.0.0.1:8201 --sharegpt data/traces/sharegpt_multiturn_3000.jsonl.gz --concurrency 16 --max-requests 1500 --model switchyard-sim "${metrics[@]}" --json $OUT/$NAME.json > $OUT/lg_$NAME.txt 2>&1
tail -12 $OUT/lg_$NAME.txt
