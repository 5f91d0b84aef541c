#!/usr/bin/env bash
# What a session runs when its CPU is of a class the results ledger has no end-to-end entry for yet (the AVX2 class
# above all), on the idle machine:
#   1. the README's main job end to end on its own fresh stack, timed, with what it gave (ops/default_e2e.py);
#   2. the trainer against fairseq side by side in the precision this class trains in (bench/bench_vs_fairseq.py
#      train, the tiny size), fairseq's venv made first where it is missing (the recipe in that script's docstring);
#   3. on a class that trains in fp32, the same at the shape its recipe trains (fp32-recipe: d_model 128, updates of
#      2,048 tokens), over a span long enough for fairseq's whole-second clock.
# Records go to bench/results/ named after the class and the CPU's family and model; commit them, then write the
# ledger entries (the README's "What you get" row of the class cites the first).
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
class=$($py -c "from pipeline.support.hardware import cpu_class; print(cpu_class())")
fm=$(awk -F': ' '/^cpu family/{f=$2} /^model\t/{m=$2} END{print "f" f "m" m}' /proc/cpuinfo)
precision=$($py -c "from pipeline.support.hardware import training_precision; print(training_precision('auto')[0])")
tag="$class-$fm"
echo "CPU class $class ($fm), training precision $precision; records tagged $tag"
$py -m ops.default_e2e --tag "$tag"
venv=${FAIRSEQ_VENV:-/work/peers/fairseq-venv}
if [ ! -x "$venv/bin/fairseq-train" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q fairseq-fixed==0.12.3.1 "numpy<2"
fi
$py -m bench.bench_vs_fairseq train --sizes tiny --precisions "$precision" --venv "$venv" --tag "$tag"
if [ "$precision" = fp32 ]; then
  $py -m bench.bench_vs_fairseq train --sizes fp32-recipe --precisions fp32 --repeats 3 --updates 160 --skip 20 \
    --log-every 20 --venv "$venv" --tag "$tag"
fi
