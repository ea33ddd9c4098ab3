"""The server builds the devices' trainer with TensorFlow and exports it as TFLite.

Two stateless signatures, parameters passed in as inputs so that a device needs no
variables or checkpoints:

* ``loss_and_grads(<params>, x, y)`` -> ``loss`` and one gradient per parameter, for a
  batch of exactly ``batch_size`` rows (TensorFlow's gradients of broadcasting ops need
  shape arithmetic that TFLite's builtins lack when the batch is dynamic);
* ``predict(<params>, x)`` -> ``logits``, for any number of rows.

Only TFLite builtin ops: ReLU's gradient is written by hand (TF's ReluGrad does not
convert), and a convolution (the CNN's k x k patches, a Conv1D's runs of time steps) is a gather
of patches times a matrix (im2col), whose weight gradient is a matrix product (TF's
Conv2DBackpropFilter does not convert).
The arithmetic is learning.model's, so the two backends agree to float rounding.

Needs the ``tf`` extra (tensorflow-cpu); imported only when an artifact is built.
"""

from __future__ import annotations

import hashlib
from typing import Any

from learning.keras import quiet_tensorflow
from learning.model import Params, architecture, classes, convolution, dense_layers, model_features, pool_size
from schemas.artifact import ArtifactMeta, TensorSpec, encode_artifact


def _loss(tf: Any, name: str, z: Any, y: Any, outputs: int) -> Any:
    """The mean ``name`` loss (learning.losses) of outputs ``z`` against ``y``, in builtin ops."""
    if name == "cross_entropy":
        log_probs = z - tf.reduce_logsumexp(z, axis=1, keepdims=True)
        return -tf.reduce_mean(tf.reduce_sum(tf.one_hot(y, outputs) * log_probs, axis=1))
    value = tf.reshape(z, [-1])  # one output (a slice's gradient, StridedSliceGrad, is not a builtin)
    if name == "bce":  # log(1 + e^-|z|) + max(z, 0) - z y
        return tf.reduce_mean(tf.math.log(1.0 + tf.exp(-tf.abs(value))) + tf.maximum(value, 0.0) - value * y)
    error = value - y
    return tf.reduce_mean(error * error) if name == "mse" else tf.reduce_mean(tf.abs(error))


def build_tflite(params: Params, batch_size: int, loss: str = "cross_entropy", features: int | None = None) -> bytes:
    """The ``.tflite`` flatbuffer of the trainer for parameters shaped like ``params``, training ``loss``
    on rows of ``features`` values (default: what the shapes say; a pooled Conv1D needs it)."""
    quiet_tensorflow()
    import tensorflow as tf

    names = list(params)
    features = model_features(params, features)
    outputs = classes(params)
    layers = dense_layers(params)
    cnn = architecture(params) != "mlp"  # a convolution first: over a square image or a time window
    if cnn:
        table, conv = convolution(params, features)
        index = tf.constant(table)
        positions, patch = table.shape
        channels = params[f"{conv}.w"].shape[-1]
        pool = pool_size(params, features)

    @tf.custom_gradient
    def relu(h: Any) -> Any:
        def grad(upstream: Any) -> Any:
            return upstream * tf.cast(h > 0, tf.float32)

        return tf.maximum(h, 0.0), grad

    def logits(p: dict[str, Any], x: Any) -> Any:
        h = x
        if cnn:
            patches = tf.reshape(tf.gather(x, index, axis=1), [-1, patch])
            kernel = tf.reshape(p[f"{conv}.w"], [patch, channels])
            out = relu(tf.reshape(tf.matmul(patches, kernel), [-1, positions, channels]) + p[f"{conv}.b"])
            if pool > 1:  # max pooling: the largest of each run of ``pool`` positions
                out = tf.reduce_max(tf.reshape(out, [-1, positions // pool, pool, channels]), axis=2)
            h = tf.reshape(out, [-1, (positions // pool) * channels])
        for i in range(layers):
            h = tf.matmul(h, p[f"dense{i}.w"]) + p[f"dense{i}.b"]
            if i < layers - 1:
                h = relu(h)
        return h

    specs = [tf.TensorSpec(params[n].shape, tf.float32, name=n.replace(".", "_")) for n in names]
    train_x = tf.TensorSpec([batch_size, features], tf.float32, name="x")
    train_y = tf.TensorSpec([batch_size], tf.int32 if loss == "cross_entropy" else tf.float32, name="y")
    any_x = tf.TensorSpec([None, features], tf.float32, name="x")

    class Trainer(tf.Module):  # type: ignore[misc]  # TensorFlow is untyped
        @tf.function(input_signature=[*specs, train_x, train_y])
        def loss_and_grads(self, *args: Any) -> dict[str, Any]:
            p, x, y = dict(zip(names, args[:-2], strict=True)), args[-2], args[-1]
            with tf.GradientTape() as tape:
                tape.watch(list(p.values()))
                value = _loss(tf, loss, logits(p, x), y, outputs)
            grads = tape.gradient(value, [p[n] for n in names])
            return {"loss": value, **{n.replace(".", "_"): g for n, g in zip(names, grads, strict=True)}}

        @tf.function(input_signature=[*specs, any_x])
        def predict(self, *args: Any) -> dict[str, Any]:
            return {"logits": logits(dict(zip(names, args[:-1], strict=True)), args[-1])}

    module = Trainer()
    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [module.loss_and_grads.get_concrete_function(), module.predict.get_concrete_function()], module
    )
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]  # no Flex: a plain runtime runs it
    flatbuffer: bytes = converter.convert()
    return flatbuffer


def build_artifact(
    params: Params, batch_size: int, version: int = 1, loss: str = "cross_entropy", features: int | None = None
) -> bytes:
    """The artifact payload for ``edgeps/{job}/model``: metadata and the verified flatbuffer."""
    import tensorflow as tf

    features = model_features(params, features)
    tflite = build_tflite(params, batch_size, loss, features)
    meta = ArtifactMeta(
        arch=architecture(params),
        version=version,
        params=[TensorSpec(name=n, shape=tuple(int(d) for d in v.shape)) for n, v in params.items()],
        features=features,
        classes=classes(params),
        loss=loss,
        batch_size=batch_size,
        sha256=hashlib.sha256(tflite).hexdigest(),
        size=len(tflite),
        built_with=f"tensorflow {tf.__version__}",
    )
    return encode_artifact(meta, tflite)
