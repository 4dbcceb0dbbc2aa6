"""Former home of the parameter server (before 0.2.0): its names, for old imports.

``from lasagne_accum.distributed.core import Shard`` keeps working; new code
imports :mod:`lasagne_accum.distributed` (the public API) or the module that
holds a name:

* :mod:`~lasagne_accum.distributed.checks`: input checks, :class:`ServerOptions`, exceptions;
* :mod:`~lasagne_accum.distributed.rounds`: a shard's bookkeeping (plain Python);
* :mod:`~lasagne_accum.distributed.shard`: the compiled apply function and :class:`Shard`;
* :mod:`~lasagne_accum.distributed.server`: :class:`BaseServer`, :class:`ParameterServer`;
* :mod:`~lasagne_accum.distributed.worker`: :class:`Worker`.

Modes: ``"sync"`` (a round closes when every live worker has pushed; the
shard applies the merged gradient once: the weighted mean, which is exactly
the gradient of the concatenated batches, or the sum) and ``"async"`` (each
push is applied on arrival; ``staleness = version now - version it was
computed from`` is recorded, and ``staleness_scale=True`` multiplies the
step by ``1 / max(1, staleness)``). Versions are per shard.
"""

from . import checks, rounds, server, shard
from .checks import *  # noqa: F403
from .checks import MERGES, MODES, check_grads, named_params, param_specs, plan_shards
from .rounds import *  # noqa: F403
from .server import *  # noqa: F403
from .shard import *  # noqa: F403
from .worker import Worker, model_spec

__all__ = ["Worker", "model_spec", "MODES", "MERGES",
           "check_grads", "named_params", "param_specs", "plan_shards"]
__all__ += checks.__all__
__all__ += rounds.__all__
__all__ += server.__all__
__all__ += shard.__all__
