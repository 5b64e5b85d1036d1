"""DeepSeek's MoE router settings (no torch here: model configs are read where torch is not imported)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class GroupedRouting:
    """How a DeepSeek MoE block picks its experts, as transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter do
    (layers/moe.py's `route_grouped`): scores from the router's fp32 logits (sigmoid: V3, softmax: V2); the
    experts in n_group groups, each group scored (top2_sum: the sum of its two best scores with the correction
    bias, V3; max: its best score, V2's group_limited_greedy), only the topk_group best groups' experts eligible;
    the k best eligible experts by score (+ the correction bias where the model has one: for the choice only,
    never in the weights); their scores renormalized to sum to 1 where `renormalize`, then times
    routed_scaling_factor."""

    scoring: Literal["sigmoid", "softmax"]
    n_group: int
    topk_group: int
    group_score: Literal["top2_sum", "max"]
    correction_bias: bool  # V3's e_score_correction_bias
    renormalize: bool
    routed_scaling_factor: float
