"""Dropout (paper section 5.4: on each sub-layer's output and on the sums of embeddings and positions, P_drop).

On CPU the mask comes from 15 random bits per element (``random_`` on int16: 0..32767) instead of one float
Bernoulli draw (``F.dropout``'s ``bernoulli_``, 10-15% of a training update here: bench/profile_train.py); the
whole forward and backward is about 1.9x faster. An element is kept when its bits are >= round(p * 2^15), so the
drop probability is p to within 2^-16 (0.1 -> 0.100006), and kept values are scaled by 1 / (1 - that
probability), as F.dropout scales by 1 / (1 - p). Elsewhere (CUDA) F.dropout's fused kernel runs as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_LEVELS = 2**15  # int16 random_ draws 0 .. 2^15 - 1


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``x`` with each element zeroed with probability ``p`` (see the module docstring) and the rest scaled up;
    ``x`` itself when not ``training`` or ``p`` is 0."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, True)
    drop = round(p * _LEVELS)
    keep = torch.empty(x.shape, dtype=torch.int16).random_() >= drop  # same shape as x
    return x * keep.to(x.dtype).mul_(_LEVELS / (_LEVELS - drop))
