"""Training metrics: model FLOPs and MFU, and a logger writing to the terminal (progress
bar with ETA; plain lines when the output is redirected), JSONL, TensorBoard and (when
installed and asked for) wandb."""
from __future__ import annotations

import importlib
import json
import math
import os
import sys
from typing import Optional

import jax

# Dense bf16 peak FLOP/s per device, by `device_kind` substring, first match wins (vendor data
# sheets). TPU device kinds: v5e "TPU v5 lite", v5p "TPU v5", v6e "TPU v6 lite", v4 "TPU v4"
# (one megacore device per chip).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
              "TPU v6 lite": 918e12, "TPU v6e": 918e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12,
              "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v4": 275e12}


def flops_per_token(num_params: int, num_layers: int, attn_width: int, seq_len: int) -> float:
    """Training FLOPs per token (PaLM appendix B): 6·N for the matmuls over the weights
    (forward 2·N, backward 4·N) plus 12·L·(N_heads·H)·T for the attention scores and
    values (QKᵀ and AV, forward and backward, full T×T blocks). N: the parameters a token's
    matmuls use (`Trainer.flop_params`: lookup tables left out, a tied output table kept)."""
    return 6.0 * num_params + 12.0 * num_layers * attn_width * seq_len


def interactive_output() -> bool:
    """True in a notebook or a terminal that reports its width, where a redrawn progress bar
    stays one line; a redirected log would collect every redraw, joined by carriage returns,
    into one line, and in a terminal of width 0 the bar draws nothing at all."""
    if "ipykernel" in sys.modules:
        return True
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        return False
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except OSError:
        return False


def peak_flops(device=None) -> Optional[float]:
    kind = (device or jax.devices()[0]).device_kind
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops
    return None


def _records_upto(path: str, step: int) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r["step"] <= step]


def last_logged_step(workdir: str) -> int:
    """The largest step recorded in workdir/metrics.jsonl (0: none)."""
    return max((r["step"] for r in _records_upto(os.path.join(workdir, "metrics.jsonl"), math.inf)), default=0)


def summary_writer_class():
    """tensorboardX's SummaryWriter. Its module imports torch only to name a type in annotations (about a
    second of CPU in every run); unless torch is already loaded, it is imported with torch hidden."""
    if "tensorboardX.writer" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
        try:
            importlib.import_module("tensorboardX.writer")
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter
    return SummaryWriter


class MetricLogger:
    """Writes scalars from process 0 only; other processes keep a silent progress count."""

    def __init__(self, workdir: str, total_steps: int, *, initial_step: int = 0,
                 progress_bar: bool = True, wandb_project: Optional[str] = None,
                 config: Optional[dict] = None):
        self.primary = jax.process_index() == 0
        self.jsonl = self.tb = self.wandb = self.bar = None
        self.previous = []  # records of earlier runs in this workdir, up to initial_step
        if not self.primary:
            return
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.previous = self._keep_upto(initial_step)  # a resumed run repeats the steps after its checkpoint
        self.jsonl = open(self.path, "a")
        self.tb = summary_writer_class()(os.path.join(workdir, "tensorboard"), purge_step=initial_step + 1 if initial_step else None)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                print("wandb_project set but wandb is not installed; skipping wandb")
            else:
                self.wandb = wandb.init(project=wandb_project, dir=workdir, config=config,
                                        resume="allow")
        if progress_bar and interactive_output():  # otherwise `write` prints one plain line a step
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total_steps, initial=initial_step, unit="step",
                            dynamic_ncols=True)

    def write(self, step: int, scalars: dict, prefix: str = "train") -> None:
        if not self.primary:
            return
        scalars = {k: float(v) for k, v in scalars.items()}
        self._record(step, prefix, scalars)
        for k, v in scalars.items():
            self.tb.add_scalar(f"{prefix}/{k}", v, step)
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in scalars.items()}, step=step)
        # train: the headline; eval: every metric (an experiment's own names included)
        shown = ({k: scalars[k] for k in ("loss", "accuracy", "tokens_per_s", "mfu") if k in scalars}
                 if prefix == "train" else scalars)
        text = " ".join(f"{k}={v:.4g}" for k, v in shown.items())
        if self.bar is not None:
            if prefix == "train":
                self.bar.set_postfix_str(text)
            else:
                self.bar.write(f"step {step} {prefix}: {text}")
        else:
            print(f"step {step} {prefix}: {text}", flush=True)

    def _keep_upto(self, step: int) -> list[dict]:
        """Rewrites metrics.jsonl with its records up to `step` alone; returns them."""
        records = _records_upto(self.path, step)
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        return records

    def rewind(self, step: int) -> None:
        """Forgets the records after `step`, as a resume from a checkpoint of `step` does (a run
        rolled back to it repeats the steps after it)."""
        if not self.primary:
            return
        self.jsonl.close()
        self._keep_upto(step)
        self.jsonl = open(self.path, "a")
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def event(self, step: int, split: str, fields: dict, text: str) -> None:
        """A record of something that happened at `step` (a "recovery"), beside the metrics, and
        `text` saying it in words."""
        if not self.primary:
            return
        self._record(step, split, fields)
        self.message(text)

    def _record(self, step: int, split: str, fields: dict) -> None:
        """One line of metrics.jsonl, flushed."""
        self.jsonl.write(json.dumps({"step": step, "split": split, **fields}) + "\n")
        self.jsonl.flush()

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def message(self, text: str) -> None:
        if not self.primary:
            return
        (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
