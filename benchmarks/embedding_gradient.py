"""How accurate the token table's gradient is, by the dtype its scatter-add accumulates in.

The table's gradient sums, for every row, the cotangents of all the tokens that read it: over the
whole global batch under FSDP (`tfm.layers.embeddings.sharded_lookup` adds a D group's tokens into
each device's shard), so a frequent token's row sums tens of thousands of terms. This draws
Zipf-distributed ids (exponent --zipf, as word frequencies roughly are), bf16 cotangents (the
model's compute dtype), and compares the sum accumulated in bf16 and in fp32 with the float64 sum:
max |error| over the table / max |exact|, and the same for the most frequent row alone. Numerics,
not speed: any CPU gives the same figures.

    python -m benchmarks.embedding_gradient --vocab 32000 --tokens 1048576 --width 64
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def zipf_ids(vocab: int, tokens: int, exponent: float, seed: int = 0) -> np.ndarray:
    """int32 [tokens] in [0, vocab): id k drawn with probability proportional to (k + 1) ** -exponent."""
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -exponent
    return np.random.default_rng(seed).choice(vocab, size=tokens, p=p / p.sum()).astype(np.int32)


def errors(ids: np.ndarray, cotangents: np.ndarray, vocab: int) -> dict:
    """{dtype: (relative error over the table, relative error of the most frequent row)} of the
    scatter-add of cotangents [N, D] (bf16 values) at ids [N] accumulated in each dtype."""
    exact = np.zeros((vocab, cotangents.shape[1]))
    np.add.at(exact, ids, cotangents.astype(np.float64))
    top = np.bincount(ids, minlength=vocab).argmax()
    out = {}
    for name, dtype in DTYPES.items():
        summed = jnp.zeros(exact.shape, dtype).at[ids].add(jnp.asarray(cotangents, dtype))
        error = np.abs(np.asarray(summed, np.float64) - exact)
        out[name] = (error.max() / np.abs(exact).max(), error[top].max() / np.abs(exact[top]).max())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=1 << 20, help="the tokens summed into the table (a global batch)")
    p.add_argument("--width", type=int, default=64, help="columns of the table (D; the error does not depend on it)")
    p.add_argument("--zipf", type=float, default=1.1)
    args = p.parse_args(argv)
    ids = zipf_ids(args.vocab, args.tokens, args.zipf)
    cotangents = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (args.tokens, args.width)).astype(jnp.bfloat16),
                            np.float32)
    counts = np.bincount(ids, minlength=args.vocab)
    print(f"# embedding gradient accuracy  jax {jax.__version__}  vocab {args.vocab}  tokens {args.tokens}  "
          f"zipf {args.zipf}  width {args.width}  (most frequent id: {counts.max()} tokens; "
          f"{(counts > 0).sum()} ids seen)")
    print("| accumulated in | max error / max value (table) | the most frequent row |")
    print("|---|---|---|")
    for name, (table, row) in errors(ids, cotangents, args.vocab).items():
        print(f"| {name} | {table:.2e} | {row:.2e} |")


if __name__ == "__main__":
    main()
