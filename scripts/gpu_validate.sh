#!/usr/bin/env bash
# Runs the GPU evidence on a CUDA machine from a checkout (no pip install): the GPU tests,
# the runtime bench with profiler traces, and a real tuning job through Ray.
#   OUT=/some/dir [TRIALS=24] [SPACE=search_spaces/ctr.yaml] bash scripts/gpu_validate.sh [tests|trace|tune|all]
# Logs and JSON land in $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
what=${1:-all}
py=python3
if [ "$what" = tests ] || [ "$what" = all ]; then
  $py -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -n 15 | tee "$OUT/gpu_tests.log"
fi
if [ "$what" = trace ] || [ "$what" = all ]; then
  for b in ${TRACE_BATCHES:-2048 32768}; do
    $py -m erase_tune bench --workload ctr --arg batch=$b --arg width=256 --arg emb_dim=64 --arg rows=100000 \
      --arg sub_out=64 --arg train_batches=16 --arg eval_batches=2 --device cuda --windows 4 --window-steps 20 \
      --only "ERASE threaded,graph + detach only,graph + ERASE" --trace "$OUT/trace_$b" --json \
      > "$OUT/trace_bench_$b.json" 2> "$OUT/trace_bench_$b.err" || tail -n 5 "$OUT/trace_bench_$b.err"
    [ -s "$OUT/trace_bench_$b.err" ] && grep -v "^USDT" "$OUT/trace_bench_$b.err" | tail -n 3; rm -f "$OUT/trace_bench_$b.err"
    gzip -f "$OUT"/trace_$b/*.json 2>/dev/null
  done
fi
if [ "$what" = tune ] || [ "$what" = all ]; then
  $py -m erase_tune start --space "${SPACE:-search_spaces/ctr.yaml}" --study gpu --trials "${TRIALS:-24}" \
    --storage "sqlite:///$OUT/tune.db" 2>&1 | tee "$OUT/tune.log" | tail -n 8
  $py -m erase_tune status --study gpu --storage "sqlite:///$OUT/tune.db" 2>&1 | tee "$OUT/status.txt"
  $py -m erase_tune export --study gpu --storage "sqlite:///$OUT/tune.db" -o "$OUT/best.yaml" 2>&1 | tail -n 2
fi
for f in "$OUT"/trace_bench_*.json; do
  [ -f "$f" ] && $py -c "
import json,sys; d=json.load(open('$f'))
for r in d['rows']:
    g=r['vs_graph'] or [0,0,0]; ov=r['overlap']
    print(f\"b={d['batch_size']:<6} {r['name']:<22} vs eager {r['vs_eager'][0]:.2f}x  vs graph {g[0]:.2f}x  overlap {'-' if ov is None else format(ov,'.0%')}\")"
done
exit 0
