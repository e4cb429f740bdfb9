#!/usr/bin/env bash
# One device call: does numba-cuda compile under the image's numpy (with our shim)? Then
# install the pinned numpy wheel (.whl/, see ../shared/tools/gpu-wheels.sh) and run the whole
# test suite on the GPU, writing logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import numpy, numba, numba_cuda; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__)" | tee -a "$OUT/gpu.txt"
echo "--- shim check with the image's numpy" | tee -a "$OUT/gpu.txt"
PYTHONPATH=$PWD python3 -m loop_orders run --schedule q_outer --n 256 --d 64 --block-q 64 --block-k 64 2>&1 | tail -4 | tee -a "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import numpy; print('numpy for the tests', numpy.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -s -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
