# Each user-facing target installs first, so it works alone on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench bench-full clean

install: $(STAMP)

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: install
	$(PY) -m experiments.demo

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# fits 2 cores and 24 GB beside other jobs: 4.9 GB peak, 13 min measured on shared cores
bench: install
	$(PY) -m benchmarks.attention --smoke --plot benchmarks/attention_smoke.png
	$(PY) -m benchmarks.train_step --only transformer
	$(PY) -m benchmarks.decode --smoke

# adds the BERT-base and GPT-2-small train steps: give it 16 GB free and nothing else running
bench-full: bench
	$(PY) -m benchmarks.train_step --only bert,gpt2

clean:
	rm -rf $(VENV) .pytest_cache
