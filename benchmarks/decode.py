"""Translation decode throughput: tfm's jitted `decode.translate` vs Hugging Face
`MarianMTModel.generate`, greedy and beam 4, side by side in one process on the same CPU.

Both models are Transformer-base at the paper's size (6+6 layers, D 512, 8 heads, F 2048, ReLU,
37k shared vocabulary) with random weights, fp32, and decode the same batches of random source
ids (same lengths, padded the same way) to the same maximum output length. PyTorch gets as
many threads as XLA's CPU client uses (one per core this process may run on). Throughput is
sentences/s over the whole set, the best of --rounds interleaved passes (`interleaved`).

    python -m benchmarks.decode [--sentences 32] [--source-len 20] [--max-new 30] [--batch 1,8,32]
    taskset -c 0 python -m benchmarks.decode   # both on one core (XLA and torch follow the affinity)
    python -m benchmarks.decode --smoke     # tiny model, a few sentences: a check that it runs

On a CPU shared with other jobs, PyTorch's OpenMP threads suffer far more from
oversubscription than XLA's pool (a tiny model's generate went from 0.02 s to 1.2 s going
from 1 to 2 threads at load 8 on 2 cores): compare the one-core run too before reading a ratio.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from benchmarks.train_step import interleaved
from tfm import decode
from tfm.models import EncoderDecoder, presets

PAD, EOS, BOS = 0, 1, 2
BASE = dict(vocab=37_000, d_model=512, heads=8, layers=6, d_ff=2048)
SMOKE = dict(vocab=1_000, d_model=64, heads=4, layers=2, d_ff=128)


def sources(n: int, max_len: int, vocab: int, seed: int = 0) -> np.ndarray:
    """n random sentences [n, max_len]: lengths uniform in [max_len // 2, max_len] (the last
    token EOS), ids in [3, vocab), padded with PAD."""
    rng = np.random.default_rng(seed)
    ids = np.full((n, max_len), PAD, np.int32)
    for row, length in enumerate(rng.integers(max_len // 2, max_len + 1, n)):
        ids[row, :length - 1] = rng.integers(3, vocab, length - 1)
        ids[row, length - 1] = EOS
    return ids


def tfm_translator(size: dict, max_new: int, beam: int):
    """translate(ids [B, S]) -> tokens [B, max_new] with tfm, jitted; random weights."""
    cfg = presets.transformer_base(vocab_size=size["vocab"], d_model=size["d_model"], num_heads=size["heads"],
                                   num_layers=size["layers"], d_ff=size["d_ff"], dropout_rate=0.0)
    model = EncoderDecoder(cfg)
    dummy = jnp.zeros((1, 8), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), dummy, dummy)["params"]
    run = jax.jit(lambda p, x: decode.translate(model, p, x, max_new, bos_id=BOS, eos_id=EOS,
                                                inputs_segment_ids=(x != PAD).astype(jnp.int32),
                                                beam_size=beam, alpha=0.6, pad_id=PAD))
    return lambda ids: np.asarray(run(params, ids))


def hf_translator(size: dict, max_new: int, beam: int, device: str = "cpu"):
    """translate(ids [B, S]) -> tokens [B, <= max_new] with MarianMTModel.generate on `device`
    ("cpu" or "cuda"); random weights, fp32.

    Marian's config forces PAD as the last token by default (`forced_eos_token_id`); that is
    switched off, as tfm forces nothing. HF's length penalty (score / length ** 0.6) is not
    GNMT's, which changes which beam wins, not the work per step."""
    config = transformers.MarianConfig(
        vocab_size=size["vocab"], d_model=size["d_model"], encoder_layers=size["layers"],
        decoder_layers=size["layers"], encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"], encoder_ffn_dim=size["d_ff"], decoder_ffn_dim=size["d_ff"],
        activation_function="relu", max_position_embeddings=256, scale_embedding=True,
        share_encoder_decoder_embeddings=True, pad_token_id=PAD, eos_token_id=EOS,
        decoder_start_token_id=BOS, forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval().to(device)

    beam_flags = dict(num_beams=beam, length_penalty=0.6) if beam > 1 else {}

    def translate(ids: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(ids.astype(np.int64)).to(device)
        with torch.inference_mode():
            out = model.generate(x, attention_mask=(x != PAD).long(), do_sample=False, max_new_tokens=max_new,
                                 min_new_tokens=0, **beam_flags)
        return out[:, 1:].cpu().numpy()  # drop the decoder start token (.cpu() waits for the GPU)
    return translate


def over_batches(translate, ids: np.ndarray, batch: int):
    """A callable that translates all of ids in batches; remembers the tokens it produced last."""
    produced = {}

    def run():
        outs = [translate(ids[i:i + batch]) for i in range(0, len(ids), batch)]
        produced["tokens"] = sum(int(_lengths(o).sum()) for o in outs)
    return run, produced


def _lengths(tokens: np.ndarray) -> np.ndarray:
    """Output length per row: up to and including the first EOS, else every non-PAD position."""
    is_eos = tokens == EOS
    return np.where(is_eos.any(1), is_eos.argmax(1) + 1, (tokens != PAD).sum(1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sentences", type=int, default=32)
    p.add_argument("--source-len", type=int, default=20, help="longest source, EOS included")
    p.add_argument("--max-new", type=int, default=30, help="maximum output tokens")
    p.add_argument("--batch", default="1,8,32", help="sentences per call; a comma-separated list runs each")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny model, 4 sentences, 1 round")
    args = p.parse_args(argv)
    size = SMOKE if args.smoke else BASE
    if args.smoke:
        args.sentences, args.source_len, args.max_new, args.batch, args.rounds = 4, 8, 6, "4", 1

    threads = len(os.sched_getaffinity(0))  # XLA's CPU client uses one thread per usable core
    torch.set_num_threads(threads)
    ids = sources(args.sentences, args.source_len, size["vocab"])
    print(f"# decode benchmark  {datetime.date.today()}  {platform.processor() or platform.machine()}  "
          f"jax {jax.__version__}  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"threads {threads} (torch.set_num_threads = XLA CPU threads)"
          + ("  SMOKE: tiny model, no meaning for speed" if args.smoke else ""))
    print(f"# model {size}  sentences {args.sentences}  source len {args.source_len // 2}-{args.source_len}  "
          f"max new {args.max_new}  rounds {args.rounds}")
    print(f"{'impl':<6} {'batch':>5} {'beam':>4} {'sent/s':>9} {'s/pass':>8} {'tokens/sent':>12}")
    for batch in (int(b) for b in args.batch.split(",")):
        for beam in (1, 4):
            runs = [over_batches(make(size, args.max_new, beam), ids, batch)
                    for make in (tfm_translator, hf_translator)]
            for run, _ in runs:
                run()  # warm-up: compiles tfm's decode, lets torch allocate
            seconds = interleaved([run for run, _ in runs], args.rounds)
            for name, s, (_, produced) in zip(("tfm", "hf"), seconds, runs):
                print(f"{name:<6} {batch:>5} {beam:>4} {args.sentences / s:>9.2f} {s:>8.3f} "
                      f"{produced['tokens'] / args.sentences:>12.1f}")
            print(f"ratio tfm/hf, batch {batch}, beam {beam}: {seconds[1] / seconds[0]:.2f}x (sentences/s)", flush=True)

if __name__ == "__main__":
    main()
