"""Dropout (paper section 5.4: on each sub-layer's output and on the sums of embeddings and positions, P_drop).

On CPU the mask comes from 15 random bits per element instead of one float Bernoulli draw (``F.dropout``'s
``bernoulli_``, a sizeable share of a training update here: bench/profile_train.py, results ledger L03). The bits
are drawn 63 at a time: ``random_`` on int64 fills [0, 2^63) from two 32-bit generator outputs, and each value is
read as four int16 lanes, three of 16 uniform bits (-2^15 .. 2^15 - 1) and, on top, one of 15 (0 .. 2^15 - 1). An
element is dropped when its lane is below the lane's threshold, ``2 d - 2^15`` for the 16-bit lanes and ``d`` for
the 15-bit one, ``d = round(p * 2^15)``: the same probability ``d / 2^15`` in every lane, p to within 2^-16 (0.1 ->
0.100006). Kept values are scaled by ``1 / (1 - d / 2^15)``, as F.dropout scales by 1 / (1 - p). Mask generation is
faster than one int16 draw per element, and faster still than ``bernoulli_`` (results ledger L04). Elsewhere (CUDA)
F.dropout's fused kernel runs as it is.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor

_LEVELS = 2**15  # 15-bit lanes: 0 .. 2^15 - 1
_LANES = 4  # int16 lanes per int64 draw; the last (most significant) has 15 random bits on little-endian CPUs


def _keep_mask(shape: torch.Size, drop: int) -> Tensor:
    """Boolean mask of ``shape``, each element False with probability ``drop / 2^15``."""
    n = shape.numel()
    lanes = torch.empty(-(-n // _LANES), dtype=torch.int64).random_().view(torch.int16).view(-1, _LANES)
    thresholds = torch.tensor([2 * drop - _LEVELS] * (_LANES - 1) + [drop], dtype=torch.int16)  # [4]
    return (lanes >= thresholds).view(-1)[:n].view(shape)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``x`` with each element zeroed with probability ``p`` (see the module docstring) and the rest scaled up;
    ``x`` itself when not ``training`` or ``p`` is 0."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0 or sys.byteorder != "little":
        return F.dropout(x, p, True)
    drop = round(p * _LEVELS)
    keep = _keep_mask(x.shape, drop)  # same shape as x
    # mask x scale in x's dtype in one pass (what backward multiplies the gradient by)
    scale, zero = (torch.tensor(v, dtype=x.dtype) for v in (_LEVELS / (_LEVELS - drop), 0.0))
    return x * torch.where(keep, scale, zero)
