"""``dgc``: Deep Gradient Compression top-k with error feedback (ZEN §4), one sparsifier in one package.

* ``sparsifier.py``: ``DGCSparsifier`` (accumulation, error feedback, loss scaling, selection) and
  its registration as the ``dgc`` kind;
* ``thresholds.py``: the sampled threshold search (sample, candidates, refinement);
* ``config.py``: ``DGCConfig``, the ``zen.dgc`` section, its validation and the removed keys;
* ``defaults.py``: what a null field becomes once the engine's optimizer is known;
* ``units.py``: selection units per bucket layout, the sample grid and the threshold search's state.

Measurements behind the defaults and the removed options: docs/results/dgc_history.md.
"""

from .config import DGCConfig
from .sparsifier import DGCSparsifier

__all__ = ["DGCConfig", "DGCSparsifier"]
