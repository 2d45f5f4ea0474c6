"""One jitted train step (forward, backward, AdamW) vs the same-size Hugging Face PyTorch
model on the same CPU, side by side: BERT-base MLM+NSP (8 x 128), GPT-2-small LM (8 x 256),
Transformer-base (8 x 64 -> 64), with tfm's plain cross-entropy and the fused one
(`Task.vocab_chunk` = --vocab-chunk). On a GPU also prints MFU for GPT-2 small/medium at
1024 (bf16).

    python -m benchmarks.train_step [--steps 5] [--only gpt2] [--vocab-chunk 8192]

--memory compiles (without running) the GPT-2-small fp32 train step at 8 x 1024 with
chunked attention and prints XLA's temp memory, plain vs fused per chunk size:

    python -m benchmarks.train_step --memory --vocab-chunk 4096,8192,16384
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from tfm.models import DecoderLM, EncoderDecoder, EncoderModel, presets
from tfm.parallel import MeshConfig
from tfm.train import LMTask, MLMTask, OptimizerConfig, Seq2SeqTask, TrainConfig, Trainer
from tfm.train.metrics import flops_per_token, peak_flops
from tfm.train.step import make_train_step


# Smoke-run sizes of BERT and GPT-2: tfm ModelConfig fields, and the same for Hugging Face.
TINY = dict(num_layers=2, d_model=64, num_heads=2, d_ff=128)
TINY_HF = {"bert": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128),
           "gpt2": dict(n_layer=2, n_embd=64, n_head=2, n_inner=128),
           "llama1b": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=128, vocab_size=1000)}
TINY_HF["bert_dropout"] = TINY_HF["bert"]


def _jax_case(name, B, T, vocab_chunk=None):
    r = np.random.default_rng(0)
    ids = lambda *s: r.integers(5, 1000, s).astype(np.int32)
    if name in ("bert", "bert_dropout"):
        # MLM on every position: HF's BertForPreTraining scores all T tokens, so tfm does too
        batch = {"input_ids": ids(B, T), "token_type_ids": np.zeros((B, T), np.int32),
                 "attention_mask": np.ones((B, T), np.int32),
                 "mlm_positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
                 "mlm_ids": ids(B, T), "mlm_weights": np.ones((B, T), np.float32),
                 "nsp_label": np.zeros((B,), np.int32)}
        rate = 0.1 if name == "bert_dropout" else 0.0  # the paper's dropout, attention's too
        model = EncoderModel(presets.bert_base(dropout_rate=rate, attention_dropout=rate))
        return model, MLMTask(vocab_chunk=vocab_chunk), batch
    if name == "llama1b":  # Llama 3.2 1B's shape: 16 layers, width 2048, GQA 32/8, SwiGLU 8192, vocab 128k
        cfg = presets.llama(vocab_size=128_256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                            d_ff=8192, dropout_rate=0.0)
        return DecoderLM(cfg), LMTask(vocab_chunk=vocab_chunk), {"inputs": ids(B, T), "targets": ids(B, T)}
    if name.startswith("gpt2"):
        cfg = (presets.gpt2_medium if name == "gpt2_medium" else presets.gpt2_small)(dropout_rate=0.0)
        return DecoderLM(cfg), LMTask(vocab_chunk=vocab_chunk), {"inputs": ids(B, T), "targets": ids(B, T)}
    return (EncoderDecoder(presets.transformer_base(dropout_rate=0.0)), Seq2SeqTask(vocab_chunk=vocab_chunk),
            {"inputs": ids(B, T), "targets_in": ids(B, T), "targets": ids(B, T)})


def case_trainer(name, B, T, vocab_chunk=None, mesh=None, **model_changes):
    """(Trainer set up for case `name` at B x T, its batch of numpy arrays). mesh: None = the
    Trainer's own over this machine's devices; a mesh of one compile-only GPU works too (setup
    runs nothing)."""
    model, task, batch = _jax_case(name, B, T, vocab_chunk)
    if model_changes:
        model = type(model)(model.config.replace(**model_changes))
    cfg = TrainConfig(batch_size=B, mesh=MeshConfig(data=1), optimizer=OptimizerConfig())
    return Trainer(model, task, cfg, mesh).setup(batch), batch


def jax_stepper(name, B, T, dtype="float32", vocab_chunk=None, **model_changes):
    """(step, trainer, compiled): step() runs one train step to completion, warmed up; compiled is
    the step it runs (the Trainer's, compiled once ahead of time: `memory_analysis()`, `as_text()`).
    model_changes replace ModelConfig fields (attention_impl, or TINY for a smoke run)."""
    trainer, batch = case_trainer(name, B, T, vocab_chunk, dtype=dtype, **model_changes)
    state, gb = [trainer.init_state()], trainer.global_batch(batch)
    with trainer.context():
        compiled = trainer.jitted_train_step.lower(state[0], gb).compile()

    def step():
        state[0], metrics = compiled(state[0], gb)
        jax.block_until_ready(metrics)
    step()
    return step, trainer, compiled


def interleaved(steps, rounds: int) -> list[float]:
    """Fastest seconds per call of each step function, called round-robin so that load from
    other jobs on a shared machine falls on all of them alike."""
    times = [[] for _ in steps]
    for _ in range(rounds):
        for t, step in zip(times, steps):
            t0 = time.perf_counter()
            step()
            t.append(time.perf_counter() - t0)
    return [min(t) for t in times]


def compiled_temp_bytes(vocab_chunk, B=8, T=1024) -> int:
    """XLA's temp memory of the GPT-2-small fp32 train step (chunked attention), compiled
    as the Trainer compiles it (state donated) but not run."""
    trainer, batch = case_trainer("gpt2", B, T, vocab_chunk, attention_impl="chunked")
    step = make_train_step(trainer.model, trainer.task, trainer.tx, trainer.schedule)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    with trainer.context():
        compiled = jax.jit(step, donate_argnums=0).lower(trainer.abstract_state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def memory_table(vocab_chunks):
    print(f"# GPT-2 small fp32 train step, 8 x 1024, attention 'chunked'; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}")
    print(f"{'loss':<22}{'temp bytes':>16}{'temp GB':>9}{'saved GB':>10}")
    plain = compiled_temp_bytes(None)
    print(f"{'plain':<22}{plain:>16,}{plain / 1e9:>9.2f}{'':>10}", flush=True)
    for chunk in vocab_chunks:
        fused = compiled_temp_bytes(chunk)
        print(f"{f'fused, chunk {chunk}':<22}{fused:>16,}{fused / 1e9:>9.2f}{(plain - fused) / 1e9:>10.2f}",
              flush=True)


def torch_stepper(name, B, T, *, device="cpu", bf16=False, compile=False, fused=False, tiny=False):
    """step() runs one HF PyTorch train step (AdamW) to completion on `device`; warmed up.
    bf16: autocast to bfloat16; compile: `torch.compile` the model; fused: fused AdamW
    (CUDA); tiny: the TINY_HF size (BERT and GPT-2). Attention is SDPA."""
    import torch
    import transformers as hf
    g = torch.Generator().manual_seed(0)
    ids = lambda *s: torch.randint(5, 1000, s, generator=g).to(device)
    size = dict(TINY_HF[name], attn_implementation="sdpa") if tiny else dict(attn_implementation="sdpa")
    if name in ("bert", "bert_dropout"):
        rate = 0.1 if name == "bert_dropout" else 0.0
        model = hf.BertForPreTraining(hf.BertConfig(hidden_dropout_prob=rate, attention_probs_dropout_prob=rate, **size))
        kw = dict(input_ids=ids(B, T), labels=ids(B, T), next_sentence_label=torch.zeros(B, dtype=torch.long).to(device))
    elif name == "llama1b":
        shape = dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128_256)
        model = hf.LlamaForCausalLM(hf.LlamaConfig(**{**shape, **size}, rope_theta=500_000.0, tie_word_embeddings=False))
        kw = dict(input_ids=ids(B, T), labels=ids(B, T))
    elif name == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **size))
        kw = dict(input_ids=ids(B, T), labels=ids(B, T))
    else:
        model = hf.MarianMTModel(hf.MarianConfig(vocab_size=37000, d_model=512, encoder_layers=6,
                                                 decoder_layers=6, encoder_attention_heads=8,
                                                 decoder_attention_heads=8, encoder_ffn_dim=2048,
                                                 decoder_ffn_dim=2048, dropout=0.0, pad_token_id=0,
                                                 decoder_start_token_id=0, eos_token_id=1))
        kw = dict(input_ids=ids(B, T), labels=ids(B, T))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    forward = torch.compile(model) if compile else model

    def step():
        opt.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            loss = forward(**kw).loss
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
    step()
    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--only", default="bert,gpt2,transformer")
    p.add_argument("--vocab-chunk", default="8192",
                   help="fused cross-entropy chunk size(s), comma-separated (--memory: one row each); "
                        "'' times the plain loss only")
    p.add_argument("--memory", action="store_true",
                   help="compiled temp memory of the GPT-2-small 8x1024 step, plain vs fused")
    a = p.parse_args()
    chunks = [int(c) for c in a.vocab_chunk.split(",") if c]
    if a.memory:
        return memory_table(chunks)
    chunk = chunks[0] if chunks else None
    cases = {"bert": (8, 128), "gpt2": (8, 256), "transformer": (8, 64)}
    print(f"device: {jax.devices()[0].device_kind}; fastest of {a.steps} interleaved steps after one warm-up")
    fused_head = f"{f'fused {chunk} (s)':>16}{'tfm/fused':>11}" if chunk else ""
    fused_ratio = f"{'torch/fused':>13}" if chunk else ""
    print(f"{'model':<14}{'batch':>10}{'tfm (s)':>10}{fused_head}{'HF torch (s)':>14}{'torch/tfm':>11}{fused_ratio}")
    for name in a.only.split(","):
        B, T = cases[name]
        steps = {"tfm": jax_stepper(name, B, T)[0]}
        if chunk:
            steps["fused"] = jax_stepper(name, B, T, vocab_chunk=chunk)[0]
        steps["torch"] = torch_stepper(name, B, T)
        t = dict(zip(steps, interleaved(list(steps.values()), a.steps)))
        row = f"{name:<14}{f'{B}x{T}':>10}{t['tfm']:>10.3f}"
        row += f"{t['fused']:>16.3f}{t['tfm'] / t['fused']:>11.2f}" if chunk else ""
        row += f"{t['torch']:>14.3f}{t['torch'] / t['tfm']:>11.2f}"
        row += f"{t['torch'] / t['fused']:>13.2f}" if chunk else ""
        print(row, flush=True)
    if jax.default_backend() == "gpu":
        for name in ("gpt2", "gpt2_medium"):
            step, tr, _ = jax_stepper(name, 8, 1024, dtype="bfloat16", vocab_chunk=chunk)
            t, = interleaved([step], a.steps)
            cfg = tr.model.config
            fpt = flops_per_token(tr.flop_params, cfg.num_layers, cfg.d_model, 1024)
            print(f"{name} bf16 8x1024: {t:.3f} s/step, MFU {fpt * 8 * 1024 / t / peak_flops():.1%}")


if __name__ == "__main__":
    main()
