# fp16_sdk developer entry points. `make demo` and `make test` install first (once).
PYTHON ?= python3
STAMP := .make-install.stamp

.PHONY: install demo test test-fast image image-gpu bench clean

install: $(STAMP)

$(STAMP): setup.cfg setup.py constraints.txt
	$(PYTHON) -m pip install -q -c constraints.txt torch==2.13.0
	$(PYTHON) -m pip install -q -c constraints.txt -e ".[test]"
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

# Needs a registry for the CUDA PyTorch base image: make image-gpu BASE_IMAGE=<cuda pytorch image>
image-gpu: install
	BASE_IMAGE="$(BASE_IMAGE)" bash container/build_image.sh gpu

clean:
	rm -rf $(STAMP) build dist *.egg-info fp16_sdk_jobs .pytest_cache
