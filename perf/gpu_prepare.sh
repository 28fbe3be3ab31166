#!/usr/bin/env bash
# Prepares .gpu/ for perf/gpu_check.sh, on a machine with internet, from the project root:
#   bash perf/gpu_prepare.sh
# .gpu/site.tar.xz: what the GPU machine's image lacks (../shared/gpu/README.md says what it has: torch 2.11,
#   triton 3.6, transformers 5.17, numpy, httpx, pyyaml, ...), installed for its Python 3.12 and packed as
#   one solid archive. transformers >= 5.23 (pyproject's floor) is a 13 MB wheel and 3.7 MB in it, which
#   keeps .gpu/ under the 64 MiB a run may carry beside the compile cache.
#   With AOT_PYTHON set, it also holds FlashInfer's modules built for Hopper (below).
# .gpu/default: the default model's tokenizer files, converted here if need be (test_structured reads only
#   them; its 94 MB GGUF cannot travel).
# .gpu/cache/: the cache parts (kc.*) the last run returned go here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .gpu/cache
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
pkgs=(
  flashinfer-python==0.5.3 "apache-tvm-ffi<0.2"                                  # attention and sampling
  msgspec orjson starlette hypercorn h2 hpack hyperframe priority wsproto gguf   # the server, the GGUF reader
  "transformers>=5.23" "huggingface-hub>=1.31,<2"                                # the image's 5.17 is too old
  "xgrammar>=0.2.8,<0.3" pydantic pydantic-core annotated-types typing-inspection typing-extensions
  openai anyio httpx2 httpcore2 jiter sniffio truststore idna                    # tests' OpenAI client
)
"$PY" -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --target "$stage" "${pkgs[@]}"
rm -rf "$stage/bin"
# FlashInfer's modules, built here with no GPU for Hopper (sm_90a) by CUDA 13.0's nvcc (the image's), into
# the site's AOT folder: the GPU machine loads them and builds nothing, where its cold build took 100-176 s
# of a 900 s lease (all 13 took 30 min here on 2 cores; 2.3 MB more in the archive). AOT_PYTHON: a Python
# 3.12 (the image's; tvm-ffi's extension is built for it) with what flashinfer imports: torch, numpy,
# packaging, requests, einops, click, tabulate, tqdm, nvidia-ml-py.
if [ -n "${AOT_PYTHON:-}" ]; then
  cuda=$(mktemp -d); trap 'rm -rf "$stage" "$cuda"' EXIT
  "$PY" -m pip download -q --no-deps -d "$cuda/whl" "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
    "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-curand==10.4.0.*"
  for w in "$cuda"/whl/*.whl; do "$PY" -m zipfile -e "$w" "$cuda"; done
  home=$cuda/nvidia/cu13; chmod +x "$home"/bin/* "$home"/nvvm/bin/*
  ln -s lib "$home/lib64" && ln -s libcudart.so.13 "$home/lib/libcudart.so" && mkdir "$home/lib/stubs"
  # FlashInfer links -lcuda: an empty stand-in, as the driver's own libcuda.so.1 resolves it at load.
  echo > "$cuda/stub.c" && cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib/stubs/libcuda.so" "$cuda/stub.c"
  CUDA_HOME=$home PYTHONPATH=$stage:$PWD "$AOT_PYTHON" perf/gpu_prebuild.py --aot 9.0a
else
  echo "AOT_PYTHON unset: FlashInfer's modules will be built on the GPU machine"
fi
tar -C "$stage" -cf - . | xz -9 -T0 > .gpu/site.tar.xz
rm -rf .gpu/whl  # replaced by site.tar.xz
models=$("$PY" -c "from kiln.models.convert import default_model_dir; print(default_model_dir())")
mkdir -p .gpu/default && cp "$models"/*.json "$models/.kiln-complete" .gpu/default/
"$PY" -m pip list --path "$stage" 2>/dev/null | tail -n +3 | tr -s ' ' '=' | paste -sd' '
du -sh .gpu/* | sort -h
