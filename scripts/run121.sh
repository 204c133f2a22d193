#!/bin/bash
set -u
f=$OUT/run121-sweep-sustained.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.limit --format=csv > $f
timeout 560 .gpubin/coda_program_bench --sweep-sustained --m 8192 \
  --op out_proj+F1,gate_up+F2,down_proj+F1,qkv+F3,down_bwd+B2,gate_up_bwd+B1,qkv_bwd+B1 \
  --json $OUT/run121-sweep-sustained.json --commit $1 --command "coda_program_bench --sweep-sustained --m 8192 --op (7 chain ops)" >> $f 2>&1
echo "rc=$?" >> $f
