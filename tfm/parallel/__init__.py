"""Mesh, logical-axis rules, shardings and multi-host initialisation."""
from tfm.parallel.distributed import any_process, await_lost_peer, from_process_0, initialize, is_primary
from tfm.parallel.mesh import AXES, MeshConfig, make_mesh
from tfm.parallel.rules import RULE_SETS, active_param_rules, flax_rules, make_rules, param_rules, parse_parallelism
from tfm.parallel.sharding import (batch_sharding, batch_spec, global_batch, logical_specs,
                                   logical_to_spec, mirror_shardings, param_shardings)
