"""The train-step speed changes keep the loss curve: 20 Adam steps on CPU (fp32) of the tiny
GPT-2-style decoder (tied output) and the tiny Llama (untied `lm_head`), with label smoothing
and z-loss, give the same losses

  - with the logits matmul padded to whole tiles (ExecutionConfig.logits_block_size 48: V 64
    runs as 96) as unpadded (1), and
  - with `cross_entropy`'s own VJP as with the loss written out with `jax.nn.log_softmax` and
    differentiated by autodiff (`WrittenOutLMTask`).

Tolerance: rtol 1e-5 per step (fp32; both pairs compute the same sums in another order, and 20
Adam steps carry the rounding forward)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.parallel import MeshConfig, make_mesh
from tfm.train import LMTask, OptimizerConfig, TrainConfig, Trainer
from tfm.train.losses import LossTerm

B, T, V, STEPS = 4, 16, 64, 20
RTOL = 1e-5
SMOOTHING, Z_LOSS = 0.1, 1e-4


def written_out_terms(logits, targets, weights):
    """Per-token (smoothed cross-entropy, log Z) [B, T] of fp32 logits [B, T, V], from
    log_softmax and an explicit smoothed target; its gradient is autodiff's."""
    log_p = jax.nn.log_softmax(logits)
    hot = jax.nn.one_hot(targets, logits.shape[-1])
    soft = hot * (1 - SMOOTHING) + (1 - hot) * SMOOTHING / (logits.shape[-1] - 1)
    ce = -jnp.sum(soft * log_p, -1) + jnp.sum(soft * jnp.log(soft), -1)  # 0 for the smoothed target itself
    return ce * weights, jax.nn.logsumexp(logits, -1)


class WrittenOutLMTask(LMTask):
    """LMTask with its cross-entropy written out (`written_out_terms`), not tfm's."""

    def loss_terms(self, out, batch):
        weights = self.weights(batch)["lm"]
        ce, log_z = written_out_terms(out.logits, batch["targets"], weights)
        correct = (jnp.argmax(out.logits, -1) == batch["targets"]) * weights
        return {"lm": LossTerm(ce=jnp.sum(ce), z=self.z_loss * jnp.sum(log_z ** 2 * weights),
                               weight=jnp.sum(weights), correct=jnp.sum(correct))}


def _batches():
    r = np.random.default_rng(0)
    weights = np.ones((B, T), np.float32)
    weights[:, -3:] = 0  # padding
    out = []
    for _ in range(2):  # alternated: the loss falls on both, so the curve is not flat
        y = r.integers(0, V, (B, T + 1)).astype(np.int32)
        out.append({"inputs": y[:, :-1], "targets": y[:, 1:], "weights": weights})
    return out


def curves(family: str, runs: dict) -> dict:
    """name -> per-step losses (objective: loss + z-loss) of a 20-step Adam run on one device, for
    runs {name: (task class, logits_block_size)}, all from the same initial state."""
    batches, first = _batches(), None
    cfg = TrainConfig(num_train_steps=STEPS, batch_size=B, mesh=MeshConfig(data=1),
                      optimizer=OptimizerConfig(name="adam", learning_rate=3e-3))
    out = {}
    for name, (task_cls, block) in runs.items():
        model = DecoderLM(tiny(family, num_layers=1, logits_block_size=block))
        task = task_cls(label_smoothing=SMOOTHING, z_loss=Z_LOSS)
        trainer = Trainer(model, task, cfg, make_mesh(cfg.mesh, jax.devices()[:1])).setup(batches[0])
        if first is None:  # neither setting changes the parameters: one initial state for all runs
            first = trainer.init_state()
        state, out[name] = jax.tree.map(jnp.copy, first), []  # the step donates its state
        for step in range(STEPS):
            state, metrics = trainer.train_step(state, trainer.global_batch(batches[step % 2]))
            out[name].append(float(metrics["loss"]) + float(metrics["z_loss"]))
    return {name: np.asarray(losses) for name, losses in out.items()}


@pytest.mark.parametrize("family", ["decoder", "llama"])
def test_step_changes_keep_the_loss_curve(family):
    runs = curves(family, {"tfm": (LMTask, 1), "padded": (LMTask, 48), "written out": (WrittenOutLMTask, 1)})
    tfm_loss, padded, written_out = runs["tfm"], runs["padded"], runs["written out"]
    print(f"{family}: losses {tfm_loss[0]:.4f} -> {tfm_loss[-1]:.4f}; max rel diff: padded "
          f"{np.max(np.abs(padded / tfm_loss - 1)):.1e}, written out {np.max(np.abs(written_out / tfm_loss - 1)):.1e}")
    assert tfm_loss[-1] < tfm_loss[0] - 0.5  # it trains: the curve compared is not flat
    np.testing.assert_allclose(padded, tfm_loss, rtol=RTOL, err_msg="logits_block_size 48 vs 1")
    np.testing.assert_allclose(written_out, tfm_loss, rtol=RTOL, err_msg="written-out loss vs cross_entropy")
