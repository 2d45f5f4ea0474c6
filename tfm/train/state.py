"""Train state: a pytree of step, params, optimizer state and RNG key."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
    step: jax.Array       # int32 scalar: number of updates applied
    params: Any
    opt_state: Any
    rng: jax.Array        # uint32 [2] base key; step t uses fold_in(rng, t)
