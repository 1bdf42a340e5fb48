"""Group-aware placement for group-limited routing: experts ``[k * E / groups, (k + 1) * E / groups)`` form
group ``k``; the hierarchical placement packs groups onto nodes and keeps their replicas there, and the walk
then moves replicas off their group's node only as far as balance needs."""

from __future__ import annotations

import numpy as np

from .layout import FloatArray, IntArray, Layout, counts_of, gpu_loads, layer_ratio
from .packing import difference_pack, fresh_placement
from .walk import incremental

GROUP_TOLERANCE = 0.002
"""With ``num_groups``: replicas leave their group's node only until balance is this close to global."""


def group_aware(load: FloatArray, layout: Layout, num_groups: int) -> IntArray:
    """Start from the node-local (hierarchical) placement and move only the replicas needed to come
    within ``GROUP_TOLERANCE`` of the global placement's balance; layers where the local one already is
    stay wholly local, layers the walk cannot bring there take the global placement."""
    glob = fresh_placement(load, layout)
    local = group_local(load, layout, num_groups)
    top = gpu_loads(load / counts_of(glob, layout.experts), glob, layout.gpus).max(axis=1)
    walked = incremental(load, local, layout, top, None, GROUP_TOLERANCE)
    # a walk that got stuck short of the global balance gives way to the global placement
    stuck = layer_ratio(load, walked, layout.gpus) > layer_ratio(load, glob, layout.gpus) * (1 + GROUP_TOLERANCE)
    walked[stuck] = glob[stuck]
    return walked


def group_local(load: FloatArray, layout: Layout, num_groups: int) -> IntArray:
    """Groups packed onto nodes by load (equal count per node), then a fresh placement inside each node."""
    layers, experts = load.shape
    nodes = layout.nodes
    per_group = experts // num_groups
    group_load = load.reshape(layers, num_groups, per_group).sum(axis=2)
    node_groups = np.empty((layers, nodes, num_groups // nodes), dtype=np.int64)
    for layer in range(layers):
        node_groups[layer] = difference_pack(
            group_load[layer], np.arange(num_groups, dtype=np.int64), nodes, allow_dup=True
        )
    # experts of node n in layer l, [L, N, E / N]
    node_experts = (node_groups[:, :, :, None] * per_group + np.arange(per_group)).reshape(layers, nodes, -1)
    sub = Layout(experts // nodes, layout.slots // nodes, layout.gpus // nodes, 1, layout.min_distinct)
    sub_load = np.take_along_axis(load, node_experts.reshape(layers, -1), axis=1).reshape(layers * nodes, -1)
    sub_p2l = fresh_placement(sub_load, sub).reshape(layers, nodes, -1)
    return np.take_along_axis(node_experts, sub_p2l, axis=2).reshape(layers, -1)
