#!/bin/bash
# Run 119: chain fwd+bwd under sustained load (batches of 20 steps), every variant, with NVML energy.
set -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.limit --format=csv > $OUT/run119-sustained.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/coda-site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/coda-site
cd bench && PYTHONUNBUFFERED=1 timeout 560 python3 chain_train_bench.py --lib ../.gpubin/libcoda_capi.so --quick \
  --models llama3-1B,llama3-8B,llama3-70B --sustained 20 --json $OUT/run119-sustained.json --commit f33f8f6 >> $OUT/run119-sustained.txt 2>&1
echo "rc=$?" >> $OUT/run119-sustained.txt
