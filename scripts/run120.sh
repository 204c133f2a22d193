#!/bin/bash
set -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.limit --format=csv > $OUT/run120-sustained-probe.txt
cd bench && PYTHONUNBUFFERED=1 timeout 500 python3 sustained_probe.py --lib ../.gpubin/libcoda_capi.so \
  --models llama3-1B,llama3-8B,llama3-70B --json $OUT/run120-sustained-probe.json --commit $(git rev-parse --short HEAD 2>/dev/null || echo f33f8f6+probe) >> $OUT/run120-sustained-probe.txt 2>&1
echo "rc=$?" >> $OUT/run120-sustained-probe.txt
