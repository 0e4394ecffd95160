"""ZeroRedundancyOptimizer, the drop-in for torch's: the class (``_optimizer.py``), its three
backends named by who computes the update (``_torch_backend.py``, ``_core_backend.py``,
``_torch_slices_backend.py``; see [Note: one backend] in ``_backend.py``), what it checks of its
input (``_params.py``, ``_classes.py``, ``_probe.py``) and its state dicts (``_state_dicts.py``).
"""

from shardopt.optim.zero._optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
