# fp16_sdk developer entry points. `make demo` and `make test` install first (once).
PYTHON ?= python3
STAMP := .make-install.stamp
# The Hugging Face tests also run jobs on these transformers versions (setup.cfg pins the main
# one): each goes into its own folder, outside site-packages, that a job puts on its PYTHONPATH
# (tests/helpers/hf_versions.py). Oldest: what AWS's smp v1 GPT scripts pin (4.21) does not
# install on Python 3.11 (its tokenizers has no wheel), nor does 4.22; 4.23 does; newest: the last 4.x.
HF_OLDEST := transformers==4.23.1 tokenizers==0.13.3
HF_NEWEST := transformers==4.57.6 tokenizers==0.22.1 accelerate==1.12.0 huggingface-hub==0.36.2

.PHONY: install demo test test-fast image image-gpu bench clean

install: $(STAMP)

$(STAMP): setup.cfg setup.py constraints.txt Makefile
	$(PYTHON) -m pip install -q -c constraints.txt torch==2.13.0
	$(PYTHON) -m pip install -q -c constraints.txt -e ".[test]"
	$(PYTHON) -m pip install -q --no-deps --upgrade --target .hf-oldest $(HF_OLDEST)
	$(PYTHON) -m pip install -q --no-deps --upgrade --target .hf-newest $(HF_NEWEST)
	@touch $(STAMP)

demo: install
	$(PYTHON) examples/run_demo.py

# pytest's own status is the recipe's: 5 (no tests collected) fails like 1 does, and the
# session-end leak check in tests/conftest.py turns a leaked process or container into 1.
test: install
	$(PYTHON) -m pytest -q -ra

test-fast: install
	$(PYTHON) -m pytest -q -ra -m "not slow and not docker"

image: install
	bash container/build_image.sh cpu

# Base: BASE_IMAGE, else fp16-sdk-base:cuda-host if built (container/build_gpu_base_image.sh:
# this machine's own CUDA PyTorch, no registry), else an official CUDA PyTorch image (pulled)
image-gpu: install
	BASE_IMAGE="$(BASE_IMAGE)" bash container/build_image.sh gpu

clean:
	rm -rf $(STAMP) .hf-oldest .hf-newest build dist *.egg-info fp16_sdk_jobs .pytest_cache
