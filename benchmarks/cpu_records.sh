#!/usr/bin/env bash
# The CPU records quoted in the README, in the order they were made (2-core CPU, no GPU).
# Run from the repository root after ./install.sh. Each step writes under benchmarks/results/.
# STEPS selects some of them, e.g. STEPS="demo bench" benchmarks/cpu_records.sh
set -euo pipefail
DATA=${SPEEDRUN_DATA:-../shared/datasets}
R=benchmarks/results
SR=.venv/bin/speedrun
PY=.venv/bin/python
JPEG=${JPEG_DIR:-/tmp/speedrun-cifar10-jpeg}
STEPS=${STEPS:-"demo bench pipeline folder flops ablate fast cifar"}
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has demo; then       # issue 2: the Fashion-MNIST demo as a user runs it, start-up included
  $PY benchmarks/train_cli.py fashion-mnist --runs 3 --data-dir "$DATA" --out $R/fashion-mnist-cpu-demo.json
fi
if has bench; then      # issue 3: bench, compare (fp32 against bf16 autocast), reports
  $SR bench fashion-mnist --runs 5 --data-dir "$DATA" --out $R/bench-fashion-mnist-fp32
  $SR bench fashion-mnist --runs 5 --data-dir "$DATA" --set runtime.precision=bf16 --out $R/bench-fashion-mnist-bf16
  $SR compare $R/bench-fashion-mnist-fp32 $R/bench-fashion-mnist-bf16 --json $R/compare-fashion-mnist-fp32-bf16.json \
    | tee $R/compare-fashion-mnist-fp32-bf16.txt
  $SR report $R/bench-fashion-mnist-fp32
  $SR report $R/bench-fashion-mnist-bf16
fi
if has pipeline; then   # issue 4: streamed pipeline against a per-sample Pillow pipeline
  [ -d "$JPEG" ] || $SR data export cifar10 --format jpeg --out "$JPEG" --data-dir "$DATA"
  $PY benchmarks/stream_pipeline.py "$JPEG" --batches 100 --out $R/stream-pipeline-cpu.json
fi
if has folder; then     # issue 4: the CIFAR-10 JPEG folder, streamed, then prepared and resident
  [ -d "$JPEG" ] || $SR data export cifar10 --format jpeg --out "$JPEG" --data-dir "$DATA"
  $SR train folder --data-dir "$JPEG" --set train.epochs=5 --out $R/folder-cifar10-jpeg-streamed
  $SR data prepare "$JPEG" --size 32 --out /tmp/speedrun-cifar10-32.npz
  $SR train folder --set data.dataset=npz --data-dir /tmp/speedrun-cifar10-32.npz --set train.epochs=5 \
    --out $R/folder-cifar10-jpeg-resident
  $SR report $R/folder-cifar10-jpeg-streamed
  $SR report $R/folder-cifar10-jpeg-resident
fi
if has flops; then      # issue 5: the arithmetic of the headline recipe and of the candidate
  $SR flops cifar10-94 --device cpu --data-dir "$DATA" --json $R/flops-cifar10-94-cpu.json
  $SR flops cifar10-94-fast --device cpu --data-dir "$DATA" --json $R/flops-cifar10-94-fast-cpu.json
fi
if has ablate; then     # issue 3: every trick of the demo recipe turned off in turn
  # resumed where an earlier session was cut off (the record says which variants were kept)
  $SR ablate fashion-mnist --runs 2 --data-dir "$DATA" --out $R/ablate-fashion-mnist \
    $( [ -f $R/ablate-fashion-mnist/ablate.json ] && echo --resume )
  $SR report $R/ablate-fashion-mnist
fi
if has fast; then       # issue 5: one full CPU run of the candidate recipe
  $SR train cifar10-94-fast --device cpu --data-dir "$DATA" --out $R/cifar10-94-fast-cpu
  $SR report $R/cifar10-94-fast-cpu
fi
if has cifar; then      # issue 2: the headline recipe on this CPU
  $SR train cifar10-94 --device cpu --data-dir "$DATA" --out $R/cifar10-94-cpu-final
  $SR report $R/cifar10-94-cpu-final
fi
