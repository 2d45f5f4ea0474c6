"""tfm.train.host_memory: a freed buffer above glibc's default thresholds stays in the process, so
allocating it again faults in no fresh pages; a Trainer on CPU devices asks for it."""
import subprocess
import sys

import jax
import pytest

from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.parallel import MeshConfig, make_mesh
from tfm.train import LMTask, TrainConfig, Trainer, trainer as trainer_module

# 20 times: 64 MiB from malloc, as XLA:CPU takes a step's buffers, written through (16,384 pages of
# 4 KiB), then freed; prints whether the thresholds were raised and the minor page faults taken
_LOOP = """
import ctypes, ctypes.util, resource, sys
from tfm.train.host_memory import keep_freed_buffers
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
kept = sys.argv[1] == "keep" and keep_freed_buffers()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, check=True).stdout
    kept, faults = out.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_buffer_is_reused_without_page_faults():
    default, kept = _faults("default"), _faults("keep")
    assert default[0] == "False" and default[1] > 20 * 16_384 * 0.9  # every allocation faults its pages in
    assert kept[0] == "True" and kept[1] < 2 * 16_384  # the first one only (and its neighbours)


def test_a_trainer_on_cpu_devices_keeps_freed_buffers(monkeypatch):
    calls = []
    monkeypatch.setattr(trainer_module, "keep_freed_buffers", lambda: calls.append(True))
    model = DecoderLM(tiny("gpt2", num_layers=1))
    cfg = TrainConfig(num_train_steps=1, batch_size=2, mesh=MeshConfig(data=1))
    Trainer(model, LMTask(), cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    assert calls == [True]
