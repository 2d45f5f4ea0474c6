"""How XLA TPU writes FSDP's two collectives on v5p slices, and what its cost model charges for them.

One Llama-2-7B feed-forward weight W [4096, 11008] bf16 (86 MiB), sharded on its first dim, on
compile-only v5p chips (JAX_PLATFORMS=cpu; nothing runs):

  gather   y = tanh(x @ W) with x [2 rows per chip, 256, 4096] batch-sharded and W gathered whole
           for the matmul (FSDP's forward);
  scatter  dW = xᵀ dy summed over the batch, left sharded like W (FSDP's gradient).

Each line gives the collectives of the compiled program (`tfm.preflight.read_hlo`), what its
all-reduces do (`tfm.preflight.all_reduce_forms`: "gather" / "scatter" / "sum") and XLA's
cost-model time (`optimal_seconds`) in µs. Meshes: FSDP over every chip (one axis), and W sharded
over data x fsdp but gathered in two steps (first over `data`, then over `fsdp`: the gradient the
same way back), which keeps each collective's group on part of the torus.

    JAX_PLATFORMS=cpu python -m benchmarks.fsdp_collectives                  # v5p-64 .. v5p-256
    JAX_PLATFORMS=cpu python -m benchmarks.fsdp_collectives --targets v5p-8
"""
from __future__ import annotations

import argparse
import collections

from tfm.preflight.targets import use_plugins

use_plugins()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from tfm import parallel, preflight  # noqa: E402
from tfm.parallel.mesh import MeshConfig  # noqa: E402

D, F, T = 4096, 11008, 256


def _cost_us(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return cost["optimal_seconds"] * 1e6


def _describe(compiled) -> str:
    text = compiled.as_text()
    kinds = {k: v["count"] for k, v in preflight.read_hlo(text)[0].items()}
    forms = collections.Counter(r["form"] for r in preflight.all_reduce_forms(text))
    return (f"{_cost_us(compiled):7.1f} us  {kinds}" + (f", all-reduces that {dict(forms)}" if forms else ""))


def measure(target_name: str, data: int) -> list[str]:
    """The gather and the scatter on `target_name`, W over fsdp (data=1) or data x fsdp, in two steps."""
    devices = preflight.parse_target(target_name).devices()
    mesh = parallel.make_mesh(MeshConfig(data=data, fsdp=-1), devices)
    at = lambda *spec: NamedSharding(mesh, P(*spec))
    staged = data > 1
    w_spec = ("fsdp", "data") if staged else ("fsdp",)  # `data` minor: gathering it first leaves P("fsdp")
    rows = jax.ShapeDtypeStruct((2 * len(devices), T, D), jnp.bfloat16, sharding=at(("data", "fsdp")))
    weight = jax.ShapeDtypeStruct((D, F), jnp.bfloat16, sharding=at(w_spec))
    dy = jax.ShapeDtypeStruct((2 * len(devices), T, F), jnp.bfloat16, sharding=at(("data", "fsdp")))

    def use(x, w):
        if staged:
            w = jax.lax.with_sharding_constraint(w, at("fsdp"))
        return jnp.tanh(x @ jax.lax.with_sharding_constraint(w, at()))

    def grad(x, g):
        dw = jnp.einsum("btd,btf->df", x, g)
        return jax.lax.with_sharding_constraint(dw, at("fsdp")) if staged else dw

    name = f"{target_name} ({len(devices)} chips), " + (f"data {data} x fsdp {len(devices) // data}, staged"
                                                       if staged else f"fsdp {len(devices)}")
    gather = jax.jit(use, out_shardings=at(("data", "fsdp"))).lower(rows, weight).compile()
    scatter = jax.jit(grad, out_shardings=at(w_spec)).lower(rows, dy).compile()
    return [f"{name}\n  gather  {_describe(gather)}\n  scatter {_describe(scatter)}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=["v5p-64", "v5p-128", "v5p-256"])
    parser.add_argument("--data", nargs="+", type=int, default=[1, 4], help="1: FSDP over every chip")
    args = parser.parse_args()
    print(f"jax {jax.__version__}; W [{D}, {F}] bf16; x [2 rows per chip, {T}, {D}]")
    for target in args.targets:
        for data in args.data:
            print("\n".join(measure(target, data)), flush=True)


if __name__ == "__main__":
    main()
