"""The text detector's upsampling head, rewritten for OpenVINO's CPU kernels (the same sums).

rapidocr's detector (DBNet) ends in two 2 x 2, stride-2 transposed convolutions, each followed by
per-channel ops (bias, batch norm, ReLU; bias, sigmoid). With the input's height and width
dynamic, OpenVINO runs those ops as separate passes over large maps, the last of them over a
one-channel map padded to 16 channels: ~16% of the detector's time at 736 x 736.

A 2 x 2, stride-2 transposed convolution is a 1 x 1 convolution to 4x the channels, one group
per output offset (a, b), followed by a pixel shuffle. ``fold_head`` rewrites the head so:

    x -> conv 1x1 (Cin -> 4*C1, group-major) -> bias, BN, ReLU (per channel, repeated 4x)
      -> conv 1x1 (4*C1 -> 16: each group's C1 channels to its 4 offsets; zeros elsewhere)
      -> bias, sigmoid -> DepthToSpace(block 4)

so the per-channel ops fuse into the convolutions. Each output sums the same products in the
same order; the zero weights add exact zeros. Whether the compiled kernels keep every bit is
checked where it runs (``textspot_runtime.OvSession``): the rewritten model is used only when
its maps equal the original's on a test input, so output bytes never depend on it.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np


def fold_head(model: Any) -> bool:
    """Rewrite ``model``'s (an ``openvino.Model``) first pair of chained 2 x 2, stride-2
    transposed convolutions as above; False (the model untouched) when it has none."""
    for node in model.get_ordered_ops():
        w1 = k2s2_weights(node)
        if w1 is None:
            continue
        last1, ops1 = per_channel_ops(node.output(0), w1.shape[1])
        nxt = users(last1)
        w2 = k2s2_weights(nxt[0]) if len(nxt) == 1 else None
        if w2 is None or w2.shape[0] != w1.shape[1]:
            continue
        last2, ops2 = per_channel_ops(nxt[0].output(0), w2.shape[1])
        out = build(node.input_value(0), w1, ops1, w2, ops2)
        for target in list(last2.get_target_inputs()):
            target.replace_source_output(out)
        model.validate_nodes_and_infer_types()
        return True
    return False


def build(x: Any, w1: np.ndarray, ops1: list, w2: np.ndarray, ops2: list) -> Any:
    """The rewritten head on ``x``: its output (N, C2, 4H, 4W)."""
    import openvino.opset13 as o
    cin, c1 = w1.shape[:2]
    c2 = w2.shape[1]
    # first: channel g * c1 + c, g = 2a + b the output offset
    first = w1.transpose(2, 3, 1, 0).reshape(4 * c1, cin, 1, 1)
    y = apply(conv1x1(x, first), ops1, np.tile(np.arange(c1), 4))
    # second: output channel (c * 4 + dy) * 4 + dx, dy = 2a + a2, dx = 2b + b2
    second = np.zeros((c2 * 16, 4 * c1, 1, 1), w2.dtype)
    for a, b, a2, b2 in np.ndindex(2, 2, 2, 2):
        rows = np.arange(c2) * 16 + (2 * a + a2) * 4 + 2 * b + b2
        g = 2 * a + b
        second[rows, g * c1:(g + 1) * c1, 0, 0] = w2[:, :, a2, b2].T
    y = apply(conv1x1(y, second), ops2, np.repeat(np.arange(c2), 16))
    return o.depth_to_space(y, "depth_first", 4).output(0)


def conv1x1(x: Any, w: np.ndarray) -> Any:
    import openvino.opset13 as o
    return o.convolution(x, o.constant(np.ascontiguousarray(w)), [1, 1], [0, 0], [0, 0],
                         [1, 1]).output(0)


def apply(y: Any, ops: list, channel: np.ndarray) -> Any:
    """The per-channel ``ops`` (``per_channel_ops``) on ``y``, whose channel i is the original's
    ``channel[i]``."""
    import openvino.opset13 as o
    for kind, consts, eps in ops:
        if kind == "Add":
            y = o.add(y, o.constant(consts[0].reshape(-1)[channel].reshape(1, -1, 1, 1)))
        elif kind == "BatchNormInference":
            y = o.batch_norm_inference(y, *[o.constant(c[channel]) for c in consts], eps)
        else:
            y = o.relu(y) if kind == "Relu" else o.sigmoid(y)
        y = y.output(0)
    return y


def per_channel_ops(out: Any, channels: int) -> tuple[Any, list]:
    """The chain of per-channel ops that follows ``out`` alone (a constant bias, an inference
    batch norm, ReLU, sigmoid): the last output of the chain and (kind, constants, epsilon)
    per op."""
    ops: list = []
    while len(users(out)) == 1:
        node = users(out)[0]
        kind = node.get_type_name()
        if kind == "Add":
            b = constant(node.input_value(1))
            if b is None or b.size != channels or node.input_value(0) != out:
                break
            ops.append((kind, [b], None))
        elif kind == "BatchNormInference":
            consts = [constant(node.input_value(i)) for i in range(1, 5)]
            if any(c is None for c in consts):
                break
            ops.append((kind, consts, node.get_attributes()["epsilon"]))
        elif kind in ("Relu", "Sigmoid"):
            ops.append((kind, [], None))
        else:
            break
        out = node.output(0)
    return out, ops


def k2s2_weights(node: Any) -> Optional[np.ndarray]:
    """The constant weights (Cin, Cout, 2, 2) of a 2 x 2, stride-2 transposed convolution
    without padding, or None for any other node."""
    if node.get_type_name() != "ConvolutionBackpropData" or node.get_input_size() != 2:
        return None
    a = node.get_attributes()
    w = constant(node.input_value(1))
    if w is None or w.ndim != 4 or list(w.shape[2:]) != [2, 2] or list(a["strides"]) != [2, 2] \
            or list(a["dilations"]) != [1, 1] or any(a["pads_begin"]) or any(a["pads_end"]) \
            or any(a["output_padding"]):
        return None
    return w


def constant(out: Any) -> Optional[np.ndarray]:
    node = out.get_node()
    return node.get_data() if node.get_type_name() == "Constant" else None


def users(out: Any) -> list:
    return [t.get_node() for t in out.get_target_inputs()]
