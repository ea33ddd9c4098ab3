"""The numpy reference models: a ReLU MLP, and a small CNN in front of one, trained with any
loss of learning.losses (softmax cross-entropy, binary cross-entropy, MSE, MAE) on their raw outputs.

Parameters are a flat, ordered dict of float32 arrays named ``dense{i}.w`` (in, out)
and ``dense{i}.b`` (out,); the CNN adds ``conv0.w`` (k*k, channels) and ``conv0.b``
(channels,): a k x k valid convolution over the square input image, as a matrix
product with the image's k x k patches (im2col), then ReLU, flattened position by
position (channels fastest) into the MLP. The architecture follows from the shapes, so a
device learns it from the first parameter frame it receives.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from learning.losses import get_loss
from learning.metrics import METRICS

Params = dict[str, np.ndarray]


def init_mlp(sizes: list[int], seed: int) -> Params:
    """He-initialised weights and zero biases for layer sizes like [64, 64, 10]."""
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"an MLP needs at least two positive layer sizes, got {sizes}")
    rng = np.random.default_rng(seed)
    params: Params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        params[f"dense{i}.w"] = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        params[f"dense{i}.b"] = np.zeros(fan_out, dtype=np.float32)
    return params


def init_cnn(side: int, kernel: int, channels: int, hidden: list[int], classes: int, seed: int) -> Params:
    """A k x k convolution with ``channels`` filters over a side x side image, then an MLP."""
    if not 1 <= kernel <= side or channels < 1:
        raise ValueError(f"a {kernel}x{kernel} kernel with {channels} channels does not fit a {side}x{side} image")
    rng = np.random.default_rng(seed + 1_000_003)
    out = side - kernel + 1
    conv = {
        "conv0.w": (rng.standard_normal((kernel * kernel, channels)) * np.sqrt(2.0 / kernel**2)).astype(np.float32),
        "conv0.b": np.zeros(channels, dtype=np.float32),
    }
    return {**conv, **init_mlp([out * out * channels, *hidden, classes], seed)}


def architecture(params: Params) -> str:
    """``cnn`` if the parameters hold a convolution over a square image, ``conv1d`` one over time
    windows, else ``mlp``."""
    return "cnn" if "conv0.w" in params else "conv1d" if "tconv0.w" in params else "mlp"


def conv1d_geometry(params: Params, features: int) -> tuple[int, int, int, int, int]:
    """(window length, kernel, input channels, filters, pool) of a Conv1D model on ``features`` inputs
    (a (length, channels) window flattened time-major, channels fastest); ``pool``: the size of the
    max pooling after the convolution (1: none), which the shapes imply: the convolution's
    positions over the positions ``dense0.w`` takes. ValueError if they do not fit together."""
    w = params["tconv0.w"]
    if w.ndim != 3:
        raise ValueError(f"tconv0.w {w.shape}: a Conv1D kernel is (kernel, channels, filters)")
    kernel, channels, filters = (int(d) for d in w.shape)
    if channels < 1 or features % channels or not 1 <= kernel <= features // channels:
        raise ValueError(f"tconv0.w {w.shape} does not convolve windows of {features} values")
    length = features // channels
    positions, taken = length - kernel + 1, int(params["dense0.w"].shape[0])
    if params["tconv0.b"].shape != (filters,) or taken % filters or positions % max(1, taken // filters):
        raise ValueError(f"tconv0.b or dense0.w does not match tconv0.w on windows of {features} values")
    return length, kernel, channels, filters, positions // (taken // filters)


@functools.cache
def window_index(length: int, kernel: int, channels: int) -> np.ndarray:
    """(positions, kernel*channels) indices into a flattened (length, channels) window: each run of
    ``kernel`` consecutive time steps, time-major, channels fastest (a Keras Conv1D kernel's order)."""
    steps, channel = np.divmod(np.arange(kernel * channels), channels)
    starts = np.arange(length - kernel + 1)
    return ((starts[:, None] + steps[None, :]) * channels + channel[None, :]).astype(np.int32)


def convolution(params: Params, features: int) -> tuple[np.ndarray, str]:
    """(the patch index of the model's convolution on ``features`` inputs, its tensors' prefix): the
    square image's k x k patches (``conv0``) or the window's runs of time steps (``tconv0``)."""
    if architecture(params) == "cnn":
        side, kernel, _ = conv_geometry(params, features)
        return patch_index(side, kernel), "conv0"
    length, kernel, channels, _, _ = conv1d_geometry(params, features)
    return window_index(length, kernel, channels), "tconv0"


def conv_geometry(params: Params, features: int) -> tuple[int, int, int]:
    """(image side, kernel, channels) of a CNN on ``features`` inputs; ValueError if inconsistent."""
    w = params["conv0.w"]
    side, kernel = math.isqrt(features), math.isqrt(w.shape[0])
    if side * side != features or kernel * kernel != w.shape[0] or not 1 <= kernel <= side:
        raise ValueError(f"conv0.w {w.shape} does not convolve a square image of {features} values")
    channels = w.shape[1]
    if params["conv0.b"].shape != (channels,) or params["dense0.w"].shape[0] != (side - kernel + 1) ** 2 * channels:
        raise ValueError("conv0.b or dense0.w does not match conv0.w")
    return side, kernel, channels


@functools.cache
def patch_index(side: int, kernel: int) -> np.ndarray:
    """(positions, k*k) indices into a flattened side x side image: each valid k x k patch, row-major."""
    out = side - kernel + 1
    rows, cols = np.divmod(np.arange(out * out), out)
    di, dj = np.divmod(np.arange(kernel * kernel), kernel)
    return ((rows[:, None] + di[None, :]) * side + cols[:, None] + dj[None, :]).astype(np.int32)


def pool_size(params: Params, features: int) -> int:
    """The max pooling after the model's convolution (1: none; only a Conv1D's is pooled)."""
    return conv1d_geometry(params, features)[4] if architecture(params) == "conv1d" else 1


def _conv_forward(params: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(patches (n, positions, patch), activations (n, positions, channels), flattened features: the
    activations max-pooled over ``pool_size`` positions, if any)."""
    index, name = convolution(params, x.shape[1])
    patches = x[:, index]
    w = params[f"{name}.w"]
    activations = np.maximum(patches @ w.reshape(-1, w.shape[-1]) + params[f"{name}.b"], 0.0)
    pool = pool_size(params, x.shape[1])
    n, positions, channels = activations.shape
    pooled = activations.reshape(n, positions // pool, pool, channels).max(axis=2) if pool > 1 else activations
    return patches, activations, pooled.reshape(n, -1)


def mlp_sizes(params: Params) -> list[int]:
    """Layer sizes of an MLP parameter dict; ValueError if it is not one."""
    layers = len(params) // 2
    if layers < 1 or len(params) != 2 * layers:
        raise ValueError("an MLP has a weight and a bias per layer")
    sizes: list[int] = []
    for i in range(layers):
        w, b = params.get(f"dense{i}.w"), params.get(f"dense{i}.b")
        if w is None or b is None or w.ndim != 2 or b.shape != (w.shape[1],):
            raise ValueError(f"layer {i}: expected dense{i}.w (in, out) and dense{i}.b (out,)")
        if sizes and sizes[-1] != w.shape[0]:
            raise ValueError(f"layer {i}: input {w.shape[0]} does not match previous output {sizes[-1]}")
        sizes += [w.shape[0]] if not sizes else []
        sizes.append(w.shape[1])
    return sizes


def model_features(params: Params, features: int | None = None) -> int:
    """Input features of a parameter set (the CNN's image is square). A Conv1D's window length
    follows from its shapes only without pooling: with ``features`` (the data's), they are checked
    against the shapes (pooling implied) and returned; ValueError if they do not fit."""
    if architecture(params) == "mlp":
        return int(params["dense0.w"].shape[0])
    if architecture(params) == "conv1d":
        if features is None:
            kernel, channels, filters = (int(d) for d in params["tconv0.w"].shape)
            features = int((params["dense0.w"].shape[0] // filters + kernel - 1) * channels)
        conv1d_geometry(params, features)  # ValueError if the shapes do not fit together
        return features
    kernel, channels = math.isqrt(params["conv0.w"].shape[0]), params["conv0.w"].shape[1]
    out = math.isqrt(params["dense0.w"].shape[0] // channels)
    features = (out + kernel - 1) ** 2
    conv_geometry(params, features)  # ValueError if the shapes do not fit together
    return features


def dense_layers(params: Params) -> int:
    """How many dense layers the parameters hold (the MLP, or the CNN's head)."""
    return sum(1 for name in params if name.startswith("dense") and name.endswith(".w"))


def classes(params: Params) -> int:
    """Output classes: the width of the last dense layer."""
    return int(params[f"dense{dense_layers(params) - 1}.b"].shape[0])


def forward(params: Params, x: np.ndarray) -> np.ndarray:
    """Logits for a batch ``x`` of shape (n, features)."""
    h = _conv_forward(params, x)[2] if architecture(params) != "mlp" else x
    last = dense_layers(params) - 1
    for i in range(last + 1):
        h = h @ params[f"dense{i}.w"] + params[f"dense{i}.b"]
        if i < last:
            h = np.maximum(h, 0.0)
    return h


def loss_and_grads(params: Params, x: np.ndarray, y: np.ndarray, loss: str = "cross_entropy") -> tuple[float, Params]:
    """Mean ``loss`` (learning.losses) over the batch and its gradient for every parameter."""
    cnn = architecture(params) != "mlp"
    if cnn:
        patches, conv_out, h = _conv_forward(params, x)
    else:
        h = x
    last = dense_layers(params) - 1
    activations = [h]
    for i in range(last + 1):
        h = h @ params[f"dense{i}.w"] + params[f"dense{i}.b"]
        if i < last:
            h = np.maximum(h, 0.0)
            activations.append(h)
    value, delta = get_loss(loss).value_and_delta(h, y)
    grads: Params = {}
    for i in range(last, -1, -1):
        grads[f"dense{i}.w"] = (activations[i].T @ delta).astype(np.float32, copy=False)
        grads[f"dense{i}.b"] = np.add.reduce(delta, axis=0).astype(np.float32, copy=False)
        if i > 0:
            delta = (delta @ params[f"dense{i}.w"].T) * (activations[i] > 0)
    if cnn:  # back through the flattening, the pooling (to each window's maximum), the ReLU and the patch product
        name = "conv0" if "conv0.w" in params else "tconv0"
        pool = pool_size(params, x.shape[1])
        delta = delta @ params["dense0.w"].T
        if pool > 1:
            n, positions, channels = conv_out.shape
            windows = conv_out.reshape(n, positions // pool, pool, channels)
            peak = windows == windows.max(axis=2, keepdims=True)
            delta = (peak * delta.reshape(n, positions // pool, 1, channels)).reshape(n, positions, channels)
        delta = delta.reshape(conv_out.shape) * (conv_out > 0)
        w = params[f"{name}.w"]
        grads[f"{name}.w"] = np.einsum("npk,npc->kc", patches, delta).reshape(w.shape).astype(np.float32)
        grads[f"{name}.b"] = delta.sum(axis=(0, 1)).astype(np.float32)
    return value, {name: grads[name] for name in params}


def evaluate(
    params: Params, x: np.ndarray, y: np.ndarray, loss: str = "cross_entropy", metrics: tuple[str, ...] = ("accuracy",)
) -> tuple[dict[str, float], float]:
    """({metric: value}, mean ``loss``) of the model on a labelled set."""
    z = forward(params, x)
    value, _ = get_loss(loss).value_and_delta(z, y)
    return {name: METRICS[name].compute(z, y) for name in metrics}, value
