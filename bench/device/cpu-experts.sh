#!/usr/bin/env bash
# Native CPU FP4 expert kernel: build, correctness tests, then `moemesh bench fullsize-cpu` (throughput by
# thread count, the worker pool against OpenMP) on an idle host (16 / all threads, 256 experts = 3.4 GB so
# the L3 holds few of a call's experts), beside 3 busy processes, then 2 experts per call.
# Run by bench/device/run_all.sh from the repo root (cap 60 s); log to stdout, JSON into $RESULTS_DIR.
set -u
: "${RESULTS_DIR:?}"
export MOEMESH_CACHE_DIR="${TMPDIR:-/tmp}/moemesh-cache"
echo "--- $(date +%T) host: $(nproc) cpus; $(grep -m1 'model name' /proc/cpuinfo); $(uptime)"
echo "--- $(date +%T) build"
timeout 30 python3 -c "
import time; t = time.perf_counter()
from moemesh.common.kernels import cpu_fp4
k = cpu_fp4.load_native()
print(k.path, k.isa, 'openmp', k.has_openmp, f'{time.perf_counter() - t:.1f} s')"
echo "--- $(date +%T) tests"
timeout 12 python3 -m pytest -x -q -p no:cacheprovider tests/test_kernels_cpu_fp4.py \
  -k "native and (linear_matches or experts_match or pool or routed)" 2>&1 | tail -n 2
echo "--- $(date +%T) bench: paths x threads x tokens"
timeout 12 python3 -m moemesh.bench.fullsize_cpu --out-dir "$RESULTS_DIR" --threads 16,all --tokens 1,8 \
  --paths native,native_omp --reps 7 --copy-bytes 536870912 2>&1 | grep -v cpu_fp4_path
echo "--- $(date +%T) bench under load: 3 busy processes beside it (as the attention + GPU expert workers)"
busy=()
for _ in 1 2 3; do python3 -c "while True: pass" & busy+=($!); done
timeout 8 python3 -m moemesh.bench.fullsize_cpu --out-dir "$RESULTS_DIR" --threads all --tokens 1,8 \
  --paths native,native_omp --reps 5 --num-experts 128 --copy-bytes 268435456 2>&1 | grep -v cpu_fp4_path
kill "${busy[@]}"
echo "--- $(date +%T) bench: 2 experts per call (a far worker's share of one token at B = 1), idle poll 50 / 500 us"
timeout 7 python3 -m moemesh.bench.fullsize_cpu --out-dir "$RESULTS_DIR" --threads 16,all --tokens 1 --top-k 2 \
  --paths native,native_omp --spin-us 50,500 --reps 15 --copy-bytes 268435456 2>&1 | grep -v cpu_fp4_path
echo "--- $(date +%T) done"
