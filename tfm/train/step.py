"""The train step: loss, gradients (optionally accumulated over microbatches), update."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from tfm.train.state import TrainState


def split_microbatches(batch: dict, n: int) -> dict:
    """[B, ...] -> [n, B/n, ...], microbatch i = rows i, i+n, … so each one keeps rows on
    every data-parallel device (a contiguous split would land each on a few devices)."""
    def one(x):
        x = x.reshape((x.shape[0] // n, n) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)
    return jax.tree.map(one, batch)


def make_train_step(model, task, tx, schedule, *, microbatches: int = 1,
                    skip_nonfinite: bool = False, microbatch_constraint=None, norm=optax.tree.norm):
    """train_step(state, batch) -> (state, metrics), for `jax.jit`.

    metrics: loss, accuracy, z_loss (with a z-loss), moe_aux_loss (a model sowing one) as full-batch
    means, grad_norm (`norm(grads)`: the trainer passes `optim.learned_norm`, the norm `tx` clips), lr, and
    finite (1.0 if loss and gradients are finite). With skip_nonfinite a
    non-finite step leaves params and optimizer state unchanged (the step counter still advances).
    `microbatch_constraint(mb)` re-shards a microbatch (the trainer passes the batch sharding).
    """
    def grads_of(params, batch, rng, totals, num_micro):
        def objective(p):
            return task.loss(model, p, batch, rng, totals, num_micro)
        (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return grads, metrics

    def train_step(state: TrainState, batch: dict):
        rng = jax.random.fold_in(state.rng, state.step)
        totals = task.weight_totals(batch)
        if microbatches == 1:
            grads, metrics = grads_of(state.params, batch, rng, totals, 1)
        else:
            micro = split_microbatches(batch, microbatches)

            def body(carry, xs):
                i, mb = xs
                if microbatch_constraint is not None:
                    mb = microbatch_constraint(mb)
                g, m = grads_of(state.params, mb, jax.random.fold_in(rng, i), totals,
                                microbatches)
                return jax.tree.map(jnp.add, carry, (g, m)), None

            zeros = jax.eval_shape(
                lambda: grads_of(state.params, jax.tree.map(lambda x: x[0], micro), rng,
                                 totals, microbatches))
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), zeros)
            (grads, metrics), _ = jax.lax.scan(body, zeros, (jnp.arange(microbatches), micro))
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        grad_norm = norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        with jax.named_scope("optimizer"):  # names the update's ops in compiled HLO
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            if skip_nonfinite:
                params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                                 (params, opt_state), (state.params, state.opt_state))
        metrics = dict(metrics, grad_norm=grad_norm, lr=schedule(state.step),
                       finite=finite.astype(jnp.float32))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(model, task):
    """eval_step(params, batch) -> (metrics as full-batch means, the batch's count of the
    first loss term's weights, e.g. target tokens), deterministic forward."""
    def eval_step(params, batch):
        totals = task.weight_totals(batch)
        _, metrics = task.loss(model, params, batch, jax.random.PRNGKey(0), totals,
                               deterministic=True)
        first = next(iter(task.weights(batch).values()))
        return metrics, jnp.sum(first.astype(jnp.float32))
    return eval_step
