"""The numpy reference model: a ReLU MLP with softmax cross-entropy.

Parameters are a flat, ordered dict of float32 arrays named ``dense{i}.w`` (in, out)
and ``dense{i}.b`` (out,); the layer sizes follow from their shapes, so a device learns
the architecture from the first parameter frame it receives.
"""

from __future__ import annotations

import itertools

import numpy as np

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


def mlp_sizes(params: Params) -> list[int]:
    """Layer sizes of an MLP parameter dict; ValueError if it is not one."""
    layers = len(params) // 2
    if layers < 1 or len(params) != 2 * layers:
        raise ValueError("an MLP has a weight and a bias per layer")
    sizes = []
    for i in range(layers):
        w, b = params.get(f"dense{i}.w"), params.get(f"dense{i}.b")
        if w is None or b is None or w.ndim != 2 or b.shape != (w.shape[1],):
            raise ValueError(f"layer {i}: expected dense{i}.w (in, out) and dense{i}.b (out,)")
        if sizes and sizes[-1] != w.shape[0]:
            raise ValueError(f"layer {i}: input {w.shape[0]} does not match previous output {sizes[-1]}")
        sizes += [w.shape[0]] if not sizes else []
        sizes.append(w.shape[1])
    return sizes


def _layers(params: Params) -> int:
    return len(params) // 2


def forward(params: Params, x: np.ndarray) -> np.ndarray:
    """Logits for a batch ``x`` of shape (n, features)."""
    h = x
    last = _layers(params) - 1
    for i in range(last + 1):
        h = h @ params[f"dense{i}.w"] + params[f"dense{i}.b"]
        if i < last:
            h = np.maximum(h, 0.0)
    return h


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def loss_and_grads(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
    """Mean softmax cross-entropy over the batch and its gradient for every parameter."""
    last = _layers(params) - 1
    activations = [x]
    h = x
    for i in range(last + 1):
        h = h @ params[f"dense{i}.w"] + params[f"dense{i}.b"]
        if i < last:
            h = np.maximum(h, 0.0)
            activations.append(h)
    logp = _log_softmax(h)
    n = len(y)
    loss = float(-logp[np.arange(n), y].mean())
    delta = np.exp(logp)
    delta[np.arange(n), y] -= 1.0
    delta /= n
    grads: Params = {}
    for i in range(last, -1, -1):
        grads[f"dense{i}.w"] = (activations[i].T @ delta).astype(np.float32)
        grads[f"dense{i}.b"] = delta.sum(axis=0).astype(np.float32)
        if i > 0:
            delta = (delta @ params[f"dense{i}.w"].T) * (activations[i] > 0)
    return loss, {name: grads[name] for name in params}


def evaluate(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss) of the model on a labelled set."""
    logits = forward(params, x)
    logp = _log_softmax(logits)
    accuracy = float((logits.argmax(axis=1) == y).mean())
    loss = float(-logp[np.arange(len(y)), y].mean())
    return accuracy, loss
