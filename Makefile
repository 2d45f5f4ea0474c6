# Each user-facing target installs first, so it works alone on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

PLUGINS := $(VENV)/compile-only
PLUGINS_STAMP := $(PLUGINS)/.installed

.PHONY: install compile-plugins demo test test-cpu-time bench bench-full gpu-install gpu-check gpu-mixers clean

install: $(STAMP)

# libtpu and the CUDA PJRT plugin (versions matching the installed jax) plus ptxas, apart from the
# environment: tfm.preflight and the tests compile for TPU slices and H100s from this CPU.
compile-plugins: $(PLUGINS_STAMP)

$(PLUGINS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-deps --target $(PLUGINS) \
		$$($(PY) -c "from tfm.preflight.targets import plugin_requirements as r; print(*r())")
	touch $(PLUGINS_STAMP)

# The environment the tests and the README's figures are measured in: setup.py's ranges, pinned here because a
# fresh install moves printed numbers (one commit's `make demo` gave BLEU 92.71 on 2026-12-02, 93.08 on 2026-12-04).
PINS := jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 numpy==2.4.6 \
	grain==0.2.18 tensorflow-datasets==4.9.10 sentencepiece==0.2.3 tokenizers==0.23.3 sacrebleu==2.6.0 \
	ml_collections==1.1.0 transformers==5.25.0 scipy==1.17.1 scikit-learn==1.9.1 ml_dtypes==0.7.0

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]" $(PINS)
	touch $(STAMP)

demo: install
	$(PY) -m experiments.demo

test: install compile-plugins
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

# the suite as `make test` runs it, with each test's CPU seconds (tests/cpu_time.py): where its time goes
test-cpu-time: install compile-plugins
	rm -f cpu_time.tsv
	TFM_CPU_TIME_FILE=$(CURDIR)/cpu_time.tsv PYTHONPATH=tests $(PY) -m pytest -q -n 2 --dist loadfile \
		--no-loadscope-reorder -p cpu_time tests
	$(PY) tests/cpu_time.py cpu_time.tsv

# fits 2 cores and 24 GB beside other jobs: 4.9 GB peak, 13 min measured on shared cores
bench: install
	$(PY) -m benchmarks.attention --smoke --plot benchmarks/attention_smoke.png
	$(PY) -m benchmarks.train_step --only transformer
	$(PY) -m benchmarks.decode --smoke
	$(PY) -m benchmarks.moe --tokens 1024,2048 --experts 8,16

# adds the BERT-base and GPT-2-small train steps: give it 16 GB free and nothing else running
bench-full: bench
	$(PY) -m benchmarks.train_step --only bert,gpt2
	$(PY) -m benchmarks.moe

# The GPU machine reaches no registry and its own Python has jax with CUDA: no venv; tfm
# without dependencies, plus the wheels carried into $(WHEELS) (benchmarks/gpu_check.py says which;
# gpu-mixers adds flash-linear-attention: pip download --no-deps -d wheels fla-core flash-linear-attention einops).
WHEELS ?= wheels
gpu-install:
	$(PYTHON) -m pip install --quiet --no-deps -e .
	if [ -d $(WHEELS) ]; then $(PYTHON) -m pip install --quiet --no-deps $(WHEELS)/*.whl; fi

gpu-check: gpu-install
	$(PYTHON) -m benchmarks.gpu_check --out gpu_check_out

# Token mixers against attention, L 1k-128k, beside flash-linear-attention and cuDNN (under 9 minutes)
MIXERS_OUT ?= mixer_crossover_out
gpu-mixers: gpu-install
	$(PYTHON) -m benchmarks.mixer_crossover --out $(MIXERS_OUT)

clean:
	rm -rf $(VENV) .pytest_cache
