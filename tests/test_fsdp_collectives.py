"""FSDP as FSDP: the compiled train step of a small decoder under every rule set with fsdp gathers
each weight for its use and reduce-scatters its gradient, and sums nothing of a weight's or an
activation's size over the batch axes (compile-only v5p chips; nothing runs on them).

The check reads the program through `tfm.preflight.all_reduce_forms`: XLA TPU writes some
all-gathers as an all-reduce of the shard placed in zeros (small ones; on a slice without wraparound
links, all over 64 chips) and a reduce-scatter over a whole v5p slice as an all-reduce of which each
chip keeps its slice; those count as the gathers and scatters they are. What must not appear is an
all-reduce that sums partial products of weight or activation size (a contraction over a sharded
dim), e.g. from activations split on "embed".
"""
import math

import jax
import pytest

from tfm import parallel, preflight
from tfm.data import pipeline
from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.parallel.mesh import MeshConfig
from tfm.preflight.analysis import shape_arrays, sharded_data_groups
from tfm.train import LMTask, TrainConfig, Trainer

T = 128
MIN_BYTES = 4096  # the smallest weight here is 32 KiB (wq [128, 4, 32] bf16); norm scales f32[128] are 512 B


def _compile(target_name, mesh_config, parallelism, family="llama", activation_rules=None):
    """(collectives by kind, all-reduce forms, trainer) of a 2-layer scanned bf16 decoder's train step."""
    cfg = tiny(family, d_model=128, d_ff=256, num_heads=4, num_kv_heads=4, max_len=T, dtype="bfloat16",
               attention_impl="xla", scan_layers=True, remat_policy="dots_with_no_batch_dims_saveable")
    target = preflight.parse_target(target_name)
    train = TrainConfig(batch_size=2 * target.chips, mesh=mesh_config, parallelism=parallelism, num_train_steps=10)
    batch = pipeline.lm_batch_spec(train.batch_size, T)
    trainer = Trainer(DecoderLM(cfg), LMTask(), train, parallel.make_mesh(train.mesh, target.devices())).setup(batch)
    if activation_rules is not None:
        trainer.activation_rules = activation_rules
    sharded = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding) for k, v in batch.items()}
    with trainer.context():
        text = trainer.jitted_train_step.trace(trainer.abstract_state, sharded).lower().compile().as_text()
    collectives, _, _ = preflight.read_hlo(text)
    return collectives, preflight.all_reduce_forms(text), trainer


def _weight_arrays(trainer) -> set:
    """"128,4,32"-style per-device shapes of every matrix parameter as an FSDP gather yields them for
    one layer: whole on the axes that split the batch (fsdp, context, and expert beside fsdp), still
    split on tensor and on an "expert" dim (the one dim that `expert` alone shards)."""
    shapes = set()
    for x in jax.tree.leaves(trainer.abstract_state.params):
        if len(x.shape) < 2:
            continue
        spec = tuple(x.sharding.spec) + (None,) * (len(x.shape) - len(x.sharding.spec))
        shape = []
        for dim, axes in zip(x.shape, spec):
            axes = (axes,) if isinstance(axes, str) else axes or ()
            kept = [a for a in axes if a == "tensor" or axes == ("expert",)]
            shape.append(dim // math.prod(trainer.mesh.shape[a] for a in kept))
        scanned = len(shape) > 2 and x.shape[0] == trainer.model.config.num_layers  # [layers, ...]
        shapes.add(",".join(map(str, shape[1:] if scanned else shape)))
    return shapes


def _check_fsdp(collectives, forms, trainer):
    """No weight- or activation-sized sum outside the groups the rules sum over by design
    (`sharded_data_groups`); some weight gathered whole (per device) and some gradient reduce-scattered."""
    expected = sharded_data_groups(trainer)
    unexpected = preflight.unexpected_all_reduces(forms, min_bytes=MIN_BYTES, expected_groups=expected)
    assert not unexpected, [(r["array"], r["group_size"], r["op_name"][-80:]) for r in unexpected]
    weights = _weight_arrays(trainer)
    whole = lambda array: array.split("[")[1].rstrip("]").removeprefix("1,") in weights
    gathered = [a for a in collectives.get("all-gather", {}).get("shapes", []) if whole(a)]
    gathered += [r["array"] for r in forms if r["form"] == "gather" and r["bytes"] >= MIN_BYTES and whole(r["array"])]
    scattered = collectives.get("reduce-scatter", {}).get("count", 0)
    scattered += sum(r["form"] == "scatter" and r["bytes"] >= MIN_BYTES for r in forms)
    assert gathered, ("no weight all-gathered", collectives)
    assert scattered, ("no gradient reduce-scattered", collectives)


@pytest.mark.parametrize("parallelism,mesh,family", [
    ("fsdp", MeshConfig(data=1, fsdp=4), "llama"),
    ("fsdp+tensor", MeshConfig(data=1, fsdp=4, tensor=2), "llama"),
    ("fsdp+context", MeshConfig(data=1, fsdp=4, context=2), "llama"),
    ("fsdp+expert", MeshConfig(data=1, fsdp=4, expert=2), "moe"),
], ids=["fsdp", "fsdp+tensor", "fsdp+context", "fsdp+expert"])
def test_fsdp_gathers_weights_and_scatters_gradients(parallelism, mesh, family):
    """v5p-8 (fsdp alone, 4 chips) or v5p-16 (8 chips: fsdp 4 x the other axis 2). By design, the
    row-parallel projections of tensor parallelism sum their partial products over the tensor group
    (2 chips); nothing else of a weight's or an activation's size is summed. Under fsdp+expert the
    weights without an "expert" dim were replicated over `expert`, and every gradient shard was summed
    whole over it: this fails unless the fsdp+expert rules shard them over `expert` too."""
    target = "v5p-8" if parallelism == "fsdp" else "v5p-16"
    collectives, forms, trainer = _compile(target, mesh, parallelism, family)
    _check_fsdp(collectives, forms, trainer)


def test_fsdp_over_a_whole_torus_gathers_with_all_gathers():
    """fsdp over 128 chips (v5p-256: a 4x4x8 torus with its wraparound links, `Target.wraparound`):
    every matrix is gathered by a real all-gather, none as an all-reduce of its shard laid in zeros
    (libtpu's form for a whole-slice gather on an open mesh, which a preflight without the links
    compiled, at the cost of zero-filling each gathered weight); gradients are reduce-scattered and
    nothing of weight size is summed."""
    collectives, forms, trainer = _compile("v5p-256", MeshConfig(data=1, fsdp=-1), "fsdp")
    _check_fsdp(collectives, forms, trainer)
    zero_filled = [r["array"] for r in forms if r["form"] == "gather" and r["bytes"] >= MIN_BYTES]
    gathered = {tuple(d for d in dims if d != 1)  # the layer's unit dim dropped, wherever XLA put it
                for a in collectives.get("all-gather", {}).get("shapes", []) for _, dims in shape_arrays(a)}
    layers = trainer.model.config.num_layers
    matrices = {x.shape[1:] for x in jax.tree.leaves(trainer.abstract_state.params)
                if x.ndim >= 3 and x.shape[0] == layers}  # the scanned layers' weights, one layer each
    assert len(matrices) >= 4 and not zero_filled and matrices <= gathered, (zero_filled, matrices - gathered)


def test_activations_split_on_embed_are_caught():
    """The check can fail: activations split over fsdp on "embed" (D), as the weights are, instead of on
    "batch" make every projection contract a sharded dim, and XLA sums the partial products whole.
    (The first rule for a name wins.)"""
    wrong = (("batch", ("data",)), ("embed", ("fsdp",)))
    rules = parallel.flax_rules(wrong + parallel.make_rules("fsdp", activations=True))
    collectives, forms, trainer = _compile("v5p-8", MeshConfig(data=1, fsdp=4), "fsdp", activation_rules=rules)
    unexpected = preflight.unexpected_all_reduces(forms, min_bytes=MIN_BYTES)
    assert unexpected, forms
    with pytest.raises(AssertionError):
        _check_fsdp(collectives, forms, trainer)
