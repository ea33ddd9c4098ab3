"""A ``tf.keras`` model as the built-in model (learning.model), and back.

Every device tier (numpy, TFLite, the C SDK for MLPs) runs the built-in model: dense layers with
ReLU between them, optionally after one convolution. A Keras model converts when its layers are
that model, layer for layer:

* ``Dense`` (with bias): ReLU on every hidden layer; on the last, the activation the loss implies
  (``softmax`` or none for cross_entropy, ``sigmoid`` or none for bce, none for mse and mae);
* ``Conv2D`` first, once, on a square one-channel image (``Input((s, s, 1))`` or ``Reshape((s, s,
  1))`` of s*s features): stride 1, ``valid`` padding, no dilation, with bias, ReLU; then ``Flatten``;
* ``Conv1D`` first, once, on a sensor window ``Input((steps, channels))`` (the features are the
  window flattened time-major, channels fastest): the same rules; optionally one ``MaxPooling1D``
  right after it (strides = pool size, ``valid``, a pool size dividing its positions); ``Flatten``;
* ``ReLU``, ``Activation`` (relu, and on the last layer softmax/sigmoid as above), ``Softmax``;
* ``Dropout``: accepted and not applied (devices train without it; Keras skips it at inference too);
* ``Flatten`` and ``InputLayer``.

Anything else (other pooling, BatchNormalization, DepthwiseConv2D, recurrent layers, other activations,
strides or padding) is refused before the job starts, naming the layer. Tensors are named as the
built-in model's (``conv0.w``, ``dense{i}.w``, ...); ``layer_names`` maps them to the Keras layers.

TensorFlow is imported only by ``save_keras``; ``from_keras`` reads the model it is given.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from learning.model import Params

#: The activation the last layer may carry for each loss (besides none: raw outputs).
HEADS = {"cross_entropy": "softmax", "bce": "sigmoid", "mse": None, "mae": None}


class KerasError(ValueError):
    """A Keras model that does not convert; the message names the layer."""


def quiet_tensorflow() -> None:
    """TensorFlow's start-up chatter off, for a process about to import it: its C++ logs below warnings, and
    oneDNN's note ("oneDNN custom operations are on"), which TensorFlow 2.21 writes through absl whatever
    TF_CPP_MIN_LOG_LEVEL says; oneDNN's reordered float sums go with it. A user's own setting wins."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def _activation(layer: Any) -> str:
    config = layer.get_config()
    name = config.get("activation", "linear")
    return str(name if isinstance(name, str) else getattr(name, "__name__", name))


def _one(value: Any) -> int:
    """A 1-D layer's size, written as a number or a one-element list."""
    return int(value[0] if isinstance(value, list | tuple) else value)


def _walk(model: Any, loss: str) -> list[tuple[Any, list[str]]]:
    """(Keras layer, the built-in tensor names of its weights) for every layer with weights."""
    shape = tuple(model.input_shape[1:])
    image = len(shape) == 3 and shape[0] == shape[1] and shape[2] == 1
    window = len(shape) == 2  # (time steps, channels): a sensor window, for a Conv1D
    if not image and not window and len(shape) != 1:
        raise KerasError(
            f"input shape {shape}: edgeps takes (features,), a window (steps, channels) for a Conv1D, "
            "or a square one-channel image (s, s, 1)"
        )
    mapped: list[tuple[Any, list[str]]] = []
    dense, flat = 0, not (image or window)
    pooled, positions = False, 0  # a Conv1D's max pooling, and the positions it pools
    act, owner = "", ""  # the activation of the last Dense or Conv2D so far, and that layer
    for layer in model.layers:
        kind = type(layer).__name__
        name = f"layer {layer.name!r} ({kind})"
        config = layer.get_config()
        if kind in ("InputLayer", "Dropout"):
            continue
        if kind == "Reshape":
            target = tuple(config["target_shape"])
            if image or len(target) != 3 or target[0] != target[1] or target[2] != 1 or target[0] ** 2 != shape[0]:
                raise KerasError(f"{name}: only a first Reshape of s*s input features to (s, s, 1) converts")
            image, flat = True, False
        elif kind == "Flatten":
            flat = True
        elif kind == "MaxPooling1D":
            size, step = _one(config["pool_size"]), _one(config.get("strides") or config["pool_size"])
            if not mapped or type(mapped[-1][0]).__name__ != "Conv1D" or flat or pooled:
                raise KerasError(f"{name}: one MaxPooling1D converts, right after the Conv1D")
            if step != size or config["padding"] != "valid" or positions % size:
                raise KerasError(
                    f"{name}: needs strides equal to its pool size, padding 'valid', and a pool size "
                    f"that divides the Conv1D's {positions} positions"
                )
            pooled = True
        elif kind in ("ReLU", "Activation", "Softmax"):
            new = {"ReLU": "relu", "Softmax": "softmax"}.get(kind) or _activation(layer)
            if kind == "ReLU" and (config.get("max_value") is not None or config.get("negative_slope")):
                raise KerasError(f"{name}: only a plain ReLU converts (no max_value, no negative_slope)")
            if act != "linear":
                raise KerasError(f"{name}: an activation layer converts only right after a Dense or Conv2D without one")
            act, owner = new, name
        elif kind in ("Conv2D", "Conv1D", "Dense"):
            if mapped and act != "relu":
                raise KerasError(f"{owner}: activation {act!r} on a hidden layer does not convert (edgeps runs ReLU)")
            if not config["use_bias"]:
                raise KerasError(f"{name}: needs use_bias=True")
            if kind == "Conv2D":
                kernel = tuple(config["kernel_size"])
                if mapped or not image or flat:
                    raise KerasError(f"{name}: only one Conv2D converts, first, on a (s, s, 1) image")
                plain = tuple(config["strides"]) == (1, 1) and tuple(config.get("dilation_rate", (1, 1))) == (1, 1)
                if kernel[0] != kernel[1] or not plain or config["padding"] != "valid" or config.get("groups", 1) != 1:
                    raise KerasError(f"{name}: needs a square kernel, strides 1, padding 'valid', no dilation")
                mapped.append((layer, ["conv0.w", "conv0.b"]))
            elif kind == "Conv1D":
                if mapped or not window or flat:
                    raise KerasError(f"{name}: only one Conv1D converts, first, on a (steps, channels) window")
                plain = tuple(config["strides"]) == (1,) and tuple(config.get("dilation_rate", (1,))) == (1,)
                if not plain or config["padding"] != "valid" or config.get("groups", 1) != 1:
                    raise KerasError(f"{name}: needs strides 1, padding 'valid', no dilation")
                mapped.append((layer, ["tconv0.w", "tconv0.b"]))
                positions = shape[0] - int(config["kernel_size"][0]) + 1
            else:
                if not flat:
                    raise KerasError(f"{name}: a Dense after a convolution needs a Flatten before it")
                mapped.append((layer, [f"dense{dense}.w", f"dense{dense}.b"]))
                dense += 1
            act, owner = _activation(layer), name
        else:
            raise KerasError(
                f"{name} does not convert: edgeps runs Dense, one Conv2D or Conv1D, Flatten, Dropout, ReLU and "
                "the output's activation (docs/TASKS.md)"
            )
    if not mapped or type(mapped[-1][0]).__name__ != "Dense":
        raise KerasError("the model's outputs must come from a Dense layer")
    head = HEADS[loss]
    allowed = {"linear", head} if head else {"linear"}
    if act not in allowed:
        raise KerasError(
            f"{owner}: activation {act!r} on the output does not fit loss {loss!r} (use {' or '.join(sorted(allowed))})"
        )
    return mapped


def from_keras(model: Any, loss: str) -> Params:
    """The built-in model's parameters holding the Keras model's weights; KerasError naming the
    first layer that does not convert."""
    if loss not in HEADS:
        raise KerasError(f"a Keras task trains one of the losses {', '.join(HEADS)}, not {loss!r}")
    params: Params = {}
    for layer, names in _walk(model, loss):
        kernel, bias = (np.asarray(w, np.float32) for w in layer.get_weights())
        if names[0] == "conv0.w":
            kernel = kernel.reshape(-1, kernel.shape[-1])  # (k, k, 1, c) -> (k*k, c), row-major like patch_index
        params[names[0]], params[names[1]] = kernel, bias
    return params


def layer_names(model: Any, loss: str) -> dict[str, str]:
    """Built-in tensor name -> the Keras layer holding it."""
    return {name: layer.name for layer, names in _walk(model, loss) for name in names}


def save_keras(model: Any, params: Params, stem: Path, loss: str = "cross_entropy") -> list[Path]:
    """Put ``params`` into the Keras model; save it as ``STEM.keras`` and a TFLite inference model
    ``STEM.tflite``; return both paths."""
    quiet_tensorflow()
    import tensorflow as tf

    for layer, names in _walk(model, loss):
        kernel, bias = (np.asarray(w) for w in layer.get_weights())
        layer.set_weights([params[names[0]].reshape(kernel.shape), params[names[1]].reshape(bias.shape)])
    keras_path, tflite_path = stem.with_suffix(".keras"), stem.with_suffix(".tflite")
    model.save(keras_path)
    with contextlib.redirect_stdout(io.StringIO()):  # the converter prints where it saved its temporary model
        tflite_path.write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())
    return [keras_path, tflite_path]
