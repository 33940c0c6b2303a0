# Sourced by the device scripts (gpu_tests.sh, multi_gpu.sh) from the repository root:
# the wheels the GPU machine lacks (pydantic, from $WHEELS) on PYTHONPATH, this checkout on
# PYTHONPATH, and NVLink multicast off (the device notes: it can take the host's GPUs out of
# service).
if ! python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
